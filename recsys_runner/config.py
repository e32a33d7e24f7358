"""The config schema: dataclasses registered in Hydra's ConfigStore.

Every component module owns the dataclass for its config group (``DeepFMConfig`` in
``models/deepfm.py``, ``SparseAdagradConfig`` in ``optim/sparse.py`` …): field defaults, field docs and
``__post_init__`` validation live there. This module registers them as ``schema/<group>/<name>``
and each ``conf/<group>/<name>.yaml`` extends its schema with ``/schema/<group>/<name>@_here_``,
so YAML only chooses and overrides.

:func:`validate` turns a composed ``DictConfig`` into those dataclasses (running every
``__post_init__``) — all user mistakes surface there as :class:`ConfigError`, before any process
group, data or model exists.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recsys_runner import help_groups
from recsys_runner.checkpoint.config import CheckpointConfig
from recsys_runner.config_keys import check_known_keys
from recsys_runner.config_metrics import metric_mode
from recsys_runner.configurable import Configurable, typed
from recsys_runner.data.base import DataConfig
from recsys_runner.data.collision import resolve_collision_modules
from recsys_runner.data.files.criteo_config import CriteoDataConfig, CriteoNpyDataConfig
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
from recsys_runner.distributed.config import DistributedConfig, check_sharding_types, resolve_device_type
from recsys_runner.errors import ConfigError, UserError, require_seed
from recsys_runner.metrics.registry import MetricsConfig
from recsys_runner.models.autoint import AutoIntConfig
from recsys_runner.models.bst import BSTConfig
from recsys_runner.models.common import ModelConfig
from recsys_runner.models.dbmtl import DBMTLConfig
from recsys_runner.models.dcn import DCNConfig
from recsys_runner.models.dcn_v2 import DCNv2Config
from recsys_runner.models.deepfm import DeepFMConfig
from recsys_runner.models.din import DINConfig
from recsys_runner.models.dlrm import DLRMConfig
from recsys_runner.models.dssm import DSSMConfig
from recsys_runner.models.esmm import ESMMConfig
from recsys_runner.models.fm import FMConfig
from recsys_runner.models.hstu_rank import HSTURankConfig
from recsys_runner.models.lr import LRConfig
from recsys_runner.models.masknet import MaskNetConfig
from recsys_runner.models.mind import MINDConfig
from recsys_runner.models.mmoe import MMoEConfig
from recsys_runner.models.ple import PLEConfig
from recsys_runner.models.sasrec import SASRecConfig
from recsys_runner.models.wide_deep import WideDeepConfig
from recsys_runner.models.wukong import WukongConfig
from recsys_runner.models.xdeepfm import XDeepFMConfig
from recsys_runner.optim.config import OptimConfig
from recsys_runner.optim.optimizers import DenseAdagradConfig, DenseAdamConfig, DenseAdamWConfig, DenseSGDConfig
from recsys_runner.optim.schedulers import (
    ConstantConfig,
    CosineConfig,
    CosineRestartsConfig,
    ExponentialDecayConfig,
    ManualStepConfig,
    SchedulerConfig,
    schedule_error,
)
from recsys_runner.optim.sparse import (
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
from recsys_runner.paths import register_resolvers
from recsys_runner.plugins import Plugins, listed, load_class, store_lazily
from recsys_runner.store_settings import StorageConfig
from recsys_runner.tracking.tracker import MlflowTrackingConfig, NoTrackingConfig, TrackingConfig
from recsys_runner.train.compile import check_compile
from recsys_runner.train.config import TrainConfig
from recsys_runner.train.precision import PrecisionConfig


@dataclass(kw_only=True)
class RunConfig:
    """The root of the composed config (``conf/config.yaml``), typed all the way down after :func:`validate`.

    Each group field holds its option's own config dataclass (``model`` a ``DeepFMConfig``, ``data`` a
    ``SyntheticDataConfig`` …), which builds the component (:mod:`recsys_runner.configurable`).
    """

    model: ModelConfig = MISSING
    """The model (``model=deepfm``); any class whose constructor takes a ``ModelConfig`` subclass first."""
    data: DataConfig = MISSING
    """The data module (``data=synthetic``, ``data=parquet data.path=…``)."""
    optim: OptimConfig = MISSING
    """Sparse (fused) and dense optimizers (``optim=adagrad``, ``optim/sparse=rowwise_adagrad``)."""
    scheduler: SchedulerConfig = MISSING
    """The lr schedule of every optimizer group without its own (``scheduler=cosine``)."""
    distributed: DistributedConfig = MISSING
    """Process group, device, sharding plan and train pipeline."""
    precision: PrecisionConfig = MISSING
    """Mixed precision (``precision=bf16``)."""
    tracking: TrackingConfig = MISSING
    """Where runs are recorded (``tracking=mlflow``, ``tracking=none``)."""
    checkpoint: CheckpointConfig = MISSING
    """When and where checkpoints are written, and what a launch resumes from."""
    train: TrainConfig = field(default_factory=TrainConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Eval and decaying train metrics, e.g. ``metrics.eval=[auc,gauc] metrics.grouping_key=cat_0`` (docs/metrics.md)."""
    seed: int = 0
    """Seeds torch on every rank (dense init, dropout); data has its own ``data.seed``."""
    storage: StorageConfig = field(default_factory=StorageConfig)
    """Object stores (``s3://`` paths, docs/storage.md): ``storage.endpoint_url`` of an S3-compatible store, region,
    retries, timeouts; never credentials (the store client's environment and config files hold those)."""

    def __post_init__(self) -> None:
        require_seed("seed", self.seed)

    @functools.cached_property
    def served_data(self) -> DataConfig:
        """``data`` as the model gets it, ``data.for_model(model.data_needs())``: generated data takes the model's labels
        and towers' pairs and becomes histories for a model over them; file data is ``data`` itself. Computed once (its
        log lines and warnings come once), first by :func:`validate`, whose checks of what the model needs from its data
        see the data it will get; the builders build it."""
        return self.data.for_model(self.model.data_needs())


def _component_slots() -> dict[str, type]:
    """The root fields whose option is a component config (``model``, ``data`` …), with their base class."""
    hints = typing.get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)
            if isinstance(hints[f.name], type) and issubclass(hints[f.name], Configurable)}


@functools.cache
def _composition_schema() -> type:
    """:class:`RunConfig` as Hydra composes it: the same fields, with the component slots left open.

    Derived, not declared: a component slot must accept a mapping whose schema only its ``_target_``
    knows (a user's own model class), which a field typed by our base class would reject at
    composition. :func:`validate` types each slot by its ``_target_`` (:func:`~recsys_runner.configurable.typed`)
    and returns a :class:`RunConfig`.
    """
    slots = _component_slots()
    spec: list[tuple[str, Any, Any]] = []
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        if f.name in slots:
            spec.append((f.name, Any, field(default=None)))
        elif f.default_factory is not dataclasses.MISSING:
            spec.append((f.name, hints[f.name], field(default_factory=f.default_factory)))
        else:
            spec.append((f.name, hints[f.name], field(default=f.default)))
    return dataclasses.make_dataclass("RunSchema", spec, kw_only=True)


GROUPS: dict[str, dict[str, type]] = {
    "model": {"deepfm": DeepFMConfig, "dlrm": DLRMConfig, "dcn_v2": DCNv2Config, "wide_deep": WideDeepConfig,
              "mmoe": MMoEConfig, "dssm": DSSMConfig, "lr": LRConfig, "fm": FMConfig,
              "din": DINConfig, "bst": BSTConfig, "sasrec": SASRecConfig, "ple": PLEConfig, "dbmtl": DBMTLConfig,
              "xdeepfm": XDeepFMConfig, "autoint": AutoIntConfig, "masknet": MaskNetConfig,
              "dcn": DCNConfig, "wukong": WukongConfig, "hstu_rank": HSTURankConfig, "esmm": ESMMConfig, "mind": MINDConfig},
    "data": {"synthetic": SyntheticDataConfig, "parquet": ParquetDataConfig, "csv": CsvDataConfig, "criteo": CriteoDataConfig,
             "criteo_npy": CriteoNpyDataConfig, "synthetic_sequences": SyntheticSequencesConfig},
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
    "tracking": {"mlflow": MlflowTrackingConfig, "none": NoTrackingConfig},
}
"""Every built-in schema, by group and name. A new option of this package registers its dataclass here; another package's
comes from its entry points (:func:`plugins`)."""

PLUGIN_BASES: dict[str, type] = {"model": ModelConfig, "data": DataConfig}
"""The config groups other packages may add options to (``plugins.ENTRY_POINT_GROUPS``), with the base each must subclass."""


@functools.cache
def plugins() -> Plugins:
    """The options installed packages declare as entry points (``recsys_runner.models``, ``recsys_runner.data``), listed
    by name once per process; none is imported here (:mod:`recsys_runner.plugins`)."""
    return listed(GROUPS)


@functools.cache
def _plugin_schema(group: str, name: str) -> type | ConfigError:
    """The config class of the installed option ``<group>=<name>``, imported once; or the one-line error of a broken one."""
    try:
        return load_class(plugins().entries[group][name], PLUGIN_BASES[group])
    except ConfigError as e:
        return e


def plugin_schema(group: str, name: str) -> type:
    """The config class of the installed option ``<group>=<name>``, imported on first use (Hydra composing the option).

    Raises:
        ConfigError: the entry point fails to import or names no config class (one line naming it and its distribution).
    """
    schema = _plugin_schema(group, name)
    if isinstance(schema, ConfigError):
        raise ConfigError(str(schema))
    return schema


def group_options(group: str) -> dict[str, type]:
    """Every option of ``group`` with its schema: the built-in ones and those of installed packages that import (which
    imports them: for the hints that read an option's keys, after a mistake, not for an ordinary run)."""
    added = {name: _plugin_schema(group, name) for name in plugins().entries.get(group, {})}
    return {**GROUPS.get(group, {}), **{name: schema for name, schema in added.items() if isinstance(schema, type)}}


def options_with_key(group: str, key: str) -> list[str]:
    """The options of config group ``group`` whose schema has ``key`` (``model``, ``structure`` → ``dcn_v2``, ``masknet``)."""
    return [option for option, schema in group_options(group).items() if key in {f.name for f in dataclasses.fields(schema)}]


def register_configs() -> None:
    """Store the root schema and every group schema in Hydra's ConfigStore, register the resolvers ``conf/`` uses, and
    make ``--help`` list the groups in one walk, without these ``schema/*`` groups (``help_groups.py``; idempotent).
    Every Hydra entry runs it before ``@hydra.main``. Each option of an installed package (:func:`plugins`) is stored
    twice: as ``schema/<group>/<name>``, which its own YAML presets extend as ours do, and as the option
    ``<group>=<name>`` itself; by name, its module imported only when Hydra first composes it."""
    register_resolvers()
    help_groups.install()
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=_composition_schema())
    for group, builtin in GROUPS.items():
        for name, node in builtin.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
    for group, added in plugins().entries.items():
        for name in added:
            schema = functools.partial(plugin_schema, group, name)  # imported when Hydra first composes it
            store_lazily(f"schema/{group}", name, schema)  # for the package's own YAML presets to extend
            store_lazily(group, name, schema)  # the option itself: the dataclass's defaults, no YAML needed


def register_entry_schema(name: str, fields: list[tuple[str, Any, Any]]) -> None:
    """Store ``<name>_schema``: the root schema plus the top-level keys only the entry point ``name`` reads.

    ``conf/<name>.yaml`` lists ``defaults: [config, <name>_schema, _self_]``: the whole training config
    composes as usual, then this schema adds the entry's own keys (``fields``, ``(name, type,
    dataclasses.field(...))`` as for :func:`dataclasses.make_dataclass`, e.g. ``load`` and an ``export``
    section), so :func:`check_known_keys` still names a typo anywhere. It subclasses the root schema
    (OmegaConf merges only a subclass onto a typed node) with every inherited field redeclared as
    ``Any = ???``, which a merge never copies: the training values composed before it are kept, and so
    are their nodes' own types (redeclaring them typed would retype the composed nodes).
    :func:`validate` reads only the training keys.
    """
    register_configs()
    base = _composition_schema()
    inherited = [(f.name, Any, field(default=MISSING)) for f in dataclasses.fields(base)]
    schema = dataclasses.make_dataclass(f"{name.title().replace('_', '')}Schema", [*inherited, *fields], bases=(base,), kw_only=True)
    ConfigStore.instance().store(name=f"{name}_schema", node=schema)


def validate(cfg: DictConfig) -> RunConfig:
    """Resolve and type-check ``cfg`` and run every schema's ``__post_init__``; the one typed config of the run.

    Each component slot is typed by its option's schema, or for a user's own ``_target_`` by the
    config class that class declares (:func:`~recsys_runner.configurable.typed`); then every key is
    checked against its schema and every value converted and validated. ``cfg`` is not changed.

    Raises:
        ConfigError: naming the key and the fix, for any invalid value or combination, or for a key
            the schema does not define (:func:`check_known_keys`).
    """
    try:
        cfg = copy.deepcopy(cfg)
        for name, base in _component_slots().items():
            cfg[name] = typed(cfg[name], base, name)
        check_known_keys(cfg)
        _check_group_schedules(cfg)
        check_finite(OmegaConf.to_container(cfg, resolve=True))
        composed = OmegaConf.to_object(cfg)
    except UserError:
        raise
    except OmegaConfBaseException as e:
        cause = e.__cause__ if isinstance(e.__cause__, UserError) else None
        if cause is not None:
            raise cause from None
        raise ConfigError(_omegaconf_message(e)) from None
    assert dataclasses.is_dataclass(composed), f"root config is {type(composed)}; conf/config.yaml must extend run_schema"
    run = RunConfig(**{f.name: getattr(composed, f.name) for f in dataclasses.fields(RunConfig)})
    device_type = resolve_device_type(run.distributed.device)
    resolve_collision_modules(run.data, device_type)  # managed_collision.module=auto: hash_zch on CUDA, mch on CPU
    ckpt = run.checkpoint
    saves_checkpoints = bool(ckpt.at_end or ckpt.every_steps or ckpt.every_epochs or ckpt.best_metric)
    check_sparse_on_device(run.optim.sparse, device_type, checkpoints=saves_checkpoints)
    check_sharding_types(run.distributed.sharding_types, device_type, run.distributed.tables)
    # the data as the model gets it (for_model: e.g. histories for model=din on the default data), and its checks
    check_compile(run.train.compile, device_type, run.served_data)
    if ckpt.best_metric is not None:
        ckpt.best_mode = metric_mode(ckpt.best_metric, ckpt.best_mode, "checkpoint.best_mode")
    stopping = run.train.early_stopping
    if stopping.patience is not None:
        stopping.mode = metric_mode(stopping.metric, stopping.mode, "train.early_stopping.mode")
    return run


def _check_group_schedules(cfg: DictConfig) -> None:
    """Validate the schedules of single optimizer groups (``+scheduler@optim.sparse_scheduler=…``) before the whole
    config, so that a mistake in one names its own key (``optim.sparse_scheduler.decay_rate``), not the top-level
    ``scheduler``'s, which the schedule's checks name and which would not fix it (:func:`schedule_error`)."""
    parts = cfg.optim.get("parts") or {}
    slots = {f"optim.{name}": cfg.optim.get(name) for name in ("sparse_scheduler", "dense_scheduler")}
    slots |= {f"optim.parts.{name}.scheduler": part.get("scheduler") for name, part in parts.items() if isinstance(part, DictConfig)}
    for where, node in slots.items():
        if isinstance(node, DictConfig):
            try:
                OmegaConf.to_object(node)
            except ConfigError as e:
                raise schedule_error(where, e) from None


def check_finite(node: Any, key: str = "") -> None:
    """Every number of the config (``node``, as plain containers) is finite. ``inf`` passes every ``> 0`` check a schema
    makes (``optim.lr=1e400`` is infinity, as YAML's ``.inf`` is) and reaches training, where it turns the weights to NaN;
    ``nan`` fails those checks with a message about its sign. One check for every key, so no schema needs its own.

    Raises:
        ConfigError: naming the first key whose value is ``inf``, ``-inf`` or ``nan``.
    """
    if isinstance(node, dict):
        for k, v in node.items():
            check_finite(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            check_finite(v, f"{key}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{key}={node} is not a finite number. Fix: give {key} a finite value (YAML reads numbers beyond "
                          f"1.8e308, and .inf, as infinity)")


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    first = str(e).splitlines()[0]
    return f"{key}: {first}" if key else first


def as_container(run: RunConfig) -> dict[str, Any]:
    """The validated config as plain values (``_target_`` included), for logging and display."""
    container = OmegaConf.to_container(OmegaConf.structured(run))
    assert isinstance(container, dict)
    return {str(k): v for k, v in container.items()}


def to_yaml(run: RunConfig) -> str:
    """The validated config as YAML: what the run really used (logged as ``config.yaml``)."""
    return OmegaConf.to_yaml(OmegaConf.structured(run))


def flatten(run: RunConfig) -> dict[str, Any]:
    """``{"optim.sparse.lr": 0.05, …}`` for logging the validated config as MLflow params."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            out[prefix] = node

    walk(as_container(run), "")
    return out
