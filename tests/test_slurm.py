"""Against a real SLURM cluster (tests/slurm_cluster.py): an array sweep, submit-and-exit + collect, two-task jobs.
A job that fails its config check and one that crashes (a bug: tests/job_hooks.py, a ``sitecustomize`` hook in the job
processes) ride along in the array sweep and in a detached one.

Every job logs to MLflow as a child of the multirun's parent run, from inside ``sbatch``/``srun``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from recsys_runner.tracking.sweep_jobs import own_failure
from recsys_runner.tracking.sweep_summary import SWEEP_PARENT_TAG
from tests import job_hooks
from tests.conftest import TINY, run_cli
from tests.slurm_cluster import SlurmCluster, slurm_cluster_fixture  # noqa: F401 - provides the slurm_cluster fixture

pytestmark = pytest.mark.slow

SLURM = ["hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=10", "hydra.launcher.cpus_per_task=1"]


def _run_slurm(cluster: SlurmCluster, tmp_path: Path, *args: str, timeout: float,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``run_cli`` of a SLURM sweep; past ``timeout``, a failure that shows what SLURM and the jobs were doing (their
    queue, the daemons' logs, the jobs' own logs), not only the sweep's first line."""
    try:
        return run_cli(*args, cwd=tmp_path, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        jobs = "".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                       for p in sorted((tmp_path / "multirun").glob("*/*/.submitit/*/*_log.*")))
        said = e.output.decode(errors="replace") if isinstance(e.output, bytes) else e.output
        pytest.fail(f"the sweep ran past {timeout} s, having said: {said}\n{cluster.squeue('--states=all')}\n{jobs}\n"
                    f"{cluster.logs()}")


def _sweep(uri: str, experiment: str) -> tuple[object, list]:
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    (parent,) = [r for r in runs if SWEEP_PARENT_TAG in r.data.tags]
    children = [r for r in runs if r is not parent]
    assert all(r.data.tags.get("mlflow.parentRunId") == parent.info.run_id for r in children)
    return parent, children


def test_array_sweep_lands_in_mlflow_as_parent_and_children(slurm_cluster: SlurmCluster, tmp_path: Path, store_uri: str) -> None:
    """A 4-job array, one of them with an invalid value, one that crashes (a bug, tests/job_hooks.py): the others run
    and are compared; each failed one is named in a line (its own, or its error's; not submitit's traceback), and the
    parent ends FAILED naming them once every job has ended."""
    uri = store_uri
    hooks = job_hooks.install(tmp_path / "hooks", "crash_at_the_first_step('optim.lr=0.05')")
    out = run_cli("-m", *SLURM, "optim.lr=0.01,-1,0.1,0.05", *TINY, "train.num_steps=10", f"tracking.uri={uri}",
                  "tracking.experiment=slurm_array", cwd=tmp_path, timeout=600, env={"PYTHONPATH": hooks})
    assert out.returncode == 1, out.stderr[-3000:] + slurm_cluster.logs()
    assert "Job #1 failed: Config error: optim.sparse.lr must be positive, got -1.0" in out.stderr, out.stderr[-3000:]
    assert f"Job #3 failed: RuntimeError: {job_hooks.CRASH}" in out.stderr.splitlines(), out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "Sweep failed (failed job(s): #1 optim.lr=-1; #3 optim.lr=0.05); 2 of 3 " in out.stderr, out.stderr[-3000:]
    parent, children = _sweep(uri, "slurm_array")
    by_lr = {float(r.data.params["optim.lr"]): r for r in children}
    assert sorted(by_lr) == [0.01, 0.05, 0.1] and by_lr.pop(0.05).info.status == "FAILED", "the crash ended its run FAILED"
    assert all(r.info.status == "FINISHED" for r in by_lr.values())
    best = max(by_lr.values(), key=lambda r: r.data.metrics["eval/auc"])
    assert parent.info.status == "FAILED" and parent.data.tags["best.run_id"] == best.info.run_id
    assert parent.data.tags["sweep.failed_jobs"] == "#1 optim.lr=-1; #3 optim.lr=0.05"
    # One array job: "<id>_0" … "<id>_3".
    ids = {p.name for p in (tmp_path / "multirun").glob("*/*/.submitit/*_*") if p.is_dir()}
    assert len(ids) == 4 and len({i.split("_")[0] for i in ids}) == 1, ids
    _failed_on_its_own(tmp_path, "1")
    _crashed(tmp_path, "3")


def _failed_on_its_own(tmp_path: Path, task: str) -> None:
    """Array task ``task`` of the sweep ended on its config error: the error is its result, read at once (its exit left
    none, and the sweep's side waited submitit's 15 s for one, then read its log); its log holds its line, no traceback;
    SLURM saw it fail with the command's own status, 2."""
    error = "Config error: optim.sparse.lr must be positive, got -1.0"
    (result,) = (tmp_path / "multirun").glob(f"*/*/.submitit/*_{task}/*_{task}_0_result.pkl")
    assert (own_failure(result) or "").startswith(error), own_failure(result)
    log = result.with_name(result.name.replace("_result.pkl", "_log.err")).read_text()
    assert any(line.startswith(error) for line in log.splitlines()) and "Traceback" not in log, log[-3000:]
    job = subprocess.run(["scontrol", "-o", "show", "job", result.parent.name], capture_output=True, text=True, timeout=30)
    assert "JobState=FAILED" in job.stdout and "ExitCode=2:0" in job.stdout, job.stdout + job.stderr


def _crashed(tmp_path: Path, task: str) -> None:
    """Array task ``task`` of the sweep crashed: its error is its result (named by the traceback's last line), its log
    holds the traceback, and SLURM saw it fail with exit 1. Before, Hydra kept the error as the job's return value:
    submitit wrote it as a success, the job exited 0 with no traceback, and SLURM said COMPLETED."""
    (result,) = (tmp_path / "multirun").glob(f"*/*/.submitit/*_{task}/*_{task}_0_result.pkl")
    assert own_failure(result) == f"RuntimeError: {job_hooks.CRASH}", own_failure(result)
    log = result.with_name(result.name.replace("_result.pkl", "_log.err")).read_text()
    assert "Traceback" in log and any(line.endswith(f"RuntimeError: {job_hooks.CRASH}") for line in log.splitlines()), log[-3000:]
    job = subprocess.run(["scontrol", "-o", "show", "job", result.parent.name], capture_output=True, text=True, timeout=30)
    assert "JobState=FAILED" in job.stdout and "ExitCode=1:0" in job.stdout, job.stdout + job.stderr


def test_submit_and_exit_then_collect(slurm_cluster: SlurmCluster, tmp_path: Path, store_uri: str) -> None:
    """``submitit_slurm_detached`` returns at once, leaving the parent RUNNING; ``compare collect`` finishes it."""
    uri = store_uri
    detached = ["hydra/launcher=submitit_slurm_detached", *SLURM[1:]]
    out = run_cli("-m", *detached, "optim.lr=0.01,0.1", *TINY, "train.num_steps=10", f"tracking.uri={uri}",
                  "tracking.experiment=slurm_detached", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    (parent,) = client.search_runs([client.get_experiment_by_name("slurm_detached").experiment_id], f"tags.`{SWEEP_PARENT_TAG}` != ''")
    assert parent.data.tags["sweep.num_jobs"] == "2" and len(parent.data.tags["sweep.slurm_job_ids"].split()) == 2
    assert parent.info.status == "RUNNING", "returned before the jobs finished"
    collected = subprocess.run([sys.executable, "-m", "recsys_runner.compare", "collect", "--uri", uri, "--parent",
                                parent.info.run_id, "--wait", "--timeout", "400", "--out", str(tmp_path / "plots")],
                               cwd=tmp_path, capture_output=True, text=True, timeout=500)
    assert collected.returncode == 0, collected.stderr[-3000:] + slurm_cluster.squeue("--states=all") + slurm_cluster.logs()
    assert "best eval/auc=" in collected.stdout and (tmp_path / "plots" / "curves.png").exists()
    parent, children = _sweep(uri, "slurm_detached")
    assert parent.info.status == "FINISHED" and len(children) == 2
    assert all(r.info.status == "FINISHED" for r in children)


def test_collect_names_a_detached_job_that_died_before_its_mlflow_run_and_one_that_crashed(slurm_cluster: SlurmCluster,
                                                                                          tmp_path: Path, store_uri: str) -> None:
    """A detached sweep whose job #0 fails its config check (exit 2, before any MLflow run) and whose job #2 crashes (a
    bug, tests/job_hooks.py; its run ended FAILED): ``collect --wait`` waited for job #0's child until ``--timeout``, and
    counted job #2 among those that succeeded (SLURM said COMPLETED). SLURM's account says both ended FAILED: each is
    named with its own error line (#2 by its traceback's last line), the parent ends FAILED naming both, long before the
    timeout."""
    import time

    uri = store_uri
    detached = ["hydra/launcher=submitit_slurm_detached", *SLURM[1:]]
    hooks = job_hooks.install(tmp_path / "hooks", "crash_at_the_first_step('optim.lr=0.05')")
    out = run_cli("-m", *detached, "optim.lr=-1,0.1,0.05", *TINY, "train.num_steps=5", f"tracking.uri={uri}",
                  "tracking.experiment=slurm_died", cwd=tmp_path, timeout=300, env={"PYTHONPATH": hooks})
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    (parent,) = client.search_runs([client.get_experiment_by_name("slurm_died").experiment_id], f"tags.`{SWEEP_PARENT_TAG}` != ''")
    started = time.monotonic()
    collected = subprocess.run([sys.executable, "-m", "recsys_runner.compare", "collect", "--uri", uri, "--parent",
                                parent.info.run_id, "--wait", "--timeout", "400", "--no-plots"],
                               cwd=tmp_path, capture_output=True, text=True, timeout=500)
    assert collected.returncode == 1, collected.stderr[-3000:] + slurm_cluster.squeue("--states=all") + slurm_cluster.logs()
    assert time.monotonic() - started < 300, "noticed when the jobs ended, not at the timeout"
    first_id, _, crashed_id = parent.data.tags["sweep.slurm_job_ids"].split()
    lines = collected.stderr.splitlines()
    assert (f"Job #0 (SLURM {first_id}, FAILED) failed: Config error: optim.sparse.lr must be positive, got -1.0. "
            "Fix: e.g. optim.sparse.lr=0.01 where it is set, else optim.lr=0.01 (its default)") in lines, collected.stderr[-3000:]
    assert f"Job #2 (SLURM {crashed_id}, FAILED) failed: RuntimeError: {job_hooks.CRASH}" in lines, collected.stderr[-3000:]
    parent, children = _sweep(uri, "slurm_died")
    assert parent.info.status == "FAILED", parent.info.status
    assert parent.data.tags["sweep.failed_jobs"] == f"#0 (SLURM {first_id}, FAILED); #2 (SLURM {crashed_id}, FAILED)"
    by_lr = {float(r.data.params["optim.lr"]): r for r in children}
    assert sorted(by_lr) == [0.05, 0.1] and by_lr[0.05].info.status == "FAILED" and by_lr[0.1].info.status == "FINISHED"
    assert parent.data.tags["best.run_id"] == by_lr[0.1].info.run_id
    _failed_on_its_own(tmp_path, "0")
    _crashed(tmp_path, "2")


def test_two_task_slurm_job_is_one_two_rank_run(slurm_cluster: SlurmCluster, tmp_path: Path, store_uri: str) -> None:
    """One job (a one-point sweep: the parent and its one child FINISHED) with ``tasks_per_node=2``: srun starts 2
    tasks, each maps SLURM's environment to a torch rank, one MLflow run. (A one-task job is the array sweep's.)"""
    uri = store_uri
    out = _run_slurm(slurm_cluster, tmp_path, "-m", *SLURM, "hydra.launcher.tasks_per_node=2", *TINY, "train.num_steps=10",
                     "distributed.sharding_types=[column_wise]", f"tracking.uri={uri}", "tracking.experiment=slurm_ranks",
                     timeout=600)
    assert out.returncode == 0, out.stderr[-3000:] + slurm_cluster.logs()
    parent, (child,) = _sweep(uri, "slurm_ranks")
    assert child.info.status == "FINISHED" and parent.info.status == "FINISHED" and child.data.tags["world_size"] == "2"
    logs = "".join(p.read_text() for p in (tmp_path / "multirun").glob("*/*/.submitit/*/*_log.*"))
    assert "task 1/2" in logs and "task 0/2" in logs, "each task announced its torch.distributed rank"
    # It really ran under SLURM: submitit's folder holds the sbatch script, and the job's log the eval it ran.
    (script,) = (tmp_path / "multirun").glob("*/*/.submitit/*/*_submission.sh")
    assert "#SBATCH" in script.read_text() and "eval/auc" in logs
    port = int(logs.split("torch.distributed via localhost:")[1].split()[0])
    assert 20000 <= port < 32768, f"the job's port {port} is drawn below the kernel's ephemeral ports (32768-60999)"


def test_two_task_job_whose_rendezvous_port_is_taken_ends_at_once_naming_it(slurm_cluster: SlurmCluster,
                                                                           tmp_path: Path, store_uri: str) -> None:
    """Rank 0 of a two-task job cannot open the group's store: another process listens on ``MASTER_PORT``. It fails with
    one line naming the address, the port and the fix, not torch's traceback; srun (``--kill-on-bad-exit``) ends rank 1,
    which otherwise waited on the rendezvous for ``distributed.timeout_s`` (30 min), the sweep waiting with it."""
    uri = store_uri
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        out = _run_slurm(slurm_cluster, tmp_path, "-m", *SLURM, "hydra.launcher.tasks_per_node=2",
                         f'hydra.launcher.setup=["export MASTER_PORT={port}"]', *TINY, "train.num_steps=10",
                         f"tracking.uri={uri}", "tracking.experiment=slurm_taken", timeout=500)
        took = time.monotonic() - started
    assert out.returncode == 1, out.stderr[-3000:] + slurm_cluster.logs()
    assert (f"Job #0 failed: Launch error: rank 0 cannot open the process group's rendezvous on localhost:{port}: another "
            "process on this host listens on that port (set in the environment). Fix: choose a free port for the job: "
            """under SLURM hydra.launcher.setup='["export MASTER_PORT=<free port>"]', else MASTER_PORT=<free port> in the """
            "command's environment") in out.stderr.splitlines(), out.stderr[-3000:]
    assert took < 300, f"{took:.0f} s: rank 1 was ended with rank 0, not left waiting on the rendezvous (30 min)"
    (script,) = (tmp_path / "multirun").glob("*/*/.submitit/*/*_submission.sh")
    assert "srun --unbuffered" in script.read_text() and "--kill-on-bad-exit=1" in script.read_text()
    parent, children = _sweep(uri, "slurm_taken")
    assert parent.info.status == "FAILED" and all(r.info.status != "RUNNING" for r in children)


def test_two_task_job_whose_rank_1_crashes_ends_with_rank_0s_lost_rank_line(slurm_cluster: SlurmCluster,
                                                                          tmp_path: Path, store_uri: str) -> None:
    """Rank 1 crashes at its first step (a bug, tests/job_hooks.py). srun's ``--kill-on-bad-exit`` ends the job, yet rank
    0 still sees its peer gone first and ends as a lost rank (its line, exit 75); the job fails naming the crash, the run
    ends FAILED, nothing waits."""
    uri = store_uri
    hooks = job_hooks.install(tmp_path / "hooks", "crash_at_the_first_step('train.num_steps=10', rank=1)")
    started = time.monotonic()
    out = _run_slurm(slurm_cluster, tmp_path, "-m", *SLURM, "hydra.launcher.tasks_per_node=2", *TINY, "train.num_steps=10",
                     f"tracking.uri={uri}", "tracking.experiment=slurm_crash", timeout=500, env={"PYTHONPATH": hooks})
    took = time.monotonic() - started
    assert out.returncode == 1, out.stderr[-3000:] + slurm_cluster.logs()
    assert f"Job #0 failed: rank 1: RuntimeError: {job_hooks.CRASH}" in out.stderr.splitlines(), out.stderr[-3000:]
    logs = "".join(p.read_text() for p in (tmp_path / "multirun").glob("*/*/.submitit/*/*_log.err"))
    assert "Rank lost: rank 1 of 2 stopped: a collective on rank 0" in logs and "task 0: Exited with exit code 75" in logs
    assert took < 300, f"{took:.0f} s: the job ended with its crashed rank, nothing waited"
    parent, (child,) = _sweep(uri, "slurm_crash")
    assert parent.info.status == "FAILED" and child.info.status == "FAILED"
