"""Experiment tracking: MLflow on rank 0, nothing elsewhere.

The default store is ``sqlite:///mlflow.db`` in the launch directory (MLflow's own embedded
default), so ``make ui`` shows every run without a server. ``tracking.uri`` or the
``MLFLOW_TRACKING_URI`` environment variable (in that order) point elsewhere, e.g. a
``mlflow server`` at ``http://host:5000``.

A remote server may go away mid-run. Training never waits on it: what cannot be sent waits in the run's
:class:`~recsys_runner.tracking.outbox.Outbox` and is re-sent with the next batch, and :meth:`MlflowTracker.finish`
retries for ``tracking.flush_timeout_s``. If the server is still gone then, the unsent metrics — and the run's end,
when the store does not take it (nothing else could end the run) — go to the run's replay file, which
``python -m recsys_runner.tracking replay <file>`` sends later (:mod:`recsys_runner.tracking.outbox`).

The start of a run is different: it needs its MLflow run id (a resumed training continues that run,
a sweep files its jobs under their parent), so a store that cannot be used then is an error, found
before any data or model is built (:meth:`MlflowTracker.check`, :func:`open_store`): within seconds,
with MLflow's minutes of HTTP retries off, and as a :class:`~recsys_runner.errors.TrackingError` naming
the URI, the cause and the fixes. A sqlite store is probed with a write that is rolled back, because
a read-only file opens fine and would fail only at the first write; a local artifact folder (the run's
``config.yaml``, manifest, summaries' histograms, profiler traces) with a probe file
(:mod:`recsys_runner.tracking.folders`). Creating a new sqlite store is
serialized across processes (:func:`store_lock`): MLflow creates its tables without a lock, and runs
starting together on a new file would crash one another.

Runs of a multirun are children of one parent run (see :mod:`recsys_runner.tracking.sweep`), which the
sweep passes to its jobs in the environment variable :data:`PARENT_RUN_ENV`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from recsys_runner.configurable import Configurable
from recsys_runner.errors import Stopped, require
from recsys_runner.tracking.folders import check_folder
from recsys_runner.tracking.outbox import UNSENT_DIR_TAG, Outbox
from recsys_runner.tracking.requeue import run_record, why_not_continue
from recsys_runner.tracking.store import (
    experiment_id,
    is_remote,
    no_http_retries,
    open_store,
    resolve_uri,
    store_errors,
    ui_lines,
    ui_url,
    uri_source,
)

if TYPE_CHECKING:  # the annotation only: a tracker logs the records it is handed
    from recsys_runner.tracking.datasets import DataRecord

log = logging.getLogger(__name__)

_MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value

_PARAMS_PER_CALL = 100  # MLflow's limit on params per log_batch

_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's database stores (scheme, or dialect before "+driver")

PARENT_RUN_ENV = "RECSYS_RUNNER_PARENT_RUN_ID"
"""Set by the sweep callback for its jobs: their runs become children of this run."""


@dataclass(frozen=True)
class Histogram:
    """One histogram in TensorBoard's raw form (``SummaryWriter.add_histogram_raw``): ``bucket_limits`` are right edges."""

    min: float
    max: float
    num: int
    sum: float
    sum_squares: float
    bucket_limits: list[float]
    bucket_counts: list[int]


@dataclass(kw_only=True)
class TrackingConfig(Configurable):
    """Base of the ``tracking`` group's schemas: each builds a :class:`Tracker` (on rank 0; other ranks use :class:`NullTracker`)."""

    experiment: str = "recsys_runner"
    """The experiment the run belongs to: MLflow files the run under it (created when missing); a tracker that tracks
    nothing ignores it, so a preset that names its experiment still runs with ``tracking=none``."""
    tensorboard: bool = False
    """Also write every logged metric (and ``train.summary_histograms``' histograms) to TensorBoard event files under
    ``<run dir>/tensorboard`` (``./tensorboard`` from Python), rank 0 only: ``tensorboard --logdir <run dir>`` shows them."""
    dataset_digest_max_mb: float = 256.0
    """The run's data inputs (docs/experiments.md, *What each run records*) get a digest of the files' contents when
    they total at most this many MB; larger data gets a digest of its file names, sizes and modification times
    instead, so that no run reads its data twice just to name it. 0: never read the files for a digest. Kept in
    each checkpoint too (``data_inputs.json``), so this applies with ``tracking=none`` as well."""

    def __post_init__(self) -> None:
        require(self.dataset_digest_max_mb >= 0,
                f"tracking.dataset_digest_max_mb must be >= 0, got {self.dataset_digest_max_mb}. Fix: e.g. "
                f"tracking.dataset_digest_max_mb=256, or 0 to digest only file names, sizes and modification times")

    def build(self) -> Tracker:
        """The tracker this config describes; it opens nothing until :meth:`Tracker.check` or ``start``."""
        built: Tracker = self.component_class()(self)
        return built


@dataclass(kw_only=True)
class MlflowTrackingConfig(TrackingConfig):
    """Schema of ``conf/tracking/mlflow.yaml``; builds :class:`MlflowTracker`."""

    _target_: str = "recsys_runner.tracking.tracker.MlflowTracker"
    uri: str | None = None
    """Tracking URI; ``null`` means ``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlflow.db`` in the launch dir."""
    run_name: str | None = None
    """Run name; ``null`` uses the Hydra overrides (e.g. ``model=dlrm,optim.lr=0.1``)."""
    flush_timeout_s: float = 60.0
    """At the end of a run, how long to keep retrying metrics a tracking server did not accept
    before writing them to ``mlflow_unsent_<run id>.json`` (see ``python -m recsys_runner.tracking replay``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(bool(self.experiment), "tracking.experiment must not be empty")
        require(self.flush_timeout_s >= 0, f"tracking.flush_timeout_s must be >= 0, got {self.flush_timeout_s}")


@dataclass(kw_only=True)
class NoTrackingConfig(TrackingConfig):
    """Schema of ``conf/tracking/none.yaml``: log to the console only; builds :class:`NullTracker`."""

    _target_: str = "recsys_runner.tracking.tracker.NullTracker"

_TRACKING_OFF = NoTrackingConfig()


class Tracker(Protocol):
    """What the runner logs through. Only rank 0 gets a real tracker."""

    @property
    def run_id(self) -> str | None:
        """The run being logged to, once started or resumed; ``None`` before, and always for a tracker that tracks nothing."""
        ...

    def check(self) -> None: ...
    def start(self, *, run_name: str, tags: Mapping[str, str], params: Mapping[str, Any]) -> None: ...
    def resume(self, run_id: str) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def logged_at(self, step: int, keys: Sequence[str]) -> dict[str, float] | None:
        """The values of ``keys`` this run logged at ``step`` (in an earlier launch of a resumed run), when it holds every
        one; ``None`` when it lacks any, or cannot say (nothing tracked, the store unreachable)."""
        ...

    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_histograms(self, histograms: Mapping[str, Histogram], step: int) -> None: ...

    def log_inputs(self, datasets: Sequence[DataRecord]) -> None:
        """Record the data the run read as the run's dataset inputs (:mod:`recsys_runner.tracking.datasets`); an outage
        only warns."""
        ...

    def set_tag(self, key: str, value: str) -> None: ...
    def finish(self, status: str) -> None: ...

    def run_record(self) -> str | None:
        """What a relaunch of this job needs to find this run again (:mod:`recsys_runner.tracking.requeue`), once started
        or resumed; ``None`` when nothing is tracked."""
        ...

    def why_not_continue(self, record: str, params: Mapping[str, Any]) -> str | None:
        """Why a launch at step 0 that would log ``params`` must not continue the run ``record`` names (a preempted
        launch's, :func:`~recsys_runner.tracking.requeue.why_not_continue`); ``None`` when it may."""
        ...


class NullTracker:
    """Tracks nothing (non-zero ranks, or ``tracking=none``)."""

    def __init__(self, config: NoTrackingConfig = _TRACKING_OFF) -> None:
        self.config = config

    @property
    def run_id(self) -> str | None:
        return None

    def check(self) -> None:
        pass

    def start(self, *, run_name: str, tags: Mapping[str, str], params: Mapping[str, Any]) -> None:
        pass

    def resume(self, run_id: str) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def logged_at(self, step: int, keys: Sequence[str]) -> dict[str, float] | None:
        return None

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_histograms(self, histograms: Mapping[str, Histogram], step: int) -> None:
        pass

    def log_inputs(self, datasets: Sequence[DataRecord]) -> None:
        pass

    def set_tag(self, key: str, value: str) -> None:
        pass

    def finish(self, status: str) -> None:
        pass

    def run_record(self) -> str | None:
        return None

    def why_not_continue(self, record: str, params: Mapping[str, Any]) -> str | None:
        return "nothing is tracked"


class MlflowTracker:
    """Logs one MLflow run through ``MlflowClient`` (no global active-run state, so a multirun's
    jobs in one process never leak into each other)."""

    def __init__(self, config: MlflowTrackingConfig) -> None:
        self.config = config
        self.uri = resolve_uri(config.uri)
        """The store logged to: ``tracking.uri``, ``$MLFLOW_TRACKING_URI`` or the default (:func:`resolve_uri`)."""
        self.run_id: str | None = None
        self._experiment_id: str | None = None
        self._source = uri_source(config.uri)
        self._client: Any = None
        self._remote = is_remote(self.uri)
        self._outbox = Outbox(self.uri)
        self._unsent_dir = Path.cwd()  # where the run starts: its UNSENT_DIR_TAG says so, for whoever finds it RUNNING

    def check(self) -> None:
        """Preflight, run by ``build`` on rank 0 before data and model exist: open the store, or raise
        :class:`TrackingError` naming the URI, the cause and the fixes (:func:`open_store`); then the run's artifact
        folder when it is local (:func:`~recsys_runner.tracking.folders.check_folder`), which MLflow writes only at the
        first artifact and whose failure would otherwise look like an outage."""
        self._client = open_store(self.uri, self._source)
        found = self._artifact_folder()
        if found is not None:
            folder, elsewhere = found
            check_folder(folder, setting=f"the MLflow store {self.uri} ({self._source})",
                         writes=f"experiment {self.config.experiment!r}'s run artifacts (config.yaml, the manifest, summaries' "
                                "histograms, profiler traces)", fixes=(elsewhere, "tracking=none"))

    def _artifact_folder(self) -> tuple[Path, str] | None:
        """The local folder this run's artifacts go under, and how to go elsewhere: the experiment's artifact location,
        or, for an experiment to be created, the store's default (``./mlruns`` beside a database store, the store's own
        folder for a file store); ``None`` when they go to a tracking server or an object store."""
        if is_remote(self.uri):
            return None
        with store_errors(self.uri, self._source):
            experiment = self._client.get_experiment_by_name(self.config.experiment)
        if experiment is not None:
            location = urlsplit(experiment.artifact_location)
            new = "use another tracking.experiment (a new one keeps its artifacts in ./mlruns of the directory the run starts in)"
            return (Path(location.path), new) if location.scheme in ("", "file") else None
        store = urlsplit(self.uri)
        if store.scheme in ("", "file"):
            return Path(store.path), "use another tracking.uri"
        if store.scheme.split("+")[0] in _DATABASES:  # MLflow's default artifact root beside a database store
            return Path("mlruns").absolute(), "start the run from another directory (a new experiment's artifacts go to its ./mlruns)"
        return None

    def start(self, *, run_name: str, tags: Mapping[str, str], params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        if self._client is None:
            self.check()
        all_tags = dict(tags) | {UNSENT_DIR_TAG: str(self._unsent_dir)}
        parent = os.environ.get(PARENT_RUN_ENV)
        if parent:
            all_tags["mlflow.parentRunId"] = parent
        with store_errors(self.uri, self._source):
            experiment = experiment_id(self._client, self.config.experiment)
            run = self._client.create_run(experiment, run_name=self.config.run_name or run_name, tags=all_tags)
            self.run_id, self._experiment_id = run.info.run_id, experiment
            if (url := ui_url(self.uri, experiment, self.run_id)) is not None:
                log.info("MLflow run %s: %s", self.run_id, url)
            items = [Param(k, str(v)[:_MAX_PARAM_CHARS]) for k, v in params.items()]
            for i in range(0, len(items), _PARAMS_PER_CALL):
                self._client.log_batch(self.run_id, params=items[i : i + _PARAMS_PER_CALL])

    def resume(self, run_id: str) -> None:
        """Continue logging into existing run ``run_id`` (a training resumed from a checkpoint):
        it is marked RUNNING again; params are not re-logged (MLflow params are immutable)."""
        if self._client is None:
            self.check()
        with no_http_retries(self._remote):  # the store answered check(); a failure here means it lacks the run
            self._experiment_id = self._client.get_run(run_id).info.experiment_id  # fails clearly if the store lacks it
            self._client.update_run(run_id, status="RUNNING")
            self._client.set_tag(run_id, "resumed", "true")
            self._client.set_tag(run_id, UNSENT_DIR_TAG, str(self._unsent_dir))  # this launch's directory, not the first's
        self.run_id = run_id

    def run_record(self) -> str | None:
        return run_record(self.run_id, self.uri) if self.run_id is not None else None

    def why_not_continue(self, record: str, params: Mapping[str, Any]) -> str | None:
        """See :func:`~recsys_runner.tracking.requeue.why_not_continue`; the params compared as :meth:`start` logs them."""
        if self._client is None:
            self.check()
        logged = {k: str(v)[:_MAX_PARAM_CHARS] for k, v in params.items()}
        with store_errors(self.uri, self._source):
            return why_not_continue(self._client, record, uri=self.uri, experiment=self.config.experiment, params=logged,
                                    parent=os.environ.get(PARENT_RUN_ENV) or None)

    def log_inputs(self, datasets: Sequence[DataRecord]) -> None:
        """The run's dataset inputs, in one call; a store outage (or a store too old for datasets) only warns: the
        record is in the checkpoints' ``data_inputs.json`` all the same. Logged again by a resumed run, which MLflow
        keeps once (a dataset is its name and digest)."""
        if not datasets:
            return
        try:
            with no_http_retries(self._remote):
                self._client.log_inputs(self._run(), datasets=[d.as_mlflow() for d in datasets])
        except Stopped:
            raise
        except Exception as e:  # noqa: BLE001 - a lost dataset record must not fail the run
            log.warning("could not log the datasets %s to MLflow run %s: %s: %s", ", ".join(d.name for d in datasets), self.run_id,
                        type(e).__name__, e)

    def set_tag(self, key: str, value: str) -> None:
        """Tag the run now (e.g. ``preempted``); a store outage only warns."""
        try:
            with no_http_retries(self._remote):
                self._client.set_tag(self._run(), key, value)
        except Exception as e:  # noqa: BLE001 - a lost tag must not fail the run
            log.warning("could not tag MLflow run %s %s=%s: %s", self.run_id, key, value, e)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._outbox.metrics.extend(Metric(k, float(v), now, step) for k, v in metrics.items())
        if self._outbox.due():
            self._flush()

    def logged_at(self, step: int, keys: Sequence[str]) -> dict[str, float] | None:
        """The last value of each of ``keys`` at ``step`` in this run's metric history (MLflow keeps every value logged,
        so a value logged twice at a step stays twice); ``None`` when any is missing, or when the store does not answer
        (the caller then logs the values, at worst again)."""
        if self.run_id is None or not keys:
            return None
        found: dict[str, float] = {}
        try:
            with no_http_retries(self._remote):
                for key in keys:
                    at_step = [m for m in self._client.get_metric_history(self.run_id, key) if m.step == step]
                    if not at_step:
                        return None
                    found[key] = max(at_step, key=lambda m: m.timestamp).value
        except Stopped:
            raise
        except Exception as e:  # noqa: BLE001 - an outage: say so, and let the caller log again rather than lose the values
            log.warning("could not read the metric history of MLflow run %s (%s: %s); step %d's eval metrics are logged "
                        "anew", self.run_id, type(e).__name__, e, step)
            return None
        return found

    def log_text(self, text: str, artifact_file: str) -> None:
        self._outbox.texts.append((text, artifact_file))
        if self._outbox.due():
            self._flush()

    def log_histograms(self, histograms: Mapping[str, Histogram], step: int) -> None:
        """One JSON artifact per step, ``summaries/histograms_step_<step>.json``: tag → :class:`Histogram` fields."""
        text = json.dumps({tag: asdict(h) for tag, h in histograms.items()})
        self.log_text(text, f"summaries/histograms_step_{step:08d}.json")

    def finish(self, status: str) -> None:
        if self.run_id is None:
            return
        deadline = time.monotonic() + self.config.flush_timeout_s
        while not self._flush() and time.monotonic() < deadline:
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        if not self._outbox.empty():
            path = self._outbox.write(self._unsent_dir, self._run(), status)
            log.warning(
                "tracking server %s still unreachable after %.0f s: %d metric values of run %s saved to %s; "
                "send them later with: python -m recsys_runner.tracking replay %s",
                self.uri, self.config.flush_timeout_s, len(self._outbox.metrics), self.run_id, path, path,
            )
        else:
            try:
                self._client.set_terminated(self.run_id, status=status)
            except Exception as e:  # noqa: BLE001 - the run's data is safe; its end waits in the file for a replay
                path = self._outbox.write(self._unsent_dir, self._run(), status)
                log.warning("could not mark MLflow run %s %s (%s): its end saved to %s; send it later with: "
                            "python -m recsys_runner.tracking replay %s", self.run_id, status, e, path, path)
            else:
                self._say_where(status)
        self.run_id = None

    def _say_where(self, status: str) -> None:
        """The run's last lines: which MLflow run it was, in which store, and how to see it (a server's page; for a local
        store, which has no UI until one serves it, the ``mlflow ui`` command and the page it serves)."""
        if self._experiment_id is None or self.run_id is None:
            return
        log.info("MLflow run %s %s (experiment %r, store %s)", self.run_id, status, self.config.experiment, self.uri)
        for line in ui_lines(self.uri, self._experiment_id, self.run_id):
            log.info("%s", line)

    def _flush(self) -> bool:
        """Send everything the outbox holds; True when nothing is left. Never raises for a store outage."""
        return self._outbox.flush(self._client, self._run())

    def _run(self) -> str:
        assert self.run_id is not None, "MlflowTracker.start() must run first"
        return self.run_id

