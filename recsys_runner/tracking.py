"""Experiment tracking: MLflow on rank 0, nothing elsewhere.

The default store is ``sqlite:///mlflow.db`` in the launch directory (MLflow's own embedded
default), so ``make ui`` shows every run without a server. ``tracking.uri`` or the
``MLFLOW_TRACKING_URI`` environment variable (in that order) point elsewhere.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from recsys_runner.errors import require

_MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
_PARAMS_PER_CALL = 100  # MLflow's limit on params per log_batch


@dataclass(kw_only=True)
class TrackingConfig:
    """Schema of ``conf/tracking/mlflow.yaml``."""

    _target_: str = "recsys_runner.tracking.MlflowTracker"
    _partial_: bool = True
    uri: str | None = None
    """Tracking URI; ``null`` means ``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlflow.db`` in the launch dir."""
    experiment: str = "recsys_runner"
    """MLflow experiment the run is filed under (created when missing)."""
    run_name: str | None = None
    """Run name; ``null`` uses the Hydra overrides (e.g. ``model=dlrm,optim.lr=0.1``)."""

    def __post_init__(self) -> None:
        require(bool(self.experiment), "tracking.experiment must not be empty")


@dataclass(kw_only=True)
class NoTrackingConfig:
    """Schema of ``conf/tracking/none.yaml``: log to the console only."""

    _target_: str = "recsys_runner.tracking.NullTracker"
    _partial_: bool = True


class Tracker(Protocol):
    """What the runner logs through. Only rank 0 gets a real tracker."""

    def start(self, *, run_name: str, tags: Mapping[str, str], params: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def finish(self, status: str) -> None: ...


class NullTracker:
    """Tracks nothing (non-zero ranks, or ``tracking=none``)."""

    def __init__(self, **_: Any) -> None:
        pass

    def start(self, *, run_name: str, tags: Mapping[str, str], params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def finish(self, status: str) -> None:
        pass


class MlflowTracker:
    """Logs one MLflow run through ``MlflowClient`` (no global active-run state, so a multirun's
    jobs in one process never leak into each other)."""

    def __init__(self, *, uri: str | None, experiment: str, run_name: str | None = None) -> None:
        self.uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('mlflow.db')}"
        self.experiment = experiment
        self.run_name = run_name
        self.run_id: str | None = None
        self._client: Any = None

    def start(self, *, run_name: str, tags: Mapping[str, str], params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.uri)
        found = self._client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self._client.create_experiment(self.experiment)
        run = self._client.create_run(experiment_id, run_name=self.run_name or run_name, tags=dict(tags))
        self.run_id = run.info.run_id
        items = [Param(k, str(v)[:_MAX_PARAM_CHARS]) for k, v in params.items()]
        for i in range(0, len(items), _PARAMS_PER_CALL):
            self._client.log_batch(self.run_id, params=items[i : i + _PARAMS_PER_CALL])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self._client.log_batch(self._run(), metrics=batch)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._client.log_text(self._run(), text, artifact_file)

    def finish(self, status: str) -> None:
        if self.run_id is not None:
            self._client.set_terminated(self.run_id, status=status)
            self.run_id = None

    def _run(self) -> str:
        assert self.run_id is not None, "MlflowTracker.start() must run first"
        return self.run_id
