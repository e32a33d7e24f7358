"""The fused sparse (embedding) optimizers: ``optim.sparse``'s configs, and attaching the chosen one to the tables.

The config's ``_target_`` is one of TorchRec's optimizer classes that fbgemm implements as a fused kernel.
:func:`apply_sparse_optimizer` attaches it to every embedding parameter with ``apply_optimizer_in_backward``; when
DistributedModelParallel shards the tables, the kernel updates each row *during* the backward pass, so embedding
gradients are never materialized. Its keyword arguments are passed to fbgemm as-is (``lr`` becomes
``learning_rate``), which is why Adam takes ``beta1``/``beta2`` here, not ``betas``.

The ``_target_`` names a class that is not ours (a ``torchrec.optim`` class), so unlike other
:class:`~recsys_runner.configurable.Configurable` configs :class:`SparseOptimizerConfig` does not pass itself to it: it
hands its class and keyword arguments to TorchRec (:func:`apply_sparse_optimizer`).

fbgemm's CPU build implements only ``sgd``, ``adagrad`` and ``rowwise_adagrad``; every other fused optimizer composes
and instantiates anywhere but is rejected on CPU by :func:`check_sparse_on_device` before anything is built. The dense
optimizers, and how the run's optimizers are combined, are :mod:`recsys_runner.optim.optimizers`'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed.optim  # noqa: F401 - imported now, before any process group exists: see below
from omegaconf import II
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from recsys_runner.configurable import Configurable
from recsys_runner.errors import ConfigError, require
from recsys_runner.optim.compat import WeightDecayMode
from recsys_runner.optim.optimizers import check_eps, check_rate_and_decay, optimizer_kwargs

# TorchRec's apply_optimizer_in_backward imports torch.distributed.optim on its first call, and that package's
# zero_redundancy_optimizer binds dist.group.WORLD as a default argument as it is imported: the first job of a process,
# whose group is WORLD then, left that group (its gloo threads, sockets and pipes, and its store) held for the rest of
# the process. Imported with this module (above), before any job's group, it binds None.


@dataclass(kw_only=True)
class SparseOptimizerConfig(Configurable):
    """Base of every fused embedding optimizer's config (``optim.sparse``, ``conf/optim/sparse/*.yaml``).

    ``_target_`` is a TorchRec optimizer class (``torchrec.optim.Adagrad`` …), which is never
    instantiated here: :func:`apply_sparse_optimizer` attaches :meth:`optimizer_class` with
    :meth:`kwargs` to the embedding parameters and fbgemm builds the fused kernel from them.
    """

    lr: float = II("..lr")
    """The embedding learning rate; ``optim.lr`` unless set."""

    def __post_init__(self) -> None:
        check_rate_and_decay("optim.sparse", self.lr, 0.0)

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The TorchRec optimizer class ``_target_`` names."""
        cls = self.component_class()
        if not issubclass(cls, torch.optim.Optimizer):
            raise ConfigError(f"optim.sparse._target_={self._target_} is not an optimizer class; e.g. torchrec.optim.RowWiseAdagrad")
        return cls

    def kwargs(self) -> dict[str, Any]:
        """The fields but ``_target_``, as fbgemm takes them: passed as-is (``lr`` becomes its ``learning_rate``)."""
        return optimizer_kwargs(self)

_WEIGHT_DECAY_MODES = ("none", "l2", "decouple")
_MAX_GRADIENT = 1.0
"""``max_gradient``'s default: any other value set while ``gradient_clipping`` is off is a mistake."""


@dataclass(kw_only=True)
class _FusedConfig(SparseOptimizerConfig):
    """The fields every fused optimizer but plain SGD has: weight decay and in-kernel gradient clipping."""

    weight_decay: float = 0.0
    weight_decay_mode: str = "none"
    """How ``weight_decay`` is applied by fbgemm: ``none``, ``l2`` (added to the gradient) or
    ``decouple`` (AdamW-style, applied to the weights). Only the modes the optimizer's kernel has are accepted
    (:attr:`decay_modes`)."""
    gradient_clipping: bool = False
    """Clip each embedding gradient element to ``[-max_gradient, max_gradient]`` inside the kernel."""
    max_gradient: float = _MAX_GRADIENT
    """Clipping threshold when ``gradient_clipping`` is on (another value with it off is refused: it would do nothing)."""

    decay_modes: ClassVar[tuple[str, ...]] = ("l2", "decouple")
    """The weight decay modes fbgemm's kernel for this optimizer really applies. Only row-wise Adagrad's kernel reads
    ``weight_decay_mode``; the others apply ``weight_decay`` one fixed way whatever the mode says (Adam and LAMB
    decoupled, LARS added to the gradient), and exact Adagrad's kernel takes no weight decay at all (fbgemm's
    ``lookup_<optimizer>`` invokers pass it only ``eps``). A mode the kernel does not apply would be silently wrong."""

    def __post_init__(self) -> None:
        check_rate_and_decay("optim.sparse", self.lr, self.weight_decay)
        require(self.weight_decay_mode in _WEIGHT_DECAY_MODES,
                f"optim.sparse.weight_decay_mode={self.weight_decay_mode!r} must be one of {_WEIGHT_DECAY_MODES}")
        name, modes = self._target_.rsplit(".", 1)[-1], self.decay_modes or ("none",)
        require(self.weight_decay == 0 or bool(self.decay_modes),
                f"optim.sparse.weight_decay={self.weight_decay}: fbgemm's {name} kernel has no weight decay (it would do "
                f"nothing). Fix: optim/sparse=rowwise_adagrad with optim.sparse.weight_decay_mode=l2 (or decouple), or "
                f"optim.sparse.weight_decay=0")
        require(self.weight_decay == 0 or self.weight_decay_mode in ("none", *self.decay_modes),
                f"optim.sparse.weight_decay_mode={self.weight_decay_mode}: fbgemm's {name} kernel ignores the mode and applies "
                f"weight decay as {'/'.join(modes)} only. Fix: optim.sparse.weight_decay_mode={modes[0]}")
        require(self.max_gradient > 0, f"optim.sparse.max_gradient must be positive, got {self.max_gradient}")
        require(self.gradient_clipping or self.max_gradient == _MAX_GRADIENT,
                f"optim.sparse.max_gradient={self.max_gradient} does nothing while optim.sparse.gradient_clipping is off "
                f"(the bound applies only with the switch). Fix: "
                f"optim.sparse.gradient_clipping=true optim.sparse.max_gradient={self.max_gradient}")
        require(self.weight_decay == 0 or self.weight_decay_mode != "none",
                f"optim.sparse.weight_decay={self.weight_decay} with weight_decay_mode=none does not say how it is applied "
                f"(fbgemm's {name} kernel: {' or '.join(modes)}). Fix: optim.sparse.weight_decay_mode={modes[0]}")

    def kwargs(self) -> dict[str, Any]:
        """As the base, with ``weight_decay_mode`` as fbgemm's ``WeightDecayMode`` enum."""
        return {**optimizer_kwargs(self), "weight_decay_mode": WeightDecayMode[self.weight_decay_mode.upper()]}


@dataclass(kw_only=True)
class SparseSGDConfig(SparseOptimizerConfig):
    """Plain SGD on embedding rows (fbgemm ``EXACT_SGD``)."""

    _target_: str = "torchrec.optim.SGD"


@dataclass(kw_only=True)
class SparseAdagradConfig(_FusedConfig):
    """Adagrad with one accumulator per embedding element (fbgemm ``EXACT_ADAGRAD``)."""

    _target_: str = "torchrec.optim.Adagrad"
    decay_modes: ClassVar[tuple[str, ...]] = ()
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        check_eps("optim.sparse", self.eps)


@dataclass(kw_only=True)
class SparseRowWiseAdagradConfig(SparseAdagradConfig):
    """Adagrad with one accumulator per embedding *row*: D× less optimizer state; the usual
    choice for large tables (fbgemm ``EXACT_ROWWISE_ADAGRAD``)."""

    _target_: str = "torchrec.optim.RowWiseAdagrad"
    decay_modes: ClassVar[tuple[str, ...]] = ("l2", "decouple")


@dataclass(kw_only=True)
class SparseAdamConfig(_FusedConfig):
    """Adam on embedding rows (fbgemm ``ADAM``, GPU only); keeps two moments per element."""

    _target_: str = "torchrec.optim.Adam"
    decay_modes: ClassVar[tuple[str, ...]] = ("decouple",)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"optim.sparse.beta1/beta2 must lie in [0, 1), got {self.beta1}, {self.beta2}")
        check_eps("optim.sparse", self.eps)


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
class SparseLarsSGDConfig(_FusedConfig):
    """LARS SGD: SGD with a layer-wise trust ratio (fbgemm ``LARS_SGD``, GPU only)."""

    _target_: str = "torchrec.optim.LarsSGD"
    decay_modes: ClassVar[tuple[str, ...]] = ("l2",)
    eta: float = 0.001
    """LARS trust coefficient."""
    momentum: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.eta > 0, f"optim.sparse.eta must be positive, got {self.eta}")
        require(0 <= self.momentum < 1, f"optim.sparse.momentum must lie in [0, 1), got {self.momentum}")


CPU_FUSED_SPARSE = {"torchrec.optim.SGD": "sgd", "torchrec.optim.Adagrad": "adagrad", "torchrec.optim.RowWiseAdagrad": "rowwise_adagrad"}
"""Sparse optimizers for which fbgemm has a CPU kernel (its CPU build asserts on any other)."""

NOT_CHECKPOINTABLE_SPARSE = {"LarsSGD": "lars_sgd"}
"""Sparse optimizers (by class name) whose state TorchRec cannot export (fbgemm's ``get_optimizer_state`` raises
``NotImplementedError`` for them), so a run using one dies at its first checkpoint."""


def check_sparse_on_device(sparse: SparseOptimizerConfig, device_type: str, checkpoints: bool = False) -> None:
    """Fail early, with the alternatives, when fbgemm has no kernel for this optimizer here, when its kernel here would
    ignore a setting (weight decay on CPU: measured, ``test_cpu_kernels_ignore_sparse_weight_decay``), or when
    the run would save ``checkpoints`` (any: at the end, periodic or best) of an optimizer whose state
    TorchRec cannot export."""
    name = sparse._target_.rsplit(".", 1)[-1]
    if device_type == "cpu" and sparse._target_ not in CPU_FUSED_SPARSE:
        raise ConfigError(
            f"optim.sparse is {name}, which fbgemm implements only on GPU; on CPU the fused embedding optimizers "
            f"are {sorted(CPU_FUSED_SPARSE.values())}. Fix: optim/sparse=rowwise_adagrad (keeping your dense "
            f"optimizer, e.g. optim/dense=adam), or run on a CUDA device."
        )
    weight_decay = getattr(sparse, "weight_decay", 0.0)
    if device_type == "cpu" and weight_decay > 0:
        raise ConfigError(
            f"optim.sparse.weight_decay={weight_decay}: fbgemm's CPU kernels ({name} included) apply no weight decay, in "
            f"any weight_decay_mode, so it would silently do nothing on CPU. Fix: optim.sparse.weight_decay=0 on CPU, "
            f"or run on a CUDA device"
        )
    if checkpoints and name in NOT_CHECKPOINTABLE_SPARSE:
        choice = NOT_CHECKPOINTABLE_SPARSE[name]
        raise ConfigError(
            f"optim/sparse={choice} ({name}) cannot be checkpointed: TorchRec cannot export its optimizer state "
            f"(fbgemm raises NotImplementedError at the first save). Fix: checkpoint=none, or another sparse "
            f"optimizer (optim/sparse=lamb, adam or rowwise_adagrad)."
        )


def sparse_accumulation_warning(sparse: SparseOptimizerConfig, accumulation_steps: int, batch_size: int) -> str | None:
    """What ``train.grad_accum_steps`` does *not* do to the embedding tables, for every fused optimizer but SGD; ``None``
    when there is nothing to say (no accumulation, or SGD).

    Why: fbgemm updates the rows inside every micro-batch's backward. The loss is divided by the accumulation steps, so
    SGD's per-micro-batch updates add up to the large-batch one. Every other fused optimizer normalizes the gradient
    (Adagrad's and Adam's ``g / sqrt(sum g²)``, LAMB's and LARS's trust ratio): dividing it by ``N`` leaves the update
    as it was, so the tables take ``N`` full-size steps on ``batch_size`` rows per optimizer step — the same as without
    accumulation — while the dense part trains on the ``N``-times larger batch. A user expecting the large-batch
    update for both parts (TorchEasyRec's ``gradient_accumulation_steps`` reads that way) is told so at build time.
    """
    if accumulation_steps == 1 or sparse._target_ == "torchrec.optim.SGD":
        return None
    name = sparse._target_.rsplit(".", 1)[-1]
    return (f"train.grad_accum_steps={accumulation_steps} accumulates the dense gradients only: the fused {name} still updates "
            f"the embedding tables at every micro-batch, and its update does not shrink with the loss's 1/{accumulation_steps} "
            f"(it normalizes the gradient), so the tables take {accumulation_steps} full-size steps on data.batch_size="
            f"{batch_size} rows per optimizer step, exactly as without accumulation. For large-batch embedding updates raise "
            f"data.batch_size instead, or use optim/sparse=sgd, whose micro-batch updates add up to the large-batch one")


def apply_sparse_optimizer(model: nn.Module, sparse: SparseOptimizerConfig) -> None:
    """Attach the fused optimizer ``sparse`` describes to every embedding module's parameters in ``model``.

    Must run before DistributedModelParallel: the sharder reads the attached class and kwargs to
    build fbgemm's fused kernels.
    """
    embedding_modules = [m for m in model.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]
    assert embedding_modules, "model has no embedding module; every model builds a SparseArch"
    optimizer_class, kwargs = sparse.optimizer_class(), sparse.kwargs()
    for module in embedding_modules:
        apply_optimizer_in_backward(optimizer_class, module.parameters(), kwargs)
