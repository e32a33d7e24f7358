"""TorchRec's sharding planner as ``distributed.*`` sets it up: topology, per-table constraints, proposers and sharders.

What the planner is told: each rank's memory and the links between them (:func:`build_planner`), per table the sharding
types, kernels and UVM cache settings it may choose (:func:`table_constraints`: the config's choices, one rank's
defaults, and what TorchRec can do with history and managed-collision tables), which proposers search
(:func:`proposers`) and which sharders (:func:`runner_sharders`); and, when no plan fits, whether the reason is the UVM
caches (:func:`caches_overflow_hbm`). What the chosen plan says is :mod:`recsys_runner.distributed.plan_report`'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchrec import optim as trec_optim
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.constants import DEFAULT_PERF_ESTIMATOR
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.proposers import DynamicProgrammingProposer, GreedyProposer, GridSearchProposer, UniformProposer
from torchrec.distributed.planner.shard_estimators import (
    EmbeddingPerfEstimatorFactory,
    EmbeddingStorageEstimator,
    _get_optimizer_multipler,
)
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import (
    HardwareConfig,
    KernelConfig,
    Proposer,
    ShardingOption,
    Stats,
    Storage,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import CacheParams, ModuleSharder, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_modules import ManagedCollisionCollection

from recsys_runner.distributed.config import DistributedConfig, PlannerConfig, TableShardingConfig
from recsys_runner.distributed.plan_report import CACHING_KERNELS, GB, cache_ratio, mb
from recsys_runner.errors import ConfigError, require

_GBPS_TO_PLANNER = GB / 1000  # the planner's bandwidths are bytes per millisecond

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


def build_planner(config: DistributedConfig, model: nn.Module, batch_size: int, world_size: int, local_world_size: int,
                  device_type: str, stats: list[Stats]) -> tuple[EmbeddingShardingPlanner, Topology]:
    """TorchRec's planner for ``world_size`` ranks (``local_world_size`` to a host) on ``device_type`` as ``distributed.*``
    sets it up (memory caps, bandwidths, per-table constraints, storage reserve, proposers), reporting to ``stats``; and
    its topology, whose devices hold each rank's memory."""
    c = config
    intra, cross = c.intra_node_bandwidth_gbps, c.cross_node_bandwidth_gbps
    hbm, ddr = c.hbm_cap_gb, c.ddr_cap_gb
    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(
            world_size=world_size, local_world_size=local_world_size,
            hbm_cap_bytes=None if hbm is None else int(hbm * GB), ddr_cap_bytes=None if ddr is None else int(ddr * GB),
        ),
        hardware_config=HardwareConfig(
            intra_host_bw=None if intra is None else intra * _GBPS_TO_PLANNER,
            inter_host_bw=None if cross is None else cross * _GBPS_TO_PLANNER,
        ),
        # Hardware bandwidths are read only in this mode; unset ones fall back to TorchRec's defaults.
        kernel_config=KernelConfig(compute_device=device_type, use_hardware_based_bandwidth=intra is not None or cross is not None),
    )
    constraints = model_constraints(c, model, world_size, device_type)
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=c.planner_batch_size or batch_size,
        enumerator=enumerator(topology, c.planner_batch_size or batch_size, constraints),
        constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(percentage=c.storage_reserve_percent),
        proposer=proposers(c.planner, device_type),
        stats=stats,
    )
    return planner, topology


class _StateInFloat32(EmbeddingStorageEstimator):
    """TorchRec's storage estimate, with the optimizer state of a table stored in less than fp32 counted in float32.

    TorchRec counts a table's state at the table's element size (its optimizer's state per weight × the table's bytes);
    fbgemm's fused kernel keeps the state in float32 whatever the weights (measured on CPU, fbgemm-gpu-cpu 1.8: Adagrad's
    ``momentum1`` of an fp16 table is float32), so exact Adagrad's state of an fp16 table is twice the table's bytes, where
    TorchRec would count it once and under-budget the table by a third. Only the ``fused`` kernel's shards are corrected
    (the state where the table is: HBM on CUDA, host memory on CPU); the caching kernels' placement is fbgemm's own."""

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map: Any) -> None:
        super().estimate(sharding_options, sharder_data_map)
        on_device = self._topology.compute_device == "cuda"
        for option in sharding_options:
            size = option.tensor.element_size()
            if size >= FLOAT32_BYTES or option.compute_kernel != EmbeddingComputeKernel.FUSED.value:
                continue
            per_weight = _get_optimizer_multipler(getattr(option.tensor, "_optimizer_classes", [None])[0], option.tensor.shape)
            for shard in option.shards:
                missing = math.ceil(math.prod(shard.size) * per_weight * (FLOAT32_BYTES - size))
                if shard.storage is None or not missing:
                    continue
                s = shard.storage
                shard.storage = Storage(hbm=s.hbm + missing, ddr=s.ddr, ssd=s.ssd) if on_device else \
                    Storage(hbm=s.hbm, ddr=s.ddr + missing, ssd=s.ssd)


FLOAT32_BYTES = 4


def enumerator(topology: Topology, batch_size: int, constraints: dict[str, ParameterConstraints] | None) -> EmbeddingEnumerator:
    """TorchRec's enumerator with its default estimators, the storage one counting fp16 tables' state in float32
    (:class:`_StateInFloat32`): what the runner's planner and :func:`caches_overflow_hbm` both rate options with."""
    return EmbeddingEnumerator(topology, batch_size, constraints, estimator=[
        EmbeddingPerfEstimatorFactory.create(DEFAULT_PERF_ESTIMATOR, topology=topology, constraints=constraints),
        _StateInFloat32(topology=topology, constraints=constraints),
    ])


def model_constraints(config: DistributedConfig, model: nn.Module, world_size: int,
                      device_type: str) -> dict[str, ParameterConstraints] | None:
    """:func:`table_constraints` for the tables of ``model``: its pooled and unpooled tables, which of them are managed,
    and which are half-precision tables an optimizer with state trains (:func:`_half_trained_tables`)."""
    return table_constraints(config, _table_names(model), world_size, set(_table_names(model, unpooled=True)), device_type,
                             managed=_managed_table_names(model), half=_half_trained_tables(model))


def caches_overflow_hbm(config: DistributedConfig, model: nn.Module, batch_size: int, topology: Topology) -> str | None:
    """Why no plan fits, when it is because the device memory cannot hold even the UVM caches: every table in its
    least-HBM option that the allowed kernels offer (the planner's own enumeration and estimates), and some of
    those options cache; ``None`` otherwise (the planner's message stands)."""
    if topology.compute_device != "cuda":
        return None
    c = config
    constraints = model_constraints(c, model, topology.world_size, topology.compute_device)
    options = enumerator(topology, c.planner_batch_size or batch_size, constraints).enumerate(model, runner_sharders())
    least: dict[str, ShardingOption] = {}
    for option in options:
        if option.fqn not in least or option.total_storage.hbm < least[option.fqn].total_storage.hbm:
            least[option.fqn] = option
    need = sum(o.total_storage.hbm for o in least.values())
    budget = sum(int(d.storage.hbm * (1 - c.storage_reserve_percent)) for d in topology.devices)
    cached = [o for o in least.values() if o.compute_kernel in CACHING_KERNELS]
    if need <= budget or not cached:
        return None
    ratios = sorted({cache_ratio(o) for o in cached})
    ratio = "/".join(f"{r:.0%}" for r in ratios)
    source = "distributed.cache_load_factor" if c.cache_load_factor is not None else "TorchRec's default"
    cap_gb = topology.devices[0].storage.hbm / GB
    need_gb = need / len(topology.devices) / (1 - c.storage_reserve_percent) / GB
    ranks = f"{len(topology.devices)} rank{'s' if len(topology.devices) != 1 else ''}"
    allowed = f"distributed.compute_kernels={c.compute_kernels}" if c.compute_kernels else "distributed.tables.<t>.compute_kernels"
    return (
        f"distributed.hbm_cap_gb={cap_gb:g} cannot hold even the tables' UVM caches: with the kernels allowed "
        f"({allowed}), {len(cached)} tables are at best cached, {ratio} of their rows "
        f"({source}), and the tables then need {mb(need)} of HBM (caches, optimizer state and buffers: the planner's "
        f"estimate), more than {ranks} x {cap_gb:g} GB leave after distributed.storage_reserve_percent="
        f"{c.storage_reserve_percent:g} ({mb(budget)}). Fix: distributed.hbm_cap_gb={math.ceil(need_gb * 100) / 100:g} or "
        f"more (what they need), a smaller distributed.cache_load_factor (e.g. {ratios[0] / 2:g}), or allow tables in host "
        f"memory without a cache: distributed.compute_kernels=null (or add fused_uvm)"
    )


def table_constraints(config: DistributedConfig, tables: list[str], world_size: int, unpooled: set[str] | None = None,
                      device_type: str = "cpu", managed: set[str] | None = None,
                      half: set[str] | None = None) -> dict[str, ParameterConstraints] | None:
    """Per-table planner constraints: the table's own choices, else the global ones, else (sharding
    types on one rank) :data:`ONE_RANK_SHARDING_TYPES`; ``unpooled`` tables (an EmbeddingCollection's: histories)
    and ``half`` ones (fp16 weights with optimizer state, :func:`_half_trained_tables`) never get ``data_parallel``
    (:func:`_without_data_parallel`); ``managed`` (managed-collision) tables are row-wise, the
    one way TorchRec shards their mapping (:func:`_managed_types`). On CUDA each table's UVM cache settings
    (:func:`_cache_params`) go with it, for the planner to budget and fbgemm to build if the table is cached."""
    c = config
    unknown = sorted(set(c.tables) - set(tables))
    if unknown:
        known = sorted(tables, key=lambda t: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", t)])
        raise ConfigError(f"distributed.tables names {unknown}, which the model does not have; its tables: {', '.join(known)}")
    sharding_types = c.sharding_types or (ONE_RANK_SHARDING_TYPES if world_size == 1 else None)
    if not (sharding_types or c.compute_kernels or c.tables or unpooled or half or c.cache_load_factor or c.pipeline == "prefetch"):
        return None
    constraints = {}
    for table in tables:
        own = c.tables.get(table, TableShardingConfig())
        types = list(own.sharding_types or sharding_types or [])  # a copy: never the shared default
        if table in (unpooled or set()):
            types = _without_data_parallel(table, types, device_type, own.sharding_types or c.sharding_types, unpooled=True)
        if table in (half or set()):
            types = _without_data_parallel(table, types, device_type, own.sharding_types or c.sharding_types, unpooled=False)
        if table in (managed or set()):
            types = _managed_types(table, chosen=own.sharding_types or c.sharding_types)
        constraints[table] = ParameterConstraints(sharding_types=types or None,
                                                  compute_kernels=own.compute_kernels or c.compute_kernels,
                                                  cache_params=_cache_params(c, own, device_type))
    return constraints


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


_HALF_DATA_PARALLEL = ("is stored in fp16 (precision.embedding_data_type, or embedding_data_type_by_feature for its "
                       "features) and trained by an optimizer with state, which cannot be sharded data_parallel: "
                       "data_parallel trains a replicated table with torch's own optimizer in the table's dtype, where its "
                       "eps (1e-8) rounds to 0 and every row without a gradient in a step becomes NaN (measured on CPU with "
                       "adagrad and rowwise_adagrad; sgd keeps no state)")
"""Why an fp16 table trained by an optimizer with state is never ``data_parallel``."""

_UNPOOLED_DATA_PARALLEL = "is read unpooled (a history's table, in an EmbeddingCollection), which cannot be sharded data_parallel"
"""Why an unpooled table is never ``data_parallel``: in this TorchRec an EmbeddingCollection sharded so returns one row per
bag instead of one per id (measured on CPU: the forward fails in ``split_with_sizes``)."""


def _without_data_parallel(table: str, types: list[str], device_type: str, chosen: list[str] | None, unpooled: bool) -> list[str]:
    """The sharding types a table that cannot be ``data_parallel`` may take: those of ``types`` (all when empty) its sharder
    offers on ``device_type``, without ``data_parallel``. Two kinds of table: an ``unpooled`` one (an
    EmbeddingCollection's, :data:`_UNPOOLED_DATA_PARALLEL`) and an fp16 one trained by an optimizer with state
    (:data:`_HALF_DATA_PARALLEL`).

    Raises:
        ConfigError: the configured types (``chosen``) leave none for the table.
    """
    sharder = EmbeddingCollectionSharder() if unpooled else EmbeddingBagCollectionSharder()
    own = sharder.sharding_types(device_type)
    # an unpooled table's sharder offers fewer types than a pooled one's (no table_column_wise): the configured types
    # it cannot take would otherwise reach TorchRec's planner, whose RuntimeError names no key
    usable = [t for t in types or own if t != ShardingType.DATA_PARALLEL.value and t in own]
    if not usable:
        why = (f"{_UNPOOLED_DATA_PARALLEL}; its sharder takes only {[t for t in own if t != ShardingType.DATA_PARALLEL.value]} "
               f"on {device_type}") if unpooled else _HALF_DATA_PARALLEL
        fix = "" if unpooled else ", or fp32 for its features (precision.embedding_data_type / embedding_data_type_by_feature), or optim/sparse=sgd"
        raise ConfigError(
            f"table {table!r} {why}, and the sharding types {chosen} leave nothing else. "
            f"Fix: +distributed.tables.{table}.sharding_types=[table_wise] (or row_wise / column_wise){fix}"
        )
    return usable


def _half_trained_tables(model: nn.Module) -> set[str]:
    """The tables of ``model`` stored in less than fp32 (``precision.embedding_data_type``) whose in-backward optimizer
    (:func:`~recsys_runner.optim.sparse.apply_sparse_optimizer`) keeps state: all but SGD. None before an optimizer is
    attached (evaluate, predict: no step, any sharding scores alike)."""
    half: set[str] = set()
    for module in model.modules():
        if isinstance(module, EmbeddingBagCollection):
            tables = [(c.name, module.embedding_bags[c.name].weight) for c in module.embedding_bag_configs()]
        elif isinstance(module, EmbeddingCollection):
            tables = [(c.name, module.embeddings[c.name].weight) for c in module.embedding_configs()]
        else:
            continue
        for name, weight in tables:
            optimizer = getattr(weight, "_optimizer_classes", [None])[0]
            if weight.dtype != torch.float32 and optimizer not in (None, torch.optim.SGD, trec_optim.SGD):
                half.add(name)
    return half
