"""Tracking faults at the start of a run: an unreachable server, a read-only sqlite store, and many
processes creating one new sqlite store together. The first two must stop the CLI within seconds with
``Tracking error:`` and exit 2, before any data or model is built; the third must not crash anyone."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from recsys_runner.configurable import make
from recsys_runner.errors import TrackingError
from recsys_runner.tracking.tracker import MlflowTracker, MlflowTrackingConfig
from tests.conftest import skip_unless_ci

# tests.conftest (TINY, run_cli) imports torch and torchrec; it is imported inside the CLI tests only, so
# that the race test's worker processes, which import this module, start in seconds.

EXPERIMENT = "faults"


def _free_port() -> int:
    """:func:`tests.conftest.free_port` (a port the kernel hands no other process: nothing else can be listening on a
    port meant to be unreachable), imported when called (above)."""
    from tests.conftest import free_port

    return free_port()


def _cli_env() -> dict[str, str]:
    """The environment for a CLI run, as ``run_cli`` makes it: errors printed without a traceback."""
    return {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}


def _assert_tracking_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Tracking error: " in result.stderr and "Traceback" not in output, output[-3000:]
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)
    assert "sharding plan" not in output, "the store is checked before data and model are built"


def test_a_free_port_is_one_the_kernel_hands_no_other_process() -> None:
    """A port the kernel had handed out (``bind`` to port 0) could be handed to another process before the test bound it
    (the other pytest worker's gloo ranks, a client's connection): ``address already in use`` for a torchrun, or a
    listener on the port these tests need unreachable. ``free_port``'s come from below the ephemeral range, a share of
    their own per pytest worker."""
    from tests.conftest import EPHEMERAL_PORTS, free_port, worker_ports

    ephemeral = int(EPHEMERAL_PORTS.read_text().split()[0])
    gw0, gw1 = worker_ports("gw0", "2"), worker_ports("gw1", "2")
    assert len(gw0) > 1000 and len(gw1) > 1000 and gw0.stop <= gw1.start and gw1.stop <= ephemeral
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20 and all(p in worker_ports() for p in ports), ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] >= ephemeral  # what any other process gets meanwhile


def test_unreachable_server_stops_the_cli_within_seconds(tmp_path: Path) -> None:
    """Nothing listens on the port: without the preflight MLflow retries for about 4 minutes, then a traceback."""
    from tests.conftest import TINY, run_cli

    uri = f"http://127.0.0.1:{_free_port()}"
    started = time.monotonic()
    result = run_cli(*TINY, f"tracking.uri={uri}", f"tracking.experiment={EXPERIMENT}", cwd=tmp_path, timeout=240)
    elapsed = time.monotonic() - started
    _assert_tracking_error(result, f"tracking server {uri} (tracking.uri) is not reachable", "Connection refused",
                         "Fix: start the server", "MLFLOW_TRACKING_URI", "tracking=none")
    assert elapsed < 60, f"took {elapsed:.0f} s"


def test_multirun_with_unreachable_server_stops_before_launching_jobs(tmp_path: Path) -> None:
    """The multirun command runs in this process as ``python -m`` runs it (the single run above is the process)."""
    from tests.conftest import TINY, run_in_process

    uri = f"http://127.0.0.1:{_free_port()}"
    result = run_in_process([sys.executable, "-m", "recsys_runner", "-m", "optim.lr=0.01,0.1", *TINY, f"tracking.uri={uri}"], tmp_path)
    _assert_tracking_error(result, f"tracking server {uri} (tracking.uri) is not reachable", "tracking=none")
    assert "Launching" not in result.stdout + result.stderr


@pytest.mark.slow
def test_unreachable_server_stops_every_torchrun_rank(tmp_path: Path) -> None:
    """Rank 0 checks the store; rank 1 gets the same error from it instead of waiting in a collective."""
    from tests.conftest import TINY

    uri = f"http://127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", "-m", "recsys_runner", *TINY, f"tracking.uri={uri}"]
    started = time.monotonic()
    result = subprocess.run(cmd, cwd=tmp_path, env=_cli_env(), capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert result.stderr.count(f"Tracking error: tracking server {uri} (tracking.uri) is not reachable") == 2, result.stderr[-4000:]
    assert "sharding plan" not in result.stdout + result.stderr
    assert elapsed < 120, f"took {elapsed:.0f} s"


def test_unreachable_server_from_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"http://127.0.0.1:{_free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    started = time.monotonic()
    with pytest.raises(TrackingError, match=rf"tracking server {uri} \(\$MLFLOW_TRACKING_URI\) is not reachable"):
        MlflowTracker(make(MlflowTrackingConfig, uri=None, experiment=EXPERIMENT)).check()
    assert time.monotonic() - started < 10


@pytest.fixture(scope="module")
def store_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real MLflow store that already has the experiment: opening it writes nothing, so without a
    write probe a read-only copy would fail only at the first write, after the model is built."""
    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    client = MlflowClient(tracking_uri=f"sqlite:///{path}")
    client.create_experiment(EXPERIMENT)
    return path


def _without_root_powers() -> list[str]:
    """A command prefix under which permission bits hold: root writes through them (CAP_DAC_OVERRIDE), so as
    root the command runs without that capability (``setpriv`` drops it from the bounding set before exec)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        skip_unless_ci("READ-ONLY STORE TEST SKIPPED — running as root, and setpriv (util-linux) is missing to drop "
                       "CAP_DAC_OVERRIDE")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]


_BOTH_IN_ONE_PROCESS = """
import json, sys
from pathlib import Path
from tests.conftest import run_in_process
done = [run_in_process(json.loads(argv), Path(cwd)) for argv, cwd in zip(sys.argv[1::2], sys.argv[2::2])]
print(json.dumps([[d.returncode, d.stdout, d.stderr] for d in done]))
"""
"""Each ``python -m recsys_runner`` command given (JSON, then its directory) run in turn in one process, as ``python -m``
runs it (:func:`tests.conftest.run_in_process`): its exit status and output, as JSON."""


def test_read_only_sqlite_store_stops_the_cli(store_template: Path, tmp_path: Path) -> None:
    """A read-only store file, and a writable file in a read-only directory (sqlite cannot create its journal next to
    it). Both commands run in one process without root's powers over permission bits, one after the other, each as
    ``python -m`` runs it (``_BOTH_IN_ONE_PROCESS``): ~10 s of imports once, not once per case."""
    from tests.conftest import REPO, TINY

    prefix, cases = _without_root_powers(), []
    for read_only in ("file", "directory"):
        store = tmp_path / read_only / "store"
        store.mkdir(parents=True)
        db = store / "mlflow.db"
        shutil.copy(store_template, db)
        if read_only == "file":
            db.chmod(0o444)
        else:  # a writable file in a read-only directory: sqlite cannot create its journal next to it
            store.chmod(0o555)
        cases.append((store, db))
    try:
        commands: list[str] = []
        for store, db in cases:
            write = f"import sqlite3; sqlite3.connect({str(db)!r}).execute('CREATE TABLE t (x)')"
            probe = subprocess.run([*prefix, sys.executable, "-c", write], capture_output=True, text=True)
            assert probe.returncode != 0 and "readonly" in probe.stderr, f"{db} must be read-only for the CLI's process"
            argv = [sys.executable, "-m", "recsys_runner", *TINY, f"tracking.uri=sqlite:///{db}", f"tracking.experiment={EXPERIMENT}"]
            commands += [json.dumps(argv), str(store.parent)]
        both = subprocess.run([*prefix, sys.executable, "-c", _BOTH_IN_ONE_PROCESS, *commands], cwd=tmp_path,
                              env={**_cli_env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=240)
    finally:
        for store, _ in cases:
            store.chmod(0o755)
    assert both.returncode == 0, both.stderr[-3000:]
    results = json.loads(both.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases), results
    for (_, db), (code, out, err) in zip(cases, results, strict=True):
        result = subprocess.CompletedProcess([], code, out, err)
        uri = f"sqlite:///{db}"
        _assert_tracking_error(result, f"tracking store {uri} (tracking.uri) cannot be written",
                               "attempt to write a readonly database", f"Fix: make {db} and its directory writable", "tracking=none")
        with sqlite3.connect(db) as check:
            assert check.execute("SELECT COUNT(*) FROM runs").fetchone() == (0,)


def _start_run(uri: str, index: int, barrier: Any, results: Any) -> None:
    """One run's start in its own process: check the store, start and finish a run."""
    barrier.wait()
    try:
        tracker = MlflowTracker(make(MlflowTrackingConfig, uri=uri, experiment="race"))
        tracker.check()
        tracker.start(run_name=f"job{index}", tags={}, params={"index": index})
        tracker.finish("FINISHED")
        results.put((index, None))
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails on it
        results.put((index, f"{type(e).__name__}: {str(e)[:300]}"))


def test_processes_creating_a_new_sqlite_store_together_all_start(tmp_path: Path) -> None:
    """MLflow creates a new store's tables unlocked: processes starting together on a new file used to
    crash on ``duplicate column name`` / ``table ... already exists`` (runs launched together by a script)."""
    num_processes = 4
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["mlflow.tracking", "recsys_runner.tracking", "tests.test_tracking_faults"])
    barrier, results = ctx.Barrier(num_processes), ctx.Queue()
    processes = [ctx.Process(target=_start_run, args=(uri, i, barrier, results)) for i in range(num_processes)]
    for p in processes:
        p.start()
    try:
        outcomes = dict(results.get(timeout=240) for _ in processes)
    finally:
        for p in processes:
            p.join(timeout=60)
    assert {i: e for i, e in outcomes.items() if e is not None} == {}
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("race")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"job{i}" for i in range(num_processes)]
    assert all(r.info.status == "FINISHED" for r in runs)


def test_a_reader_waits_for_a_store_being_created_instead_of_opening_it_half_made(tmp_path: Path) -> None:
    """A reader (``compare``, a test polling a sweep's store) that saw a store's first tables and opened it made the rest
    again under the creator and crashed it (``table sql_trace_metric_daily_rollups already exists``, a CI run):
    :func:`missing_store` waits while a creator holds the store's lock exclusively, as :func:`store_lock` does."""
    import fcntl
    import threading

    from recsys_runner.tracking.store import missing_store

    path = tmp_path / "mlflow.db"
    with sqlite3.connect(path) as db:  # the creator's first table: MLflow's own are still being made
        db.execute("CREATE TABLE experiments (experiment_id INTEGER)")
    uri = f"sqlite:///{path}"
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what store_lock holds while a new store is made
    answer: list[str | None] = []
    reader = threading.Thread(target=lambda: answer.append(missing_store(uri)), daemon=True)
    try:
        reader.start()
        reader.join(timeout=1.0)
        assert reader.is_alive() and answer == [], f"read a store while it was being created: {answer}"
    finally:
        os.close(fd)  # the creator is done
    reader.join(timeout=30)
    assert answer == [None]
    assert missing_store(f"sqlite:///{tmp_path}/none.db") == f"{tmp_path}/none.db does not exist"


def test_a_signal_while_metrics_are_sent_stops_the_command_and_keeps_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tracker rides out a store outage by catching every error while sending; a signal (the lifecycle's
    ``Interrupted``, raised from its handler into whatever runs) is not an outage: it goes through, the metrics stay
    pending for the run's end."""
    from recsys_runner.train.signals import Interrupted

    tracker = MlflowTracker(make(MlflowTrackingConfig, uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="signals"))
    tracker.start(run_name="r", tags={}, params={})

    def interrupted(*_: Any, **__: Any) -> None:
        raise Interrupted(15, None, None)

    monkeypatch.setattr(tracker._client, "log_batch", interrupted)
    with pytest.raises(Interrupted):
        tracker.log_metrics({"train/loss": 0.5}, step=1)
    assert [m.key for m in tracker._outbox.metrics] == ["train/loss"], "the metrics that were being sent stay pending"
    monkeypatch.undo()
    run_id = tracker.run_id
    tracker.finish("KILLED")  # sends them
    assert [m.value for m in MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_metric_history(run_id, "train/loss")] == [0.5]
