"""The process group, TorchRec's sharding planner and DistributedModelParallel (:class:`Distributed`).

Rank and world size come from the environment torchrun (or SLURM via submitit) sets: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``. Without them the run is a single process, and
a world-size-1 process group is still created, because TorchRec shards through one even then.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.constants import UVM_CACHING_RATIO
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.proposers import DynamicProgrammingProposer, GreedyProposer, GridSearchProposer, UniformProposer
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import (
    HardwareConfig,
    KernelConfig,
    PlannerError,
    Proposer,
    ShardingOption,
    Stats,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import (
    CacheParams,
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
)
from torchrec.modules.mc_modules import ManagedCollisionCollection

from recsys_runner.distributed.config import DistributedConfig, PlannerConfig, TableShardingConfig, resolve_device_type
from recsys_runner.distributed.env import DistEnv, auto_num_threads
from recsys_runner.distributed.launch import elastic_store, map_submitit_env
from recsys_runner.errors import ConfigError, require

log = logging.getLogger(__name__)

_GB = 1024**3

_GBPS_TO_PLANNER = _GB / 1000  # the planner's bandwidths are bytes per millisecond

_CACHING_KERNELS = {EmbeddingComputeKernel.FUSED_UVM_CACHING.value, EmbeddingComputeKernel.QUANT_UVM_CACHING.value}
"""The kernels that keep a table in host memory behind an HBM cache of ``cache_load_factor`` of its rows (fbgemm's)."""

ONE_RANK_SHARDING_TYPES = [ShardingType.TABLE_WISE.value, ShardingType.DATA_PARALLEL.value]
"""The sharding types the planner may choose on one rank unless the config names others: row-wise and
column-wise shard a table across ranks, and with one rank they only add work (row-wise: a bucketize and
an all-to-all every step, measured on an H100), yet the planner's costs can still prefer them."""


class _RowWiseOnCpu(EmbeddingBagCollectionSharder):
    """TorchRec's EmbeddingBagCollection sharder, offering ``row_wise`` on CPU too: a managed-collision table's mapping
    is sharded row-wise only, and its embedding table must follow (TorchRec's sharder offers ``row_wise`` on CUDA alone)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = super().sharding_types(compute_device_type)
        return types if ShardingType.ROW_WISE.value in types else [*types, ShardingType.ROW_WISE.value]


class _ManagedSharder(ManagedCollisionEmbeddingBagCollectionSharder):
    """TorchRec's ManagedCollisionEmbeddingBagCollection sharder over :class:`_RowWiseOnCpu`, offering only the compute
    kernels its table sharder has on the device (TorchRec's lists UVM kernels on CPU too, which the planner's cost
    estimator then rejects)."""

    def __init__(self) -> None:
        super().__init__(ebc_sharder=_RowWiseOnCpu())

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        offered = self._e_sharder.compute_kernels(sharding_type, compute_device_type)
        return [k for k in super().compute_kernels(sharding_type, compute_device_type) if k in offered]


def runner_sharders() -> list[ModuleSharder[nn.Module]]:
    """TorchRec's default sharders (which include the managed-collision ones), the ManagedCollisionEmbeddingBagCollection
    sharder replaced by :class:`_ManagedSharder` so that a managed table is shardable on CPU (gloo) as on CUDA."""
    return [_ManagedSharder() if isinstance(s, ManagedCollisionEmbeddingBagCollectionSharder) else s for s in get_default_sharders()]


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
    proposer: str = "default"
    """``distributed.planner.proposer``: which proposer(s) the planner searched with."""
    summary: str = ""
    """The plan's one line (:func:`plan_summary`): tables per sharding type and kernel, UVM caches' ratio and size."""

    @property
    def fits(self) -> bool:
        return self.plan is not None and all(r.fits for r in self.ranks)

    def __str__(self) -> str:
        head = (f"sharding plan for world_size={self.world_size} (local_world_size={self.local_world_size}) "
                f"on {self.compute_device}, proposer={self.proposer}")
        if self.plan is None:
            return f"{head}\nDOES NOT FIT: {self.error}"
        lines = [head, str(self.plan), "", *([self.summary, ""] if self.summary else []),
                 "per-rank memory (GB used / budget after storage reserve):",
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
        self.summary = ""  # the last plan's line (plan_summary), as logged; the caches' sizes only on rank 0, which planned

    # -- process group ---------------------------------------------------------------------------
    def setup(self) -> DistEnv:
        """Create the process group (unless the launcher already did) and pick the device."""
        map_submitit_env()  # inside a multi-task SLURM/submitit job: RANK, WORLD_SIZE, … from its environment
        rank = int(os.environ.get("RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        use_cuda = resolve_device_type(self.config.device) == "cuda"
        require(not use_cuda or torch.cuda.is_available(),
                f"distributed.device=cuda but no CUDA device is visible (torch {torch.__version__}: no GPU, no driver, or a "
                f"CPU build of torch). Fix: distributed.device=auto (CUDA when there is one) or distributed.device=cpu")
        device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        backend = self.config.backend if self.config.backend != "auto" else ("nccl" if use_cuda else "gloo")
        timeout = datetime.timedelta(seconds=self.config.timeout_s)
        if not dist.is_initialized():
            if world_size == 1 and "MASTER_ADDR" not in os.environ:
                # A private in-process store: no port to pick, nothing to clash with other runs.
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            else:  # under torchrun, a store of this restart (launch.elastic_store)
                dist.init_process_group(backend, store=elastic_store(rank, world_size, timeout), rank=rank, world_size=world_size,
                                        timeout=timeout)
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
        planner, recorder, topology = self._planner(model, batch_size, env.world_size, env.local_world_size, env.device.type)
        try:
            plan = planner.collective_plan(model, runner_sharders(), dist.GroupMember.WORLD)
        except PlannerError as e:
            why = self._caches_overflow_hbm(model, batch_size, topology)
            if why is None:
                raise
            raise ConfigError(why) from e
        # rank 0 planned, so its recorder holds the chosen options and their storage
        self.summary = plan_summary(plan, env.world_size, _rank_usage(recorder.best_plan, env.world_size), recorder.best_plan)
        if env.is_main:
            log.info("%s", self.summary)
            log.debug("sharding plan (%d ranks):\n%s", env.world_size, plan)
            self._warn_unused_cache_load_factor(plan)
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
            plan = planner.plan(model, runner_sharders())
        except PlannerError as e:
            why = self._caches_overflow_hbm(model, batch_size, topology)
            error = str(e).strip() if why is None else f"{why}\n\nTorchRec's planner: {str(e).strip()}"
            return PlanReport(world_size, local_world_size, device_type, None, [], error=error, proposer=c.planner.proposer)
        used = _rank_usage(recorder.best_plan, world_size)
        ranks = [RankMemory(r, used[r][0], used[r][1], *budgets[r]) for r in range(world_size)]
        return PlanReport(world_size, local_world_size, device_type, plan, ranks, proposer=c.planner.proposer,
                          summary=plan_summary(plan, world_size, used, recorder.best_plan))

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
            constraints=self._model_constraints(model, world_size, device_type),
            storage_reservation=FixedPercentageStorageReservation(percentage=c.storage_reserve_percent),
            proposer=proposers(c.planner, device_type),
            stats=[_StatsAtDebug(), recorder],
        )
        return planner, recorder, topology

    def _model_constraints(self, model: nn.Module, world_size: int, device_type: str) -> dict[str, ParameterConstraints] | None:
        return self._constraints(_table_names(model), world_size, set(_table_names(model, unpooled=True)), device_type,
                                 managed=_managed_table_names(model))

    def _caches_overflow_hbm(self, model: nn.Module, batch_size: int, topology: Topology) -> str | None:
        """Why no plan fits, when it is because the device memory cannot hold even the UVM caches: every table in its
        least-HBM option that the allowed kernels offer (the planner's own enumeration and estimates), and some of
        those options cache; ``None`` otherwise (the planner's message stands)."""
        if topology.compute_device != "cuda":
            return None
        c = self.config
        constraints = self._model_constraints(model, topology.world_size, topology.compute_device)
        options = EmbeddingEnumerator(topology, c.planner_batch_size or batch_size, constraints).enumerate(model, runner_sharders())
        least: dict[str, ShardingOption] = {}
        for option in options:
            if option.fqn not in least or option.total_storage.hbm < least[option.fqn].total_storage.hbm:
                least[option.fqn] = option
        need = sum(o.total_storage.hbm for o in least.values())
        budget = sum(int(d.storage.hbm * (1 - c.storage_reserve_percent)) for d in topology.devices)
        cached = [o for o in least.values() if o.compute_kernel in _CACHING_KERNELS]
        if need <= budget or not cached:
            return None
        ratios = sorted({_load_factor(o) for o in cached})
        ratio = "/".join(f"{r:.0%}" for r in ratios)
        source = "distributed.cache_load_factor" if c.cache_load_factor is not None else "TorchRec's default"
        cap_gb = topology.devices[0].storage.hbm / _GB
        need_gb = need / len(topology.devices) / (1 - c.storage_reserve_percent) / _GB
        ranks = f"{len(topology.devices)} rank{'s' if len(topology.devices) != 1 else ''}"
        allowed = f"distributed.compute_kernels={c.compute_kernels}" if c.compute_kernels else "distributed.tables.<t>.compute_kernels"
        return (
            f"distributed.hbm_cap_gb={cap_gb:g} cannot hold even the tables' UVM caches: with the kernels allowed "
            f"({allowed}), {len(cached)} tables are at best cached, {ratio} of their rows "
            f"({source}), and the tables then need {_mb(need)} of HBM (caches, optimizer state and buffers: the planner's "
            f"estimate), more than {ranks} x {cap_gb:g} GB leave after distributed.storage_reserve_percent="
            f"{c.storage_reserve_percent:g} ({_mb(budget)}). Fix: distributed.hbm_cap_gb={math.ceil(need_gb * 100) / 100:g} or "
            f"more (what they need), a smaller distributed.cache_load_factor (e.g. {ratios[0] / 2:g}), or allow tables in host "
            f"memory without a cache: distributed.compute_kernels=null (or add fused_uvm)"
        )

    def _warn_unused_cache_load_factor(self, plan: ShardingPlan) -> None:
        c = self.config
        if c.cache_load_factor is None and not any(t.cache_load_factor is not None for t in c.tables.values()):
            return
        kernels = {p.compute_kernel for m in plan.plan.values() if isinstance(m, EmbeddingModuleShardingPlan) for p in m.values()}
        if not kernels & _CACHING_KERNELS:
            log.warning("distributed.cache_load_factor has no effect: no table was given a UVM caching kernel (every table fits "
                        "in distributed.hbm_cap_gb, or the plan is for a CPU)")

    def _constraints(self, tables: list[str], world_size: int, unpooled: set[str] | None = None,
                     device_type: str = "cpu", managed: set[str] | None = None) -> dict[str, ParameterConstraints] | None:
        """Per-table planner constraints: the table's own choices, else the global ones, else (sharding
        types on one rank) :data:`ONE_RANK_SHARDING_TYPES`; ``unpooled`` tables (an EmbeddingCollection's: histories)
        never get ``data_parallel`` (:func:`_unpooled_types`); ``managed`` (managed-collision) tables are row-wise, the
        one way TorchRec shards their mapping (:func:`_managed_types`). On CUDA each table's UVM cache settings
        (:func:`_cache_params`) go with it, for the planner to budget and fbgemm to build if the table is cached."""
        c = self.config
        unknown = sorted(set(c.tables) - set(tables))
        if unknown:
            known = sorted(tables, key=lambda t: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", t)])
            raise ConfigError(f"distributed.tables names {unknown}, which the model does not have; its tables: {', '.join(known)}")
        sharding_types = c.sharding_types or (ONE_RANK_SHARDING_TYPES if world_size == 1 else None)
        if not (sharding_types or c.compute_kernels or c.tables or unpooled or c.cache_load_factor or c.pipeline == "prefetch"):
            return None
        constraints = {}
        for table in tables:
            own = c.tables.get(table, TableShardingConfig())
            types = list(own.sharding_types or sharding_types or [])  # a copy: never the shared default
            if table in (unpooled or set()):
                types = _unpooled_types(table, types, device_type, chosen=own.sharding_types or c.sharding_types)
            if table in (managed or set()):
                types = _managed_types(table, chosen=own.sharding_types or c.sharding_types)
            constraints[table] = ParameterConstraints(sharding_types=types or None,
                                                      compute_kernels=own.compute_kernels or c.compute_kernels,
                                                      cache_params=_cache_params(c, own, device_type))
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
            sharders=runner_sharders(),
        )

    def _require_env(self) -> DistEnv:
        assert self.env is not None, "Distributed.setup() must run first"
        return self.env


def proposers(config: PlannerConfig, device_type: str) -> list[Proposer] | None:
    """The proposers ``distributed.planner.proposer`` names; ``None`` for TorchRec's default set."""
    if config.proposer == "dynamic_programming":
        require(device_type == "cuda",
                "distributed.planner.proposer=dynamic_programming budgets device (HBM) memory, and this plan is for "
                f"{device_type}, which has none. Fix: distributed.planner.proposer=default, or distributed.device=cuda")
        return [DynamicProgrammingProposer(hbm_bins_per_device=config.hbm_bins_per_device)]
    chosen: dict[str, Callable[[], list[Proposer]]] = {
        "greedy": lambda: [GreedyProposer()], "grid_search": lambda: [GridSearchProposer()], "uniform": lambda: [UniformProposer()],
    }
    return chosen[config.proposer]() if config.proposer in chosen else None


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


def plan_summary(plan: ShardingPlan, world_size: int, usage: list[tuple[int, int]] | None = None,
                 options: Sequence[ShardingOption] = ()) -> str:
    """One line: how many tables, on how many ranks, per sharding type and compute kernel, and (from the
    planner's estimates, when ``usage`` has them) the most memory one rank holds, e.g.
    ``sharding plan: 26 tables on 1 rank: 26 table_wise (fused kernel); est. 12.3 MB/rank (HBM 12.3 MB, DDR 0.0 MB)``;
    with several ranks ``est. max ... (HBM ..., DDR ...), min ...``, the fullest and the emptiest rank.

    With the planner's chosen ``options``, tables with a UVM caching kernel also say their cache ratio and the cache's
    size against the whole tables' (weights, all ranks), e.g. ``26 table_wise (fused_uvm_caching kernel, cache 20% of
    rows: 0.41 GB HBM of 2.05 GB)``.
    """
    counts = Counter(
        (p.sharding_type, p.compute_kernel)
        for module in plan.plan.values() if isinstance(module, EmbeddingModuleShardingPlan)
        for p in module.values()
    )
    caches = _cache_notes(options)
    kinds = ", ".join(f"{n} {sharding} ({kernel} kernel{caches.get((sharding, kernel), '')})"
                      for (sharding, kernel), n in sorted(counts.items(), key=lambda kv: -kv[1]))
    line = (f"sharding plan: {sum(counts.values())} tables on {world_size} rank{'s' if world_size != 1 else ''}: "
            f"{kinds or 'nothing to shard'}")
    if usage and any(hbm or ddr for hbm, ddr in usage):
        hbm, ddr = max(usage, key=lambda u: u[0] + u[1])
        most = "" if world_size == 1 else "max "
        line += f"; est. {most}{_mb(hbm + ddr)}/rank (HBM {_mb(hbm)}, DDR {_mb(ddr)})"
        if world_size > 1:  # how even the split is
            line += f", min {_mb(min(h + d for h, d in usage))}"
    return line


def _load_factor(option: ShardingOption) -> float:
    """The share of rows a cached table's HBM cache holds: its ``cache_load_factor``, else TorchRec's default (which
    the planner budgets and TorchRec's fbgemm kernels allocate alike)."""
    return option.cache_load_factor if option.cache_load_factor is not None else UVM_CACHING_RATIO


def _cache_notes(options: Sequence[ShardingOption]) -> dict[tuple[str, str], str]:
    """Per (sharding type, caching kernel): ``, cache 20% of rows: 0.41 GB HBM of 2.05 GB``, the tables' caches and
    whole sizes (weights) summed; a range of ratios when tables differ."""
    groups: dict[tuple[str, str], list[ShardingOption]] = {}
    for option in options:
        if option.compute_kernel in _CACHING_KERNELS:
            groups.setdefault((option.sharding_type, option.compute_kernel), []).append(option)
    out = {}
    for key, group in groups.items():
        ratios = sorted({_load_factor(o) for o in group})
        ratio = f"{ratios[0]:.0%}" if len(ratios) == 1 else f"{ratios[0]:.0%}-{ratios[-1]:.0%}"
        whole = [o.tensor.numel() * o.tensor.element_size() for o in group]
        cache = sum(round(_load_factor(o) * size) for o, size in zip(group, whole, strict=True))
        out[key] = f", cache {ratio} of rows: {_mb(cache)} HBM of {_mb(sum(whole))}"
    return out


def _cache_params(config: DistributedConfig, table: TableShardingConfig, device_type: str) -> CacheParams | None:
    """A table's UVM cache settings on CUDA, used if the planner caches it: its ``cache_load_factor`` (else the global
    one) and, with ``distributed.pipeline=prefetch``, ``prefetch_pipeline``: fbgemm then locks the rows prefetched for
    the next batch in the cache until that batch has used them (without it TorchRec warns that backward may read wrong
    cache locations). ``None`` where nothing is set (TorchRec's defaults) and on CPU, which has no such kernel."""
    load_factor = table.cache_load_factor if table.cache_load_factor is not None else config.cache_load_factor
    prefetch = config.pipeline == "prefetch"
    if device_type != "cuda" or (load_factor is None and not prefetch):
        return None
    return CacheParams(load_factor=load_factor, prefetch_pipeline=True if prefetch else None)


def _table_names(model: nn.Module, unpooled: bool = False) -> list[str]:
    """Every embedding table of ``model``: its EmbeddingBagCollections' (pooled) and EmbeddingCollections' (histories);
    with ``unpooled`` only the latter. A ManagedCollisionCollection lists its tables' configs too, but holds no table."""
    getters = ("embedding_configs",) if unpooled else ("embedding_bag_configs", "embedding_configs")
    return [config.name for module in model.modules() if not isinstance(module, ManagedCollisionCollection)
            for getter in getters for config in getattr(module, getter, lambda: [])()]


def _managed_table_names(model: nn.Module) -> set[str]:
    """The tables of ``model`` whose ids a managed-collision module maps (``models/collision.py``)."""
    return {c.name for m in model.modules() if isinstance(m, ManagedCollisionCollection) for c in m.embedding_configs()}


def _managed_types(table: str, chosen: list[str] | None) -> list[str]:
    """``[row_wise]``: TorchRec's ManagedCollisionCollectionSharder shards a mapping row-wise only (one rank included).

    Raises:
        ConfigError: the configured types (``chosen``) exclude ``row_wise``.
    """
    if chosen and ShardingType.ROW_WISE.value not in chosen:
        raise ConfigError(f"table {table!r} is a managed-collision table, which TorchRec shards row_wise only, but the sharding "
                          f"types {chosen} exclude it. Fix: +distributed.tables.{table}.sharding_types=[row_wise]")
    return [ShardingType.ROW_WISE.value]


def _unpooled_types(table: str, types: list[str], device_type: str, chosen: list[str] | None) -> list[str]:
    """The sharding types an unpooled (EmbeddingCollection) table may take: ``types`` (all the sharder offers when
    empty) without ``data_parallel``, which in this TorchRec returns one row per bag instead of one per id for an
    EmbeddingCollection (measured on CPU: the forward fails in ``split_with_sizes``).

    Raises:
        ConfigError: the configured types (``chosen``) leave none for the table.
    """
    offered = types or EmbeddingCollectionSharder().sharding_types(device_type)
    usable = [t for t in offered if t != ShardingType.DATA_PARALLEL.value]
    if not usable:
        raise ConfigError(
            f"table {table!r} is read unpooled (a history's table, in an EmbeddingCollection), which cannot be sharded "
            f"data_parallel, and the sharding types {chosen} leave nothing else. Fix: +distributed.tables.{table}.sharding_types="
            f"[table_wise] (or row_wise / column_wise)"
        )
    return usable
