"""A batch's ``KeyedJaggedTensor`` that knows each key's longest row on the host, where the batch was built.

Why: a model that pads histories into a dense block sizes it by the batch's longest row. Read from the lengths where
the step runs (on the GPU), that is a device-to-host sync in every step, which drains the queue of kernels and costs a
pipelined step its overlap (docs/performance.md, "Host syncs per step"). The data module builds each batch on the CPU,
where the longest row per key is a NumPy ``max`` beside the per-key sums TorchRec already keeps on the host
(``length_per_key``): :func:`recsys_runner.data.base.batch_kjt` takes both and returns a :class:`HostLengthsKJT`.

TorchRec's own copies of a ``KeyedJaggedTensor`` (``to``, ``pin_memory``: what the train pipelines, the DataLoader's pin
thread and the evaluator call on a batch) keep its host-side caches but return a plain ``KeyedJaggedTensor``; this class
carries its longest rows through both. Any other ``KeyedJaggedTensor`` (built by a test, a server, an export) has none:
:func:`longest_row` says ``None`` and the model reads the lengths instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["HostLengthsKJT", "longest_row", "with_longest_rows"]


class HostLengthsKJT(KeyedJaggedTensor):
    """A ``KeyedJaggedTensor`` with :attr:`longest_rows`: each key's longest row (its most values in one row), host ints.

    Made by :func:`with_longest_rows`; ``to`` and ``pin_memory`` return one with the same longest rows.
    """

    longest_rows: Mapping[str, int] = MappingProxyType({})
    """Each key's longest row of this batch, counted on the host when the batch was built (none known for one made
    otherwise than by :func:`with_longest_rows`)."""

    def to(self, device: torch.device, non_blocking: bool = False, dtype: torch.dtype | None = None) -> KeyedJaggedTensor:
        return with_longest_rows(super().to(device, non_blocking=non_blocking, dtype=dtype), self.longest_rows)

    def pin_memory(self) -> KeyedJaggedTensor:
        return with_longest_rows(super().pin_memory(), self.longest_rows)


def with_longest_rows(kjt: KeyedJaggedTensor, longest_rows: Mapping[str, int]) -> HostLengthsKJT:
    """``kjt`` (the same tensors and host-side caches, not copied) carrying ``longest_rows``: each key's longest row,
    which the caller counted from the same lengths on the host."""
    carrier = HostLengthsKJT.__new__(HostLengthsKJT)
    carrier.__dict__.update(kjt.__dict__)
    carrier.longest_rows = dict(longest_rows)
    return carrier


def longest_row(sparse: KeyedJaggedTensor, key: str) -> int | None:
    """``key``'s longest row in ``sparse`` as the batch's builder counted it on the host; ``None`` when ``sparse`` does not
    carry it (not a :class:`HostLengthsKJT`), or under ``torch.export`` (whose program pads to a size symbol)."""
    if isinstance(sparse, HostLengthsKJT) and not torch.compiler.is_exporting():
        return sparse.longest_rows.get(key)
    return None
