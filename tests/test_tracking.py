"""Tracking through outages: a fake store for the buffer/retry logic, a real ``mlflow server`` for the rest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from recsys_runner import tracking
from recsys_runner.configurable import make
from recsys_runner.tracking.outbox import replay
from recsys_runner.tracking.tracker import MlflowTracker, MlflowTrackingConfig
from tests.conftest import LogWarnings, free_port


class FlakyClient:
    """Stands in for MlflowClient: fails while ``down``, records what it accepted."""

    def __init__(self) -> None:
        self.down = False
        self.metrics: list[tuple[str, float, int]] = []
        self.texts: list[str] = []
        self.status: str | None = None

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = ()) -> None:
        if self.down:
            raise ConnectionError("server gone")
        self.metrics += [(m.key, m.value, m.step) for m in metrics]

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        if self.down:
            raise ConnectionError("server gone")
        self.texts.append(artifact_file)

    def set_terminated(self, run_id: str, status: str) -> None:
        if self.down:
            raise ConnectionError("server gone")
        self.status = status


def _tracker(client: FlakyClient, flush_timeout_s: float = 0.0) -> MlflowTracker:
    t = MlflowTracker(make(MlflowTrackingConfig, uri="http://127.0.0.1:9", experiment="x", flush_timeout_s=flush_timeout_s))
    t._client, t.run_id = client, "run0"
    return t


def test_outage_buffers_and_resends_in_order() -> None:
    client = FlakyClient()
    t = _tracker(client)
    t.log_metrics({"train/loss": 1.0}, step=10)
    client.down = True
    with LogWarnings(tracking.__name__) as records:
        t.log_metrics({"train/loss": 0.9}, step=20)
        t.log_text("plan", "sharding_plan.txt")
        t.log_metrics({"train/loss": 0.8}, step=30)  # inside the back-off window: not even tried
    assert sum("unreachable" in m for m in records.messages) == 1, "warn once per outage"
    assert [s for _, _, s in client.metrics] == [10]
    client.down = False
    t._outbox.next_try = 0.0  # the back-off window has passed
    t.log_metrics({"train/loss": 0.7}, step=40)
    assert [s for _, _, s in client.metrics] == [10, 20, 30, 40]
    assert client.texts == ["sharding_plan.txt"]
    t.finish("FINISHED")
    assert client.status == "FINISHED"


def test_finish_writes_unsent_metrics_when_server_stays_away(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    client = FlakyClient()
    t = _tracker(client, flush_timeout_s=0.2)
    client.down = True
    t.log_metrics({"eval/auc": 0.7}, step=5)
    t.finish("FINISHED")
    (path,) = tmp_path.glob("mlflow_unsent_run0.json")
    record = json.loads(path.read_text())
    assert record["run_id"] == "run0" and record["status"] == "FINISHED"
    assert [m[0] for m in record["metrics"]] == ["eval/auc"] and client.status is None




class MlflowServer:
    """A real ``mlflow server`` on loopback, started and stopped by PID (its own process group)."""

    def __init__(self, root: Path, artifacts: str | None = None, env: dict[str, str] | None = None) -> None:
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.artifacts = artifacts or str(root / "artifacts")
        """``--artifacts-destination``: a local folder, or a bucket (``s3://…``, with its client's variables in ``env``)."""
        self.env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}
        """No job runner (MLflow 3's GenAI scorer jobs, none here): two more Python processes (a job runner and huey's
        consumers) starting beside the server cost ~2.5 s of its start-up and CPU the other test worker wants."""

    def start(self, timeout_s: float = 90) -> None:
        mlflow = Path(sys.executable).with_name("mlflow")
        cmd = [str(mlflow), "server", "--backend-store-uri", f"sqlite:///{self.root}/server.db",
               "--artifacts-destination", self.artifacts, "--host", "127.0.0.1", "--port", str(self.port),
               "--workers", "1"]
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(cmd, cwd=self.root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"mlflow server on {self.uri} not healthy after {timeout_s}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group this Popen created (uvicorn + its worker)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


@pytest.fixture
def mlflow_server(tmp_path: Path):
    server = MlflowServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_server_goes_away_mid_run(make_cfg, mlflow_server: MlflowServer, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Training against a real server that is killed at step 20: the run completes, warns, saves the
    unsent metrics locally, and replaying them after the server is back loses nothing."""
    from recsys_runner.__main__ import run

    monkeypatch.chdir(tmp_path)
    original = MlflowTracker.log_metrics

    def log_then_kill(self: MlflowTracker, metrics: Any, step: int) -> None:
        original(self, metrics, step)
        if step == 20:
            mlflow_server.stop()

    monkeypatch.setattr(MlflowTracker, "log_metrics", log_then_kill)
    cfg = make_cfg("train.num_steps=50", f"tracking.uri={mlflow_server.uri}", "tracking.experiment=outage",
                   "tracking.flush_timeout_s=1")
    with LogWarnings(tracking.__name__) as records:
        auc = run(cfg)
    assert auc > 0.5
    assert any("unreachable" in m and "training continues" in m for m in records.messages), records.messages
    (unsent,) = tmp_path.glob("mlflow_unsent_*.json")
    mlflow_server.start()
    run_id = replay(unsent)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    r = client.get_run(run_id)
    assert r.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))
    assert steps == [10, 20, 30, 40, 50]
    assert client.get_metric_history(run_id, "eval/auc")[-1].value == pytest.approx(auc)
    assert "config.yaml" in {a.path for a in client.list_artifacts(run_id)}


@pytest.mark.parametrize("content", [None, "{not json", '{"run_id": "abc"}', "[1, 2]"], ids=["missing", "not-json", "lacks-keys", "a-list"])
def test_replay_of_a_file_that_is_no_replay_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None) -> None:
    # python -m recsys_runner.tracking replay <file>: a mistyped path or another file is the user's to fix, said in one
    # line with exit status 2, never a FileNotFoundError or KeyError traceback
    from recsys_runner.tracking.__main__ import main

    path = tmp_path / "mlflow_unsent_abc.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exited:
        main(["replay", str(path)])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and err.startswith(f"Tracking error: {path}") and "Fix: give the mlflow_unsent_" in err, err
    assert len(err.splitlines()) == 1, err
