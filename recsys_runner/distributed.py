"""Process group, device, sharding planner, DistributedModelParallel and the train pipeline.

Rank and world size come from the environment torchrun (or SLURM via submitit) sets: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``. Without them the run is a single process, and
a world-size-1 process group is still created, because TorchRec shards through one even then.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
from torchrec.distributed.embedding_types import EmbeddingComputeKernel

from recsys_runner.errors import require

_BACKENDS = ("auto", "gloo", "nccl")
_DEVICES = ("auto", "cpu", "cuda")
_PIPELINES = ("auto", "sparse_dist", "base")
_SHARDING_TYPES = sorted(t.value for t in ShardingType)
_KERNELS = sorted(k.value for k in EmbeddingComputeKernel)


@dataclass(kw_only=True)
class DistributedConfig:
    """Schema of ``conf/distributed/*.yaml``."""

    _target_: str = "recsys_runner.distributed.Distributed"
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda``."""
    backend: str = "auto"
    """Process-group backend: ``auto`` (NCCL on CUDA, gloo on CPU), ``gloo`` or ``nccl``."""
    pipeline: str = "auto"
    """Train pipeline: ``sparse_dist`` overlaps the next batch's input distribution with the current
    step (a win on GPU); ``base`` is a plain forward/backward/step loop (faster on CPU, where there
    is nothing to overlap). ``auto`` picks ``sparse_dist`` on CUDA and ``base`` on CPU."""
    sharding_types: list[str] | None = None
    """Sharding types the planner may choose from for every table (e.g. ``[table_wise, row_wise]``);
    ``null`` lets the planner consider all."""
    compute_kernels: list[str] | None = None
    """Embedding kernels the planner may choose from (e.g. ``[fused]``); ``null`` for all."""
    storage_reserve_percent: float = 0.15
    """Fraction of each device's memory the planner keeps free for activations and buffers."""
    timeout_s: int = 1800
    """Collective timeout; a rank that hangs longer than this fails instead of waiting forever."""

    def __post_init__(self) -> None:
        require(self.device in _DEVICES, f"distributed.device={self.device!r} must be one of {_DEVICES}")
        require(self.backend in _BACKENDS, f"distributed.backend={self.backend!r} must be one of {_BACKENDS}")
        require(self.pipeline in _PIPELINES, f"distributed.pipeline={self.pipeline!r} must be one of {_PIPELINES}")
        for t in self.sharding_types or []:
            require(t in _SHARDING_TYPES, f"distributed.sharding_types has unknown {t!r}; valid: {_SHARDING_TYPES}")
        for k in self.compute_kernels or []:
            require(k in _KERNELS, f"distributed.compute_kernels has unknown {k!r}; valid: {_KERNELS}")
        require(0 <= self.storage_reserve_percent < 1, "distributed.storage_reserve_percent must lie in [0, 1)")
        require(self.timeout_s > 0, "distributed.timeout_s must be positive")
        require(
            not (self.device == "cpu" and self.backend == "nccl"),
            "distributed.backend=nccl needs CUDA tensors; use distributed.backend=gloo (or auto) with distributed.device=cpu",
        )


def resolve_device_type(device: str) -> str:
    """``cuda`` or ``cpu`` for a ``distributed.device`` setting, without touching a process group."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def check_sharding_types(sharding_types: list[str] | None, device_type: str) -> None:
    """Reject sharding types TorchRec cannot use for embedding tables on ``device_type``."""
    if not sharding_types:
        return
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    available = EmbeddingBagCollectionSharder().sharding_types(device_type)
    unusable = [t for t in sharding_types if t not in available]
    require(
        not unusable,
        f"distributed.sharding_types={sharding_types}: {unusable} cannot shard embedding tables on {device_type}; "
        f"available there: {available}",
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


class Distributed:
    """Owns the process group and turns a model into a sharded, pipelined one."""

    def __init__(
        self,
        *,
        device: str = "auto",
        backend: str = "auto",
        pipeline: str = "auto",
        sharding_types: list[str] | None = None,
        compute_kernels: list[str] | None = None,
        storage_reserve_percent: float = 0.15,
        timeout_s: int = 1800,
    ) -> None:
        self._device, self._backend, self._pipeline = device, backend, pipeline
        self._sharding_types = list(sharding_types) if sharding_types else None
        self._compute_kernels = list(compute_kernels) if compute_kernels else None
        self._storage_reserve_percent = storage_reserve_percent
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self.env: DistEnv | None = None
        self._owns_group = False

    # -- process group ---------------------------------------------------------------------------
    def setup(self) -> DistEnv:
        """Create the process group (unless the launcher already did) and pick the device."""
        rank = int(os.environ.get("RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        use_cuda = resolve_device_type(self._device) == "cuda"
        require(not use_cuda or torch.cuda.is_available(), "distributed.device=cuda but no CUDA device is visible; use distributed.device=auto or cpu")
        device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        backend = self._backend if self._backend != "auto" else ("nccl" if use_cuda else "gloo")
        if not dist.is_initialized():
            if world_size == 1 and "MASTER_ADDR" not in os.environ:
                # A private in-process store: no port to pick, nothing to clash with other runs.
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=self._timeout)
            else:
                dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=self._timeout)
            self._owns_group = True
        self.env = DistEnv(rank, world_size, local_rank, local_world_size, device, backend)
        return self.env

    def close(self) -> None:
        """Destroy the process group if this object created it (safe to call twice)."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    # -- sharding --------------------------------------------------------------------------------
    def plan(self, model: nn.Module, batch_size: int) -> ShardingPlan:
        """Ask TorchRec's planner for a sharding plan that every rank agrees on."""
        env = self._require_env()
        topology = TopologyFactory.create_topology(
            trainer_config=TrainerConfig(world_size=env.world_size, local_world_size=env.local_world_size),
            kernel_config=KernelConfig(compute_device=env.device.type),
        )
        constraints = None
        if self._sharding_types or self._compute_kernels:
            constraints = {
                table: ParameterConstraints(sharding_types=self._sharding_types, compute_kernels=self._compute_kernels)
                for table in _table_names(model)
            }
        planner = EmbeddingShardingPlanner(
            topology=topology,
            batch_size=batch_size,
            constraints=constraints,
            storage_reservation=FixedPercentageStorageReservation(percentage=self._storage_reserve_percent),
        )
        return planner.collective_plan(model, get_default_sharders(), dist.GroupMember.WORLD)

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

    def pipeline(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> TrainPipelineBase | TrainPipelineSparseDist:
        """The train pipeline chosen by ``distributed.pipeline``."""
        env = self._require_env()
        kind = self._pipeline
        if kind == "auto":
            kind = "sparse_dist" if env.device.type == "cuda" else "base"
        if kind == "sparse_dist":
            return TrainPipelineSparseDist(model, optimizer, env.device, execute_all_batches=True)
        return TrainPipelineBase(model, optimizer, env.device)

    def _require_env(self) -> DistEnv:
        assert self.env is not None, "Distributed.setup() must run first"
        return self.env


def _table_names(model: nn.Module) -> list[str]:
    return [
        config.name
        for module in model.modules()
        for config in getattr(module, "embedding_bag_configs", lambda: [])()
    ]


@contextlib.contextmanager
def detached(pipeline: TrainPipelineBase | TrainPipelineSparseDist, model: nn.Module) -> Iterator[nn.Module]:
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
