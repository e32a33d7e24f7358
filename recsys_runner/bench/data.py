"""The Parquet reader's rows/s, and training fed from Parquet vs from memory (standalone data benchmark).

``make bench`` (:mod:`recsys_runner.bench.regimes`) trains on the same kind of file in its ``b_parquet`` regime; this
module looks closer at the reader (rows/s alone, ``data.num_workers``), on a larger file.

Writes a Criteo-shaped Parquet file (:func:`recsys_runner.data.generated.generate.write_criteo_parquet` with ``learnable=False``:
label, 13 float dense, 26 int64 id columns with ~5% nulls, the schema stored as ``convert`` does) to a temporary
directory, then reports:

* reader rows/s: one process turning the file into shuffled TorchRec batches (median of rounds),
  and its ratio to the training samples/s (the target is >= 3);
* training samples/s of the runner's loop fed by ``data=parquet`` and fed the same batches from
  memory (:class:`~recsys_runner.data.memory.InMemoryData`), alternating rounds; the median of the
  per-round ratios (the target is >= 0.9).

Usage: ``python -m recsys_runner.bench.data [--rows 500000] [--batch-size 2048] [--steps 60] [--rounds 5] [overrides…]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from recsys_runner.bench.regimes import WINDOW, build_for_bench, on_device, runner_round, window_steps, with_data
from recsys_runner.data.files.tabular_config import TabularDataConfig
from recsys_runner.data.generated.generate import write_criteo_parquet
from recsys_runner.data.memory import InMemoryData


def reader_rows_per_s(data, epoch: int) -> float:
    start, rows = time.perf_counter(), 0
    for batch in data.train_batches(epoch, 0, 1):
        rows += batch.labels.shape[0]
    return rows / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--num-embeddings", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--steps", type=window_steps, default=60, help="training steps per round (windows of 10)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. data.num_workers=1)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "criteo.parquet")
        write_criteo_parquet(path, args.rows, num_embeddings=args.num_embeddings, learnable=False)
        overrides = ["model=deepfm", "optim=adagrad", "tracking=none", "data=parquet", f"data.path={path}",
                     f"data.batch_size={args.batch_size}", f"train.log_every_steps={WINDOW}", "train.eval_every_steps=null",
                     "train.eval_max_batches=1", *args.overrides]
        c = build_for_bench(overrides, args.steps)
        assert isinstance(c.run.data, TabularDataConfig)
        num_workers = c.run.data.num_workers
        try:
            parquet = c.loop.data
            reader = [reader_rows_per_s(parquet, r) for r in range(3)]
            print(f"reader: {args.rows:,} Criteo-shaped rows, batch {args.batch_size}: "
                  + "  ".join(f"{r:,.0f}" for r in reader) + " rows/s", flush=True)
            batches = on_device(list(parquet.train_batches(0, 0, 1))[: WINDOW * 2], c.env.device)
            memory = InMemoryData(parquet.features, batches, batches[:1])
            fed_parquet: list[float] = []
            fed_memory: list[float] = []
            for r in range(args.rounds):
                # Alternate which goes first so that neither always inherits a warm (or a hot) CPU.
                for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                    loop = with_data(c.loop, parquet if which == 0 else memory)
                    (fed_parquet if which == 0 else fed_memory).append(runner_round(loop, args.steps))
                print(f"round {r + 1}: from Parquet {fed_parquet[-1]:,.0f} samples/s   from memory {fed_memory[-1]:,.0f} samples/s", flush=True)
        finally:
            c.close()
    ratios = [p / m for p, m in zip(fed_parquet, fed_memory, strict=True)]
    train_rate = statistics.median(fed_parquet)
    read = statistics.median(reader)
    print()
    print(f"model=deepfm batch={args.batch_size} threads={torch.get_num_threads()} num_workers={num_workers}")
    print(f"reader alone             : {read:,.0f} rows/s  ({read / train_rate:.1f}x training samples/s; target >= 3)")
    print(f"training fed from memory : {statistics.median(fed_memory):,.0f} samples/s")
    print(f"training fed from Parquet: {train_rate:,.0f} samples/s")
    print(f"ratio Parquet / memory   : {statistics.median(ratios):.3f}  (median of per-round ratios, range "
          f"{min(ratios):.2f}-{max(ratios):.2f}; target >= 0.9)")


if __name__ == "__main__":
    main()
