"""Regime ``h_collision`` of ``make bench``: managed-collision lookups against plain hashing, on the same batches.

DeepFM (the runner's default model) with 26 sparse features, once with every table managed (``data.managed_collision``:
raw ids from 10x more distinct ids than slots, mapped by TorchRec's MCH modules, ``models/collision.py``) and once
with plain tables reading the same ids hashed into them (``raw id mod num_embeddings``: what ``encoding: mod`` does).
Both train the same in-memory batches through the runner (:func:`~recsys_runner.bench.regimes.runner_round`), so the
difference is the remapping (with its history recording and counters) and the eviction every ``eviction_interval``
steps. The two are timed apart: every eviction (TorchRec's ``_coalesce_history``: sort the history, rescore and evict)
is clocked, so a round's wall time splits into eviction seconds and the rest. Reported, each the median over rounds of
a share of the plain round's wall time: ``lookup_added`` (the managed round less its evictions), ``eviction_added``
(its evictions, amortized over the round's steps), ``added_step`` (both); per ``eviction_interval``, and the
milliseconds of one eviction. Target: ``added_step`` at most :data:`ADDED_STEP_TARGET`.

``python -m recsys_runner.bench.collision [--quick] [overrides…]`` runs it alone; ``python -m recsys_runner.bench``
runs it after the sequence regimes.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torchrec.datasets.utils import Batch
from torchrec.modules.mc_modules import MCHManagedCollisionModule
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
from recsys_runner.models.collision import CountedMCH

ADDED_STEP_TARGET = 0.15
"""The managed-collision path may add at most this share to a training step."""
TABLES, SLOTS = 26, 100_000
INTERVALS = (100, 1000)
"""The eviction intervals measured (steps between evictions; the default ``eviction_interval`` is 100)."""


class _MCHClock:
    """Seconds spent in TorchRec's MCH modules while :meth:`running`: evictions (``_coalesce_history``: sort the
    history, rescore, evict; and how many table evictions ran) and the per-step work (``remap`` plus the history
    recording of ``profile``). A CUDA device is synchronized around each call."""

    def __init__(self) -> None:
        self.evict_s, self.evictions, self.calls_s = 0.0, 0, 0.0

    def reading(self) -> tuple[float, int, float]:
        return self.evict_s, self.evictions, self.calls_s

    @contextmanager
    def running(self) -> Iterator[None]:
        coalesce, profile, remap = MCHManagedCollisionModule._coalesce_history, MCHManagedCollisionModule.profile, CountedMCH.remap
        clock = self

        def timed_coalesce(module: MCHManagedCollisionModule) -> None:
            start = _now(module.device)
            coalesce(module)
            clock.evict_s += _now(module.device) - start
            clock.evictions += 1

        def timed_profile(module: MCHManagedCollisionModule, features: dict[str, Any]) -> dict[str, Any]:
            start = _now(module.device)
            out = profile(module, features)
            clock.calls_s += _now(module.device) - start  # the eviction inside is taken off below
            return out

        def timed_remap(module: CountedMCH, features: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
            start = _now(module.device)
            out = remap(module, features, *args, **kwargs)
            clock.calls_s += _now(module.device) - start
            return out

        MCHManagedCollisionModule._coalesce_history = timed_coalesce
        MCHManagedCollisionModule.profile = timed_profile
        CountedMCH.remap = timed_remap  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            MCHManagedCollisionModule._coalesce_history, MCHManagedCollisionModule.profile = coalesce, profile
            CountedMCH.remap = remap  # type: ignore[method-assign]


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


Round = tuple[float, float, int, float]
"""One round of one path: wall seconds, eviction seconds, table evictions, seconds in MCH remap and history recording."""


def _timed_round(run_round: Callable[[], float], clock: _MCHClock, log: list[Round]) -> float:
    """``run_round()`` (its samples/s returned as is), appending its :data:`Round`."""
    evict_s, evictions, calls_s = clock.reading()
    start = time.perf_counter()
    rate = run_round()
    wall = time.perf_counter() - start
    log.append((wall, clock.evict_s - evict_s, clock.evictions - evictions, clock.calls_s - calls_s - (clock.evict_s - evict_s)))
    return rate


def _forced_eviction(model: torch.nn.Module, clock: _MCHClock) -> tuple[float, int]:
    """Evict every managed table of ``model`` once, now, timed (a path whose rounds held no eviction):
    ``(seconds, table evictions)``."""
    evict_s, evictions, _ = clock.reading()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MCHManagedCollisionModule) and module._current_history_buffer_offset > 0:
                module._coalesce_history()
    return clock.evict_s - evict_s, clock.evictions - evictions


def _hashed(batch: Batch, slots: int) -> Batch:
    """``batch`` with every raw id hashed into ``slots`` rows (``mod``): the plain tables' input."""
    kjt = batch.sparse_features
    plain = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() % slots, lengths=kjt.lengths())
    return Batch(dense_features=batch.dense_features, sparse_features=plain, labels=batch.labels)


def bench_collision(overrides: Sequence[str], quick: bool, rounds: int | None) -> tuple[dict[str, Any], str]:
    """The regime's JSON and its printed row: samples/s of the plain and managed paths per round, and per eviction
    interval what the lookups and the (amortized) evictions add to a step."""
    steps, rounds = (20, rounds or 1) if quick else (200, rounds or 3)
    batch_size = 128 if quick else 1024
    base = ["model=deepfm", *COMMON, *overrides, f"data.num_sparse={TABLES}", f"data.num_embeddings={SLOTS}",
            f"data.batch_size={batch_size}"]
    features = ",".join(f"cat_{i}" for i in range(TABLES))
    intervals = (10,) if quick else INTERVALS
    managed = {f"every_{k}": build_for_bench([*base, f"data.managed_collision={{features: [{features}], eviction_interval: {k}}}"],
                                             steps) for k in intervals}
    plain = build_for_bench(base, steps)
    clock = _MCHClock()
    logs: dict[str, list[Round]] = {}
    try:
        first = managed[f"every_{intervals[0]}"]
        batches = on_device(list(itertools.islice(first.loop.data.train_batches(0, 0, 1), min(steps, MAX_DISTINCT_BATCHES))),
                            first.env.device)
        hashed = [_hashed(b, SLOTS) for b in batches]
        loops = {k: with_data(c.loop, InMemoryData(c.loop.data.features, batches, batches[:1])) for k, c in managed.items()}
        loops["plain"] = with_data(plain.loop, InMemoryData(plain.loop.data.features, hashed, hashed[:1]))
        logs.update({name: [] for name in loops})
        paths = {name: functools.partial(_timed_round, functools.partial(runner_round, loop, steps), clock, logs[name])
                 for name, loop in loops.items()}
        with clock.running():
            for name, c in managed.items():  # a first round, then an eviction: every mapping holds ids, as in a long run
                runner_round(loops[name], steps)
                _forced_eviction(c.loop.evaluator.model, clock)
            per_round = alternate(rounds, paths, "h")
            evictions = {k: _evictions(logs[k], c.loop.evaluator.model, clock) for k, c in managed.items()}
    finally:
        plain.close()
        for c in reversed(managed.values()):
            c.close()
    added = _added(logs, evictions, steps)
    result = {"tables": TABLES, "slots": SLOTS, "batch_size": batch_size, "steps_per_round": steps, "rounds": per_round,
              "round_seconds": logs, **added, "target": ADDED_STEP_TARGET}
    return result, _row(per_round, added)


def _evictions(log: list[Round], model: torch.nn.Module, clock: _MCHClock) -> tuple[float, float]:
    """``(seconds, tables evicted)`` of the evictions in a path's rounds; one forced now when none fell in them."""
    seconds, count = sum(r[1] for r in log), sum(r[2] for r in log)
    return (seconds, count) if count else _forced_eviction(model, clock)


def _added(logs: dict[str, list[Round]], evictions: dict[str, tuple[float, float]], steps: int) -> dict[str, dict[str, float]]:
    """Per managed path (``every_<k>``), shares of a plain step: its rounds as run, evictions where they fell
    (``measured_added``, median over rounds); the round less its evictions (``lookup_added``); of that, the MCH modules'
    own remap and history recording (``mch_calls_added``); one eviction of every table (``eviction_ms``) amortized over
    ``k`` steps (``eviction_added``); and ``added_step = lookup_added + eviction_added``, the steady-state cost."""
    plain = [r[0] for r in logs["plain"]]
    step_ms = 1000 * statistics.median(plain) / steps
    keys = ("added_step", "measured_added", "lookup_added", "mch_calls_added", "eviction_added", "eviction_ms")
    out: dict[str, dict[str, float]] = {key: {} for key in keys}
    for name, (seconds, tables_evicted) in evictions.items():
        log, interval = logs[name], int(name.removeprefix("every_"))
        out["measured_added"][name] = statistics.median(r[0] / p - 1 for r, p in zip(log, plain, strict=True))
        out["lookup_added"][name] = statistics.median((r[0] - r[1]) / p - 1 for r, p in zip(log, plain, strict=True))
        out["mch_calls_added"][name] = statistics.median(r[3] / p for r, p in zip(log, plain, strict=True))
        eviction_ms = 1000 * seconds / max(tables_evicted / (2 * TABLES), 1e-9)  # DeepFM: 2 managed tables per feature
        out["eviction_ms"][name] = eviction_ms
        out["eviction_added"][name] = eviction_ms / interval / step_ms
        out["added_step"][name] = out["lookup_added"][name] + out["eviction_added"][name]
    return out


def _row(per_round: dict[str, list[float]], added: dict[str, dict[str, float]]) -> str:
    return (f"h_collision      plain {statistics.median(per_round['plain']):,.0f} samples/s; managed adds "
            + "; ".join(f"{added['added_step'][k]:+.1%} = lookup {added['lookup_added'][k]:+.1%} (MCH calls "
                        f"{added['mch_calls_added'][k]:+.1%}) + eviction {added['eviction_added'][k]:+.1%} "
                        f"({added['eviction_ms'][k]:,.0f} ms per eviction of all tables, {k.replace('_', ' ')} steps)"
                        for k in added["added_step"])
            + f" to a step (target <= {ADDED_STEP_TARGET:.0%})")


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
    parser.add_argument("--json", type=Path, default=None, help="also write the result to this file")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. distributed.device=cuda)")
    args = parser.parse_args(argv)
    result, row = bench_collision(args.overrides, args.quick, args.rounds)
    print(row)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
