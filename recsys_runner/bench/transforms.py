"""Which transform of Criteo's 13 integer columns trains best: ``python -m recsys_runner.bench.transforms [--quick] [flags]``.

DeepFM with the Criteo preset's model settings (``experiment=criteo_tsv``: embedding_dim 8, a 128-64 deep head, Adagrad
lr 0.02, one epoch) is trained on generated Criteo-format rows (:func:`recsys_runner.data.generated.generate.write_criteo_csv`, a
fixed seed; the click depends on the categoricals and on ``log1p`` of the counts) and evaluated on rows of another seed,
once per variant of the integer columns ``int_0…int_12`` (:data:`VARIANTS`), the 26 hex categoricals as the preset
reads them (hex → integer, tables sized from the file):

* ``raw`` — the counts as numbers, no transform (missing → 0, negatives kept);
* ``log1p`` — negatives clamped to 0, ``log(1 + x)``: ``data=criteo``'s default (``dense_transform: log1p``);
* ``log1p_zscore`` — then ``normalize: zscore`` (mean and std fitted on the sample of the training file);
* ``quantiles`` — each bucketized into ids by its fitted ``quantiles`` (``--quantiles``, repeats dropped) and embedded as
  a sparse feature (no dense input left).

Each variant is trained with ``--seeds`` model seeds (the data stay the same); the table gives eval AUC and log loss,
their mean over the seeds and the difference to ``log1p``. Writes ``bench_results/transforms.json``; docs/performance.md
and docs/data.md (Criteo) quote the numbers.
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
from recsys_runner.bench.regimes import compose_run
from recsys_runner.build import build
from recsys_runner.data.files.criteo_config import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE
from recsys_runner.data.generated.generate import write_criteo_csv
from recsys_runner.train.loop import train

PRESET = ["model=deepfm", "model.embedding_dim=8", "model.deep_layer_sizes=[128,64]", "optim=adagrad", "optim.lr=0.02",
          "scheduler=constant", "train.num_steps=null", "train.num_epochs=1", "train.eval_every_steps=null",
          "tracking=none", "checkpoint=none", "distributed.device=cpu", "train.progress=log"]
"""``experiment=criteo_tsv``'s model, optimizer and length; nothing logged or saved."""


def variants(quantiles: int) -> dict[str, list[str]]:
    """Each variant's ``data.dense`` / ``data.sparse`` (module docstring)."""
    ids = [f"{{name: cat_{i}, hex: true}}" for i in range(CRITEO_NUM_SPARSE)]

    def dense(fields: str) -> list[str]:
        return [f"data.dense=[{', '.join(f'{{name: int_{i}{fields}}}' for i in range(CRITEO_NUM_DENSE))}]", f"data.sparse=[{', '.join(ids)}]"]

    buckets = [f"{{name: int_{i}, quantiles: {quantiles}}}" for i in range(CRITEO_NUM_DENSE)]
    return {"raw": dense(""), "log1p": dense(", transform: log1p"), "log1p_zscore": dense(", transform: log1p, normalize: zscore"),
            "quantiles": ["data.dense=[]", f"data.sparse=[{', '.join([*ids, *buckets])}]"]}


def train_eval(overrides: list[str]) -> dict[str, float]:
    """One run's final eval metrics."""
    c = build(compose_run(overrides))
    try:
        return train(c.loop)
    finally:
        c.close()


def bench_transforms(train_rows: int, eval_rows: int, batch_size: int, seeds: int, quantiles: int,
                     overrides: list[str]) -> dict[str, Any]:
    """Per variant: eval AUC and log loss per seed, their means and the difference to ``log1p``."""
    tmp = tempfile.mkdtemp(prefix="bench-transforms-")
    runs: dict[str, list[dict[str, float]]] = {}
    try:
        train_file, eval_file = os.path.join(tmp, "train.csv"), os.path.join(tmp, "eval.csv")
        write_criteo_csv(train_file, train_rows, seed=0)
        write_criteo_csv(eval_file, eval_rows, seed=1)
        data = ["data=csv", f"data.path={train_file}", f"data.eval_path={eval_file}", "data.label=label",
                f"data.batch_size={batch_size}"]
        for seed in range(seeds):
            for name, columns in variants(quantiles).items():
                start = time.perf_counter()
                final = train_eval([*PRESET, *data, *columns, f"seed={seed}", *overrides])
                runs.setdefault(name, []).append({"auc": final["eval/auc"], "logloss": final["eval/logloss"],
                                                  "seconds": time.perf_counter() - start})
                print(f"seed {seed} {name:<13} eval AUC {final['eval/auc']:.4f}  log loss {final['eval/logloss']:.4f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out: dict[str, Any] = {}
    for name, per_seed in runs.items():
        out[name] = {"auc": statistics.mean(r["auc"] for r in per_seed), "logloss": statistics.mean(r["logloss"] for r in per_seed),
                     "auc_per_seed": [r["auc"] for r in per_seed], "logloss_per_seed": [r["logloss"] for r in per_seed],
                     "seconds": sum(r["seconds"] for r in per_seed)}
    for v in out.values():
        v["auc_vs_log1p"] = v["auc"] - out["log1p"]["auc"]
        v["logloss_vs_log1p"] = v["logloss"] - out["log1p"]["logloss"]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-rows", type=int, default=None, help="training rows (default 40,000; --quick 2,000)")
    parser.add_argument("--eval-rows", type=int, default=None, help="eval rows, another seed (default 20,000; --quick 1,000)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=None, help="model seeds per variant (default 2; --quick 1)")
    parser.add_argument("--quantiles", type=int, default=16, help="buckets of the quantiles variant (before repeats are dropped)")
    parser.add_argument("--json", default="bench_results/transforms.json", help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="tiny files, one seed: checks that it runs, not what wins")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every run (e.g. model.embedding_dim=16)")
    args = parser.parse_args(argv)
    train_rows = args.train_rows or (2_000 if args.quick else 40_000)
    eval_rows = args.eval_rows or (1_000 if args.quick else 20_000)
    seeds = args.seeds or (1 if args.quick else 2)
    out = bench_transforms(train_rows, eval_rows, args.batch_size, seeds, args.quantiles, args.overrides)
    best = max(out, key=lambda n: out[n]["auc"])
    result = {"device": "cpu", "threads": torch.get_num_threads(), "train_rows": train_rows, "eval_rows": eval_rows,
              "batch_size": args.batch_size, "seeds": seeds, "quantiles": args.quantiles, "variants": out, "best_auc": best}
    print(f"\nDeepFM on generated Criteo rows: {train_rows:,} training, {eval_rows:,} eval, one epoch, batch {args.batch_size}, "
          f"mean of {seeds} seed(s)")
    print(f"{'int_* columns':<15} {'eval AUC':>9} {'vs log1p':>9} {'log loss':>9} {'vs log1p':>9}")
    for name, v in out.items():
        print(f"{name:<15} {v['auc']:9.4f} {v['auc_vs_log1p']:+9.4f} {v['logloss']:9.4f} {v['logloss_vs_log1p']:+9.4f}")
    print(f"best eval AUC: {best}")
    write_results(args.json, result)
    return result


if __name__ == "__main__":
    main()
