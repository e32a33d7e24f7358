"""Precision policy: the dense compute dtype, fp16 loss scaling, TF32 switches.

``fp32`` runs everything in float32. ``bf16`` and ``fp16`` run the dense arches under
``torch.autocast`` in that dtype — on CPU too (torch's CPU autocast supports both; recent x86
cores have native bf16 matmul, fp16 is mostly emulated there and useful to test the code path).
Parameters, optimizer state, the embedding tables and the loss stay in float32.

fp16 has a narrow exponent, so small gradients underflow: ``precision.grad_scaler`` multiplies
the loss by a dynamic scale before backward (``torch.amp.GradScaler``), unscales the dense
gradients before clipping and the optimizer step, skips steps whose gradients overflowed and
adapts the scale (``growth_factor`` after ``growth_interval`` good steps, ``backoff_factor`` after
an overflow). The fused embedding optimizer updates rows *inside* backward, so the gradient
reaching the embedding tables is unscaled on its way there (:mod:`recsys_runner.train.loss_scale`, which also logs
the scale and the count of skipped steps, ``train/loss_scale`` and ``train/skipped_steps``). A skipped step leaves the
dense EMA as it was; the lr schedule goes on with the run's step (docs/training.md says why).
bf16 has fp32's exponent range and needs no scaler.

``allow_tf32_matmul`` / ``allow_tf32_cudnn`` let CUDA matmuls / cuDNN convolutions use TF32
tensor cores (Ampere and newer): ~10 bits of mantissa instead of 23, much faster. They are
process-wide torch flags; on CPU they are set but change nothing (no TF32 on CPUs).
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
from torchrec.types import DataType

from recsys_runner.configurable import Configurable
from recsys_runner.errors import ConfigError, require

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

EMBEDDING_DATA_TYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16}
"""``precision.embedding_data_type``'s (and ``embedding_data_type_by_feature``'s) choices: TorchRec's ``DataType`` of an
embedding table."""


def _check_table_type(key: str, value: str) -> None:
    """Refuse a table type fbgemm cannot train here (``bf16``) or that is not one of :data:`EMBEDDING_DATA_TYPES`, naming
    ``key`` (``precision.embedding_data_type``, or ``precision.embedding_data_type_by_feature.<feature>``) and the fix."""
    require(value != "bf16",
            f"{key}=bf16 is not offered: fbgemm-gpu-cpu 1.8's CPU kernels have no bfloat16 table "
            "(the first lookup fails: split_embedding_cpu_forward not implemented for BFloat16), and it is untested on "
            f"CUDA here. Fix: {key}=fp16 (half the table "
            "memory, as bf16), with precision=bf16 for the dense arches if you want bf16 compute")
    require(value in EMBEDDING_DATA_TYPES,
            f"{key}={value!r} is not one of {list(EMBEDDING_DATA_TYPES)}. "
            f"Fix: {key}=fp16 (half the table memory) or fp32 (the default)")


@dataclass(kw_only=True)
class GradScalerConfig:
    """``precision.grad_scaler``: dynamic loss scaling (used with ``dtype: fp16``)."""

    enabled: bool | None = None
    """``null``: on for fp16, off otherwise; ``true`` forces it on (any dtype), ``false`` off."""
    init_scale: float = 65536.0
    """Initial loss scale."""
    growth_factor: float = 2.0
    """The scale is multiplied by this after ``growth_interval`` steps without overflow."""
    backoff_factor: float = 0.5
    """The scale is multiplied by this after a step whose gradients overflowed (the step is skipped)."""
    growth_interval: int = 2000
    """Overflow-free steps before the scale grows."""

    def __post_init__(self) -> None:
        require(self.init_scale > 0, f"precision.grad_scaler.init_scale must be positive, got {self.init_scale}")
        require(self.growth_factor > 1, f"precision.grad_scaler.growth_factor must be > 1, got {self.growth_factor}")
        require(0 < self.backoff_factor < 1, f"precision.grad_scaler.backoff_factor must lie in (0, 1), got {self.backoff_factor}")
        require(self.growth_interval > 0, f"precision.grad_scaler.growth_interval must be positive, got {self.growth_interval}")


@dataclass(kw_only=True)
class PrecisionConfig(Configurable):
    """Schema of ``conf/precision/*.yaml``; builds :class:`Precision`."""

    _target_: str = "recsys_runner.train.precision.Precision"
    dtype: str = "fp32"
    """Dense compute dtype: ``fp32``, ``bf16`` or ``fp16``."""
    grad_scaler: GradScalerConfig = field(default_factory=GradScalerConfig)
    """Dynamic loss scaling; on by default for fp16 only."""
    embedding_data_type: str = "fp32"
    """How the embedding tables store their weights: ``fp32`` or ``fp16`` (half the table memory; TorchEasyRec's
    feature ``data_type``, TorchRec's ``EmbeddingBagConfig.data_type``, fbgemm's ``weights_precision``). Independent of
    ``dtype``: the tables' pooled output and their optimizer state stay float32 (docs/performance.md). The type of every
    table no feature of ``embedding_data_type_by_feature`` reads."""
    embedding_data_type_by_feature: dict[str, str] = field(default_factory=dict)
    """Sparse feature name → ``fp32`` or ``fp16``: the type of the tables that feature reads (its own ``t_<name>``, a table
    it shares (``data.sparse[].table``), and a model's tables beside it such as DeepFM's ``first_order_t_<name>``), in place
    of ``embedding_data_type`` (TorchEasyRec's per-feature ``data_type``). On the command line
    ``+precision.embedding_data_type_by_feature={cat_0: fp16, cat_1: fp16}``. A name no sparse feature of the data has is
    an error naming the closest ones; features that share a table must not ask for different types."""
    allow_tf32_matmul: bool = False
    """``torch.backends.cuda.matmul.allow_tf32`` (CUDA only; torch's default is off)."""
    allow_tf32_cudnn: bool = True
    """``torch.backends.cudnn.allow_tf32`` (CUDA only; torch's default is on)."""

    def __post_init__(self) -> None:
        require(self.dtype in _DTYPES, f"precision.dtype={self.dtype!r} is not one of {sorted(_DTYPES)}; "
                "choose precision=fp32, precision=bf16 or precision=fp16")
        _check_table_type("precision.embedding_data_type", self.embedding_data_type)
        for feature, value in self.embedding_data_type_by_feature.items():
            _check_table_type(f"precision.embedding_data_type_by_feature.{feature}", value)

    @property
    def half_tables(self) -> bool:
        """Whether any table may be stored in less than fp32 (``embedding_data_type`` or one feature's)."""
        return any(t != "fp32" for t in (self.embedding_data_type, *self.embedding_data_type_by_feature.values()))

    def check_features(self, names: Collection[str]) -> None:
        """Refuse a feature of ``embedding_data_type_by_feature`` that is not among the data's sparse feature ``names``.

        Why here, once the data is built: a data module may learn its features from its files (a Parquet schema).

        Raises:
            ConfigError: naming the unknown features, the closest of ``names`` and the valid ones.
        """
        unknown = [f for f in self.embedding_data_type_by_feature if f not in names]
        if not unknown:
            return
        closest = {f: difflib.get_close_matches(f, list(names), n=1, cutoff=0.0) for f in unknown}
        hints = ", ".join(f"{f!r} (closest: {c[0]})" if c else repr(f) for f, c in closest.items())
        raise ConfigError(f"precision.embedding_data_type_by_feature names {hints}, which the data has no sparse feature of; "
                          f"its sparse features: {', '.join(names)}. Fix: name one of them, or drop the entry")

    def table_data_type(self, table: str, features: Sequence[str]) -> DataType:
        """TorchRec's ``DataType`` of embedding table ``table``, read by ``features``: the one
        ``embedding_data_type_by_feature`` gives them, else ``embedding_data_type``.

        Raises:
            ConfigError: two of ``features`` (sharing the table) are given different types.
        """
        chosen = {f: self.embedding_data_type_by_feature[f] for f in features if f in self.embedding_data_type_by_feature}
        types = set(chosen.values())
        if len(types) > 1:
            raise ConfigError(f"precision.embedding_data_type_by_feature gives table {table!r} more than one type: "
                              f"{', '.join(f'{f}: {t}' for f, t in chosen.items())}; the features {list(features)} share "
                              f"its rows. Fix: give them one type")
        return EMBEDDING_DATA_TYPES[types.pop() if types else self.embedding_data_type]

    def build(self) -> Precision:
        """The :class:`Precision` this config describes."""
        built: Precision = self.component_class()(self)
        return built


class Precision:
    """Turns the configured dtype into an autocast context and a loss scaler for a device type."""

    def __init__(self, config: PrecisionConfig) -> None:
        self.config = config

    def apply_tf32(self) -> None:
        """Set torch's process-wide TF32 switches (no effect on CPU computation)."""
        torch.backends.cuda.matmul.allow_tf32 = self.config.allow_tf32_matmul
        torch.backends.cudnn.allow_tf32 = self.config.allow_tf32_cudnn

    def autocast(self, device: torch.device) -> torch.autocast | None:
        """The autocast to run the dense forward under, or ``None`` for float32."""
        fast = _DTYPES[self.config.dtype]
        return None if fast is None else torch.autocast(device_type=device.type, dtype=fast)

    def table_rounding_warning(self, device: torch.device) -> str | None:
        """What fp16 tables lose when trained on a CPU, for the run's log; ``None`` elsewhere (float32 tables, CUDA).

        Why: fbgemm's CPU kernels (fbgemm-gpu-cpu 1.8) round each updated weight to the nearest fp16, with or without
        ``stochastic_rounding`` (measured: 1000 SGD steps of 1e-4 on a weight of 1.0 leave it at 1.0 in fp16, 0.9 in
        fp32), where its CUDA kernels round stochastically, so that small updates add up on average."""
        if not self.config.half_tables or device.type != "cpu":
            return None
        setting = ("precision.embedding_data_type=fp16" if self.config.embedding_data_type != "fp32"
                   else "fp16 tables of precision.embedding_data_type_by_feature")
        return (f"{setting} on CPU: fbgemm's CPU kernels round every embedding update to the nearest "
                "fp16 (no stochastic rounding, which its CUDA kernels use), so an update smaller than half an fp16 step of its "
                "weight (about |w|/2048) is lost: a small optim.sparse.lr, or Adagrad's shrinking steps late in a run, may stop "
                "training the tables. Compare eval metrics with precision.embedding_data_type=fp32 before relying on it")

    def line(self, device: torch.device) -> str | None:
        """What the run computes and stores in, for its log, where it is not float32 throughout (``None`` then): a run
        in bf16 or fp16 says so once at start, not only in its MLflow params."""
        c = self.config
        if c.dtype == "fp32" and not c.half_tables:
            return None
        tables = c.embedding_data_type + (f" ({len(c.embedding_data_type_by_feature)} features' tables by "
                                          "precision.embedding_data_type_by_feature)" if c.embedding_data_type_by_feature else "")
        dense = "fp32" if c.dtype == "fp32" else f"{c.dtype} (autocast on {device.type}; weights and optimizer fp32)"
        return f"precision: dense compute {dense}, embedding tables {tables}, loss scaling {'on' if self.scales_loss else 'off'}"

    @property
    def scales_loss(self) -> bool:
        """Whether loss scaling is on: ``precision.grad_scaler.enabled``, by default for fp16 only."""
        enabled = self.config.grad_scaler.enabled
        return enabled if enabled is not None else self.config.dtype == "fp16"

    def unused_scaler_warning(self) -> str | None:
        """For the run's log: ``precision.grad_scaler`` settings changed from their defaults while loss scaling is off,
        which therefore do nothing (a config migrated with a ``grad_scaler`` section under bf16 or fp32); ``None``
        otherwise."""
        defaults, c = GradScalerConfig(), self.config.grad_scaler
        changed = [f"precision.grad_scaler.{k}={getattr(c, k)}" for k in ("init_scale", "growth_factor", "backoff_factor",
                                                                          "growth_interval") if getattr(c, k) != getattr(defaults, k)]
        if self.scales_loss or not changed:
            return None
        return (f"{', '.join(changed)} {'does' if len(changed) == 1 else 'do'} nothing: loss scaling is off with precision.dtype={self.config.dtype} (on for fp16 "
                f"only, unless precision.grad_scaler.enabled=true). To scale the loss: precision=fp16, or "
                f"precision.grad_scaler.enabled=true")

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        """A ``GradScaler`` when loss scaling is on (fp16 by default), else ``None``."""
        c = self.config.grad_scaler
        if not self.scales_loss:
            return None
        return torch.amp.GradScaler(
            device.type, init_scale=c.init_scale, growth_factor=c.growth_factor,
            backoff_factor=c.backoff_factor, growth_interval=c.growth_interval,
        )
