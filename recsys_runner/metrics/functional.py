"""Closed-form metric math on one process's rows (or the gathered union's): pure functions of tensors.

The metric classes (:mod:`recsys_runner.metrics.classification`, :mod:`~recsys_runner.metrics.decay`) keep
states and synchronize them across ranks; every value they report is one of these functions applied to
those states.
"""

from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-7
"""Probabilities are clamped to ``[EPS, 1 − EPS]`` before a logarithm (log loss, NE)."""


def grouped_auc_parts(preds: Tensor, labels: Tensor, groups: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group AUC with tied predictions counted as half: ``(auc [G], positives [G], negatives [G])``.

    The Mann–Whitney form: within a group, ``auc = (Σ_pos rank − P(P+1)/2) / (P·N)`` with ranks
    ascending and averaged over ties. Groups are the distinct values of ``groups`` in ascending
    order; a group without both classes has ``auc`` NaN. ``labels`` count as positive when ``≥ 0.5``.
    """
    preds, positive = preds.detach().double().flatten(), (labels.detach().flatten() >= 0.5).double()
    group_idx = torch.unique(groups.flatten(), return_inverse=True)[1]
    num_groups = int(group_idx.max()) + 1 if group_idx.numel() else 0
    # Sorting (group, pred) pairs lexicographically gives each distinct pair its run of rows.
    pairs, row_to_pair, pair_counts = torch.unique(
        torch.stack([group_idx.double(), preds], dim=1), dim=0, return_inverse=True, return_counts=True
    )
    pair_group = pairs[:, 0].long()
    group_sizes = torch.zeros(num_groups, dtype=torch.float64, device=preds.device).index_add_(0, group_idx, torch.ones_like(preds))
    group_start = torch.cumsum(group_sizes, 0) - group_sizes
    rows_before = torch.cumsum(pair_counts, 0) - pair_counts
    pair_rank = rows_before.double() - group_start[pair_group] + (pair_counts.double() + 1) / 2
    row_rank = pair_rank[row_to_pair]
    num_pos = torch.zeros_like(group_sizes).index_add_(0, group_idx, positive)
    num_neg = group_sizes - num_pos
    rank_sum = torch.zeros_like(group_sizes).index_add_(0, group_idx, row_rank * positive)
    auc = (rank_sum - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)
    return torch.where((num_pos > 0) & (num_neg > 0), auc, torch.nan), num_pos, num_neg


def binary_auc(preds: Tensor, labels: Tensor) -> Tensor:
    """ROC AUC: the probability that a random positive outranks a random negative (ties ½); NaN
    without both classes."""
    auc, _, _ = grouped_auc_parts(preds, labels, torch.zeros_like(labels, dtype=torch.long))
    return auc[0] if auc.numel() else torch.tensor(torch.nan, dtype=torch.float64)


def grouped_auc(preds: Tensor, labels: Tensor, groups: Tensor, weighting: str = "impressions") -> Tensor:
    """Mean of per-group AUCs over the groups that have both classes.

    ``weighting="impressions"`` weights each group by its number of rows (the GAUC of Zhou et al.
    2018, DIN); ``"uniform"`` gives every group the same weight. NaN when no group has both classes.
    """
    if weighting not in ("impressions", "uniform"):
        raise ValueError(f"grouped AUC weighting must be 'impressions' or 'uniform', got {weighting!r}")
    auc, num_pos, num_neg = grouped_auc_parts(preds, labels, groups)
    valid = ~torch.isnan(auc)
    weights = (num_pos + num_neg) if weighting == "impressions" else torch.ones_like(auc)
    weights = weights[valid]
    if weights.numel() == 0:
        return torch.tensor(torch.nan, dtype=torch.float64, device=preds.device)
    return (auc[valid] * weights).sum() / weights.sum()


def xauc(preds: Tensor, targets: Tensor, max_pairs: int = 1 << 22, seed: int = 0) -> Tensor:
    """Pairwise ordering accuracy for real-valued targets (e.g. watch time).

    Over pairs ``(i, j)`` whose targets differ: 1 when the predictions are ordered like the targets,
    ½ when the predictions tie, 0 otherwise; the mean of that. Exact (all ``n(n−1)/2`` pairs) while
    that count is at most ``max_pairs``; above it, ``max_pairs`` pairs drawn uniformly with a
    generator seeded by ``seed``. The rows are first sorted by ``(target, pred)``, so the sampled
    value depends only on the multiset of rows, not on their order (nor on which rank held them).
    NaN when no pair has distinct targets.
    """
    p, t = preds.detach().double().flatten(), targets.detach().double().flatten()
    order = torch.argsort(p, stable=True)
    order = order[torch.argsort(t[order], stable=True)]
    p, t = p[order], t[order]
    n = p.numel()
    if n * (n - 1) // 2 <= max_pairs:
        score, valid = torch.zeros((), dtype=torch.float64, device=p.device), torch.zeros((), dtype=torch.float64, device=p.device)
        chunk = max(1, (1 << 22) // max(n, 1))
        cols = torch.arange(n, device=p.device)
        for start in range(0, n, chunk):
            rows = torch.arange(start, min(start + chunk, n), device=p.device)
            upper = cols.unsqueeze(0) > rows.unsqueeze(1)
            s, v = _pair_scores(p[rows].unsqueeze(1), p.unsqueeze(0), t[rows].unsqueeze(1), t.unsqueeze(0), upper)
            score, valid = score + s, valid + v
    else:
        g = torch.Generator(device="cpu").manual_seed(seed)
        i = torch.randint(n, (max_pairs,), generator=g).to(p.device)
        j = torch.randint(n - 1, (max_pairs,), generator=g).to(p.device)
        j = j + (j >= i).long()  # uniform over j != i
        score, valid = _pair_scores(p[i], p[j], t[i], t[j], None)
    return score / valid if valid > 0 else torch.tensor(torch.nan, dtype=torch.float64, device=p.device)


def _pair_scores(pi: Tensor, pj: Tensor, ti: Tensor, tj: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Sum of pair scores (1 concordant, ½ prediction tie) and count of pairs with distinct targets.

    With ``s = sign(Δpred)·sign(Δtarget)`` a valid pair scores ``(s + 1) / 2``; pairs with equal
    targets have ``sign(Δtarget) = 0`` and drop out of both sums.
    """
    target_sign = torch.sign(tj - ti).to(torch.int8)
    products = torch.sign(pj - pi).to(torch.int8) * target_sign
    if mask is not None:
        products, target_sign = products * mask, target_sign * mask
    valid = target_sign.abs().sum(dtype=torch.float64)
    return 0.5 * (products.sum(dtype=torch.float64) + valid), valid


def binary_entropy(p: Tensor) -> Tensor:
    """``−(p log p + (1−p) log(1−p))`` in nats."""
    p = p.double()
    return -(torch.xlogy(p, p) + torch.xlogy(1 - p, 1 - p))


def histogram_auc(pos: Tensor, neg: Tensor) -> Tensor:
    """AUC of weighted rows binned by ascending score: ``Σ_b pos_b (neg_{<b} + ½ neg_b) / (Σpos · Σneg)``."""
    neg_below = torch.cumsum(neg, 0) - neg
    denominator = pos.sum() * neg.sum()
    return torch.where(denominator > 0, (pos * (neg_below + 0.5 * neg)).sum() / denominator, torch.nan)
