"""Regime ``h_collision`` of ``make bench``: managed-collision lookups against plain hashing, on the same batches.

DeepFM (the runner's default model) with 26 sparse features, once per managed-collision path with every table managed
(``data.managed_collision``: raw ids from 10x more distinct ids than slots, ``models/collision.py``) and once with plain
tables reading the same ids hashed into them (``raw id mod num_embeddings``: what ``encoding: mod`` does). All train
the same in-memory batches through the runner (:func:`~recsys_runner.bench.regimes.runner_round`). The paths, by
``--module`` (``auto``: what the device picks, with ``mch`` beside ``hash_zch`` on CUDA):

* ``every_<k>`` (``mch``, TorchRec's MCH modules): the remapping (with its history recording and counters) and the
  eviction every ``k`` steps, timed apart: every eviction (TorchRec's ``_coalesce_history``: sort the history, rescore
  and evict) is clocked, so a round's wall time splits into eviction seconds and the rest.
* ``hash_zch`` (CUDA only, TorchRec's HashZch modules): admission and eviction happen inside every lookup's kernel, so
  the round is all lookup; the module calls (remap, the evicted slots' collection) are clocked.

Reported, each the median over rounds of a share of the plain round's wall time: ``lookup_added`` (the managed round
less its evictions), ``eviction_added`` (its evictions, amortized over the round's steps; 0 for ``hash_zch``),
``added_step`` (both), ``mch_calls_added`` (the managed-collision modules' own calls; on a GPU timed by CUDA events, so
the clock adds no sync), and the milliseconds of one eviction. Target: ``added_step`` at most :data:`ADDED_STEP_TARGET`.

``python -m recsys_runner.bench.collision [--quick] [--module M] [overrides…]`` runs it alone; ``python -m
recsys_runner.bench`` runs it after the sequence regimes. ``--check`` runs instead :func:`check_hash_zch`, the GPU smoke
test of ``hash_zch``: train, checkpoint, resume into a fresh model, the mapping and eviction checked.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import tempfile
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
    compose_run,
    on_device,
    runner_round,
    with_data,
)
from recsys_runner.build import build
from recsys_runner.data.memory import InMemoryData
from recsys_runner.distributed.config import resolve_device_type
from recsys_runner.models.collision import CountedHashZch, CountedMCH
from recsys_runner.train.loop import train

ADDED_STEP_TARGET = 0.15
"""The managed-collision path may add at most this share to a training step."""
TABLES, SLOTS = 26, 100_000
INTERVALS = (100, 1000)
"""The eviction intervals measured for ``mch`` (steps between evictions; the default ``eviction_interval`` is 100)."""
MODULES = ("auto", "mch", "hash_zch", "all")
"""``--module``: ``auto`` measures what the device picks (CUDA: ``hash_zch``, and ``mch`` beside it; CPU: ``mch``)."""
HASH_ZCH = "hash_zch"
"""The ``hash_zch`` path's name (its ``ttl_steps`` at the default, 100)."""


class _Spans:
    """Seconds between marks, summed: ``perf_counter`` on a CPU; CUDA events on a GPU, recorded in the stream without
    a sync and read (one sync) by :meth:`total`, so that timing the module calls does not slow them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self, device: torch.device) -> Any:
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, mark: Any) -> None:
        if isinstance(mark, float):
            self.seconds += time.perf_counter() - mark
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._events.append((mark, end))

    def total(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1000
            self._events = []
        return self.seconds


class _MCHClock:
    """Seconds spent in TorchRec's managed-collision modules while :meth:`running`: MCH's evictions
    (``_coalesce_history``: sort the history, rescore, evict; and how many table evictions ran) and the per-step work
    (MCH: ``remap`` plus the history recording of ``profile``; HashZch: ``remap`` and ``evict``, which collects the
    slots its kernel evicted inline)."""

    def __init__(self) -> None:
        self.evict, self.calls, self.evictions = _Spans(), _Spans(), 0

    def reading(self) -> tuple[float, int, float]:
        return self.evict.total(), self.evictions, self.calls.total()

    @contextmanager
    def running(self) -> Iterator[None]:
        coalesce, profile = MCHManagedCollisionModule._coalesce_history, MCHManagedCollisionModule.profile
        remap, zch_remap, zch_evict = CountedMCH.remap, CountedHashZch.remap, CountedHashZch.evict
        clock = self

        def timed_coalesce(module: MCHManagedCollisionModule) -> None:
            mark = clock.evict.start(module.device)
            coalesce(module)
            clock.evict.stop(mark)
            clock.evictions += 1

        def timed(call: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(call)
            def wrapper(module: Any, *args: Any, **kwargs: Any) -> Any:
                mark = clock.calls.start(module.device)
                out = call(module, *args, **kwargs)
                clock.calls.stop(mark)  # MCH: the eviction inside profile is taken off below
                return out
            return wrapper

        replaced: list[tuple[type, str, Any]] = [
            (MCHManagedCollisionModule, "_coalesce_history", timed_coalesce), (MCHManagedCollisionModule, "profile", timed(profile)),
            (CountedMCH, "remap", timed(remap)), (CountedHashZch, "remap", timed(zch_remap)), (CountedHashZch, "evict", timed(zch_evict))]
        originals = [(cls, name, cls.__dict__[name]) for cls, name, _ in replaced]
        for cls, name, wrapper in replaced:
            setattr(cls, name, wrapper)
        try:
            yield
        finally:
            for cls, name, original in originals:
                setattr(cls, name, original)


Round = tuple[float, float, int, float]
"""One round of one path: wall seconds, eviction seconds, table evictions, seconds in the modules' own calls."""


def _timed_round(run_round: Callable[[], float], clock: _MCHClock, log: list[Round]) -> float:
    """``run_round()`` (its samples/s returned as is), appending its :data:`Round`."""
    evict_s, evictions, calls_s = clock.reading()
    start = time.perf_counter()
    rate = run_round()
    wall = time.perf_counter() - start
    evict_now, evictions_now, calls_now = clock.reading()
    log.append((wall, evict_now - evict_s, evictions_now - evictions, calls_now - calls_s - (evict_now - evict_s)))
    return rate


def _forced_eviction(model: torch.nn.Module, clock: _MCHClock) -> tuple[float, int]:
    """Evict every MCH table of ``model`` once, now, timed (a path whose rounds held no eviction):
    ``(seconds, table evictions)``."""
    evict_s, evictions, _ = clock.reading()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MCHManagedCollisionModule) and module._current_history_buffer_offset > 0:
                module._coalesce_history()
    evict_now, evictions_now, _ = clock.reading()
    return evict_now - evict_s, evictions_now - evictions


def _hashed(batch: Batch, slots: int) -> Batch:
    """``batch`` with every raw id hashed into ``slots`` rows (``mod``): the plain tables' input."""
    kjt = batch.sparse_features
    plain = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() % slots, lengths=kjt.lengths())
    return Batch(dense_features=batch.dense_features, sparse_features=plain, labels=batch.labels)


def _paths(module: str, device_type: str, intervals: Sequence[int], features: str) -> dict[str, str]:
    """Each managed path's ``data.managed_collision`` override, by path name, for ``--module``."""
    modules = {"auto": ["hash_zch", "mch"] if device_type == "cuda" else ["mch"], "all": ["hash_zch", "mch"]}.get(module, [module])
    paths = {f"every_{k}": f"data.managed_collision={{features: [{features}], module: mch, eviction_interval: {k}}}"
             for k in intervals if "mch" in modules}
    if "hash_zch" in modules:
        paths = {HASH_ZCH: f"data.managed_collision={{features: [{features}], module: hash_zch}}", **paths}
    return paths


def bench_collision(overrides: Sequence[str], quick: bool, rounds: int | None, module: str = "auto") -> tuple[dict[str, Any], str]:
    """The regime's JSON and its printed row: samples/s of the plain and managed paths per round, and per path what
    the lookups and the (amortized) evictions add to a step."""
    steps, rounds = (20, rounds or 1) if quick else (200, rounds or 3)
    batch_size = 128 if quick else 1024
    base = ["model=deepfm", *COMMON, *overrides, f"data.num_sparse={TABLES}", f"data.num_embeddings={SLOTS}",
            f"data.batch_size={batch_size}"]
    device_type = resolve_device_type(compose_run(base).distributed.device)
    features = ",".join(f"cat_{i}" for i in range(TABLES))
    managed = {name: build_for_bench([*base, override], steps)
               for name, override in _paths(module, device_type, (10,) if quick else INTERVALS, features).items()}
    plain = build_for_bench(base, steps)
    clock = _MCHClock()
    logs: dict[str, list[Round]] = {}
    try:
        first = next(iter(managed.values()))
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
            evictions = {k: _evictions(logs[k], c.loop.evaluator.model, clock) for k, c in managed.items() if k != HASH_ZCH}
    finally:
        plain.close()
        for c in reversed(managed.values()):
            c.close()
    added = _added(logs, evictions, steps)
    result = {"tables": TABLES, "slots": SLOTS, "batch_size": batch_size, "steps_per_round": steps, "device": device_type,
              "rounds": per_round, "round_seconds": logs, **added, "target": ADDED_STEP_TARGET}
    return result, _row(per_round, added)


def _evictions(log: list[Round], model: torch.nn.Module, clock: _MCHClock) -> tuple[float, float]:
    """``(seconds, tables evicted)`` of the evictions in a path's rounds; one forced now when none fell in them."""
    seconds, count = sum(r[1] for r in log), sum(r[2] for r in log)
    return (seconds, count) if count else _forced_eviction(model, clock)


def _added(logs: dict[str, list[Round]], evictions: dict[str, tuple[float, float]], steps: int) -> dict[str, dict[str, float]]:
    """Per managed path, shares of a plain step: its rounds as run, evictions where they fell (``measured_added``, median
    over rounds); the round less its evictions (``lookup_added``); of that, the modules' own calls (``mch_calls_added``).
    For ``every_<k>`` (MCH): one eviction of every table (``eviction_ms``) amortized over ``k`` steps
    (``eviction_added``), and ``added_step = lookup_added + eviction_added``, the steady-state cost. For ``hash_zch``
    evictions are inline: ``added_step`` is the round as measured."""
    plain = [r[0] for r in logs["plain"]]
    step_ms = 1000 * statistics.median(plain) / steps
    keys = ("added_step", "measured_added", "lookup_added", "mch_calls_added", "eviction_added", "eviction_ms")
    out: dict[str, dict[str, float]] = {key: {} for key in keys}
    for name in [n for n in logs if n != "plain"]:
        log = logs[name]
        out["measured_added"][name] = statistics.median(r[0] / p - 1 for r, p in zip(log, plain, strict=True))
        out["lookup_added"][name] = statistics.median((r[0] - r[1]) / p - 1 for r, p in zip(log, plain, strict=True))
        out["mch_calls_added"][name] = statistics.median(r[3] / p for r, p in zip(log, plain, strict=True))
        if name not in evictions:  # hash_zch: admission and eviction inside the lookups
            out["eviction_ms"][name], out["eviction_added"][name] = 0.0, 0.0
            out["added_step"][name] = out["measured_added"][name]
            continue
        seconds, tables_evicted = evictions[name]
        eviction_ms = 1000 * seconds / max(tables_evicted / (2 * TABLES), 1e-9)  # DeepFM: 2 managed tables per feature
        out["eviction_ms"][name] = eviction_ms
        out["eviction_added"][name] = eviction_ms / int(name.removeprefix("every_")) / step_ms
        out["added_step"][name] = out["lookup_added"][name] + out["eviction_added"][name]
    return out


def _row(per_round: dict[str, list[float]], added: dict[str, dict[str, float]]) -> str:
    def one(k: str) -> str:
        if k == HASH_ZCH:
            return (f"{added['added_step'][k]:+.1%} = hash_zch lookup (module calls {added['mch_calls_added'][k]:+.1%}; "
                    f"eviction inline)")
        return (f"{added['added_step'][k]:+.1%} = lookup {added['lookup_added'][k]:+.1%} (MCH calls "
                f"{added['mch_calls_added'][k]:+.1%}) + eviction {added['eviction_added'][k]:+.1%} "
                f"({added['eviction_ms'][k]:,.0f} ms per eviction of all tables, {k.replace('_', ' ')} steps)")

    return (f"h_collision      plain {statistics.median(per_round['plain']):,.0f} samples/s; managed adds "
            + "; ".join(one(k) for k in added["added_step"]) + f" to a step (target <= {ADDED_STEP_TARGET:.0%})")


CHECK_STEPS, CHECK_SLOTS = 8, 128
CHECK_MANAGED = ("data.managed_collision={features: [cat_0, cat_1], input_hash_size: 1000000, module: hash_zch, ttl_steps: 1, "
                 "max_probe: 16}")
""":func:`check_hash_zch`'s tables: cat_0 and cat_1 draw 1280 distinct raw ids (10x their 128 slots) and an id unseen
for a step may lose its slot, so that slots fill and evict within a few steps."""


def check_hash_zch(overrides: Sequence[str], directory: Path) -> dict[str, Any]:
    """The GPU smoke test of ``hash_zch`` (``--check``), modelled on ``tests/test_managed_collision.py``: train
    :data:`CHECK_STEPS` steps with checkpoints in ``directory``, build a fresh model that resumes from the last one,
    and check that every table's mapping (ids, stamps) and lookup clock came back, then train as many steps again.

    Returns what it saw (per table: slots used, slots evicted over both runs; the restored step; the resumed run's
    eval metrics).

    Raises:
        AssertionError: no slot was evicted, or a table's mapping or clock did not survive the checkpoint.
    """
    run = [*[o for o in COMMON if not o.startswith("checkpoint=")], "model=deepfm", f"data.num_embeddings={CHECK_SLOTS}", CHECK_MANAGED, "data.batch_size=512", "train.log_every_steps=2",
           "train.eval_max_batches=2", "checkpoint=default", f"checkpoint.dir={directory}", f"checkpoint.every_steps={CHECK_STEPS // 2}",
           "checkpoint.keep_last=null", *overrides]
    evicted: dict[str, int] = {}
    real_evict = CountedHashZch.__dict__["evict"]

    def counted_evict(module: CountedHashZch) -> torch.Tensor | None:
        slots = real_evict(module)
        evicted[str(module._name)] = evicted.get(str(module._name), 0) + (0 if slots is None else slots.numel())
        return slots

    setattr(CountedHashZch, "evict", counted_evict)  # noqa: B010 - replaced for the run, as the clock does
    try:
        first = build(compose_run([*run, f"train.num_steps={CHECK_STEPS}"]))
        try:
            train(first.loop)
            saved = _mappings(first.loop.evaluator.model)
        finally:
            first.close()
        resumed = build(compose_run([*run, f"train.num_steps={2 * CHECK_STEPS}"]))
        try:
            restored = _mappings(resumed.loop.evaluator.model)
            metrics = train(resumed.loop)
            used = {t: int((m._hash_zch_identities != -1).sum()) for t, m in _hash_zch_tables(resumed.loop.evaluator.model)}
        finally:
            resumed.close()
    finally:
        setattr(CountedHashZch, "evict", real_evict)  # noqa: B010
    assert saved and saved.keys() == restored.keys(), f"hash_zch tables before/after the checkpoint: {sorted(saved)} / {sorted(restored)}"
    for table, (ids, stamps, step) in saved.items():
        got = restored[table]
        assert torch.equal(ids, got[0]) and torch.equal(stamps, got[1]), f"{table}: the restored mapping differs from the saved one"
        assert got[2] == step == CHECK_STEPS, f"{table}: lookup clock {got[2]} after the restore, {step} when saved (want {CHECK_STEPS})"
        assert int((ids != -1).sum()) > CHECK_SLOTS // 2, f"{table}: only {int((ids != -1).sum())} of {CHECK_SLOTS} slots hold an id"
    assert all(evicted.get(t, 0) > 0 for t in saved), f"no slot was evicted in some table: {evicted}"
    return {"tables": {t: {"slots_used": used[t], "slots_evicted": evicted.get(t, 0)} for t in saved},
            "restored_step": CHECK_STEPS, "eval": metrics}


def _hash_zch_tables(model: torch.nn.Module) -> list[tuple[str, CountedHashZch]]:
    return [(str(m._name), m) for m in model.modules() if isinstance(m, CountedHashZch)]


def _mappings(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """Each hash_zch table's ids, stamps (on the CPU) and lookup clock."""
    out = {}
    for table, m in _hash_zch_tables(model):
        stamps = m._hash_zch_metadata
        assert stamps is not None, f"{table}: no eviction metadata"
        out[table] = (m._hash_zch_identities.detach().cpu().clone(), stamps.detach().cpu().clone(), m._step)
    return out


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
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; --quick 1)")
    parser.add_argument("--module", choices=MODULES, default=None,
                        help="managed paths: auto (CUDA: hash_zch and mch; CPU: mch), mch, hash_zch or all "
                             "(also as the override data.managed_collision.module=...)")
    parser.add_argument("--check", action="store_true", help="instead of timing: the hash_zch smoke test (train, checkpoint, resume)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result to this file")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. distributed.device=cuda)")
    args = parser.parse_args(argv)
    key = "data.managed_collision.module="
    chosen = [o.removeprefix(key) for o in args.overrides if o.startswith(key)]
    overrides = [o for o in args.overrides if not o.startswith(key)]
    module = args.module or (chosen[-1] if chosen else "auto")
    if module not in MODULES:
        parser.error(f"{key}{module}: the module must be one of {list(MODULES)}")
    if args.check:
        with tempfile.TemporaryDirectory(prefix="hash_zch_check_") as directory:
            result = check_hash_zch(overrides, Path(directory))
        print(f"h_collision check: hash_zch trained, evicted, checkpointed and resumed: {json.dumps(result, default=float)}")
    else:
        result, row = bench_collision(overrides, args.quick, args.rounds, module)
        print(row)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=float))
    return result


if __name__ == "__main__":
    main()
