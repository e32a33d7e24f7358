"""``python -m recsys_runner.bench.gpu --out DIR``: every GPU measurement of docs/performance.md, in one call.

A lent GPU comes with minutes, not hours, so the measurements run as one prepared list, most wanted first, each in its
own process with its own time limit (a crash or a hang in one costs only its own slot), until a deadline that leaves
time to copy the results back. Each writes its log and JSON into ``DIR``; ``DIR/summary.json`` says what ran, how it
ended and on which stack (GPU, driver, torch, fbgemm-gpu, torchrec).

``--list`` prints the commands without running them; ``--only a,b`` runs some; ``--quick`` runs each with tiny settings
(does the list run on this stack?), ``--parallel`` all at once (a smoke run: its timings mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Measurement:
    """One process of the list: ``python -m <module> <args>``, stopped after ``limit_s`` seconds."""

    name: str
    module: str
    args: tuple[str, ...]
    limit_s: int
    quick_args: tuple[str, ...] = ()
    """What replaces ``args``' sizes with ``--quick`` (a CPU run of the plumbing)."""

    def argv(self, out: Path, device: str, quick: bool) -> list[str]:
        args = [a.format(out=out) for a in (self.quick_args if quick and self.quick_args else self.args)]
        return [sys.executable, "-m", self.module, *args, f"distributed.device={device}"]


MEASUREMENTS = (
    # The regimes first: since the third lease, data.num_workers=auto starts 12 workers on the H200's 16 CPUs and every batch
    # carries its per-key lengths (data/base.py batch_kjt), neither measured in the regimes yet (docs/performance.md, 7.)
    Measurement("regimes_4096", "recsys_runner.bench.regimes",
                ("--batch-size", "4096", "--steps", "200", "--rounds", "3", "--parquet-rows", "2000000", "--startup-runs", "1",
                 "--json", "{out}/regimes_4096.json"), 200,
                ("--quick", "--skip", "d", "--json", "{out}/regimes_4096.json")),
    Measurement("regimes_65536", "recsys_runner.bench.regimes",
                ("--batch-size", "65536", "--steps", "60", "--rounds", "3", "--parquet-rows", "2000000", "--skip", "c",
                 "--skip", "d", "--json", "{out}/regimes_65536.json"), 150,
                ("--quick", "--skip", "c", "--skip", "d", "--json", "{out}/regimes_65536.json")),
    # The input path alone and end to end against memory over the worker counts around auto's, pinned (the CUDA default);
    # at 65536 three batches per worker are timed, so that batches made while the first was awaited do not inflate it
    Measurement("input_path_4096", "recsys_runner.bench.input_path",
                ("--batch-sizes", "4096", "--workers", "0,2,4,8,12", "--pin", "on", "--rounds", "2", "--train", "--steps", "100",
                 "--json", "{out}/input_path_4096.json"), 150,
                ("--batch-sizes", "128", "--workers", "0,2", "--batches", "3", "--rounds", "1", "--train", "--steps", "20",
                 "--json", "{out}/input_path_4096.json")),
    Measurement("input_path_65536", "recsys_runner.bench.input_path",
                ("--batch-sizes", "65536", "--workers", "8,12", "--pin", "on", "--batches", "36", "--rounds", "2", "--train", "--steps", "40",
                 "--json", "{out}/input_path_65536.json"), 120,
                ("--batch-sizes", "256", "--workers", "0,2", "--batches", "3", "--rounds", "1", "--json", "{out}/input_path_65536.json")),
    Measurement("hstu_kernels", "recsys_runner.bench.hstu_kernels", ("--json", "{out}/hstu_kernels.json"), 90,
                ("--quick", "--json", "{out}/hstu_kernels.json")),
    Measurement("step_options_deepfm", "recsys_runner.bench.step_options",
                ("--batch-size", "16384", "--rounds", "3", "--steps", "100", "--exact-steps", "200", "--syncs",
                 "--json", "{out}/step_options_deepfm.json"), 200,
                ("--batch-size", "128", "--rounds", "1", "--steps", "20", "--exact-steps", "20",
                 "--variants", "base,no_train_metrics", "--json", "{out}/step_options_deepfm.json")),
    Measurement("breakdown_deepfm", "recsys_runner.bench.breakdown",
                ("--run", "--json", "{out}/breakdown_deepfm.json", "model=deepfm", "data.batch_size=16384"), 70,
                ("--run", "--json", "{out}/breakdown_deepfm.json", "model=deepfm", "data.batch_size=128")),
    Measurement("breakdown_dlrm", "recsys_runner.bench.breakdown",
                ("--run", "--json", "{out}/breakdown_dlrm.json", "model=dlrm", "data.batch_size=16384"), 70,
                ("--run", "--json", "{out}/breakdown_dlrm.json", "model=dlrm", "data.batch_size=128")),
    Measurement("caching", "recsys_runner.bench.caching",
                ("--num-embeddings", "1000000", "--json", "{out}/caching.json"), 150,
                ("--quick", "--json", "{out}/caching.json")),
    Measurement("collision_hash_zch", "recsys_runner.bench.collision",
                ("--rounds", "3", "--module", "hash_zch", "--json", "{out}/collision_hash_zch.json"), 120,
                ("--quick", "--module", "hash_zch", "--json", "{out}/collision_hash_zch.json")),
    Measurement("collision_check", "recsys_runner.bench.collision", ("--check",), 90, ("--check",)),
    Measurement("sequences", "recsys_runner.bench",
                ("--skip", "ab", "--skip", "c", "--skip", "d", "--rounds", "2", "--json", "{out}/sequences.json"), 150,
                ("--quick", "--skip", "ab", "--skip", "c", "--skip", "d", "--json", "{out}/sequences.json")),
)
"""The list, most wanted first (a deadline cuts from the end). More are appended by the modules that own them."""


def stack() -> dict[str, Any]:
    """The versions a figure was taken on."""
    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for name in ("fbgemm_gpu", "torchrec"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "?")
        except Exception as e:  # reported, not fatal: the figures say what they were taken on
            info[name] = f"import failed: {e}"
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    return info


def run_all(measurements: tuple[Measurement, ...], out: Path, device: str, quick: bool, deadline_s: float) -> list[dict[str, Any]]:
    """Run ``measurements`` in order until ``deadline_s`` seconds have passed; each one's record (rc, seconds, log)."""
    started = time.monotonic()
    records: list[dict[str, Any]] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for m in measurements:
        left = deadline_s - (time.monotonic() - started)
        if left < 20:
            records.append({"name": m.name, "skipped": f"deadline: {left:.0f} s left"})
            continue
        argv = m.argv(out, device, quick)
        limit = min(m.limit_s, int(left))
        print(f"== {m.name} (limit {limit} s): {' '.join(argv[1:])}", flush=True)
        t0 = time.monotonic()
        with open(out / f"{m.name}.log", "w") as log:
            try:
                rc: int | str = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                rc = f"timed out after {limit} s"
        seconds = time.monotonic() - t0
        records.append({"name": m.name, "rc": rc, "seconds": round(seconds, 1), "argv": argv[1:]})
        tail = (out / f"{m.name}.log").read_text(errors="replace").splitlines()[-25:]
        print(f"== {m.name}: rc={rc} in {seconds:.0f} s\n" + "\n".join(tail), flush=True)
    return records


def run_parallel(measurements: tuple[Measurement, ...], out: Path, device: str, quick: bool, limit_s: float) -> list[dict[str, Any]]:
    """Start every measurement at once and wait for all (``--parallel``: a smoke run of the list, whose timings mean
    nothing, in the time of the slowest instead of the sum)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    running = []
    for m in measurements:
        log = open(out / f"{m.name}.log", "w")  # noqa: SIM115 - closed below, once the process ends
        running.append((m, log, subprocess.Popen(m.argv(out, device, quick), stdout=log, stderr=subprocess.STDOUT, env=env)))
    records: list[dict[str, Any]] = []
    for m, log, proc in running:
        try:
            rc: int | str = proc.wait(timeout=max(1.0, limit_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = f"timed out after {limit_s:.0f} s"
        log.close()
        records.append({"name": m.name, "rc": rc, "seconds": round(time.monotonic() - t0, 1)})
        tail = (out / f"{m.name}.log").read_text(errors="replace").splitlines()[-15:]
        print(f"== {m.name}: rc={rc}\n" + "\n".join(tail), flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the logs, JSON and summary.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="start nothing after this many seconds")
    parser.add_argument("--only", default=None, help="comma-separated names (default: all, in order)")
    parser.add_argument("--quick", action="store_true", help="tiny settings: checks the list runs, not how fast")
    parser.add_argument("--list", action="store_true", help="print the commands and exit")
    parser.add_argument("--parallel", action="store_true", help="run all at once (a smoke run: timings mean nothing)")
    parser.add_argument("--passed", type=Path, default=None,
                        help="a smoke run's summary.json: run only what ran to the end there (a failure costs no slot twice)")
    args = parser.parse_args(argv)
    chosen = MEASUREMENTS if args.only is None else tuple(m for m in MEASUREMENTS if m.name in args.only.split(","))
    if args.passed is not None:
        smoke = json.loads(args.passed.read_text())["measurements"]
        ok = {r["name"] for r in smoke if r.get("rc") == 0}
        print(f"skipped, failed in {args.passed}: {[m.name for m in chosen if m.name not in ok]}", flush=True)
        chosen = tuple(m for m in chosen if m.name in ok)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.list:
        for m in chosen:
            print(m.name, " ".join(m.argv(args.out, args.device, args.quick)[1:]))
        return 0
    summary: dict[str, Any] = {"stack": stack(), "device": args.device, "quick": args.quick}
    if args.parallel:
        summary["measurements"] = run_parallel(chosen, args.out, args.device, args.quick, args.deadline_s)
    else:
        summary["measurements"] = run_all(chosen, args.out, args.device, args.quick, args.deadline_s)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    failed = [r["name"] for r in summary["measurements"] if r.get("rc") != 0]
    print(f"summary: {len(chosen) - len(failed)} of {len(chosen)} ran to the end" + (f"; not: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
