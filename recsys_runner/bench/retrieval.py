"""What sampled negatives cost a two-tower training step: ``python -m recsys_runner.bench.retrieval [--quick] [overrides…]``.

* ``h_negatives_step`` — DSSM through the runner (:func:`recsys_runner.train.loop.train`, built by
  :func:`recsys_runner.build.build`) on ``data=synthetic_retrieval`` with ``data.negatives.num_negatives=256``
  (``distribution: popularity``) against the same run without (in-batch negatives only). samples/s of *real* rows (the
  runner's throughput counts the ``B + K`` rows of a batch, so the figure with negatives is scaled by ``B / (B + K)``);
  the ratio is the median of per-round ratios, paths alternating within a round. Target ≥ 0.90 (≤ 10 % added). It
  includes the model's own added work (the item tower on ``K`` more rows, ``B × (B + K)`` scores).
* ``h_sampler_share`` — the data pipeline alone: the time to make a training batch with the ``K`` sampled rows minus
  without (drawing, the table lookup, appending to the KJT), as a share of a step without negatives. Target ≤ 0.10.

Each variant is built afresh per round (one process group at a time). Writes ``bench_results/bench_retrieval.json``; docs/retrieval.md
quotes the measured numbers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from dataclasses import asdict
from typing import Any

import torch

from recsys_runner.bench.regimes import COMMON, Regime, build_for_bench, runner_round, window_steps

NEGATIVES = 256
"""``K`` of the regime: the ``data.negatives.num_negatives`` of ``experiment=dssm_negatives``."""
TARGET_STEP, TARGET_SHARE = 0.90, 0.10


def _overrides(batch_size: int, negatives: int, extra: list[str]) -> list[str]:
    return ["model=dssm", "data=synthetic_retrieval", *COMMON, f"data.batch_size={batch_size}", "data.negatives.distribution=popularity",
            f"data.negatives.num_negatives={negatives}", *extra]


def _step_round(batch_size: int, negatives: int, steps: int, extra: list[str]) -> tuple[float, float]:
    """One runner round of a freshly built variant: (real rows/s, seconds to make one training batch in the data module)."""
    c = build_for_bench(_overrides(batch_size, negatives, extra), steps)
    try:
        rate = runner_round(c.loop, steps) * batch_size / (batch_size + negatives)
        data = c.loop.data
        count = max(steps // 2, 5)
        start = time.perf_counter()
        for _ in itertools.islice(data.train_batches(1, 0, 1), count):
            pass
        return rate, (time.perf_counter() - start) / count
    finally:
        c.close()


def bench_retrieval(overrides: list[str], quick: bool, rounds: int | None, batch_size: int | None = None,
                    steps: int | None = None) -> tuple[list[Regime], dict[str, Any]]:
    """The two regimes and the raw per-round figures."""
    batch = batch_size or (256 if quick else 1024)
    steps = steps or (20 if quick else 100)
    rounds = rounds or (1 if quick else 5)
    figures: dict[str, list[tuple[float, float]]] = {"in_batch": [], "sampled": []}
    for r in range(rounds):
        order = [("in_batch", 0), ("sampled", NEGATIVES)]
        for name, k in order if r % 2 == 0 else reversed(order):
            figures[name].append(_step_round(batch, k, steps, overrides))
        print(f"h round {r + 1}: " + "   ".join(f"{n} {figures[n][-1][0]:,.0f} rows/s, {figures[n][-1][1] * 1e3:.2f} ms/batch made"
                                           for n in figures), flush=True)
    plain, sampled = [f[0] for f in figures["in_batch"]], [f[0] for f in figures["sampled"]]
    ratios = [s / p for s, p in zip(sampled, plain, strict=True)]
    shares = [(s[1] - p[1]) / (batch / p[0]) for s, p in zip(figures["sampled"], figures["in_batch"], strict=True)]
    step = Regime("h_negatives_step", f"DSSM step with {NEGATIVES} sampled negatives vs in-batch only, real rows/s",
                  statistics.median(sampled), statistics.median(plain), statistics.median(ratios), TARGET_STEP, min(ratios), max(ratios),
                  {"sampled": sampled, "in_batch": plain})
    share = Regime("h_sampler_share", "added time to make a batch with the negatives, as a share of an in-batch step",
                   statistics.median(sampled), statistics.median(plain), statistics.median(shares), TARGET_SHARE, min(shares), max(shares),
                   {"share": shares})
    return [step, share], {"batch_size": batch, "steps_per_round": steps, "rounds": rounds, "negatives": NEGATIVES,
                           "make_batch_s": {n: [f[1] for f in v] for n, v in figures.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=None, help="rows per batch B (default 1024; --quick 256)")
    parser.add_argument("--steps", type=window_steps, default=None, help="steps per round, windows of 10 (default 100; --quick 20)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5; --quick 1)")
    parser.add_argument("--json", default="bench_results/bench_retrieval.json", help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="small steps and one round: checks that it runs, not how fast")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. distributed.device=cuda)")
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(str(args.json)) or ".", exist_ok=True)
    regimes, info = bench_retrieval(args.overrides, args.quick, args.rounds, args.batch_size, args.steps)
    result = {"device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(), **info,
              "regimes": {r.name: asdict(r) for r in regimes}}
    for r in regimes:
        bound = ">=" if r.name == "h_negatives_step" else "<="
        print(f"{r.name:<18} {r.ratio:6.3f} (range {r.ratio_min:.3f}-{r.ratio_max:.3f}, target {bound} {r.target:.2f})  {r.what}")
    print(f"in-batch {regimes[0].reference_samples_per_s:,.0f} rows/s, with {NEGATIVES} negatives {regimes[0].runner_samples_per_s:,.0f} "
          f"real rows/s; results in {args.json}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
