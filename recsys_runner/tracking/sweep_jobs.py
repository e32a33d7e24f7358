"""How a sweep's jobs ended: SLURM's account of them (``sacct``, as submitit reads it), and the runs dead jobs left open.

A sweep launched with ``hydra/launcher=submitit_slurm_detached`` records its jobs' SLURM ids and submitit's folder on
its MLflow parent run (:data:`SLURM_JOB_IDS_TAG`, :data:`SUBMITIT_FOLDER_TAG`); ``python -m recsys_runner.compare
collect`` asks SLURM here which of them have ended, so a job that died before it created its MLflow run is named at
once instead of waited for. A failed job is named with its own last line of error output (:func:`last_own_line`,
which the waiting launchers use on submitit's error text too).

A job killed from outside — ``scancel``, a time limit, an OOM kill, SIGKILL — never reaches the end of its run
(:func:`recsys_runner.lifecycle.tracked_run`), which would stay RUNNING in MLflow for ever, without an end time. The side
that sees the job die ends it (:func:`end_dead_runs`): the waiting launchers (``submitit_slurm``, ``submitit_local``) once
their jobs have ended, and ``collect`` when SLURM says a job has. A job's run is found by its number in the sweep
(:data:`~recsys_runner.tracking.sweep_names.JOB_NUM_TAG`); only jobs seen ended are looked at, so a run whose job still runs
is never touched.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from recsys_runner.tracking.sweep_names import JOB_NUM_TAG

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


def end_dead_runs(client: Any, parent_run_id: str, dead: Mapping[int, str]) -> list[str]:
    """End the runs that jobs of the sweep left RUNNING when they died; returns their ids.

    ``dead``: a job's number in the sweep → how it ended (:data:`JOB_END_TAG`'s value), for jobs seen ended without a
    result. Each child of ``parent_run_id`` still RUNNING whose :data:`~recsys_runner.tracking.sweep_names.JOB_NUM_TAG` is one
    of them is tagged with how its job ended and ended KILLED (FAILED for :data:`_FAILED_STATES`), its end time now, with
    a line on stderr. A state in which SLURM says a job may still run (``PENDING``, ``REQUEUED``, ``UNKNOWN``, …) is
    never taken for a death, whoever passes it: a run whose job still runs, or will run again, is left alone.
    """
    dead = {num: state for num, state in dead.items() if state not in _SLURM_NOT_ENDED}
    if not dead:
        return []
    experiment = client.get_run(parent_run_id).info.experiment_id
    running = client.search_runs([experiment], max_results=10000, filter_string=(
        f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.status = 'RUNNING'"))
    ended = []
    for run in running:
        num = run.data.tags.get(JOB_NUM_TAG)
        if num is None or not num.isdigit() or int(num) not in dead:
            continue
        state = dead[int(num)]
        status = "FAILED" if state in _FAILED_STATES else "KILLED"
        client.set_tag(run.info.run_id, JOB_END_TAG, state)
        client.set_terminated(run.info.run_id, status=status)
        print(f"Job #{num} ({state}) died before it could end its MLflow run {run.info.run_id} "
              f"({run.info.run_name}): ended it {status}", file=sys.stderr)
        ended.append(run.info.run_id)
    return ended


@dataclass(frozen=True)
class EndedJob:
    """A job of a detached sweep that SLURM says has ended: its number in the sweep, its SLURM id and state, and for
    a failed one the last line of its own error output."""

    num: int
    slurm_id: str
    state: str
    error: str | None

    @property
    def failed(self) -> bool:
        return self.state != _SLURM_OK

    def label(self) -> str:
        """``#1 (SLURM 42_1, FAILED)``, how a failed job is named on the parent and in ``collect``'s line."""
        return f"#{self.num} (SLURM {self.slurm_id}, {self.state})"


def slurm_jobs_ended(tags: Mapping[str, str]) -> list[EndedJob] | None:
    """The jobs of a detached sweep (:data:`SLURM_JOB_IDS_TAG` on its parent) that have ended, by SLURM's account (submitit
    asks ``sacct``); ``None`` when the parent names no SLURM job (another launcher) or SLURM cannot say (``sacct``
    missing: every state ``UNKNOWN``). A job that died before it created its MLflow run (a config error, an import
    error, an OOM kill) shows only here: the parent's child runs never count it."""
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
    ended = []
    for num, (job, state) in enumerate(zip(jobs, states, strict=True)):
        if state in _SLURM_NOT_ENDED:
            continue
        error = None if state == _SLURM_OK else (last_own_line(job.stderr() or "") or f"no error output ({job.paths.stderr})")
        ended.append(EndedJob(num, job.job_id, state, error))
    return ended


def last_own_line(stderr: str) -> str | None:
    """A job's own last word in its error output: the last line that is not ``srun``'s (``srun: error: …``) or a
    separator; ``None`` when there is none."""
    own = [line.strip() for line in stderr.splitlines()]
    own = [line for line in own if line and not line.startswith(("srun:", "---")) and "Error stream" not in line]
    return own[-1] if own else None
