"""Preemption → requeue → resume, one MLflow run: on submitit's SIGUSR2 training finishes the step, checkpoints,
closes the MLflow run (KILLED, ``preempted=true``) and hands over to submitit, which resubmits the same Hydra job
into the same sweep dir; the requeued job resumes from ``<job dir>/checkpoints`` into the same MLflow run.

Against the real test SLURM cluster (``scancel --signal=USR2``: what SLURM sends ahead of a time limit with
``--signal=USR2@<signal_delay_s>``; SLURM tests skip loudly where the cluster cannot run) and with
``submitit_local`` (always on: the job's process gets SIGUSR2 directly, submitit's local controller restarts it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from recsys_runner.tracking.sweep_summary import SWEEP_PARENT_TAG
from tests.conftest import REPO, TINY
from tests.slurm_cluster import SlurmCluster, slurm_cluster_fixture  # noqa: F401 - provides the slurm_cluster fixture

pytestmark = pytest.mark.slow

STEPS = 80


def _args(tmp_path: Path, experiment: str) -> list[str]:
    return [*[a for a in TINY if not a.startswith("train.")], f"train.num_steps={STEPS}", "train.log_every_steps=1",
            "train.eval_every_steps=null", "train.eval_max_batches=2", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"tracking.experiment={experiment}", f"hydra.sweep.dir={tmp_path}/sweep"]


def _multirun(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.Popen([sys.executable, "-m", "recsys_runner", "-m", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _job_logs(tmp_path: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((tmp_path / "sweep").glob(".submitit/*/*_log.*")))


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


def _check_one_resumed_run(tmp_path: Path, experiment: str, proc: subprocess.Popen[str], extra: str = "") -> None:
    out, _ = proc.communicate(timeout=600)
    logs = _job_logs(tmp_path)
    assert proc.returncode == 0, out[-3000:] + logs[-6000:] + extra
    assert "handing over to submitit" in logs and "Requeued job" in logs, logs[-6000:]
    ckpts = tmp_path / "sweep" / "0" / "checkpoints"
    assert f"resuming from {ckpts}" in logs, "the requeued job resumed from the same job dir"
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    (child,) = [r for r in runs if SWEEP_PARENT_TAG not in r.data.tags]  # exactly one training run
    assert child.info.status == "FINISHED", child.info.status
    assert child.data.tags.get("resumed") == "true" and child.data.tags.get("preempted") == "true", child.data.tags
    steps = sorted(m.step for m in client.get_metric_history(child.info.run_id, "train/loss"))
    assert steps == list(range(1, STEPS + 1)), steps[:10]  # before and after the requeue, no step twice
    resumed_at = int(logs.split(f"resuming from {ckpts}/step_")[1][:8])
    assert 0 < resumed_at < STEPS, resumed_at


def test_slurm_preemption_requeues_and_resumes_into_the_same_run(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    proc = _multirun(tmp_path, "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=10", "hydra.launcher.cpus_per_task=1",
                     *_args(tmp_path, "slurm_preempt"))
    try:
        _wait_for("training step 5 in the SLURM job's log", lambda: f"step 5/{STEPS}" in _job_logs(tmp_path), proc, 300, tmp_path)
        job_id = slurm_cluster.squeue("-h", "-o", "%i").split()[0]
        # What SLURM sends ahead of the time limit (--signal=USR2@signal_delay_s), to the job's srun step.
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, env={**os.environ, **slurm_cluster.env}, timeout=30)
        _check_one_resumed_run(tmp_path, "slurm_preempt", proc, slurm_cluster.logs())
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


def test_submitit_local_preemption_requeues_and_resumes_into_the_same_run(tmp_path: Path) -> None:
    proc = _multirun(tmp_path, "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10", *_args(tmp_path, "local_preempt"))
    try:
        _wait_for("training step 5 in the local job's log", lambda: f"step 5/{STEPS}" in _job_logs(tmp_path), proc, 300, tmp_path)
        pid = _wait_for("the local job's process", lambda: _local_task_pid(tmp_path), proc, 30, tmp_path)
        os.kill(int(pid), signal.SIGUSR2)  # type: ignore[call-overload]
        _check_one_resumed_run(tmp_path, "local_preempt", proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
