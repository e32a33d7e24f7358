"""A job preempted before its first checkpoint and launched again (SLURM's requeue: the same command, the same checkpoint
directory) continues the MLflow run of its first launch, when that is safe, instead of leaving it KILLED beside a new one.

The launches run in this process as ``python -m`` runs them (:func:`tests.conftest.run_in_process`), against the real
embedded sqlite MLflow store; the preemption is a real SIGUSR2 (submitit's signal; outside submitit there is no handler to
hand over to, so the launch just stops), sent as the sanity eval reads its first batch, before any step or checkpoint.
The safety rules themselves (:func:`recsys_runner.tracking.requeue.why_not_continue`) are checked one by one on runs made
in a sqlite store.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from torchrec.datasets.utils import Batch

from recsys_runner.__main__ import run
from recsys_runner.checkpoint.storage import DcpFileStorage, list_checkpoints
from recsys_runner.tracking.requeue import PREEMPTED_TAG, RECORD_FILE, run_record, why_not_continue
from recsys_runner.train import evaluation
from tests.conftest import run_in_process
from tests.test_run_safety import SMALL, runs, steps_logged

TRAIN = [sys.executable, "-m", "recsys_runner"]


def _preempted_at_the_sanity_eval(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """SIGUSR2 to this process as the run's first eval batch (the sanity eval's) is read, once; the list gets an entry
    when it is sent."""
    real, sent = evaluation.checked_batches, []

    def checked(batches: Iterable[Batch], *args: Any) -> Iterator[Batch]:
        for batch in real(batches, *args):
            if not sent:
                sent.append(1)
                os.kill(os.getpid(), signal.SIGUSR2)
            yield batch

    monkeypatch.setattr(evaluation, "checked_batches", checked)
    return sent


def _launch(tmp_path: Path, uri: str, experiment: str, *extra: str) -> list[str]:
    return [*TRAIN, *SMALL, "train.num_steps=4", f"checkpoint.dir={tmp_path}/ck", f"tracking.uri={uri}",
            f"tracking.experiment={experiment}", f"hydra.run.dir={tmp_path}/run", *extra]


def _preempted(tmp_path: Path, uri: str, experiment: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The first launch, preempted in its sanity eval: no step, no checkpoint, its run KILLED and tagged preempted."""
    with monkeypatch.context() as patched:
        sent = _preempted_at_the_sanity_eval(patched)  # type: ignore[arg-type]
        first = run_in_process(_launch(tmp_path, uri, experiment), tmp_path)
    assert sent and first.returncode == 128 + signal.SIGUSR2, first.stderr[-3000:]
    assert list_checkpoints(tmp_path / "ck") == []
    (killed,) = runs(uri, experiment)
    assert killed.info.status == "KILLED" and killed.data.tags.get(PREEMPTED_TAG) == "true", killed.info
    assert (tmp_path / "ck" / RECORD_FILE).exists()
    return str(killed.info.run_id)


def test_a_relaunch_after_a_preemption_before_the_first_checkpoint_continues_the_same_run(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = _preempted(tmp_path, mlflow_uri, "requeued", monkeypatch)
    again = run_in_process(_launch(tmp_path, mlflow_uri, "requeued"), tmp_path)  # the requeue: the same command
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stdout + again.stderr
    assert f"continuing MLflow run {run_id}, preempted before its first checkpoint" in out, out[-3000:]
    (finished,) = runs(mlflow_uri, "requeued")  # one run for the job
    assert finished.info.run_id == run_id and finished.info.status == "FINISHED"
    assert finished.data.tags.get("resumed") == "true", finished.data.tags
    assert steps_logged(mlflow_uri, run_id) == [1, 2, 3, 4]  # each step once


def test_a_relaunch_with_another_config_starts_a_new_run_and_says_why(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = _preempted(tmp_path, mlflow_uri, "requeued_changed", monkeypatch)
    again = run_in_process(_launch(tmp_path, mlflow_uri, "requeued_changed", "optim.dense.lr=0.02"), tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stdout + again.stderr
    (line,) = [x for x in out.splitlines() if f"not continuing MLflow run {run_id}" in x]
    assert f"recorded in {tmp_path}/ck/{RECORD_FILE} by an earlier launch: this launch's config differs from the one it " \
           "logged (optim.dense.lr: " in line and line.endswith("; starting a new run"), line
    assert "continuing MLflow run" not in out.replace(f"not continuing MLflow run {run_id}", "")
    statuses = {r.info.run_id: r.info.status for r in runs(mlflow_uri, "requeued_changed")}
    assert statuses.pop(run_id) == "KILLED" and list(statuses.values()) == ["FINISHED"]
    (new_id,) = statuses
    assert DcpFileStorage().read_note(tmp_path / "ck", RECORD_FILE) == run_record(new_id, mlflow_uri)  # the new run's now


def test_a_launch_that_resumes_nothing_records_no_run(make_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    """``checkpoint.resume=never`` (``checkpoint=none``): its relaunch resumes nothing, so no record is left to read."""
    run(make_cfg("train.num_steps=2", "checkpoint.resume=never", f"checkpoint.dir={tmp_path}/ck"))
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["step_00000002"]
    assert not (tmp_path / "ck" / RECORD_FILE).exists()


# -- the rules, one by one ------------------------------------------------------------------------------------------
@pytest.fixture
def store(mlflow_uri: str, request: pytest.FixtureRequest) -> tuple[MlflowClient, str]:
    """The session's sqlite store and an experiment of this test's own."""
    client = MlflowClient(tracking_uri=mlflow_uri)
    name = f"rules_{request.node.name}"
    client.create_experiment(name)
    return client, name


def _run(client: MlflowClient, experiment: str, *, status: str = "KILLED", preempted: bool = True,
         params: dict[str, str] | None = None, metric_at: int | None = None, parent: str | None = None) -> str:
    run = client.create_run(client.get_experiment_by_name(experiment).experiment_id,
                            tags={"mlflow.parentRunId": parent} if parent else {})
    run_id = str(run.info.run_id)
    for k, v in (params if params is not None else {"optim.lr": "0.1"}).items():
        client.log_param(run_id, k, v)
    if preempted:
        client.set_tag(run_id, PREEMPTED_TAG, "true")
    if metric_at is not None:
        client.log_metric(run_id, "train/loss", 0.5, step=metric_at)
    client.set_terminated(run_id, status=status)
    return run_id


def test_only_a_preempted_run_of_the_same_store_experiment_sweep_and_config_with_no_metric_is_continued(
    store: tuple[MlflowClient, str], mlflow_uri: str
) -> None:
    client, experiment = store
    params = {"optim.lr": "0.1"}

    def why(run_id: str, *, uri: str = mlflow_uri, exp: str = experiment, parent: str | None = None) -> str | None:
        return why_not_continue(client, run_record(run_id, uri), uri=uri, experiment=exp, params=params, parent=parent)

    assert why(_run(client, experiment)) is None
    assert why(_run(client, experiment, status="FINISHED")) == "it ended FINISHED, not KILLED by a preemption"
    assert why(_run(client, experiment, preempted=False)) == (
        "it was KILLED, but not by a preemption (a stop asked for by hand is not continued)")
    assert why(_run(client, experiment, metric_at=1)) == ("it logged metrics (train/loss) that this launch, starting from step 0 "
                                                          "with no checkpoint, would log again")
    assert why(_run(client, experiment, params={"optim.lr": "0.2"})) == (
        "this launch's config differs from the one it logged (optim.lr: 0.2 -> 0.1)")
    assert why(_run(client, experiment, params={})) == "this launch's config differs from the one it logged (optim.lr: (unset) -> 0.1)"
    client.create_experiment(f"{experiment}_other")
    assert why(_run(client, experiment), exp=f"{experiment}_other") == f"it is not in experiment '{experiment}_other'"
    assert why(_run(client, experiment, parent="p1"), parent="p2") == "it belongs to another sweep"
    assert why(_run(client, experiment, parent="p1")) == "it is a sweep's job, this launch is not"
    assert why(_run(client, experiment, parent="p1"), parent="p1") is None
    other = f"sqlite:///{Path(mlflow_uri.removeprefix('sqlite:///')).parent}/other.db"
    assert why_not_continue(client, run_record(_run(client, experiment), other), uri=mlflow_uri, experiment=experiment,
                            params=params, parent=None) == f"it is in another tracking store ({other}, this launch logs to {mlflow_uri})"
    assert why_not_continue(client, "{not json", uri=mlflow_uri, experiment=experiment, params=params, parent=None) == \
        "the record cannot be read"
    assert (why("0" * 32) or "").startswith("the store does not have it")


def test_a_note_is_written_whole_beside_the_checkpoints_and_read_back(tmp_path: Path) -> None:
    storage = DcpFileStorage()
    assert storage.read_note(tmp_path / "ck", RECORD_FILE) is None  # no directory yet
    storage.write_note(tmp_path / "ck", RECORD_FILE, "one")
    storage.write_note(tmp_path / "ck", RECORD_FILE, "two")
    assert storage.read_note(tmp_path / "ck", RECORD_FILE) == "two"
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [RECORD_FILE]  # no temporary left
    assert list_checkpoints(tmp_path / "ck") == []
