"""AUC and grouped AUC by stable sorts (``metrics/functional.py``): the same values, to the last bit, as the
``torch.unique(..., dim=0)`` formulation they replaced (kept here as the reference), and as brute force over the
pairs, on inputs full of ties and tiny groups; independent of row order and of float32 vs float64 predictions; NaN
where a prediction is NaN (the old formulation's sort returned an arbitrary value there)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor

from recsys_runner.metrics.classification import AUC, GroupedAUC
from recsys_runner.metrics.functional import binary_auc, grouped_auc, grouped_auc_parts


def unique_pairs_parts(preds: Tensor, labels: Tensor, groups: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The formulation before the sorts, verbatim: ``torch.unique`` over ``(group, pred)`` pairs."""
    preds, positive = preds.detach().double().flatten(), (labels.detach().flatten() >= 0.5).double()
    group_idx = torch.unique(groups.flatten(), return_inverse=True)[1]
    num_groups = int(group_idx.max()) + 1 if group_idx.numel() else 0
    pairs, row_to_pair, pair_counts = torch.unique(
        torch.stack([group_idx.double(), preds], dim=1), dim=0, return_inverse=True, return_counts=True
    )
    pair_group = pairs[:, 0].long()
    group_sizes = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_idx, torch.ones_like(preds))
    group_start = torch.cumsum(group_sizes, 0) - group_sizes
    rows_before = torch.cumsum(pair_counts, 0) - pair_counts
    pair_rank = rows_before.double() - group_start[pair_group] + (pair_counts.double() + 1) / 2
    row_rank = pair_rank[row_to_pair]
    num_pos = torch.zeros_like(group_sizes).index_add_(0, group_idx, positive)
    num_neg = group_sizes - num_pos
    rank_sum = torch.zeros_like(group_sizes).index_add_(0, group_idx, row_rank * positive)
    auc = (rank_sum - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)
    return torch.where((num_pos > 0) & (num_neg > 0), auc, torch.nan), num_pos, num_neg


def pairwise(preds: list[float], labels: list[float]) -> float:
    """Brute force: over (positive, negative) pairs, 1 if the positive scores higher, ½ on a tie; NaN with one class."""
    scores = [1.0 if p > q else 0.5 if p == q else 0.0
              for (p, y), (q, z) in itertools.product(zip(preds, labels, strict=True), repeat=2) if y >= 0.5 > z]
    return sum(scores) / len(scores) if scores else math.nan


def tied_rows(seed: int, n: int, levels: int, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """``n`` rows whose predictions take ``levels`` values (many ties, ``-0.0`` and ``0.0`` among them) in
    ``num_groups`` sparse group ids (many groups of one to three rows, some of one class)."""
    g = torch.Generator().manual_seed(seed)
    preds = torch.randint(0, levels, (n,), generator=g).double() / levels
    preds[torch.rand(n, generator=g) < 0.1] = -0.0
    labels = (torch.rand(n, generator=g) < 0.2 + 0.6 * preds).double()
    groups = torch.randint(0, num_groups, (n,), generator=g) * 1009 - 5000
    return preds, labels, groups


@pytest.mark.parametrize("seed", range(12))
def test_sorted_runs_equal_the_unique_pairs_formulation_to_the_last_bit(seed: int) -> None:
    n, levels, num_groups = [(40, 3, 25), (200, 5, 90), (500, 50, 8), (1, 1, 1)][seed % 4]
    preds, labels, groups = tied_rows(seed, n, levels, num_groups)
    for got, want in zip(grouped_auc_parts(preds, labels, groups), unique_pairs_parts(preds, labels, groups), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    one = torch.zeros_like(groups)
    torch.testing.assert_close(binary_auc(preds, labels), unique_pairs_parts(preds, labels, one)[0][0], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("seed", range(6))
def test_each_group_s_auc_is_the_brute_force_over_its_pairs(seed: int) -> None:
    preds, labels, groups = tied_rows(100 + seed, 60, 4, 15)
    auc, num_pos, num_neg = grouped_auc_parts(preds, labels, groups)
    ids = groups.unique().tolist()  # the groups, ascending
    assert len(auc) == len(ids)
    for i, k in enumerate(ids):
        sel = groups == k
        want = pairwise(preds[sel].tolist(), labels[sel].tolist())
        assert (math.isnan(want) and math.isnan(auc[i])) or float(auc[i]) == pytest.approx(want, abs=1e-12), (k, want)
        assert (num_pos[i], num_neg[i]) == (labels[sel].sum(), (1 - labels[sel]).sum())
    valid = [(float(auc[i]), int((groups == k).sum())) for i, k in enumerate(ids) if not math.isnan(auc[i])]
    assert float(grouped_auc(preds, labels, groups)) == pytest.approx(sum(a * w for a, w in valid) / sum(w for _, w in valid))
    assert float(grouped_auc(preds, labels, groups, "uniform")) == pytest.approx(sum(a for a, _ in valid) / len(valid))
    assert float(binary_auc(preds, labels)) == pytest.approx(pairwise(preds.tolist(), labels.tolist()), abs=1e-12)


def test_row_order_and_float32_predictions_change_no_bit() -> None:
    preds, labels, groups = tied_rows(7, 3000, 20, 300)
    shuffle = torch.randperm(3000, generator=torch.Generator().manual_seed(1))
    want = grouped_auc(preds, labels, groups)
    assert torch.equal(grouped_auc(preds[shuffle], labels[shuffle], groups[shuffle]), want)
    assert torch.equal(grouped_auc(preds.float(), labels, groups), want)  # levels/20 is not a float32; still its order
    assert torch.equal(grouped_auc(preds.float(), labels, groups), grouped_auc(preds.float().double(), labels, groups))
    assert torch.equal(binary_auc(preds[shuffle], labels[shuffle]), binary_auc(preds, labels))


def test_ranks_stay_exact_past_a_million_rows_of_one_tie() -> None:
    preds, labels = torch.full((1_200_000,), 0.25, dtype=torch.float32), torch.arange(1_200_000) % 3 == 0
    assert float(binary_auc(preds, labels)) == 0.5
    assert float(grouped_auc(preds, labels.double(), torch.arange(1_200_000) % 7)) == 0.5


def test_infinities_rank_as_numbers_and_a_nan_prediction_makes_the_value_nan() -> None:
    inf = math.inf
    assert float(binary_auc(torch.tensor([inf, -inf, 0.5, inf]), torch.tensor([1.0, 0, 1, 0]))) == pytest.approx(0.625)
    preds, labels, groups = torch.tensor([0.1, math.nan, 0.3, 0.2]), torch.tensor([1.0, 0, 1, 0]), torch.tensor([1, 1, 2, 2])
    assert math.isnan(float(binary_auc(preds, labels)))
    auc, _, _ = grouped_auc_parts(preds, labels, groups)
    assert math.isnan(float(auc[0])) and float(auc[1]) == 1.0  # only the group holding the NaN
    # a group quietly dropped would leave gauc at group 2's 1.0: a diverged model's rows must show, not vanish
    assert math.isnan(float(grouped_auc(preds, labels, groups)))


def test_no_rows_is_nan_and_the_metric_classes_use_the_same_math() -> None:
    assert math.isnan(float(binary_auc(torch.zeros(0), torch.zeros(0))))
    assert math.isnan(float(grouped_auc(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long))))
    preds, labels, groups = tied_rows(3, 400, 6, 40)
    auc, gauc = AUC(), GroupedAUC()
    for rows in (slice(0, 150), slice(150, 400)):
        auc.update(preds[rows], labels[rows])
        gauc.update(preds[rows], labels[rows], groups=groups[rows])
    assert torch.equal(auc.compute(), unique_pairs_parts(preds, labels, torch.zeros_like(groups))[0][0])
    assert torch.equal(gauc.compute(), grouped_auc(preds, labels, groups))
