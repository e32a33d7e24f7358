"""AUC and grouped AUC over several ranks without gathering their rows: each rank ends up holding about its share.

Why: the gather of :mod:`recsys_runner.metrics.state` copies every rank's kept rows onto every rank, which then sorts
the union — each rank's memory grows with world size × rows, and the largest rank is the one that runs out (8 GPUs,
50M eval rows; docs/performance.md, "At scale"). Here the rows are *routed* instead (a sample sort):

1. every rank sends a summary of its rows (:func:`_header`: dtype, dimensions, rows, NaN predictions) to all; any NaN
   makes the value NaN at once, as it does on one process, and no row moves;
2. :func:`splitters`: ``world − 1`` keys cutting the union into ranges of about equal rows, from an all-gathered
   sample of each rank's sorted keys (at most :data:`SAMPLES` per rank, each weighted by the rows it stands for);
3. :func:`route`: every row goes to the rank whose range ``(s[r−1], s[r]]`` holds its key, by ``all_to_all``;
   equal keys land on one rank, so a tie of predictions, or a group, never straddles two;
4. each rank computes on its own range, and only a summary travels back: for AUC three int64 sums
   (:func:`auc_over_ranks`), for grouped AUC each valid group's ``(auc, weight)`` (:func:`grouped_auc_over_ranks`).

Exact, to the bit: the rank sums are integers (:func:`~recsys_runner.metrics.functional.rank_sums`), shifted by the
rows of the lower ranges and added over ranks, then passed through the same float arithmetic one process uses; grouped
AUC's terms arrive in ascending group order, the vector one process sums. A rank receives at most its share of the rows,
plus the largest tie (AUC) or group (grouped AUC) at a range's edge, plus the sample's slack (one sample's rows per
rank; none while a rank holds at most :data:`SAMPLES` rows).

Only binary AUC and grouped AUC go this way (:meth:`~recsys_runner.metrics.state.Metric._compute_sharded`); multi-class
macro AUC, XAUC and coverage@k still gather, and sum states all-reduce. Every function here is collective: all ranks
call it in the same order (a rank with no rows joins with none) and all return the same value. The collectives run on
the rows' device (the metric's), so on the process group's backend: gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from recsys_runner.metrics.functional import (
    auc_from_rank_sums,
    check_weighting,
    group_terms,
    grouped_auc_parts,
    rank_sums,
    weighted_mean,
)

__all__ = ["SAMPLES", "auc_over_ranks", "grouped_auc_over_ranks", "route", "splitters"]

SAMPLES = 4096
"""Keys each rank contributes to the splitters' sample (``world × SAMPLES`` keys gathered: 256 KB of float64 at 8
ranks). A range's rows stray from an even share by at most one sample's worth per rank, ``rows / SAMPLES``."""

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
"""The prediction dtypes, by their code in :func:`_header` (AUC's kept predictions are floating:
:func:`~recsys_runner.metrics.classification.ranked_preds`)."""


def auc_over_ranks(preds: Tensor, labels: Tensor) -> Tensor | None:
    """:func:`~recsys_runner.metrics.functional.binary_auc` of all ranks' rows together, this rank's given; ``None``
    (on every rank alike) when some rank holds class probabilities ``[B, C]`` (macro AUC: the caller gathers).

    Routed by prediction; each rank's doubled rank sum of positives is shifted by twice the rows of the lower ranges
    per positive, and the three int64 sums (doubled rank sum, positives, rows) are all-reduced (NaN predictions were
    counted before: any makes the value NaN, as on one process)."""
    world = dist.get_world_size()
    table = _header(preds)
    if any(row[1] > 1 for row in table):
        return None
    nan_rows, rows = sum(row[3] for row in table), sum(row[2] for row in table)
    if nan_rows or not rows:  # NaN as one process gives it (a NaN prediction, or no rows), and nothing routed
        return torch.tensor(torch.nan, dtype=torch.float64, device=preds.device)
    keys = _common_dtype(preds.flatten(), table)
    mine, (positive,), received = route(keys, [labels.flatten() >= 0.5], world)
    offset = sum(received[:dist.get_rank()])
    doubled, num_pos, num_rows, _ = rank_sums(mine, positive)
    totals = torch.stack([(doubled + 2 * offset * num_pos).sum(), num_pos.sum(), num_rows.sum()])
    dist.all_reduce(totals)
    auc, _, _ = auc_from_rank_sums(totals[0:1], totals[1:2], totals[2:3], torch.zeros(1, dtype=torch.bool, device=totals.device))
    return auc[0]


def grouped_auc_over_ranks(preds: Tensor, labels: Tensor, groups: Tensor, weighting: str) -> Tensor:
    """:func:`~recsys_runner.metrics.functional.grouped_auc` of all ranks' rows together, this rank's given.

    Routed by group id: every group's rows meet on one rank, which computes the group's AUC as one process would;
    the valid groups' ``(auc, weight)`` are gathered in rank order (ascending group ranges), and summed as one process
    sums them."""
    check_weighting(weighting)
    world = dist.get_world_size()
    table = _header(preds)
    if sum(row[3] for row in table):  # a NaN prediction anywhere: NaN, as on one process
        return torch.tensor(torch.nan, dtype=torch.float64, device=preds.device)
    if not sum(row[2] for row in table):
        return torch.tensor(torch.nan, dtype=torch.float64, device=preds.device)
    keys = groups.flatten().long()
    mine, (mine_preds, positive), _ = route(keys, [_common_dtype(preds.flatten(), table), labels.flatten() >= 0.5], world)
    aucs, weights = group_terms(*grouped_auc_parts(mine_preds, positive, mine), weighting)
    del mine, mine_preds, positive
    return weighted_mean(_gathered(aucs), _gathered(weights))


def splitters(ordered: Tensor, world: int) -> Tensor:
    """``world − 1`` nondecreasing keys cutting all ranks' keys into ranges of about equal rows (collective), from this
    rank's keys sorted (``ordered``).

    Each rank offers the last key of each of ``min(rows, SAMPLES)`` equal chunks of its sorted keys, weighted by the
    chunk's rows; on the gathered sample, cut ``r`` is the first key at which the weights reach ``r / world`` of all
    rows. With every key sampled (a rank of at most :data:`SAMPLES` rows: chunks of one) the cuts are the union's exact
    quantiles, and a range holds at most ``⌈rows / world⌉`` rows plus the tie at its upper cut."""
    n = ordered.numel()
    k = min(n, SAMPLES)
    ends = torch.arange(1, k + 1, device=ordered.device) * n // max(k, 1)
    values = torch.zeros(SAMPLES, dtype=ordered.dtype, device=ordered.device)
    weights = torch.zeros(SAMPLES, dtype=torch.long, device=ordered.device)
    if k:
        values[:k] = ordered[ends - 1]
        weights[:k] = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    all_values = [torch.empty_like(values) for _ in range(world)]
    all_weights = [torch.empty_like(weights) for _ in range(world)]
    dist.all_gather(all_values, values)
    dist.all_gather(all_weights, weights)
    sample, weight = torch.cat(all_values), torch.cat(all_weights)
    kept = weight > 0
    sample, order = torch.sort(sample[kept])
    reached = torch.cumsum(weight[kept][order], 0)  # rows at or below each sampled key
    targets = torch.arange(1, world, device=ordered.device) * reached[-1]  # r · rows, against reached · world: integers
    return sample[torch.searchsorted(reached * world, targets).clamp_max(sample.numel() - 1)]


def route(keys: Tensor, payload: Sequence[Tensor], world: int) -> tuple[Tensor, list[Tensor], list[int]]:
    """Every row to the rank whose range ``(cuts[r−1], cuts[r]]`` of :func:`splitters` holds its key (collective; one
    ``all_to_all`` per column): ``(this rank's keys, its payload columns, rows received by each rank)``, the keys of rank
    ``r`` all above those of the ranks below it. Equal keys always go to one rank.

    One sort of this rank's keys serves both the sample and the sends (each destination's rows are then one contiguous
    slice): no per-row destination or second permutation, so that routing holds little beyond the rows themselves."""
    ordered, order = torch.sort(keys)
    payload = [column[order] for column in payload]
    del order
    cuts = splitters(ordered, world)
    bounds = torch.searchsorted(ordered, cuts, right=True).tolist()  # rows at or below each cut
    send_sizes = [b - a for a, b in zip([0, *bounds], [*bounds, ordered.numel()], strict=True)]
    table = [torch.empty(world, dtype=torch.long, device=keys.device) for _ in range(world)]
    dist.all_gather(table, torch.tensor(send_sizes, dtype=torch.long, device=keys.device))
    rank = dist.get_rank()
    receive_sizes = [int(t[rank]) for t in table]
    received = [int(sum(int(t[r]) for t in table)) for r in range(world)]
    columns = [_exchanged(ordered, receive_sizes, send_sizes)]
    del ordered
    while payload:
        columns.append(_exchanged(payload.pop(0), receive_sizes, send_sizes))
    return columns[0], columns[1:], received


def _exchanged(column: Tensor, receive_sizes: list[int], send_sizes: list[int]) -> Tensor:
    """``column``'s slices of ``send_sizes`` rows sent to the ranks in turn, and what they sent this rank (collective)."""
    wire = column.view(torch.uint8) if column.dtype == torch.bool else column  # as bytes: NCCL has no bool
    out = torch.empty(sum(receive_sizes), dtype=wire.dtype, device=wire.device)
    dist.all_to_all_single(out, wire, receive_sizes, send_sizes)
    return out.view(torch.bool) if column.dtype == torch.bool else out


def _header(preds: Tensor) -> list[list[int]]:
    """Every rank's ``[prediction dtype code (−1: no rows), prediction dimensions, rows, NaN predictions]``
    (collective, on the predictions' device)."""
    rows = preds.shape[0] if preds.dim() else 1
    code = _FLOATS.index(preds.dtype) if rows and preds.dtype in _FLOATS else -1
    nan = int(torch.isnan(preds).sum()) if preds.is_floating_point() else 0
    mine = torch.tensor([code, preds.dim() if rows else 0, rows, nan], dtype=torch.long, device=preds.device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(table, mine)
    return [t.tolist() for t in table]


def _common_dtype(preds: Tensor, table: list[list[int]]) -> Tensor:
    """``preds`` in the one dtype all ranks route (a rank without rows takes the others'; ranks' float dtypes that
    differ meet in the wider, an exact conversion: no order or tie changes)."""
    dtype = None
    for code, *_ in table:
        if code >= 0:
            dtype = _FLOATS[code] if dtype is None else torch.promote_types(dtype, _FLOATS[code])
    if dtype is None:
        raise ValueError(f"AUC predictions must be floating point on every rank, got {preds.dtype} here")
    return preds.to(dtype)


def _gathered(values: Tensor) -> Tensor:
    """Every rank's ``values`` (1-D, any length) concatenated in rank order (collective): a summary of groups, not rows."""
    world = dist.get_world_size()
    size = torch.tensor([values.numel()], dtype=torch.long, device=values.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    counts = [int(s) for s in sizes]
    padded = torch.zeros(max(counts), dtype=values.dtype, device=values.device)
    padded[:values.numel()] = values
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)])
