"""A rank lost mid-run: the survivors end with one line naming the lost rank, the last checkpoint and the command that
resumes (no traceback, exit 75, the MLflow run FAILED), and that command resumes into the same run; under
``torchrun --max-restarts`` the restarted group resumes by itself. Real gloo groups, real ``kill -9``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from recsys_runner.build import build
from recsys_runner.checkpoint.storage import DcpFileStorage, list_checkpoints
from recsys_runner.config import validate
from recsys_runner.distributed.peers import EXIT_RANK_LOST, RankLost, cause_of, peer_gone
from recsys_runner.lifecycle import exit_codes, note_interrupted_runs, rank_lost_message
from recsys_runner.runtime import Launch
from tests.conftest import REPO, TINY, free_port

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:9371: Connection "
              "reset by peer. This is typically caused by a remote worker hanging or bugs in the application. Check the logs "
              "of the remote worker before reporting an error. GLHF!")
"""What the survivor of a 2-rank gloo run got when the other rank was killed with ``kill -9`` (torch 2.13)."""

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Rank 0 of 2 on node 0, as torchrun sets it, no restarts."""
    for name, value in zip(TORCHRUN_ENV, ("0", "2", "0", "0", "0", "0"), strict=True):
        monkeypatch.setenv(name, value)
    return monkeypatch


# -- telling a lost peer from other errors -------------------------------------------------------------------------
PEER_THEN_COLLECTIVE = """
import os, signal, sys, time
import torch, torch.distributed as dist
rank, ending = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=2)
dist.all_reduce(torch.ones(1))  # both connected
if rank == 1:
    if ending == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)
time.sleep(0.5)
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError as e:
    print(e)
"""


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["kill", "exit"])
def test_a_collective_whose_peer_is_gone_is_told_apart_by_its_real_error(ending: str) -> None:
    """Not a copied string: a real gloo group of two processes whose rank 1 is killed (or exits) before an all-reduce."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [subprocess.Popen([sys.executable, "-c", PEER_THEN_COLLECTIVE, str(r), ending], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    error = ranks[0].communicate(timeout=120)[0].strip()
    ranks[1].wait(timeout=60)
    assert peer_gone(RuntimeError(error)) == "stopped", error
    assert "by peer" in cause_of(RuntimeError(error)) and "pair.cc" not in cause_of(RuntimeError(error)), error


def test_only_a_lost_peer_counts() -> None:
    assert peer_gone(RuntimeError(GLOO_RESET)) == "stopped"
    assert peer_gone(RuntimeError("[pair.cc:598] Timed out waiting 1800000ms for recv operation to complete")) == "stopped answering"
    assert peer_gone(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert peer_gone(ConnectionResetError("Connection reset by peer")) is None  # not a collective's error (an HTTP store)
    assert cause_of(RuntimeError(GLOO_RESET)) == "Read error [127.0.0.1]:9371: Connection reset by peer"


# -- a main thread blocked in native code after a stop signal ------------------------------------------------------
WATCHED = """
import os, signal, sys, time
from recsys_runner.train.signals import StopSignals
def stuck(signum, waited_s):
    print(f"stuck on {signal.Signals(signum).name} after {waited_s:.1f} s", flush=True)
    os._exit(75)
with StopSignals(2, on_stuck=stuck, stuck_after_s=0.5) as signals:
    os.kill(os.getpid(), signal.SIGTERM)
    if sys.argv[1] == "blocked":
        os.read(os.pipe()[0], 1)  # one native call that never returns, as a collective on a peer that never fails
    end = time.monotonic() + 1.5
    while time.monotonic() < end:  # busy in Python meanwhile: stopping as it should
        pass
print("stopped by", signals.signum)
"""


@pytest.mark.parametrize("main", ["blocked", "busy"])
def test_a_main_thread_still_in_one_native_call_after_sigterm_is_ended_and_a_busy_one_is_not(main: str) -> None:
    """:mod:`recsys_runner.train.stuck` through :class:`StopSignals` with several ranks: the handler noted the SIGTERM,
    but the main thread blocked in one native call is ended by the watch; one running Python for longer is left to stop."""
    out = subprocess.run([sys.executable, "-c", WATCHED, main], env=ENV, capture_output=True, text=True, timeout=30)
    if main == "blocked":
        assert out.returncode == 75 and out.stdout.startswith("stuck on SIGTERM after 0."), out.stdout + out.stderr
    else:
        assert out.returncode == 0 and out.stdout.strip() == f"stopped by {int(signal.SIGTERM)}", out.stdout + out.stderr


# -- the survivor's line -------------------------------------------------------------------------------------------
def test_the_line_names_the_other_rank_of_two_and_where_this_one_failed(torchrun_env: pytest.MonkeyPatch) -> None:
    lost = RankLost(RuntimeError(GLOO_RESET), step=12, checkpoint="/o/r/checkpoints/step_00000010")
    assert str(lost) == ("rank 1 of 2 stopped: a collective on rank 0 (local rank 0 on node 0) failed after step 12 with "
                         "'Read error [127.0.0.1]:9371: Connection reset by peer'")
    torchrun_env.setenv("RANK", "3")
    torchrun_env.setenv("WORLD_SIZE", "8")
    torchrun_env.setenv("LOCAL_RANK", "3")
    torchrun_env.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    many = str(RankLost(RuntimeError("Timed out waiting 60000ms for recv operation to complete")))
    assert many.startswith("rank(s) other than this one (rank 3 of 8) stopped answering: a collective on this rank "
                           "(local rank 3 on node 0) failed with 'Timed out waiting 60000ms for recv operation to complete'")
    assert many.endswith("; torchrun restarts the group (restart 1 of 2)")
    for name in TORCHRUN_ENV:
        torchrun_env.delenv(name)
    assert str(RankLost(RuntimeError(GLOO_RESET))).startswith("another rank stopped: a collective on this rank failed with")


def test_the_message_gives_the_last_checkpoint_and_the_resume_command(torchrun_env: pytest.MonkeyPatch) -> None:
    torchrun_env.setenv("TORCHELASTIC_RUN_ID", "none")
    torchrun_env.setenv("LOCAL_WORLD_SIZE", "2")
    launch = Launch(overrides=("optim.lr=0.1",), output_dir=Path("/o/r"), config_name="config")
    lost = RankLost(RuntimeError(GLOO_RESET), step=12, checkpoint="/o/r/checkpoints/step_00000010")
    assert rank_lost_message(launch, lost) == (
        f"Rank lost: {lost}; the checkpoints written are intact\n"
        "Resume this run from step_00000010, into the same MLflow run, with this command:\n"
        "  torchrun --nproc_per_node=2 -m recsys_runner optim.lr=0.1 checkpoint.dir=/o/r/checkpoints")
    early = RankLost(RuntimeError(GLOO_RESET))
    assert rank_lost_message(launch, early) == (
        f"Rank lost: {early}; no checkpoint was written, run it again with:\n  torchrun --nproc_per_node=2 -m recsys_runner optim.lr=0.1")


@contextlib.contextmanager
def _sigterm_kept() -> Iterator[None]:
    """Give this pytest process its SIGTERM handler back after an exit that ignores it."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def test_exit_codes_prints_the_line_without_a_traceback_and_exits_75(torchrun_env: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    launch = Launch(overrides=("optim.lr=0.1",), output_dir=Path("/o/r"), config_name="config")
    with _sigterm_kept(), pytest.raises(SystemExit) as exited, exit_codes(launch):
        raise RankLost(RuntimeError(GLOO_RESET), step=3, checkpoint="/o/r/checkpoints/step_00000002")
    assert exited.value.code == EXIT_RANK_LOST == 75
    err = capsys.readouterr().err
    assert err.startswith("Rank lost: rank 1 of 2 stopped") and "step_00000002" in err and "Traceback" not in err
    with _sigterm_kept(), pytest.raises(SystemExit) as exited, exit_codes(launch):  # lost while building: no checkpoint
        raise RuntimeError(GLOO_RESET)
    assert exited.value.code == 75 and "no checkpoint was written, run it again with:" in capsys.readouterr().err
    torchrun_env.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="Connection reset"), exit_codes(launch):  # one rank: no peer, not ours to name
        raise RuntimeError(GLOO_RESET)


class PeerDiesAfterWrite:
    """A checkpoint storage whose write finishes on this rank (``whole``: meta.json on disk) or not, and then fails as a
    closing barrier fails when the other rank died: the race the kill -9 test meets when the kill lands just after the
    checkpoint it waited for."""

    def __init__(self, inner: DcpFileStorage, whole: bool) -> None:
        self.inner, self.whole = inner, whole

    def write(self, path: Path, *args: object) -> None:
        if self.whole:
            self.inner.write(path, *args)
        raise RuntimeError(GLOO_RESET)

    def is_complete(self, path: Path) -> bool:
        return self.inner.is_complete(path)


@pytest.mark.parametrize("whole", [True, False], ids=["written", "not-written"])
def test_a_peer_lost_in_the_closing_barrier_leaves_the_written_checkpoint_to_resume(make_cfg, tmp_path: Path, whole: bool) -> None:
    c = build(validate(make_cfg("tracking=none", f"checkpoint.dir={tmp_path}", "train.num_steps=2")))
    try:
        checkpointer = c.loop.checkpointer
        checkpointer.storage = PeerDiesAfterWrite(DcpFileStorage(), whole)
        with pytest.raises(RuntimeError, match="Connection reset by peer"):
            checkpointer.save(c.loop.state)
    finally:
        c.close()
    written = list_checkpoints(tmp_path)
    assert len(written) == (1 if whole else 0)
    assert checkpointer.last_saved == (str(written[0]) if whole else None)  # what the survivor's resume command names


def test_a_default_checkpoint_dir_under_max_restarts_is_warned_about(torchrun_env: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    launch = Launch(output_dir=Path("/o/r"), config_name="config")
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        note_interrupted_runs(launch, DcpFileStorage(), None)
        assert not caplog.records  # no restarts asked for: nothing to say
        torchrun_env.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
        note_interrupted_runs(launch, DcpFileStorage(), None)
    (record,) = caplog.records
    assert "torchrun --max-restarts=3" in record.getMessage() and "Set checkpoint.dir=<path>" in record.getMessage()


# -- real torchrun, real kill -9 -----------------------------------------------------------------------------------
SHORT = [a for a in TINY if not a.startswith("train.")] + [
    "train.num_steps=40", "train.log_every_steps=5", "train.eval_every_steps=null", "train.eval_max_batches=2",
    "checkpoint.every_steps=5"]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
ENV.pop("HYDRA_FULL_ERROR", None)


def _torchrun(*launcher: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", *launcher]


def _workers(torchrun: subprocess.Popen) -> dict[int, int]:
    """``{rank: pid}`` of torchrun's worker processes (its children, told apart by their ``RANK``)."""
    children = [int(p) for task in Path(f"/proc/{torchrun.pid}/task").iterdir()
                for p in (task / "children").read_text().split()]
    ranks = {}
    for pid in children:
        with contextlib.suppress(OSError):
            env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in v)
            if "RANK" in env:
                ranks[int(env["RANK"])] = pid
    return ranks


def _kill_after_first_checkpoint(argv: list[str], checkpoints: str, rank: int, cwd: Path, timeout_s: float = 240,
                                 sig: int = signal.SIGKILL) -> subprocess.Popen:
    """Start ``argv`` (torchrun), wait for a complete checkpoint under the glob ``checkpoints``, ``kill -9`` worker ``rank``
    (or send it ``sig``)."""
    proc = subprocess.Popen(argv, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    while not list(cwd.glob(f"{checkpoints}/step_*/meta.json")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:] if proc.poll() is not None else "no checkpoint"
        time.sleep(0.1)
    workers = _workers(proc)
    assert set(workers) == {0, 1}, workers
    os.kill(workers[rank], sig)
    return proc


def _rank_output(log_dir: Path, attempt: int, local_rank: int, stream: str = "stderr") -> str:
    """What worker ``local_rank`` of torchrun's ``attempt`` wrote to ``stream`` (``--log-dir``, ``--redirects=3``)."""
    (path,) = log_dir.glob(f"*/attempt_{attempt}/{local_rank}/{stream}.log")
    return path.read_text()


def _only_run(uri: str, experiment: str):  # noqa: ANN202 - mlflow's Run
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


@pytest.mark.slow
def test_kill_9_of_one_rank_ends_the_survivor_with_one_line_and_its_command_resumes(store_uri: str, tmp_path: Path) -> None:
    uri = store_uri
    # The default checkpoint dir (<Hydra run dir>/checkpoints, rank 0's for every rank), as a plain launch has it; the
    # run dir is given so that the test knows where it is.
    args = [*SHORT, f"tracking.uri={uri}", "tracking.experiment=lost", f"hydra.run.dir={tmp_path}/run"]
    proc = _kill_after_first_checkpoint(_torchrun("--log-dir=logs", "--redirects=3", "-m", "recsys_runner", *args),
                                        "run/checkpoints", rank=1, cwd=tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-3000:]
    assert "exitcode  : 75" in out, out[-3000:]  # torchrun's summary: the survivor's own status
    survivor = _rank_output(tmp_path / "logs", 0, 0)
    assert "Traceback" not in survivor and "Error executing job" not in survivor, survivor[-3000:]
    lines = survivor.splitlines()
    (i,) = [n for n, line in enumerate(lines) if line.startswith("Rank lost: ")]
    assert lines[i].startswith("Rank lost: rank 1 of 2 stopped: a collective on rank 0 (local rank 0 on node 0) failed after step ")
    assert "Connection reset by peer" in lines[i] or "closed by peer" in lines[i], lines[i]
    assert lines[i + 1].startswith("Resume this run from step_"), survivor[-2000:]
    named = lines[i + 1].split()[4].rstrip(",")
    command = shlex.split(lines[i + 2])
    assert command[:4] == ["torchrun", "--nproc_per_node=2", "-m", "recsys_runner"], command
    ckpt_dir = Path(next(a for a in command if a.startswith("checkpoint.dir=")).split("=", 1)[1])
    assert list_checkpoints(ckpt_dir)[-1].name == named  # the newest complete checkpoint, untouched
    failed = _only_run(uri, "lost")
    assert failed.info.status == "FAILED"  # rank 0 survived and ended it

    resumed = subprocess.run(_torchrun(*command[2:]), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{named} at step {int(named.split('_')[1])}" in resumed.stdout + resumed.stderr
    run = _only_run(uri, "lost")  # the same run, continued and ended
    assert run.info.run_id == failed.info.run_id and run.info.status == "FINISHED" and run.data.tags.get("resumed") == "true"
    assert list_checkpoints(ckpt_dir)[-1].name == "step_00000040"


@pytest.mark.slow
def test_a_survivor_blocked_on_a_peer_that_never_fails_ends_with_the_line_after_sigterm(store_uri: str, tmp_path: Path) -> None:
    """The flake of the kill -9 test above on a loaded machine: the survivor logged its checkpoint, then stayed blocked in a
    collective that never failed, where the SIGTERM torchrun sent it could not reach Python; torchrun killed it 30 s later
    (-9, no line). Here the peer is stopped (SIGSTOP) right after the checkpoint, so every collective of the survivor waits
    on it for ``distributed.timeout_s``, and the survivor gets torchrun's SIGTERM: it ends within
    ``distributed.stuck_after_signal_s`` with the lost rank's line, the whole checkpoint and exit 75, its run FAILED."""
    uri = store_uri
    args = [*SHORT, f"tracking.uri={uri}", "tracking.experiment=stuck", f"hydra.run.dir={tmp_path}/run",
            "distributed.stuck_after_signal_s=2"]
    proc = _kill_after_first_checkpoint(_torchrun("--log-dir=logs", "--redirects=3", "-m", "recsys_runner", *args),
                                        "run/checkpoints", rank=1, cwd=tmp_path, sig=signal.SIGSTOP)
    workers = _workers(proc)
    try:
        os.kill(workers[0], signal.SIGTERM)  # what torchrun sends the survivors once it sees a rank gone
        deadline = time.monotonic() + 25  # torchrun's kill comes 30 s after its SIGTERM
        while not _ended(workers[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        ended = _ended(workers[0])
    finally:
        os.kill(workers[1], signal.SIGKILL)  # stopped, it would hold torchrun 30 s past its SIGTERM
    out, _ = proc.communicate(timeout=120)
    assert ended, f"rank 0 still blocked 25 s after SIGTERM: {out[-3000:]}"
    assert "exitcode  : 75" in out, out[-3000:]
    survivor = _rank_output(tmp_path / "logs", 0, 0)
    assert "Traceback" not in survivor, survivor[-3000:]
    lines = survivor.splitlines()
    (i,) = [n for n, line in enumerate(lines) if line.startswith("Rank lost: ")]
    assert lines[i].startswith("Rank lost: rank 1 of 2 stopped answering: a collective on rank 0 (local rank 0 on node 0) "
                               "failed after step "), lines[i]
    assert "after SIGTERM, waiting on it" in lines[i], lines[i]
    assert lines[i + 1].startswith("Resume this run from step_00000005,"), survivor[-2000:]  # whole before the stop
    assert _only_run(uri, "stuck").info.status == "FAILED"


def _ended(pid: int) -> bool:
    """Process ``pid`` (not this one's child) has ended: gone, or a zombie its parent has yet to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


RESTARTED_GROUP = """
import os, signal, time
import torch, torch.distributed as dist
from recsys_runner.distributed.config import DistributedConfig
from recsys_runner.distributed.sharding import Distributed
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 0:
    time.sleep(3)  # rank 1 of the restart looks for rank 0's address before this rank 0 has published it
Distributed(DistributedConfig(device="cpu", timeout_s=20, num_threads=1)).setup()
dist.all_reduce(torch.ones(1))
if attempt == 0:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    dist.all_reduce(torch.ones(1))
print(f"attempt {attempt} rank {rank}: group formed", flush=True)
"""


@pytest.mark.slow
def test_a_restarted_group_forms_on_the_store_of_its_own_attempt(tmp_path: Path) -> None:
    """torchrun's store outlives a restart: without a prefix per attempt (launch.elastic_store) rank 1 of the restart
    reads rank 0's gloo address of the attempt before and fails ('Gloo connectFullMesh failed ... Connection refused')."""
    script = tmp_path / "group.py"
    script.write_text(RESTARTED_GROUP)
    out = subprocess.run(_torchrun("--max-restarts=1", str(script)), cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "attempt 1 rank 0: group formed" in out.stdout and "attempt 1 rank 1: group formed" in out.stdout, out.stdout


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_the_same_run_after_kill_9_of_rank_0(store_uri: str, tmp_path: Path) -> None:
    """docs/launch.md's recommendation: with ``--max-restarts`` and a checkpoint.dir, torchrun restarts the group, which
    resumes from the last checkpoint into the same MLflow run and finishes. Rank 0 (the MLflow owner) is the one killed."""
    uri = store_uri
    args = [*SHORT, f"tracking.uri={uri}", "tracking.experiment=elastic", f"checkpoint.dir={tmp_path}/ckpt"]
    proc = _kill_after_first_checkpoint(
        _torchrun("--max-restarts=1", "--log-dir=logs", "--redirects=3", "-m", "recsys_runner", *args), "ckpt", rank=0, cwd=tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    survivor = _rank_output(tmp_path / "logs", 0, 1)
    assert "Rank lost: rank 0 of 2 stopped: a collective on rank 1" in survivor and "Traceback" not in survivor, survivor[-3000:]
    assert "torchrun restarts the group (restart 1 of 1)" in survivor
    restarted = _rank_output(tmp_path / "logs", 1, 0, "stdout")  # the log lines
    assert "resuming from" in restarted and "step_000000" in restarted, restarted[-3000:]
    run = _only_run(uri, "elastic")  # one run: the restarted rank 0 continued the one its killed predecessor opened
    assert run.info.status == "FINISHED" and run.data.tags.get("resumed") == "true"
    assert sorted(m.step for m in MlflowClient(tracking_uri=uri).get_metric_history(run.info.run_id, "train/loss"))[-1] == 40
