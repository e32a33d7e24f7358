"""The chunked exact top ``k`` with ties broken by the lowest item row: one rule for every list a model serves.

``torch.topk`` picks among exactly tied scores as its algorithm happens to meet them, so a top ``k`` built chunk by
chunk (``predict``'s, the served model's, the corpus eval's top rows) would make another list out of the same scores
under another chunk size. Here the list is the first ``k`` rows under the key (score descending, row ascending),
whatever the chunking: each chunk keeps its best ``k`` under that key (:func:`chunk_top_k`), the running top ``k`` is
merged with it under that key (:func:`merge_top_k`), and the final list's tied runs are put in row order
(:func:`in_order`). The key is needed only where ``topk`` would choose: a row whose ``k``-th and ``k + 1``-th scores
tie (one ``topk`` of ``k + 1`` instead of ``k`` tells), and, once at the end, a row whose list holds a tie; every other
row is ``topk``'s own answer, so lists without exact ties are what they were, bit for bit. A NaN score ranks above
every other, as ``torch.topk`` and ``torch.sort`` place it.

Standalone (torch only): the served top-k model carries a copy in its ``code/`` (``recsys_top_k_<hash>.py``,
:mod:`recsys_runner.serving.served_topk`), so that it breaks ties as ``predict`` does.

Shape legend: ``Q`` queries, ``C`` items of a chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chunk_top_k", "in_order", "merge_top_k"]


def _above(scores: Tensor, kth: Tensor) -> Tensor:
    """``scores > kth`` with NaN above every number."""
    return (scores > kth) | (torch.isnan(scores) & ~torch.isnan(kth))


def _tied(scores: Tensor, kth: Tensor) -> Tensor:
    """``scores == kth`` with NaN equal to NaN."""
    return (scores == kth) | (torch.isnan(scores) & torch.isnan(kth))


def chunk_top_k(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``scores [Q, C]``' best ``min(k, C)`` columns per row under (score descending, column ascending): ``(values,
    columns)``, in no particular order (:func:`merge_top_k` orders them).

    ``torch.topk`` of ``k + 1`` tells the rows whose ``k``-th and ``k + 1``-th scores tie (the only rows where which
    tied columns make the cut is topk's choice); those rows alone are reselected from the whole chunk, the tied
    columns taken lowest first."""
    q, c = scores.shape
    if c <= k:
        return scores, torch.arange(c, device=scores.device).expand(q, c)
    values, columns = scores.topk(k + 1, dim=1)
    cut = _tied(values[:, k - 1], values[:, k])
    values, columns = values[:, :k], columns[:, :k]
    if bool(cut.any()):
        rows = cut.nonzero().squeeze(1)
        chunk, kth = scores[rows], values[rows, k - 1:k]
        above, tied = _above(chunk, kth), _tied(chunk, kth)
        taken = above | (tied & (tied.long().cumsum(dim=1) <= k - above.sum(dim=1, keepdim=True)))
        picked = taken.nonzero()[:, 1].view(-1, k)  # row-major: each row's k columns, ascending
        columns = columns.index_put((rows,), picked)
        values = values.index_put((rows,), chunk.gather(1, picked))
    return values, columns


def merge_top_k(top_values: Tensor, top_rows: Tensor, values: Tensor, rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The best ``k`` of a running top (``top_values``, ``top_rows`` ``[Q, ≤k]``) and a chunk's (:func:`chunk_top_k`):
    ``(values, rows)``, by score descending, exact ties in no particular order until :func:`in_order`.

    As in :func:`chunk_top_k`, only a row whose ``k``-th and ``k + 1``-th merged scores tie is picked again, by the
    full key (:func:`_order`): which of its tied items stay must not be topk's choice, while the order of the ones
    kept is set once, at the end."""
    merged_values, merged_rows = torch.cat([top_values, values], dim=1), torch.cat([top_rows, rows], dim=1)
    width = merged_values.shape[1]
    keep = min(k, width)
    best, pick = merged_values.topk(min(keep + 1, width), dim=1)
    if width > keep:
        cut = _tied(best[:, keep - 1], best[:, keep])
        pick = pick[:, :keep]
        if bool(cut.any()):
            again = cut.nonzero().squeeze(1)
            pick = pick.index_put((again,), _order(merged_values[again], merged_rows[again], keep))
    return merged_values.gather(1, pick), merged_rows.gather(1, pick)


def in_order(values: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """A top list ``(values, rows)`` ``[Q, k]`` sorted by score (:func:`merge_top_k`'s) with each run of exactly tied
    scores put in row order: only rows that have such a run are ordered again (:func:`_order`)."""
    if values.shape[1] < 2:
        return values, rows
    tied = _tied(values[:, 1:], values[:, :-1]).any(dim=1)
    if not bool(tied.any()):
        return values, rows
    again = tied.nonzero().squeeze(1)
    order = _order(values[again], rows[again], values.shape[1])
    return (values.index_put((again,), values[again].gather(1, order)),
            rows.index_put((again,), rows[again].gather(1, order)))


def _order(values: Tensor, rows: Tensor, k: int) -> Tensor:
    """The places of the first ``k`` of ``values [Q, W]`` under (value descending, ``rows`` ascending).

    Scores that float32 holds exactly (float32, float16, bfloat16) become one int64 key each, the value's order-keeping
    bits above the row's complement, whose ``topk`` is that order (keys are distinct; a stable ``torch.sort`` on the CPU
    took over ten times a ``topk``'s time on ``[1024, 100]``). Others (float64) take two sorts."""
    if values.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        by_row = rows.argsort(dim=1)
        by_value = values.gather(1, by_row).argsort(dim=1, descending=True, stable=True)[:, :k]
        return by_row.gather(1, by_value)
    exact = values.float() + 0.0  # -0.0 becomes 0.0: equal scores, equal keys
    exact = torch.where(torch.isnan(exact), torch.full_like(exact, float("nan")), exact)  # one NaN, above +inf
    bits = exact.view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude, smaller key
    keys = ordered * (1 << 32) + ((1 << 32) - 1 - rows.long())
    return keys.topk(k, dim=1).indices
