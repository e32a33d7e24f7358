"""What a sharding plan puts where: each rank's memory against its budget, the plan's one-line summary, its UVM caches.

:class:`PlanReport` is what ``python -m recsys_runner.plan`` prints (:meth:`~recsys_runner.distributed.sharding.Distributed.dry_plan`);
:func:`plan_summary` is the line every run logs, read from the options the planner chose (:class:`RecordBestPlan`) and the
planner's own storage estimates.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.constants import UVM_CACHING_RATIO
from torchrec.distributed.planner.types import ShardingOption, Stats
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan

GB = 1024**3

CACHING_KERNELS = {EmbeddingComputeKernel.FUSED_UVM_CACHING.value, EmbeddingComputeKernel.QUANT_UVM_CACHING.value}
"""The kernels that keep a table in host memory behind an HBM cache of ``cache_load_factor`` of its rows (fbgemm's)."""


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
            lines.append(f"{r.rank:>4}  {r.hbm / GB:8.3f} / {r.hbm_budget / GB:6.2f}  "
                         f"{r.ddr / GB:8.3f} / {r.ddr_budget / GB:6.2f}  {'yes' if r.fits else 'NO'}")
        lines.append(f"fits: {'yes' if self.fits else 'NO'}")
        return "\n".join(lines)


class RecordBestPlan(Stats):
    """Keeps the planner's chosen sharding options (their shards carry rank and storage estimates)."""

    def __init__(self) -> None:
        self.best_plan: list[ShardingOption] = []

    def log(self, sharding_plan: Any, topology: Any, batch_size: int, storage_reservation: Any, num_proposals: int,
            num_plans: int, run_time: float, best_plan: list[ShardingOption], *args: Any, **kwargs: Any) -> None:
        self.best_plan = best_plan


def rank_usage(best_plan: list[ShardingOption], world_size: int) -> list[tuple[int, int]]:
    """``(hbm, ddr)`` bytes the planner's chosen options put on each rank."""
    used = [[0, 0] for _ in range(world_size)]
    for option in best_plan:
        for shard in option.shards:
            if shard.rank is not None and shard.storage is not None:
                used[shard.rank][0] += shard.storage.hbm
                used[shard.rank][1] += shard.storage.ddr
    return [(hbm, ddr) for hbm, ddr in used]


def mb(n: int) -> str:
    return f"{n / 1024**2:.1f} MB" if n < GB else f"{n / GB:.2f} GB"


def plan_summary(plan: ShardingPlan, world_size: int, usage: list[tuple[int, int]] | None = None,
                 options: Sequence[ShardingOption] = ()) -> str:
    """One line: how many tables, on how many ranks, per sharding type and compute kernel, and (from the
    planner's estimates, when ``usage`` has them) the most memory one rank holds, e.g.
    ``sharding plan: 26 tables on 1 rank: 26 table_wise (fused kernel); est. 12.3 MB/rank (HBM 12.3 MB, DDR 0.0 MB)``;
    with several ranks ``est. max ... (HBM ..., DDR ...), min ...``, the fullest and the emptiest rank. Tables whose
    weights are not float32 (``precision.embedding_data_type``) are counted by dtype, e.g. ``; 52 tables in fp16``.

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
            f"{kinds or 'nothing to shard'}{_weight_types(options)}")
    if usage and any(hbm or ddr for hbm, ddr in usage):
        hbm, ddr = max(usage, key=lambda u: u[0] + u[1])
        most = "" if world_size == 1 else "max "
        line += f"; est. {most}{mb(hbm + ddr)}/rank (HBM {mb(hbm)}, DDR {mb(ddr)})"
        if world_size > 1:  # how even the split is
            line += f", min {mb(min(h + d for h, d in usage))}"
    return line


def _weight_types(options: Sequence[ShardingOption]) -> str:
    """``; 52 tables in fp16`` for the chosen ``options`` whose weights are not float32 (one count per dtype); ``""``
    when every table is float32 or no options are given."""
    half = Counter(_DTYPE_NAMES.get(o.tensor.dtype, str(o.tensor.dtype)) for o in options if o.tensor.dtype != torch.float32)
    return "".join(f"; {n} table{'s' if n != 1 else ''} in {name}" for name, n in sorted(half.items()))


_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
"""How a table's dtype is named in the plan's line: as ``precision.embedding_data_type`` names it."""


def cache_ratio(option: ShardingOption) -> float:
    """The share of rows a cached table's HBM cache holds: its ``cache_load_factor``, else TorchRec's default (which
    the planner budgets and TorchRec's fbgemm kernels allocate alike)."""
    return option.cache_load_factor if option.cache_load_factor is not None else UVM_CACHING_RATIO


def _cache_notes(options: Sequence[ShardingOption]) -> dict[tuple[str, str], str]:
    """Per (sharding type, caching kernel): ``, cache 20% of rows: 0.41 GB HBM of 2.05 GB``, the tables' caches and
    whole sizes (weights) summed; a range of ratios when tables differ."""
    groups: dict[tuple[str, str], list[ShardingOption]] = {}
    for option in options:
        if option.compute_kernel in CACHING_KERNELS:
            groups.setdefault((option.sharding_type, option.compute_kernel), []).append(option)
    out = {}
    for key, group in groups.items():
        ratios = sorted({cache_ratio(o) for o in group})
        ratio = f"{ratios[0]:.0%}" if len(ratios) == 1 else f"{ratios[0]:.0%}-{ratios[-1]:.0%}"
        whole = [o.tensor.numel() * o.tensor.element_size() for o in group]
        cache = sum(round(cache_ratio(o) * size) for o, size in zip(group, whole, strict=True))
        out[key] = f", cache {ratio} of rows: {mb(cache)} HBM of {mb(sum(whole))}"
    return out

