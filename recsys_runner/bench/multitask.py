"""What Pareto loss weighting costs a multi-task step: ``python -m recsys_runner.bench.multitask [--quick] [overrides…]``.

* ``i_pareto_every_step`` — MMoE through the runner on the multi-task preset (``experiment=mmoe_taobao``: 3 experts
  ``[256, 192, 128]``, towers ``[256, 192, 128, 64]``, batch 8192) with ``train.loss_weighting.kind=pareto`` solving
  every step, against the same run with fixed weights: samples/s ratio, the median of per-round ratios with the paths
  alternating within a round. Target >= 0.77 (Pareto costs <= 30 % over fixed: ``1 / 1.3``). The cost is one extra
  backward per task through the towers and gates to the experts' output (``torch.autograd.grad``), a ``T×T`` Gram matrix
  and a few Frank–Wolfe steps on it.
* ``i_pareto_every_10`` — the same with ``train.loss_weighting.every_n_steps=10`` (reported, no target).
* ``i_pareto_solve_share`` — the solves' own time per step (timed around each, synchronized on a GPU) over a fixed-weight
  step's time: the same cost without what else moves a whole round's samples/s on a shared machine. Target <= 0.30.

Each variant is built afresh per round, after one untimed warm-up run. Writes ``bench_multitask.json``; docs/performance.md quotes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict
from typing import Any

import torch

from recsys_runner.bench.regimes import COMMON, Regime, build_for_bench, runner_round, window_steps
from recsys_runner.train.weighting import ParetoWeighting

TARGET, TARGET_SHARE = 1 / 1.3, 0.30
"""Pareto weighting every step may cost at most 30 % over fixed weights: a samples/s ratio of at least ``1/1.3``, and
the solves' own time at most 0.30 of a fixed-weight step."""
PRESET = ["model=mmoe", "data=synthetic_multitask", "optim/dense=adam", "optim.lr=0.001", "model.num_experts=3",
          "model.expert_layer_sizes=[256,192,128]", "model.tower_layer_sizes=[256,192,128,64]", "data.batch_size=8192"]
"""``experiment=mmoe_taobao``'s model, optimizers and batch (the preset itself also sets MLflow and checkpoints, which the
bench turns off)."""
VARIANTS = {"fixed": [], "pareto_every_step": ["train.loss_weighting.kind=pareto"],
            "pareto_every_10": ["train.loss_weighting.kind=pareto", "train.loss_weighting.every_n_steps=10"]}


def _round(variant: list[str], steps: int, extra: list[str]) -> tuple[float, float]:
    """One runner round of a freshly built variant: (samples/s, seconds its Pareto solves took per step, 0 without)."""
    c = build_for_bench([*PRESET, *COMMON, *variant, *extra], steps)
    try:
        weighting, spent = c.loop.stepper.weighting, [0.0]
        if isinstance(weighting, ParetoWeighting):
            solve = weighting._solve

            def timed(losses: torch.Tensor, per_task: list[torch.Tensor], shared: list[torch.Tensor]) -> None:
                _sync()
                start = time.perf_counter()
                solve(losses, per_task, shared)
                _sync()
                spent[0] += time.perf_counter() - start

            weighting._solve = timed  # type: ignore[method-assign]
        rate = runner_round(c.loop, steps)
        return rate, spent[0] / steps
    finally:
        c.close()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_multitask(overrides: list[str], quick: bool, rounds: int | None, steps: int | None) -> tuple[list[Regime], dict[str, Any]]:
    """The regimes and the raw per-round figures."""
    steps = steps or (20 if quick else 60)
    rounds = rounds or (1 if quick else 3)
    extra = (["data.batch_size=512"] if quick else []) + overrides
    batch = 512 if quick else int(PRESET[-1].split("=")[1])
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    solve_s: dict[str, list[float]] = {name: [] for name in VARIANTS}
    _round(VARIANTS["fixed"], 20, extra)  # untimed: the process's first build and steps pay one-off costs (allocator, caches)
    for r in range(rounds):
        for name in VARIANTS if r % 2 == 0 else reversed(list(VARIANTS)):
            rate, solve = _round(VARIANTS[name], steps, extra)
            rates[name].append(rate)
            solve_s[name].append(solve)
        print(f"i round {r + 1}: " + "   ".join(f"{n} {rates[n][-1]:,.0f}" for n in VARIANTS) + " samples/s; solve "
              + "   ".join(f"{n} {solve_s[n][-1] * 1e3:.1f} ms/step" for n in VARIANTS if n != "fixed"), flush=True)
    regimes = []
    for name, what in (("pareto_every_step", "Pareto weighting solved every step vs fixed weights, samples/s"),
                       ("pareto_every_10", "Pareto weighting solved every 10 steps vs fixed weights, samples/s")):
        ratios = [p / f for p, f in zip(rates[name], rates["fixed"], strict=True)]
        regimes.append(Regime(f"i_{name}", what, statistics.median(rates[name]), statistics.median(rates["fixed"]),
                              statistics.median(ratios), TARGET if name == "pareto_every_step" else 0.0, min(ratios), max(ratios),
                              {name: rates[name], "fixed": rates["fixed"]}))
    # The solve's own time over a fixed-weight step: robust to what moves a whole round's samples/s (other load, numerics).
    shares = [s / (batch / f) for s, f in zip(solve_s["pareto_every_step"], rates["fixed"], strict=True)]
    regimes.append(Regime("i_pareto_solve_share", "time of the Pareto solves per step over a fixed-weight step's time",
                          statistics.median(rates["pareto_every_step"]), statistics.median(rates["fixed"]), statistics.median(shares),
                          TARGET_SHARE, min(shares), max(shares), {"solve_s_per_step": solve_s["pareto_every_step"]}))
    return regimes, {"steps_per_round": steps, "rounds": rounds, "overrides": extra, "batch_size": batch}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=window_steps, default=None, help="steps per round, windows of 10 (default 60; --quick 20)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; --quick 1)")
    parser.add_argument("--json", default="bench_results/bench_multitask.json", help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="batch 512, few steps, one round: checks that it runs, not how fast")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. distributed.device=cuda)")
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(str(args.json)) or ".", exist_ok=True)
    regimes, info = bench_multitask(args.overrides, args.quick, args.rounds, args.steps)
    result = {"device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(), **info,
              "regimes": {r.name: asdict(r) for r in regimes}}
    for r in regimes:
        if r.name == "i_pareto_solve_share":
            print(f"{r.name:<22} {r.ratio:6.3f} (range {r.ratio_min:.3f}-{r.ratio_max:.3f}, target <= {r.target:.2f})  {r.what}")
            continue
        target = f"target >= {r.target:.2f}" if r.target else "reported"
        print(f"{r.name:<22} {r.ratio:6.3f} (range {r.ratio_min:.3f}-{r.ratio_max:.3f}, {target}; cost {1 / r.ratio - 1:+.1%})  {r.what}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
