"""``distributed.*``: the schema of ``conf/distributed/*.yaml`` and the checks that need no process group."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ShardingType

from recsys_runner.configurable import Configurable
from recsys_runner.errors import ConfigError, require

if TYPE_CHECKING:  # built by name (_target_); the config must not import the machinery it configures
    from recsys_runner.distributed.sharding import Distributed

AUTO_THREADS = "auto"
"""``distributed.num_threads: auto``: see :func:`auto_num_threads`."""

_BACKENDS = ("auto", "gloo", "nccl")

_DEVICES = ("auto", "cpu", "cuda")

_PIPELINES = ("auto", "sparse_dist", "base", "semi_sync", "prefetch")

_SHARDING_TYPES = sorted(t.value for t in ShardingType)

_KERNELS = sorted(k.value for k in EmbeddingComputeKernel)

PROPOSERS = ("default", "dynamic_programming", "greedy", "grid_search", "uniform")
"""``distributed.planner.proposer``'s choices (:func:`recsys_runner.distributed.planner.proposers` builds them)."""


TORCHEASYREC_ENVIRONMENT: dict[str, tuple[str, float]] = {
    "STORAGE_RESERVE_PERCENT": ("distributed.storage_reserve_percent", 1.0),
    "INTRA_NODE_BANDWIDTH": ("distributed.intra_node_bandwidth_gbps", 1e-9),
    "CROSS_NODE_BANDWIDTH": ("distributed.cross_node_bandwidth_gbps", 1e-9),
    "PROCESS_GROUP_TIMEOUT_SECONDS": ("distributed.timeout_s", 1.0),
}
"""TorchEasyRec's environment variables for planning and the process group (its docs' "Environment Variables
Reference"), with our key and the factor from its unit to ours (bandwidths: bytes/s there, GB/s here)."""


def foreign_environment(environ: Mapping[str, str]) -> list[str]:
    """For the run's log: each of TorchEasyRec's environment variables set in ``environ``, which this runner does not read
    (the setting is config, saved with the run), with the key that does and the value in its unit."""
    said = []
    for name, (key, factor) in TORCHEASYREC_ENVIRONMENT.items():
        if (value := environ.get(name)) is None:
            continue
        try:
            ours = f"{float(value) * factor:g}"
            if key == "distributed.timeout_s":
                ours = str(round(float(value)))
        except ValueError:
            ours = "<value>"
        said.append(f"{name}={value} is TorchEasyRec's and is not read here: the planner and the process group take their "
                    f"settings from the config. Fix: {key}={ours}" + (" (GB/s; TorchEasyRec's is bytes/s)" if factor != 1 else ""))
    return said


def _check_choices(key: str, sharding_types: list[str] | None, compute_kernels: list[str] | None,
                   cache_load_factor: float | None = None) -> None:
    # an empty list reads as "none allowed" but the planner takes it as null (all): refuse it rather than guess
    for name, chosen in (("sharding_types", sharding_types), ("compute_kernels", compute_kernels)):
        require(chosen is None or len(chosen) > 0, f"{key}.{name}=[] allows nothing. Fix: {key}.{name}=null (the planner "
                f"chooses among all), or list the ones to allow")
    _check_names(f"{key}.sharding_types", sharding_types, _SHARDING_TYPES)
    _check_names(f"{key}.compute_kernels", compute_kernels, _KERNELS)
    require(cache_load_factor is None or 0 < cache_load_factor < 1,
            f"{key}.cache_load_factor={cache_load_factor} must lie strictly between 0 and 1 (the share of a UVM-cached table's "
            f"rows its HBM cache holds; at 1 the whole table would sit in HBM, which is the fused kernel, and TorchRec refuses it). "
            f"Fix: e.g. {key}.cache_load_factor=0.2, or null for TorchRec's default")


def _check_names(key: str, chosen: list[str] | None, valid: list[str]) -> None:
    """Each of ``chosen`` is one of TorchRec's ``valid`` values; an unknown one is named with the whole list fixed: each
    replaced by the value equal but for case (TorchRec's enum names, ``TABLE_WISE``, as TorchEasyRec's configs write them),
    else by the closest."""
    unknown = [v for v in chosen or [] if v not in valid]
    if not unknown:
        return

    def fixed(v: str) -> str:
        if v in valid:
            return v
        return v.lower() if v.lower() in valid else (difflib.get_close_matches(v.lower(), valid, n=1, cutoff=0.0) or valid)[0]

    raise ConfigError(f"{key} has unknown {', '.join(map(repr, unknown))}; valid: {', '.join(valid)} (TorchRec's values, in "
                      f"lower case). Fix: {key}=[{','.join(fixed(v) for v in chosen or [])}]")


@dataclass(kw_only=True)
class TableShardingConfig:
    """One entry of ``distributed.tables``: what the planner may do with that table."""

    sharding_types: list[str] | None = None
    """Sharding types for this table only (overrides ``distributed.sharding_types``); ``null`` inherits."""
    compute_kernels: list[str] | None = None
    """Compute kernels for this table only (overrides ``distributed.compute_kernels``); ``null`` inherits."""
    cache_load_factor: float | None = None
    """This table's HBM cache, as a share of its rows, when it is UVM-cached (overrides ``distributed.cache_load_factor``;
    ``null`` inherits). Tables that fbgemm runs in one kernel share one cache, of their summed sizes."""


@dataclass(kw_only=True)
class PlannerConfig:
    """``distributed.planner``: how TorchRec's planner searches for a sharding plan (its constraints are
    ``distributed.sharding_types``, ``distributed.tables`` and the memory settings)."""

    proposer: str = "default"
    """Which proposer(s) suggest the plans the planner partitions and rates, keeping the best: ``default`` is
    TorchRec's own set (grid search, greedy by depth, greedy, uniform); ``dynamic_programming`` is TorchRec's
    ``DynamicProgrammingProposer`` (what TorchEasyRec uses): for every total HBM budget it picks one option per table
    minimising the summed perf estimate, so it weighs all tables together instead of upgrading them one at a time —
    it budgets device memory (HBM) only, so it needs ``distributed.device=cuda`` (planning for CUDA needs no GPU:
    ``python -m recsys_runner.plan distributed.device=cuda``). ``greedy``, ``grid_search``, ``uniform``: one of the
    default set alone."""
    hbm_bins_per_device: int = 100
    """``dynamic_programming`` only: HBM budget steps per device (its precision; time grows with it)."""

    def __post_init__(self) -> None:
        require(self.proposer in PROPOSERS,
                f"distributed.planner.proposer={self.proposer!r} is not one of {PROPOSERS}. Fix: e.g. "
                f"distributed.planner.proposer=dynamic_programming")
        require(self.hbm_bins_per_device > 0,
                f"distributed.planner.hbm_bins_per_device must be positive, got {self.hbm_bins_per_device}")


@dataclass(kw_only=True)
class DistributedConfig(Configurable):
    """Schema of ``conf/distributed/*.yaml``; builds :class:`Distributed`."""

    _target_: str = "recsys_runner.distributed.sharding.Distributed"
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda``."""
    num_threads: int | str = AUTO_THREADS
    """torch's intra-op CPU threads per rank (``torch.set_num_threads``). ``auto``: ``$OMP_NUM_THREADS`` when it is set,
    else this rank's share of the physical cores it may use, capped by its share of the CPUs idle at start (at
    least 1): torch's own default takes every core for every rank, and threads that compete with other ranks or
    other jobs for the cores make each step many times slower (:func:`auto_num_threads`)."""
    backend: str = "auto"
    """Process-group backend: ``auto`` (NCCL on CUDA, gloo on CPU), ``gloo`` or ``nccl``."""
    pipeline: str = "auto"
    """Train pipeline: ``sparse_dist`` overlaps the next batch's input distribution with the current
    step (a win on GPU); ``base`` is a plain forward/backward/step loop (faster on CPU, where there
    is nothing to overlap; on CPU it is :class:`~recsys_runner.train.stepping.LeanPipeline`, which skips the
    per-batch device copy and profiler ranges). ``auto`` picks ``sparse_dist`` on several GPUs, ``base`` on one GPU (TorchRec's ``TrainPipelineBase``, which still copies
    the next batch on a side stream: 1.13x ``sparse_dist``'s samples/s on an H200, docs/performance.md) and on CPU.
    ``semi_sync`` is TorchRec's ``TrainPipelineSemiSync``: batch ``i``'s embedding all-to-all overlaps the dense
    forward of batch ``i-1``, so after ``distributed.semi_sync_start_batch`` synchronous batches each batch is looked up
    with embeddings one update older — faster on several GPUs, but *not* the same training as the others (never a
    default). ``prefetch`` is TorchRec's ``PrefetchTrainPipelineSparseDist``: ``sparse_dist`` plus a stage that
    prefetches the next batch's rows into the UVM caches (``fused_uvm_caching`` tables, see ``distributed.hbm_cap_gb``),
    exact. Both run on CUDA only. Neither takes a step policy (``train.grad_accum_steps``, fp16 loss scaling, clipping, EMA)."""
    semi_sync_start_batch: int = 100
    """``distributed.pipeline=semi_sync`` only: batches trained synchronously before the pipeline turns semi-synchronous
    (TorchRec's ``start_batch``; a short synchronous start keeps the early loss from jumping)."""
    sharding_types: list[str] | None = None
    """Sharding types the planner may choose from for every table (e.g. ``[table_wise, row_wise]``);
    ``null`` lets the planner consider all — but with one rank only ``table_wise`` and ``data_parallel``
    (sharding a table across ranks gains nothing there); set it to allow others on one rank."""
    compute_kernels: list[str] | None = None
    """Embedding kernels the planner may choose from (e.g. ``[fused]``); ``null`` for all."""
    tables: dict[str, TableShardingConfig] = field(default_factory=dict)
    """Per-table choices by table name (``t_<feature>`` unless the data names tables); on the command
    line ``+distributed.tables={t_cat_0: {sharding_types: [row_wise]}}``, in YAML a mapping under
    ``distributed.tables``. A name the model does not have is an error."""
    storage_reserve_percent: float = 0.15
    """Fraction of each device's memory the planner keeps free for activations and buffers."""
    intra_node_bandwidth_gbps: float | None = None
    """Bandwidth between devices of one node, GB/s, for the planner's cost model (``null``: TorchRec's 600)."""
    cross_node_bandwidth_gbps: float | None = None
    """Bandwidth between nodes, GB/s, for the planner's cost model (``null``: TorchRec's 12.5)."""
    hbm_cap_gb: float | None = None
    """Device (GPU) memory per rank the planner may fill, GB (``null``: TorchRec's default, 32)."""
    ddr_cap_gb: float | None = None
    """Host memory per rank the planner may fill, GB — the budget for tables on CPU (``null``: 128)."""
    cache_load_factor: float | None = None
    """The share of a UVM-cached table's rows that its HBM cache holds, in (0, 1): TorchRec's
    ``CacheParams(load_factor=...)`` for every table (``distributed.tables.<t>.cache_load_factor`` for one). A table the
    planner gives ``fused_uvm_caching`` (fbgemm's kernel: the table in host memory, its hot rows cached on the GPU; chosen
    when the tables exceed ``distributed.hbm_cap_gb`` and ``distributed.compute_kernels`` allows it, e.g.
    ``[fused, fused_uvm_caching]``) costs this share of its size in HBM. It is the trade the plan makes: a smaller cache
    fits a smaller cap (or leaves room to keep more tables whole in HBM), a larger one misses less, which matters when
    ids are not heavy-headed. The planner budgets the caches at this size and fbgemm allocates them so; the plan prints
    it (``cache 20% of rows``). ``null``: TorchRec's default, 0.2. No effect on tables kept in HBM, nor on CPU."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """How the planner searches: ``distributed.planner.proposer=dynamic_programming`` (TorchEasyRec's choice) or TorchRec's default set."""
    planner_batch_size: int | None = None
    """Per-rank batch size the planner costs with (``null``: ``data.batch_size``)."""
    plan_world_size: int | None = None
    """``python -m recsys_runner.plan`` only: plan for this many ranks instead of this process's world."""
    plan_local_world_size: int | None = None
    """``python -m recsys_runner.plan`` only: ranks per node for ``plan_world_size`` (``null``: all on one node)."""
    timeout_s: int = 1800
    """Collective timeout; a rank that hangs longer than this fails instead of waiting forever."""
    stuck_after_signal_s: float = 20.0
    """With several ranks: how long after a SIGTERM (the one torchrun sends the survivors once a rank is lost) a rank's
    training may stay blocked in native code, e.g. a collective waiting on a rank gone without its connection failing,
    before it ends as a lost rank (exit 75, :mod:`recsys_runner.train.stuck`). Below the launcher's kill grace (torchrun's
    and SLURM's: 30 s), which would end it with no word. A healthy group's stop in which a rank waits on another that
    long (a checkpoint still being written) ends so too: raise it for such checkpoints, within the launcher's grace."""

    def __post_init__(self) -> None:
        require(self.device in _DEVICES, f"distributed.device={self.device!r} must be one of {_DEVICES}")
        threads = self.num_threads
        require(threads == AUTO_THREADS or (isinstance(threads, int) and not isinstance(threads, bool) and threads > 0),
                f"distributed.num_threads={threads!r} must be a positive number or auto. Fix: distributed.num_threads=auto "
                f"(cores / ranks per node) or e.g. distributed.num_threads=4")
        require(self.backend in _BACKENDS, f"distributed.backend={self.backend!r} must be one of {_BACKENDS}")
        require(self.pipeline in _PIPELINES, f"distributed.pipeline={self.pipeline!r} must be one of {_PIPELINES}")
        require(not (self.pipeline in ("semi_sync", "prefetch") and self.device == "cpu"), cuda_pipeline_reason(self.pipeline))
        require(self.semi_sync_start_batch >= 0,
                f"distributed.semi_sync_start_batch must be >= 0, got {self.semi_sync_start_batch}")
        _check_choices("distributed", self.sharding_types, self.compute_kernels, self.cache_load_factor)
        for name, table in self.tables.items():
            _check_choices(f"distributed.tables.{name}", table.sharding_types, table.compute_kernels, table.cache_load_factor)
        if self.compute_kernels or any(t.compute_kernels for t in self.tables.values()):
            check_compute_kernels(self, resolve_device_type(self.device))
        require(0 <= self.storage_reserve_percent < 1, "distributed.storage_reserve_percent must lie in [0, 1)")
        for key in ("intra_node_bandwidth_gbps", "cross_node_bandwidth_gbps", "hbm_cap_gb", "ddr_cap_gb",
                    "planner_batch_size", "plan_world_size", "plan_local_world_size"):
            value = getattr(self, key)
            require(value is None or value > 0, f"distributed.{key} must be positive or null, got {value}")
        if self.plan_local_world_size is not None:
            require(
                self.plan_world_size is not None and self.plan_world_size % self.plan_local_world_size == 0,
                f"distributed.plan_local_world_size={self.plan_local_world_size} needs distributed.plan_world_size set to a "
                f"multiple of it (got {self.plan_world_size})",
            )
        require(self.timeout_s > 0, "distributed.timeout_s must be positive")
        require(self.stuck_after_signal_s > 0, f"distributed.stuck_after_signal_s must be positive, got {self.stuck_after_signal_s}. "
                "Fix: e.g. distributed.stuck_after_signal_s=20 (below the launcher's 30 s kill grace)")
        require(not (self.device == "cpu" and self.planner.proposer == "dynamic_programming"),
                "distributed.planner.proposer=dynamic_programming budgets device (HBM) memory, which a CPU plan has none of. "
                "Fix: distributed.planner.proposer=default on CPU (or plan for CUDA: distributed.device=cuda)")
        require(
            not (self.device == "cpu" and self.backend == "nccl"),
            "distributed.backend=nccl needs CUDA tensors; use distributed.backend=gloo (or auto) with distributed.device=cpu",
        )

    def build(self) -> Distributed:
        """The :class:`Distributed` this config describes (its process group is created by ``setup()``)."""
        built: Distributed = self.component_class()(self)
        return built


def cuda_pipeline_reason(kind: str) -> str:
    """Why ``distributed.pipeline=<kind>`` (``semi_sync``, ``prefetch``) cannot run on a CPU, and the fix."""
    what = ("prefetches rows into the GPU's UVM caches" if kind == "prefetch"
            else "overlaps the all-to-all with the forward on CUDA streams")
    return f"distributed.pipeline={kind} {what}; it runs on CUDA only. Fix: distributed.pipeline=auto (or base) on CPU"


def resolve_device_type(device: str) -> str:
    """``cuda`` or ``cpu`` for a ``distributed.device`` setting, without touching a process group."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def check_sharding_types(
    sharding_types: list[str] | None, device_type: str, tables: Mapping[str, TableShardingConfig] | None = None
) -> None:
    """Reject sharding types (global or per table) TorchRec cannot use for embedding tables on ``device_type``."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    available = EmbeddingBagCollectionSharder().sharding_types(device_type)
    chosen = {"distributed.sharding_types": sharding_types} | {
        f"distributed.tables.{name}.sharding_types": t.sharding_types for name, t in (tables or {}).items()
    }
    for key, types in chosen.items():
        unusable = [t for t in types or [] if t not in available]
        require(
            not unusable,
            f"{key}={types}: {unusable} cannot shard embedding tables on {device_type}; available there: {available}",
        )


def check_compute_kernels(config: DistributedConfig, device_type: str) -> None:
    """Reject compute kernels (global or per table) TorchRec has no embedding kernel for on ``device_type``: on a CPU
    only ``dense`` and ``fused``; the UVM and key-value kernels are fbgemm's CUDA kernels (tables in host memory or on
    SSD, looked up by the GPU), which the planner would otherwise reject with a message about its search space."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    sharder = EmbeddingBagCollectionSharder()
    available = sorted({k for t in sharder.sharding_types(device_type) for k in sharder.compute_kernels(t, device_type)})
    chosen = {"distributed.compute_kernels": config.compute_kernels} | {
        f"distributed.tables.{name}.compute_kernels": t.compute_kernels for name, t in config.tables.items()
    }
    for key, kernels in chosen.items():
        unusable = [k for k in kernels or [] if k not in available]
        require(
            not unusable,
            f"{key}={kernels}: {unusable} cannot run on {device_type} (fbgemm's UVM and key-value kernels keep a table in "
            f"host memory or on SSD for a GPU to look up); available there: {available}. Fix: {key}=[fused] (or null), "
            f"or distributed.device=cuda",
        )
