"""The fixed-size pieces of SASRec's in-batch sampled softmax (:meth:`~recsys_runner.models.sasrec.SASRec.sampled_logits`):
how many positions a batch has, where they lie in the padded rows, and its distinct positives in a bounded number of
slots — every output sized by a count known on the host, never by device values.

Apart from :mod:`~recsys_runner.models.sasrec` because what they guard against is a concern of its own: selecting the
real positions by a mask, or the distinct positives by ``torch.unique``, sizes a tensor by device values, a
device-to-host sync in every training step (docs/performance.md). The model says what the softmax computes; these say
how to compute it without the sync. :func:`real_positions` and :func:`distinct_positives` are leaves of TorchRec's
pipeline trace (``torch.fx.wrap``), and a caller in another module registers them again by name (the trace patches
only the caller's globals).

Shape legend: ``B`` rows, ``P`` real positions of the batch, ``N`` items in the table, ``K = min(P, N)`` slots.
"""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["distinct_positives", "flat_positions", "real_positions"]


@torch.fx.wrap
def real_positions(sparse: KeyedJaggedTensor, item_feature: str, lengths: torch.Tensor) -> int:
    """``P``, the batch's positions with a next event: its history events plus one per row (the candidate), from the
    event count TorchRec keeps on the host (``length_per_key``, set by every data module's batch); else summed from
    ``lengths`` (a device read)."""
    per_key = sparse.length_per_key_or_none()
    if per_key is None or torch.compiler.is_exporting():
        return int(lengths.sum()) + lengths.shape[0]
    return per_key[sparse.keys().index(item_feature)] + lengths.shape[0]


def flat_positions(sizes: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """``[count]``: the flat index (into rows of ``width``) of each row's first ``sizes[row]`` positions, row after row,
    ``count = sizes.sum()`` given by the caller (the order a boolean mask selects them in, without counting them)."""
    rows = torch.repeat_interleave(torch.arange(sizes.shape[0], device=sizes.device), sizes, output_size=count)
    starts = torch.cumsum(sizes, 0) - sizes
    return rows * width + torch.arange(count, device=sizes.device) - starts[rows]


@torch.fx.wrap  # a leaf of TorchRec's pipeline trace: its number of slots is a comparison of sizes
def distinct_positives(ids: torch.Tensor, num_items: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids [P]``'s distinct values (item ids below ``num_items``) numbered in ascending order, as ``torch.unique``
    numbers them, in ``K = min(P, num_items)`` slots: at least the distinct count, a bound known without counting them.

    Returns ``(positives, counts, first)``: ``positives [P]`` each id's slot, ``counts [K]`` the ids in each slot
    (0: a slot no id fills), ``first [K]`` each slot's first position in ``ids`` (``P - 1`` for an empty slot).
    Every size is ``P`` or ``K``, none counted from the values: a sort, the starts of its runs of equal ids, and
    their running count."""
    total = ids.shape[0]
    columns = min(total, num_items)
    ordered, order = torch.sort(ids)
    starts = torch.cat([torch.ones_like(ordered[:1], dtype=torch.bool), ordered[1:] != ordered[:-1]])
    slot = torch.cumsum(starts, 0) - 1
    positives = torch.empty_like(slot).scatter_(0, order, slot)
    counts = torch.zeros(columns, dtype=torch.int64, device=ids.device).scatter_add_(0, slot, torch.ones_like(slot))
    positions = torch.arange(total, device=ids.device)
    first = torch.full((columns,), total, dtype=torch.int64, device=ids.device).scatter_reduce(0, positives, positions, reduce="amin")
    return positives, counts, first.clamp_max(max(total - 1, 0))
