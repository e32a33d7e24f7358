"""Regime ``h_collision`` of ``make bench``: managed-collision lookups against plain hashing, on the same batches.

DeepFM (the runner's default model) with 26 sparse features, once with every table managed (``data.managed_collision``:
raw ids from 10x more distinct ids than slots, mapped by TorchRec's MCH modules, ``models/collision.py``) and once
with plain tables reading the same ids hashed into them (``raw id mod num_embeddings``: what ``encoding: mod`` does).
Both train the same in-memory batches through the runner (:func:`~recsys_runner.bench.regimes.runner_round`), so the
difference is the remapping, its eviction every ``eviction_interval`` steps and the counters. Reported: how much the
managed path adds to a step (``plain samples/s / managed samples/s - 1``, the median of per-round ratios) at an
eviction every step and every 100 steps; target: at most :data:`ADDED_STEP_TARGET`.

``python -m recsys_runner.bench.collision [--quick] [overrides…]`` runs it alone; ``python -m recsys_runner.bench``
runs it after the sequence regimes.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
from collections.abc import Sequence
from typing import Any

from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.bench.regimes import (
    COMMON,
    MAX_DISTINCT_BATCHES,
    Regime,
    SequenceBench,
    alternate,
    build_for_bench,
    on_device,
    runner_round,
    with_data,
)
from recsys_runner.data.memory import InMemoryData

ADDED_STEP_TARGET = 0.15
"""The managed-collision path may add at most this share to a training step."""
TABLES, SLOTS = 26, 100_000


def _hashed(batch: Batch, slots: int) -> Batch:
    """``batch`` with every raw id hashed into ``slots`` rows (``mod``): the plain tables' input."""
    kjt = batch.sparse_features
    plain = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() % slots, lengths=kjt.lengths())
    return Batch(dense_features=batch.dense_features, sparse_features=plain, labels=batch.labels)


def bench_collision(overrides: Sequence[str], quick: bool, rounds: int | None) -> tuple[dict[str, Any], str]:
    """The regime's JSON and its printed row: samples/s of the plain and managed paths per round, and what each
    eviction interval adds to a step."""
    steps, rounds = (20, rounds or 1) if quick else (100, rounds or 5)
    batch_size = 128 if quick else 1024
    base = ["model=deepfm", *COMMON, *overrides, f"data.num_sparse={TABLES}", f"data.num_embeddings={SLOTS}",
            f"data.batch_size={batch_size}"]
    features = ",".join(f"cat_{i}" for i in range(TABLES))
    managed = {interval: build_for_bench([*base, f"data.managed_collision={{features: [{features}], eviction_interval: {interval}}}"], steps)
               for interval in (1, 100)}
    plain = build_for_bench(base, steps)
    try:
        data = managed[1].loop.data
        batches = on_device(list(itertools.islice(data.train_batches(0, 0, 1), min(steps, MAX_DISTINCT_BATCHES))), managed[1].env.device)
        hashed = [_hashed(b, SLOTS) for b in batches]
        loops = {f"managed_every_{k}": with_data(c.loop, InMemoryData(c.loop.data.features, batches, batches[:1])) for k, c in managed.items()}
        loops["plain"] = with_data(plain.loop, InMemoryData(plain.loop.data.features, hashed, hashed[:1]))
        per_round = alternate(rounds, {name: functools.partial(runner_round, loop, steps) for name, loop in loops.items()}, "h")
    finally:
        plain.close()
        for c in reversed(managed.values()):
            c.close()
    added = {name: statistics.median(p / m - 1 for p, m in zip(per_round["plain"], rates, strict=True))
             for name, rates in per_round.items() if name != "plain"}
    result = {"tables": TABLES, "slots": SLOTS, "batch_size": batch_size, "steps_per_round": steps, "rounds": per_round,
              "added_step": added, "target": ADDED_STEP_TARGET}
    row = (f"h_collision      plain {statistics.median(per_round['plain']):,.0f} samples/s; managed adds "
           + ", ".join(f"{v:+.1%} ({k.replace('managed_', 'eviction ').replace('_', ' ')} steps)" for k, v in added.items())
           + f" to a step (target <= {ADDED_STEP_TARGET:.0%})")
    return result, row


def with_collision(sequence_bench: SequenceBench) -> SequenceBench:
    """``sequence_bench`` followed by this regime: its JSON joins the sequence regimes' (``h_collision``), its row their
    rows. How ``python -m recsys_runner.bench`` registers it without :mod:`~recsys_runner.bench.regimes` knowing it."""

    def both(overrides: list[str], quick: bool, rounds: int | None) -> tuple[Regime, dict[str, Any], str]:
        din, sequences, rows = sequence_bench(overrides, quick, rounds)
        result, row = bench_collision(overrides, quick, rounds)
        return din, {**sequences, "h_collision": result}, f"{rows}\n{row}" if rows else row

    return both


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny steps and one round: checks that the regime runs, not how fast")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5; --quick 1)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. distributed.device=cuda)")
    args = parser.parse_args(argv)
    result, row = bench_collision(args.overrides, args.quick, args.rounds)
    print(row)
    return result


if __name__ == "__main__":
    main()
