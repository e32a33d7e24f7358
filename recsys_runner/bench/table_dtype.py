"""``python -m recsys_runner.bench.table_dtype``: what ``precision.embedding_data_type=fp16`` saves and costs.

Two built runs of one config (regime (a)'s DeepFM and settings, :data:`~recsys_runner.bench.regimes.COMMON`, on the same
batches held in memory on the run's device), one with float32 tables and one with fp16 tables, train the same number of
steps per round, alternating as the other regimes do. Reported per table type: the median of the rounds' samples/s
(each round's median window, :func:`~recsys_runner.bench.regimes.runner_round`), the bytes this rank's tables and their
optimizer state really hold in the sharded module, and the planner's estimate (its plan line).

Usage: ``python -m recsys_runner.bench.table_dtype [--steps 200] [--rounds 4] [--json out.json] [overrides…]``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
from typing import Any

import torch
from torch import nn

from recsys_runner.bench.regimes import (
    COMMON,
    MAX_DISTINCT_BATCHES,
    alternate,
    build_for_bench,
    on_device,
    runner_round,
    window_steps,
    with_data,
)
from recsys_runner.build import Components
from recsys_runner.data.memory import InMemoryData
from recsys_runner.optim.optimizers import SPARSE

TYPES = ("fp32", "fp16")


def _local(value: Any) -> torch.Tensor | None:
    """This rank's tensor of a state-dict value (a sharded tensor's first local shard), or ``None`` for none."""
    if hasattr(value, "local_shards"):
        shards = value.local_shards()
        return shards[0].tensor if shards else None
    return value if isinstance(value, torch.Tensor) else None


def table_bytes(c: Components) -> dict[str, int]:
    """The bytes this rank holds of the model's embedding tables (``weights``) and of their optimizer state (``state``)."""
    model: nn.Module = c.loop.evaluator.model
    weights = [_local(v) for k, v in model.state_dict().items() if k.endswith(".weight") and (".embedding_bags." in k or ".embeddings." in k)]
    state = [_local(v) for param, saved in c.loop.stepper.optimizer.state_dict()["state"].items()
             if param.startswith(f"{SPARSE.key}.") for v in saved.values()]
    return {"weights": sum(t.numel() * t.element_size() for t in weights if t is not None),
            "state": sum(t.numel() * t.element_size() for t in state if t is not None)}


def bench_table_dtype(overrides: list[str], steps: int, rounds: int) -> dict[str, Any]:
    """The figures of the module docstring, for ``rounds`` rounds of ``steps`` steps."""
    built = {t: build_for_bench(["model=deepfm", *COMMON, *overrides, f"precision.embedding_data_type={t}"], steps) for t in TYPES}
    try:
        data = built["fp32"].loop.data
        batches = on_device(list(itertools.islice(data.train_batches(0, 0, 1), min(steps, MAX_DISTINCT_BATCHES))), built["fp32"].env.device)
        loops = {t: with_data(c.loop, InMemoryData(data.features, batches, batches[:1])) for t, c in built.items()}
        rates = alternate(rounds, {t: functools.partial(runner_round, loop, steps) for t, loop in loops.items()}, "table dtype")
        result: dict[str, Any] = {"device": str(built["fp32"].env.device), "threads": torch.get_num_threads(),
                                  "batch_size": data.batch_size, "steps_per_round": steps, "rounds": rounds, "types": {}}
        for t, c in built.items():
            result["types"][t] = {"samples_per_s": statistics.median(rates[t]), "rounds": rates[t], **table_bytes(c),
                                  "plan": c.distributed.summary}
    finally:
        for c in reversed(list(built.values())):  # the first built owns the process group
            c.close()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recsys_runner.bench.table_dtype", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=window_steps, default=200)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    result = bench_table_dtype(args.overrides, args.steps, args.rounds)
    mb = 1024 ** 2
    for t, r in result["types"].items():
        print(f"{t}: {r['samples_per_s']:,.0f} samples/s; tables {r['weights'] / mb:.1f} MB + optimizer state {r['state'] / mb:.1f} MB "
              f"(this rank, measured); {r['plan']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
