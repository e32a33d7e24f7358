"""Metric states whose size must not grow with the eval's rows where the value does not need them to: ``coverage@k``
keeps one mask over the catalogue per rank, however many queries it sees, with the values of the distinct rows it kept
per batch before (the old computation, written out here)."""

from __future__ import annotations

import pytest
import torch

from recsys_runner.metrics.corpus import CoverageAtK
from recsys_runner.metrics.retrieval import Ranked


def distinct_rows_coverage(tops: list[torch.Tensor], k: int, num_items: int) -> float:
    """The former computation: each batch's distinct top-``k`` rows (``-1`` padding dropped), all batches' distinct
    rows counted over the catalogue."""
    kept = [top[:, :k].reshape(-1).unique() for top in tops]
    rows = torch.cat([t[t >= 0] for t in kept])
    return rows.unique().numel() / num_items


@pytest.mark.parametrize("seed", range(4))
def test_coverage_keeps_one_catalogue_mask_and_counts_what_the_distinct_rows_counted(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    num_items, k = 5000, 7
    tops = []
    metric = CoverageAtK(k)
    for _ in range(30):
        top = (torch.rand(64, 10, generator=g) ** 4 * num_items).long()  # popular rows first, as a model retrieves them
        top[torch.rand(64, 10, generator=g) < 0.1] = -1  # an approximate search's padding of a short list
        tops.append(top)
        metric.update(Ranked(torch.zeros(64), top, num_items))
    assert [t.shape for t in metric.covered] == [torch.Size([num_items])]  # not one tensor per batch
    assert float(metric.compute()) == distinct_rows_coverage(tops, k, num_items)
    assert 0 < float(metric.compute()) < 1


def test_coverage_from_full_table_scores_and_no_rows() -> None:
    assert float(CoverageAtK(2).compute()) == 0.0
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.2], [0.8, 0.7, 0.0, 0.1], [0.2, 0.1, 0.3, 0.9]])
    metric = CoverageAtK(2)
    metric.update(scores[:2], torch.zeros(2))
    metric.update(scores[2:], torch.zeros(1))
    assert float(metric.compute()) == 1.0  # {0, 2} ∪ {0, 1} ∪ {3, 2}
    metric.reset()
    metric.update(Ranked(torch.zeros(0), torch.zeros(0, 2, dtype=torch.long), 4))  # a stand-in batch: no row
    assert float(metric.compute()) == 0.0
