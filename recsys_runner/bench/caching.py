"""Tables larger than the GPU: fbgemm's UVM caching against the same tables held whole in HBM.

DeepFM through the runner's training path (regime (a)'s method: :func:`~recsys_runner.bench.regimes.runner_round` on
the same batches, held in memory on the device) with big tables — by default 26 of 2M rows x 64 (13.3 GB of fp32
weights, as much again of Adagrad state) — each variant built once, then alternated for ``--rounds`` rounds:

* ``hbm`` — every table whole in device memory (``distributed.compute_kernels=[fused]``, the planner's cap the GPU's
  memory);
* ``caching`` — ``distributed.hbm_cap_gb`` below what the tables need in HBM, so that the planner must put them in host
  memory behind an HBM cache (``fused_uvm_caching``: fbgemm's UVM caching; ``distributed.compute_kernels=[fused,
  fused_uvm_caching]``, so that it cannot choose plain UVM either). The cap comes from the planner's own estimates
  (two dry plans on ``meta``): what every table cached needs, plus half of what keeping an average table whole would
  add, so that no big table fits whole and the caches do. Its plan line gives the cache ratio
  (``distributed.cache_load_factor``, TorchRec's 0.2 unless set) and the caches' size;
* ``prefetch`` — ``caching`` trained with ``distributed.pipeline=prefetch`` (TorchRec's ``PrefetchTrainPipelineSparseDist``:
  the next batch's rows fetched into the caches while this one trains).

Prints samples/s of each and its ratio to ``hbm`` (median of per-round ratios, with their range); ``--json`` writes it.
The synthetic ids are heavy-headed (``data.id_skew=3``: a 20% cache can hold the rows of ~58% of the lookups); pass
``data.id_skew=1`` for uniform ids, the caches' worst case. Caching is fbgemm's CUDA kernel: on a CPU only ``hbm``
trains (``--quick distributed.device=cpu`` is the smoke test).

Usage: ``python -m recsys_runner.bench.caching [--quick] [--rounds 3] [--steps 40] [--batch-size 16384]
[--num-embeddings 2000000] [--json caching.json] [overrides…]``, e.g. ``distributed.device=cuda`` on a GPU machine.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torchrec.datasets.utils import Batch
from torchrec.distributed.types import EmbeddingModuleShardingPlan

from recsys_runner.bench.regimes import (
    COMMON,
    MAX_DISTINCT_BATCHES,
    WINDOW,
    alternate,
    build_for_bench,
    compose_run,
    on_device,
    runner_round,
    window_steps,
    with_data,
)
from recsys_runner.build import Components, build_model
from recsys_runner.data.memory import InMemoryData
from recsys_runner.distributed.config import resolve_device_type
from recsys_runner.distributed.plan_report import PlanReport
from recsys_runner.models.train_wrapper import TrainWrapper
from recsys_runner.optim.sparse import apply_sparse_optimizer

_GB = 1024**3

SHARED = ["model=deepfm", *COMMON, "distributed.sharding_types=[table_wise]", "data.num_workers=0"]
"""Every variant's: regime (a)'s settings, tables whole on a rank (``data_parallel`` needs the ``dense`` kernel, which no
variant allows: naming it would only have the planner warn about every table), and the batches made in this process
(once, before timing: no worker processes forked from one that holds the tables)."""

VARIANTS = {
    "hbm": ["distributed.compute_kernels=[fused]"],
    "caching": ["distributed.compute_kernels=[fused,fused_uvm_caching]"],
    "prefetch": ["distributed.compute_kernels=[fused,fused_uvm_caching]", "distributed.pipeline=prefetch"],
}
"""Each variant's own overrides (after the shared ones); ``caching`` and ``prefetch`` also get the computed cap."""


def plan_on_meta(overrides: Sequence[str]) -> PlanReport:
    """The plan ``overrides`` get for CUDA, with the model on ``meta`` and no process group (what
    ``python -m recsys_runner.plan`` prints; this package may not import that entry point)."""
    run = compose_run(overrides)
    with torch.device("meta"):  # generated data holds state per id; nothing of it is needed to plan
        data = run.data.for_model(run.model.data_needs()).build(device="cpu")
    model = TrainWrapper(build_model(run, data.features, torch.device("meta")))
    apply_sparse_optimizer(model, run.optim.sparse)  # optimizer state counts toward table memory
    return run.distributed.build().dry_plan(model, batch_size=data.batch_size, device_type="cuda")


def caching_cap_gb(overrides: Sequence[str], device_gb: float) -> tuple[float, dict[str, float]]:
    """``distributed.hbm_cap_gb`` for the ``caching`` variant, and the planner's HBM estimates it comes from (GB):
    every table whole (``hbm``), every table cached (``cached``); the cap leaves room for the caches plus half of what
    an average table whole adds to its cache, over ``distributed.storage_reserve_percent``."""
    plans = {name: plan_on_meta([*overrides, f"distributed.compute_kernels=[{kernel}]", f"distributed.hbm_cap_gb={device_gb:.2f}"])
             for name, kernel in (("hbm", "fused"), ("cached", "fused_uvm_caching"))}
    for name, report in plans.items():
        if not report.fits:
            raise SystemExit(f"planning every table {'whole' if name == 'hbm' else 'cached'} on this GPU ({device_gb:.0f} GB) "
                             f"failed: {report.error}\nFix: a smaller --num-embeddings")
    whole, cached = (plans[n].ranks[0].hbm for n in ("hbm", "cached"))
    plan = plans["hbm"].plan
    assert plan is not None
    tables = sum(len(module) for module in plan.plan.values() if isinstance(module, EmbeddingModuleShardingPlan))
    reserve = compose_run(overrides).distributed.storage_reserve_percent
    cap = (cached + (whole - cached) / (2 * tables)) / (1 - reserve) / _GB
    return cap, {"hbm": whole / _GB, "cached": cached / _GB}


def bench_caching(overrides: list[str], steps: int, rounds: int, variants: Sequence[str]) -> dict[str, Any]:
    """Build the variants, alternate them on the same on-device batches, return the figures (see the module docstring)."""
    started = time.perf_counter()
    base = [*SHARED, *overrides]
    on_cuda = resolve_device_type(compose_run(base).distributed.device) == "cuda"
    if on_cuda and not torch.cuda.is_available():
        raise SystemExit("distributed.device=cuda but no CUDA device is visible. Fix: distributed.device=cpu (the hbm variant only)")
    chosen = [v for v in variants if v == "hbm" or on_cuda]
    if chosen != list(variants):
        print(f"UVM caching is fbgemm's CUDA kernel and this run is on the CPU: training {', '.join(chosen)} only", flush=True)
    device_gb = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / _GB if on_cuda else 0.0
    cap, planned = caching_cap_gb(base, device_gb) if len(chosen) > 1 else (None, {})
    if cap is not None:
        print(f"planner's HBM estimate: {planned['hbm']:.2f} GB every table whole, {planned['cached']:.2f} GB every table "
              f"cached -> caching variants' distributed.hbm_cap_gb={cap:.2f}", flush=True)
    caps = {name: (device_gb if name == "hbm" else cap) if on_cuda else None for name in chosen}  # a CPU plan has no HBM
    built: dict[str, Components] = {}
    batches: list[Batch] = []
    try:
        for name in chosen:
            own = [*VARIANTS[name], *([f"distributed.hbm_cap_gb={caps[name]:.3f}"] if caps[name] is not None else [])]
            built[name] = c = build_for_bench([*base, *own], steps)
            print(f"{name}: {c.distributed.summary}", flush=True)
            if not batches:  # every variant's data is the same; made while the process holds one model only
                batches = on_device(list(itertools.islice(c.loop.data.train_batches(0, 0, 1), min(steps, MAX_DISTINCT_BATCHES))),
                                    c.env.device)
        first = built[chosen[0]]
        loops = {name: with_data(c.loop, InMemoryData(c.loop.data.features, batches, batches[:1])) for name, c in built.items()}
        per_round = alternate(rounds, {name: functools.partial(runner_round, loop, steps) for name, loop in loops.items()}, "caching")
        data = first.loop.data
        info = {"device": str(first.env.device), "batch_size": data.batch_size, "tables": len(data.features.sparse),
                "num_embeddings": sorted({s.num_embeddings for s in data.features.sparse}),
                "plans": {name: c.distributed.summary for name, c in built.items()}}
    finally:
        for c in reversed(built.values()):  # the first built owns the process group
            c.close()
    ratios = {name: [x / y for x, y in zip(per_round[name], per_round["hbm"], strict=True)] for name in per_round}
    return {
        **info, "torch": torch.__version__, "steps_per_round": steps, "rounds": rounds, "overrides": overrides,
        "hbm_cap_gb": cap, "planner_hbm_gb": planned,
        "samples_per_s": {name: statistics.median(r) for name, r in per_round.items()},
        "ratio_to_hbm": {name: {"median": statistics.median(r), "min": min(r), "max": max(r)} for name, r in ratios.items()},
        "rounds_samples_per_s": per_round, "bench_seconds": time.perf_counter() - started,
    }


def table(result: dict[str, Any]) -> str:
    """The printed figures: samples/s and ratio to ``hbm`` per variant, each with its plan line."""
    rows = [f"device={result['device']} batch={result['batch_size']} tables={result['tables']}x{result['num_embeddings']} "
            f"steps/round={result['steps_per_round']} rounds={result['rounds']} (ratios: median of per-round ratios)",
            f"{'variant':<9} {'samples/s':>12} {'vs hbm':>7} {'range':>10}"]
    for name, rate in result["samples_per_s"].items():
        r = result["ratio_to_hbm"][name]
        rows.append(f"{name:<9} {rate:>12,.0f} {r['median']:>6.2f}x {r['min']:>4.2f}-{r['max']:<5.2f}")
    rows += [f"  {name}: {plan}" for name, plan in result["plans"].items()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small tables, few steps, one round: checks that it runs, not how fast")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; --quick 1)")
    parser.add_argument("--steps", type=window_steps, default=None, help=f"steps per round, windows of {WINDOW} (default 40; --quick 20)")
    parser.add_argument("--batch-size", type=int, default=None, help="batch size (default 16384; --quick 512)")
    parser.add_argument("--num-embeddings", type=int, default=None, help="rows per table (default 2000000; --quick 20000)")
    parser.add_argument("--embedding-dim", type=int, default=None, help="width of every table (default 64; --quick 16)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)} (default all)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result to this file")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. distributed.device=cuda)")
    args = parser.parse_args(argv)
    q = args.quick
    steps = args.steps or (20 if q else 40)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or variants[0] != "hbm" or set(variants) - set(VARIANTS):
        parser.error(f"--variants must start with hbm (the reference) and name only {', '.join(VARIANTS)}")
    sizes = [f"data.batch_size={args.batch_size or (512 if q else 16384)}",
             f"data.num_embeddings={args.num_embeddings or (20_000 if q else 2_000_000)}",
             f"model.embedding_dim={args.embedding_dim or (16 if q else 64)}"]
    result = bench_caching([*sizes, *args.overrides], steps, args.rounds or (1 if q else 3), variants)
    print()
    print(table(result))
    print(f"bench took {result['bench_seconds']:.0f} s" + (f"; results in {args.json}" if args.json else ""))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
