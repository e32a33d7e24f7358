"""What stored encoders and the transforms cost the Parquet reader: ``python -m recsys_runner.bench.encoding [--quick] [flags]``.

One Criteo-shaped Parquet file (:func:`recsys_runner.data.generated.generate.write_criteo_parquet`, ``learnable=False``: label,
13 float dense, 26 int64 id columns with ~5% nulls) is read into shuffled TorchRec batches by one process
(:func:`recsys_runner.bench.data.reader_rows_per_s`: ``data=parquet``'s ``train_batches``, a whole pass), the same file
under each schema (:data:`VARIANTS`):

* ``plain`` — the schema ``convert`` stored in the file: dense as they are, ids already in their tables (``encoding: id``);
* ``vocab`` — every id column with ``encoding: vocab``: its vocabulary (fitted on ``data.infer.sample_rows`` rows when
  the module is built, as when training starts, and what a checkpoint's ``encoders.json`` stores) and OOV rows;
* ``transforms`` — the dense columns ``int_0…int_6`` with ``clip`` and ``normalize: zscore`` (mean and std fitted), and
  ``int_7…int_12`` bucketized into ids by ``quantiles`` (boundaries fitted), ids as in ``plain``;
* ``vocab_transforms`` — both.

Every variant reads the same 40 columns into batches of the same size; the variants alternate within a round (the order
flipped every round), and a variant's ratio is the median of its per-round ratios to ``plain``. Target: ``>= 0.95`` for
``vocab_transforms`` (issue 29). Writes ``bench_results/encoding.json``; docs/performance.md quotes the numbers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from recsys_runner.bench import write_results
from recsys_runner.bench.data import reader_rows_per_s
from recsys_runner.bench.regimes import compose_run
from recsys_runner.data.files.criteo_config import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE
from recsys_runner.data.generated.generate import write_criteo_parquet

TARGET = 0.95
ZSCORED = range(7)
"""Dense columns clipped and z-scored in the ``transforms`` variants; the others (7…12) are bucketized by quantiles."""
CLIP, QUANTILES = (0.0, 5.0), 10


def variants() -> dict[str, list[str]]:
    """Each variant's ``data.*`` overrides (module docstring); ``plain`` reads the schema stored in the file."""
    plain_dense = [f"{{name: int_{i}}}" for i in range(CRITEO_NUM_DENSE)]
    scaled = [f"{{name: int_{i}, clip: [{CLIP[0]}, {CLIP[1]}], normalize: zscore}}" for i in ZSCORED]
    buckets = [f"{{name: int_{i}, quantiles: {QUANTILES}}}" for i in range(CRITEO_NUM_DENSE) if i not in ZSCORED]
    ids = [f"{{name: cat_{i}, num_embeddings: {{n}}, encoding: id}}" for i in range(CRITEO_NUM_SPARSE)]
    vocab = [f"{{name: cat_{i}, encoding: vocab}}" for i in range(CRITEO_NUM_SPARSE)]

    def schema(dense: list[str], sparse: list[str]) -> list[str]:
        return ["data.label=label", f"data.dense=[{', '.join(dense)}]", f"data.sparse=[{', '.join(sparse)}]"]

    return {"plain": [], "vocab": schema(plain_dense, vocab), "transforms": schema(scaled, [*ids, *buckets]),
            "vocab_transforms": schema(scaled, [*vocab, *buckets])}


def bench_encoding(rows: int, num_embeddings: int, batch_size: int, rounds: int, overrides: list[str]) -> dict[str, Any]:
    """Rows/s of every variant per round, their medians and ratios to ``plain``."""
    tmp = tempfile.mkdtemp(prefix="bench-encoding-")
    try:
        path = os.path.join(tmp, "criteo.parquet")
        write_criteo_parquet(path, rows, num_embeddings=num_embeddings, learnable=False)
        common = ["data=parquet", f"data.path={path}", f"data.batch_size={batch_size}", "data.num_workers=0", "model=deepfm",
                  "tracking=none", "distributed.device=cpu", *overrides]
        modules, built_s = {}, {}
        for name, extra in variants().items():
            start = time.perf_counter()
            extra = [e.replace("{n}", str(num_embeddings)) for e in extra]
            modules[name] = compose_run([*common, *extra]).data.build(device=torch.device("cpu"))  # fits what it needs
            built_s[name] = time.perf_counter() - start
        for module in modules.values():  # untimed: the file's pages into the OS cache, the first batches' allocations
            next(iter(module.train_batches(0, 0, 1)))
        figures: dict[str, list[float]] = {name: [] for name in modules}
        for r in range(rounds):
            names = list(modules) if r % 2 == 0 else list(reversed(modules))
            for name in names:
                figures[name].append(reader_rows_per_s(modules[name], r))
            print(f"round {r + 1}: " + "   ".join(f"{n} {figures[n][-1]:,.0f}" for n in modules) + " rows/s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out: dict[str, Any] = {}
    for name, rates in figures.items():
        ratios = [v / p for v, p in zip(rates, figures["plain"], strict=True)]
        out[name] = {"rows_per_s": statistics.median(rates), "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                     "ratio_max": max(ratios), "rounds": rates, "build_s": built_s[name]}
    out["vocab_transforms"]["target"] = TARGET
    out["vocab_transforms"]["met"] = out["vocab_transforms"]["ratio"] >= TARGET
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=None, help="rows of the Parquet file (default 300,000; --quick 20,000)")
    parser.add_argument("--num-embeddings", type=int, default=100_000, help="id space of every categorical column")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds, a pass over the file each (default 5; --quick 1)")
    parser.add_argument("--json", default="bench_results/encoding.json", help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="a small file and one round: checks that it runs, not how fast")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. data.infer.sample_rows=50000)")
    args = parser.parse_args(argv)
    rows = args.rows or (20_000 if args.quick else 300_000)
    rounds = args.rounds or (1 if args.quick else 5)
    variants_out = bench_encoding(rows, args.num_embeddings, args.batch_size, rounds, args.overrides)
    result = {"device": "cpu", "threads": torch.get_num_threads(), "rows": rows, "num_embeddings": args.num_embeddings,
              "batch_size": args.batch_size, "rounds": rounds, "target": TARGET, "variants": variants_out}
    print(f"\nParquet -> batches, {rows:,} Criteo-shaped rows, batch {args.batch_size}, one process (data.num_workers=0)")
    for name, v in variants_out.items():
        target = f"  target >= {TARGET} ({'met' if v['met'] else 'NOT met'})" if "target" in v else ""
        print(f"{name:<17} {v['rows_per_s']:>12,.0f} rows/s  {v['ratio']:.3f}x plain (range {v['ratio_min']:.2f}-{v['ratio_max']:.2f}){target}")
    write_results(args.json, result)
    return result


if __name__ == "__main__":
    main()
