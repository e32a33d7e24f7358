"""The project's Hydra launchers: ``hydra/launcher=submitit_slurm_detached`` submits a sweep to SLURM and returns
(submit-and-exit); ``hydra/launcher=submitit_slurm`` waits for every job of the array, a failed one included, and so
does ``hydra/launcher=submitit_local`` (the same jobs as local subprocesses);
``hydra/launcher=basic_keep_going`` (the default) runs a sweep's jobs here, one after the other,
going on past a failed one.

A Hydra plugin module (Hydra instantiates launchers only from the ``hydra_plugins`` namespace);
the recsys_runner side of launching lives in :mod:`recsys_runner.distributed.launch`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from unittest.mock import patch

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher, LocalLauncher, SlurmLauncher

from recsys_runner.paths import register_resolvers

log = logging.getLogger(__name__)
register_resolvers()  # conf/config.yaml's ${new_dir:…}: Hydra imports this module in every process it composes in


class _OwnFailuresAreErrors(BaseSubmititLauncher):
    """The plugin's submitit launcher whose job (its ``__call__``, run in the job's process) ends on a failure of the
    command's own — one line on stderr and exit 2 for a user error, 1 for a non-finite loss, 75 for a lost rank
    (:func:`recsys_runner.errors.fail`) — by raising it as a :class:`~recsys_runner.tracking.sweep_jobs.JobFailed`.

    Such an exit is a ``SystemExit``, which passes Hydra's ``run_job`` and submitit's job wrapper alike: the job left no
    result, and the launcher waited submitit's ``_results_timeout_s`` (15 s) for one, job after failed job, then took the
    job's line from its stderr (as ``compare collect`` did from SLURM's log). A ``JobFailed`` is an ``Exception`` to
    submitit, which writes it as the job's error result at once, and a ``SystemExit`` to the process, which still exits
    with the command's status (SLURM's ``FAILED``) and prints no traceback. A signal's exit (a preempted job handed over
    to submitit's requeue, a ``scancel``) is no failure of the command's own and passes as it did.

    A crash (an error of no kind the command knows: a bug, a CUDA out-of-memory) is raised again: Hydra's ``run_job``
    keeps any ``Exception`` of the task as a ``FAILED`` result, which submitit then wrote as the job's success, the
    process exiting 0 with no traceback in its log: SLURM said ``COMPLETED`` and ``compare collect`` counted the job
    among those that succeeded. Raised, it is the job's error result (its traceback's last line names it), its
    traceback is in the job's log, and the process exits 1 (SLURM's ``FAILED``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        from recsys_runner.errors import Failed
        from recsys_runner.tracking.sweep_jobs import JobFailed

        try:
            returned = super().__call__(*args, **kwargs)
        except Failed as e:
            raise JobFailed(e.code, e.message) from None
        if returned.status == JobStatus.FAILED and isinstance(returned._return_value, BaseException):
            raise returned._return_value
        return returned


SRUN_ARGS = ("--kill-on-bad-exit=1",)
"""What every SLURM job's ``srun`` is given: a task that exits non-zero ends its job's other tasks (SIGTERM, then SIGKILL
after SLURM's ``KillWait``), as torchrun ends a group's other workers. Without it a multi-task job whose rank 0 failed
before the group formed (a config error, a taken ``MASTER_PORT``) kept its other ranks waiting on the rendezvous for
``distributed.timeout_s`` (30 minutes), holding the allocation, the sweep waiting on them. ``submitit_local``'s jobs do
the same in their controller (:class:`_LocalTasksEndTogether`)."""


class _SlurmTasksEndTogether(SlurmLauncher):
    """The plugin's SLURM launcher whose jobs run ``srun`` with :data:`SRUN_ARGS` (the plugin's schema has no
    ``srun_args``; submitit's executor takes them)."""

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.params["srun_args"] = list(SRUN_ARGS)


class _LocalTasksEndTogether(LocalLauncher):
    """The plugin's local launcher whose jobs' tasks end together, as :data:`SRUN_ARGS` has SLURM end a job's: each job's
    controller process (submitit's, which starts the job's tasks and waits for them) is
    :class:`recsys_runner.distributed.local_tasks.TasksEndTogether`, which sends the other tasks SIGTERM, then SIGKILL
    30 s later, once one has failed (any exit but 0, a requeue, or a stop on a signal)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from submitit.local import local

        from recsys_runner.distributed.local_tasks import start_controller

        with patch.object(local, "start_controller", start_controller):  # submitit's own again on exit
            return super().launch(job_overrides, initial_job_idx)


class DetachedSlurmLauncher(_OwnFailuresAreErrors, _SlurmTasksEndTogether):
    """``submitit_slurm`` that returns once the array is queued (submit-and-exit).

    Everything but the wait is the plugin's own ``launch``: executor, parameters, sweep dir, job
    array. Records the number of jobs, their SLURM ids and submitit's folder on the sweep's MLflow parent run, so that
    ``python -m recsys_runner.compare collect`` knows how many children to wait for, and which job ended without one. Sweepers that
    need results to continue (Optuna) cannot use it.
    """

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from recsys_runner.errors import ConfigError
        from recsys_runner.tracking.sweep import EXPECTED_JOBS_TAG
        from recsys_runner.tracking.sweep_jobs import SLURM_JOB_IDS_TAG, SUBMITIT_FOLDER_TAG
        from recsys_runner.tracking.tracker import PARENT_RUN_ENV

        assert self.config is not None
        sweeper = str(self.config.hydra.sweeper.get("_target_", ""))
        if not sweeper.endswith("BasicSweeper"):
            raise ConfigError(f"hydra/launcher=submitit_slurm_detached returns before jobs finish, but {sweeper} needs their "
                              "results; use hydra/launcher=submitit_slurm")
        with _results_are_job_ids():
            returns = super().launch(job_overrides, initial_job_idx)
        job_ids = [str(r.return_value) for r in returns]
        parent = os.environ.get(PARENT_RUN_ENV)
        if parent:
            client = _client(self.config)
            client.set_tag(parent, EXPECTED_JOBS_TAG, str(len(job_ids)))
            client.set_tag(parent, SLURM_JOB_IDS_TAG, " ".join(job_ids))
            client.set_tag(parent, SUBMITIT_FOLDER_TAG, os.path.abspath(str(self.params["submitit_folder"])))
        log.info("submitted SLURM jobs %s; collect with: python -m recsys_runner.compare collect --parent %s --wait",
                 " ".join(job_ids), parent)
        return returns


FAILED_JOB_EXITS = (1, 2)
"""The exit statuses of a job that failed on its own (1: training failed, e.g. a non-finite loss; 2: a user error), after
which the other jobs of a sweep still run. Any other (a signal's 128 + n) stops the sweep at once."""


class KeepGoingLauncher(BasicLauncher):
    """Hydra's basic launcher (the jobs in this process, one after the other) that goes on past a failed job.

    A recsys_runner job ends its process on a failure — one line and exit 2 for a user error, exit 1 for a non-finite
    loss (``recsys_runner.lifecycle.exit_codes``) — and ``SystemExit`` passes through Hydra's ``run_job``: the basic
    launcher would stop the sweep at the first bad grid point, the points after it never run. Here each job runs in
    its own call of the basic launcher's ``launch``; one that exits :data:`FAILED_JOB_EXITS` is noted and the next
    one runs; once the batch is done the process exits with the first failed job's status, so the sweep fails as a
    whole (the MLflow parent run ends FAILED, naming the failed jobs: ``recsys_runner.tracking.sweep``).

    A job that returned or failed here has a known end: once it has, a run it left RUNNING — its end never reached the
    tracking store — is ended as the waiting launchers end theirs (:func:`_end_left_runs`): left to its replay file while
    there is one (its tracker printed the replay command, on this console), else ended at the job's end, tagged why."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from recsys_runner.tracking.sweep_jobs import JobEnd

        returns: list[JobReturn] = []
        failed: list[tuple[int, int]] = []  # (job number, exit status)
        log.info("Launching %d jobs locally (a failed one does not stop the others)", len(job_overrides))
        basic_log, one_line = logging.getLogger(BasicLauncher.__module__), _DropLaunchingOne()
        basic_log.addFilter(one_line)  # its "Launching 1 jobs locally" before every job says nothing
        try:
            for offset, overrides in enumerate(job_overrides):
                num, started_ms = initial_job_idx + offset, int(time.time() * 1000)
                try:
                    job = super().launch([overrides], num)
                    state = "COMPLETED" if all(r.status == JobStatus.COMPLETED for r in job) else "FAILED"  # raised
                    returns.extend(job)
                except SystemExit as e:
                    if e.code not in FAILED_JOB_EXITS:
                        raise
                    failed.append((num, int(e.code)))
                    state = "FAILED"
                ends = {num: JobEnd(state, returned=True, end_ms=int(time.time() * 1000))}
                _end_left_runs(self.config, ends, {num: " ".join(overrides)}, started_ms, tracker_said_replays=True)
        finally:
            basic_log.removeFilter(one_line)
        if failed:
            numbers = ", ".join(f"#{num} (exit {code})" for num, code in failed)
            log.error("%d of %d jobs failed: %s", len(failed), len(job_overrides), numbers)
            sys.exit(failed[0][1])
        return returns


class WaitingSubmititLauncher(_OwnFailuresAreErrors):
    """The plugin's submitit launcher that waits for every job and reports a failed one in a line; the executor is the
    subclass's (:class:`WaitingSlurmLauncher`, :class:`WaitingLocalLauncher`).

    The plugin's ``launch`` ends with ``[j.results()[0] for j in jobs]``: the first failed job raises submitit's
    ``UncompletedJobError`` while the jobs after it still run, and Hydra prints its 30-line traceback, the job's own
    one-line error (``Config error: …``) buried inside, and the sweep's MLflow parent is left RUNNING. Here each
    job's failure becomes a ``FAILED`` result (:func:`_failures_are_results`); once every job has ended, each failed
    one is named with its own line (:func:`_error_line`), the parent is ended FAILED naming them
    (``recsys_runner.tracking.sweep.jobs_ended``), and the command exits 1. A job that left its MLflow run RUNNING —
    killed after the run started (``scancel``, a time limit, an OOM kill, SIGKILL), or ended while the tracking store was
    gone — has it ended first, tagged with how the job ended, unless a replay file holds the run's end
    (:func:`recsys_runner.tracking.sweep_jobs.end_left_runs`)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from submitit.core.utils import UncompletedJobError

        from recsys_runner.tracking.sweep import jobs_ended

        launched_ms = int(time.time() * 1000)  # this batch's runs start later: an earlier batch's are never taken for them
        with _failures_are_results() as jobs:
            returns = super().launch(job_overrides, initial_job_idx)
        failed = [(initial_job_idx + i, overrides, r) for i, (overrides, r) in enumerate(zip(job_overrides, returns, strict=True))
                  if r.status == JobStatus.FAILED]
        # A job that raised (its own failure too: _OwnFailuresAreErrors) left its error as its result, its run ended by
        # the job itself; one that left none died.
        ends = {initial_job_idx + i: _job_end(job, r, isinstance(r._return_value, UncompletedJobError))
                for i, (job, r) in enumerate(zip(jobs, returns, strict=True))}
        _end_left_runs(self.config, ends, {initial_job_idx + i: " ".join(o) for i, o in enumerate(job_overrides)}, launched_ms)
        jobs_ended([(num, list(overrides)) for num, overrides, _ in failed])
        if failed:
            for num, _, r in failed:
                print(f"Job #{num} failed: {_error_line(jobs[num - initial_job_idx], r._return_value)}", file=sys.stderr)
            log.error("%d of %d jobs failed: %s", len(failed), len(job_overrides), ", ".join(f"#{num}" for num, _, _ in failed))
            sys.exit(1)
        return returns


class WaitingSlurmLauncher(WaitingSubmititLauncher, _SlurmTasksEndTogether):
    """``hydra/launcher=submitit_slurm``: the plugin's SLURM launcher, waiting for every job of the array
    (:class:`WaitingSubmititLauncher`)."""


class WaitingLocalLauncher(WaitingSubmititLauncher, _LocalTasksEndTogether):
    """``hydra/launcher=submitit_local``: the plugin's local-subprocess launcher, waiting for every job
    (:class:`WaitingSubmititLauncher`), as ``submitit_slurm`` and ``basic_keep_going`` do, a job's tasks ending together
    (:class:`_LocalTasksEndTogether`)."""


def _error_line(job: Any, error: Exception) -> str:
    """A failed job's own line: the first line of the message its own failure left as its result, the rank that failed
    first for a multi-task job (:func:`recsys_runner.tracking.sweep_jobs.job_failure`); else, from submitit's ``error``
    (for a job that left no result its stderr follows ``Error stream produced:``), the last line that is not srun's
    own, else its first line."""
    from recsys_runner.tracking.sweep_jobs import job_failure, last_own_line

    text = str(error)
    own = last_own_line(text.split("Error stream produced:")[-1]) if "Error stream produced:" in text else None
    return job_failure(job.paths.result_pickle) or own or text.strip().splitlines()[0]


def _end_left_runs(config: Any, ends: Mapping[int, Any], overrides: Mapping[int, str], launched_ms: int, *,
                   tracker_said_replays: bool = False) -> None:
    """The MLflow runs the jobs (number → how each ended, a :class:`recsys_runner.tracking.sweep_jobs.JobEnd`) left
    RUNNING, ended (:func:`recsys_runner.tracking.sweep_jobs.end_left_runs`), a line on stderr for each one left.
    ``tracker_said_replays``: the jobs ran in this process, whose console has its tracker's line with the replay
    command of a run left to its replay file; that command is not said twice.

    A store that cannot be reached now only says so where that leaves something unknown that matters: a job that died,
    whose run may show RUNNING. A job that returned ended its own run, or left its end in a replay file and said so:
    a healthy sweep whose store is gone as it ends prints nothing of the kind."""
    from recsys_runner.tracking.store import failure, is_remote, no_http_retries
    from recsys_runner.tracking.sweep_jobs import end_left_runs
    from recsys_runner.tracking.tracker import PARENT_RUN_ENV

    parent = os.environ.get(PARENT_RUN_ENV)
    if parent is None or config is None:  # no MLflow parent: tracking is off
        return
    client = _client(config)
    try:
        with no_http_retries(is_remote(client.tracking_uri)):  # an outage answers in seconds, not after minutes of retries
            left = end_left_runs(client, parent, ends, lambda: overrides, since_ms=launched_ms)
    except Exception as e:  # noqa: BLE001 - the jobs have ended; only their runs' status is left to fix
        died = [f"#{num} ({end.state})" for num, end in ends.items() if not end.returned]
        if died:
            print(f"Could not check the MLflow runs of the sweep's jobs ({failure(e)}): job(s) {', '.join(died)} "
                  f"died, and a run of theirs may show RUNNING; once the store is back, end it with: python -m "
                  f"recsys_runner.tracking end <run id> --uri {client.tracking_uri}", file=sys.stderr)
        return
    for note in left.notes:
        if not (tracker_said_replays and note in left.replay_notes):
            print(note, file=sys.stderr)


def _client(config: Any) -> Any:
    """The MLflow client of the sweep's store (``tracking.uri``, as its jobs resolve it)."""
    from mlflow.tracking import MlflowClient

    from recsys_runner.tracking.store import resolve_uri

    return MlflowClient(tracking_uri=resolve_uri(config.tracking.get("uri")))


def _job_end(job: Any, result: JobReturn, died: bool) -> Any:
    """How a submitit job ended (a :class:`recsys_runner.tracking.sweep_jobs.JobEnd`). One that ``died`` (left no result):
    SLURM's state (``TIMEOUT``, ``OUT_OF_MEMORY``, ``CANCELLED``, …), for a local job, whose process submitit only saw
    end, ``DIED``. One that returned (completed, or raised: its error is its result): ``COMPLETED`` or ``FAILED``, at the
    time of its result file."""
    from submitit.local.local import LocalJob

    from recsys_runner.tracking.sweep_jobs import DIED, JobEnd, ended_at, slurm_state

    if died:
        return JobEnd(DIED if isinstance(job, LocalJob) else slurm_state(job.state))
    state = "COMPLETED" if result.status == JobStatus.COMPLETED else "FAILED"
    return JobEnd(state, returned=True, end_ms=ended_at(job.paths.result_pickle))


@contextmanager
def _failures_are_results() -> Iterator[list[Any]]:
    """While the plugin's ``launch`` runs, a job that failed answers ``results()`` with a ``FAILED`` result (its error
    as the value) instead of raising, so the plugin waits for every job (as :func:`_results_are_job_ids` does). Yields
    the submitted submitit jobs, in job order, once ``launch`` has submitted them. A local job that left no result (it
    died) is said to have at once, without submitit's wait for a result a shared file system shows late."""
    import submitit
    from submitit.core.utils import FailedJobError, UncompletedJobError
    from submitit.local.local import LocalJob

    class Failed:
        def __init__(self, job: Any) -> None:
            self.job = job
            if isinstance(job, LocalJob):
                # submitit waits _results_timeout_s (15 s) for a result that a shared file system may show late; a
                # local job's result is written on this host by a process that has exited once the job is done, so
                # one that is not there never comes (a job killed mid-training): said at once, not 15 s later.
                job._results_timeout_s = 0

        def results(self) -> list[JobReturn]:
            try:
                return list(self.job.results())
            except (FailedJobError, UncompletedJobError) as e:
                return [JobReturn(status=JobStatus.FAILED, _return_value=e)]

    submitted: list[Any] = []

    class WaitForAllExecutor(submitit.AutoExecutor):
        def map_array(self, fn: Callable[..., Any], *iterable: Iterable[Any]) -> list[Any]:
            jobs = super().map_array(fn, *iterable)
            submitted.extend(jobs)
            return [Failed(j) for j in jobs]

    with patch.object(submitit, "AutoExecutor", WaitForAllExecutor):
        yield submitted


class _DropLaunchingOne(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Launching 1 jobs locally"


class _Queued:
    """A submitted job as the plugin's ``launch`` sees it: its result, its SLURM id, is there at once."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id

    def results(self) -> list[JobReturn]:
        # "Completed" from the sweeper's point of view: submitting was the job; the value is the SLURM id.
        return [JobReturn(status=JobStatus.COMPLETED, _return_value=self.job_id)]


@contextmanager
def _results_are_job_ids() -> Iterator[None]:
    """While the plugin's ``launch`` runs, its executor's jobs answer ``results()`` without waiting.

    The plugin's ``launch`` ends with ``executor.map_array(...)`` then ``[j.results()[0] for j in jobs]``,
    which blocks until every job has run; it builds its executor from ``submitit.AutoExecutor``, looked
    up when it runs, so for this call that name is a subclass whose ``map_array`` submits as usual and
    hands back :class:`_Queued` jobs. Launching is single-threaded, and the name is restored on exit.
    """
    import submitit

    class SubmitOnlyExecutor(submitit.AutoExecutor):
        def map_array(self, fn: Callable[..., Any], *iterable: Iterable[Any]) -> list[Any]:
            return [_Queued(j.job_id) for j in super().map_array(fn, *iterable)]

    with patch.object(submitit, "AutoExecutor", SubmitOnlyExecutor):  # the library's class again on exit
        yield
