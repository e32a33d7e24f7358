"""Multirun ↔ MLflow: one parent run per sweep, every job a child of it, the best trial on the parent.

:class:`MlflowSweepCallback` is a Hydra callback (``hydra.callbacks.mlflow_sweep`` in
``conf/config.yaml``). In the launching process, ``on_multirun_start`` creates the parent run and
exports its id in :data:`recsys_runner.tracking.tracker.PARENT_RUN_ENV`; every job's tracker tags its run
with ``mlflow.parentRunId``. The environment is the one channel that reaches every kind of job:
in-process (basic launcher), ``submitit_local`` subprocesses and SLURM jobs (``sbatch`` exports the
submitting environment) — and a requeued SLURM job gets it again.

``on_multirun_end`` (after the launcher returns) writes the summary of the best finished child to
the parent and ends it. When jobs are still queued — ``hydra/launcher=submitit_slurm_detached``
returns right after submitting — the parent stays RUNNING and ``python -m recsys_runner.compare
collect --parent <id>`` summarizes it later.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from recsys_runner.errors import UserError
from recsys_runner.metrics.registry import DEFAULT_OBJECTIVE, higher_is_better
from recsys_runner.tracking.store import experiment_id, open_store, resolve_uri, store_errors, uri_source
from recsys_runner.tracking.tracker import PARENT_RUN_ENV

log = logging.getLogger(__name__)

_TERMINAL = {"FINISHED", "FAILED", "KILLED"}
SWEEP_PARENT_TAG = "sweep.objective"
"""Present on a sweep's parent run only (its value is the objective's metric name)."""
EXPECTED_JOBS_TAG = "sweep.num_jobs"
"""Set on the parent by launchers that return before their jobs finish (the collector waits for this many)."""


@dataclass(frozen=True)
class SweepSummary:
    """The state of a sweep's children, and the best finished one."""

    num_children: int
    num_finished: int
    num_terminal: int
    best_run_id: str | None
    best_value: float | None
    best_overrides: str | None


class MlflowSweepCallback(Callback):
    """Creates the sweep's MLflow parent run and summarizes it at the end (``tracking=mlflow`` only)."""

    def __init__(self) -> None:
        self._client: Any = None
        self._parent: str | None = None
        self._previous_env: str | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        tracking = config.get("tracking")
        if tracking is None or not str(tracking.get("_target_", "")).endswith("MlflowTracker"):
            return
        uri, source = resolve_uri(tracking.get("uri")), uri_source(tracking.get("uri"))
        sweep_dir = str(OmegaConf.select(config, "hydra.sweep.dir"))
        overrides = " ".join(OmegaConf.select(config, "hydra.overrides.task") or [])
        sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_") or "").rsplit(".", 1)[-1]
        try:  # the same start-of-run check as every job's (MlflowTracker.check), before any job is launched
            self._client = open_store(uri, source)
            with store_errors(uri, source):
                run = self._client.create_run(
                    experiment_id(self._client, str(tracking.experiment)),
                    run_name=f"sweep {os.path.basename(sweep_dir.rstrip('/'))}" if sweep_dir else "sweep",
                    tags={"sweep.dir": os.path.abspath(sweep_dir), "sweep.overrides": overrides, "sweep.sweeper": sweeper,
                          SWEEP_PARENT_TAG: OmegaConf.select(config, "train.objective") or DEFAULT_OBJECTIVE, "sweep.tracking_uri": uri},
                )
        except UserError as e:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"{e.label}: {e}", file=sys.stderr)  # as the CLI does; Hydra would print a traceback
            sys.exit(2)
        self._parent = run.info.run_id
        self._previous_env = os.environ.get(PARENT_RUN_ENV)
        os.environ[PARENT_RUN_ENV] = self._parent
        log.info("MLflow parent run %s (experiment %s) groups this multirun", self._parent, tracking.experiment)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self._parent is None:
            return
        if self._previous_env is None:
            os.environ.pop(PARENT_RUN_ENV, None)
        else:
            os.environ[PARENT_RUN_ENV] = self._previous_env
        collect = f"python -m recsys_runner.compare collect --parent {self._parent}"
        try:
            summary = summarize(self._client, self._parent)
            expected = int(self._client.get_run(self._parent).data.tags.get(EXPECTED_JOBS_TAG, summary.num_children))
            if summary.num_terminal < expected:
                log.info("%d of %d jobs still running or queued; summarize later with: %s",
                         expected - summary.num_terminal, expected, collect)
            else:
                finish_parent(self._client, self._parent, summary)
        except Exception as e:  # noqa: BLE001 - the jobs' results are safe in their own runs; only the summary waits
            log.warning("could not summarize sweep parent run %s (%s); do it later with: %s", self._parent, e, collect)
        self._parent = None


def sweep_objective(client: Any, parent_run_id: str) -> str:
    """The objective metric recorded on a sweep's parent run (``train.objective`` at launch)."""
    return client.get_run(parent_run_id).data.tags.get(SWEEP_PARENT_TAG) or DEFAULT_OBJECTIVE


def summarize(client: Any, parent_run_id: str, objective: str | None = None) -> SweepSummary:
    """Count the parent's children and find the finished child with the best ``objective``
    (the parent's recorded objective by default), in the metric's direction (:func:`higher_is_better`)."""
    objective = objective or sweep_objective(client, parent_run_id)
    parent = client.get_run(parent_run_id)
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'", max_results=10000
    )
    finished = [r for r in children if r.info.status == "FINISHED" and objective in r.data.metrics]
    sign = 1.0 if higher_is_better(objective) else -1.0
    best = max(finished, key=lambda r: sign * r.data.metrics[objective], default=None)
    return SweepSummary(
        num_children=len(children),
        num_finished=len(finished),
        num_terminal=sum(r.info.status in _TERMINAL for r in children),
        best_run_id=best.info.run_id if best else None,
        best_value=best.data.metrics[objective] if best else None,
        best_overrides=best.data.tags.get("hydra.overrides") if best else None,
    )


def finish_parent(client: Any, parent_run_id: str, summary: SweepSummary, objective: str | None = None) -> None:
    """Write the best child's overrides (as ``best.<key>`` params), metric and id to the parent, and end it."""
    from mlflow.entities import Metric, Param

    objective = objective or sweep_objective(client, parent_run_id)
    params = []
    if summary.best_run_id is not None:
        best = client.get_run(summary.best_run_id)
        # Sweepers re-quote values (``sqlite\\:///…``); compare without the escapes.
        common = {_unescape(o) for o in (client.get_run(parent_run_id).data.tags.get("sweep.overrides") or "").split()}
        swept = [_unescape(o) for o in (summary.best_overrides or "").split() if _unescape(o) not in common]
        params = [Param(f"best.{k}", v) for k, v in _override_pairs(" ".join(swept))]
        now = int(time.time() * 1000)
        client.log_batch(parent_run_id, metrics=[Metric(f"best/{objective}", float(summary.best_value or 0.0), now, 0)])
        for key in ("train/loss", "eval/logloss"):
            if key in best.data.metrics:
                client.log_metric(parent_run_id, f"best/{key}", best.data.metrics[key])
        client.set_tag(parent_run_id, "best.run_id", summary.best_run_id)
        client.set_tag(parent_run_id, "best.run_name", best.info.run_name)
    existing = client.get_run(parent_run_id).data.params
    new = [p for p in params if p.key not in existing]
    if new:
        client.log_batch(parent_run_id, params=new)
    client.set_tag(parent_run_id, "sweep.num_finished", str(summary.num_finished))
    client.set_tag(parent_run_id, "sweep.num_children", str(summary.num_children))
    status = "FINISHED" if summary.num_finished else "FAILED"
    client.set_terminated(parent_run_id, status=status)
    if summary.best_run_id is not None:
        log.info("sweep parent %s: best %s=%.4f from run %s (%s)", parent_run_id, objective, summary.best_value,
                 summary.best_run_id, summary.best_overrides)


def _unescape(override: str) -> str:
    return override.replace("\\", "")


def _override_pairs(overrides: str) -> list[tuple[str, str]]:
    """``"optim.lr=0.1 model=dlrm"`` → ``[("optim.lr", "0.1"), ("model", "dlrm")]`` (``+``/``~`` prefixes dropped)."""
    pairs = []
    for item in overrides.split():
        key, sep, value = item.partition("=")
        if sep:
            pairs.append((key.lstrip("+~"), value))
    return pairs
