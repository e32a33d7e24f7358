"""``hydra/launcher=submitit_local``: a task that fails ends its job's other tasks (recsys_runner/distributed/local_tasks.py),
as ``srun --kill-on-bad-exit`` ends a SLURM job's (tests/test_slurm.py)."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from recsys_runner.distributed.local_tasks import KILL_WAIT_S, _ours, failed
from recsys_runner.tracking.sweep_summary import SWEEP_PARENT_TAG
from tests.conftest import TINY

BOUND_S = 360
"""What the two-task sweep below may take: its start (imports, data) and :data:`KILL_WAIT_S`, with room on a loaded
machine; far below its job's ``timeout_min`` (10 minutes), which ended rank 1 before."""


def test_only_a_failure_ends_the_other_tasks() -> None:
    """A stop on a signal (SIGTERM: every rank exits 143) and submitit's requeue (144: rank 0 of a preempted job, its
    other ranks exit 0) are not failures; an error, a lost rank and a kill are."""
    assert not any(failed(status) for status in (None, 0, 144, 128 + 12, 128 + 15, 128 + 2, 128 + 10))
    assert all(failed(status) for status in (1, 2, 75, 255, -9, -11))


def test_the_controller_runs_in_place_of_submitits() -> None:
    """submitit's controller command, a list or (after ``+hydra.launcher.setup`` lines) a shell line, names ours; one
    that no longer names submitit's is refused, not run as submitit's."""
    theirs = [sys.executable, "-m", "submitit.local._local", "/sweep/.submitit/%j"]
    assert _ours(theirs) == [sys.executable, "-m", "recsys_runner.distributed.local_tasks", "/sweep/.submitit/%j"]
    assert _ours(f"export A=1 && {shlex.join(theirs)}") == f"export A=1 && {shlex.join(_ours(theirs))}"
    with pytest.raises(RuntimeError, match="no longer starts its local controller"):
        _ours([sys.executable, "-m", "submitit.local.controller", "/sweep"])


def _job_processes(root: Path) -> dict[int, tuple[str, int]]:
    """The processes whose command line names a path under ``root`` (a job's controller and tasks name submitit's folder
    in the sweep's): pid → (command line, parent pid). A task's fork (a ``subprocess`` call, before its exec) shows the
    task's command line for a moment too: its parent tells it apart."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if str(root) in cmd:
                found[int(entry.name)] = (cmd, parent)
    return found


@pytest.mark.slow
def test_a_rank_that_fails_before_the_group_forms_ends_its_sibling(tmp_path: Path) -> None:
    """Rank 0 of a two-task job cannot open the group's store: another process listens on ``MASTER_PORT``. Rank 1's store
    client connected to that process and waits for an answer that never comes, in native code, deaf to SIGTERM: the job's
    controller kills it :data:`KILL_WAIT_S` after rank 0 failed, where before it waited until the job's ``timeout_min``.
    The sweep names rank 0's line and exits 1, its MLflow parent ends FAILED, and no process of the job is left."""
    uri = f"sqlite:///{tmp_path}/taken.db"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env.pop("HYDRA_FULL_ERROR", None)
    seen: dict[int, tuple[str, int]] = {}
    with socket.socket() as taken, (tmp_path / "out.txt").open("w") as out:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        env["MASTER_PORT"] = port = str(taken.getsockname()[1])
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "recsys_runner", "-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
             "hydra.launcher.timeout_min=10", *TINY, "train.num_steps=10", f"tracking.uri={uri}",
             "tracking.experiment=local_taken"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)  # its group holds the job's controller and tasks: ended whole if it overruns
        try:
            while proc.poll() is None and time.monotonic() - started < BOUND_S:
                seen.update(_job_processes(tmp_path))
                time.sleep(0.2)
            assert proc.poll() is not None, f"the sweep ran past {BOUND_S} s: rank 1 was left waiting on the rendezvous"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    said = (tmp_path / "out.txt").read_text()
    assert proc.returncode == 1, said[-3000:]
    assert any(line.startswith("Job #0 failed: Launch error: rank 0 cannot open the process group's rendezvous on ") and
               f":{port}: another process on this host listens on that port (set in the environment)" in line
               for line in said.splitlines()), said[-3000:]
    controllers = [pid for pid, (cmd, _) in seen.items() if cmd.split()[1:3] == ["-m", "recsys_runner.distributed.local_tasks"]]
    tasks = [pid for pid, (cmd, parent) in seen.items()
             if cmd.split()[1:4] == ["-u", "-m", "submitit.core._submit"] and parent in controllers]
    assert len(controllers) == 1 and len(tasks) == 2, seen
    left = _job_processes(tmp_path)
    assert not set(seen) & set(left) and not left, f"the job's processes still run: {left}"
    (log,) = tmp_path.glob("multirun/*/*/.submitit/*/*_1_log.err")
    assert (f"Task 0 of this job exited with status 2: ending task 1 too (SIGTERM, then SIGKILL after {KILL_WAIT_S:.0f} "
            "s), as srun --kill-on-bad-exit ends a SLURM job's tasks") in log.read_text()
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("local_taken").experiment_id])
    (parent,) = [r for r in runs if SWEEP_PARENT_TAG in r.data.tags]
    assert parent.info.status == "FAILED" and all(r.info.status != "RUNNING" for r in runs), [r.info for r in runs]
