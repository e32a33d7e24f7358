"""An object store that stalls (SIGSTOP of a real loopback S3 server), a wrong endpoint and a missing bucket, on every
path that talks to a store: data listings and reads, the checkpoint lock, checkpoint writes and reads, and a training
run whose checkpoint store stops answering (its failure, and a SIGTERM while it waits). Each gives up within the bound
of ``storage.*`` with one error naming the URI, what was being done and the fix (docs/storage.md)."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from recsys_runner import store_settings, stores, uris
from recsys_runner.checkpoint.lock import ObjectStoreLock
from recsys_runner.checkpoint.object_storage import DcpObjectStorage
from recsys_runner.errors import CheckpointError, DataError, UserError
from tests.conftest import REPO, free_port, hint_of, run_in_process
from tests.object_store import MotoServer, moto_with_buckets

FAST = store_settings.StorageConfig(max_attempts=2, connect_timeout_s=1, request_timeout_s=1, lock_ttl_s=6)
"""Small bounds, so a stalled store fails in seconds: 2 attempts of (1 s connect + 1 s answer) with 1 s backoff."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto server for the module, with a bucket ``ckpt``; every test leaves it answering (SIGCONT)."""
    with moto_with_buckets(tmp_path_factory.mktemp("s3"), "ckpt") as server:
        yield server


@pytest.fixture
def store(server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoServer]:
    with server.as_client(monkeypatch, FAST):
        yield server


SLACK_S = 10
"""What a call may take beyond the bound of the settings in force: a client made anew, the error's own calls, a loaded
machine (6.7 s for a 2 s bound seen at the end of a full 2-worker run on 2 cores). It tells a bounded call from one left
to botocore's defaults (60 s per connection and answer, retried: minutes), not a fast machine from a slow one."""


def _fails_within_bound(call: Callable[[], object], error: type[UserError], pattern: str) -> float:
    started = time.monotonic()
    with pytest.raises(error, match=pattern):
        call()
    elapsed = time.monotonic() - started
    bound = store_settings.give_up_after_s()
    assert elapsed <= bound + SLACK_S, f"{elapsed:.1f} s > the bound {bound:.0f} s + {SLACK_S} s"
    return elapsed


def test_a_stalled_store_fails_each_path_within_the_bound_naming_what_was_being_done(store: MotoServer) -> None:
    storage, root = DcpObjectStorage(), uris.as_path("s3://ckpt/stall")
    storage.write(root / "step_00000002", {"model/w": torch.arange(4.0)}, {"objects": {}}, {"step": 2, "world_size": 1})
    stores.write_bytes("s3://ckpt/data/a.txt", b"x\n")
    # answers waited for only a quarter second from here: every call below goes to the stopped server (what it says is
    # the point, and that it gives up within the bound in force, not how long that bound is); FAST again once it answers
    store_settings.configure(dataclasses.replace(FAST, connect_timeout_s=0.25, request_timeout_s=0.25))
    store.pause()
    unreachable = r"cannot be reached at http://127\.0\.0\.1:\d+, after 2 attempts with backoff \(storage\.max_attempts.*Fix: check"
    _fails_within_bound(lambda: ObjectStoreLock("s3://ckpt/other").acquire(), CheckpointError,
                        rf"checkpoint\.dir='s3://ckpt/other' \(taking the run's lock\): the store {unreachable}")
    _fails_within_bound(lambda: storage.write(root / "step_00000004", {"model/w": torch.zeros(4)}, {"objects": {}},
                                              {"step": 4, "world_size": 1}),
                        CheckpointError, rf"s3://ckpt/stall/step_00000004 \(writing the checkpoint\): the store {unreachable}")
    _fails_within_bound(lambda: storage.read_meta(root / "step_00000002"), CheckpointError,
                        rf"s3://ckpt/stall/step_00000002 \(reading the checkpoint\): the store {unreachable}")
    _fails_within_bound(lambda: stores.list_files("s3://ckpt/data/", "data.path", None), DataError,
                        rf"data\.path='s3://ckpt/data/' \(listing it\): the store {unreachable}")
    _fails_within_bound(lambda: stores.read_bytes("s3://ckpt/data/a.txt"), DataError,
                        rf"s3://ckpt/data/a\.txt \(reading it\): the store {unreachable}")
    store.resume()  # the checkpoint written before the stall is whole, and the one cut off is not listed
    store_settings.configure(FAST)
    assert storage.checkpoints(root) == [root / "step_00000002"] and storage.damage(root / "step_00000002") is None


def test_a_wrong_endpoint_and_a_missing_bucket_raise_the_store_error_not_botocore(store: MotoServer) -> None:
    store_settings.configure(store_settings.StorageConfig(endpoint_url=f"http://127.0.0.1:{free_port()}", max_attempts=1, connect_timeout_s=1))
    _fails_within_bound(lambda: stores.list_files("s3://ckpt/data/", "data.path", None), DataError,
                        r"data\.path='s3://ckpt/data/' \(listing it\): the store cannot be reached")  # EndpointConnectionError
    _fails_within_bound(lambda: ObjectStoreLock("s3://ckpt/x").acquire(), CheckpointError,
                        r"checkpoint\.dir='s3://ckpt/x' \(taking the run's lock\): the store cannot be reached")
    store_settings.configure(FAST)
    _fails_within_bound(lambda: ObjectStoreLock("s3://no-such-bucket/run").acquire(), CheckpointError,
                        r"checkpoint\.dir='s3://no-such-bucket/run': its bucket 'no-such-bucket' does not exist.*Fix: create it")


def _cli(tmp: Path, server: MotoServer, *args: str, request_timeout_s: int = 1) -> list[str]:
    """The training command on generated data, with the store's bound at 2 × (1 s + ``request_timeout_s``) + 1 s."""
    files = any(a.startswith("data=") for a in args)
    data = [] if files else ["data.num_embeddings=1000", "data.num_train_rows=32768", "data.num_eval_rows=2048"]
    endpoint = [] if any(a.startswith("storage.endpoint_url=") for a in args) else [f"storage.endpoint_url={server.endpoint}"]
    return [sys.executable, "-m", "recsys_runner", "data.batch_size=256", *data, "train.log_every_steps=1", "train.eval_every_steps=null",
            "distributed.device=cpu", f"tracking.uri=sqlite:///{tmp}/mlflow.db", *endpoint, "storage.max_attempts=2",
            "storage.connect_timeout_s=1", f"storage.request_timeout_s={request_timeout_s}", *args]


def _env(server: MotoServer) -> dict[str, str]:
    return {**os.environ, **server.env, "PYTHONPATH": str(REPO)}


@pytest.mark.slow
def test_checkpoint_dir_faults_are_one_line_before_the_model_is_built(store: MotoServer, tmp_path: Path) -> None:
    """A missing bucket, and an endpoint nothing listens on, for checkpoint.dir and data.path: exit 2, one line naming
    the setting and the fix, no traceback, nothing built (the lock and the data's listing come first). The first case
    through a process, the other two in this process as ``python -m`` runs them (:func:`tests.conftest.run_in_process`:
    the same exit status and output, without ~10 s of imports each)."""
    dead = f"storage.endpoint_url=http://127.0.0.1:{free_port()}"
    cases = [
        (["checkpoint.dir=s3://no-such-bucket/run"], r"Checkpoint error: checkpoint\.dir='s3://no-such-bucket/run': its bucket "
                                                     r"'no-such-bucket' does not exist"),
        (["checkpoint.dir=s3://ckpt/run", dead], r"Checkpoint error: checkpoint\.dir='s3://ckpt/run' \(taking the run's lock\): the "
                                                 r"store cannot be reached"),
        (["data=parquet", "data.path=s3://ckpt/train/", dead], r"Data error: data\.path='s3://ckpt/train/' \(listing it\): the store "
                                                                r"cannot be reached"),
    ]
    for i, (args, expected) in enumerate(cases):
        if i == 0:
            done = subprocess.run(_cli(tmp_path, store, *args), cwd=tmp_path, env=_env(store), capture_output=True, text=True, timeout=120)
        else:
            done = run_in_process(_cli(tmp_path, store, *args), tmp_path, env=store.env)
        assert done.returncode == 2, done.stderr[-3000:]
        assert re.search(expected, done.stderr) and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert "sharding plan" not in (done.stdout + done.stderr).lower(), done.stderr[-3000:]


def _start_training(tmp: Path, server: MotoServer, directory: str, request_timeout_s: int = 1, *more: str,
                    steps: int = 40) -> tuple[subprocess.Popen[str], list[str]]:
    """A training run of ``steps`` steps checkpointing every 2 into ``directory``; returns once its first checkpoint is
    in (step 2: the store is stopped long before the run could end)."""
    lines: list[str] = []
    live = subprocess.Popen(_cli(tmp, server, f"train.num_steps={steps}", "checkpoint.every_steps=2", f"checkpoint.dir={directory}",
                                 *more, request_timeout_s=request_timeout_s),
                            cwd=tmp, env=_env(server), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert live.stdout is not None
    for line in live.stdout:
        lines.append(line)
        if "checkpoint saved: s3://" in line:
            return live, lines
    raise AssertionError("".join(lines[-50:]))


def _main_thread_blocked(pid: int, for_s: float = 0.5) -> bool:
    """Whether the main thread of process ``pid`` sleeps through ``for_s`` seconds without using CPU: blocked, as a
    thread waiting on a stalled store is (a training step computes; a thread starved of a core is runnable, not asleep)."""
    def sample() -> tuple[str, int]:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])  # state, then user + system clock ticks

    state, used = sample()
    time.sleep(for_s)
    return state == "S" and sample() == ("S", used)


@pytest.mark.slow
def test_training_whose_checkpoint_store_stalls_fails_or_stops_with_the_resume_command(store: MotoServer, tmp_path: Path) -> None:
    """The store stops answering after the first checkpoints: the run fails within the bound with one line and the
    command that resumes from the last complete checkpoint, and that command continues once the store is back. A SIGTERM
    while a run waits on the stalled store stops it within a second or two (not after the bound), the same way."""
    live, lines = _start_training(tmp_path, store, "s3://ckpt/stalled")
    store.pause()
    started = time.monotonic()
    out, _ = live.communicate(timeout=120)
    elapsed, out = time.monotonic() - started, "".join(lines) + out
    assert live.returncode == 2, out[-3000:]
    assert elapsed < 5 + 20, f"{elapsed:.1f} s"  # the bound (5 s), the lock's release (2 s) and the exit
    assert re.search(r"Checkpoint error: s3://ckpt/stalled/step_\d+ \((writing the checkpoint|checking whether the checkpoint is complete)\): "
                     r"the store cannot be reached", out), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    hint = hint_of(out)
    assert hint is not None, out[-3000:]
    store.resume()
    saved = stores.fsspec_filesystem("s3://ckpt/stalled")[0].find("ckpt/stalled")
    assert any(p.endswith("meta.json") for p in saved), saved

    # The bound: 2 × 21 s + 1 s. The signal must come while the main thread waits on the store: one that comes while it
    # trains is taken after the step, whose checkpoint then waits for the whole bound (CI met this twice, with a request
    # of another thread found waiting, or the main thread's about to be); so both are waited for.
    # 16 steps: the printed command, run to the end below, trains and checkpoints the rest (of 40: 3 times as many)
    live, lines = _start_training(tmp_path, store, "s3://ckpt/stopped", 20, "storage.lock_ttl_s=3600", steps=16)
    store.pause()
    deadline = time.monotonic() + 60
    while not (store.request_waiting() and _main_thread_blocked(live.pid)):
        assert live.poll() is None and time.monotonic() < deadline, "no request of the main thread reached the paused store"
        time.sleep(0.05)
    sent = time.monotonic()
    live.send_signal(signal.SIGTERM)
    out, _ = live.communicate(timeout=60)
    waited, out = time.monotonic() - sent, "".join(lines) + out
    store.resume()
    assert live.returncode == 143, out[-3000:]
    assert waited < 20, f"the stop took {waited:.1f} s: it waited for the store to give up (43 s): {out[-3000:]}"
    assert "while waiting on the object store" in out and hint_of(out) is not None, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    resumed = run_in_process(hint_of(out) or [], tmp_path, env=store.env)  # the printed command, as python -m runs it
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"resuming from s3://ckpt/stopped/step_\d+", resumed.stdout + resumed.stderr), resumed.stderr[-3000:]
