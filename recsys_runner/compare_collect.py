"""``python -m recsys_runner.compare collect``: a sweep's parent run summarized once its jobs have ended.

What the ``collect`` command of :mod:`recsys_runner.compare` does before it prints and plots the sweep like the default
command: it waits for the sweep's jobs (child runs, SLURM's account of them), names the failed ones, ends the runs ended
jobs left RUNNING, writes the best trial (``best/*``) to the parent and ends it (:func:`collect`), then says which trial
was best (:func:`best_line`). :func:`wrong_parent` refuses a ``--parent`` that names no run, or, for ``collect``, a run
that is no sweep's parent. The table and the plots are :mod:`recsys_runner.compare`'s.
"""

from __future__ import annotations

import sys
import time
from functools import partial
from typing import Any

from recsys_runner.tracking.sweep import EXPECTED_JOBS_TAG, FAILED_JOBS_TAG
from recsys_runner.tracking.sweep_jobs import end_left_runs, overrides_on_disk, slurm_account
from recsys_runner.tracking.sweep_summary import SWEEP_PARENT_TAG, finish_parent, summarize, sweep_objective

__all__ = ["best_line", "collect", "wrong_parent"]


def collect(client: Any, parent: str, *, wait: bool, timeout_s: float, poll_s: float = 5.0) -> list[str] | None:
    """Summarize a sweep's parent once all its jobs ended: the jobs that failed (``[]`` when none did); ``None`` when
    ``wait`` is off or time ran out first.

    The jobs have ended when every expected child run has (:data:`EXPECTED_JOBS_TAG`), or, for a SLURM sweep, when SLURM
    says every job has (:func:`~recsys_runner.tracking.sweep_jobs.slurm_account`): a job that died before it created its
    MLflow run (a config error, an OOM kill) never adds a child, and waiting for it would last until ``--timeout``. Never
    while SLURM says a job still runs or will run again: a preempted job ended its run ``KILLED`` before SLURM requeued
    it, and the requeued job continues that run.
    Each failed job is named in a line on stderr as soon as SLURM reports it (``Job #1 (SLURM 42_1, FAILED) failed:
    Config error: …``); the parent then ends ``FAILED`` with them in its tag ``sweep.failed_jobs``, as a waiting
    launcher's would. A job that ended and left its MLflow run RUNNING — killed after the run started (``scancel``, a
    time limit, an OOM kill), or completed while the store was gone — has that run ended as soon as SLURM reports the job
    (:func:`~recsys_runner.tracking.sweep_jobs.end_left_runs`); a run whose end waits in a replay file is the replay's,
    and the summary waits for it."""
    deadline, told, said = time.monotonic() + timeout_s, set[int](), set[str]()
    while True:
        tags = client.get_run(parent).data.tags
        account = slurm_account(tags)
        ended, running = (account.ended, account.running) if account is not None else (None, {})
        on_disk = partial(overrides_on_disk, tags.get("sweep.dir"), int(tags.get(EXPECTED_JOBS_TAG, 0)))
        left = end_left_runs(client, parent, {job.num: job.end() for job in ended or []}, on_disk)
        for note in left.notes:
            if note not in said:  # once each, not at every poll
                said.add(note)
                print(note, file=sys.stderr)
        summary = summarize(client, parent)
        expected = int(tags.get(EXPECTED_JOBS_TAG, summary.num_children))
        for job in ended or []:
            if job.failed and job.num not in told:
                told.add(job.num)
                print(f"Job {job.label()} failed: {job.error}", file=sys.stderr)
        runs_ended = summary.num_children >= expected and summary.num_terminal == summary.num_children and not running
        if not left.awaiting_replay and (runs_ended or (ended is not None and len(ended) == expected)):
            failed = [job.label() for job in ended or [] if job.failed]
            if failed:
                client.set_tag(parent, FAILED_JOBS_TAG, "; ".join(failed)[:5000])
            finish_parent(client, parent, summary, status="FAILED" if failed else None)
            if failed:
                print(f"Sweep failed (failed job(s): {'; '.join(failed)}); {summary.num_finished} of {summary.num_children} "
                      f"child runs finished; MLflow parent run {parent} ended FAILED.", file=sys.stderr)
            return failed
        if not wait or time.monotonic() > deadline:
            waiting = f"; {len(left.awaiting_replay)} run(s) wait for their replay (above)" if left.awaiting_replay else ""
            num_ended = len(ended) if ended is not None else summary.num_terminal  # a requeued job's run looks ended
            print(f"sweep {parent}: {num_ended} of {expected} jobs ended{waiting}; run collect again later", file=sys.stderr)
            return None
        time.sleep(poll_s)


def wrong_parent(client: Any, uri: str, parent: str, *, collect: bool) -> str | None:
    """Why ``--parent`` cannot be used, or ``None``: no run of that id in the store (MLflow's traceback), or, for
    ``collect``, a run that is no sweep's parent (no :data:`SWEEP_PARENT_TAG`): collect would end it FAILED or FINISHED
    and log a sweep summary on it, overwriting a training run's status without a word."""
    from mlflow.exceptions import MlflowException

    fix = "Fix: --parent <the sweep's parent run id>, which a sweep prints when it starts and each child's tag mlflow.parentRunId holds"
    try:
        run = client.get_run(parent)
    except MlflowException:
        return f"no MLflow run {parent} in {uri}. {fix}"
    if not collect or SWEEP_PARENT_TAG in run.data.tags:
        return None
    sweep = run.data.tags.get("mlflow.parentRunId")
    return (f"run {parent} ({run.info.run_name}) is not a sweep's parent run (it has no tag {SWEEP_PARENT_TAG}): collect ends "
            f"a sweep's parent with its summary, and leaves other runs alone. "
            + (f"Fix: --parent {sweep}, the sweep this run is a child of" if sweep else fix))



def best_line(client: Any, parent: str) -> str:
    """What ``collect`` prints on stdout once it has summarized the sweep: the objective's best value on the parent
    (``best/<objective>``, ``nan`` when no child reported it) and the run that reached it."""
    run = client.get_run(parent)
    objective = sweep_objective(client, parent)
    return (f"sweep {parent}: best {objective}={run.data.metrics.get('best/' + objective, float('nan')):.4f} "
            f"({run.data.tags.get('best.run_name', '-')})")
