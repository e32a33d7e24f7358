"""The process group and the sharded model: :class:`Distributed` sets up the group, plans with TorchRec's planner, wraps DMP.

Rank and world size come from the environment torchrun (or SLURM via submitit) sets: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``. Without them the run is a single process, and
a world-size-1 process group is still created, because TorchRec shards through one even then. The planner is set up
by :mod:`recsys_runner.distributed.planner`; what its plan puts where is :mod:`recsys_runner.distributed.plan_report`'s,
and this module logs it (the one-line summary at INFO, the full plan and TorchRec's planner stats at DEBUG).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.types import PlannerError, Stats
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingEnv, ShardingPlan

from recsys_runner.distributed.config import DistributedConfig, foreign_environment, resolve_device_type
from recsys_runner.distributed.env import DistEnv, auto_num_threads
from recsys_runner.distributed.launch import elastic_store, map_submitit_env, port_taken
from recsys_runner.distributed.plan_report import (
    CACHING_KERNELS,
    PlanReport,
    RankMemory,
    RecordBestPlan,
    plan_summary,
    rank_usage,
)
from recsys_runner.distributed.planner import build_planner, caches_overflow_hbm, runner_sharders
from recsys_runner.errors import ConfigError, require

log = logging.getLogger(__name__)


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
        port_from = "set in the environment" if "MASTER_PORT" in os.environ else "drawn from the job id"
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
                try:
                    dist.init_process_group(backend, store=elastic_store(rank, world_size, timeout), rank=rank,
                                            world_size=world_size, timeout=timeout)
                except dist.DistNetworkError as e:
                    raise port_taken(e, port_from) or e from None
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
            why = caches_overflow_hbm(self.config, model, batch_size, topology)
            if why is None:
                raise
            raise ConfigError(why) from e
        # rank 0 planned, so its recorder holds the chosen options and their storage
        self.summary = plan_summary(plan, env.world_size, rank_usage(recorder.best_plan, env.world_size), recorder.best_plan)
        if env.is_main:
            _warn_foreign_environment()
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
        _warn_foreign_environment()
        world_size = c.plan_world_size or int(os.environ.get("WORLD_SIZE", 1))
        local_world_size = c.plan_local_world_size or (world_size if c.plan_world_size else int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        planner, recorder, topology = self._planner(model, batch_size, world_size, local_world_size, device_type)
        budgets = [(int(d.storage.hbm * (1 - c.storage_reserve_percent)), int(d.storage.ddr * (1 - c.storage_reserve_percent)))
                   for d in topology.devices]
        try:
            plan = planner.plan(model, runner_sharders())
        except PlannerError as e:
            why = caches_overflow_hbm(self.config, model, batch_size, topology)
            error = str(e).strip() if why is None else f"{why}\n\nTorchRec's planner: {str(e).strip()}"
            return PlanReport(world_size, local_world_size, device_type, None, [], error=error, proposer=c.planner.proposer)
        used = rank_usage(recorder.best_plan, world_size)
        ranks = [RankMemory(r, used[r][0], used[r][1], *budgets[r]) for r in range(world_size)]
        return PlanReport(world_size, local_world_size, device_type, plan, ranks, proposer=c.planner.proposer,
                          summary=plan_summary(plan, world_size, used, recorder.best_plan))

    def _planner(self, model: nn.Module, batch_size: int, world_size: int, local_world_size: int,
                 device_type: str) -> tuple[EmbeddingShardingPlanner, RecordBestPlan, Topology]:
        """The planner (:func:`~recsys_runner.distributed.planner.build_planner`), reporting to this module's log and to a
        recorder of the options it chooses; and its topology."""
        recorder = RecordBestPlan()
        planner, topology = build_planner(self.config, model, batch_size, world_size, local_world_size, device_type,
                                          stats=[_StatsAtDebug(), recorder])
        return planner, recorder, topology

    def _warn_unused_cache_load_factor(self, plan: ShardingPlan) -> None:
        c = self.config
        if c.cache_load_factor is None and not any(t.cache_load_factor is not None for t in c.tables.values()):
            return
        kernels = {p.compute_kernel for m in plan.plan.values() if isinstance(m, EmbeddingModuleShardingPlan) for p in m.values()}
        if not kernels & CACHING_KERNELS:
            log.warning("distributed.cache_load_factor has no effect: no table was given a UVM caching kernel (every table fits "
                        "in distributed.hbm_cap_gb, or the plan is for a CPU)")

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


def _warn_foreign_environment() -> None:
    """Say each of TorchEasyRec's planning and process-group variables set in the environment, which nothing here reads
    (:func:`~recsys_runner.distributed.config.foreign_environment`): a migrated launch script would plan as if it had
    no effect, without a word."""
    for said in foreign_environment(os.environ):
        log.warning("%s", said)
