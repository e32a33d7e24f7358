"""A sweep job killed after its MLflow run started (SIGKILL, an OOM kill, ``scancel``, a time limit) never ends that run
itself; the launcher that waits for the jobs sees it die and ends the run, tagged with how the job ended
(``tracking/sweep_jobs.py``). With ``submitit_local`` (always on) and against the real test SLURM cluster
(tests/slurm_cluster.py; SLURM tests skip loudly where it cannot run). ``collect``'s side, from SLURM's account of a
detached sweep, is in tests/test_compare.py.

Each sweep sweeps the run length, ``train.num_steps=10,3000``: job #0 ends on its own, so once its run has finished the
one task process left is job #1's, which is killed mid-training.
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

from recsys_runner.tracking.store import missing_store
from recsys_runner.tracking.sweep_jobs import DIED, JOB_END_TAG
from recsys_runner.tracking.sweep_names import JOB_NUM_TAG
from recsys_runner.tracking.sweep_summary import SWEEP_PARENT_TAG
from tests.conftest import REPO, TINY
from tests.slurm_cluster import SlurmCluster, slurm_cluster_fixture  # noqa: F401 - provides the slurm_cluster fixture

pytestmark = pytest.mark.slow

LONG = 3000


FAST_SLURM_WATCH = '''"""Test hook (tests/test_sweeps_dead_jobs.py), in the sweep's launching process only."""
import os
import sys

if sys.orig_argv[1:3] == ["-m", "recsys_runner"] and not os.environ.get("SUBMITIT_EXECUTOR"):
    from submitit.slurm.slurm import SlurmJob

    SlurmJob.watcher._delay_s = 2
    SlurmJob._results_timeout_s = 1
'''
"""A ``sitecustomize`` for the SLURM sweep's launching process: submitit asks SLURM (``sacct``) for the state of a job
that left no result 2, 4, 8, 16, 32, 64 s … after the submission, and then waits 15 s for a result a shared file
system may show late; on this one node, whose files are local, a killed job is seen as SLURM ends it: every 2 s, and
its missing result at once. What the launcher does with it is unchanged."""


def _multirun(tmp_path: Path, experiment: str, *launcher: str, pythonpath: str = str(REPO)) -> subprocess.Popen[str]:
    args = [*[a for a in TINY if not a.startswith("train.")], f"train.num_steps=10,{LONG}", "train.log_every_steps=1",
            "train.eval_every_steps=null", "train.eval_max_batches=2", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"tracking.experiment={experiment}", f"hydra.sweep.dir={tmp_path}/sweep"]
    env = {**os.environ, "PYTHONPATH": pythonpath}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.Popen([sys.executable, "-m", "recsys_runner", "-m", *launcher, *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _runs(tmp_path: Path, experiment: str) -> list:
    """The experiment's runs; none while the sweep has not made its store. Polling must not open a store the sweep is
    still creating: MLflow would make its tables again and crash the sweep (``table ... already exists``)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    if missing_store(uri) is not None:
        return []
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def _job_runs(tmp_path: Path, experiment: str) -> dict[str, object]:
    """The sweep's child runs by job number."""
    return {r.data.tags[JOB_NUM_TAG]: r for r in _runs(tmp_path, experiment) if JOB_NUM_TAG in r.data.tags}


def _task_pids(tmp_path: Path) -> list[int]:
    """The sweep's submitit task processes (``python -u -m submitit.core._submit <sweep>/.submitit/...``), local or SLURM
    (not ``srun``, whose command line holds the task's)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        is_python = Path(cmd[0].decode(errors="replace")).name.startswith("python") if cmd else False
        if is_python and b"submitit.core._submit" in cmd and any(str(tmp_path).encode() in c for c in cmd):
            pids.append(int(entry.name))
    return pids


def _wait_for(what: str, ready: Callable[[], object], proc: subprocess.Popen[str], timeout_s: float) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        value = ready()
        if value:
            return value
        time.sleep(0.2)
    out = proc.stdout.read() if proc.poll() is not None and proc.stdout else ""
    raise AssertionError(f"{what}: not seen after {timeout_s}s\n{out[-3000:]}")


def _kill_the_long_job(tmp_path: Path, experiment: str, proc: subprocess.Popen[str]) -> None:
    """Once job #0's run has finished and job #1's has logged a few steps, SIGKILL job #1's one task process."""
    def long_job_training() -> bool:
        runs = _job_runs(tmp_path, experiment)
        if runs.get("0") is None or runs["0"].info.status != "FINISHED" or runs.get("1") is None:
            return False
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
        return len(client.get_metric_history(runs["1"].info.run_id, "train/loss")) >= 5

    _wait_for("job #0 finished and job #1 training", long_job_training, proc, 400)
    (pid,) = _wait_for("one task process left (job #1's)", lambda: len(pids := _task_pids(tmp_path)) == 1 and pids, proc, 60)
    os.kill(pid, signal.SIGKILL)


def _check_killed_run(tmp_path: Path, experiment: str, proc: subprocess.Popen[str], end: str, status: str) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-3000:]
    runs = _job_runs(tmp_path, experiment)
    finished, killed = runs["0"], runs["1"]
    assert finished.info.status == "FINISHED" and JOB_END_TAG not in finished.data.tags, "a job that ended well is left alone"
    assert killed.info.status == status and killed.data.tags.get(JOB_END_TAG) == end, (killed.info, killed.data.tags, out[-3000:])
    assert killed.info.end_time is not None and killed.info.end_time >= killed.info.start_time
    assert f"Job #1 ({end}) died before it could end its MLflow run {killed.info.run_id} (num_steps={LONG}): ended it {status}" in out
    (parent,) = [r for r in _runs(tmp_path, experiment) if SWEEP_PARENT_TAG in r.data.tags]
    assert parent.info.status in ("FAILED", "KILLED") and parent.data.tags["sweep.failed_jobs"] == f"#1 train.num_steps={LONG}"
    return out


@pytest.mark.usefixtures("store_uri")  # the sweep's store, tmp_path/mlflow.db, made once per session
def test_submitit_local_job_killed_mid_training_leaves_no_running_run(tmp_path: Path) -> None:
    """SIGKILL to a local job's process: submitit sees only that it left no result; its run ends KILLED, tagged DIED,
    and the parent ends KILLED naming the job (it stayed RUNNING for ever, the parent FAILED)."""
    proc = _multirun(tmp_path, "local_killed", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10")
    try:
        _kill_the_long_job(tmp_path, "local_killed", proc)
        _check_killed_run(tmp_path, "local_killed", proc, DIED, "KILLED")
        (parent,) = [r for r in _runs(tmp_path, "local_killed") if SWEEP_PARENT_TAG in r.data.tags]
        assert parent.info.status == "KILLED"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.usefixtures("store_uri")  # the sweep's store, tmp_path/mlflow.db, made once per session
def test_slurm_job_killed_mid_training_leaves_no_running_run(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The same under SLURM with the waiting launcher: SLURM's account of the job (its state, as submitit reads it) is
    what the run's tag says."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FAST_SLURM_WATCH)
    proc = _multirun(tmp_path, "slurm_killed", "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=10",
                     "hydra.launcher.cpus_per_task=1", pythonpath=f"{hooks}{os.pathsep}{REPO}")
    try:
        _kill_the_long_job(tmp_path, "slurm_killed", proc)
        _check_killed_run(tmp_path, "slurm_killed", proc, "FAILED", "FAILED")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
