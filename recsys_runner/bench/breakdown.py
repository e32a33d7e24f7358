"""Where a training step's time goes, from a torch.profiler trace: kernel time against step time, by category.

Two ways in:

* ``python -m recsys_runner.bench.breakdown TRACE.json [--steps N] [--json out.json]`` reads a Chrome trace (e.g. the
  ``profile/trace_rank0.json`` artifact of a run with ``debug=profile``) and prints the table;
* ``python -m recsys_runner.bench.breakdown --run [--wait 10 --warmup 3 --steps 10] [--json out.json] [--save-trace t.json]
  [overrides...]`` composes the run as the CLI does (plus the bench's ``COMMON`` overrides), trains
  ``wait + warmup + steps`` steps with ``train.profile`` recording the last ``steps``, and prints the breakdown of the
  trace it captured, e.g. ``--run model=deepfm data.batch_size=16384 distributed.device=cuda``.

The categories and the two modes (GPU kernels linked to their launches; CPU time when the trace has no kernels) are
:func:`recsys_runner.train.breakdown.breakdown`'s; it lives in the train room because every profiled run logs the same
table as ``profile/breakdown.txt``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from recsys_runner.bench.regimes import COMMON, build_for_bench
from recsys_runner.tracking.tracker import NullTracker
from recsys_runner.train.breakdown import CATEGORIES, StepBreakdown, breakdown
from recsys_runner.train.loop import train

__all__ = ["CATEGORIES", "StepBreakdown", "breakdown", "main", "profile_run"]


class _ArtifactCapture(NullTracker):
    """A tracker that keeps the text artifacts a run logs (the profiler's trace and tables) in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: dict[str, str] = {}

    def log_text(self, text: str, artifact_file: str) -> None:
        self.texts[artifact_file] = text


def profile_run(overrides: Sequence[str], *, wait: int = 10, warmup: int = 3,
                active: int = 10) -> tuple[StepBreakdown, dict[str, str]]:
    """Train the composed run with ``train.profile`` recording ``active`` steps after ``wait + warmup``; return the
    breakdown of its trace (rank 0) and every text artifact it logged, the trace and ``profile/breakdown.txt`` included.

    The profiled steps are the run's last, so the final eval and the end of training stay out of the trace.
    """
    profile = ["train.profile.enabled=true", f"train.profile.wait={wait}", f"train.profile.warmup={warmup}",
               f"train.profile.active={active}"]
    c = build_for_bench([*COMMON, *overrides, *profile], wait + warmup + active)
    try:
        capture = _ArtifactCapture()
        train(replace(c.loop, tracker=capture))
    finally:
        c.close()
    trace = capture.texts.get(f"profile/trace_rank{c.env.rank}.json")
    if trace is None:
        raise RuntimeError(f"the run logged no trace (artifacts: {sorted(capture.texts)}); "
                           f"were all {wait + warmup + active} steps trained?")
    return breakdown(json.loads(trace), steps=active), capture.texts


def main(argv: Sequence[str] | None = None) -> StepBreakdown:
    """The command line (see the module docstring); prints the table and returns the breakdown."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("args", nargs="*", help="TRACE.json, or with --run the config overrides (model=dlrm ...)")
    parser.add_argument("--run", action="store_true", help="train and profile a run instead of reading a trace")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps averaged: with --run the profiled steps (default 10); "
                             "on a trace its last N step markers (default all)")
    parser.add_argument("--wait", type=int, default=10, help="--run: steps before the profiler starts (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="--run: profiled steps discarded (default 3)")
    parser.add_argument("--json", default=None, help="also write the breakdown as JSON to this path")
    parser.add_argument("--save-trace", default=None, help="--run: also write the captured Chrome trace to this path")
    ns = parser.parse_args(argv)
    extra: dict[str, Any] = {}
    if ns.run:
        result, texts = profile_run(ns.args, wait=ns.wait, warmup=ns.warmup, active=ns.steps or 10)
        extra = {"overrides": [*COMMON, *ns.args], "artifacts": sorted(texts)}
        if ns.save_trace:
            trace = next(text for name, text in texts.items() if name.startswith("profile/trace_rank"))
            Path(ns.save_trace).write_text(trace)
    else:
        if len(ns.args) != 1 or ns.save_trace:
            parser.error("give one TRACE.json (or --run with config overrides)")
        extra = {"trace": ns.args[0]}
        result = breakdown(json.loads(Path(ns.args[0]).read_text()), steps=ns.steps)
    print(result.table(), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(result.as_dict() | extra, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
