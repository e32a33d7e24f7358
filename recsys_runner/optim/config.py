"""``optim.*``: the ``optim`` group's schema (a shared lr, one sparse and one dense optimizer, part-wise dense
optimizers by parameter-name pattern, per-group schedules), and the typing of a part's free-form entries.

Imports both optimizers and schedulers: it is where the two meet, so neither needs the other's config.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from omegaconf import MISSING

from recsys_runner.configurable import config_class, locate_class, make
from recsys_runner.errors import ConfigError, require
from recsys_runner.optim.optimizers import DENSE_CONFIGS, DenseOptimizerConfig, optimizer_error
from recsys_runner.optim.schedulers import SchedulerConfig, schedule_error
from recsys_runner.optim.sparse import SparseOptimizerConfig

C = TypeVar("C")


@dataclass(kw_only=True)
class PartConfig:
    """One part-wise dense optimizer: ``optim.parts.<name>`` (made by :meth:`OptimConfig.__post_init__`)."""

    pattern: str
    """Regular expression searched (``re.search``) in each dense parameter's name, e.g. ``over_arch``."""
    optimizer: DenseOptimizerConfig
    """The part's dense optimizer (``_target_`` a ``torch.optim`` class with a schema, its own fields; ``lr`` defaults to ``optim.lr``)."""
    scheduler: SchedulerConfig | None = None
    """The part's own schedule; ``null`` uses ``optim.dense_scheduler`` or else ``scheduler``."""

_PART_KEYS = {"pattern", "optimizer", "scheduler"}


@dataclass(kw_only=True)
class OptimConfig:
    """Schema of every ``conf/optim/*.yaml``: a shared lr plus one sparse and one dense optimizer."""

    lr: float = 0.01
    """Learning rate used by both optimizers unless ``optim.sparse.lr``/``optim.dense.lr`` are set."""
    sparse: SparseOptimizerConfig = MISSING
    """Fused embedding optimizer; choose with ``optim/sparse=<name>``."""
    dense: DenseOptimizerConfig = MISSING
    """Dense optimizer; choose with ``optim/dense=<name>``."""
    parts: dict[str, Any] = field(default_factory=dict)
    """Part-wise dense optimizers by parameter-name regex, each ``{pattern, optimizer, scheduler}``, e.g.
    ``+optim.parts.over={pattern: over_arch, optimizer: {_target_: torch.optim.SGD, lr: 0.1}}``;
    parameters no part matches use ``optim.dense``. A :class:`PartConfig` after validation.

    Free-form in the schema because OmegaConf cannot add a plain mapping to a ``dict[str, PartConfig]``
    (Hydra's ``+optim.parts.<name>={…}`` fails with "dict is not a subclass of PartConfig"), and a field
    typed ``DenseOptimizerConfig`` would reject the keys only its subclasses have (``momentum`` …). :meth:`__post_init__`
    therefore converts each entry with :func:`~recsys_runner.configurable.make`: the optimizer by the
    schema whose ``_target_`` it names (:data:`DENSE_CONFIGS`, or the ``config`` annotation of a
    user's class), the scheduler by its ``_target_``'s ``config`` annotation (or kept as is when
    composed with ``+scheduler@optim.parts.<name>.scheduler=…``). Unknown keys fail there.
    """
    sparse_scheduler: SchedulerConfig | None = None
    """Schedule of the sparse lr only; ``null`` uses the top-level ``scheduler``. Set with
    ``+scheduler@optim.sparse_scheduler=cosine``."""
    dense_scheduler: SchedulerConfig | None = None
    """Schedule of the dense lr only; ``null`` uses the top-level ``scheduler``
    (``+scheduler@optim.dense_scheduler=exponential_decay``)."""

    def __post_init__(self) -> None:
        require(self.lr > 0, f"optim.lr must be positive, got {self.lr}. Fix: e.g. optim.lr=0.01")
        self.parts = {name: _part_config(name, part, self.lr) for name, part in self.parts.items()}

    def decay_caveats(self) -> list[str]:
        """What the dense optimizers' weight decay exclusions do not do (:meth:`DenseOptimizerConfig.decay_caveat`), for
        the builder to say once."""
        caveats = [self.dense.decay_caveat("optim.dense"),
                   *(part.optimizer.decay_caveat(f"optim.parts.{name}.optimizer") for name, part in self.part_configs().items())]
        return [c for c in caveats if c is not None]

    def part_configs(self) -> dict[str, PartConfig]:
        """:attr:`parts`, typed (every entry is a :class:`PartConfig` once ``__post_init__`` ran)."""
        assert all(isinstance(p, PartConfig) for p in self.parts.values())
        return dict(self.parts)


def _part_config(name: str, part: Any, lr: float) -> PartConfig:
    """``optim.parts.<name>`` as a :class:`PartConfig`; :class:`ConfigError` naming the part for any mistake."""
    where = f"optim.parts.{name}"
    if isinstance(part, PartConfig):
        part = {"pattern": part.pattern, "optimizer": part.optimizer, "scheduler": part.scheduler}
    require(isinstance(part, Mapping) and set(part) <= _PART_KEYS and "pattern" in part,
            f"{where} must be {{pattern: <regex>, optimizer: {{_target_: …}}, scheduler: <optional>}}, got {part}")
    pattern = part["pattern"]
    require(isinstance(pattern, str), f"{where}.pattern must be a regular expression string, got {pattern!r}")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"{where}.pattern={pattern!r} is not a valid regular expression: {e}") from None
    optimizer = part.get("optimizer")
    require(optimizer is not None, f"{where} has no optimizer; set {where}.optimizer="
            "{_target_: torch.optim.SGD, lr: 0.1} (any torch.optim class)")
    scheduler = part.get("scheduler")
    if scheduler is not None and not isinstance(scheduler, SchedulerConfig):
        try:
            scheduler = _typed_mapping(f"{where}.scheduler", scheduler, SchedulerConfig, {})
        except ConfigError as e:
            raise schedule_error(f"{where}.scheduler", e) from None
    if not isinstance(optimizer, DenseOptimizerConfig):
        try:
            optimizer = _dense_config(f"{where}.optimizer", optimizer, lr)
        except ConfigError as e:
            raise optimizer_error(f"{where}.optimizer", e) from None
    return PartConfig(pattern=pattern, optimizer=optimizer, scheduler=scheduler)


def signature_config(cls: type[torch.optim.Optimizer]) -> type[DenseOptimizerConfig]:
    """A config dataclass for a ``torch.optim`` class we ship none for (e.g. ``torch.optim.RMSprop`` as a part's
    optimizer), generated from its constructor's keyword arguments and their defaults, as hydra-zen's
    ``builds(cls, populate_full_signature=True)`` would. Only here: our own components declare their config."""
    target = f"{cls.__module__}.{cls.__qualname__}"
    if target in _SIGNATURE_CONFIGS:
        return _SIGNATURE_CONFIGS[target]
    declared = {f.name for f in dataclasses.fields(DenseOptimizerConfig)}
    spec: list[tuple[str, Any, Any]] = [("_target_", str, field(default=target))]
    for name, p in inspect.signature(cls).parameters.items():
        if name == "params" or name in declared or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = p.default if p.default is not p.empty else MISSING
        if isinstance(default, tuple):  # a list in the config (OmegaConf has no tuples); a dataclass needs a factory for one
            spec.append((name, Any, field(default_factory=functools.partial(list, default))))
        else:
            spec.append((name, Any, field(default=default)))
    schema = dataclasses.make_dataclass(f"{cls.__name__}Config", spec, bases=(DenseOptimizerConfig,), kw_only=True)
    _SIGNATURE_CONFIGS[target] = schema
    return schema

_SIGNATURE_CONFIGS: dict[str, type[DenseOptimizerConfig]] = {}


def _dense_config(where: str, node: Any, lr: float) -> DenseOptimizerConfig:
    by_target = {c._target_: c for c in DENSE_CONFIGS}
    target = node.get("_target_") if isinstance(node, Mapping) else None
    if target in by_target:
        return _typed_mapping(where, node, DenseOptimizerConfig, {"lr": lr}, by_target[target])
    return _typed_mapping(where, node, DenseOptimizerConfig, {"lr": lr})


def _typed_mapping(where: str, node: Any, base: type[C], defaults: Mapping[str, Any], schema: type | None = None) -> C:
    """``node`` (a plain mapping with ``_target_``) made into ``schema``, by default the ``config`` annotation of its class."""
    require(isinstance(node, Mapping) and isinstance(node.get("_target_"), str),
            f"{where} must be a mapping with a _target_, got {node!r}")
    fields = {k: v for k, v in node.items() if k != "_partial_"}  # accepted from before configs built their component
    if schema is None:
        try:
            cls = locate_class(fields["_target_"])
        except ConfigError as e:
            raise ConfigError(f"{where}.{e}") from None
        schema = config_class(cls)
        if schema is None and base is DenseOptimizerConfig and issubclass(cls, torch.optim.Optimizer):
            schema = signature_config(cls)
        require(schema is not None and issubclass(schema, base),
                f"{where}._target_={fields['_target_']} has no config schema subclassing {base.__name__}"
                + ("; use a torch.optim class" if base is DenseOptimizerConfig else ""))
        assert schema is not None
    try:
        return make(schema, {**defaults, **fields})
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
