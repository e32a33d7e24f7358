"""A batch crossing the DataLoader worker boundary as ONE buffer: the worker copies the tensors of a batch tuple into one
contiguous byte buffer in shared memory (:func:`pack`), the training process takes them back as views of it (:func:`unpack`).

Why: a tensor a worker sends is copied into a shared-memory segment of its own, whose file descriptor crosses on a
connection of its own and is mapped by the receiver; that costs the training process ~0.5 ms per tensor (cProfile, on a
CPU), whatever its size. A file batch (dense, values, lengths, labels, weights) paid it five times, a synthetic one four:
on a CPU, one worker delivered 3.4x fewer synthetic rows/s than generating them in the training process
(docs/performance.md, *6. The input path on a CPU*). One buffer pays it once, and the worker writes it straight into
shared memory (:func:`shared_bytes`); with ``pin_memory`` the pin thread pins one buffer, not each tensor.

The tuple is otherwise what it was: the same tensors bit for bit (dtype, shape, values), every other item (counts,
``None``, error markers) as it was, at its place. Views are contiguous and share the buffer: a part kept alone (a batch's
labels) keeps the whole batch's buffer alive, as long as it is kept.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64
"""Byte alignment of each tensor in the buffer: any dtype's view needs its offset a multiple of its element size, and 64
is a cache line (and what the CPU's vector loads prefer)."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor of a packed tuple lies in the buffer."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Packed:
    """A batch tuple whose tensors lie in :attr:`buffer`: ``slots[i]`` places item ``i`` (``None`` for an item that is not a
    tensor, which stays in ``items``)."""

    buffer: torch.Tensor
    slots: tuple[Slot | None, ...]
    items: tuple[Any, ...]

    def pin_memory(self) -> Packed:
        """This batch with its buffer in page-locked memory: DataLoader's pin thread calls it (one pin per batch)."""
        return Packed(self.buffer.pin_memory(), self.slots, self.items)


def pack(item: tuple[Any, ...]) -> Packed | tuple[Any, ...]:
    """``item`` with its tensors copied into one buffer; an item without tensors (a marker, an error) as it is."""
    slots: list[Slot | None] = []
    total = 0
    for x in item:
        if isinstance(x, torch.Tensor):
            slots.append(Slot(total, x.dtype, tuple(x.shape)))
            total += -(-x.numel() * x.element_size() // ALIGN) * ALIGN
        else:
            slots.append(None)
    if all(s is None for s in slots):
        return item
    buffer = shared_bytes(total)
    packed = Packed(buffer, tuple(slots), tuple(None if s is not None else x for x, s in zip(item, slots, strict=True)))
    for x, view in zip(item, _views(packed), strict=True):
        if view is not None:
            view.copy_(x)
    return packed


def shared_bytes(size: int) -> torch.Tensor:
    """``size`` bytes (at least one) of new shared memory, not yet written. A worker's batch is packed straight into it, so
    that DataLoader sends it as it is: a private buffer would be copied once more into a new segment when sent, and the
    pages of a fresh segment cost more to fault in than the copy (at batch 65536, 24 MB: ~40 ms more per batch on a
    loaded CPU)."""
    storage = torch.UntypedStorage._new_shared(max(size, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage)[:size]


def unpack(item: Packed | tuple[Any, ...]) -> tuple[Any, ...]:
    """The tuple :func:`pack` was given, its tensors as views of the buffer; any other item as it is."""
    if not isinstance(item, Packed):
        return item
    return tuple(x if view is None else view for x, view in zip(item.items, _views(item), strict=True))


def packed_stream(items: Iterable[tuple[Any, ...]]) -> Iterator[Packed | tuple[Any, ...]]:
    """``items`` packed: what a DataLoader worker yields."""
    return (pack(x) for x in items)


def unpacked_stream(items: Iterable[Packed | tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
    """``items`` unpacked: what the training process reads from a DataLoader over a :func:`packed_stream`."""
    return (unpack(x) for x in items)


def _views(packed: Packed) -> list[torch.Tensor | None]:
    """Each slot's tensor as a view of the buffer (``None`` where the item is not a tensor)."""
    out: list[torch.Tensor | None] = []
    for slot in packed.slots:
        if slot is None:
            out.append(None)
            continue
        nbytes = math.prod(slot.shape) * slot.dtype.itemsize
        out.append(packed.buffer[slot.offset : slot.offset + nbytes].view(slot.dtype).view(slot.shape))
    return out
