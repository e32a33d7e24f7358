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
(:func:`job_swept_values`, :func:`child_name`, :func:`child_params`), the same keys in every child: what the UI's
parallel-coordinates and contour charts plot.

``on_multirun_end`` (after the launcher returns) writes the summary of the best finished child to
the parent, a table of every child (``sweep_summary.json`` and ``sweep_summary.csv``) and ends it. A multirun that
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
import csv
import io
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from recsys_runner.errors import ConfigError, UserError, reported
from recsys_runner.metrics.registry import DEFAULT_OBJECTIVE, best_first_key, higher_is_better
from recsys_runner.tracking.store import experiment_id, open_store, resolve_uri, store_errors, uri_source
from recsys_runner.tracking.tracker import PARENT_RUN_ENV

log = logging.getLogger(__name__)

_TERMINAL = {"FINISHED", "FAILED", "KILLED"}
SWEEP_PARENT_TAG = "sweep.objective"
"""Present on a sweep's parent run only (its value is the objective's metric name)."""
EXPECTED_JOBS_TAG = "sweep.num_jobs"
"""Set on the parent by launchers that return before their jobs finish (the collector waits for this many)."""
SWEPT_KEYS_ENV = "RECSYS_RUNNER_SWEPT_KEYS"
"""The swept keys, comma-separated (``optim.lr,model``), exported to every job of a sweep with the parent's id."""
SWEPT_KEYS_TAG = "sweep.params"
"""The parent's tag listing the swept keys, comma-separated, in the order the sweep gave them."""
RANGE_PARAM, SWEPT_PARAM = "sweep.range.", "swept."
"""Param prefixes: the parent's range of each swept key, a child's value of it."""
SUMMARY_METRICS = ("eval/auc", "eval/logloss", "train/loss")
"""The metrics of each child the summary table holds, after the objective (those a child logged)."""
JOB_NUM_TAG = "sweep.job_num"
"""On a sweep job's run: the job's number in the sweep (``hydra.job.num``), by which the side that sees the job die finds
the run it left RUNNING (:func:`recsys_runner.tracking.sweep_jobs.end_dead_runs`)."""
FAILED_JOBS_TAG = "sweep.failed_jobs"
"""On a parent whose multirun stopped early: the jobs that failed (``#1 optim.lr=-1``), ``; ``-separated."""
_MAX_NAME_CHARS = 80


@dataclass(frozen=True)
class SweepSummary:
    """The state of a sweep's children, and the best finished one."""

    num_children: int
    num_finished: int
    num_terminal: int
    best_run_id: str | None
    best_value: float | None
    best_overrides: str | None


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
                _log_ranges(self._client, run.info.run_id, ranges)
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
        values = dict(_override_values(overrides))
        named = [f"{k}={values[k]}" for k in self._swept_keys if k in values] or [_unescape(o) for o in overrides]
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
            children = _children(self._client, self._client.get_run(parent))
            status = "KILLED" if any(r.info.status == "KILLED" for r in children) else "FAILED"
            self._client.set_tag(parent, FAILED_JOBS_TAG, _clip("; ".join(failed) or "none (the sweep itself failed)", 5000))
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

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self._parent is None:
            return
        self._restore_env()
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


def swept_ranges(config: DictConfig) -> dict[str, str]:
    """The keys a multirun sweeps → their values or range as given (``{"optim.lr": "0.01,0.05,0.1"}``).

    Both places a sweep is declared: the sweeper's ``hydra.sweeper.params`` (what ``sweeps/*.yaml`` set, for the
    basic and the Optuna sweeper alike), then the command line's overrides (``hydra.overrides.task``), a later one
    winning as in the sweepers. Only sweep overrides count (``a,b``, ``choice``, ``range``, ``interval``, ``glob``):
    a plain ``key=value`` there is the same in every job.
    """
    ranges = dict[str, str]()
    for text, override in sweep_overrides(config):
        ranges.pop(override.key_or_group, None)  # re-inserted last: a command-line sweep follows the file's
        ranges[override.key_or_group] = text.partition("=")[2]
    return ranges


def sweep_overrides(config: DictConfig) -> list[tuple[str, Any]]:
    """A multirun's sweep overrides, each as given (``optim.lr=0.01,0.05``) and as Hydra parsed it (its ``Override``):
    the sweeper's ``hydra.sweeper.params``, then the command line's ``hydra.overrides.task`` (see :func:`swept_ranges`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    params = OmegaConf.select(config, "hydra.sweeper.params")
    given = [str(k) + f"={v}" for k, v in params.items() if v is not None] if isinstance(params, DictConfig) else []
    given += [str(o) for o in OmegaConf.select(config, "hydra.overrides.task") or []]
    parser, swept = OverridesParser.create(), []
    for text in given:
        try:
            override = parser.parse_override(text)
        except HydraException:  # the sweeper has parsed them already; one we cannot read is no sweep we can name
            continue
        if override.is_sweep_override():
            swept.append((text, override))
    return swept


def sweep_name(ranges: Mapping[str, str]) -> str | None:
    """The parent run's name: what it tries, ``sweep optim.lr=0.01,0.05,0.1 model=deepfm,dlrm`` (each range compact,
    ``interval(0.005,0.5)`` without its tags, the whole clipped to 80 characters); ``None`` when nothing is swept."""
    if not ranges:
        return None
    return _clip("sweep " + " ".join(f"{key}={_clip(_compact(value), 40)}" for key, value in ranges.items()), _MAX_NAME_CHARS)


def job_swept_values(overrides: Sequence[str]) -> dict[str, str]:
    """In a sweep's job: the value it tries of each swept key (:data:`SWEPT_KEYS_ENV`), read from the job's overrides
    (``hydra.overrides.task``: ``optim.lr=0.05``); ``{}`` outside a sweep."""
    keys = [k for k in os.environ.get(SWEPT_KEYS_ENV, "").split(",") if k]
    if not keys or not os.environ.get(PARENT_RUN_ENV):
        return {}
    values = dict(_override_values(overrides))
    return {key: values[key] for key in keys if key in values}


def child_name(values: Mapping[str, str]) -> str | None:
    """A sweep job's run name: the values it tried, ``lr=0.05 model=dlrm`` (each key's last component, more of it
    where two would read the same: ``sparse.lr=… dense.lr=…``; long numbers to 4 significant digits); ``None``
    outside a sweep."""
    if not values:
        return None
    return _clip(" ".join(f"{_label(key, values)}={_short_value(value)}" for key, value in values.items()), _MAX_NAME_CHARS)


def _label(key: str, keys: Iterable[str]) -> str:
    """The shortest tail of ``key``'s dotted parts that no other key ends with the same way (the full key at most)."""
    parts, others = key.split("."), [k.split(".") for k in keys if k != key]
    for n in range(1, len(parts) + 1):
        if all(other[-n:] != parts[-n:] for other in others):
            return ".".join(parts[-n:])
    return key


def child_params(values: Mapping[str, str]) -> dict[str, str]:
    """A sweep job's params ``swept.<key>``: the same keys in every child, so the UI's parallel-coordinates and
    contour charts can plot them (the flattened config spells a choice like ``model`` as ``model._target_``)."""
    return {f"{SWEPT_PARAM}{key}": value for key, value in values.items()}


def child_tags(job_num: int | None) -> dict[str, str]:
    """A sweep job's run tags: its number in the sweep (:data:`JOB_NUM_TAG`); ``{}`` outside a multirun."""
    return {JOB_NUM_TAG: str(job_num)} if job_num is not None else {}


def sweep_objective(client: Any, parent_run_id: str) -> str:
    """The objective metric recorded on a sweep's parent run (``train.objective`` at launch)."""
    return client.get_run(parent_run_id).data.tags.get(SWEEP_PARENT_TAG) or DEFAULT_OBJECTIVE


def summarize(client: Any, parent_run_id: str, objective: str | None = None) -> SweepSummary:
    """Count the parent's children and find the finished child with the best ``objective``
    (the parent's recorded objective by default), in the metric's direction (:func:`higher_is_better`)."""
    objective = objective or sweep_objective(client, parent_run_id)
    children = _children(client, client.get_run(parent_run_id))
    finished = [r for r in children if r.info.status == "FINISHED" and objective in r.data.metrics]
    higher = higher_is_better(objective)
    ranked = [r for r in finished if not math.isnan(r.data.metrics[objective])]  # a NaN trial (diverged) is best at nothing
    best = min(ranked, key=lambda r: best_first_key(r.data.metrics[objective], higher), default=None)
    return SweepSummary(
        num_children=len(children),
        num_finished=len(finished),
        num_terminal=sum(r.info.status in _TERMINAL for r in children),
        best_run_id=best.info.run_id if best else None,
        best_value=best.data.metrics[objective] if best else None,
        best_overrides=best.data.tags.get("hydra.overrides") if best else None,
    )


def finish_parent(client: Any, parent_run_id: str, summary: SweepSummary, objective: str | None = None,
                  status: str | None = None) -> None:
    """Write the best child's overrides (as ``best.<key>`` params), metric and id to the parent, and end it: ``status``,
    by default ``FINISHED`` when a child finished, else ``FAILED``."""
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
    _write_summary(client, parent_run_id, objective)
    client.set_tag(parent_run_id, "sweep.num_finished", str(summary.num_finished))
    client.set_tag(parent_run_id, "sweep.num_children", str(summary.num_children))
    client.set_terminated(parent_run_id, status=status or ("FINISHED" if summary.num_finished else "FAILED"))
    if summary.best_run_id is not None:
        log.info("sweep parent %s: best %s=%.4f from run %s (%s)", parent_run_id, objective, summary.best_value,
                 summary.best_run_id, summary.best_overrides)


def summary_rows(client: Any, parent_run_id: str, objective: str) -> list[dict[str, Any]]:
    """One row per child of the sweep, best ``objective`` first (children without it last): run id, name, status,
    its ``swept.<key>`` values (from its overrides for a child logged before those params existed), the objective
    and :data:`SUMMARY_METRICS` (``None`` where a child has no value)."""
    parent = client.get_run(parent_run_id)
    keys = [k for k in parent.data.tags.get(SWEPT_KEYS_TAG, "").split(",") if k]
    metrics = list(dict.fromkeys([objective, *SUMMARY_METRICS]))
    higher = higher_is_better(objective)
    children = sorted(_children(client, parent), key=lambda r: best_first_key(r.data.metrics.get(objective), higher))
    rows = []
    for child in children:
        tried = dict(_override_values((child.data.tags.get("hydra.overrides") or "").split()))
        rows.append({"run_id": child.info.run_id, "run_name": child.info.run_name, "status": child.info.status,
                     **{f"{SWEPT_PARAM}{k}": child.data.params.get(f"{SWEPT_PARAM}{k}", tried.get(k)) for k in keys},
                     **{m: child.data.metrics.get(m) for m in metrics}})
    return rows


def _write_summary(client: Any, parent_run_id: str, objective: str) -> None:
    """The table of every child as the parent's artifacts ``sweep_summary.json`` (for scripts) and ``sweep_summary.csv``
    (for a spreadsheet or the UI's artifact view). An artifact store that fails only warns: the parent still ends."""
    try:
        rows = summary_rows(client, parent_run_id, objective)
        document = {"objective": objective, "runs": rows}
        client.log_text(parent_run_id, json.dumps(document, indent=2), "sweep_summary.json")
        client.log_text(parent_run_id, _csv(rows), "sweep_summary.csv")
    except Exception as e:  # noqa: BLE001 - the summary is a convenience; the children's runs hold everything
        log.warning("could not write the summary table of sweep %s: %s", parent_run_id, e)


def _csv(rows: Sequence[Mapping[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else ["run_id"], lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return out.getvalue()


def _children(client: Any, parent: Any) -> list[Any]:
    return list(client.search_runs([parent.info.experiment_id], max_results=10000,
                                   filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"))


def _log_ranges(client: Any, run_id: str, ranges: Mapping[str, str]) -> None:
    from mlflow.entities import Param

    if ranges:  # 6000 characters: MLflow's limit for a param's value
        client.log_batch(run_id, params=[Param(f"{RANGE_PARAM}{k}", v[:6000]) for k, v in ranges.items()])


def _override_values(overrides: Sequence[str]) -> list[tuple[str, str]]:
    """``["+x.y=2", "model@m=dlrm", "tracking.uri=sqlite\\:///a.db"]`` → ``[("x.y", "2"), ("model", "dlrm"),
    ("tracking.uri", "sqlite:///a.db")]``: one job's overrides as Hydra wrote them, spaces inside values kept."""
    pairs = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep:
            pairs.append((key.lstrip("+~").split("@")[0], _unescape(value)))
    return pairs


def _compact(value: str) -> str:
    """A sweep's values for a name: ``0.01,0.05``, ``deepfm,dlrm`` for ``choice(deepfm, dlrm)``, ``interval(0.005,0.5)``
    for ``tag(log, interval(0.005, 0.5))``; other sweeps as given, without spaces."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep

    sweep = OverridesParser.create().parse_override(f"k={value}").value()
    if isinstance(sweep, ChoiceSweep):
        return ",".join(str(v) for v in sweep.list)
    if isinstance(sweep, IntervalSweep):
        return f"interval({sweep.start},{sweep.end})"
    return value.replace(" ", "")


def _short_value(value: str) -> str:
    """``0.05`` as given; ``0.0334721651`` (an Optuna trial's) as ``0.03347``; a long text clipped."""
    try:
        number = float(value)
    except ValueError:
        return _clip(value, 24)
    return value if len(value) <= 8 else f"{number:.4g}"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


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
