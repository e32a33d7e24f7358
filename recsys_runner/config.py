"""The config schema: dataclasses registered in Hydra's ConfigStore.

Every component module owns the dataclass for its config group (``DeepFMConfig`` in
``models/deepfm.py``, ``SparseAdagradConfig`` in ``optim.py`` …): field defaults, field docs and
``__post_init__`` validation live there. This module registers them as ``schema/<group>/<name>``
and each ``conf/<group>/<name>.yaml`` extends its schema with ``/schema/<group>/<name>@_here_``,
so YAML only chooses and overrides.

:func:`validate` turns a composed ``DictConfig`` into those dataclasses (running every
``__post_init__``) — all user mistakes surface there as :class:`ConfigError`, before any process
group, data or model exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recsys_runner.checkpoint import CheckpointConfig
from recsys_runner.data.synthetic import SyntheticDataConfig
from recsys_runner.data.tabular import CriteoDataConfig, CsvDataConfig, ParquetDataConfig
from recsys_runner.distributed import DistributedConfig, check_sharding_types, resolve_device_type
from recsys_runner.ema import EmaConfig
from recsys_runner.errors import ConfigError, require
from recsys_runner.metrics import MetricsConfig
from recsys_runner.models.dcn_v2 import DCNv2Config
from recsys_runner.models.deepfm import DeepFMConfig
from recsys_runner.models.dlrm import DLRMConfig
from recsys_runner.models.dssm import DSSMConfig
from recsys_runner.models.mmoe import MMoEConfig
from recsys_runner.models.wide_deep import WideDeepConfig
from recsys_runner.optim import (
    DenseAdagradConfig,
    DenseAdamConfig,
    DenseAdamWConfig,
    DenseSGDConfig,
    OptimConfig,
    SparseAdagradConfig,
    SparseAdamConfig,
    SparseLAMBConfig,
    SparseLarsSGDConfig,
    SparsePartialRowWiseAdamConfig,
    SparsePartialRowWiseLAMBConfig,
    SparseRowWiseAdagradConfig,
    SparseSGDConfig,
    check_sparse_on_device,
)
from recsys_runner.precision import PrecisionConfig
from recsys_runner.profiling import ProfileConfig
from recsys_runner.scheduler import (
    ConstantConfig,
    CosineConfig,
    CosineRestartsConfig,
    ExponentialDecayConfig,
    ManualStepConfig,
)
from recsys_runner.stepping import ClipConfig
from recsys_runner.stopping import EarlyStoppingConfig
from recsys_runner.tracking import NoTrackingConfig, TrackingConfig


@dataclass(kw_only=True)
class TrainConfig:
    """The ``train`` section: how long to train and how often to log and evaluate."""

    num_steps: int | None = 1000
    """Optimizer steps to run. Exactly one of ``num_steps`` and ``num_epochs`` is set."""
    num_epochs: int | None = None
    """Passes over the training data (then set ``train.num_steps=null``)."""
    log_every_steps: int = 50
    """Log train loss, learning rates and samples/s every this many steps."""
    eval_every_steps: int | None = None
    """Evaluate every this many steps; ``null`` evaluates only at the end."""
    eval_max_batches: int | None = None
    """Cap on eval batches per rank (``null`` = the whole eval split)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; dense gradients are averaged over them (see docs/training.md
    for how this interacts with the fused embedding optimizers, which update every micro-batch)."""
    clip_grad: ClipConfig = field(default_factory=ClipConfig)
    """Clipping of the dense gradients (``train.clip_grad.max=1.0``)."""
    ema: EmaConfig = field(default_factory=EmaConfig)
    """Moving average of the dense weights (``train.ema.decay=0.999``)."""
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    """Stop when an eval metric stops improving (``train.early_stopping.patience=3``)."""
    nan_guard: bool = True
    """Stop with a clear error when the train loss is NaN/inf (checked at log steps and before each
    checkpoint, so a non-finite state is never saved)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """torch.profiler trace of a few steps, stored in MLflow (``debug=profile``)."""
    stop_after_steps: int | None = None
    """Train at most this many steps in this process, then checkpoint and exit like an interruption;
    relaunching continues (time slices on a preemptible cluster). ``null``: run to the end."""
    objective: str | None = None
    """The final eval metric a job returns (the value Hydra sweepers optimize), e.g. ``eval/ctr/auc``;
    ``null`` means ``eval/auc`` when the model logs it, else its first eval metric."""
    stop_check_every_steps: int = 10
    """With several ranks, how often (in steps) they agree on a pending stop signal. Agreeing is an
    all-reduce plus a host sync, so it is not done every step; a signal is honoured within this many
    steps. A single process checks every step for free."""

    def __post_init__(self) -> None:
        require(
            (self.num_steps is None) != (self.num_epochs is None),
            f"set exactly one of train.num_steps ({self.num_steps}) and train.num_epochs ({self.num_epochs}); "
            f"e.g. train.num_steps=null train.num_epochs=2, or train.num_steps=500",
        )
        require(self.num_steps is None or self.num_steps > 0, f"train.num_steps must be positive, got {self.num_steps}")
        require(self.num_epochs is None or self.num_epochs > 0, f"train.num_epochs must be positive, got {self.num_epochs}")
        require(self.log_every_steps > 0, f"train.log_every_steps must be positive, got {self.log_every_steps}")
        require(
            self.eval_every_steps is None or self.eval_every_steps > 0,
            f"train.eval_every_steps must be positive or null, got {self.eval_every_steps}",
        )
        require(
            self.eval_max_batches is None or self.eval_max_batches > 0,
            f"train.eval_max_batches must be positive or null, got {self.eval_max_batches}",
        )
        require(self.stop_after_steps is None or self.stop_after_steps > 0,
                f"train.stop_after_steps must be positive or null, got {self.stop_after_steps}")
        require(self.objective is None or self.objective.startswith("eval/"),
                f"train.objective={self.objective!r} must be an eval metric key, e.g. eval/auc or eval/ctr/auc")
        require(self.stop_check_every_steps > 0, f"train.stop_check_every_steps must be positive, got {self.stop_check_every_steps}")
        require(self.grad_accum_steps > 0, f"train.grad_accum_steps must be positive, got {self.grad_accum_steps}")
        require(
            self.early_stopping.patience is None or self.eval_every_steps is not None,
            "train.early_stopping.patience needs periodic evaluation: set train.eval_every_steps (e.g. 500)",
        )


@dataclass(kw_only=True)
class RunConfig:
    """The root of the composed config (``conf/config.yaml``)."""

    model: Any = None
    data: Any = None
    optim: Any = None
    scheduler: Any = None
    distributed: Any = None
    precision: Any = None
    tracking: Any = None
    checkpoint: Any = None
    train: TrainConfig = field(default_factory=TrainConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Eval and decaying train metrics, e.g. ``metrics.eval=[auc,gauc] metrics.grouping_key=cat_0`` (docs/metrics.md)."""
    seed: int = 0
    """Seeds torch on every rank (dense init, dropout); data has its own ``data.seed``."""


GROUPS: dict[str, dict[str, type]] = {
    "model": {"deepfm": DeepFMConfig, "dlrm": DLRMConfig, "dcn_v2": DCNv2Config, "wide_deep": WideDeepConfig,
              "mmoe": MMoEConfig, "dssm": DSSMConfig},
    "data": {"synthetic": SyntheticDataConfig, "parquet": ParquetDataConfig, "csv": CsvDataConfig, "criteo": CriteoDataConfig},
    "optim": {"optim": OptimConfig},
    "optim/sparse": {
        "sgd": SparseSGDConfig,
        "adagrad": SparseAdagradConfig,
        "rowwise_adagrad": SparseRowWiseAdagradConfig,
        "adam": SparseAdamConfig,
        "lamb": SparseLAMBConfig,
        "lars_sgd": SparseLarsSGDConfig,
        "partial_rowwise_adam": SparsePartialRowWiseAdamConfig,
        "partial_rowwise_lamb": SparsePartialRowWiseLAMBConfig,
    },
    "optim/dense": {"sgd": DenseSGDConfig, "adagrad": DenseAdagradConfig, "adam": DenseAdamConfig, "adamw": DenseAdamWConfig},
    "scheduler": {
        "constant": ConstantConfig,
        "exponential_decay": ExponentialDecayConfig,
        "cosine": CosineConfig,
        "cosine_restarts": CosineRestartsConfig,
        "manual_step": ManualStepConfig,
    },
    "distributed": {"distributed": DistributedConfig},
    "precision": {"precision": PrecisionConfig},
    "checkpoint": {"checkpoint": CheckpointConfig},
    "tracking": {"mlflow": TrackingConfig, "none": NoTrackingConfig},
}
"""Every schema, by group and name. A new option registers its dataclass here."""


def register_configs() -> None:
    """Store the root schema and every group schema in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for group, options in GROUPS.items():
        for name, node in options.items():
            cs.store(group=f"schema/{group}", name=name, node=node)


def validate(cfg: DictConfig) -> RunConfig:
    """Resolve and type-check ``cfg`` and run every schema's ``__post_init__``.

    Raises:
        ConfigError: naming the key and the fix, for any invalid value or combination.
    """
    try:
        run = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        cause = e.__cause__ if isinstance(e.__cause__, ConfigError) else None
        if cause is not None:
            raise cause from None
        raise ConfigError(_omegaconf_message(e)) from None
    assert isinstance(run, RunConfig), f"root config is {type(run)}; conf/config.yaml must extend run_schema"
    device_type = resolve_device_type(run.distributed.device)
    check_sparse_on_device(run.optim.sparse._target_, device_type)
    check_sharding_types(run.distributed.sharding_types, device_type, run.distributed.tables)
    return run


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    first = str(e).splitlines()[0]
    return f"{key}: {first}" if key else first


def flatten(cfg: DictConfig) -> dict[str, Any]:
    """``{"optim.sparse.lr": 0.05, …}`` for logging the resolved config as MLflow params."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            out[prefix] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out
