"""Metric states no larger than their value needs: ``coverage@k`` keeps one mask over the catalogue per rank, however
many queries it sees, with the values of the distinct rows it kept per batch before (the old computation, written out
here); AUC and grouped AUC keep float32 predictions as float32 and labels as one byte, with the values of float64
rows, and copy a batch's predictions rather than hold a view of the model's whole output."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.metrics.classification import AUC, GroupedAUC
from recsys_runner.metrics.corpus import CoverageAtK
from recsys_runner.metrics.functional import binary_auc, grouped_auc
from recsys_runner.metrics.retrieval import Ranked
from recsys_runner.metrics.tasks import grouping_ids


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


def test_auc_and_gauc_keep_five_and_thirteen_bytes_a_row_with_the_values_of_float64_rows() -> None:
    g = torch.Generator().manual_seed(5)
    outputs = torch.randn(3000, 3, generator=g)  # a three-task model's output: each task reads one column
    preds = torch.sigmoid((outputs * 4).round() / 4)  # float32, with ties
    labels, groups = (torch.rand(3000, generator=g) < preds[:, 1]).float(), torch.randint(0, 300, (3000,), generator=g)
    auc, gauc = AUC(), GroupedAUC()
    for rows in (slice(0, 1000), slice(1000, 3000)):
        auc.update(preds[rows, 1], labels[rows])
        gauc.update(preds[rows, 1], labels[rows], groups=groups[rows])
    kept = [t for m in (auc, gauc) for name in m._defaults for t in getattr(m, name)]
    assert sum(t.untyped_storage().nbytes() for t in kept) == 3000 * (4 + 1) + 3000 * (4 + 1 + 8)  # no view of [B, 3]
    assert {t.dtype for t in auc.preds} == {torch.float32} and {t.dtype for t in auc.labels} == {torch.bool}
    rows64 = preds[:, 1].double(), labels.double()
    assert torch.equal(auc.compute(), binary_auc(*rows64))
    assert torch.equal(gauc.compute(), grouped_auc(*rows64, groups))


def test_multiclass_auc_keeps_class_indices() -> None:
    probs = torch.softmax(torch.tensor([[2.0, 0.1, 0.3], [0.2, 1.5, 0.1], [0.3, 0.2, 1.1], [1.0, 1.2, 0.1]]), dim=1)
    auc = AUC()
    auc.update(probs, torch.tensor([0.0, 1, 2, 1]))
    assert auc.labels[0].dtype == torch.long and float(auc.compute()) == 1.0


def test_gauc_copies_the_runner_s_group_ids_out_of_the_batch_s_sparse_ids() -> None:
    batch = 512
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(26)], values=torch.randint(0, 1000, (26 * batch,)),
                                                 lengths=torch.ones(26 * batch, dtype=torch.int32))
    groups = grouping_ids(sparse, "f3")
    assert groups.untyped_storage().nbytes() == 26 * batch * 8  # a view of every feature's ids: what must not be kept
    gauc = GroupedAUC()
    gauc.update(torch.rand(batch), (torch.rand(batch) < 0.5).float(), groups=groups)
    assert gauc.groups[0].untyped_storage().nbytes() == batch * 8 and torch.equal(gauc.groups[0], groups)


def test_kept_rows_are_merged_every_64_batches_in_order() -> None:
    g = torch.Generator().manual_seed(9)
    preds, labels, groups = torch.rand(200 * 16, generator=g), (torch.rand(200 * 16, generator=g) < 0.3).float(), torch.arange(200 * 16) % 37
    gauc = GroupedAUC()
    for b in range(200):
        rows = slice(16 * b, 16 * (b + 1))
        gauc.update(preds[rows], labels[rows], groups=groups[rows])
    assert [len(gauc.preds), len(gauc.labels), len(gauc.groups)] == [3 + 8] * 3  # three merged pieces of 64 and 8 batches
    assert torch.equal(torch.cat(gauc.preds), preds) and torch.equal(torch.cat(gauc.groups), groups)
    assert torch.equal(gauc.compute(), grouped_auc(preds.double(), labels.double(), groups))
    gauc.reset()
    for _ in range(70):
        gauc.update(preds[:16], labels[:16], groups=groups[:16])
    assert len(gauc.preds) == 1 + 6  # counted afresh after the reset
