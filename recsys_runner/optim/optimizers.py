"""Dense optimizers, and how the run's optimizers are combined; the fused sparse one is :mod:`recsys_runner.optim.sparse`.

Dense: an ordinary ``torch.optim`` class, built by its config (:meth:`DenseOptimizerConfig.build`)
with the parameters that are left once sharding is done, by name: ``no_decay_1d``/``no_decay_patterns`` put the
parameters they exclude from weight decay in a param group of their own (:meth:`DenseOptimizerConfig.param_groups`).
Its config names a class that is not ours (a ``torch.optim`` class), so unlike other
:class:`~recsys_runner.configurable.Configurable` configs it does not pass itself to it: :class:`DenseOptimizerConfig`
calls its class with the parameters and its fields.

``optim.lr`` is the shared learning rate: both ``optim.sparse.lr`` and ``optim.dense.lr`` default
to it and can be set independently (a part's optimizer too, unless it sets its own ``lr``).

Part-wise dense optimizers (``optim.parts.<name>``): dense parameters whose name matches a part's
regex get that part's optimizer (and optionally its own schedule) instead of ``optim.dense``;
parts are matched in the order they are declared and the first match wins.

The run's optimizers are named by :class:`OptimizerGroup` (sparse, dense, or part ``<name>``) and
combined in one :class:`GroupedOptimizer`; a group's :attr:`~OptimizerGroup.key` (``sparse``, ``dense``,
``part.<name>``) is the one string form, used by TorchRec's ``CombinedOptimizer``, hence in checkpoint keys
(``optim/<key>.<param>/<state>``), and in the logged ``lr/<key>``."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from omegaconf import II
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper

from recsys_runner.configurable import Configurable
from recsys_runner.errors import ConfigError, require

_DENSE_KEY = re.compile(r"(?<![\w.])optim\.dense\.")


def optimizer_error(where: str, error: ConfigError) -> ConfigError:
    """``error`` of a dense optimizer's config or build, with its keys named where that optimizer sits.

    :class:`DenseOptimizerConfig`'s checks name ``optim.dense.<key>``, but the same config is also a part's
    ``optim.parts.<name>.optimizer``, where ``optim.dense.no_decay_patterns`` would change another optimizer.
    """
    return ConfigError(_DENSE_KEY.sub(f"{where}.", str(error)))


def check_rate_and_decay(where: str, lr: float, weight_decay: float) -> None:
    """The checks every optimizer config (sparse and dense) makes of its learning rate and weight decay."""
    require(lr > 0, f"{where}.lr must be positive, got {lr}. Fix: e.g. {where}.lr=0.01 where it is set, else optim.lr=0.01 (its default)")
    require(weight_decay >= 0, f"{where}.weight_decay must be >= 0, got {weight_decay}")


def check_eps(where: str, eps: float) -> None:
    """``eps`` keeps an adaptive optimizer's division by its accumulated squares finite: 0 divides by zero on a row or
    weight that has had no gradient yet (NaN), and torch refuses a negative one only when the optimizer is built, after
    sharding."""
    require(eps > 0, f"{where}.eps must be positive, got {eps}. Fix: e.g. {where}.eps=1e-8")


def optimizer_kwargs(config: Configurable) -> dict[str, Any]:
    """Every field of ``config`` but ``_target_``: the keyword arguments of the optimizer class it names."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "_target_"}


@dataclass(kw_only=True)
class DenseOptimizerConfig(Configurable):
    """Base of every dense optimizer's config (``optim.dense``, ``conf/optim/dense/*.yaml``, a part's ``optimizer``).

    ``_target_`` is a ``torch.optim`` class; :meth:`build` calls it with the parameters and every
    other field as a keyword argument, so a subclass declares exactly that class's arguments — but the
    weight decay exclusions (:data:`DECAY_EXCLUSIONS`), which :meth:`build` turns into param groups.
    """

    lr: float = II("..lr")
    """The dense learning rate; ``optim.lr`` unless set."""
    weight_decay: float = 0.0
    """Weight decay (``torch.optim``'s: added to the gradient; decoupled for AdamW) of every parameter of this optimizer
    but those ``no_decay_1d``/``no_decay_patterns`` exclude."""
    no_decay_1d: bool = False
    """No weight decay for parameters with ``ndim <= 1``: biases, the scales and shifts of LayerNorm/BatchNorm, and any
    other vector weight (DCN v1's cross kernels are vectors too) — timm's ``filter_bias_and_bn``, the usual choice for
    transformers. Off by default so that an existing config trains as it did (docs/training.md, "Weight decay")."""
    no_decay_patterns: list[str] = field(default_factory=list)
    """Regular expressions searched (``re.search``) in each parameter's name; a match gets no weight decay, e.g.
    ``[bias, norm]`` (Hugging Face's ``no_decay`` list). A pattern that matches no parameter is an error."""

    def __post_init__(self) -> None:
        check_rate_and_decay("optim.dense", self.lr, self.weight_decay)
        for pattern in self.no_decay_patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"optim.dense.no_decay_patterns has {pattern!r}, not a valid regular expression: {e}") from None
        if not _takes_weight_decay(self.component_class()):
            name = self._target_.rsplit(".", 1)[-1]
            require(self.weight_decay == 0, f"optim.dense.weight_decay={self.weight_decay}: {self._target_} takes no weight_decay "
                    f"argument, so it cannot decay. Fix: optim.dense.weight_decay=0, or an optimizer with weight decay "
                    f"(torch.optim.AdamW, SGD, Adam …) instead of {name}")
            require(not self.excludes_from_decay, f"optim.dense.no_decay_1d/no_decay_patterns exclude parameters from the weight "
                    f"decay of {self._target_}, which has none. Fix: drop them (optim.dense.no_decay_1d=false, "
                    f"optim.dense.no_decay_patterns=[])")

    @property
    def excludes_from_decay(self) -> bool:
        """Whether ``no_decay_1d`` or ``no_decay_patterns`` exclude anything."""
        return self.no_decay_1d or bool(self.no_decay_patterns)

    def decays(self, name: str, param: torch.Tensor) -> bool:
        """Whether ``weight_decay`` applies to the parameter ``name``: not when ``no_decay_1d`` and it is a vector or a
        scalar, nor when one of ``no_decay_patterns`` is found in its name."""
        if self.no_decay_1d and param.ndim <= 1:
            return False
        return not any(re.search(pattern, name) for pattern in self.no_decay_patterns)

    def param_groups(self, params: Mapping[str, nn.Parameter]) -> list[dict[str, Any]]:
        """``params`` (by name) as the optimizer's param groups: one group, or with weight decay on and exclusions
        set, the decayed parameters and then the excluded ones with ``weight_decay=0`` (empty groups left out).

        Groups, not one flag per parameter, because ``torch.optim`` reads ``weight_decay`` per group. Checkpoints hold
        the state per parameter name, not the groups, so a resume rebuilds them from its config.

        Raises:
            ConfigError: a ``no_decay_patterns`` entry that matches none of ``params``.
        """
        for pattern in self.no_decay_patterns:
            if not any(re.search(pattern, name) for name in params):
                raise ConfigError(f"optim.dense.no_decay_patterns has {pattern!r}, which matches none of this optimizer's "
                                  f"{len(params)} parameters, e.g. {sorted(params)[:6]}. Fix: a pattern found in one of those "
                                  f"names, or drop it")
        if self.weight_decay == 0 or not self.excludes_from_decay:
            return [{"params": list(params.values())}]
        decayed = [p for name, p in params.items() if self.decays(name, p)]
        excluded = [p for name, p in params.items() if not self.decays(name, p)]
        return [group for group in ({"params": decayed}, {"params": excluded, "weight_decay": 0.0}) if group["params"]]

    def build(self, params: Mapping[str, nn.Parameter]) -> torch.optim.Optimizer:
        """``<_target_>(param groups, **fields)``: the optimizer of ``params`` (by name), its param groups
        :meth:`param_groups`'s."""
        cls = self.component_class()
        if not issubclass(cls, torch.optim.Optimizer):
            raise ConfigError(f"optim.dense._target_={self._target_} is not a torch.optim.Optimizer class; e.g. torch.optim.Adam")
        kwargs = {k: v for k, v in optimizer_kwargs(self).items() if k not in DECAY_EXCLUSIONS}
        if not _takes_weight_decay(cls):  # validated: it is 0 (torch.optim.Rprop, LBFGS, SparseAdam take no argument for it)
            del kwargs["weight_decay"]
        return cls(self.param_groups(params), **kwargs)

    def decay_caveat(self, where: str) -> str | None:
        """What to tell a user whose exclusions do nothing (``weight_decay=0``), else ``None``. Said, not refused: a sweep
        over ``weight_decay`` that includes 0 keeps one set of exclusions for all its runs."""
        if self.weight_decay > 0 or not self.excludes_from_decay:
            return None
        return (f"{where}.no_decay_1d/no_decay_patterns do nothing: {where}.weight_decay=0, so no parameter is decayed. "
                f"Set {where}.weight_decay (e.g. 0.01) for them to matter")

DECAY_EXCLUSIONS = ("no_decay_1d", "no_decay_patterns")
"""The fields of :class:`DenseOptimizerConfig` that choose its param groups instead of being the optimizer's arguments."""


def _takes_weight_decay(cls: type) -> bool:
    """Whether ``cls``'s constructor has a ``weight_decay`` argument (every ``torch.optim`` class but Rprop, LBFGS and SparseAdam)."""
    try:
        return "weight_decay" in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # no signature to read: let the class itself say what it takes
        return True


def decay_summary(groups: Sequence[tuple[OptimizerGroup, KeyedOptimizer]]) -> str | None:
    """One line saying, for each dense optimizer that decays, how many tensors (and values) it decays and how many it
    leaves undecayed (what ``no_decay_1d``/``no_decay_patterns`` excluded), read from the optimizers' real param groups;
    ``None`` when none decays."""
    said = []
    for group, optimizer in groups:
        decayed = [p for g in optimizer.param_groups if g.get("weight_decay", 0) > 0 for p in g["params"]]
        excluded = [p for g in optimizer.param_groups if not g.get("weight_decay", 0) > 0 for p in g["params"]]
        if decayed:
            rate = max(g.get("weight_decay", 0) for g in optimizer.param_groups)
            said.append(f"{group.key} decays {len(decayed)} tensors ({sum(p.numel() for p in decayed):,} values) by {rate:g}, "
                        f"excludes {len(excluded)} ({sum(p.numel() for p in excluded):,} values)")
    return "weight decay: " + "; ".join(said) if said else None


@dataclass(kw_only=True)
class DenseSGDConfig(DenseOptimizerConfig):
    """``torch.optim.SGD`` for the dense parameters."""

    _target_: str = "torch.optim.SGD"
    momentum: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        # torch refuses a negative momentum only once the optimizer is built (after sharding), and takes 1 or more,
        # with which the velocity never decays and training diverges
        require(0 <= self.momentum < 1, f"optim.dense.momentum must lie in [0, 1), got {self.momentum}. Fix: e.g. "
                "optim.dense.momentum=0.9, or 0 for plain SGD")
        require(not self.nesterov or self.momentum > 0, "optim.dense.nesterov=true needs optim.dense.momentum > 0")


@dataclass(kw_only=True)
class DenseAdagradConfig(DenseOptimizerConfig):
    """``torch.optim.Adagrad`` for the dense parameters."""

    _target_: str = "torch.optim.Adagrad"
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        check_eps("optim.dense", self.eps)


@dataclass(kw_only=True)
class DenseAdamConfig(DenseOptimizerConfig):
    """``torch.optim.Adam`` for the dense parameters."""

    _target_: str = "torch.optim.Adam"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        check_eps("optim.dense", self.eps)
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                f"optim.dense.betas needs two values in [0, 1), got {self.betas}")


@dataclass(kw_only=True)
class DenseAdamWConfig(DenseAdamConfig):
    """``torch.optim.AdamW`` (decoupled weight decay) for the dense parameters."""

    _target_: str = "torch.optim.AdamW"
    weight_decay: float = 0.01

DENSE_CONFIGS: tuple[type[DenseOptimizerConfig], ...] = (DenseSGDConfig, DenseAdagradConfig, DenseAdamConfig, DenseAdamWConfig)
"""The dense optimizer schemas; a part's ``optimizer: {_target_: …}`` is typed by the one with that ``_target_``."""


@dataclass(frozen=True)
class OptimizerGroup:
    """Which of the run's optimizers: the fused ``sparse`` one, the ``dense`` one, or part-wise ``part`` ``name``."""

    kind: Literal["sparse", "dense", "part"]
    name: str | None = None
    """The part's name (``optim.parts.<name>``); only for ``kind="part"``."""

    def __post_init__(self) -> None:
        assert (self.kind == "part") == (self.name is not None), f"a part needs a name, and only a part: {self}"

    @classmethod
    def part(cls, name: str) -> OptimizerGroup:
        return cls("part", name)

    @property
    def key(self) -> str:
        """``sparse``, ``dense`` or ``part.<name>``: the optimizer's key in the ``CombinedOptimizer``, so the
        prefix of its state in checkpoints and the suffix of its logged ``lr/<key>``. Made here only."""
        return f"part.{self.name}" if self.kind == "part" else self.kind

SPARSE = OptimizerGroup("sparse")

DENSE = OptimizerGroup("dense")


class GroupedOptimizer(CombinedOptimizer):
    """TorchRec's ``CombinedOptimizer`` whose members are named by :class:`OptimizerGroup` (their keys are
    the groups' :attr:`~OptimizerGroup.key`); :attr:`groups` gives them back typed."""

    def __init__(self, groups: Sequence[tuple[OptimizerGroup, KeyedOptimizer]]) -> None:
        super().__init__([(group.key, opt) for group, opt in groups])
        self.groups: tuple[tuple[OptimizerGroup, KeyedOptimizer], ...] = tuple(groups)



def dense_optimizers(
    params: Mapping[str, nn.Parameter],
    dense: Callable[[Mapping[str, nn.Parameter]], torch.optim.Optimizer],
    parts: Mapping[str, tuple[str, Callable[[Mapping[str, nn.Parameter]], torch.optim.Optimizer]]],
) -> list[tuple[OptimizerGroup, KeyedOptimizer]]:
    """Split dense ``params`` by the parts' regexes: ``[(OptimizerGroup.part(<name>), opt), …, (DENSE, opt)]``.

    ``parts`` maps a part name to ``(pattern, optimizer factory)``; a factory (a :meth:`DenseOptimizerConfig.build`) is
    given its parameters by name, which its weight decay exclusions read. The first matching part takes a
    parameter. A part that matches nothing is a config mistake and raises :class:`ConfigError`.
    """
    remaining = dict(params)
    out: list[tuple[OptimizerGroup, KeyedOptimizer]] = []
    for name, (pattern, factory) in parts.items():
        taken = {k: p for k, p in remaining.items() if re.search(pattern, k)}
        if not taken:
            raise ConfigError(
                f"optim.parts.{name}.pattern={pattern!r} matches no dense parameter; dense parameter names are e.g. "
                f"{sorted(remaining)[:6]}"
            )
        for k in taken:
            del remaining[k]
        try:
            out.append((OptimizerGroup.part(name), _keyed(taken, factory)))
        except ConfigError as e:  # e.g. a no_decay_patterns entry that matches none of the part's parameters
            raise optimizer_error(f"optim.parts.{name}.optimizer", e) from None
    if remaining:
        out.append((DENSE, _keyed(remaining, dense)))
    return out


def _keyed(params: dict[str, nn.Parameter], factory: Callable[[Mapping[str, nn.Parameter]], torch.optim.Optimizer]) -> KeyedOptimizer:
    """TorchRec's keyed wrapper of ``factory``'s optimizer over ``params``; the factory gets them by name (the wrapper
    would hand it their values only)."""
    return KeyedOptimizerWrapper(params, lambda _values: factory(params))
