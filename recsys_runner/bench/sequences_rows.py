"""``python -m recsys_runner.bench.sequences_rows``: SASRec on per-user rows against per-event rows of one log.

Issue 31's first speed bullet. One generated interaction log (``--users`` users, sequence lengths Zipf-distributed,
capped at ``--max-len``; each user walks the item ring in small steps, so the next item is learnable) is written as
rows by ``python -m recsys_runner.data sequences --split leave-two-out --max-len <max_len>`` twice: ``--rows per-user``
and ``--rows per-event``. ``model=sasrec`` trains through the runner on each (``data=parquet``, the same batch size,
valid rows as eval) and the bench reports, per kind of rows:

* ``tokens_per_epoch``: the history tokens an epoch reads, ``Σ (history length + 1)`` over the training rows;
* ``s_per_epoch``: wall time of one epoch of training. Per-user epochs are timed whole (``--epochs`` of them, the
  build and the final eval included: this overstates a per-user epoch, so the ratio below is conservative);
  per-event epochs are estimated (``estimated: true``) from the difference between runs of ``k`` and ``2k`` steps
  (``k = --event-steps``: the build and eval cancel), scaled to the epoch's steps, since one takes minutes to hours
  on 2 cores; ``--event-steps 0`` times a whole epoch;
* ``valid_hr_at_10``: hr@10 (exclude-seen) on ``valid.parquet`` after that training.

The ratio ``per_event.s_per_epoch / per_user.s_per_epoch`` is the speed-up (target ≥ 20x). Results go to
``bench_results/sequences_rows.json``; ``--quick`` runs a small log for tests. Trailing overrides go to both trainings
(``model.block=hstu``: SASRec with HSTU blocks, which attend on the jagged rows instead of the batch's padded block).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys_runner.bench.regimes import compose_run
from recsys_runner.build import build
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.train.loop import train

__all__ = ["interaction_log", "main", "tokens_per_epoch"]


def interaction_log(num_users: int, max_len: int, num_items: int = 2000, seed: int = 0) -> pa.Table:
    """A log of ``user, item, timestamp`` whose per-user lengths follow a Zipf law (``a = 1.5``, shifted so every user
    has at least 3 events, capped at ``max_len + 2``); each user starts at a random item and steps 1-3 items on."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.zipf(1.5, num_users) + 2, max_len + 2)
    users = np.repeat(np.arange(num_users), lengths)
    starts = np.repeat(rng.integers(0, num_items, num_users), lengths)
    steps = rng.integers(1, 4, int(lengths.sum()))
    first = np.cumsum(lengths) - lengths  # each user's first event
    offsets = np.repeat(first, lengths)
    walk = np.cumsum(steps)
    items = (starts + walk - np.repeat(walk[first], lengths)) % num_items  # the walk restarts at each user
    times = 1_000_000_000 + (np.arange(len(users)) - offsets) * 3600 + rng.integers(0, 600, len(users))
    return pa.table({"user": users, "item": items, "timestamp": times})


def tokens_per_epoch(path: Path) -> tuple[int, int]:
    """``(rows, Σ (history length + 1))`` of a rows file: what a next-item model reads in one epoch."""
    hist = pq.read_table(path, columns=["hist_item_id"]).column("hist_item_id")
    lengths = pa.compute.list_value_length(hist).to_numpy(zero_copy_only=False)
    return len(lengths), int(lengths.sum()) + len(lengths)


def _train(rows: Path, batch_size: int, length: str, extra: list[str]) -> tuple[float, float]:
    """Train sasrec on ``rows`` (``length``: ``train.num_epochs=…`` or ``train.num_steps=…``; ``extra``: more overrides,
    e.g. ``model.block=hstu``): ``(seconds, valid hr@10)``."""
    overrides = ["model=sasrec", "data=parquet", f"data.path={rows / 'train.parquet'}", f"data.eval_path={rows / 'valid.parquet'}",
                 f"data.batch_size={batch_size}", "data.num_workers=0", "metrics.exclude_seen=true", "model.eval_metrics=[hr@10]",
                 "train.log_every_steps=1000", "checkpoint=none", "tracking=none",
                 "distributed.device=cpu", length, *extra]
    start = time.perf_counter()
    c = build(compose_run(overrides))
    try:
        final = train(c.loop)
    finally:
        c.close()
    return time.perf_counter() - start, final["eval/hr_at_10"]


def measure(num_users: int, max_len: int, epochs: int, event_steps: int, batch_size: int, workdir: Path,
            extra: list[str] | None = None) -> dict[str, Any]:
    """Write the log's rows both ways and train on each; see the module docstring for what is reported."""
    log = workdir / "log.parquet"
    pq.write_table(interaction_log(num_users, max_len), log)
    result: dict[str, Any] = {"users": num_users, "max_len": max_len, "events": pq.read_metadata(log).num_rows,
                              "batch_size": batch_size, "overrides": list(extra or [])}
    for kind in ("per-user", "per-event"):
        out = workdir / kind
        assert data_main(["sequences", str(log), str(out), "--user", "user", "--item", "item", "--time", "timestamp",
                          "--max-len", str(max_len), "--rows", kind, "--split", "leave-two-out"]) == 0
        rows, tokens = tokens_per_epoch(out / "train.parquet")
        steps_per_epoch = -(-rows // batch_size)
        if kind == "per-user" or event_steps == 0:
            n = epochs if kind == "per-user" else 1
            seconds, hr = _train(out, batch_size, f"train.num_epochs={n}", extra or [])
            per_epoch, estimated = seconds / n, False
        else:  # k and 2k steps: their difference is k steps without the build and the final eval
            k = max(1, min(event_steps, steps_per_epoch // 2))
            short, _ = _train(out, batch_size, f"train.num_steps={k}", extra or [])
            seconds, hr = _train(out, batch_size, f"train.num_steps={2 * k}", extra or [])
            per_epoch, estimated = max(seconds - short, 1e-9) / k * steps_per_epoch, True
        result[kind.replace("-", "_")] = {"rows": rows, "tokens_per_epoch": tokens, "steps_per_epoch": steps_per_epoch,
                                          "s_per_epoch": round(per_epoch, 2), "estimated": estimated,
                                          "trained_s": round(seconds, 2), "valid_hr_at_10": round(hr, 4)}
    user, event = result["per_user"], result["per_event"]
    result["tokens_ratio"] = round(event["tokens_per_epoch"] / user["tokens_per_epoch"], 1)
    result["time_ratio"] = round(event["s_per_epoch"] / user["s_per_epoch"], 1)
    result["target_time_ratio"] = 20.0
    return result


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, measure, print and write ``bench_results/sequences_rows.json``."""
    p = argparse.ArgumentParser(prog="python -m recsys_runner.bench.sequences_rows", description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=10_000)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--epochs", type=int, default=3, help="per-user epochs to train (and time)")
    p.add_argument("--event-steps", type=int, default=50, help="per-event steps timed (0: a whole epoch)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="a small log, one epoch, a few per-event steps (tests)")
    p.add_argument("--out", default="bench_results/sequences_rows.json")
    p.add_argument("overrides", nargs="*", help="more overrides for both trainings (e.g. model.block=hstu: jagged HSTU blocks)")
    a = p.parse_args(argv)
    if a.quick:
        a.users, a.max_len, a.epochs, a.event_steps, a.batch_size = 200, 50, 1, 5, 32
    with tempfile.TemporaryDirectory(prefix="bench-sequences-rows-") as tmp:
        result = measure(a.users, a.max_len, a.epochs, a.event_steps, a.batch_size, Path(tmp), a.overrides)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
