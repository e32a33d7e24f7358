"""Object-store paths (``s3://``) against a real S3-compatible server on loopback (moto's, started here: nothing to
set up): data from a bucket read as from disk, checkpoints to a bucket with the one-writer lock, kill -9 and resume
to the same eval as local checkpoints, predict and export to a bucket, and the faults: a stopped server, wrong
credentials, a missing bucket, an empty prefix."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing import forkserver
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir

from recsys_runner import store_settings, stores, uris
from recsys_runner.__main__ import run
from recsys_runner.checkpoint.lock import DirectoryInUse, ObjectStoreLock
from recsys_runner.checkpoint.object_storage import DcpObjectStorage
from recsys_runner.config import register_configs
from recsys_runner.configurable import make
from recsys_runner.data.files.criteo_config import CriteoDataConfig
from recsys_runner.data.files.prefetch import read_ahead
from recsys_runner.data.files.sources import Unit
from recsys_runner.data.files.spread_sample import spread_lines, text_spans
from recsys_runner.data.files.tabular import CriteoData, CsvData, ParquetData
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig
from recsys_runner.data.generated.generate import write_criteo_csv, write_criteo_parquet, write_criteo_tsv
from recsys_runner.data.workers import worker_context
from recsys_runner.errors import CheckpointError, DataError
from recsys_runner.paths import CONFIG_PATH
from tests.conftest import REPO, run_in_process
from tests.object_store import MotoServer, start_moto


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto server for the module, with a bucket ``data`` holding Criteo-shaped Parquet (``train/``, two files in
    row groups of 700) and CSV (``csv/``); stopped by its PID at the end."""
    tmp = tmp_path_factory.mktemp("s3")
    server = start_moto(tmp)
    try:
        server.bucket("data")
        (tmp / "train").mkdir()
        for i in range(2):
            write_criteo_parquet(str(tmp / "train" / f"part{i}.parquet"), 2500, seed=i, num_embeddings=1000, row_group_rows=700)
        server.put(tmp / "train", "s3://data/train")
        (tmp / "csv").mkdir()
        write_criteo_csv(str(tmp / "csv" / "a.csv"), 900, seed=3)
        server.put(tmp / "csv", "s3://data/csv")
        server.local = tmp  # type: ignore[attr-defined]
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoServer]:
    """This process set up as a user would: the server's endpoint and credentials in the environment."""
    with s3.as_client(monkeypatch, store_settings.StorageConfig(max_attempts=2, connect_timeout_s=1, request_timeout_s=2)):
        yield s3


def _ids(batches: Iterator) -> list[tuple[int, ...]]:
    return [tuple(b.sparse_features["cat_0"].values().tolist()) + tuple(b.labels.tolist()) for b in batches]


# -- 1. data ------------------------------------------------------------------------------------------------------------
def test_bucket_data_reads_the_same_batches_as_local_files_per_rank_and_worker(s3_env: MotoServer) -> None:
    local = s3_env.local  # type: ignore[attr-defined]
    for path in ("s3://data/train/", "s3://data/train/*.parquet"):
        assert stores.list_files(path, "data.path", (".parquet",)) == ["s3://data/train/part0.parquet", "s3://data/train/part1.parquet"]
    args = {"batch_size": 64, "eval_fraction": 0.2, "num_workers": 2}
    remote = ParquetData(make(ParquetDataConfig, path="s3://data/train/*.parquet", **args))
    disk = ParquetData(make(ParquetDataConfig, path=f"{local}/train", **args))
    for rank in range(2):  # rank- and worker-disjoint exactly as on disk: the same rows, in the same batches
        assert _ids(remote.train_batches(1, rank, 2)) == _ids(disk.train_batches(1, rank, 2))
        assert _ids(remote.eval_batches(rank, 2)) == _ids(disk.eval_batches(rank, 2))
    csv_args = {"label": "label", "batch_size": 50, "shuffle": False, "num_workers": 0}
    csv_remote = CsvData(make(CsvDataConfig, path="s3://data/csv/a.csv", **csv_args))
    csv_disk = CsvData(make(CsvDataConfig, path=f"{local}/csv/a.csv", **csv_args))
    assert _ids(csv_remote.train_batches(0, 0, 1)) == _ids(csv_disk.train_batches(0, 0, 1))


def test_a_forked_worker_builds_its_own_store_client_and_reads_the_bucket(s3_env: MotoServer) -> None:
    """A DataLoader worker is a fork of the training process: it must not reuse the parent's client (its SDK threads
    did not come along; a lock one held stays held), so the fork drops the cached clients and the child reads through
    a new one."""
    path = "s3://data/train/part0.parquet"
    parent, _ = stores.arrow_filesystem(path)
    size = stores.file_size(path)
    gc.freeze()  # the child must not finalize this process's garbage (data/workers.py: WorkerLoader)
    pid = os.fork()
    if pid:
        gc.unfreeze()
    if pid == 0:  # the child: report through the exit status only
        fresh = store_settings.arrow_s3.cache_info().currsize == 0
        child, _ = stores.arrow_filesystem(path)
        ok = fresh and child is not parent and stores.file_size(path) == size and len(stores.open_input(path).read()) == size
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child reused the parent's client or could not read"
    assert stores.arrow_filesystem(path)[0] is parent  # the parent keeps its own


def test_forkserver_workers_read_the_bucket_with_the_settings_and_environment_of_now(s3: MotoServer,
                                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A forkserver worker is no copy of the training process: the store's endpoint and credentials set in the environment
    after the server started, and ``storage.*``, reach it with the loader (data/workers.py), so it reads the bucket's rows
    as a forked worker does."""
    worker_context("forkserver", ParquetData.__module__)  # the server's preload, then the server of this process, started
    forkserver.ensure_running()  # before the store is set up
    with s3.as_client(monkeypatch, store_settings.StorageConfig(max_attempts=1, connect_timeout_s=1, request_timeout_s=2)):
        args = {"path": "s3://data/train/part0.parquet", "batch_size": 64, "eval_fraction": 0.2, "num_workers": 2}
        served = ParquetData(make(ParquetDataConfig, worker_start="forkserver", **args))
        forked = ParquetData(make(ParquetDataConfig, **args))
        assert _ids(served.train_batches(0, 0, 1)) == _ids(forked.train_batches(0, 0, 1))


def test_criteo_tsv_from_a_bucket_reads_the_same_batches_and_tables_as_the_local_files(s3_env: MotoServer, tmp_path: Path) -> None:
    """``data=criteo`` (raw TSV, no header) from a prefix: the tables sized from a sample read through the store, and
    per rank the same blocks of lines, batches and hash-split eval rows as the same files on disk."""
    (tmp_path / "tsv").mkdir()
    for day in range(2):
        write_criteo_tsv(str(tmp_path / "tsv" / f"day_{day}.tsv"), 700, seed=10 + day)
    s3_env.put(tmp_path / "tsv", "s3://data/tsv")
    args = {"batch_size": 40, "eval_fraction": 0.25, "block_rows": 128, "num_workers": 0}
    remote = CriteoData(make(CriteoDataConfig, path="s3://data/tsv/", **args))  # num_embeddings=null: sized from the files
    disk = CriteoData(make(CriteoDataConfig, path=f"{tmp_path}/tsv", **args))
    assert [c.num_embeddings for c in remote.features.sparse] == [c.num_embeddings for c in disk.features.sparse]
    for rank in range(2):
        ids = _ids(remote.train_batches(1, rank, 2))
        assert ids and ids == _ids(disk.train_batches(1, rank, 2))
        assert _ids(remote.eval_batches(rank, 2)) == _ids(disk.eval_batches(rank, 2))
    first = next(iter(remote.train_batches(0, 0, 1)))
    assert torch.equal(first.dense_features, next(iter(disk.train_batches(0, 0, 1))).dense_features)


def test_object_store_units_are_read_ahead_while_the_current_one_is_used() -> None:
    read: list[int] = []

    class Slow:
        def read(self, unit: Unit) -> Iterator[tuple[pa.Table, np.ndarray]]:
            read.append(unit.index)
            yield pa.table({"x": [unit.index]}), np.arange(1)

    units = [Unit(f"s3://b/{i}.parquet", i, 0, 1) for i in range(5)]
    ahead = read_ahead(Slow(), units, depth=2)
    first = next(ahead)
    deadline = time.monotonic() + 10
    while len(read) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert read == [0, 1, 2]  # while unit 0 is in use, units 1 and 2 are read in the background, no further
    assert [t["x"][0].as_py() for t, _ in first] == [0]
    assert [next(iter(tables))[0]["x"][0].as_py() for tables in ahead] == [1, 2, 3, 4]
    local = [Unit(f"/data/{i}.parquet", i, 0, 1) for i in range(2)]
    read.clear()
    lazy = read_ahead(Slow(), local, depth=2)
    next(lazy)
    assert read == []  # local files: read in turn, when their rows are wanted


def test_missing_bucket_empty_prefix_and_wrong_credentials_name_the_uri(s3_env: MotoServer, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DataError, match=r"data.path='s3://data/nothing/' is an empty prefix.*Fix:"):
        ParquetData(make(ParquetDataConfig, path="s3://data/nothing/"))
    with pytest.raises(DataError, match=r"s3://nobucket/train/: the bucket 'nobucket' does not exist .*Fix: create it"):
        ParquetData(make(ParquetDataConfig, path="s3://nobucket/train/"))
    # said as such, not wrapped as the store refusing the listing (our DataError is a ValueError, which a store raises too)
    with pytest.raises(DataError, match=r"^data.path='s3://data/train/\*.csv' is a glob pattern that matches no objects\. Fix: check"):
        ParquetData(make(ParquetDataConfig, path="s3://data/train/*.csv"))
    with pytest.raises(DataError, match=r"^s3://nobucket/train/\*.parquet: the bucket 'nobucket' does not exist .*Fix: create it"):
        ParquetData(make(ParquetDataConfig, path="s3://nobucket/train/*.parquet"))
    strict = start_moto(tmp_path, {"INITIAL_NO_AUTH_ACTION_COUNT": "0"})  # a server that checks credentials
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", strict.endpoint)
        store_settings.configure(store_settings.StorageConfig(max_attempts=1))
        with pytest.raises(DataError, match=r"s3://data/train/.*access denied.*Fix: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
            ParquetData(make(ParquetDataConfig, path="s3://data/train/"))
    finally:
        strict.stop()


def test_reads_retry_then_fail_clearly_when_the_server_stops(s3_env: MotoServer, tmp_path: Path) -> None:
    server = s3_env  # the module's server, stopped (SIGSTOP) here and answering again at the end (s3_env)
    try:
        server.bucket("slow")
        pq.write_table(pa.table({"label": np.arange(1000) % 2, "rid": np.arange(1000)}), tmp_path / "a.parquet", row_group_size=50)
        server.put(tmp_path / "a.parquet", "s3://slow/a.parquet")
        store_settings.configure(store_settings.StorageConfig(endpoint_url=server.endpoint, max_attempts=2, connect_timeout_s=1, request_timeout_s=1))
        data = ParquetData(make(ParquetDataConfig, path="s3://slow/a.parquet", batch_size=10, shuffle=False,
                                sparse=[{"name": "rid", "num_embeddings": 1000}]))
        batches = data.train_batches(0, 0, 1)
        next(batches)
        server.pause()  # the server stops answering mid-epoch
        started = time.monotonic()
        with pytest.raises(DataError, match=r"s3://slow/a.parquet.*the store cannot be reached at http://127.0.0.1:\d+, after 2 attempts "
                                            r"with backoff.*Fix:"):
            list(batches)
        assert time.monotonic() - started >= 1  # it waited and tried again before giving up
    finally:
        server.resume()


class _CountedReads:
    """A store's file whose reads (``read_at``, ``readinto``, ``read``: every way pyarrow's file is read) are counted,
    with the most in flight at once; each takes a little longer, so reads issued together overlap."""

    def __init__(self, f: object, counts: dict[str, int], lock: threading.Lock, fail: BaseException | None) -> None:
        self._f, self._counts, self._lock, self._fail = f, counts, lock, fail

    def __getattr__(self, name: str) -> object:
        return getattr(self._f, name)

    def _counted(self, name: str, *args: object) -> object:
        with self._lock:
            self._counts["total"] += 1
            self._counts["now"] += 1
            self._counts["most"] = max(self._counts["most"], self._counts["now"])
        try:
            time.sleep(0.002)
            if self._fail is not None:
                raise self._fail
            return getattr(self._f, name)(*args)
        finally:
            with self._lock:
                self._counts["now"] -= 1

    def read_at(self, *args: object) -> object:
        return self._counted("read_at", *args)

    def readinto(self, *args: object) -> object:
        return self._counted("readinto", *args)

    def read(self, *args: object) -> object:
        return self._counted("read", *args)


def _count_reads(monkeypatch: pytest.MonkeyPatch, fail: BaseException | None = None) -> dict[str, int]:
    """Count the reads of the files the store opens (:class:`_CountedReads`); with ``fail``, each raises it instead."""
    counts, lock, real = {"total": 0, "now": 0, "most": 0}, threading.Lock(), stores.arrow_filesystem

    class Fs:
        def __init__(self, fs: object) -> None:
            self._fs = fs

        def __getattr__(self, name: str) -> object:
            return getattr(self._fs, name)

        def open_input_file(self, path: str) -> object:
            return _CountedReads(self._fs.open_input_file(path), counts, lock, fail)  # type: ignore[attr-defined]

    monkeypatch.setattr(stores, "arrow_filesystem", lambda path: (lambda fs, rest: (Fs(fs), rest))(*real(path)))
    return counts


@pytest.fixture(scope="module")
def long_lines_csv(s3: MotoServer) -> tuple[Path, str]:
    """A 4 MB CSV of lines of uneven length, a few longer than a span's block (40 KB), locally and in the bucket."""
    rng = np.random.default_rng(5)
    path = s3.local / "long.csv"  # type: ignore[attr-defined]
    with open(path, "wb") as f:
        f.write(b"id,label,text\n")
        for i in range(30_000):
            width = 40_000 if i % 2_000 == 7 else int(rng.integers(20, 250))
            f.write(b"%d,%d,%s\n" % (i, i % 2, b"x" * width))
    s3.put(path, "s3://data/spread/long.csv")
    return path, "s3://data/spread/long.csv"


def test_spread_sample_of_a_bucket_file_is_the_local_files_read_ahead_concurrently(
        s3_env: MotoServer, long_lines_csv: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    local, uri = long_lines_csv
    start = len(b"id,label,text\n")
    num_rows = 5_000  # 250 spans of 20 KB, some holding a line longer than the 16 KiB read ahead at a span
    spans = len(text_spans([(str(local), start, local.stat().st_size)], num_rows))
    want = spread_lines([(str(local), start)], num_rows)[str(local)]
    counts = _count_reads(monkeypatch)
    got = spread_lines([(uri, start)], num_rows)[uri]
    assert got == want and len(got) == num_rows  # the same lines at the same offsets
    assert counts["most"] > 1  # the spans' reads overlap, not one round trip after another
    assert spans <= counts["total"] <= spans + 40  # a request per span, and one per 16 KiB more of the 15 long lines


def test_a_store_failure_in_a_read_ahead_names_the_uri(s3_env: MotoServer, long_lines_csv: tuple[Path, str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _count_reads(monkeypatch, fail=OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 7"))
    with pytest.raises(DataError, match=r"^s3://data/spread/long.csv \(reading it\): the store cannot be reached.*Fix:"):
        spread_lines([(long_lines_csv[1], 14)], 10_000)


# -- 2. checkpoints -----------------------------------------------------------------------------------------------------
def test_object_store_lock_is_a_conditional_create_taken_over_only_when_abandoned(s3_env: MotoServer) -> None:
    first, second = ObjectStoreLock("s3://data/lock-test"), ObjectStoreLock("s3://data/lock-test")
    first.acquire()
    with pytest.raises(DirectoryInUse, match=rf"s3://data/lock-test is in use by another live run: host .*, pid {os.getpid()}"):
        second.acquire()
    first.release()
    second.acquire()
    second.release()
    # a holder that died (kill -9: no release) on this host is taken over at once
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    fs = s3_env.fs()
    fs.pipe_file("data/lock-test/.lock", json.dumps({"host": socket.gethostname(), "pid": dead.pid, "renewed": time.time()}).encode())
    taken = ObjectStoreLock("s3://data/lock-test")
    taken.acquire()
    taken.release()
    # one of another host is refused once it is renewed, and taken over when its lease (storage.lock_ttl_s) runs out unrenewed
    store_settings.configure(store_settings.StorageConfig(lock_ttl_s=3))
    elsewhere = ObjectStoreLock("s3://data/lock-test")
    elsewhere.acquire()
    fs.pipe_file("data/lock-test/.lock", json.dumps({"host": "elsewhere", "pid": 1, "renewed": time.time()}).encode())
    with pytest.raises(DirectoryInUse, match="host elsewhere"):
        ObjectStoreLock("s3://data/lock-test").acquire()  # the renewal thread of `elsewhere` rewrites it within 1 s
    elsewhere.release()
    fs.pipe_file("data/lock-test/.lock", json.dumps({"host": "elsewhere", "pid": 1, "renewed": time.time()}).encode())
    started = time.monotonic()
    stale = ObjectStoreLock("s3://data/lock-test")
    stale.acquire()
    assert 2 <= time.monotonic() - started < 10
    stale.release()


def test_a_note_beside_the_checkpoints_is_written_and_read_back_in_a_bucket(s3_env: MotoServer) -> None:
    """The record of a run's MLflow run (``.mlflow_run``, tests/test_requeue.py) goes through the checkpoint storage, so
    a checkpoint directory in a bucket keeps it too; it is no checkpoint and no unfinished one."""
    storage, root = DcpObjectStorage(), uris.as_path("s3://data/note-test")
    assert storage.read_note(root, ".mlflow_run") is None
    storage.write_note(root, ".mlflow_run", "one")
    storage.write_note(root, ".mlflow_run", "two")
    assert storage.read_note(root, ".mlflow_run") == "two"
    assert s3_env.fs().cat_file("data/note-test/.mlflow_run") == b"two"
    assert storage.checkpoints(root) == [] and storage.unfinished(root) == []


def test_a_failed_checkpoint_write_leaves_the_previous_one_usable(s3_env: MotoServer) -> None:
    server = s3_env  # the module's server, stopped (SIGSTOP) here and answering again at the end (s3_env)
    try:
        server.bucket("ckpt")
        store_settings.configure(store_settings.StorageConfig(endpoint_url=server.endpoint, max_attempts=1, connect_timeout_s=1, request_timeout_s=1))
        storage, root = DcpObjectStorage(), uris.as_path("s3://ckpt/run")
        good = {"model/w": torch.arange(6.0)}
        storage.write(root / "step_00000002", good, {"objects": {}}, {"step": 2, "world_size": 1})
        server.pause()
        with pytest.raises(CheckpointError, match=r"s3://ckpt/run/step_00000004.*cannot be reached"):
            storage.write(root / "step_00000004", {"model/w": torch.zeros(6)}, {"objects": {}}, {"step": 4, "world_size": 1})
        server.resume()
        assert storage.checkpoints(root) == [root / "step_00000002"]
        loaded = {"model/w": torch.empty(6)}
        storage.load_tensors(root / "step_00000002", loaded)
        assert torch.equal(loaded["model/w"], good["model/w"]) and storage.damage(root / "step_00000002") is None
    finally:
        server.resume()


def _train_args(tmp: Path, data: str, ckpt: str, experiment: str) -> list[str]:
    return ["data=parquet", f"data.path={data}", "data.batch_size=128", "data.eval_fraction=0.2", "train.num_steps=12",
            "train.log_every_steps=2", "train.eval_every_steps=null", "distributed.device=cpu", "checkpoint.every_steps=2",
            f"checkpoint.dir={ckpt}", f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"tracking.experiment={experiment}"]


def _final_eval(output: str) -> str:
    found = re.findall(r"step 12/12 (eval/auc=\S+ eval/logloss=\S+)", output)
    assert found, output[-3000:]
    return found[-1]


REFERENCE_ARGS = ("checkpoint.keep_last=2", "train.eval_every_steps=6", "checkpoint.best_metric=eval/auc")
"""What :func:`local_reference` trains with beyond :func:`_train_args`: the in-process resume's settings (an eval at step 6
as well, a best checkpoint kept apart: neither changes what is trained)."""


@pytest.fixture(scope="module")
def local_reference(s3: MotoServer, mlflow_uri: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """The final eval (step 12) of :func:`_train_args`' run on the bucket's files as local files, checkpoints on local
    disk, uninterrupted: the reference that both runs resumed from a bucket must reach (one training for both tests)."""
    tmp = tmp_path_factory.mktemp("local_reference")
    register_configs()
    overrides = [*_train_args(tmp, f"{s3.local}/train", f"{tmp}/ck", "local_reference"), f"tracking.uri={mlflow_uri}",  # type: ignore[attr-defined]
                 *REFERENCE_ARGS]
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        run(compose(config_name="config", overrides=overrides))
    (reference,) = _mlflow_runs(mlflow_uri, "local_reference")
    return {key: reference.data.metrics[key] for key in ("eval/auc", "eval/logloss")}


@pytest.mark.slow
def test_train_from_a_bucket_kill_9_resume_to_the_same_eval_then_predict_and_export_to_it(
    s3_env: MotoServer, tmp_path: Path, local_reference: dict[str, float]
) -> None:
    """The CLI where a process is the point: the run killed with -9. Its resume, and predict and export carrying the
    training's overrides from the bucket, run their commands in this process as ``python -m`` would
    (:func:`tests.conftest.run_in_process`: the module as ``__main__``, so the overrides are carried as on the command
    line); the local reference is :func:`local_reference` (interpreters and trainings fewer to start)."""
    s3 = s3_env
    env = {**os.environ, **s3.env, "PYTHONPATH": str(REPO)}
    uri = f"sqlite:///{tmp_path}/mlflow.db"

    def cli(*args: str, module: str = "recsys_runner") -> subprocess.CompletedProcess[str]:
        return run_in_process([sys.executable, "-m", module, *args], tmp_path, env=s3.env)

    args = _train_args(tmp_path, "s3://data/train/*.parquet", "s3://data/runs/ck", "bucket")
    live = subprocess.Popen([sys.executable, "-m", "recsys_runner", *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert live.stdout is not None
        for line in live.stdout:
            if "checkpoint saved: s3://data/runs/ck/step_00000002" in line:
                break
        s3.pause()  # the next step's reads or checkpoint hang: the run is surely killed mid-run
        live.send_signal(signal.SIGKILL)
        live.wait(timeout=60)
    finally:
        s3.resume()
    assert s3.fs().exists("data/runs/ck/.lock")  # a kill -9 leaves its lock behind ...
    resumed = cli(*args)  # ... which the same command takes over (its holder is gone), resuming from the bucket
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    assert "previous holder" in out and re.search(r"resuming from s3://data/runs/ck/step_0000000[24]", out), out[-3000:]
    (bucket,) = _mlflow_runs(uri, "bucket")
    assert bucket.data.tags.get("resumed") == "true" and bucket.data.metrics["eval/auc"] > 0  # the killed run, continued
    for key in ("eval/auc", "eval/logloss"):  # the final eval, logged at step 12 by each
        assert bucket.data.metrics[key] == pytest.approx(local_reference[key], rel=1e-6), key
    assert _final_eval(out).startswith(f"eval/auc={bucket.data.metrics['eval/auc']:.4g} ")  # the one the resumed run printed
    assert not s3.fs().exists("data/runs/ck/.lock")

    predicted = cli("load=s3://data/runs/ck", "predict.input=s3://data/train/part1.parquet", "predict.output=s3://data/scores",
                    *args[:3], "distributed.device=cpu", f"tracking.uri={uri}", module="recsys_runner.predict")
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    (part,) = s3.fs().glob("data/scores/part-*.parquet")
    with s3.fs().open(part, "rb") as f:
        assert pq.read_table(f).num_rows == 2500
    exported = cli("load=s3://data/runs/ck", "export.dir=s3://data/export", f"tracking.uri={uri}", module="recsys_runner.export")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "data/export/model.pt2" in s3.fs().find("data/export")


def _mlflow_runs(uri: str, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


def test_in_process_resume_from_a_bucket_matches_local(s3_env: MotoServer, tmp_path: Path, mlflow_uri: str,
                                                       local_reference: dict[str, float]) -> None:
    """The done-when of the issue in one process: a checkpoint written to the bucket resumes to the eval a local one does
    (:func:`local_reference`, trained with the same settings)."""
    register_configs()
    local = s3_env.local  # type: ignore[attr-defined]

    def final(ckpt: str, experiment: str, *extra: str) -> float:
        overrides = [*_train_args(tmp_path, f"{local}/train", ckpt, experiment), f"tracking.uri={mlflow_uri}",
                     f"storage.endpoint_url={s3_env.endpoint}", *REFERENCE_ARGS, *extra]
        with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
            return float(run(compose(config_name="config", overrides=overrides)))

    from recsys_runner.train.signals import Interrupted

    with pytest.raises(Interrupted):
        final("s3://data/inproc/ck", "inproc_bucket", "train.stop_after_steps=6")
    assert [p.name for p in DcpObjectStorage().checkpoints(uris.as_path("s3://data/inproc/ck"))][-1] == "step_00000006"
    assert final("s3://data/inproc/ck", "inproc_bucket") == pytest.approx(local_reference["eval/auc"], rel=1e-6)
    storage, root = DcpObjectStorage(), uris.as_path("s3://data/inproc/ck")
    assert [p.name for p in storage.checkpoints(root)] == ["step_00000010", "step_00000012"]  # keep_last=2 in the bucket
    assert len(storage.checkpoints(root, best=True)) == 1  # and the best one apart
    assert s3_env.fs().cat_file("data/inproc/ck/.finished").startswith(b"training finished")  # the mark, in the bucket
    assert not (tmp_path / "s3:").exists() and not Path("s3:").exists()  # nothing went to a local path named like the URI


class _KilledMidDelete:
    """The store's file system, with the deletion of ``name`` cut off part-way, by a kill (``SystemExit``) or a store
    that stops answering (``failure``): the store has removed every object of it but ``meta.json`` and ``.metadata`` (a
    bulk delete promises no order: here the worst one, the data first), nothing else of it. ``rm_file`` and every other
    call go to the store as they are."""

    def __init__(self, fs: object, name: str, failure: BaseException) -> None:
        self._fs, self._name, self._failure = fs, name, failure

    def __getattr__(self, attr: str) -> object:
        return getattr(self._fs, attr)

    def rm(self, path: str, recursive: bool = False, **kwargs: object) -> object:
        if recursive and path.rstrip("/").endswith(self._name):
            for key in self._fs.find(path):  # type: ignore[attr-defined]
                if not key.endswith(("/meta.json", "/.metadata")):
                    self._fs.rm_file(key)  # type: ignore[attr-defined]
            raise self._failure
        return self._fs.rm(path, recursive=recursive, **kwargs)  # type: ignore[attr-defined]


def _kill_while_deleting(monkeypatch: pytest.MonkeyPatch, name: str, failure: BaseException | None = None) -> None:
    real, failure = stores.fsspec_filesystem, failure or SystemExit("killed while deleting")
    monkeypatch.setattr(stores, "fsspec_filesystem",
                        lambda uri: (lambda fs, key: (_KilledMidDelete(fs, name, failure), key))(*real(uri)))


def _prefixes(s3: MotoServer, root: str) -> set[str]:
    """The names directly under ``root`` (``bucket/prefix``) in the bucket, whatever they hold."""
    return {key[len(root) + 1:].split("/", 1)[0] for key in s3.fs().find(root)}


@pytest.mark.parametrize("cut", ["kill", "store_failure"])
def test_a_kill_while_rotation_deletes_in_a_bucket_leaves_no_checkpoint_lookalike_and_the_next_write_sweeps_it(
    s3_env: MotoServer, tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """``keep_last=1`` in a bucket: the process dies (or the store stops answering) while rotation deletes step 2, after
    step 4 is written, the store having removed its data but not its ``.metadata``. What is left of step 2 is never
    listed as a checkpoint (rotation deletes ``meta.json`` first); a store failure ends the run naming step 4, the whole
    one, to resume from; the same command resumes from step 4, and its first checkpoint write deletes the leftover: at
    the end the bucket holds only the last checkpoint."""
    from botocore.exceptions import EndpointConnectionError

    from recsys_runner.errors import CheckpointWriteFailed

    register_configs()
    local = s3_env.local  # type: ignore[attr-defined]
    storage, root = DcpObjectStorage(), uris.as_path(f"s3://data/rotkill_{cut}/ck")

    def train(steps: int) -> None:
        overrides = [a for a in _train_args(tmp_path, f"{local}/train", str(root), f"rotkill_{cut}") if not a.startswith("train.num_steps")]
        overrides += [f"train.num_steps={steps}", "checkpoint.keep_last=1", f"tracking.uri={mlflow_uri}",
                      f"storage.endpoint_url={s3_env.endpoint}"]
        with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
            run(compose(config_name="config", overrides=overrides))

    with monkeypatch.context() as patched:
        if cut == "kill":
            _kill_while_deleting(patched, "step_00000002")
            with pytest.raises(SystemExit, match="killed while deleting"):
                train(6)
        else:
            _kill_while_deleting(patched, "step_00000002", EndpointConnectionError(endpoint_url=s3_env.endpoint))
            with pytest.raises(CheckpointWriteFailed, match=r"step_00000002 \(removing the checkpoint\): the store cannot be reached") as failed:
                train(6)
            assert failed.value.last_good == str(root / "step_00000004")
    assert "step_00000002" in _prefixes(s3_env, f"data/rotkill_{cut}/ck")  # part of it is left ...
    assert storage.checkpoints(root) == [root / "step_00000004"]  # ... and is no checkpoint: meta.json went first
    train(8)
    assert _prefixes(s3_env, f"data/rotkill_{cut}/ck") == {".finished", ".mlflow_run", "step_00000008"}  # the leftover swept,
    # step 4 and 6 rotated; the record of the MLflow run (tests/test_requeue.py) beside them
    assert storage.damage(root / "step_00000008") is None


def test_a_removal_cut_off_in_a_bucket_is_skipped_by_resume_with_a_warning_not_set_aside(
    s3_env: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newest checkpoint whose removal was cut off (moving it aside copies it, then deletes it): evaluate's
    ``load=<dir>`` passes over what is left of it, resume=auto warns that it skips it, resumes from the one before, and
    copies nothing aside (it is no checkpoint, and was a whole one elsewhere); the next write deletes it."""
    from recsys_runner.checkpoint import resume
    from recsys_runner.checkpoint.config import CheckpointConfig
    from recsys_runner.configurable import make
    from recsys_runner.tracking import lineage
    from tests.conftest import LogWarnings

    storage, root = DcpObjectStorage(), uris.as_path("s3://data/cutoff/ck")
    for step in (2, 4):
        storage.write(root / f"step_{step:08d}", {"model/w": torch.full((4,), float(step))}, {"objects": {}},
                      {"step": step, "epoch": 0, "epoch_step": step, "world_size": 1})
    with monkeypatch.context() as patched:
        _kill_while_deleting(patched, "step_00000004")
        with pytest.raises(SystemExit):
            storage.remove(root / "step_00000004")
    assert storage.checkpoints(root) == [root / "step_00000002"]
    assert lineage.locate_checkpoint(str(root)).path == root / "step_00000002"  # evaluate's load=<dir> passes over it too
    with LogWarnings("recsys_runner") as warned:
        chosen, set_aside = resume.choose(make(CheckpointConfig, dir=str(root)), storage, root)
    assert (chosen, set_aside) == (root / "step_00000002", ())
    assert any("step_00000004" in w and "cut off" in w for w in warned.messages), warned.messages
    assert _prefixes(s3_env, "data/cutoff/ck") == {"step_00000002", "step_00000004"}  # nothing copied aside
    storage.write(root / "step_00000006", {"model/w": torch.zeros(4)}, {"objects": {}},
                  {"step": 6, "epoch": 0, "epoch_step": 6, "world_size": 1})
    assert _prefixes(s3_env, "data/cutoff/ck") == {"step_00000002", "step_00000006"}


def test_resuming_an_older_step_in_a_bucket_deletes_an_unfinished_leftover_and_moves_finished_ones_aside(
    s3_env: MotoServer, tmp_path: Path, mlflow_uri: str
) -> None:
    """``checkpoint.resume=<bucket>/step_2`` where step 4 is a whole later checkpoint and step 6 what a removal cut off
    left (no ``meta.json``): step 4 is moved aside as ``abandoned-step_4`` (it continued the run otherwise), step 6 is
    no checkpoint and is deleted with a warning, never copied aside."""
    from tests.conftest import LogWarnings

    register_configs()
    local = s3_env.local  # type: ignore[attr-defined]
    root = "data/abandon/ck"

    def train(steps: int, *extra: str) -> None:
        overrides = [a for a in _train_args(tmp_path, f"{local}/train", f"s3://{root}", "abandon") if not a.startswith("train.num_steps")]
        overrides += [f"train.num_steps={steps}", f"tracking.uri={mlflow_uri}", f"storage.endpoint_url={s3_env.endpoint}", *extra]
        with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
            run(compose(config_name="config", overrides=overrides))

    train(6)
    s3_env.fs().rm_file(f"{root}/step_00000006/meta.json")  # a removal cut off after its first delete
    kept = s3_env.fs().cat_file(f"{root}/step_00000004/.metadata")
    with LogWarnings() as warned:
        train(4, f"checkpoint.resume=s3://{root}/step_00000002")
    assert _prefixes(s3_env, root) == {".finished", ".mlflow_run", "step_00000002", "step_00000004", "abandoned-step_00000004"}
    assert s3_env.fs().cat_file(f"{root}/abandoned-step_00000004/.metadata") == kept
    assert any(f"deleted s3://{root}/step_00000006, left by a checkpoint write or removal cut off part-way" in w
               for w in warned.messages), warned.messages
    assert any("abandoned-step_00000004" in w for w in warned.messages), warned.messages


def test_uri_path_refuses_local_file_methods_and_hints_keep_the_uri() -> None:
    from recsys_runner.lifecycle import resume_hint
    from recsys_runner.runtime import Launch

    path = uris.as_path("s3://bucket/runs/ck")
    for call in (path.exists, path.is_dir, path.iterdir, path.stat, path.read_bytes, lambda: path.mkdir(parents=True),
                 lambda: path.glob("*"), lambda: (path / "meta.json").read_text(), lambda: (path / "x").write_text("x"),
                 lambda: (path / ".lock").unlink(missing_ok=True), lambda: (path / "x").open("rb")):
        with pytest.raises(TypeError, match=r"on s3://bucket/runs/ck.*object store.*Fix.*recsys_runner.stores"):
            call()
    assert str(path / "step_00000002") == "s3://bucket/runs/ck/step_00000002" and path.absolute() == path
    hint = resume_hint(Launch(overrides=("data=parquet",), output_dir=Path("/tmp/run"), config_name="config"), "s3://bucket/runs/ck/step_00000002")
    assert "checkpoint.dir=s3://bucket/runs/ck" in hint and "s3:/bucket" not in hint.replace("s3://", ""), hint


@pytest.mark.slow
def test_mlflow_artifacts_go_to_the_bucket_through_a_tracking_server_serving_it(s3: MotoServer, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/storage.md's server command: ``mlflow server --artifacts-destination s3://…`` with the store's endpoint and
    credentials in the server's environment; the runner, with none of them, logs its artifacts into the bucket."""
    from mlflow.tracking import MlflowClient

    from tests.test_tracking import MlflowServer

    server_env = {k: v for k, v in s3.env.items() if k != "AWS_ENDPOINT_URL"} | {"MLFLOW_S3_ENDPOINT_URL": s3.endpoint}
    server = MlflowServer(tmp_path, artifacts="s3://data/mlflow", env=server_env)
    for key in (*s3.env, "MLFLOW_S3_ENDPOINT_URL", "AWS_PROFILE"):  # the runner's process: no store settings at all
        monkeypatch.delenv(key, raising=False)
    server.start()
    try:
        register_configs()
        overrides = ["data.batch_size=64", "data.num_train_rows=2048", "data.num_eval_rows=512", "data.num_embeddings=100",
                     "train.num_steps=4", "train.log_every_steps=2", "distributed.device=cpu", "checkpoint=none",
                     f"tracking.uri={server.uri}", "tracking.experiment=bucket_artifacts"]
        with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
            run(compose(config_name="config", overrides=overrides))
        client = MlflowClient(tracking_uri=server.uri)
        (found,) = client.search_runs([client.get_experiment_by_name("bucket_artifacts").experiment_id])
        run_id = found.info.run_id
        logged = {a.path for a in client.list_artifacts(run_id)}
        assert {"config.yaml", "manifest.json"} <= logged, logged
        fs = s3.fs()
        in_bucket = {key.split(f"/{run_id}/artifacts/", 1)[1]: key for key in fs.find("data/mlflow") if f"/{run_id}/artifacts/" in key}
        assert logged <= set(in_bucket), (logged, in_bucket)  # every artifact is an object under s3://data/mlflow
        config = Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path))).read_text()
        assert fs.cat_file(in_bucket["config.yaml"]).decode() == config and "num_steps: 4" in config
        assert not (tmp_path / "artifacts").exists() and not (tmp_path / "mlartifacts").exists()  # nothing on the server's disk
    finally:
        server.stop()


@pytest.mark.slow
def test_storage_bench_quick_runs_and_writes_its_regime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from recsys_runner.bench import storage as bench

    for key, value in bench.CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    result = bench.main(["--quick", "--json", str(tmp_path / "bench_storage.json"), "distributed.device=cpu"])
    regime = result["regimes"]["s_bucket_parquet"]
    assert regime["target"] == 0.9 and regime["runner_samples_per_s"] > 0 and regime["reference_samples_per_s"] > 0
    assert json.loads((tmp_path / "bench_storage.json").read_text())["regimes"]["s_bucket_parquet"]["ratio"] == regime["ratio"]
