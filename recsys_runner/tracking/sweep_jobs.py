"""How a sweep's jobs ended: SLURM's account of them (``sacct``, as submitit reads it), and the runs dead jobs left open.

A sweep launched with ``hydra/launcher=submitit_slurm_detached`` records its jobs' SLURM ids and submitit's folder on
its MLflow parent run (:data:`SLURM_JOB_IDS_TAG`, :data:`SUBMITIT_FOLDER_TAG`); ``python -m recsys_runner.compare
collect`` asks SLURM here which of them have ended, so a job that died before it created its MLflow run is named at
once instead of waited for. A failed job is named with its own line: the first line of the message a failure of its own
(a user error, a non-finite loss, a lost rank: :func:`recsys_runner.errors.fail`) left as the job's error result
(:class:`JobFailed`, :func:`own_failure`), else the last line of its error output (:func:`last_own_line`); the waiting
launchers name theirs the same way. A multi-task job is named by the rank that failed first, not by the others' echoes
of its end (:func:`job_failure`).

A job killed from outside — ``scancel``, a time limit, an OOM kill, SIGKILL — never reaches the end of its run
(:func:`recsys_runner.lifecycle.tracked_run`), which would stay RUNNING in MLflow for ever, without an end time. The side
that sees the job end ends it (:func:`end_left_runs`): the waiting launchers (``submitit_slurm``, ``submitit_local``) once
their jobs have ended, and ``collect`` when SLURM says a job has. Only jobs seen ended are looked at, so a run whose job
still runs is never touched.

A job that ran to its end (SLURM's ``COMPLETED``) can leave its run RUNNING too: the store was gone when the run ended.
Its tracker then wrote the run's end to ``mlflow_unsent_<run id>.json`` in the directory the run names
(:data:`~recsys_runner.tracking.outbox.UNSENT_DIR_TAG`), for ``python -m recsys_runner.tracking replay``. While that file
is there the run is the replay's: it is left RUNNING and the replay's command is said (the sweep's summary waits for it,
since the file holds the run's last metrics). Where no file is left (replayed into another store, deleted, a runner too old
to write one) nothing else would ever end the run: it is ended at the job's end time, ``FINISHED`` (``FAILED`` for a job
that failed on its own), tagged :data:`JOB_END_TAG` saying why.

A job's run is found by its number in the sweep (:data:`~recsys_runner.tracking.sweep_names.JOB_NUM_TAG`). A run from a
runner older than that tag is found by the job's overrides (the run's ``hydra.overrides`` tag,
:data:`recsys_runner.lifecycle.OVERRIDES_TAG`), only where they single it out: no other job of the sweep has the same
overrides, no other child run carries them, and the run started after the jobs were launched. Where they do not (the
jobs' overrides unknown, two jobs alike), no run is guessed: a note names the sweep's RUNNING runs left and the command
that ends one (``python -m recsys_runner.tracking end``).
"""

from __future__ import annotations

import glob
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from recsys_runner.distributed.peers import RANK_LOST_LABEL
from recsys_runner.errors import Failed
from recsys_runner.tracking.outbox import UNSENT_DIR_TAG, unsent_file
from recsys_runner.tracking.store import failure
from recsys_runner.tracking.sweep_names import JOB_NUM_TAG
from recsys_runner.tracking.sweep_summary import child_runs

SLURM_JOB_IDS_TAG = "sweep.slurm_job_ids"
"""Set with :data:`~recsys_runner.tracking.sweep.EXPECTED_JOBS_TAG` by the detached SLURM launcher: the jobs' SLURM ids in job order (``42_0 42_1``)."""
SUBMITIT_FOLDER_TAG = "sweep.submitit_folder"
"""Set with :data:`SLURM_JOB_IDS_TAG`: where submitit keeps each job's logs (absolute, ``%j`` for the job's id)."""
_SLURM_OK = "COMPLETED"
_SLURM_NOT_ENDED = ("READY", "PENDING", "RUNNING", "UNKNOWN", "REQUEUED", "COMPLETING", "PREEMPTED", "REQUEUE_HOLD",
                    "REQUEUE_FED", "RESIZING", "SUSPENDED", "CONFIGURING", "STOPPED", "SIGNALING", "STAGE_OUT")
"""SLURM states of a job that may still run (or run again: a requeued, preempted one); submitit's list and the rest."""
JOB_END_TAG = "sweep.job_end"
"""On a run its job left RUNNING when it died: how the job ended, as the side that saw it die knows — SLURM's state
(``TIMEOUT``, ``OUT_OF_MEMORY``, ``CANCELLED``, ``FAILED``, ``NODE_FAIL``, …), or :data:`DIED`."""
DIED = "DIED"
"""How a ``submitit_local`` job ended when its process left no result: submitit knows no more (killed, or crashed)."""
_FAILED_STATES = ("FAILED", "NODE_FAIL", "BOOT_FAIL")
"""End states of a job that failed (a non-zero exit, a lost node); a dead job's run ends FAILED for these, KILLED for
any other (``CANCELLED``, ``TIMEOUT``, ``OUT_OF_MEMORY``, ``DEADLINE``, :data:`DIED`): killed from outside."""


def slurm_state(raw: str) -> str:
    """``CANCELLED by 0`` → ``CANCELLED``: the state word of SLURM's account of a job (``UNKNOWN`` when empty)."""
    return (raw.split() or ["UNKNOWN"])[0].upper()


OVERRIDES_TAG = "hydra.overrides"
"""A run's overrides, as :func:`recsys_runner.lifecycle.tracked_run` tags it (that layer's ``OVERRIDES_TAG``)."""
JobOverrides = Callable[[], Mapping[int, str] | None]
"""Every job of the sweep's overrides (space-joined, as :data:`OVERRIDES_TAG` holds them) by job number, ``None`` where
not all are known: asked only when runs without :data:`~recsys_runner.tracking.sweep_names.JOB_NUM_TAG` are RUNNING."""


@dataclass(frozen=True)
class JobEnd:
    """How one job of a sweep ended, as the side that saw it end knows."""

    state: str
    """SLURM's state (``COMPLETED``, ``TIMEOUT``, ``OUT_OF_MEMORY``, …), or for a local job ``COMPLETED``, ``FAILED`` (it
    raised) or :data:`DIED`."""
    returned: bool = False
    """The job ran to its end and returned (SLURM's ``COMPLETED``, a local job with a result): the end of its run was its
    own to write, and a RUNNING run means the store was gone then (module docstring)."""
    end_ms: int | None = None
    """When the job ended, in ms since the epoch (its result file's time); ``None``: now."""


@dataclass
class LeftRuns:
    """What :func:`end_left_runs` did: the runs it ended, and the lines (for stderr) on the runs it left RUNNING."""

    ended: list[str] = field(default_factory=list)
    awaiting_replay: list[str] = field(default_factory=list)
    """Runs of jobs that returned whose end waits in a replay file: the sweep's summary waits for them."""
    notes: list[str] = field(default_factory=list)
    replay_notes: list[str] = field(default_factory=list)
    """Those of :attr:`notes` that give a run's replay command: the job's own tracker said it too, which in an in-process
    sweep was on this very console."""


def end_left_runs(client: Any, parent_run_id: str, ended: Mapping[int, JobEnd], overrides: JobOverrides | None = None,
                  since_ms: int = 0) -> LeftRuns:
    """End the runs that jobs of the sweep, seen ended, left RUNNING (module docstring); returns what was done.

    ``ended``: a job's number in the sweep → how it ended. The run of a job that died is tagged with how (:data:`JOB_END_TAG`)
    and ended KILLED (FAILED for :data:`_FAILED_STATES`), its end time now, with a line on stderr; that of a job that
    returned is left to its replay file while there is one, else ended at the job's end time. A state in which SLURM says
    a job may still run (``PENDING``, ``REQUEUED``, ``UNKNOWN``, …) is never taken for an end, whoever passes it: a run whose
    job still runs, or will run again, is left alone. ``overrides`` and ``since_ms`` (runs started before are never
    taken) find runs without a job number (:func:`job_runs`). A store that fails while one run is ended leaves a note
    naming that run and the command that ends it, and the other runs are still tried; one that fails before any run is
    found raises, and the caller says what that leaves unknown.
    """
    ended = {num: end for num, end in ended.items() if end.state not in _SLURM_NOT_ENDED}
    left = LeftRuns()
    if not ended:
        return left
    children = child_runs(client, client.get_run(parent_run_id))
    found, unknown = job_runs(children, ended, overrides, since_ms)
    for num, runs in found.items():
        for run in (r for r in runs if r.info.status == "RUNNING"):
            try:
                if ended[num].returned:
                    _end_returned(client, num, ended[num], run, left)
                else:
                    _end_dead(client, num, ended[num].state, run)
                    left.ended.append(run.info.run_id)
            except Exception as e:  # noqa: BLE001 - the store failed now: this run is known left RUNNING, the others are still ended
                left.notes.append(f"Job #{num} ({ended[num].state}) ended, but its MLflow run {run.info.run_id} "
                                  f"({run.info.run_name}), left RUNNING, could not be ended ({failure(e)}); once "
                                  f"the store is back, end it with: python -m recsys_runner.tracking end {run.info.run_id} "
                                  f"--status {_status(ended[num])} --uri {client.tracking_uri}")
    taken = {r.info.run_id for runs in found.values() for r in runs}
    still_open = [r for r in children if r.info.status == "RUNNING" and JOB_NUM_TAG not in r.data.tags
                  and r.info.run_id not in taken]
    if unknown and still_open:
        jobs = ", ".join(f"#{num} ({ended[num].state})" for num in unknown)
        listed = ", ".join(f"{r.info.run_id} ({r.info.run_name})" for r in still_open)
        left.notes.append(
            f"Sweep {parent_run_id}: job(s) {jobs} ended, but which of the sweep's RUNNING runs without {JOB_NUM_TAG} "
            f"(from an older runner) is theirs cannot be told safely: the jobs' overrides do not single it out. None was "
            f"ended. Still RUNNING: {listed}. End each one whose job has ended with: python -m recsys_runner.tracking end "
            f"<run id> --uri {client.tracking_uri}")
    return left


def job_runs(children: Iterable[Any], nums: Iterable[int], overrides: JobOverrides | None = None,
             since_ms: int = 0) -> tuple[dict[int, list[Any]], list[int]]:
    """Each job's runs among the sweep's ``children``, and the jobs whose run cannot be told apart.

    A job's runs are those tagged with its number (:data:`~recsys_runner.tracking.sweep_names.JOB_NUM_TAG`). A job with
    none, while runs without that tag are RUNNING (an older runner's), is matched by its overrides, which must single
    its run out: ``overrides()`` knows every job's, none but this job's are the same, exactly one child carries them
    (:data:`OVERRIDES_TAG`), untagged, started at ``since_ms`` or later. Otherwise the job is one whose run cannot be told
    (none when its overrides are unique and no run carries them: it died before its run).
    """
    children = list(children)
    tagged: dict[int, list[Any]] = defaultdict(list)
    for run in children:
        num = run.data.tags.get(JOB_NUM_TAG, "")
        if num.isdigit():
            tagged[int(num)].append(run)
    untagged_open = any(JOB_NUM_TAG not in r.data.tags and r.info.status == "RUNNING" for r in children)
    every: Mapping[int, str] | None = None
    found, unknown = dict[int, list[Any]](), list[int]()
    for num in nums:
        if num in tagged:
            found[num] = tagged[num]
            continue
        if not untagged_open:
            continue
        every = every if every is not None else (overrides() if overrides is not None else None) or {}
        text = every.get(num)
        if text is None or sum(other == text for other in every.values()) != 1:
            unknown.append(num)
            continue
        same = [r for r in children if r.data.tags.get(OVERRIDES_TAG) == text]
        if len(same) == 1 and JOB_NUM_TAG not in same[0].data.tags and same[0].info.start_time >= since_ms:
            found[num] = same
        elif same:
            unknown.append(num)
    return found, unknown


def _status(end: JobEnd) -> str:
    """The status a run its job left RUNNING is ended with (module docstring)."""
    if end.returned:
        return "FINISHED" if end.state == _SLURM_OK else "FAILED"
    return "FAILED" if end.state in _FAILED_STATES else "KILLED"


def _end_dead(client: Any, num: int, state: str, run: Any) -> None:
    status = _status(JobEnd(state))
    client.set_tag(run.info.run_id, JOB_END_TAG, state)
    client.set_terminated(run.info.run_id, status=status)
    print(f"Job #{num} ({state}) died before it could end its MLflow run {run.info.run_id} "
          f"({run.info.run_name}): ended it {status}", file=sys.stderr)


def _end_returned(client: Any, num: int, end: JobEnd, run: Any, left: LeftRuns) -> None:
    """The RUNNING run of a job that returned: left to its replay file while there is one, else ended (module docstring).
    A run from before :data:`UNSENT_DIR_TAG` wrote its file where its job was launched (this directory, for a launcher)."""
    file = unsent_file(run.data.tags.get(UNSENT_DIR_TAG) or Path.cwd(), run.info.run_id)
    if file.exists():
        left.awaiting_replay.append(run.info.run_id)
        left.replay_notes.append(f"Job #{num} ({end.state}) ended, but the tracking store was gone when its MLflow run "
                                 f"{run.info.run_id} ({run.info.run_name}) ended: the run stays RUNNING until its end and "
                                 f"last metrics are sent with: python -m recsys_runner.tracking replay {file}")
        left.notes.append(left.replay_notes[-1])
        return
    status = _status(end)
    client.set_tag(run.info.run_id, JOB_END_TAG, f"{end.state}: the run's end never reached the tracking store, and no "
                                                 f"replay file ({file.name}) was left")
    client.set_terminated(run.info.run_id, status=status, end_time=end.end_ms)
    left.ended.append(run.info.run_id)
    print(f"Job #{num} ({end.state}) ended, but its MLflow run {run.info.run_id} ({run.info.run_name}) never got its "
          f"end (the tracking store was gone, and no {file.name} is left to replay): ended it {status}", file=sys.stderr)


def overrides_on_disk(sweep_dir: str | None, num_jobs: int) -> dict[int, str] | None:
    """Every job's overrides as Hydra saved them in the job's folder under ``sweep_dir`` (``.hydra/hydra.yaml``:
    ``hydra.job.num``, ``hydra.overrides.task``), for a sweep that recorded them nowhere else; ``None`` unless each of
    the ``num_jobs`` jobs has exactly one such folder (a job not started yet, or folders that jobs share, leave one
    job's overrides unknown, and then another job could carry the same)."""
    if not sweep_dir or not os.path.isdir(sweep_dir):
        return None
    seen: dict[int, list[str]] = defaultdict(list)
    for folder, dirs, _ in os.walk(sweep_dir):
        if ".hydra" in dirs:
            dirs.clear()  # a job's folder: its checkpoints hold no other job's
            try:
                hydra = (yaml.safe_load((Path(folder) / ".hydra" / "hydra.yaml").read_text()) or {}).get("hydra", {})
                num, task = int(hydra["job"]["num"]), hydra["overrides"]["task"]
            except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
                return None
            seen[num].append(" ".join(str(o) for o in task))
        else:
            dirs[:] = [d for d in dirs if not d.startswith(".")]
    if sorted(seen) != list(range(num_jobs)) or any(len(found) != 1 for found in seen.values()):
        return None
    return {num: found[0] for num, found in seen.items()}


def ended_at(path: Path) -> int | None:
    """A job's end time, in ms since the epoch, as the time of a file it wrote last (submitit's result file)."""
    try:
        return int(path.stat().st_mtime * 1000)
    except OSError:
        return None


@dataclass(frozen=True)
class EndedJob:
    """A job of a detached sweep that SLURM says has ended: its number in the sweep, its SLURM id and state, and for
    a failed one the last line of its own error output."""

    num: int
    slurm_id: str
    state: str
    error: str | None
    end_ms: int | None = None
    """When it ended, where its result file says (a job that completed, or failed on its own: its error is its result)."""

    @property
    def failed(self) -> bool:
        return self.state != _SLURM_OK

    @property
    def returned(self) -> bool:
        """It ran to its end: SLURM says it completed, or it left a result (its error, :class:`JobFailed`), having ended
        its own MLflow run; any other job died."""
        return not self.failed or self.end_ms is not None

    def end(self) -> JobEnd:
        """How it ended, for :func:`end_left_runs`."""
        return JobEnd(self.state, returned=self.returned, end_ms=self.end_ms)

    def label(self) -> str:
        """``#1 (SLURM 42_1, FAILED)``, how a failed job is named on the parent and in ``collect``'s line."""
        return f"#{self.num} (SLURM {self.slurm_id}, {self.state})"


@dataclass(frozen=True)
class SlurmAccount:
    """SLURM's account of a detached sweep's jobs (:func:`slurm_account`)."""

    ended: list[EndedJob]
    """The jobs that have ended."""
    running: dict[int, str]
    """Job number → state, for the jobs SLURM says still run or will run again (``PENDING``, ``RUNNING``, a requeued
    job's ``REQUEUED``, …). A preempted job ended its MLflow run ``KILLED`` before SLURM requeued it, so its run looks
    ended until the requeued job continues it (hours later on a busy cluster): while a job is here, the sweep has not
    ended, whatever its runs say. A job SLURM keeps no record of (``UNKNOWN``) is in neither list."""


def slurm_account(tags: Mapping[str, str]) -> SlurmAccount | None:
    """SLURM's account of the jobs of a detached sweep (:data:`SLURM_JOB_IDS_TAG` on its parent; submitit asks ``sacct``);
    ``None`` when the parent names no SLURM job (another launcher) or SLURM cannot say (``sacct`` missing: every state
    ``UNKNOWN``). A job that died before it created its MLflow run (a config error, an import error, an OOM kill) shows
    only here: the parent's child runs never count it."""
    ids = tags.get(SLURM_JOB_IDS_TAG, "").split()
    if not ids:
        return None
    from submitit.slurm.slurm import SlurmJob

    folder = tags.get(SUBMITIT_FOLDER_TAG) or os.path.join(tags.get("sweep.dir", "."), ".submitit", "%j")
    jobs: list[SlurmJob[Any]] = [SlurmJob(folder=folder, job_id=job_id, tasks=(0,)) for job_id in ids]
    SlurmJob.watcher.update()  # one sacct call for the array, then each job's state from it
    states = [slurm_state(SlurmJob.watcher.get_state(job_id, mode="cache")) for job_id in ids]  # "CANCELLED by 0"
    if all(state == "UNKNOWN" for state in states):
        return None
    account = SlurmAccount(ended=[], running={})
    for num, (job, state) in enumerate(zip(jobs, states, strict=True)):
        if state in _SLURM_NOT_ENDED:
            if state != "UNKNOWN":
                account.running[num] = state
            continue
        error = None if state == _SLURM_OK else (job_failure(job.paths.result_pickle) or last_own_line(job.stderr() or "")
                                                 or f"no error output ({job.paths.stderr})")
        account.ended.append(EndedJob(num, job.job_id, state, error, ended_at(job.paths.result_pickle)))
    return account


def last_own_line(stderr: str) -> str | None:
    """A job's own last word in its error output: the last line that is not ``srun``'s (``srun: error: …``) or a
    separator; ``None`` when there is none."""
    own = [line.strip() for line in stderr.splitlines()]
    own = [line for line in own if line and not line.startswith(("srun:", "---")) and "Error stream" not in line]
    return own[-1] if own else None


class JobFailed(Failed, Exception):
    """A sweep job's failure of its own (:class:`~recsys_runner.errors.Failed`: its message already on stderr), as the
    job's launcher call raises it in the job process (``hydra_plugins/recsys_runner_detached``).

    An ``Exception``, so that submitit writes it as the job's error result at once (its traceback's text, whose last line
    is :data:`JOB_FAILED_LINE` and the message): a ``SystemExit`` left no result, and the sweep's side waited submitit's
    15 s for one, then took the job's line from its stderr. Still a ``SystemExit``, so that when submitit re-raises it the
    process exits as the command would — its status (1, 2, 75: SLURM's ``FAILED``), no traceback printed."""


JOB_FAILED_LINE = f"\n{JobFailed.__module__}.{JobFailed.__qualname__}: "
"""How a :class:`JobFailed`'s message begins in its traceback's text (``traceback.format_exception_only``)."""


def own_failure(result_pickle: Path) -> str | None:
    """A failed job's line, from the error result it left: the first line of the message of its own failure
    (:class:`JobFailed`), else, for a crash (any other error, raised again by the launcher's job side), its traceback's
    last line (``RuntimeError: …``); ``None`` for a job that left no result (died) or completed."""
    from submitit.core.utils import pickle_load

    try:
        outcome, trace = pickle_load(result_pickle)
    except Exception:  # noqa: BLE001 - none, or unreadable: the job's stderr tells instead
        return None
    if outcome != "error" or not isinstance(trace, str):
        return None
    if JOB_FAILED_LINE not in trace:
        lines = [line.strip() for line in trace.splitlines() if line.strip()]
        return lines[-1] if lines else None
    message = trace.rpartition(JOB_FAILED_LINE)[2].strip()
    return message.splitlines()[0] if message else None


def job_failure(result_pickle: Path) -> str | None:
    """A failed job's line over all of its tasks (:func:`own_failure` of each; ``result_pickle`` is task 0's).

    When one rank of a multi-task job crashes or fails on its own, the others end as lost ranks, their line an echo of
    that end (``Rank lost: rank 1 of 2 stopped: …``), and task 0's is one of them. The job's line is the first task's
    that is not such an echo, with its rank when that is not rank 0 (``rank 1: RuntimeError: …``); where every task
    left only echoes (a rank killed from outside, no result of its own), task 0's."""
    prefix = result_pickle.name.removesuffix("0_result.pkl")
    own = re.compile(re.escape(prefix) + r"(\d+)_result\.pkl")
    tasks = sorted(int(m.group(1)) for path in result_pickle.parent.glob(f"{glob.escape(prefix)}*_result.pkl")
                   if (m := own.fullmatch(path.name)))
    lines = [(task, line) for task in tasks if (line := own_failure(result_pickle.with_name(f"{prefix}{task}_result.pkl")))]
    if not lines:
        return None
    task, line = next(((t, line) for t, line in lines if not line.startswith(f"{RANK_LOST_LABEL}:")), lines[0])
    return line if task == 0 else f"rank {task}: {line}"
