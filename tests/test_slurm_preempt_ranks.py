"""A two-task SLURM job preempted mid-training is requeued and resumes into its one MLflow run, however long rank 0 takes
to requeue it.

Every job's ``srun`` has ``--kill-on-bad-exit`` (``SRUN_ARGS`` in hydra_plugins/recsys_runner_detached): a task's non-zero
exit ends the others, SIGTERM (which submitit's handler ignores), then SIGKILL SLURM's ``KillWait`` later (5 s on the test
cluster, 30 s by default). Under a preemption rank 1 exited 140 once the checkpoint was written, while rank 0 still ended
its MLflow run and had submitit pickle the job and run ``scontrol requeue``: a rank 0 slower than ``KillWait`` there (a
slow tracking store, a busy controller; here tests/job_hooks.py's ``slow_requeue``) was killed, and the job ended FAILED,
never requeued, its run left unresumed. A rank other than 0 now exits 0 after a preemption (recsys_runner/lifecycle.py).
The one-task preemption is tests/test_slurm_preempt.py's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests import job_hooks
from tests.conftest import TINY
from tests.slurm_cluster import SlurmCluster, slurm_cluster_fixture  # noqa: F401 - provides the slurm_cluster fixture

pytestmark = pytest.mark.slow

STEPS = 40


def _logs(sweep: Path, name: str = "*_log.*") -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(sweep.glob(f".submitit/*/{name}")))


def test_two_task_job_preempted_is_requeued_though_rank_0_requeues_after_killwait(slurm_cluster: SlurmCluster,
                                                                                  tmp_path: Path) -> None:
    """Rank 0 starts its requeue ``KillWait`` + 5 s after the checkpoint (``slow_requeue``): rank 1 has exited 0, so srun
    ends nothing; the job is requeued, resumes from its checkpoint and finishes its one MLflow run, every step logged
    once."""
    kill_wait_s = int(re.search(r"^KillWait=(\d+)$", slurm_cluster.conf.read_text(), re.MULTILINE)[1])  # type: ignore[index]
    hooks = job_hooks.install(tmp_path / "hooks", f"slow_requeue({kill_wait_s + 5})")
    sweep, uri = tmp_path / "sweep", f"sqlite:///{tmp_path}/mlflow.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "recsys_runner", "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=10",
         "hydra.launcher.cpus_per_task=1", "hydra.launcher.tasks_per_node=2", f"hydra.sweep.dir={sweep}",
         *[a for a in TINY if not a.startswith("train.")], f"train.num_steps={STEPS}", "train.log_every_steps=1",
         "train.eval_every_steps=null", "train.eval_max_batches=2", "distributed.sharding_types=[column_wise]",
         f"tracking.uri={uri}", "tracking.experiment=ranks_preempt"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": hooks}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 400
        while f"step 5/{STEPS}" not in _logs(sweep) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert f"step 5/{STEPS}" in _logs(sweep), _logs(sweep)[-5000:]
        (job_id,) = [p.name for p in sweep.glob(".submitit/*") if p.name.isdigit()]
        # What SLURM sends every task ahead of the time limit (--signal=USR2@signal_delay_s)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, env={**os.environ, **slurm_cluster.env}, timeout=30)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    logs = _logs(sweep)
    assert proc.returncode == 0, out[-3000:] + logs[-6000:] + slurm_cluster.logs()
    assert "Preempted: rank 1 leaves the requeue to rank 0 and exits 0" in _logs(sweep, "*_1_log.err"), logs[-6000:]
    assert "Requeued job" in _logs(sweep, "*_0_log.*") and "task 0: Killed" not in logs, logs[-6000:]
    resumed_at = int(logs.split(f"resuming from {sweep}/0/checkpoints/step_")[1][:8])
    assert 0 < resumed_at < STEPS, resumed_at
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("ranks_preempt").experiment_id])
    (run,) = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert run.info.status == "FINISHED" and run.data.tags.get("world_size") == "2", (run.info, run.data.tags)
    assert run.data.tags.get("resumed") == "true" and run.data.tags.get("preempted") == "true", run.data.tags
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == list(range(1, STEPS + 1))
