"""``python -m recsys_runner.bench.step_options``: what each step option does to samples/s, and whether it is exact.

The options a GPU step has beyond the plain ``sparse_dist`` pipeline — the other pipelines, ``torch.compile`` of the
dense modules, CUDA graphs, the train metrics — each built as a variant of one run (same model, seed, plan and
batches, held on the device as in regime (a)). For every variant:

* **exactness**: right after its build, ``--exact-steps`` steps (default 200) on the same batch sequence, the loss of
  every step read back; the largest difference to the reference variant's curve (the first one, ``sparse_dist``) is
  the figure. "Exact" means ≤ 1e-4 over the 200 steps;
* **speed**: ``--rounds`` rounds of ``--steps`` steps through the runner's training path (:func:`~recsys_runner.bench.
  regimes.runner_round`), the variants alternating within a round as in the other regimes; samples/s and the median of
  per-round ratios to the reference.

``--syncs`` then runs the reference variant for 30 steps under ``torch.cuda.set_sync_debug_mode("warn")`` and names
every host sync a step makes (the innermost frame of this package or TorchRec that caused it, and how many per step).

Usage: ``python -m recsys_runner.bench.step_options [--batch-size 16384] [--variants sparse_dist,compile] [--syncs]
[--json out.json] [overrides…]`` — on a GPU with ``distributed.device=cuda``; on a CPU only the variants that run
there (``base``, ``compile``, ``no_train_metrics``) make sense.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import statistics
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from recsys_runner.bench.regimes import COMMON, build_for_bench, on_device, runner_round, window_steps, with_data
from recsys_runner.build import Components
from recsys_runner.data.memory import InMemoryData

VARIANTS: dict[str, list[str]] = {
    "sparse_dist": ["distributed.pipeline=sparse_dist"],
    "base": ["distributed.pipeline=base"],
    "semi_sync": ["distributed.pipeline=semi_sync"],
    "no_train_metrics": ["distributed.pipeline=sparse_dist", "metrics.train=[]"],
    "compile": ["distributed.pipeline=sparse_dist", "train.compile.enabled=true"],
    "cuda_graphs": ["distributed.pipeline=sparse_dist", "train.compile.cuda_graphs=true"],
    "compile_base": ["distributed.pipeline=base", "train.compile.enabled=true"],
}
"""Each variant's overrides on top of the shared ones; the first one asked for is the reference."""

EXACT = 1e-4
"""Largest loss difference to the reference over ``--exact-steps`` steps that still counts as the same training."""


def losses(c: Components, batches: Sequence[Any], steps: int) -> list[float]:
    """The loss of each of ``steps`` optimizer steps of ``c``'s stepper over ``batches`` (cycled), read every step."""
    stepper = c.loop.stepper
    stepper.reset()
    cycled: Iterator[Any] = itertools.islice(itertools.cycle(batches), steps)
    out = []
    for _ in range(steps):
        loss = stepper.step(cycled)
        if loss is None:
            break
        out.append(float(loss))
    stepper.reset()
    return out


def sync_sites(c: Components, memory: Any, steps: int) -> list[dict[str, Any]]:
    """Run ``steps`` steps under CUDA's sync debug mode; the host syncs by the frame that caused them, most first."""
    sites: collections.Counter[str] = collections.Counter()

    def note(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if ("recsys_runner" in f.filename or "torchrec" in f.filename)
                  and "bench/step_options" not in f.filename]
        where = frames[-1] if frames else None
        sites[f"{where.filename.split('site-packages/')[-1].split('/work/main/')[-1]}:{where.lineno} {where.name}"
              if where else f"{filename}:{lineno}"] += 1

    shown = warnings.showwarning
    warnings.showwarning = note
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            runner_round(memory, steps)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = shown
    return [{"site": site, "count": n, "per_step": n / steps} for site, n in sites.most_common()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepfm")
    parser.add_argument("--batch-size", type=int, default=16384)
    parser.add_argument("--steps", type=window_steps, default=100, help="steps per timed round (windows of 10)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--exact-steps", type=int, default=200, help="steps of the loss-curve comparison (0: skip)")
    parser.add_argument("--variants", default="sparse_dist,base,semi_sync,no_train_metrics,compile,cuda_graphs",
                        help=f"comma-separated, the first is the reference; from {list(VARIANTS)}")
    parser.add_argument("--syncs", action="store_true", help="name the host syncs of the reference variant's steps (CUDA)")
    parser.add_argument("--json", default="bench_results/step_options.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(str(args.json)) or ".", exist_ok=True)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")

    started = time.perf_counter()
    shared = [f"model={args.model}", *COMMON, f"data.batch_size={args.batch_size}", *args.overrides]
    built: dict[str, Components] = {}
    result: dict[str, Any] = {"model": args.model, "batch_size": args.batch_size, "torch": torch.__version__,
                              "overrides": args.overrides, "variants": {}}
    batches: list[Any] = []
    reference: list[float] | None = None
    try:
        for name in names:
            entry: dict[str, Any] = {"overrides": VARIANTS[name]}
            result["variants"][name] = entry
            try:
                t0 = time.perf_counter()
                c = build_for_bench([*shared, *VARIANTS[name]], args.steps)
                if not batches:  # the reference's data, made once: every variant trains the very same batches
                    data = c.loop.data
                    batches = on_device(list(itertools.islice(data.train_batches(0, 0, 1), 50)), c.env.device)
                built[name] = c
                if args.exact_steps:
                    curve = losses(c, batches, args.exact_steps)
                    entry["first_steps_s"] = time.perf_counter() - t0  # build + the curve's steps, compile included
                    entry["loss_first_last"] = [curve[0], curve[-1]]
                    if reference is None:
                        reference = curve
                    else:
                        diffs = [abs(a - b) for a, b in zip(curve, reference, strict=False)]
                        first = next((i for i, d in enumerate(diffs) if d > EXACT), None)
                        entry |= {"max_loss_diff": max(diffs), "exact": max(diffs) <= EXACT, "first_step_over": first}
                print(f"built {name}: {entry}", flush=True)
            except Exception as e:  # one variant failing (a compiler error, say) must not lose the others' figures
                entry["error"] = f"{type(e).__name__}: {e}"[:2000]
                print(f"variant {name} failed: {entry['error']}", flush=True)
        ok = [n for n in names if n in built]
        rates: dict[str, list[float]] = {n: [] for n in ok}
        for r in range(args.rounds):
            for name in ok if r % 2 == 0 else reversed(ok):
                c = built[name]
                rates[name].append(runner_round(with_data(c.loop, InMemoryData(c.loop.data.features, batches, batches[:1])), args.steps))
            print(f"o round {r + 1}: " + "   ".join(f"{n} {rates[n][-1]:,.0f}" for n in ok) + " samples/s", flush=True)
        if ok:
            ref = rates[ok[0]]
            for name in ok:
                ratios = [a / b for a, b in zip(rates[name], ref, strict=True)]
                result["variants"][name] |= {"samples_per_s": statistics.median(rates[name]), "rounds": rates[name],
                                             "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        if args.syncs and ok and torch.cuda.is_available():
            c = built[ok[0]]
            result["syncs"] = sync_sites(c, with_data(c.loop, InMemoryData(c.loop.data.features, batches, batches[:1])), 30)
    finally:
        for c in built.values():
            c.close()
    result["bench_seconds"] = time.perf_counter() - started
    print(report(result))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    return result


def report(result: dict[str, Any]) -> str:
    """The variants as a markdown table (and the host syncs, when named)."""
    rows = [f"step options: model={result['model']} batch={result['batch_size']} ({result['torch']})",
            "| variant | samples/s | vs reference | range | max loss diff (steps) | exact |", "|---|---|---|---|---|---|"]
    for name, v in result["variants"].items():
        if "error" in v:
            rows.append(f"| {name} | failed: {v['error'][:160]} | | | | |")
            continue
        diff = v.get("max_loss_diff")
        rows.append(f"| {name} | {v.get('samples_per_s', float('nan')):,.0f} | {v.get('ratio', float('nan')):.3f} | "
                    f"{v.get('ratio_min', float('nan')):.2f}-{v.get('ratio_max', float('nan')):.2f} | "
                    f"{'reference' if diff is None else format(diff, '.2e')} | {v.get('exact', '')} |")
    for s in result.get("syncs", []):
        rows.append(f"host sync: {s['per_step']:.2f}/step at {s['site']}")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
