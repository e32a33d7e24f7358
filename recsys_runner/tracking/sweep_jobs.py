"""SLURM's account of a sweep's jobs: which have ended, and how (``sacct``, as submitit reads it).

A sweep launched with ``hydra/launcher=submitit_slurm_detached`` records its jobs' SLURM ids and submitit's folder on
its MLflow parent run (:data:`SLURM_JOB_IDS_TAG`, :data:`SUBMITIT_FOLDER_TAG`); ``python -m recsys_runner.compare
collect`` asks SLURM here which of them have ended, so a job that died before it created its MLflow run is named at
once instead of waited for. A failed job is named with its own last line of error output (:func:`last_own_line`,
which the waiting launchers use on submitit's error text too).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SLURM_JOB_IDS_TAG = "sweep.slurm_job_ids"
"""Set with :data:`~recsys_runner.tracking.sweep.EXPECTED_JOBS_TAG` by the detached SLURM launcher: the jobs' SLURM ids in job order (``42_0 42_1``)."""
SUBMITIT_FOLDER_TAG = "sweep.submitit_folder"
"""Set with :data:`SLURM_JOB_IDS_TAG`: where submitit keeps each job's logs (absolute, ``%j`` for the job's id)."""
_SLURM_OK = "COMPLETED"
_SLURM_NOT_ENDED = ("READY", "PENDING", "RUNNING", "UNKNOWN", "REQUEUED", "COMPLETING", "PREEMPTED", "REQUEUE_HOLD",
                    "REQUEUE_FED", "RESIZING", "SUSPENDED", "CONFIGURING", "STOPPED", "SIGNALING", "STAGE_OUT")
"""SLURM states of a job that may still run (or run again: a requeued, preempted one); submitit's list and the rest."""


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
    states = [SlurmJob.watcher.get_state(job_id, mode="cache").split()[0].upper() for job_id in ids]  # "CANCELLED by 0"
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
