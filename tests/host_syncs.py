"""Which Python calls of a block would make the host wait for the device (host syncs), and where they are made.

:class:`HostSyncs` is a ``TorchFunctionMode`` that sees every torch call made from Python while it is active and keeps
those that read a tensor's value back to the host (``item``, ``bool(t)``, ``float``/``int``, ``tolist``, ``cpu``,
``numpy``, formatting a tensor) or whose output's shape depends on the values (``nonzero``, ``masked_select``,
``unique``, a boolean-mask index, ``repeat_interleave`` without ``output_size``): on a GPU each waits for every kernel
queued before it. Each is recorded at its call site: the innermost frame inside ``recsys_runner/`` and, when the op is
called inside a library below it, the library's frame that calls it (TorchRec's, fbgemm's, torch's).

Only syncs made through Python are seen: a C++ kernel that reads a device value itself (some of TorchRec's and fbgemm's
CPU kernels do) makes none of these calls, so the inventory is of Python-visible syncs.

On a CPU run every tensor is on the "device", so a call is told apart by where it runs: one made while a data module
builds a batch or while the host checks a batch's labels (a frame of :data:`HOST_SIDE` on the stack) is host-side batch
assembly, on the tensors before the pipeline copies them to the GPU: no sync there, and kept apart in :attr:`host`
(except the ranks' agreement on a batch, :data:`ON_DEVICE_IN_DATA`).
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "__bool__", "__float__", "__int__", "__index__", "__format__", "tolist", "cpu", "numpy"}
"""Tensor methods that read the values back to the host."""
SHAPED_BY_VALUES = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "_unique2"}
"""Functions whose output's size is a count of values, read back to allocate it."""
HOST_SIDE = ("recsys_runner/data/", "recsys_runner/train/batch_checks.py", "recsys_runner/host_lengths.py")
"""Where a batch is built and checked on the host, before its copy to the device (module docstring), and where a model
reads the batch's host facts: ``host_lengths`` views the CPU tensors the batch was built from (it refuses any other)."""
ON_DEVICE_IN_DATA = ("_ranks_agree",)
"""Functions of the data path that read a device value all the same: the ranks' "have a batch" flag, all-reduced on the
GPU under NCCL (``data.base.synchronized`` / ``in_step``, several ranks only)."""

API_LAYER = (__file__.rsplit("/", 1)[-1], "torch/overrides.py", "torch/_tensor.py", "torch/functional.py")
"""Frames of this recorder and of torch's Python API around an op, left out of its call site."""
PACKAGE = str(Path(__file__).resolve().parent.parent / "recsys_runner") + "/"


def _name(func: Callable[..., Any]) -> str:
    return str(getattr(func, "__name__", func))


def _syncs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if name in READS or name in SHAPED_BY_VALUES:
        return True
    if name in ("__getitem__", "__setitem__") and len(args) > 1:  # a boolean mask: the selected rows are counted first
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor)
    return False


def _short(path: str) -> str:
    """``path`` from the project's root, or from the ``site-packages`` folder a library is in."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    return path.removeprefix(PACKAGE.removesuffix("recsys_runner/"))


def _site(stack: list[traceback.FrameSummary]) -> tuple[str, int, bool]:
    """``(key, line, host-side?)`` of the call: its innermost frame in the package (``file function``), and when the op is
    called inside a library below it, that library's frame too (``→ file function``)."""
    host = any(h in f.filename for f in stack for h in HOST_SIDE) and not any(f.name in ON_DEVICE_IN_DATA for f in stack)
    ours = [i for i, f in enumerate(stack) if f.filename.startswith(PACKAGE)]
    frame = stack[ours[-1]] if ours else stack[-1]
    key = f"{_short(frame.filename)} {frame.name}"
    if not ours or ours[-1] < len(stack) - 1:
        caller = stack[-1]
        key += f" → {_short(caller.filename)} {caller.name}"
    return key, frame.lineno or 0, host


class HostSyncs(TorchFunctionMode):
    """``with HostSyncs() as syncs: …`` records every host sync made through Python in the block (module docstring).

    A sync is keyed ``"file function op"`` (no line number, so that an edit elsewhere in the file keeps the key).

    Attributes:
        device: ``Counter`` of the keys of the block's syncs.
        host: the same for calls made in host-side batch assembly (:data:`HOST_SIDE`), which are no syncs on a GPU run.
        lines: the line numbers each key was called from, for a message.
    """

    def __init__(self) -> None:
        super().__init__()
        self.device: collections.Counter[str] = collections.Counter()
        self.host: collections.Counter[str] = collections.Counter()
        self.lines: dict[str, set[int]] = collections.defaultdict(set)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if _syncs(name, args, kwargs):
            site, line, host = _site([f for f in traceback.extract_stack() if not f.filename.endswith(API_LAYER)])
            key = f"{site} {name}"
            (self.host if host else self.device)[key] += 1
            self.lines[key].add(line)
        return func(*args, **kwargs)

    def where(self, key: str) -> str:
        """``key`` with the line numbers it was called from: ``recsys_runner/tasks.py:181,190 checked_weights item``."""
        path, rest = key.split(" ", 1)
        return f"{path}:{','.join(map(str, sorted(self.lines[key])))} {rest}"
