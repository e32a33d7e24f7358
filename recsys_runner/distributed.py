"""Process group, device, sharding planner, DistributedModelParallel and the train pipeline.

Rank and world size come from the environment torchrun (or SLURM via submitit) sets: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``. Without them the run is a single process, and
a world-size-1 process group is still created, because TorchRec shards through one even then.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import (
    HardwareConfig,
    KernelConfig,
    PlannerError,
    ShardingOption,
    Stats,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingEnv, ShardingPlan, ShardingType

from recsys_runner.configurable import Configurable
from recsys_runner.errors import ConfigError, UserError, require
from recsys_runner.launch import map_submitit_env
from recsys_runner.stepping import LeanPipeline, Pipeline, PolicyPipelineBase, PolicyPipelineSparseDist, StepPolicy

log = logging.getLogger(__name__)

AUTO_THREADS = "auto"
"""``distributed.num_threads: auto``: see :func:`auto_num_threads`."""
_BACKENDS = ("auto", "gloo", "nccl")
_DEVICES = ("auto", "cpu", "cuda")
_PIPELINES = ("auto", "sparse_dist", "base")
_SHARDING_TYPES = sorted(t.value for t in ShardingType)
_KERNELS = sorted(k.value for k in EmbeddingComputeKernel)
_GB = 1024**3
_GBPS_TO_PLANNER = _GB / 1000  # the planner's bandwidths are bytes per millisecond
ONE_RANK_SHARDING_TYPES = [ShardingType.TABLE_WISE.value, ShardingType.DATA_PARALLEL.value]
"""The sharding types the planner may choose on one rank unless the config names others: row-wise and
column-wise shard a table across ranks, and with one rank they only add work (row-wise: a bucketize and
an all-to-all every step, measured on an H100), yet the planner's costs can still prefer them."""


def _check_choices(key: str, sharding_types: list[str] | None, compute_kernels: list[str] | None) -> None:
    for t in sharding_types or []:
        require(t in _SHARDING_TYPES, f"{key}.sharding_types has unknown {t!r}; valid: {_SHARDING_TYPES}")
    for k in compute_kernels or []:
        require(k in _KERNELS, f"{key}.compute_kernels has unknown {k!r}; valid: {_KERNELS}")


@dataclass(kw_only=True)
class TableShardingConfig:
    """One entry of ``distributed.tables``: what the planner may do with that table."""

    sharding_types: list[str] | None = None
    """Sharding types for this table only (overrides ``distributed.sharding_types``); ``null`` inherits."""
    compute_kernels: list[str] | None = None
    """Compute kernels for this table only (overrides ``distributed.compute_kernels``); ``null`` inherits."""


@dataclass(kw_only=True)
class DistributedConfig(Configurable):
    """Schema of ``conf/distributed/*.yaml``; builds :class:`Distributed`."""

    _target_: str = "recsys_runner.distributed.Distributed"
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
    is nothing to overlap; on CPU it is :class:`~recsys_runner.stepping.LeanPipeline`, which skips the
    per-batch device copy and profiler ranges). ``auto`` picks ``sparse_dist`` on CUDA and ``base`` on CPU."""
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
    planner_batch_size: int | None = None
    """Per-rank batch size the planner costs with (``null``: ``data.batch_size``)."""
    plan_world_size: int | None = None
    """``python -m recsys_runner.plan`` only: plan for this many ranks instead of this process's world."""
    plan_local_world_size: int | None = None
    """``python -m recsys_runner.plan`` only: ranks per node for ``plan_world_size`` (``null``: all on one node)."""
    timeout_s: int = 1800
    """Collective timeout; a rank that hangs longer than this fails instead of waiting forever."""

    def __post_init__(self) -> None:
        require(self.device in _DEVICES, f"distributed.device={self.device!r} must be one of {_DEVICES}")
        threads = self.num_threads
        require(threads == AUTO_THREADS or (isinstance(threads, int) and not isinstance(threads, bool) and threads > 0),
                f"distributed.num_threads={threads!r} must be a positive number or auto. Fix: distributed.num_threads=auto "
                f"(cores / ranks per node) or e.g. distributed.num_threads=4")
        require(self.backend in _BACKENDS, f"distributed.backend={self.backend!r} must be one of {_BACKENDS}")
        require(self.pipeline in _PIPELINES, f"distributed.pipeline={self.pipeline!r} must be one of {_PIPELINES}")
        _check_choices("distributed", self.sharding_types, self.compute_kernels)
        for name, table in self.tables.items():
            _check_choices(f"distributed.tables.{name}", table.sharding_types, table.compute_kernels)
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
        require(
            not (self.device == "cpu" and self.backend == "nccl"),
            "distributed.backend=nccl needs CUDA tensors; use distributed.backend=gloo (or auto) with distributed.device=cpu",
        )

    def build(self) -> Distributed:
        """The :class:`Distributed` this config describes (its process group is created by ``setup()``)."""
        built: Distributed = self.component_class()(self)
        return built


def auto_num_threads(local_world_size: int = 1, sample_s: float = 0.1) -> tuple[int, str]:
    """``distributed.num_threads: auto`` for one of ``local_world_size`` ranks on this node, with why.

    An explicit ``OMP_NUM_THREADS`` wins (the user or launcher chose). Else each rank gets its share of the
    physical cores this process may use (its CPU affinity and cgroup quota, hyperthreads not counted), capped
    by its share of the CPUs idle right now (sampled over ``sample_s``): on a machine other jobs keep busy,
    torch's threads spin-wait for cores they do not get, and a CPU step measured 10x slower with 2 threads
    than with 1 on 2 busy cores. At least 1.
    """
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), f"OMP_NUM_THREADS={omp}"
    cores, ranks = usable_cores(), max(local_world_size, 1)
    idle = idle_cpus(sample_s)
    threads = max(1, min(cores // ranks, int(idle + 0.5) // ranks if idle is not None else cores))
    busy = f", {idle:.1f} CPUs idle" if idle is not None else ""
    return threads, f"auto: {cores} usable physical cores{busy}, {ranks} rank(s) on this node; set distributed.num_threads to change"


def idle_cpus(sample_s: float = 0.1) -> float | None:
    """How many of this process's CPUs were idle over the next ``sample_s`` seconds (``/proc/stat``); ``None``
    where that cannot be read."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

    def snapshot() -> dict[str, tuple[int, int]]:
        times = {}
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu" and (allowed is None or int(name[3:]) in allowed):
                values = [int(v) for v in fields[:8]]
                times[name] = (values[3] + values[4], sum(values))  # idle + iowait, all
        return times

    try:
        before = snapshot()
        time.sleep(sample_s)
        after = snapshot()
    except (OSError, ValueError):
        return None
    shares = [(after[c][0] - before[c][0]) / (after[c][1] - before[c][1]) for c in after
              if c in before and after[c][1] > before[c][1]]
    return sum(shares) if shares else None


def usable_cores() -> int:
    """Physical cores this process may run on: the CPUs of its affinity mask, capped by a cgroup CPU quota
    (a container's ``cpu.max``), and by the physical core count when CPUs are hyperthreads."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    with contextlib.suppress(OSError):
        cores: set[tuple[str, str]] = set()
        physical = "0"
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "physical id":
                physical = value.strip()
            elif key.strip() == "core id":
                cores.add((physical, value.strip()))
        if cores:
            cpus = min(cpus, len(cores))
    return max(1, cpus)


T = TypeVar("T")


def decided_on_rank0(decide: Callable[[], T], rank: int, world_size: int) -> T:
    """``decide()`` on rank 0 only; every rank gets its result, or raises the same :class:`~recsys_runner.errors.UserError`
    (its class too: a :class:`~recsys_runner.errors.TrackingError` stays one on every rank).

    For start-of-run checks and choices about shared state (the tracking store, the checkpoint
    directory's lock, which checkpoint to resume): one view of the world, and no rank left waiting in
    a collective for a rank that raised.
    """
    result: Any = None
    error: UserError | None = None
    if rank == 0:
        try:
            result = decide()
        except UserError as e:
            error = e
    if world_size > 1:
        # the error is sent pickled as class and message (an exception's traceback and cause are not pickled)
        box: list[Any] = [(result, error)]
        dist.broadcast_object_list(box, src=0)
        result, error = box[0]
    if error is not None:
        raise error
    return result


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


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: its rank, the world, its device and the process group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class RankMemory:
    """What the plan puts on one rank, against what the planner may use there (bytes)."""

    rank: int
    hbm: int
    ddr: int
    hbm_budget: int
    ddr_budget: int

    @property
    def fits(self) -> bool:
        return self.hbm <= self.hbm_budget and self.ddr <= self.ddr_budget


@dataclass
class PlanReport:
    """A sharding plan with its per-rank memory — or the planner's reason there is none."""

    world_size: int
    local_world_size: int
    compute_device: str
    plan: ShardingPlan | None
    ranks: list[RankMemory]
    error: str | None = None

    @property
    def fits(self) -> bool:
        return self.plan is not None and all(r.fits for r in self.ranks)

    def __str__(self) -> str:
        head = (f"sharding plan for world_size={self.world_size} (local_world_size={self.local_world_size}) "
                f"on {self.compute_device}")
        if self.plan is None:
            return f"{head}\nDOES NOT FIT: {self.error}"
        lines = [head, str(self.plan), "", "per-rank memory (GB used / budget after storage reserve):",
                 f"{'rank':>4}  {'hbm':>17}  {'ddr':>17}  fits"]
        for r in self.ranks:
            lines.append(f"{r.rank:>4}  {r.hbm / _GB:8.3f} / {r.hbm_budget / _GB:6.2f}  "
                         f"{r.ddr / _GB:8.3f} / {r.ddr_budget / _GB:6.2f}  {'yes' if r.fits else 'NO'}")
        lines.append(f"fits: {'yes' if self.fits else 'NO'}")
        return "\n".join(lines)


class _RecordBestPlan(Stats):
    """Keeps the planner's chosen sharding options (their shards carry rank and storage estimates)."""

    def __init__(self) -> None:
        self.best_plan: list[ShardingOption] = []

    def log(self, sharding_plan: Any, topology: Any, batch_size: int, storage_reservation: Any, num_proposals: int,
            num_plans: int, run_time: float, best_plan: list[ShardingOption], *args: Any, **kwargs: Any) -> None:
        self.best_plan = best_plan


class _StatsAtDebug(Stats):
    """TorchRec's per-table planner report (:class:`EmbeddingStats`), sent to our log at DEBUG as one record.

    EmbeddingStats writes its rows at INFO through its own module logger, which would put a table of
    dozens of lines on every run's screen once that logger's level allows INFO. Here it runs only when
    ``recsys_runner.distributed`` logs DEBUG (``hydra.verbose=recsys_runner``), its rows are collected
    instead of printed, and they reach the run's log as one DEBUG record; the INFO screen shows
    :func:`plan_summary`'s line, and MLflow keeps the full plan as ``sharding_plan.txt``.
    """

    def __init__(self) -> None:
        self.stats = EmbeddingStats()

    def log(self, *args: Any, **kwargs: Any) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        rows: list[str] = []
        with _captured(logging.getLogger(EmbeddingStats.__module__), rows):
            self.stats.log(*args, **kwargs)
        log.debug("TorchRec planner stats:\n%s", "\n".join(rows))


class _Collect(logging.Handler):
    def __init__(self, rows: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.rows = rows

    def emit(self, record: logging.LogRecord) -> None:
        self.rows.append(record.getMessage())


@contextlib.contextmanager
def _captured(logger: logging.Logger, rows: list[str]) -> Iterator[None]:
    """Inside: ``logger``'s INFO and above records land in ``rows`` and nowhere else."""
    handler, saved = _Collect(rows), (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])  # setLevel, not .level=: the loggers' cached levels are cleared
        logger.propagate = saved[1]


class Distributed:
    """Owns the process group and turns a model into a sharded, pipelined one."""

    def __init__(self, config: DistributedConfig) -> None:
        self.config = config
        self.env: DistEnv | None = None
        self._owns_group = False

    # -- process group ---------------------------------------------------------------------------
    def setup(self) -> DistEnv:
        """Create the process group (unless the launcher already did) and pick the device."""
        map_submitit_env()  # inside a multi-task SLURM/submitit job: RANK, WORLD_SIZE, … from its environment
        rank = int(os.environ.get("RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        use_cuda = resolve_device_type(self.config.device) == "cuda"
        require(not use_cuda or torch.cuda.is_available(), "distributed.device=cuda but no CUDA device is visible; use distributed.device=auto or cpu")
        device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        backend = self.config.backend if self.config.backend != "auto" else ("nccl" if use_cuda else "gloo")
        timeout = datetime.timedelta(seconds=self.config.timeout_s)
        if not dist.is_initialized():
            if world_size == 1 and "MASTER_ADDR" not in os.environ:
                # A private in-process store: no port to pick, nothing to clash with other runs.
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            else:
                dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
            self._owns_group = True
        self.env = DistEnv(rank, world_size, local_rank, local_world_size, device, backend)
        threads, why = (self.config.num_threads, "distributed.num_threads") if isinstance(self.config.num_threads, int) \
            else auto_num_threads(local_world_size)
        torch.set_num_threads(threads)
        if rank == 0:
            log.info("torch CPU threads per rank: %d (%s)", threads, why)
        planned = self.config.plan_world_size
        if planned is not None and planned != world_size and rank == 0:
            log.warning("distributed.plan_world_size=%d has no effect on training (this run has %d ranks); it is read by "
                        "python -m recsys_runner.plan", planned, world_size)
        return self.env

    def close(self) -> None:
        """Destroy the process group if this object created it (safe to call twice)."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    # -- sharding --------------------------------------------------------------------------------
    def plan(self, model: nn.Module, batch_size: int) -> ShardingPlan:
        """Ask TorchRec's planner for a sharding plan that every rank agrees on (rank 0 plans, broadcasts)."""
        env = self._require_env()
        planner, recorder, _ = self._planner(model, batch_size, env.world_size, env.local_world_size, env.device.type)
        plan = planner.collective_plan(model, get_default_sharders(), dist.GroupMember.WORLD)
        if env.is_main:  # rank 0 planned, so its recorder holds the chosen options and their storage
            log.info("%s", plan_summary(plan, env.world_size, _rank_usage(recorder.best_plan, env.world_size)))
            log.debug("sharding plan (%d ranks):\n%s", env.world_size, plan)
        return plan

    def dry_plan(self, model: nn.Module, batch_size: int, device_type: str) -> PlanReport:
        """Plan for ``distributed.plan_world_size`` ranks (default: this process's world) without a process group.

        ``model`` may live entirely on ``meta``; nothing is allocated. The report says what each rank
        would hold and whether it fits the memory budget (``hbm_cap_gb``/``ddr_cap_gb`` minus the reserve).
        """
        c = self.config
        world_size = c.plan_world_size or int(os.environ.get("WORLD_SIZE", 1))
        local_world_size = c.plan_local_world_size or (world_size if c.plan_world_size else int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        planner, recorder, topology = self._planner(model, batch_size, world_size, local_world_size, device_type)
        budgets = [(int(d.storage.hbm * (1 - c.storage_reserve_percent)), int(d.storage.ddr * (1 - c.storage_reserve_percent)))
                   for d in topology.devices]
        try:
            plan = planner.plan(model, get_default_sharders())
        except PlannerError as e:
            return PlanReport(world_size, local_world_size, device_type, None, [], error=str(e).strip())
        used = _rank_usage(recorder.best_plan, world_size)
        ranks = [RankMemory(r, used[r][0], used[r][1], *budgets[r]) for r in range(world_size)]
        return PlanReport(world_size, local_world_size, device_type, plan, ranks)

    def _planner(self, model: nn.Module, batch_size: int, world_size: int, local_world_size: int,
                 device_type: str) -> tuple[EmbeddingShardingPlanner, _RecordBestPlan, Topology]:
        c = self.config
        intra, cross = c.intra_node_bandwidth_gbps, c.cross_node_bandwidth_gbps
        hbm, ddr = c.hbm_cap_gb, c.ddr_cap_gb
        topology = TopologyFactory.create_topology(
            trainer_config=TrainerConfig(
                world_size=world_size, local_world_size=local_world_size,
                hbm_cap_bytes=None if hbm is None else int(hbm * _GB), ddr_cap_bytes=None if ddr is None else int(ddr * _GB),
            ),
            hardware_config=HardwareConfig(
                intra_host_bw=None if intra is None else intra * _GBPS_TO_PLANNER,
                inter_host_bw=None if cross is None else cross * _GBPS_TO_PLANNER,
            ),
            # Hardware bandwidths are read only in this mode; unset ones fall back to TorchRec's defaults.
            kernel_config=KernelConfig(compute_device=device_type, use_hardware_based_bandwidth=intra is not None or cross is not None),
        )
        recorder = _RecordBestPlan()
        planner = EmbeddingShardingPlanner(
            topology=topology,
            batch_size=c.planner_batch_size or batch_size,
            constraints=self._constraints(_table_names(model), world_size),
            storage_reservation=FixedPercentageStorageReservation(percentage=c.storage_reserve_percent),
            stats=[_StatsAtDebug(), recorder],
        )
        return planner, recorder, topology

    def _constraints(self, tables: list[str], world_size: int) -> dict[str, ParameterConstraints] | None:
        """Per-table planner constraints: the table's own choices, else the global ones, else (sharding
        types on one rank) :data:`ONE_RANK_SHARDING_TYPES`."""
        c = self.config
        unknown = sorted(set(c.tables) - set(tables))
        if unknown:
            known = sorted(tables, key=lambda t: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", t)])
            raise ConfigError(f"distributed.tables names {unknown}, which the model does not have; its tables: {', '.join(known)}")
        sharding_types = c.sharding_types or (ONE_RANK_SHARDING_TYPES if world_size == 1 else None)
        if not (sharding_types or c.compute_kernels or c.tables):
            return None
        constraints = {}
        for table in tables:
            own = c.tables.get(table, TableShardingConfig())
            constraints[table] = ParameterConstraints(
                sharding_types=list(own.sharding_types or sharding_types or []) or None,  # a copy: never the shared default
                compute_kernels=own.compute_kernels or c.compute_kernels,
            )
        return constraints

    def shard(self, model: nn.Module, plan: ShardingPlan) -> DistributedModelParallel:
        """Wrap ``model`` in DistributedModelParallel following ``plan``.

        Embedding tables are materialized (from ``meta``) only on the ranks that own their shards;
        the dense part is replicated and kept in sync with DDP.
        """
        env = self._require_env()
        return DistributedModelParallel(
            module=model,
            device=env.device,
            env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
            plan=plan,
            sharders=get_default_sharders(),
        )

    def pipeline(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, policy: StepPolicy | None = None, *, annotate: bool = False,
    ) -> Pipeline:
        """The train pipeline chosen by ``distributed.pipeline``.

        ``base`` on a CPU is :class:`~recsys_runner.stepping.LeanPipeline` (batches are made where the model is);
        on a GPU it is TorchRec's ``TrainPipelineBase``, which copies the next batch on a side stream. With an
        active step policy (accumulation, loss scaling, clipping, EMA) the pipeline runs the policy's backward and
        dense step (:mod:`recsys_runner.stepping`) and steps the fused optimizer; otherwise it steps ``optimizer``
        once per batch. ``annotate`` keeps the profiler ranges of the lean pipeline (``train.profile``).
        """
        env = self._require_env()
        kind = self.config.pipeline
        if kind == "auto":
            kind = "sparse_dist" if env.device.type == "cuda" else "base"
        active = policy is not None and policy.active
        if kind == "base" and env.device.type == "cpu":
            if active:
                assert policy is not None
                return LeanPipeline(model, policy.sparse, policy=policy, annotate=annotate)
            return LeanPipeline(model, optimizer, annotate=annotate)
        if active:
            assert policy is not None
            with_policy = PolicyPipelineSparseDist if kind == "sparse_dist" else PolicyPipelineBase
            return with_policy(model, policy, env.device)
        if kind == "sparse_dist":
            return TrainPipelineSparseDist(model, optimizer, env.device, execute_all_batches=True)
        return TrainPipelineBase(model, optimizer, env.device)

    def _require_env(self) -> DistEnv:
        assert self.env is not None, "Distributed.setup() must run first"
        return self.env


def _rank_usage(best_plan: list[ShardingOption], world_size: int) -> list[tuple[int, int]]:
    """``(hbm, ddr)`` bytes the planner's chosen options put on each rank."""
    used = [[0, 0] for _ in range(world_size)]
    for option in best_plan:
        for shard in option.shards:
            if shard.rank is not None and shard.storage is not None:
                used[shard.rank][0] += shard.storage.hbm
                used[shard.rank][1] += shard.storage.ddr
    return [(hbm, ddr) for hbm, ddr in used]


def _mb(n: int) -> str:
    return f"{n / 1024**2:.1f} MB" if n < _GB else f"{n / _GB:.2f} GB"


def plan_summary(plan: ShardingPlan, world_size: int, usage: list[tuple[int, int]] | None = None) -> str:
    """One line: how many tables, on how many ranks, per sharding type and compute kernel, and (from the
    planner's estimates, when ``usage`` has them) the most memory one rank holds, e.g.
    ``sharding plan: 26 tables on 1 rank: 26 table_wise (fused kernel); est. 12.3 MB/rank (HBM 12.3 MB, DDR 0.0 MB)``;
    with several ranks ``est. max ... (HBM ..., DDR ...), min ...``, the fullest and the emptiest rank.
    """
    counts = Counter(
        (p.sharding_type, p.compute_kernel)
        for module in plan.plan.values() if isinstance(module, EmbeddingModuleShardingPlan)
        for p in module.values()
    )
    kinds = ", ".join(f"{n} {sharding} ({kernel} kernel)" for (sharding, kernel), n in sorted(counts.items(), key=lambda kv: -kv[1]))
    line = (f"sharding plan: {sum(counts.values())} tables on {world_size} rank{'s' if world_size != 1 else ''}: "
            f"{kinds or 'nothing to shard'}")
    if usage and any(hbm or ddr for hbm, ddr in usage):
        hbm, ddr = max(usage, key=lambda u: u[0] + u[1])
        most = "" if world_size == 1 else "max "
        line += f"; est. {most}{_mb(hbm + ddr)}/rank (HBM {_mb(hbm)}, DDR {_mb(ddr)})"
        if world_size > 1:  # how even the split is
            line += f", min {_mb(min(h + d for h, d in usage))}"
    return line


def _table_names(model: nn.Module) -> list[str]:
    return [
        config.name
        for module in model.modules()
        for config in getattr(module, "embedding_bag_configs", lambda: [])()
    ]


@contextlib.contextmanager
def detached(pipeline: Pipeline, model: nn.Module) -> Iterator[nn.Module]:
    """The pipeline's model with its original forward, for evaluation between training steps.

    TrainPipelineSparseDist rewrites the sharded modules' forward to read pre-distributed inputs;
    detaching restores it and keeps in-flight training batches, which resume after ``attach``.
    """
    if isinstance(pipeline, TrainPipelineSparseDist):
        original = pipeline.detach()
        try:
            yield original
        finally:
            pipeline.attach(original)
    else:
        yield model
