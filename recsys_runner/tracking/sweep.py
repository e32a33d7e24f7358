"""Multirun ↔ MLflow: one parent run per sweep, every job a child of it, the best trial on the parent.

:class:`MlflowSweepCallback` is a Hydra callback (``hydra.callbacks.mlflow_sweep`` in
``conf/config.yaml``). In the launching process, ``on_multirun_start`` creates the parent run and
exports its id in :data:`recsys_runner.tracking.tracker.PARENT_RUN_ENV`; every job's tracker tags its run
with ``mlflow.parentRunId``. The environment is the one channel that reaches every kind of job:
in-process (basic launcher), ``submitit_local`` subprocesses and SLURM jobs (``sbatch`` exports the
submitting environment) — and a requeued SLURM job gets it again.

The parent also says what the sweep tries, so the MLflow UI can compare its children without a click: its name
(``sweep optim.lr=0.01,0.05,0.1``), a param ``sweep.range.<key>`` per swept key (the values or range as given) and
the tag ``sweep.params`` listing them. The swept keys reach every job in :data:`SWEPT_KEYS_ENV`, by the same channel
as the parent's id; a job names its run by the values it tried (``lr=0.05``) and logs them as params ``swept.<key>``
(:mod:`recsys_runner.tracking.sweep_names`), the same keys in every child: what the UI's parallel-coordinates and contour
charts plot.

``on_multirun_end`` (after the launcher returns) writes the summary of the best finished child to
the parent, a table of every child (``sweep_summary.json`` and ``sweep_summary.csv``) and ends it
(:mod:`recsys_runner.tracking.sweep_summary`). A multirun that
stops before that — a job's error ends the process (``Config error: …``, exit 2), a crash in a job makes the sweeper
raise once its batch has run — never reaches ``on_multirun_end``; the parent would stay RUNNING for ever. So when the
jobs ran in this process (Hydra's basic launcher), the process's exit ends the parent ``FAILED`` (``KILLED`` for a
child stopped on a signal) with the same summary, the jobs that failed named in the tag ``sweep.failed_jobs``
(``#1 optim.lr=-1``), and says so on stderr (:meth:`MlflowSweepCallback._end_stopped_sweep`).

When jobs are still queued — ``hydra/launcher=submitit_slurm_detached``
returns right after submitting — the parent stays RUNNING and ``python -m recsys_runner.compare
collect --parent <id>`` summarizes it later, asking SLURM which jobs have ended (:mod:`recsys_runner.tracking.sweep_jobs`).
"""

from __future__ import annotations

import atexit
import logging
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from recsys_runner.errors import ConfigError, UserError, reported
from recsys_runner.metrics.registry import DEFAULT_OBJECTIVE, higher_is_better
from recsys_runner.tracking.store import experiment_id, open_store, resolve_uri, store_errors, ui_lines, uri_source
from recsys_runner.tracking.sweep_names import (
    SWEPT_KEYS_ENV,
    SWEPT_KEYS_TAG,
    clip,
    log_ranges,
    override_values,
    sweep_name,
    swept_ranges,
    unescape,
)
from recsys_runner.tracking.sweep_summary import SWEEP_PARENT_TAG, child_runs, finish_parent, summarize
from recsys_runner.tracking.tracker import PARENT_RUN_ENV

log = logging.getLogger(__name__)

EXPECTED_JOBS_TAG = "sweep.num_jobs"
"""Set on the parent by launchers that return before their jobs finish (the collector waits for this many)."""
FAILED_JOBS_TAG = "sweep.failed_jobs"
"""On a parent whose multirun stopped early: the jobs that failed (``#1 optim.lr=-1``), ``; ``-separated."""


_ENDED_JOBS: list[list[tuple[int, list[str]]]] = []
"""Filled by :func:`jobs_ended`: a launcher whose jobs run elsewhere says that all of them have ended."""


def jobs_ended(failed: Sequence[tuple[int, list[str]]]) -> None:
    """Called by a launcher whose jobs run elsewhere (``WaitingSlurmLauncher``) once every job has ended: a multirun
    that then stops may end its parent, naming ``failed`` (job number, its overrides) like an in-process sweep's."""
    _ENDED_JOBS.append(list(failed))


def configured_objective(config: DictConfig) -> str:
    """``train.objective``, else :data:`DEFAULT_OBJECTIVE`: the objective as the config states it, without resolving the
    default its jobs will take (:func:`recsys_runner.sweep.sweep_objective` does)."""
    return str(OmegaConf.select(config, "train.objective") or DEFAULT_OBJECTIVE)


class MlflowSweepCallback(Callback):
    """Creates the sweep's MLflow parent run and summarizes it at the end (``tracking=mlflow`` only).

    ``objective_of(config)``: the eval key the sweep's jobs report and its parent ranks them by (the parent's tag
    :data:`SWEEP_PARENT_TAG`, :func:`check_direction`'s objective); :class:`recsys_runner.sweep.SweepCallback` gives the
    one that resolves the jobs' default objective from their config.
    """

    def __init__(self, objective_of: Callable[[DictConfig], str] = configured_objective) -> None:
        self._objective_of = objective_of
        self._client: Any = None
        self._parent: str | None = None
        self._previous_env: dict[str, str | None] = {}
        self._in_process = False  # the jobs run in this process (basic launcher): their failures end it
        self._running_job: str | None = None  # "#<num> <overrides>" between on_job_start and on_job_end
        self._failed_jobs: list[str] = []
        self._swept_keys: list[str] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        with reported():  # before any job: the objective its jobs report, and a sweeper that would chase it the wrong way
            objective = self._objective_of(config)
            check_direction(config, objective)
        tracking = config.get("tracking")
        if tracking is None or not str(tracking.get("_target_", "")).endswith("MlflowTracker"):
            return
        uri, source = resolve_uri(tracking.get("uri")), uri_source(tracking.get("uri"))
        sweep_dir = str(OmegaConf.select(config, "hydra.sweep.dir"))
        overrides = " ".join(OmegaConf.select(config, "hydra.overrides.task") or [])
        sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_") or "").rsplit(".", 1)[-1]
        ranges = swept_ranges(config)
        try:  # the same start-of-run check as every job's (MlflowTracker.check), before any job is launched
            self._client = open_store(uri, source)
            with store_errors(uri, source):
                run = self._client.create_run(
                    experiment_id(self._client, str(tracking.experiment)),
                    run_name=sweep_name(ranges) or (f"sweep {os.path.basename(sweep_dir.rstrip('/'))}" if sweep_dir else "sweep"),
                    tags={"sweep.dir": os.path.abspath(sweep_dir), "sweep.overrides": overrides, "sweep.sweeper": sweeper,
                          SWEEP_PARENT_TAG: objective, "sweep.tracking_uri": uri,
                          SWEPT_KEYS_TAG: ",".join(ranges)},
                )
                log_ranges(self._client, run.info.run_id, ranges)
        except UserError as e:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"{e.label}: {e}", file=sys.stderr)  # as the CLI does; Hydra would print a traceback
            sys.exit(2)
        self._parent, self._swept_keys = run.info.run_id, list(ranges)
        self._in_process = str(OmegaConf.select(config, "hydra.launcher._target_") or "").endswith((".BasicLauncher", ".KeepGoingLauncher"))
        atexit.register(self._end_stopped_sweep)
        self._set_env({PARENT_RUN_ENV: self._parent, SWEPT_KEYS_ENV: ",".join(ranges)})
        log.info("MLflow parent run %s (experiment %s) groups this multirun", self._parent, tracking.experiment)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self._parent is not None and self._in_process:
            if self._running_job is not None:  # the job before never reached on_job_end: it exited (KeepGoingLauncher)
                self._failed_jobs.append(self._running_job)
            overrides = [str(o) for o in OmegaConf.select(config, "hydra.overrides.task") or []]
            self._running_job = self._job_label(OmegaConf.select(config, "hydra.job.num"), overrides)

    def _job_label(self, num: object, overrides: Sequence[str]) -> str:
        """``#1 optim.lr=-1``: a job's number and swept values (all its overrides when nothing is swept)."""
        values = dict(override_values(overrides))
        named = [f"{k}={values[k]}" for k in self._swept_keys if k in values] or [unescape(o) for o in overrides]
        return f"#{num} {' '.join(named)}"

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        if self._running_job is not None and job_return.status == JobStatus.FAILED:
            self._failed_jobs.append(self._running_job)
        self._running_job = None

    def _end_stopped_sweep(self) -> None:
        """At the process's exit, a parent ``on_multirun_end`` did not end (module docstring): when its jobs ran in
        this process none is left running, so end it with the summary of its children and the failed jobs named."""
        if self._parent is None:
            return
        parent, self._parent = self._parent, None
        self._restore_env()
        collect = f"python -m recsys_runner.compare collect --parent {parent}"
        if _ENDED_JOBS:  # the launcher saw every job end (SLURM, waiting): its failed ones are named
            self._failed_jobs += [self._job_label(num, overrides) for num, overrides in _ENDED_JOBS.pop()]
            self._in_process = True
        if not self._in_process:  # jobs elsewhere (SLURM, subprocesses) may still be running: leave it to collect
            print(f"Sweep stopped early: MLflow parent run {parent} stays RUNNING; summarize it once its jobs "
                  f"have ended with: {collect}", file=sys.stderr)
            return
        failed = [*self._failed_jobs, *([self._running_job] if self._running_job else [])]
        try:
            summary = summarize(self._client, parent)
            children = child_runs(self._client, self._client.get_run(parent))
            status = "KILLED" if any(r.info.status == "KILLED" for r in children) else "FAILED"
            self._client.set_tag(parent, FAILED_JOBS_TAG, clip("; ".join(failed) or "none (the sweep itself failed)", 5000))
            finish_parent(self._client, parent, summary, status=status)
        except Exception as e:  # noqa: BLE001 - at exit: say what is left, do not mask the error that ended the sweep
            print(f"Sweep failed; could not end its MLflow parent run {parent} ({e}); do it with: {collect}",
                  file=sys.stderr)
            return
        jobs = (f"failed job(s): {'; '.join(failed)}" if failed
                else "before any job ran" if not summary.num_children else "no job failed: the sweep itself stopped")
        print(f"Sweep failed ({jobs}); {summary.num_finished} of {summary.num_children} child runs finished; "
              f"MLflow parent run {parent} ended {status}.", file=sys.stderr)

    def _set_env(self, values: Mapping[str, str]) -> None:
        """Export ``values`` to the jobs, remembering what was there to put back at the end."""
        for key, value in values.items():
            self._previous_env[key] = os.environ.get(key)
            os.environ[key] = value

    def _restore_env(self) -> None:
        for key, value in self._previous_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._previous_env = {}

    def _say_next(self, parent: str) -> None:
        """A finished sweep's last lines, as every command ends: how to compare its jobs and where the MLflow UI shows
        them (the parent's page, its children nested under it)."""
        run = self._client.get_run(parent)
        uri = run.data.tags.get("sweep.tracking_uri") or resolve_uri(None)
        store = "" if uri == resolve_uri(None) else f" --uri {shlex.quote(uri)}"
        log.info("compare its jobs (a table and plots): python -m recsys_runner.compare --parent %s%s", parent, store)
        for line in ui_lines(uri, run.info.experiment_id, parent):
            log.info("%s", line)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self._parent is None:
            return
        self._restore_env()
        collect = f"python -m recsys_runner.compare collect --parent {self._parent}"
        try:
            summary = summarize(self._client, self._parent)
            expected = int(self._client.get_run(self._parent).data.tags.get(EXPECTED_JOBS_TAG, summary.num_children))
            if summary.num_terminal < expected and (self._in_process or _ENDED_JOBS):  # every job has ended here
                log.info("every job has ended, but %d of %d child runs are still RUNNING: their end never reached the "
                         "tracking store (the lines above say how to send or end it); then summarize the sweep with: %s",
                         expected - summary.num_terminal, expected, collect)
            elif summary.num_terminal < expected:
                log.info("%d of %d jobs still running or queued; summarize later with: %s",
                         expected - summary.num_terminal, expected, collect)
            else:
                finish_parent(self._client, self._parent, summary)
                self._say_next(self._parent)
        except Exception as e:  # noqa: BLE001 - the jobs' results are safe in their own runs; only the summary waits
            log.warning("could not summarize sweep parent run %s (%s); do it later with: %s", self._parent, e, collect)
        self._parent = None
        _ENDED_JOBS.clear()  # this multirun's: a later one in this process has its own
        atexit.unregister(self._end_stopped_sweep)


def check_direction(config: DictConfig, objective: str) -> None:
    """Refuse a sweeper's ``hydra.sweeper.direction`` (Optuna's) that goes against the direction of ``objective``, the
    eval key the jobs report (:func:`higher_is_better`): minimizing ``eval/auc`` — the Optuna sweeper's default direction
    is ``minimize`` — would search for the worst trials and report one as the best, and so would maximizing a
    regression model's ``eval/mse``. A multi-objective direction (a list) is left as is.

    Raises:
        ConfigError: naming the objective, its direction and the override that fixes it.
    """
    given = OmegaConf.select(config, "hydra.sweeper.direction")  # a string, or the Optuna sweeper's default enum
    direction = str(getattr(given, "name", given)).lower() if isinstance(given, (str, Enum)) else None
    if direction not in ("maximize", "minimize"):
        return
    wanted = "maximize" if higher_is_better(objective) else "minimize"
    if direction != wanted:
        better = "higher" if wanted == "maximize" else "lower"
        source = "train.objective" if OmegaConf.select(config, "train.objective") else "the jobs' default; train.objective is unset"
        raise ConfigError(f"hydra.sweeper.direction={direction} but the objective {objective} ({source}) is "
                          f"better {better}: the search would chase its worst trials. Fix: hydra.sweeper.direction={wanted}, "
                          f"or choose another train.objective")
