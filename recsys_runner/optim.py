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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import II
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

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

    def __post_init__(self) -> None:
        require(self.lr > 0, f"optim.lr must be positive, got {self.lr}. Fix: e.g. optim.lr=0.01")
        require(self.sparse is not None, "optim.sparse is not set; choose one with optim/sparse=adagrad (or sgd, rowwise_adagrad, adam)")
        require(self.dense is not None, "optim.dense is not set; choose one with optim/dense=adagrad (or sgd, adam)")


# ----- sparse (fused, fbgemm) -------------------------------------------------------------------


@dataclass(kw_only=True)
class SparseSGDConfig:
    """Plain SGD on embedding rows (fbgemm ``EXACT_SGD``)."""

    _target_: str = "torchrec.optim.SGD"
    _partial_: bool = True
    lr: float = II("..lr")

    def __post_init__(self) -> None:
        _check_common("optim.sparse", self.lr, 0.0)


@dataclass(kw_only=True)
class SparseAdagradConfig:
    """Adagrad with one accumulator per embedding element (fbgemm ``EXACT_ADAGRAD``)."""

    _target_: str = "torchrec.optim.Adagrad"
    _partial_: bool = True
    lr: float = II("..lr")
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_common("optim.sparse", self.lr, self.weight_decay)
        require(self.eps > 0, f"optim.sparse.eps must be positive, got {self.eps}")


@dataclass(kw_only=True)
class SparseRowWiseAdagradConfig(SparseAdagradConfig):
    """Adagrad with one accumulator per embedding *row*: D× less optimizer state; the usual
    choice for large tables (fbgemm ``EXACT_ROWWISE_ADAGRAD``)."""

    _target_: str = "torchrec.optim.RowWiseAdagrad"


@dataclass(kw_only=True)
class SparseAdamConfig:
    """Adam on embedding rows (fbgemm ``ADAM``); keeps two moments per element."""

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
        require(len(self.betas) == 2, f"optim.dense.betas needs two values, got {self.betas}")


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


# ----- wiring -----------------------------------------------------------------------------------


def apply_sparse_optimizer(model: nn.Module, sparse: functools.partial[torch.optim.Optimizer]) -> None:
    """Attach the fused optimizer to every embedding module's parameters in ``model``.

    Must run before DistributedModelParallel: the sharder reads the attached class and kwargs to
    build fbgemm's fused kernels.
    """
    embedding_modules = [m for m in model.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]
    assert embedding_modules, "model has no embedding module; every model builds a SparseArch"
    for module in embedding_modules:
        apply_optimizer_in_backward(sparse.func, module.parameters(), dict(sparse.keywords))
