"""Optimizers: a fused sparse (embedding) optimizer and a dense optimizer per run.

Sparse: the config's ``_target_`` is one of TorchRec's optimizer classes that fbgemm implements
as a fused kernel. :func:`apply_sparse_optimizer` attaches it to every embedding parameter with
``apply_optimizer_in_backward``; when DistributedModelParallel shards the tables, the kernel
updates each row *during* the backward pass, so embedding gradients are never materialized.
Its keyword arguments are passed to fbgemm as-is (``lr`` becomes ``learning_rate``), which is why
Adam takes ``beta1``/``beta2`` here, not ``betas``.

Dense: an ordinary ``torch.optim`` class, instantiated as a partial and called by the builder with
the parameters that are left once sharding is done.

``optim.lr`` is the shared learning rate: both ``optim.sparse.lr`` and ``optim.dense.lr`` default
to it and can be set independently.

Part-wise dense optimizers (``optim.parts.<name>``): dense parameters whose name matches a part's
regex get that part's optimizer (and optionally its own schedule) instead of ``optim.dense``;
parts are matched in the order they are declared and the first match wins.

The run's optimizers are named by :class:`OptimizerGroup` (sparse, dense, or part ``<name>``) and
combined in one :class:`GroupedOptimizer`; a group's :attr:`~OptimizerGroup.key` (``sparse``, ``dense``,
``part.<name>``) is the one string form, used by TorchRec's ``CombinedOptimizer``, hence in checkpoint keys
(``optim/<key>.<param>/<state>``), and in the logged ``lr/<key>``.

fbgemm's CPU build implements only ``sgd``, ``adagrad`` and ``rowwise_adagrad``; every other fused
optimizer composes and instantiates anywhere but is rejected on CPU by
:func:`check_sparse_on_device` before anything is built.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from omegaconf import II
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper

from recsys_runner.errors import ConfigError, require


def _check_common(where: str, lr: float, weight_decay: float) -> None:
    require(lr > 0, f"{where}.lr must be positive, got {lr}. Fix: e.g. optim.lr=0.01")
    require(weight_decay >= 0, f"{where}.weight_decay must be >= 0, got {weight_decay}")


@dataclass(kw_only=True)
class OptimConfig:
    """Schema of every ``conf/optim/*.yaml``: a shared lr plus one sparse and one dense optimizer."""

    lr: float = 0.01
    """Learning rate used by both optimizers unless ``optim.sparse.lr``/``optim.dense.lr`` are set."""
    sparse: Any = None
    """Fused embedding optimizer; choose with ``optim/sparse=<name>``."""
    dense: Any = None
    """Dense optimizer; choose with ``optim/dense=<name>``."""
    parts: dict[str, Any] = field(default_factory=dict)
    """Part-wise dense optimizers by parameter-name regex, each ``{pattern, optimizer, scheduler}``
    (:class:`PartConfig`), e.g. ``+optim.parts.over={pattern: over_arch, optimizer: {_target_:
    torch.optim.SGD, _partial_: true, lr: 0.1}}``; parameters no part matches use ``optim.dense``."""
    sparse_scheduler: Any = None
    """Schedule of the sparse lr only; ``null`` uses the top-level ``scheduler``. Set with
    ``+scheduler@optim.sparse_scheduler=cosine``."""
    dense_scheduler: Any = None
    """Schedule of the dense lr only; ``null`` uses the top-level ``scheduler``
    (``+scheduler@optim.dense_scheduler=exponential_decay``)."""

    def __post_init__(self) -> None:
        require(self.lr > 0, f"optim.lr must be positive, got {self.lr}. Fix: e.g. optim.lr=0.01")
        require(self.sparse is not None, "optim.sparse is not set; choose one with optim/sparse=adagrad (or sgd, rowwise_adagrad, adam)")
        require(self.dense is not None, "optim.dense is not set; choose one with optim/dense=adagrad (or sgd, adam)")
        for name, part in self.parts.items():
            require(isinstance(part, dict) and set(part) <= {"pattern", "optimizer", "scheduler"} and "pattern" in part,
                    f"optim.parts.{name} must be {{pattern: <regex>, optimizer: {{_target_: …}}, scheduler: <optional>}}, got {part}")
            PartConfig(**part).check(name)


@dataclass(kw_only=True)
class PartConfig:
    """One part-wise dense optimizer: ``optim.parts.<name>``."""

    pattern: str
    """Regular expression searched (``re.search``) in each dense parameter's name, e.g. ``over_arch``."""
    optimizer: Any = None
    """A dense optimizer config (``_target_`` a ``torch.optim`` class, ``_partial_: true``, its own ``lr``)."""
    scheduler: Any = None
    """The part's own schedule; ``null`` uses ``optim.dense_scheduler`` or else ``scheduler``."""

    def check(self, name: str) -> None:
        """Called from ``OptimConfig.__post_init__`` (parts are free-form dicts in the schema: OmegaConf
        cannot add keys to a dict of dataclasses from the command line)."""
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ConfigError(f"optim.parts.{name}.pattern={self.pattern!r} is not a valid regular expression: {e}") from None
        require(self.optimizer is not None, f"optim.parts.{name} has no optimizer; set optim.parts.{name}.optimizer="
                "{_target_: torch.optim.SGD, _partial_: true, lr: 0.1} (any torch.optim class)")


# ----- sparse (fused, fbgemm) -------------------------------------------------------------------

_WEIGHT_DECAY_MODES = ("none", "l2", "decouple")


@dataclass(kw_only=True)
class _FusedExtras:
    weight_decay_mode: str = "none"
    """How ``weight_decay`` is applied by fbgemm: ``none``, ``l2`` (added to the gradient) or
    ``decouple`` (AdamW-style, applied to the weights)."""
    gradient_clipping: bool = False
    """Clip each embedding gradient element to ``[-max_gradient, max_gradient]`` inside the kernel."""
    max_gradient: float = 1.0
    """Clipping threshold when ``gradient_clipping`` is on."""

    def _check_extras(self, weight_decay: float) -> None:
        require(self.weight_decay_mode in _WEIGHT_DECAY_MODES,
                f"optim.sparse.weight_decay_mode={self.weight_decay_mode!r} must be one of {_WEIGHT_DECAY_MODES}")
        require(self.max_gradient > 0, f"optim.sparse.max_gradient must be positive, got {self.max_gradient}")
        require(weight_decay == 0 or self.weight_decay_mode != "none",
                f"optim.sparse.weight_decay={weight_decay} has no effect with weight_decay_mode=none; "
                "set optim.sparse.weight_decay_mode=l2 (or decouple)")



@dataclass(kw_only=True)
class SparseSGDConfig:
    """Plain SGD on embedding rows (fbgemm ``EXACT_SGD``)."""

    _target_: str = "torchrec.optim.SGD"
    _partial_: bool = True
    lr: float = II("..lr")

    def __post_init__(self) -> None:
        _check_common("optim.sparse", self.lr, 0.0)


@dataclass(kw_only=True)
class SparseAdagradConfig(_FusedExtras):
    """Adagrad with one accumulator per embedding element (fbgemm ``EXACT_ADAGRAD``)."""

    _target_: str = "torchrec.optim.Adagrad"
    _partial_: bool = True
    lr: float = II("..lr")
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_common("optim.sparse", self.lr, self.weight_decay)
        require(self.eps > 0, f"optim.sparse.eps must be positive, got {self.eps}")
        self._check_extras(self.weight_decay)


@dataclass(kw_only=True)
class SparseRowWiseAdagradConfig(SparseAdagradConfig):
    """Adagrad with one accumulator per embedding *row*: D× less optimizer state; the usual
    choice for large tables (fbgemm ``EXACT_ROWWISE_ADAGRAD``)."""

    _target_: str = "torchrec.optim.RowWiseAdagrad"


@dataclass(kw_only=True)
class SparseAdamConfig(_FusedExtras):
    """Adam on embedding rows (fbgemm ``ADAM``, GPU only); keeps two moments per element."""

    _target_: str = "torchrec.optim.Adam"
    _partial_: bool = True
    lr: float = II("..lr")
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_common("optim.sparse", self.lr, self.weight_decay)
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"optim.sparse.beta1/beta2 must lie in [0, 1), got {self.beta1}, {self.beta2}")
        require(self.eps > 0, f"optim.sparse.eps must be positive, got {self.eps}")
        self._check_extras(self.weight_decay)


@dataclass(kw_only=True)
class SparsePartialRowWiseAdamConfig(SparseAdamConfig):
    """Adam whose second moment is kept per row (fbgemm ``PARTIAL_ROWWISE_ADAM``, GPU only)."""

    _target_: str = "torchrec.optim.PartialRowWiseAdam"


@dataclass(kw_only=True)
class SparseLAMBConfig(SparseAdamConfig):
    """LAMB: Adam with a per-table trust ratio (fbgemm ``LAMB``, GPU only)."""

    _target_: str = "torchrec.optim.LAMB"


@dataclass(kw_only=True)
class SparsePartialRowWiseLAMBConfig(SparseAdamConfig):
    """LAMB with a row-wise second moment (fbgemm ``PARTIAL_ROWWISE_LAMB``, GPU only)."""

    _target_: str = "torchrec.optim.PartialRowWiseLAMB"


@dataclass(kw_only=True)
class SparseLarsSGDConfig(_FusedExtras):
    """LARS SGD: SGD with a layer-wise trust ratio (fbgemm ``LARS_SGD``, GPU only)."""

    _target_: str = "torchrec.optim.LarsSGD"
    _partial_: bool = True
    lr: float = II("..lr")
    eta: float = 0.001
    """LARS trust coefficient."""
    momentum: float = 0.9
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_common("optim.sparse", self.lr, self.weight_decay)
        require(self.eta > 0, f"optim.sparse.eta must be positive, got {self.eta}")
        require(0 <= self.momentum < 1, f"optim.sparse.momentum must lie in [0, 1), got {self.momentum}")
        self._check_extras(self.weight_decay)


# ----- dense (torch.optim) ----------------------------------------------------------------------


@dataclass(kw_only=True)
class DenseSGDConfig:
    """``torch.optim.SGD`` for the dense parameters."""

    _target_: str = "torch.optim.SGD"
    _partial_: bool = True
    lr: float = II("..lr")
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_common("optim.dense", self.lr, self.weight_decay)
        require(not self.nesterov or self.momentum > 0, "optim.dense.nesterov=true needs optim.dense.momentum > 0")


@dataclass(kw_only=True)
class DenseAdagradConfig:
    """``torch.optim.Adagrad`` for the dense parameters."""

    _target_: str = "torch.optim.Adagrad"
    _partial_: bool = True
    lr: float = II("..lr")
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_common("optim.dense", self.lr, self.weight_decay)


@dataclass(kw_only=True)
class DenseAdamConfig:
    """``torch.optim.Adam`` for the dense parameters."""

    _target_: str = "torch.optim.Adam"
    _partial_: bool = True
    lr: float = II("..lr")
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_common("optim.dense", self.lr, self.weight_decay)
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                f"optim.dense.betas needs two values in [0, 1), got {self.betas}")


@dataclass(kw_only=True)
class DenseAdamWConfig(DenseAdamConfig):
    """``torch.optim.AdamW`` (decoupled weight decay) for the dense parameters."""

    _target_: str = "torch.optim.AdamW"
    weight_decay: float = 0.01


CPU_FUSED_SPARSE = {"torchrec.optim.SGD": "sgd", "torchrec.optim.Adagrad": "adagrad", "torchrec.optim.RowWiseAdagrad": "rowwise_adagrad"}
"""Sparse optimizers for which fbgemm has a CPU kernel (its CPU build asserts on any other)."""


def check_sparse_on_device(sparse_target: str, device_type: str) -> None:
    """Fail early, with the alternatives, when fbgemm has no kernel for this optimizer here."""
    if device_type == "cpu" and sparse_target not in CPU_FUSED_SPARSE:
        name = sparse_target.rsplit(".", 1)[-1]
        raise ConfigError(
            f"optim.sparse is {name}, which fbgemm implements only on GPU; on CPU the fused embedding optimizers "
            f"are {sorted(CPU_FUSED_SPARSE.values())}. Fix: optim/sparse=rowwise_adagrad (keeping your dense "
            f"optimizer, e.g. optim/dense=adam), or run on a CUDA device."
        )


# ----- groups -----------------------------------------------------------------------------------


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


# ----- wiring -----------------------------------------------------------------------------------


def fbgemm_kwargs(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """A sparse optimizer's config kwargs as fbgemm takes them (``weight_decay_mode`` as its enum)."""
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

    out = dict(keywords)
    if "weight_decay_mode" in out:
        out["weight_decay_mode"] = WeightDecayMode[str(out["weight_decay_mode"]).upper()]
    return out


def apply_sparse_optimizer(model: nn.Module, sparse: functools.partial[torch.optim.Optimizer]) -> None:
    """Attach the fused optimizer to every embedding module's parameters in ``model``.

    Must run before DistributedModelParallel: the sharder reads the attached class and kwargs to
    build fbgemm's fused kernels.
    """
    embedding_modules = [m for m in model.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]
    assert embedding_modules, "model has no embedding module; every model builds a SparseArch"
    for module in embedding_modules:
        apply_optimizer_in_backward(sparse.func, module.parameters(), fbgemm_kwargs(sparse.keywords))


def dense_optimizers(
    params: Mapping[str, nn.Parameter],
    dense: Callable[..., torch.optim.Optimizer],
    parts: Mapping[str, tuple[str, Callable[..., torch.optim.Optimizer]]],
) -> list[tuple[OptimizerGroup, KeyedOptimizer]]:
    """Split dense ``params`` by the parts' regexes: ``[(OptimizerGroup.part(<name>), opt), …, (DENSE, opt)]``.

    ``parts`` maps a part name to ``(pattern, optimizer partial)``; the first matching part takes a
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
        out.append((OptimizerGroup.part(name), KeyedOptimizerWrapper(taken, lambda ps, f=factory: f(ps))))
    if remaining:
        out.append((DENSE, KeyedOptimizerWrapper(remaining, lambda ps: dense(ps))))
    return out
