"""``train.profile``: record a few steps with ``torch.profiler`` and store the trace in MLflow.

The profiler waits ``wait`` steps, warms up for ``warmup`` and records ``active`` steps (CPU
activity, plus CUDA on GPU); the Chrome trace (open it in ``chrome://tracing`` or Perfetto) and a
table of the most expensive ops are logged as artifacts ``profile/trace_rank<r>.json`` and
``profile/key_averages.txt``, with ``profile/breakdown.txt``: where a step's time goes (:func:`breakdown`: input copy,
embedding forward/backward, all-to-all, dense forward/backward, optimizer, metrics, Python; kernel time against step
time on a GPU). Off by default; ``debug=profile`` turns it on.
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


def check_trace_folder() -> None:
    """With ``train.profile.enabled``: the temporary folder each rank writes its trace into before logging it
    (``tempfile``'s: ``$TMPDIR``, else ``/tmp``, …) can be written, checked when the run is built (before the model);
    else :class:`~recsys_runner.errors.TrackingError` names it and the fix."""
    fixes = ("set TMPDIR to a writable folder", "train.profile.enabled=false")
    try:
        folder = Path(tempfile.gettempdir())
    except FileNotFoundError as e:  # tempfile found no writable candidate at all
        raise TrackingError(f"train.profile.enabled=true writes its traces into a temporary folder, and none can be written "
                            f"({e}). Fix: {fixes[0]}, or {fixes[1]}") from None
    check_folder(folder, setting="train.profile.enabled=true", writes="its traces (before logging them as artifacts)", fixes=fixes)


class StepProfiler:
    """A started ``torch.profiler.profile`` stepped by the runner; :meth:`finish` logs the trace."""

    def __init__(self, config: ProfileConfig, device: torch.device, rank: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.rank = rank
        self._dir = Path(tempfile.mkdtemp(prefix="recsys_profile_"))
        self._traces: list[Path] = []
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=config.wait, warmup=config.warmup, active=config.active, repeat=1),
            on_trace_ready=self._save,
            record_shapes=config.record_shapes,
        )
        self._prof.start()

    def _save(self, prof: Any) -> None:
        path = self._dir / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(path))
        self._traces.append(path)

    def step(self) -> None:
        self._prof.step()

    def finish(self, tracker: Any) -> list[str]:
        """Stop profiling and log what was recorded (trace, op table, step breakdown); returns the artifact names."""
        self._prof.stop()
        names, text = [], ""
        for path in self._traces:
            text = path.read_text()
            tracker.log_text(text, f"profile/{path.name}")
            names.append(f"profile/{path.name}")
        if self._traces:
            table = self._prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            tracker.log_text(table, "profile/key_averages.txt")
            names.append("profile/key_averages.txt")
            try:
                step_table = breakdown(json.loads(text)).table()
            except (ValueError, KeyError, TypeError) as e:  # a diagnostic must not cost the run its end checkpoint
                log.warning("profile/breakdown.txt not written: the trace could not be broken down (%s: %s)", type(e).__name__, e)
            else:
                tracker.log_text(step_table, "profile/breakdown.txt")
                names.append("profile/breakdown.txt")
        return names

