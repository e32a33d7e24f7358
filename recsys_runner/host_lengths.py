"""A batch's ``KeyedJaggedTensor`` that knows each key's longest row on the host, where the batch was built.

Why: a model that pads histories into a dense block sizes it by the batch's longest row. Read from the lengths where
the step runs (on the GPU), that is a device-to-host sync in every step, which drains the queue of kernels and costs a
pipelined step its overlap (docs/performance.md, "Host syncs per step"). The data module builds each batch on the CPU,
where the longest row per key is a NumPy ``max`` beside the per-key sums TorchRec already keeps on the host
(``length_per_key``): :func:`recsys_runner.data.base.batch_kjt` takes both and returns a :class:`HostLengthsKJT`. It also
keeps the rows' lengths themselves (the NumPy array they were counted from): a model on jagged rows sizes its tile plan
and its flat positions by sums over them (``models/jagged.py``, ``models/sasrec.py``), again without a device read.

TorchRec's own copies of a ``KeyedJaggedTensor`` (``to``, ``pin_memory``: what the train pipelines, the DataLoader's pin
thread and the evaluator call on a batch) keep its host-side caches but return a plain ``KeyedJaggedTensor``; this class
carries its longest rows and row lengths through both. Any other ``KeyedJaggedTensor`` (built by a test, a server, an
export) has none: :func:`longest_row` and :func:`row_lengths` say ``None`` and the model reads the lengths instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["HostLengthsKJT", "longest_row", "row_lengths", "values_on_host", "with_longest_rows"]


class HostLengthsKJT(KeyedJaggedTensor):
    """A ``KeyedJaggedTensor`` with :attr:`longest_rows`: each key's longest row (its most values in one row), host ints,
    :attr:`row_lengths`: each key's rows' lengths, and :attr:`host_values`: the batch's values, both host arrays.

    Made by :func:`with_longest_rows`; ``to`` and ``pin_memory`` return one with the same host facts. The lengths and
    values are kept as the CPU tensors the batch was built from, and the NumPy arrays are views made when asked: a batch
    a DataLoader worker sends to the trainer then crosses in shared memory like its other tensors, where NumPy arrays
    would be copied through the pipe (1.3 MB more for a Criteo-shaped batch of 4096 rows).
    """

    longest_rows: Mapping[str, int] = MappingProxyType({})
    """Each key's longest row of this batch, counted on the host when the batch was built (none known for one made
    otherwise than by :func:`with_longest_rows`)."""
    _host_lengths: torch.Tensor | None = None
    _host_values: torch.Tensor | None = None

    @property
    def row_lengths(self) -> Mapping[str, np.ndarray]:
        """Each key's rows' lengths ``[B]`` (int), views of the host lengths the batch was built from (none known unless
        :func:`with_longest_rows` was given them)."""
        lengths, keys = self._host_lengths, self.keys()
        if lengths is None or not keys:
            return MappingProxyType({})
        return dict(zip(keys, lengths.numpy().reshape(len(keys), -1), strict=True))

    @property
    def host_values(self) -> np.ndarray | None:
        """The batch's values as built, on the host (a view of the same memory; ``None``: not known): what a model whose
        token layout depends on the ids themselves (HSTU ranking's sequences of rows that share a history) sizes it by,
        without a device read."""
        return None if self._host_values is None else self._host_values.numpy()

    def to(self, device: torch.device, non_blocking: bool = False, dtype: torch.dtype | None = None) -> KeyedJaggedTensor:
        moved = super().to(device, non_blocking=non_blocking, dtype=dtype)
        return _carrying(moved, self.longest_rows, self._host_lengths, self._host_values)

    def pin_memory(self) -> KeyedJaggedTensor:
        return _carrying(super().pin_memory(), self.longest_rows, self._host_lengths, self._host_values)


def with_longest_rows(kjt: KeyedJaggedTensor, longest_rows: Mapping[str, int], host_lengths: torch.Tensor | None = None,
                      host_values: torch.Tensor | None = None) -> HostLengthsKJT:
    """``kjt`` (the same tensors and host-side caches, not copied) carrying ``longest_rows``: each key's longest row,
    which the caller counted from the same lengths on the host, ``host_lengths``: those lengths (the CPU tensor of every
    key's rows, key by key, as ``kjt`` holds them; ``None``: not known), and ``host_values``: ``kjt``'s values on the
    host (a CPU tensor; ``None``: not known). Neither is copied."""
    for name, tensor in (("host_lengths", host_lengths), ("host_values", host_values)):
        if tensor is not None and tensor.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor (the batch as built on the host), got one on {tensor.device}")
    return _carrying(kjt, longest_rows, host_lengths, host_values)


def _carrying(kjt: KeyedJaggedTensor, longest_rows: Mapping[str, int], host_lengths: torch.Tensor | None,
              host_values: torch.Tensor | None) -> HostLengthsKJT:
    carrier = HostLengthsKJT.__new__(HostLengthsKJT)
    carrier.__dict__.update(kjt.__dict__)
    carrier.longest_rows = dict(longest_rows)
    carrier._host_lengths = host_lengths
    carrier._host_values = host_values
    return carrier


def longest_row(sparse: KeyedJaggedTensor, key: str) -> int | None:
    """``key``'s longest row in ``sparse`` as the batch's builder counted it on the host; ``None`` when ``sparse`` does not
    carry it (not a :class:`HostLengthsKJT`), or under ``torch.export`` (whose program pads to a size symbol)."""
    if isinstance(sparse, HostLengthsKJT) and not torch.compiler.is_exporting():
        return sparse.longest_rows.get(key)
    return None


def row_lengths(sparse: KeyedJaggedTensor, key: str) -> np.ndarray | None:
    """``key``'s rows' lengths ``[B]`` in ``sparse`` as the batch's builder had them on the host; ``None`` when ``sparse``
    does not carry them (not a :class:`HostLengthsKJT`), or under ``torch.export``."""
    if isinstance(sparse, HostLengthsKJT) and not torch.compiler.is_exporting():
        return sparse.row_lengths.get(key)
    return None


def values_on_host(sparse: KeyedJaggedTensor, keys: list[str]) -> np.ndarray | None:
    """``[T, len(keys)]``: the values of ``keys`` (which share their rows' lengths, as a history's features and its
    times do), a column each, as the batch's builder had them on the host; ``None`` when ``sparse`` does not carry them
    (not a :class:`HostLengthsKJT` built with its values, or under ``torch.export``)."""
    if not isinstance(sparse, HostLengthsKJT) or sparse.host_values is None or torch.compiler.is_exporting():
        return None
    offsets, names = sparse.offset_per_key(), sparse.keys()
    values = sparse.host_values
    return np.stack([values[offsets[names.index(k)]: offsets[names.index(k) + 1]] for k in keys], axis=1)
