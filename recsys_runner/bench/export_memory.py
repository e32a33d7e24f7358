"""What ``python -m recsys_runner.export`` holds in memory at its peak, against the bytes of the tables it exports, as
trained (``export.quantize=none``) and quantized (``int8``, ``int4``, ``fp16``):
``python -m recsys_runner.bench.export_memory [--rows 250000] [--quick] [--json PATH]``.

DLRM (width 64) is trained for 2 steps on a generated CSV whose 8 id columns are hashed into tables of ``--rows`` rows
(8 × 250,000 × 64 float32 = 512 MB by default: the tables are most of what an export holds, as in production), and once
more with tables of :data:`SMALL_ROWS` rows. Each export runs as a user runs it, in a process of its own (MLflow model
included: the CSV's encoders are stored with the checkpoint), and its peak resident set is that process's ``ru_maxrss``
(:func:`os.wait4`). The small-table export's peak is what the command holds besides its tables (Python, torch, TorchRec,
MLflow, the data, tracing); a kind's peak less that, over the float32 tables' bytes, is the ``ratio``: how many
float-table sizes the export needs (docs/export.md, "Memory"). Not timed: memory only.

Writes ``bench_results/export_memory.json`` (``--json``); docs/export.md and docs/performance.md quote the numbers.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from recsys_runner.bench import write_results

KINDS = ("none", "int8", "int4", "fp16")
TABLES = 8
WIDTH = 64
SMALL_ROWS = 1_000
"""The tables of the export whose peak is the command's own memory: 8 × 1,000 × 64 float32, 2 MB."""
CSV_ROWS = 4_096
MB = 1024 ** 2


def write_csv(path: Path, rows: int, seed: int = 0) -> None:
    """``click`` and two numbers and :data:`TABLES` id columns ``a``, ``b``, … of random 9-digit ids (hashed into the
    tables: every table is its full size whatever the rows)."""
    rng = np.random.default_rng(seed)
    names = [chr(ord("a") + i) for i in range(TABLES)]
    ids = rng.integers(0, 10 ** 9, size=(rows, TABLES))
    with open(path, "w") as f:
        f.write(",".join(["click", *names, "price", "age"]) + "\n")
        for row, click, price, age in zip(ids, rng.integers(0, 2, rows), rng.random(rows) * 10, rng.integers(0, 80, rows), strict=True):
            f.write(",".join([str(click), *map(str, row), f"{price:.3f}", str(age)]) + "\n")


def overrides(csv: Path, rows: int) -> list[str]:
    """DLRM on ``csv`` with :data:`TABLES` hashed tables of ``rows`` rows × :data:`WIDTH`, on the CPU, nothing logged."""
    sparse = ", ".join(f"{{name: {chr(ord('a') + i)}, num_embeddings: {rows}, encoding: hash}}" for i in range(TABLES))
    return ["model=dlrm", f"model.embedding_dim={WIDTH}", "data=csv", f"data.path={csv}", "data.label=click",
            f"data.sparse=[{sparse}]", "data.dense=[{name: price}, {name: age}]", "data.batch_size=256", "distributed.device=cpu",
            "tracking=none"]


def peak_mb(module: str, args: list[str], cwd: Path) -> float:
    """``python -m <module> <args>`` in ``cwd`` as its own process; its peak resident set in MB (``ru_maxrss``).

    Raises:
        RuntimeError: the command failed, with the end of its output.
    """
    log_path = cwd / f"{module}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m {module} failed ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
    return usage.ru_maxrss / 1024  # KB on Linux


def trained(root: Path, csv: Path, rows: int) -> Path:
    """A checkpoint of DLRM with tables of ``rows`` rows, trained 2 steps."""
    folder = root / f"rows_{rows}"
    folder.mkdir()
    peak_mb("recsys_runner", [*overrides(csv, rows), "train.num_steps=2", "train.eval_max_batches=1",
                              f"checkpoint.dir={folder}/ck"], folder)
    return folder / "ck" / "step_00000002"


def exported(checkpoint: Path, csv: Path, rows: int, kind: str) -> tuple[float, int]:
    """The peak MB of exporting ``checkpoint`` in ``kind``, and the bytes of its ``model.pt2``."""
    folder = checkpoint.parent.parent / f"export_{kind}"
    folder.mkdir()
    peak = peak_mb("recsys_runner.export", [*overrides(csv, rows), f"load={checkpoint}", f"export.dir={folder}/out",
                                            f"export.quantize={kind}"], folder)
    return peak, (folder / "out" / "model.pt2").stat().st_size


def bench_export_memory(rows: int, kinds: tuple[str, ...]) -> dict[str, Any]:
    """The figures of the module docstring."""
    float_bytes = TABLES * rows * WIDTH * 4
    with tempfile.TemporaryDirectory(prefix="bench-export-memory-") as tmp:
        root = Path(tmp)
        csv = root / "train.csv"
        write_csv(csv, CSV_ROWS)
        small = trained(root, csv, SMALL_ROWS)
        base_mb, _ = exported(small, csv, SMALL_ROWS, "none")
        large = trained(root, csv, rows)
        result: dict[str, Any] = {"model": "DLRM", "tables": TABLES, "rows_per_table": rows, "width": WIDTH,
                                  "float_table_mb": float_bytes / MB, "small_table_export_peak_mb": base_mb, "kinds": {}}
        for kind in kinds:
            peak, program = exported(large, csv, rows, kind)
            result["kinds"][kind] = {"peak_mb": peak, "above_small_mb": peak - base_mb, "model_pt2_mb": program / MB,
                                     "ratio": (peak - base_mb) * MB / float_bytes}
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"export peak memory: DLRM, {result['tables']} tables x {result['rows_per_table']:,} rows x {result['width']} "
          f"(float32 tables {result['float_table_mb']:.0f} MB); the same export with {SMALL_ROWS:,}-row tables peaks at "
          f"{result['small_table_export_peak_mb']:.0f} MB")
    print(f"{'export.quantize':<16}{'peak MB':>10}{'above small MB':>16}{'x float tables':>16}{'model.pt2 MB':>14}")
    for kind, r in result["kinds"].items():
        print(f"{kind:<16}{r['peak_mb']:>10.0f}{r['above_small_mb']:>16.0f}{r['ratio']:>16.2f}{r['model_pt2_mb']:>14.1f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=None, help="rows of each of the 8 tables (default 250,000; --quick 20,000)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"export.quantize values, comma-separated (default {','.join(KINDS)})")
    parser.add_argument("--json", default="bench_results/export_memory.json", help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="small tables: checks that it runs, not what it holds")
    args = parser.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"--kinds: {unknown} are not export.quantize values; choose from {list(KINDS)}")
    result = bench_export_memory(args.rows or (20_000 if args.quick else 250_000), kinds)
    print_table(result)
    write_results(args.json, result)
    return result


if __name__ == "__main__":
    main()
