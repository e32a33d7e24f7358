"""``train.profile``: record a few steps with ``torch.profiler``, keep the trace in the run's folder and in MLflow.

The profiler waits ``wait`` steps, warms up for ``warmup`` and records ``active`` steps (CPU
activity, plus CUDA on GPU). Every rank writes its Chrome trace (open it in Perfetto or ``chrome://tracing``), a table
of the most expensive ops and ``breakdown``: where a step's time goes (:func:`breakdown`: input copy, embedding
forward/backward, all-to-all, dense forward/backward, optimizer, metrics, Python; kernel time against step time on a
GPU) into the profile folder, ``<run dir>/profile`` under the CLI (``trace_rank<r>.json``, ``key_averages_rank<r>.txt``,
``breakdown_rank<r>.txt``), and says where in a log line; rank 0 also logs its three as the MLflow artifacts
``profile/trace_rank0.json``, ``profile/key_averages.txt`` and ``profile/breakdown.txt``.

Why a folder of the run's own: only rank 0 logs to MLflow (the other ranks' tracker is a null one) and ``tracking=none``
logs nothing, so a trace kept only as an artifact was lost on every other rank and without tracking, without a word;
and traces (hundreds of MB with CUDA kernels) written into a temporary folder to upload stayed there. Off by default;
``debug=profile`` turns it on.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recsys_runner.errors import TrackingError, require
from recsys_runner.tracking.folders import check_folder
from recsys_runner.train.breakdown import breakdown

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ProfileConfig:
    """``train.profile``: which steps torch.profiler records."""

    enabled: bool = False
    """Record a trace of ``active`` steps."""
    wait: int = 5
    """Steps skipped before the profiler starts."""
    warmup: int = 2
    """Steps profiled but discarded (the profiler's own start-up)."""
    active: int = 5
    """Steps recorded."""
    record_shapes: bool = False
    """Record input shapes of every op (bigger trace)."""

    def __post_init__(self) -> None:
        require(self.wait >= 0 and self.warmup >= 0, "train.profile.wait and train.profile.warmup must be >= 0")
        require(self.active > 0, f"train.profile.active must be positive, got {self.active}")


def check_profile_window(config: ProfileConfig, total_steps: int) -> None:
    """With ``enabled``: at least one step of the run falls past ``wait`` and ``warmup``. torch.profiler writes a trace
    only for steps it records, so a window beyond the run's steps would end it without a trace, and without a word;
    checked once the run's length is known (``build``), before the model."""
    if not config.enabled:
        return
    skipped = config.wait + config.warmup
    require(skipped < total_steps, f"train.profile.wait={config.wait} + train.profile.warmup={config.warmup} skip {skipped} "
            f"steps, but the run has {total_steps}, so no step would be recorded. Fix: lower them (e.g. "
            f"train.profile.wait={max(0, min(config.wait, total_steps - 1 - config.warmup))}), or train longer")


PROFILE_DIR_NAME = "profile"
"""The folder of the traces under the run's Hydra folder (``<run dir>/profile``)."""


def check_trace_folder(folder: Path | None = None) -> None:
    """With ``train.profile.enabled``: the folder each rank writes its trace into can be written, checked when the run
    is built (before the model); else :class:`~recsys_runner.errors.TrackingError` names it and the fix. ``folder``: the
    run's profile folder (:data:`PROFILE_DIR_NAME` under the CLI's run folder); ``None`` (a run from Python): a new
    temporary folder (``tempfile``'s: ``$TMPDIR``, else ``/tmp``, …)."""
    if folder is not None:
        check_folder(folder, setting="train.profile.enabled=true", writes="its traces",
                     fixes=("use another run directory (hydra.run.dir=<dir>)", "train.profile.enabled=false"))
        return
    fixes = ("set TMPDIR to a writable folder", "train.profile.enabled=false")
    try:
        folder = Path(tempfile.gettempdir())
    except FileNotFoundError as e:  # tempfile found no writable candidate at all
        raise TrackingError(f"train.profile.enabled=true writes its traces into a temporary folder, and none can be written "
                            f"({e}). Fix: {fixes[0]}, or {fixes[1]}") from None
    check_folder(folder, setting="train.profile.enabled=true", writes="its traces (before logging them as artifacts)", fixes=fixes)


class StepProfiler:
    """A started ``torch.profiler.profile`` stepped by the runner, writing into ``folder`` (``None``: a new temporary
    folder, for a run from Python); each file written is said in a log line, and :meth:`finish` logs rank 0's to the
    tracker. ``first_step``: the run's step the loop starts after (a resume's), so the line names the steps traced."""

    def __init__(self, config: ProfileConfig, device: torch.device, rank: int, folder: Path | None = None,
                 first_step: int = 0) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.rank = rank
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        self._dir = folder if folder is not None else Path(tempfile.mkdtemp(prefix="recsys_profile_"))
        self._first = first_step + config.wait + config.warmup + 1
        self._step = first_step
        self._traces: list[Path] = []
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=config.wait, warmup=config.warmup, active=config.active, repeat=1),
            on_trace_ready=self._save,
            record_shapes=config.record_shapes,
        )
        self._prof.start()

    def _save(self, prof: Any) -> None:
        """torch.profiler's ``on_trace_ready``, as the recording ends: the trace is in its file from then on, also for a
        run stopped before :meth:`finish`."""
        path = self._dir / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(path))
        self._traces.append(path)
        steps = f"step {self._first}" if self._step <= self._first else f"steps {self._first}-{self._step}"
        log.info("profile: rank %d's trace of %s written to %s (open it in https://ui.perfetto.dev or chrome://tracing)",
                 self.rank, steps, path.absolute())

    def step(self, step: int) -> None:
        """After the run's step ``step`` trained."""
        self._step = step
        self._prof.step()

    def finish(self, tracker: Any) -> list[str]:
        """Stop profiling, write the op table and the step breakdown beside the trace, and log rank 0's three to
        ``tracker``; returns the artifact names logged."""
        self._prof.stop()
        names, text = [], ""
        for path in self._traces:
            text = path.read_text()
            tracker.log_text(text, f"profile/{path.name}")
            names.append(f"profile/{path.name}")
        if not self._traces:
            return names
        tables = {"key_averages": self._prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)}
        try:
            tables["breakdown"] = breakdown(json.loads(text)).table()
        except (ValueError, KeyError, TypeError) as e:  # a diagnostic must not cost the run its end checkpoint
            log.warning("profile/breakdown.txt not written: the trace could not be broken down (%s: %s)", type(e).__name__, e)
        written = []
        for kind, table in tables.items():
            path = self._dir / f"{kind}_rank{self.rank}.txt"
            path.write_text(table)
            written.append(str(path.absolute()))
            tracker.log_text(table, f"profile/{kind}.txt")
            names.append(f"profile/{kind}.txt")
        log.info("profile: rank %d's op table and step breakdown written to %s", self.rank, " and ".join(written))
        return names

