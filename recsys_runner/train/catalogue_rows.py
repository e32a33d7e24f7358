"""Item ids → catalogue rows: the lookup the full-corpus eval (:mod:`recsys_runner.train.corpus`) and ``predict``'s
two-tower top-k (``scoring_topk.py``) share to find a query's target and seen items among the item table's rows.

:class:`RowOf` copies the table's ids out of their (possibly read-only) Arrow view once, sorted, and maps a batch's ids
by binary search; :func:`seen_rows` reads a query's seen-item features through it.
"""

from __future__ import annotations

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.data.catalogue.items import ItemTable

__all__ = ["RowOf", "seen_rows"]


def seen_rows(sparse: KeyedJaggedTensor, names: list[str], rows: RowOf) -> torch.Tensor:
    """``[Q, L]`` each query's seen items as catalogue rows (features ``names`` concatenated, ``-1`` padding and for an
    id not in the catalogue).

    Public because the corpus eval (exclude-seen masks, sampled negatives) and ``predict``'s two-tower top-k
    (``scoring_topk.py``) must read a query's seen items identically: one function, not two copies that drift."""
    parts = []
    for name in names:
        jagged = sparse[name]
        width = max(int(jagged.lengths().max()) if jagged.lengths().numel() else 0, 1)
        parts.append(jagged.to_padded_dense(desired_length=width, padding_value=-1).long())
    ids = torch.cat(parts, dim=1)
    return torch.where(ids >= 0, rows(ids.clamp_min(0)), torch.full_like(ids, -1))


class RowOf:
    """Maps item ids to their table rows (``-1`` for an id not in the catalogue), on ``device``.

    Public for the same reason as :func:`seen_rows`: the corpus eval and ``predict``'s two-tower top-k map a batch's item
    ids to catalogue rows with this one class."""

    def __init__(self, table: ItemTable, device: torch.device) -> None:
        ids = torch.tensor(np.asarray(table.ids, dtype=np.int64), device=device)  # a copy: the ids may be a read-only Arrow view
        self.sorted_ids, self.order = ids.sort()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.sorted_ids.numel() == 0:
            return torch.full_like(ids, -1)
        at = torch.searchsorted(self.sorted_ids, ids.long()).clamp_max(self.sorted_ids.numel() - 1)
        return torch.where(self.sorted_ids[at] == ids, self.order[at], torch.full_like(at, -1))
