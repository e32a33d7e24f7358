"""The chunked exact top ``k`` with ties broken by the lowest item row: one rule for every list a model serves.

``torch.topk`` picks among exactly tied scores as its algorithm happens to meet them, so a top ``k`` built chunk by
chunk (``predict``'s, the served model's, the corpus eval's top rows) would make another list out of the same scores
under another chunk size. Here each chunk gives its best ``k`` under the key (score descending, row ascending) and the
running top ``k`` is merged with it under the same key, so the list is the first ``k`` rows of that order, whatever
the chunking. A NaN score ranks above every other, as ``torch.topk`` and ``torch.sort`` place it.

Standalone (torch only): the served top-k model carries a copy in its ``code/`` (``recsys_top_k.py``,
:mod:`recsys_runner.serving.served_topk`), so that it breaks ties as ``predict`` does.

Shape legend: ``Q`` queries, ``C`` items of a chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chunk_top_k", "merge_top_k"]


def _above(scores: Tensor, kth: Tensor) -> Tensor:
    """``scores > kth`` with NaN above every number."""
    return (scores > kth) | (torch.isnan(scores) & ~torch.isnan(kth))


def _tied(scores: Tensor, kth: Tensor) -> Tensor:
    """``scores == kth`` with NaN equal to NaN."""
    return (scores == kth) | (torch.isnan(scores) & torch.isnan(kth))


def chunk_top_k(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``scores [Q, C]``' best ``min(k, C)`` columns per row under (score descending, column ascending): ``(values,
    columns)``, in that order.

    ``torch.topk`` of ``k + 1`` tells the rows whose ``k``-th and ``k + 1``-th scores tie (the only rows where which
    tied columns make the cut is topk's choice); those rows alone are reselected from the whole chunk, the tied
    columns taken lowest first. Every row then sorts its ``k`` by that key: ``Q × k`` work beside the chunk's topk."""
    q, c = scores.shape
    if c <= k:
        values, columns = scores, torch.arange(c, device=scores.device).expand(q, c)
    else:
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
    by_column = columns.argsort(dim=1)
    values, columns = values.gather(1, by_column), columns.gather(1, by_column)
    by_score = values.argsort(dim=1, descending=True, stable=True)
    return values.gather(1, by_score), columns.gather(1, by_score)


def merge_top_k(top_values: Tensor, top_rows: Tensor, values: Tensor, rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The best ``k`` of a running top (``top_values``, ``top_rows`` ``[Q, ≤k]``) and a later chunk's
    (:func:`chunk_top_k`, its ``rows`` all above the running ones), both in (score descending, row ascending) order:
    a stable sort by score keeps the running rows first among ties, so the result is in that order too."""
    merged_values, merged_rows = torch.cat([top_values, values], dim=1), torch.cat([top_rows, rows], dim=1)
    order = merged_values.argsort(dim=1, descending=True, stable=True)[:, :k]
    return merged_values.gather(1, order), merged_rows.gather(1, order)
