"""Every model's training samples/s through the runner, side by side (issue 32): ``python -m recsys_runner.bench.zoo
[--quick] [--models a,b] [overrides…]``.

Two shapes, each with its reference model first:

* ``criteo`` — the CTR and multi-task models on Criteo-shaped generated rows (``data=synthetic``: 13 dense and 26 sparse
  columns of 100,000 ids, batch 2,048), next to DeepFM: what choosing an interaction model costs per sample.
* ``histories`` — the models that read a user's history on generated histories (``data=synthetic_sequences``: Zipf
  lengths up to 50, batch 512), next to DIN.

Each model is built once with its default sizes (``conf/model/<name>.yaml``), fused Adagrad on the tables, dense Adagrad;
one untimed round of ``steps`` steps (the first build's one-off costs), then ``rounds`` timed rounds: the median of
each round's windows after the first (:func:`~recsys_runner.bench.regimes.runner_round`), in memory (the data module
makes the batches as it trains, the same for every model of a shape). docs/performance.md ("The model zoo") quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from recsys_runner.bench.regimes import COMMON, build_for_bench, runner_round, window_steps

SHAPES: dict[str, tuple[list[str], list[str]]] = {
    "criteo": (["data=synthetic", "data.num_dense=13", "data.num_sparse=26", "data.num_embeddings=100000", "data.batch_size=2048"],
               ["deepfm", "lr", "fm", "dlrm", "dcn", "dcn_v2", "xdeepfm", "autoint", "masknet", "wukong", "wide_deep", "mmoe", "esmm"]),
    "histories": (["data=synthetic_sequences", "data.batch_size=512"], ["din", "bst", "hstu_rank", "sasrec", "mind"]),
}
"""Per shape: its data overrides, and its models (the reference first)."""


def bench_model(model: str, data: list[str], steps: int, rounds: int, extra: list[str]) -> dict[str, float]:
    """``model``'s samples/s on ``data``: the median of ``rounds`` timed rounds after an untimed one."""
    c = build_for_bench([f"model={model}", *data, *COMMON, *extra], steps)
    try:
        runner_round(c.loop, steps)
        rates = [runner_round(c.loop, steps) for _ in range(rounds)]
    finally:
        c.close()
    return {"samples_per_s": statistics.median(rates), "min": min(rates), "max": max(rates)}


def bench_zoo(models: list[str] | None, quick: bool, steps: int, rounds: int, extra: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for shape, (data, names) in SHAPES.items():
        chosen = [n for n in names if models is None or n in models or n == names[0]]
        if quick:
            chosen = chosen[:2]
            data = [*data, "data.batch_size=256"] + (["data.num_embeddings=1000"] if shape == "criteo" else [])
        figures: dict[str, dict[str, float]] = {}
        for name in chosen:  # the reference first: each line is printed as its model finishes
            f = figures[name] = bench_model(name, data, steps, rounds, extra)
            f["ratio_to_reference"] = f["samples_per_s"] / figures[names[0]]["samples_per_s"]
            print(f"{shape:9s} {name:10s} {f['samples_per_s']:>10,.0f} samples/s  {f['ratio_to_reference']:5.2f}x {names[0]}"
                  f"  (rounds {f['min']:,.0f}-{f['max']:,.0f})", flush=True)
        out[shape] = {"reference": names[0], "data": data, "models": figures}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="comma-separated models (each shape's reference is always run)")
    parser.add_argument("--steps", type=window_steps, default=None, help="steps a round, windows of 10 (default 40; --quick 20)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per model (default 2; --quick 1)")
    parser.add_argument("--json", default="bench_results/zoo.json", help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="two models a shape, small batches: checks that it runs")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. distributed.device=cuda)")
    args = parser.parse_args(argv)
    models = args.models.split(",") if args.models else None
    result = {"device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(),
              "shapes": bench_zoo(models, args.quick, args.steps or (20 if args.quick else 40), args.rounds or (1 if args.quick else 2),
                                  args.overrides)}
    os.makedirs(os.path.dirname(str(args.json)) or ".", exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
