"""Preemption → requeue → resume, one MLflow run: on submitit's SIGUSR2 training finishes the step, checkpoints,
closes the MLflow run (KILLED, ``preempted=true``) and hands over to submitit, which resubmits the same Hydra job
into the same sweep dir; the requeued job resumes from ``<job dir>/checkpoints`` into the same MLflow run.

Against the real test SLURM cluster (``scancel --signal=USR2``: what SLURM sends ahead of a time limit with
``--signal=USR2@<signal_delay_s>``; SLURM tests skip loudly where the cluster cannot run) and with
``submitit_local`` (always on: the job's process gets SIGUSR2 directly, submitit's local controller restarts it; that
sweep also stands for every ``submitit_local`` sweep that ends well: its parent run found by the job, ended FINISHED).
The SLURM sweep has a second job, preempted in its sanity eval, before any step or checkpoint (tests/job_hooks.py sends it
SIGUSR2 there): its requeued launch has no checkpoint to resume and continues the MLflow run its first launch recorded
in its checkpoint directory (tests/test_requeue.py has the rules, in one process without submitit).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from recsys_runner.tracking.sweep_names import JOB_NUM_TAG
from recsys_runner.tracking.sweep_summary import SWEEP_PARENT_TAG
from tests import job_hooks
from tests.conftest import REPO, TINY
from tests.slurm_cluster import SlurmCluster, slurm_cluster_fixture  # noqa: F401 - provides the slurm_cluster fixture

pytestmark = pytest.mark.slow

STEPS = 80


def _args(tmp_path: Path, experiment: str) -> list[str]:
    return [*[a for a in TINY if not a.startswith("train.")], f"train.num_steps={STEPS}", "train.log_every_steps=1",
            "train.eval_every_steps=null", "train.eval_max_batches=2", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"tracking.experiment={experiment}"]


def _multirun(tmp_path: Path, *args: str, pythonpath: str = str(REPO)) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.Popen([sys.executable, "-m", "recsys_runner", "-m", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _sweep_dirs(tmp_path: Path) -> list[Path]:
    """The sweep's folder: ``hydra.sweep.dir`` where given (``<tmp>/sweep``), else the default ``multirun/<date>/<time>``
    (``${new_dir:…}``): a launch that resolved it again would add ``<time>_2``."""
    return sorted([*tmp_path.glob("sweep"), *tmp_path.glob("multirun/*/*")])


def _job_logs(tmp_path: Path, job: str = "*") -> str:
    """The logs of the sweep's jobs, or of SLURM array task ``job`` (``<array id>_<job>``)."""
    folder = "*" if job == "*" else f"*_{job}"
    return "".join(p.read_text(errors="replace") for d in _sweep_dirs(tmp_path)
                   for p in sorted(d.glob(f".submitit/{folder}/*_log.*")))


def _wait_for(what: str, ready: Callable[[], object], proc: subprocess.Popen[str], timeout_s: float, tmp_path: Path) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    out = proc.stdout.read() if proc.poll() is not None and proc.stdout else ""
    raise AssertionError(f"{what}: not seen after {timeout_s}s\n{out[-3000:]}\n{_job_logs(tmp_path)[-5000:]}")


def _one_run_per_job(tmp_path: Path, experiment: str, jobs: int) -> dict[str, Any]:
    """Each job's one training run (by its job number), FINISHED, continued after the requeue (``resumed``, ``preempted``),
    each step logged once, before and after the requeue."""
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = [r for r in client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
            if SWEEP_PARENT_TAG not in r.data.tags]
    by_job = {r.data.tags.get(JOB_NUM_TAG, "(none)"): r for r in runs}
    assert len(runs) == jobs and sorted(by_job) == [str(n) for n in range(jobs)], [r.data.tags.get(JOB_NUM_TAG) for r in runs]
    for child in runs:
        assert child.info.status == "FINISHED", child.info.status
        assert child.data.tags.get("resumed") == "true" and child.data.tags.get("preempted") == "true", child.data.tags
        steps = sorted(m.step for m in client.get_metric_history(child.info.run_id, "train/loss"))
        assert steps == list(range(1, STEPS + 1)), steps[:10]
    return by_job


def _check_resumed_from_a_checkpoint(tmp_path: Path, experiment: str, proc: subprocess.Popen[str], extra: str = "",
                                     job: str = "*", jobs: int = 1) -> dict[str, Any]:
    """The sweep ended well; job ``job`` (its number: ``0``) was requeued and resumed from its checkpoint in its job dir,
    into its one MLflow run. Returns each job's run (:func:`_one_run_per_job`)."""
    out, _ = proc.communicate(timeout=600)
    logs = _job_logs(tmp_path, job)
    assert proc.returncode == 0, out[-3000:] + _job_logs(tmp_path)[-6000:] + extra
    assert "handing over to submitit" in logs and "Requeued job" in logs, logs[-6000:]
    (sweep,) = _sweep_dirs(tmp_path)  # the requeued jobs wrote into the launch's folder, no new one
    ckpts = sweep / "0" / "checkpoints"
    assert f"resuming from {ckpts}" in logs, "the requeued job resumed from the same job dir"
    resumed_at = int(logs.split(f"resuming from {ckpts}/step_")[1][:8])
    assert 0 < resumed_at < STEPS, resumed_at
    return _one_run_per_job(tmp_path, experiment, jobs)


@pytest.mark.usefixtures("store_uri")  # the sweep's store, tmp_path/mlflow.db, made once per session
def test_slurm_preemption_requeues_and_resumes_into_the_same_run(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """In the sweep's default folder (``${new_dir:…}``, resolved once by the launch and carried to the requeued jobs):
    job #0 is preempted at step 5 and resumes from its checkpoint; job #1 is preempted in its sanity eval, with no
    step trained and no checkpoint written, and its requeued launch continues the same MLflow run from step 0."""
    marker = tmp_path / "job1_preempted"
    hooks = job_hooks.install(tmp_path / "hooks", f"preempted_in_the_sanity_eval('optim.lr=0.02', {str(marker)!r})")
    proc = _multirun(tmp_path, "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=10", "hydra.launcher.cpus_per_task=1",
                     "optim.lr=0.01,0.02", *_args(tmp_path, "slurm_preempt"), pythonpath=hooks)
    try:
        _wait_for("training step 5 in job #0's log", lambda: f"step 5/{STEPS}" in _job_logs(tmp_path, "0"), proc, 300, tmp_path)
        (job_id,) = [p.name for d in _sweep_dirs(tmp_path) for p in d.glob(".submitit/*_0")]
        # What SLURM sends ahead of the time limit (--signal=USR2@signal_delay_s), to the job's srun step.
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, env={**os.environ, **slurm_cluster.env}, timeout=30)
        runs = _check_resumed_from_a_checkpoint(tmp_path, "slurm_preempt", proc, slurm_cluster.logs(), job="0", jobs=2)
        logs = _job_logs(tmp_path, "1")
        assert marker.exists() and "stopped by SIGUSR2 during the sanity eval" in logs, logs[-6000:]
        assert "handing over to submitit" in logs and "Requeued job" in logs, logs[-6000:]
        assert f"continuing MLflow run {runs['1'].info.run_id}, preempted before its first checkpoint" in logs, logs[-6000:]
        assert "resuming from" not in logs, "job #1 had no checkpoint to resume"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _local_task_pid(tmp_path: Path) -> int | None:
    """The submitit_local job's Python process (``python -m submitit.core._submit <sweep>/.submitit/...``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"submitit.core._submit" in cmd and any(str(tmp_path).encode() in c for c in cmd):
            return int(entry.name)
    return None


@pytest.mark.usefixtures("store_uri")  # the sweep's store, tmp_path/mlflow.db, made once per session
def test_submitit_local_preemption_requeues_and_resumes_into_the_same_run(tmp_path: Path) -> None:
    """Also what any ``submitit_local`` sweep that ends well shows (tests/test_sweeps.py has the failed job's side): the
    job in its submitit subprocess found the parent run (the environment survived pickling and the subprocess), left its
    result file, and the parent ended FINISHED with the best child's objective."""
    proc = _multirun(tmp_path, "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10", *_args(tmp_path, "local_preempt"),
                     f"hydra.sweep.dir={tmp_path}/sweep")
    try:
        _wait_for("training step 5 in the local job's log", lambda: f"step 5/{STEPS}" in _job_logs(tmp_path), proc, 300, tmp_path)
        pid = _wait_for("the local job's process", lambda: _local_task_pid(tmp_path), proc, 30, tmp_path)
        os.kill(int(pid), signal.SIGUSR2)  # type: ignore[call-overload]
        (child,) = _check_resumed_from_a_checkpoint(tmp_path, "local_preempt", proc).values()
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
        (parent,) = [r for r in client.search_runs([client.get_experiment_by_name("local_preempt").experiment_id])
                     if SWEEP_PARENT_TAG in r.data.tags]
        assert child.data.tags.get("mlflow.parentRunId") == parent.info.run_id
        assert parent.info.status == "FINISHED" and "best/eval/auc" in parent.data.metrics, (parent.info, parent.data.metrics)
        assert list((tmp_path / "sweep" / ".submitit").glob("*/*_result.pkl"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
