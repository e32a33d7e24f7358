"""The metric base the runner's metrics build on: :class:`Metric` (states, reset, cross-rank sync) and
:class:`MetricCollection` (a named set updated and computed together).

Why not torchmetrics' own classes, whose behaviour these keep: ``import torchmetrics`` loads every functional metric
it ships (audio, text, image, and ``transformers`` where installed) — 4.7 s of a 19.1 s start-up on an H200 machine
(docs/performance.md) — and the runner used nothing of it but these two classes. torchmetrics stays installed
(TorchRec depends on it); no module of the runner imports it.

What a :class:`Metric` keeps of torchmetrics 1.0.3's semantics, which the metric classes rely on:

* states are plain attributes declared with :meth:`Metric.add_state`: a tensor reduced over ranks by ``sum``,
  ``mean``, ``max`` or ``min``, or an empty list that ``update`` appends tensors to, whose rows are gathered from all
  ranks (``cat``, in rank order). :meth:`Metric.reset` restores the defaults; ``.to(device)`` moves the states (never
  their dtype: float64 sums stay float64); :meth:`Metric.persistent` puts them in ``state_dict()`` under their bare
  names, the keys torchmetrics used, so train-metric states checkpointed before this module load unchanged;
* ``update`` runs without autograd and drops the cached value; ``compute`` is cached until the next ``update`` or
  ``reset``. Under an initialized process group of several ranks, ``compute`` runs on the states combined over all
  ranks (a collective: every rank must call it, in the same order) and then restores this rank's own, so each value
  equals what one process computes over the union of the ranks' rows and accumulation goes on. A metric may compute
  over the ranks its own way instead (:meth:`Metric._compute_sharded`: AUC and grouped AUC route rows by range rather
  than copy all of them onto every rank, :mod:`recsys_runner.metrics.sharded`), with the same value. Unlike torchmetrics
  1.0.3, a rank that holds no rows of a ``cat`` state (an empty list: it never updated) joins the gather with none,
  rather than skipping the collective the others enter.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["Metric", "MetricCollection", "Reduction"]

Reduction = Literal["sum", "mean", "max", "min", "cat"]
"""How a state combines over ranks: a tensor state by an element-wise reduction over the ranks' values, a list
state (``cat``) by concatenating every rank's rows."""

_REDUCE: dict[str, Callable[[Tensor], Tensor]] = {
    "sum": lambda stacked: torch.sum(stacked, dim=0),
    "mean": lambda stacked: torch.mean(stacked, dim=0),
    "max": lambda stacked: torch.max(stacked, dim=0).values,
    "min": lambda stacked: torch.min(stacked, dim=0).values,
}
"""The tensor reductions over the ranks' values stacked along dim 0 (torchmetrics' ``dim_zero_*``: the same
arithmetic, so the same last bits)."""

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
           torch.uint8, torch.bool)
"""The dtypes a ``cat`` state's rows may have, by their code in the gathered headers."""

_MAX_DIMS = 6
"""The most dimensions a ``cat`` state's rows may have (the gathered header has room for this many sizes)."""


class Metric(nn.Module):
    """A metric whose states combine over ranks in ``compute`` (see the module's docstring).

    A subclass declares its states in ``__init__`` with :meth:`add_state` and defines ``update`` (fold a batch into the
    states) and ``compute`` (the value from the states); both are wrapped when the subclass is defined. Its direction
    is the class attribute :attr:`higher_is_better`.
    """

    higher_is_better: ClassVar[bool | None] = None
    """Whether a larger value is better; ``None``: best at a target value (calibration, at 1), so it ranks nothing."""

    def __init__(self) -> None:
        super().__init__()
        self._defaults: dict[str, Tensor | list[Tensor]] = {}
        self._reductions: dict[str, Reduction] = {}
        self._persistent: dict[str, bool] = {}
        self._computed: Any = None
        """``compute``'s cached value; ``None`` after an ``update``, a ``reset`` or a change of the states outside
        ``update`` (which must clear it, as :meth:`DecayAUC.decay <recsys_runner.metrics.decay.DecayAUC.decay>` does)."""
        self._computing = False
        self._device = torch.device("cpu")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Wrap the ``update`` and ``compute`` a subclass defines (:func:`_updating`, :func:`_computing`)."""
        super().__init_subclass__(**kwargs)
        for name, wrap in (("update", _updating), ("compute", _computing)):
            if name in vars(cls):
                setattr(cls, name, wrap(vars(cls)[name]))

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Fold a batch into the states; a subclass defines it."""
        raise NotImplementedError(f"{type(self).__name__} defines no update()")

    def compute(self) -> Any:
        """The value from the states (combined over ranks); a subclass defines it."""
        raise NotImplementedError(f"{type(self).__name__} defines no compute()")

    @property
    def device(self) -> torch.device:
        """Where the states live (moved by ``.to(device)``)."""
        return self._device

    def add_state(self, name: str, default: Tensor | list[Tensor], dist_reduce_fx: Reduction, persistent: bool = False) -> None:
        """Declare state ``name`` (then ``self.<name>``), reset to ``default``: a tensor combined over ranks by
        ``dist_reduce_fx`` (``sum``, ``mean``, ``max``, ``min``), or ``[]``, a list of tensors whose rows are gathered
        from all ranks (``cat``). ``persistent``: in ``state_dict()`` (see :meth:`persistent`)."""
        if isinstance(default, list):
            if default or dist_reduce_fx != "cat":
                raise ValueError(f"state {name!r}: a list state starts empty ([]) and combines over ranks by 'cat', "
                                 f"got {len(default)} items and {dist_reduce_fx!r}")
        elif dist_reduce_fx not in _REDUCE:
            raise ValueError(f"state {name!r}: a tensor state combines over ranks by one of {', '.join(_REDUCE)}, "
                             f"got {dist_reduce_fx!r}")
        else:
            default = default.contiguous()
        setattr(self, name, default)
        self._defaults[name] = default.detach().clone() if isinstance(default, Tensor) else []
        self._reductions[name] = dist_reduce_fx
        self._persistent[name] = persistent

    def persistent(self, mode: bool = False) -> None:
        """Whether the states are saved in ``state_dict()``, under their bare names (``load_state_dict`` reads any state it
        is given)."""
        for name in self._persistent:
            self._persistent[name] = mode

    def reset(self) -> None:
        """Every state back to its default (on the state's current device); the cached value dropped."""
        self._computed = None
        for name, default in self._defaults.items():
            current = getattr(self, name)
            setattr(self, name, default.detach().clone().to(current.device) if isinstance(default, Tensor) else [])

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Metric:
        """``.to(device)``, ``.cuda()``, ``.cpu()`` move the states, their defaults and the cached value too; a dtype
        conversion of the module leaves them as they are (the sums are float64 on purpose)."""
        super()._apply(fn, recurse)
        device = fn(torch.zeros(1, device=self._device)).device
        moved = functools.partial(_moved, device=device)
        for name in self._defaults:
            self._defaults[name] = moved(self._defaults[name])
            setattr(self, name, moved(getattr(self, name)))
        if isinstance(self._computed, Tensor):
            self._computed = self._computed.to(device)
        self._device = device
        return self

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, keep in self._persistent.items():
            if keep:
                value = getattr(self, name)
                destination[prefix + name] = [t.detach().clone() for t in value] if isinstance(value, list) else value.detach().clone()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        for name in self._defaults:
            if prefix + name in state_dict:
                setattr(self, name, state_dict.pop(prefix + name))
        self._computed = None
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _compute_sharded(self) -> Any:
        """Under a process group of several ranks: the value over all ranks' rows by the metric's own collectives,
        without the gather of :meth:`_over_all_ranks`; ``None`` (this default): gather, then ``compute``.

        A metric whose rows are too many to copy onto every rank overrides it (AUC and grouped AUC route their rows
        by range, :mod:`recsys_runner.metrics.sharded`). Collective: every rank must decide alike whether to return
        ``None``, from what all ranks exchanged, never from its own rows alone."""
        return None

    @contextmanager
    def _over_all_ranks(self) -> Iterator[None]:
        """Within: the states combined over the default process group (when one of several ranks is initialized);
        after: this rank's own again, so that updates accumulate on."""
        world = _world_size()
        if world < 2:
            yield
            return
        local = {name: getattr(self, name) for name in self._defaults}
        try:
            for name, how in self._reductions.items():
                state = getattr(self, name)
                if how == "cat":
                    setattr(self, name, _gathered_rows(state, world, self._device, f"{type(self).__name__}.{name}"))
                else:
                    parts = [torch.zeros_like(state) for _ in range(world)]
                    dist.all_gather(parts, state.contiguous())
                    setattr(self, name, _REDUCE[how](torch.stack(parts)))
            yield
        finally:
            for name, value in local.items():
                setattr(self, name, value)


def _updating(update: Callable[..., None]) -> Callable[..., None]:
    """``update`` run without autograd, dropping the cached value."""

    @functools.wraps(update)
    def wrapped(self: Metric, *args: Any, **kwargs: Any) -> None:
        self._computed = None
        with torch.no_grad():
            update(self, *args, **kwargs)

    return wrapped


def _computing(compute: Callable[..., Any]) -> Callable[..., Any]:
    """``compute`` on the states combined over ranks (or the metric's :meth:`Metric._compute_sharded` value), cached
    until the next update; a one-element tensor as a scalar (torchmetrics' squeeze). A ``super().compute()`` inside a
    subclass's runs as is (no second combination)."""

    @functools.wraps(compute)
    def wrapped(self: Metric, *args: Any, **kwargs: Any) -> Any:
        if self._computing:
            return compute(self, *args, **kwargs)
        if self._computed is not None:
            return self._computed
        self._computing = True
        try:
            value = self._compute_sharded() if _world_size() >= 2 else None
            if value is None:
                with self._over_all_ranks():
                    value = compute(self, *args, **kwargs)
        finally:
            self._computing = False
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.squeeze()
        self._computed = value
        return value

    return wrapped


def _world_size() -> int:
    """The default process group's ranks; 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _moved(value: Tensor | list[Tensor], device: torch.device) -> Tensor | list[Tensor]:
    """A state (a tensor, or a list state's tensors) on ``device``."""
    return [t.to(device) for t in value] if isinstance(value, list) else value.to(device)


def _gathered_rows(parts: Tensor | list[Tensor], world: int, device: torch.device, what: str) -> Tensor | list[Tensor]:
    """Every rank's rows of one ``cat`` state concatenated in rank order (the same on every rank; ``[]`` when no rank
    holds any tensor).

    The ranks may hold different numbers of rows, none at all included: each sends a header (dtype, dimensions,
    sizes) first, then its rows padded to the most any rank holds; the padding is cut off again. A rank whose list is
    empty takes its dtype and row shape from a rank with rows, so the gather has one dtype and shape everywhere.
    """
    local = parts if isinstance(parts, Tensor) else (
        torch.cat([t.unsqueeze(0) if t.ndim == 0 else t for t in parts]) if parts else None)
    header = [-1] * (2 + _MAX_DIMS)
    if local is not None:
        if local.ndim > _MAX_DIMS or local.dtype not in _DTYPES:
            raise ValueError(f"{what}: rows of {local.ndim} dimensions and dtype {local.dtype} cannot be gathered "
                             f"(at most {_MAX_DIMS} dimensions, one of {_DTYPES})")
        header[:2 + local.ndim] = [_DTYPES.index(local.dtype), local.ndim, *local.shape]
    headers = [torch.zeros(len(header), dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(headers, torch.tensor(header, dtype=torch.long, device=device))
    table = [h.tolist() for h in headers]
    held = [h for h in table if h[0] >= 0]
    if not held:
        return []
    rows = [h[2] if h[0] >= 0 else 0 for h in table]
    reference = next((h for h in held if h[2] > 0), held[0])
    code, ndim = reference[0], reference[1]
    row_shape = reference[3:2 + ndim]
    if any((h[0], h[1], h[3:2 + h[1]]) != (code, ndim, row_shape) for h in held if h[2] > 0):
        raise RuntimeError(f"{what}: the ranks' rows differ in dtype or row shape (headers: dtype code, dimensions, "
                           f"sizes): {held}")
    dtype = _DTYPES[code]
    if max(rows) == 0:
        return torch.zeros((0, *row_shape), dtype=dtype, device=device)
    padded = torch.zeros((max(rows), *row_shape), dtype=dtype, device=device)
    if local is not None and local.shape[0] > 0:
        padded[:local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[:n] for g, n in zip(gathered, rows, strict=True)])


class MetricCollection(nn.Module):
    """Named metrics updated and computed together (an eval's ``auc``, ``logloss``, ``gauc``…), in the given order.

    ``update(*args, **kwargs)`` passes every metric the positional arguments and only the keyword arguments its
    ``update`` takes (torchmetrics' rule: all of them to one that takes ``**kwargs``), so ``groups=`` reaches
    ``gauc`` alone; ``compute()`` is ``{name: value}`` (collective under a process group); ``.to(device)`` moves all.
    """

    def __init__(self, metrics: Mapping[str, Metric]) -> None:
        super().__init__()
        for name, metric in metrics.items():
            self.add_module(name, metric)
        self._keywords = {name: _keywords(metric) for name, metric in metrics.items()}

    def update(self, *args: Any, **kwargs: Any) -> None:
        for name, metric in self.items():
            named, any_keyword = self._keywords[name]
            metric.update(*args, **(kwargs if any_keyword else {k: v for k, v in kwargs.items() if k in named}))

    def compute(self) -> dict[str, Any]:
        return {name: metric.compute() for name, metric in self.items()}

    def reset(self) -> None:
        for metric in self.values():
            metric.reset()

    def items(self) -> Iterator[tuple[str, Metric]]:
        for name, metric in self._modules.items():
            assert isinstance(metric, Metric)
            yield name, metric

    def keys(self) -> Iterator[str]:
        return iter(self._modules)

    def values(self) -> Iterator[Metric]:
        return (metric for _, metric in self.items())

    def __getitem__(self, name: str) -> Metric:
        metric = self._modules[name]
        assert isinstance(metric, Metric)
        return metric

    def __len__(self) -> int:
        return len(self._modules)

    def __contains__(self, name: object) -> bool:
        return name in self._modules

    def __iter__(self) -> Iterator[str]:
        return self.keys()


def _keywords(metric: Metric) -> tuple[frozenset[str], bool]:
    """The names ``metric.update`` takes by keyword, and whether it takes ``**kwargs`` (read through the wrapper)."""
    parameters = inspect.signature(metric.update).parameters.values()
    named = frozenset(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return named, any(p.kind is p.VAR_KEYWORD for p in parameters)
