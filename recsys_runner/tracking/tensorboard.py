"""``tracking.tensorboard=true``: every metric the run logs, also written to TensorBoard event files (rank 0).

:class:`TensorBoardTracker` wraps the run's tracker (MLflow, or none): it forwards every call and writes each
metric as a scalar and each histogram (``train.summary_histograms``) as a histogram, through torch's
``SummaryWriter`` (the ``tensorboard`` package's event-file format), into ``<run dir>/tensorboard``, so
``tensorboard --logdir <run dir>`` (or ``--logdir outputs`` for many runs) shows the run.

A run resumed from the checkpoint of step ``n`` into the same folder (a requeued job, a fixed ``hydra.run.dir``, a
run from Python) trains steps ``n+1…`` again: :meth:`TensorBoardTracker.purge_from` opens the writer with
``purge_step=n+1``, so TensorBoard drops the points the interrupted run logged after its checkpoint and shows each
step once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from recsys_runner.tracking.datasets import DataRecord
from recsys_runner.tracking.folders import check_folder
from recsys_runner.tracking.tracker import Histogram, Tracker

LOGDIR_NAME = "tensorboard"
"""The event files' folder under the run directory."""

_FLUSH_SECS = 30  # a live ``tensorboard`` sees new points within this (the writer's default is 120)


class TensorBoardTracker:
    """``inner`` plus TensorBoard event files in ``logdir``; the writer opens at the first event and closes at :meth:`finish`.
    ``elsewhere`` says how to put ``logdir`` somewhere else (``hydra.run.dir=<dir>`` under the command line), for the
    message of :meth:`check`."""

    def __init__(self, inner: Tracker, logdir: Path, elsewhere: str = "run from another directory") -> None:
        self.inner, self.logdir, self.elsewhere = inner, logdir, elsewhere
        self._writer: Any = None
        self._purge_step: int | None = None

    def purge_from(self, step: int) -> None:
        """The run goes on from ``step`` (a resume): events logged earlier into this folder at ``step`` or later are
        dropped by TensorBoard (the writer's ``purge_step``), as they are logged again."""
        self._purge_step = step
        if self._writer is not None:  # opened already: the purge is written at the start of a new event file
            self._writer.close()
            self._writer = None

    @property
    def run_id(self) -> str | None:
        return self.inner.run_id

    def check(self) -> None:
        """The inner tracker's check, then ``logdir``'s: a file in its place or a folder this user cannot write fails
        now, before the model is built, not at the first metric (:func:`~recsys_runner.tracking.folders.check_folder`)."""
        self.inner.check()
        check_folder(self.logdir, setting="tracking.tensorboard=true", writes="its event files",
                     fixes=(self.elsewhere, "tracking.tensorboard=false"))

    def start(self, *, run_name: str, tags: Mapping[str, str], params: Mapping[str, Any]) -> None:
        self.inner.start(run_name=run_name, tags=tags, params=params)

    def resume(self, run_id: str) -> None:
        self.inner.resume(run_id)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.inner.log_metrics(metrics, step)
        writer = self._open()
        for key, value in metrics.items():
            writer.add_scalar(key, float(value), global_step=step)

    def logged_at(self, step: int, keys: Sequence[str]) -> dict[str, float] | None:
        return self.inner.logged_at(step, keys)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.inner.log_text(text, artifact_file)

    def log_histograms(self, histograms: Mapping[str, Histogram], step: int) -> None:
        self.inner.log_histograms(histograms, step)
        writer = self._open()
        for tag, h in histograms.items():
            writer.add_histogram_raw(tag, min=h.min, max=h.max, num=h.num, sum=h.sum, sum_squares=h.sum_squares,
                                     bucket_limits=h.bucket_limits, bucket_counts=h.bucket_counts, global_step=step)

    def log_inputs(self, datasets: Sequence[DataRecord]) -> None:
        self.inner.log_inputs(datasets)

    def set_tag(self, key: str, value: str) -> None:
        self.inner.set_tag(key, value)

    def run_record(self) -> str | None:
        return self.inner.run_record()

    def why_not_continue(self, record: str, params: Mapping[str, Any]) -> str | None:
        return self.inner.why_not_continue(record, params)

    def finish(self, status: str) -> None:
        try:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
        finally:
            self.inner.finish(status)

    def _open(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when it is used

            self._writer = SummaryWriter(log_dir=str(self.logdir), flush_secs=_FLUSH_SECS, purge_step=self._purge_step)
            self._purge_step = None  # written once, at the start of this writer's event file
        return self._writer
