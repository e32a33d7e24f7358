"""``python -m recsys_runner.compare``: table and PNGs from runs in an MLflow store; ``collect`` for a detached sweep."""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient
from submitit.core.utils import cloudpickle_dump

from recsys_runner import compare, compare_ui
from recsys_runner.tracking.requeue import PREEMPTED_TAG
from recsys_runner.tracking.store import mlflow_command
from recsys_runner.tracking.sweep import EXPECTED_JOBS_TAG
from recsys_runner.tracking.sweep_jobs import JOB_END_TAG, SLURM_JOB_IDS_TAG, SUBMITIT_FOLDER_TAG, JobFailed
from recsys_runner.tracking.sweep_names import JOB_NUM_TAG, SWEPT_KEYS_TAG
from recsys_runner.tracking.sweep_summary import SWEEP_PARENT_TAG
from tests.conftest import free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _child(client: MlflowClient, exp: str, parent: str, lr: float, model: str, auc: float, status: str = "FINISHED") -> str:
    run = client.create_run(exp, run_name=f"optim.lr={lr},model={model}",
                            tags={"mlflow.parentRunId": parent, "hydra.overrides": f"optim.lr={lr} model={model} train.num_steps=30"})
    rid = run.info.run_id
    params = [Param("optim.lr", str(lr)), Param("model._target_", f"recsys_runner.models.{model}.{model.upper()}"),
              Param("train.num_steps", "30"), Param("tracking.uri", "sqlite:///x.db")]
    metrics = [Metric("train/loss", 0.7 - 0.01 * s * lr, 0, s) for s in (10, 20, 30)] + [Metric("eval/auc", auc, 0, 30)]
    client.log_batch(rid, metrics=metrics, params=params)
    client.set_terminated(rid, status)
    return rid


@pytest.fixture
def sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, dict[str, str]]:
    """A sweep as a runner before ``swept.*`` params logged it (its children's values only in their overrides)."""
    monkeypatch.chdir(tmp_path)  # the experiment's artifacts (collect's summary table) go to ./mlruns
    uri = f"sqlite:///{tmp_path}/cmp.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("cmp")
    parent = client.create_run(exp, run_name="sweep", tags={SWEEP_PARENT_TAG: "eval/auc", "sweep.overrides": "train.num_steps=30",
                                                            EXPECTED_JOBS_TAG: "3", SWEPT_KEYS_TAG: "optim.lr,model"}).info.run_id
    ids = {"a": _child(client, exp, parent, 0.01, "deepfm", 0.61), "b": _child(client, exp, parent, 0.1, "deepfm", 0.68),
           "c": _child(client, exp, parent, 0.1, "dlrm", 0.65)}
    return uri, parent, ids


def test_table_and_pngs(sweep: tuple[str, str, dict[str, str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri, _, _ = sweep
    assert compare.main(["--uri", uri, "--experiment", "cmp", "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = lines[0].split()
    # Only what varies between the trials; bookkeeping (tracking.*) and constants are left out; parent excluded.
    assert header == ["run", "status", "model._target_", "optim.lr", "eval/auc", "eval/logloss", "train/loss"]
    rows = [line.split() for line in lines[2:5]]
    assert [r[4] for r in rows] == ["0.6800", "0.6500", "0.6100"], "best first"
    assert rows[0][2:4] == ["DEEPFM", "0.1"] and rows[1][2] == "DLRM"
    assert "sweep" not in out.split("plots:")[0]
    for name in ("curves.png", "eval_auc_vs_params.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name


def test_loss_metric_ranks_lowest_first(sweep: tuple[str, str, dict[str, str]], capsys: pytest.CaptureFixture[str]) -> None:
    uri, _, _ = sweep
    assert compare.main(["--uri", uri, "--experiment", "cmp", "--metric", "train/loss", "--no-plots"]) == 0
    losses = [float(line.split()[-1]) for line in capsys.readouterr().out.splitlines()[2:]]
    assert losses == sorted(losses) and len(losses) == 3


def test_a_metric_no_run_logged_names_the_closest_logged_one(sweep: tuple[str, str, dict[str, str]],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``--metric eval/acu``: the column was all ``-`` and the ranking none, without a word."""
    uri, _, _ = sweep
    assert compare.main(["--uri", uri, "--experiment", "cmp", "--metric", "eval/acu", "--no-plots"]) == 2
    out, err = capsys.readouterr()
    assert not out and err.startswith("--metric eval/acu: none of the 3 runs selected logged it (did you mean eval/auc?); they "
                                      "logged eval/auc, train/loss. Fix: --metric eval/auc")


def test_runs_of_another_objective_are_ranked_by_it_without_metric(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Multi-task runs log ``eval/<task>/auc``, never ``eval/auc``: without ``--metric`` the table showed ``-`` in every
    metric column and ranked nothing. It now takes their objective (``best/eval/ctr/auc``) first, ranks by it, and
    shows their other eval metrics and ``train/loss``; a line on stderr says what ranks."""
    uri = f"sqlite:///{tmp_path}/mt.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("mt")
    for kind, ctr in (("fixed", 0.55), ("pareto", 0.61), ("uncertainty", 0.58)):
        rid = client.create_run(exp, run_name=f"kind={kind}").info.run_id
        metrics = {"eval/ctr/auc": ctr, "best/eval/ctr/auc": ctr, "eval/ctr/logloss": 0.4, "eval/cvr/auc": 0.5, "train/loss": 0.6}
        client.log_batch(rid, metrics=[Metric(k, v, 0, 30) for k, v in metrics.items()],
                         params=[Param("train.loss_weighting.kind", kind)])
        client.set_terminated(rid, "FINISHED")
    assert compare.main(["--uri", uri, "--experiment", "mt", "--no-plots"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split() == ["run", "status", "train.loss_weighting.kind", "eval/ctr/auc", "eval/ctr/logloss", "eval/cvr/auc",
                                "train/loss"]
    assert [line.split()[0] for line in lines[2:]] == ["kind=pareto", "kind=uncertainty", "kind=fixed"], "best eval/ctr/auc first"
    assert "ranked by eval/ctr/auc, the runs' objective" in err


def test_lower_is_better_metric_ranks_best_lowest_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``eval/mse`` is lower-is-better (its metric class says so): the lowest error is listed first, a run that
    never logged it last."""
    uri = f"sqlite:///{tmp_path}/mse.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("reg")
    for name, mse in (("mid", 0.5), ("best", 0.2), ("worst", 0.9), ("failed", None)):
        rid = client.create_run(exp, run_name=name).info.run_id
        client.log_batch(rid, metrics=[Metric("eval/mse", mse, 0, 30)] if mse is not None else [],
                         params=[Param("optim.lr", name)])
        client.set_terminated(rid, "FINISHED" if mse is not None else "FAILED")
    assert compare.main(["--uri", uri, "--experiment", "reg", "--metric", "eval/mse", "--no-plots"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[-1]) for r in rows] == [("best", "0.2000"), ("mid", "0.5000"), ("worst", "0.9000"), ("failed", "-")]


def test_parent_and_filter_select_runs(sweep: tuple[str, str, dict[str, str]], capsys: pytest.CaptureFixture[str]) -> None:
    uri, parent, _ = sweep
    assert compare.main(["--uri", uri, "--parent", parent, "--filter", "params.`optim.lr` = '0.1'", "--no-plots"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "optim.lr" not in lines[0], "constant within the selection, so not a column"
    assert sorted(line.split()[2] for line in lines[2:]) == ["DEEPFM", "DLRM"]


def test_collect_summarizes_a_finished_sweep(sweep: tuple[str, str, dict[str, str]], capsys: pytest.CaptureFixture[str]) -> None:
    uri, parent, ids = sweep
    assert compare.main(["collect", "--uri", uri, "--parent", parent, "--no-plots"]) == 0
    p = MlflowClient(tracking_uri=uri).get_run(parent)
    assert p.info.status == "FINISHED" and p.data.tags["best.run_id"] == ids["b"]
    assert p.data.params == {"best.optim.lr": "0.1", "best.model": "deepfm"}
    out, err = capsys.readouterr()
    assert "best eval/auc=0.6800" in out
    summary = json.loads(Path(MlflowClient(tracking_uri=uri).download_artifacts(parent, "sweep_summary.json")).read_text())
    assert [(r["run_id"], r["swept.optim.lr"], r["swept.model"], r["eval/auc"]) for r in summary["runs"]] == [
        (ids["b"], "0.1", "deepfm", 0.68), (ids["c"], "0.1", "dlrm", 0.65), (ids["a"], "0.01", "deepfm", 0.61)]
    assert summary["runs"][0]["eval/logloss"] is None, "a metric the children did not log"
    experiment = p.info.experiment_id
    assert f"then open http://127.0.0.1:5000/#/experiments/{experiment}/runs/{parent}?workflowType=machine_learning" in err


def test_a_parent_that_is_no_sweep_parent_is_refused_and_left_alone(sweep: tuple[str, str, dict[str, str]],
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``collect --parent <a child's id>`` ended that finished trial FAILED with a sweep summary on it; an unknown id was
    MLflow's traceback. Both are one line, exit 2, and the child keeps its status."""
    uri, parent, ids = sweep
    assert compare.main(["collect", "--uri", uri, "--parent", ids["a"], "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert f"run {ids['a']} (optim.lr=0.01,model=deepfm) is not a sweep's parent run (it has no tag {SWEEP_PARENT_TAG})" in err
    assert err.strip().endswith(f"Fix: --parent {parent}, the sweep this run is a child of")
    child = MlflowClient(tracking_uri=uri).get_run(ids["a"])
    assert child.info.status == "FINISHED" and "best.run_id" not in child.data.tags
    for command in (["collect"], []):
        assert compare.main([*command, "--uri", uri, "--parent", "deadbeef", "--no-plots"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"no MLflow run deadbeef in {uri}. Fix: --parent <the sweep's parent run id>") and "Traceback" not in err


def test_collect_without_wait_reports_missing_jobs(sweep: tuple[str, str, dict[str, str]], capsys: pytest.CaptureFixture[str]) -> None:
    uri, parent, _ = sweep
    client = MlflowClient(tracking_uri=uri)
    client.set_tag(parent, EXPECTED_JOBS_TAG, "4")  # one job still queued: no child run yet
    assert compare.main(["collect", "--uri", uri, "--parent", parent, "--no-plots"]) == 1
    assert "3 of 4 jobs ended" in capsys.readouterr().err
    assert client.get_run(parent).info.status == "RUNNING"


def test_collect_names_a_job_that_died_before_its_run_at_once(tmp_path: Path, slurm_states: Path,
                                                              capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A detached sweep's job that failed before it created its MLflow run (a config error) never adds a child: collect
    --wait waited for it until its timeout. SLURM's account of the jobs says it ended: it is named in a line at once, with
    its own error, and the parent ends FAILED naming it (exit 1), the table of the other jobs still printed."""
    monkeypatch.chdir(tmp_path)  # the parent's summary table goes to ./mlruns
    uri = f"sqlite:///{tmp_path}/died.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("died")
    folder = tmp_path / "multirun" / ".submitit"
    parent = client.create_run(exp, run_name="sweep", tags={SWEEP_PARENT_TAG: "eval/auc", EXPECTED_JOBS_TAG: "2",
                                                            SLURM_JOB_IDS_TAG: "9100_0 9100_1",
                                                            SUBMITIT_FOLDER_TAG: f"{folder}/%j"}).info.run_id
    ok = _child(client, exp, parent, 0.1, "deepfm", 0.68)
    (folder / "9100_1").mkdir(parents=True)
    (folder / "9100_1" / "9100_1_0_log.err").write_text(
        "Config error: optim.sparse.lr must be positive, got -1.0. Fix: e.g. optim.lr=0.01\n"
        "srun: error: localhost: task 0: Exited with exit code 2\n")
    slurm_states.write_text("9100_0|COMPLETED|localhost\n9100_1|FAILED|localhost\n")
    started = time.monotonic()
    assert compare.main(["collect", "--uri", uri, "--parent", parent, "--wait", "--timeout", "30", "--no-plots"]) == 1
    assert time.monotonic() - started < 20, "noticed at once, not at the timeout"
    out, err = capsys.readouterr()
    assert ("Job #1 (SLURM 9100_1, FAILED) failed: Config error: optim.sparse.lr must be positive, got -1.0. "
            "Fix: e.g. optim.lr=0.01") in err.splitlines(), err
    assert f"Sweep failed (failed job(s): #1 (SLURM 9100_1, FAILED)); 1 of 1 child runs finished; MLflow parent run {parent} ended FAILED." in err
    p = client.get_run(parent)
    assert p.info.status == "FAILED" and p.data.tags["sweep.failed_jobs"] == "#1 (SLURM 9100_1, FAILED)"
    assert p.data.tags["best.run_id"] == ok and "0.6800" in out, "the job that ran is still compared"


def _detached_job_with_an_error(tmp_path: Path, name: str, job_id: str, run_name: str,
                                error: BaseException) -> tuple[MlflowClient, str, str, Path]:
    """A detached one-job SLURM sweep in ``sqlite:///<tmp_path>/<name>.db`` whose job ``job_id`` raised ``error`` in its
    process after its child run ``run_name`` started: ``(client, parent id, run id, the job's result file)``, the result
    written as submitit's job side writes a job's error (submitit/core/submission.py)."""
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/{name}.db")
    exp = client.create_experiment(name)
    folder = tmp_path / "multirun" / ".submitit"
    parent = client.create_run(exp, run_name="sweep", tags={SWEEP_PARENT_TAG: "eval/auc", EXPECTED_JOBS_TAG: "1",
                                                            SLURM_JOB_IDS_TAG: job_id,
                                                            SUBMITIT_FOLDER_TAG: f"{folder}/%j"}).info.run_id
    run = client.create_run(exp, run_name=run_name, tags={"mlflow.parentRunId": parent, JOB_NUM_TAG: "0"}).info.run_id
    (folder / job_id).mkdir(parents=True)
    result = folder / job_id / f"{job_id}_0_result.pkl"
    try:
        raise error
    except BaseException:  # noqa: BLE001 - JobFailed is a SystemExit too
        cloudpickle_dump(("error", traceback.format_exc()), result)
    return client, parent, run, result


def test_collect_names_a_job_by_its_own_failure_left_as_its_result(tmp_path: Path, slurm_states: Path,
                                                                    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A detached job that ended on a failure of its own after its run started (a non-finite loss: a message of three
    lines, exit 1) left its error as its result (:class:`JobFailed`, as submitit's job side writes an error). collect
    names the job by the message's first line (its log's last line is submitit's own), and takes the job for one that
    returned: its run, left RUNNING (the store was gone as it ended, no replay file left), is ended FAILED at the job's
    end, tagged why, not as the run of a job that died."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/own.db"
    message = ("Training failed: the loss is nan at step 3\nResume this run from step_2, into the same MLflow run, with "
               "this command with your change made:\n  python -m recsys_runner optim.lr=10 checkpoint.dir=/tmp/x")
    client, parent, run, result = _detached_job_with_an_error(tmp_path, "own", "9400_0", "lr=10", JobFailed(1, message))
    folder = result.parent.parent
    job_end = int(time.time()) - 600
    os.utime(result, (job_end, job_end))
    (folder / "9400_0" / "9400_0_0_log.err").write_text(
        f"{message}\nsubmitit ERROR (2026-01-01 00:00:00,000) - Submitted job triggered an exception\n")
    slurm_states.write_text("9400_0|FAILED|localhost\n")
    assert compare.main(["collect", "--uri", uri, "--parent", parent, "--no-plots"]) == 1
    err = capsys.readouterr().err
    assert "Job #0 (SLURM 9400_0, FAILED) failed: Training failed: the loss is nan at step 3" in err.splitlines(), err
    ended = client.get_run(run)
    assert ended.info.status == "FAILED" and ended.info.end_time == job_end * 1000, ended.info
    assert ended.data.tags[JOB_END_TAG].startswith("FAILED: the run's end never reached the tracking store"), ended.data.tags
    assert "died before" not in err
    p = client.get_run(parent)
    assert p.info.status == "FAILED" and p.data.tags["sweep.failed_jobs"] == "#0 (SLURM 9400_0, FAILED)"


def test_collect_names_a_crashed_job_by_its_errors_last_line(tmp_path: Path, slurm_states: Path,
                                                            capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A detached job that crashed (an error of no kind the command knows, here a CUDA out-of-memory) is raised again by
    the launcher's job side, so it left its traceback as its error result and SLURM says FAILED: collect names the job
    by the traceback's last line and ends the parent FAILED naming it. Before, Hydra kept the error as the job's return
    value: SLURM said COMPLETED and the sweep ended as if the job had succeeded."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/crash.db"
    client, parent, run, _ = _detached_job_with_an_error(tmp_path, "crash", "9500_0", "bs=65536",
                                                         RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    client.set_terminated(run, status="FAILED")  # the job's tracker ended its run as the error left the command
    slurm_states.write_text("9500_0|FAILED|localhost\n")
    assert compare.main(["collect", "--uri", uri, "--parent", parent, "--no-plots"]) == 1
    err = capsys.readouterr().err
    assert "Job #0 (SLURM 9500_0, FAILED) failed: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB" in err.splitlines(), err
    p = client.get_run(parent)
    assert p.info.status == "FAILED" and p.data.tags["sweep.failed_jobs"] == "#0 (SLURM 9500_0, FAILED)"


def test_collect_waits_while_slurm_says_a_job_still_runs(tmp_path: Path, slurm_states: Path,
                                                         capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/running.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("running")
    parent = client.create_run(exp, run_name="sweep", tags={SWEEP_PARENT_TAG: "eval/auc", EXPECTED_JOBS_TAG: "2",
                                                            SLURM_JOB_IDS_TAG: "9200_0 9200_1"}).info.run_id
    _child(client, exp, parent, 0.1, "deepfm", 0.68)
    slurm_states.write_text("9200_0|COMPLETED|localhost\n9200_1|PENDING|\n")
    assert compare.main(["collect", "--uri", uri, "--parent", parent, "--no-plots"]) == 1
    err = capsys.readouterr().err
    assert "1 of 2 jobs ended; run collect again later" in err and "failed" not in err
    assert client.get_run(parent).info.status == "RUNNING"


def test_collect_waits_for_a_requeued_job_whose_preemption_ended_its_run_killed(
        tmp_path: Path, slurm_states: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A preempted job ends its run KILLED (tagged ``preempted``) and SLURM requeues it: until the requeued job runs (on a
    busy cluster, hours) every child run is KILLED or FINISHED. collect took that for the sweep's end: it ended the parent
    FINISHED with the best of the runs so far, and the requeued job's result, logged later into the same run, was never
    summarized. While SLURM says a job may still run, the sweep has not ended; once it has, collect summarizes it."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/requeued.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("requeued")
    parent = client.create_run(exp, run_name="sweep", tags={SWEEP_PARENT_TAG: "eval/auc", EXPECTED_JOBS_TAG: "2",
                                                            SLURM_JOB_IDS_TAG: "9700_0 9700_1"}).info.run_id
    _child(client, exp, parent, 0.1, "deepfm", 0.68)
    preempted = client.create_run(exp, run_name="optim.lr=0.2,model=deepfm",
                                  tags={"mlflow.parentRunId": parent, JOB_NUM_TAG: "1", PREEMPTED_TAG: "true"}).info.run_id
    client.log_metric(preempted, "train/loss", 0.5, step=10)
    client.set_terminated(preempted, "KILLED")
    for requeued in ("REQUEUED", "PENDING", "RUNNING"):
        slurm_states.write_text(f"9700_0|COMPLETED|localhost\n9700_1|{requeued}|\n")
        assert compare.main(["collect", "--uri", uri, "--parent", parent, "--no-plots"]) == 1, requeued
        err = capsys.readouterr().err
        assert "sweep " + parent + ": 1 of 2 jobs ended; run collect again later" in err and "failed" not in err, err
        assert client.get_run(parent).info.status == "RUNNING", requeued
        assert client.get_run(preempted).info.status == "KILLED", "the requeued job's run is its own to continue"

    client.log_metric(preempted, "eval/auc", 0.71, step=30)  # the requeued job continued its run and finished it
    client.set_terminated(preempted, "FINISHED")
    slurm_states.write_text("9700_0|COMPLETED|localhost\n9700_1|COMPLETED|localhost\n")
    assert compare.main(["collect", "--uri", uri, "--parent", parent, "--no-plots"]) == 0
    p = client.get_run(parent)
    assert p.info.status == "FINISHED" and p.data.tags["best.run_id"] == preempted


def test_collect_ends_the_runs_of_jobs_slurm_killed_and_leaves_running_ones_alone(
        tmp_path: Path, slurm_states: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs killed after their MLflow run started (a time limit, an OOM kill) left their runs RUNNING for ever, without
    an end time. collect ends each one when SLURM reports its job ended — KILLED, FAILED for a job SLURM says failed —
    tagged with SLURM's state; the run of a job SLURM says still runs, or was requeued, is not touched."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/killed.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("killed")
    parent = client.create_run(exp, run_name="sweep", tags={SWEEP_PARENT_TAG: "eval/auc", EXPECTED_JOBS_TAG: "4",
                                                            SLURM_JOB_IDS_TAG: "9300_0 9300_1 9300_2 9300_3"}).info.run_id
    runs = [client.create_run(exp, run_name=f"lr=0.{num + 1}", tags={"mlflow.parentRunId": parent, JOB_NUM_TAG: str(num)})
            for num in range(4)]
    for run in runs:
        client.log_metric(run.info.run_id, "train/loss", 0.5, step=10)
    slurm_states.write_text("9300_0|TIMEOUT|localhost\n9300_1|RUNNING|localhost\n9300_2|OUT_OF_MEMORY|localhost\n"
                            "9300_3|REQUEUED|\n")
    assert compare.main(["collect", "--uri", uri, "--parent", parent, "--no-plots"]) == 1
    err = capsys.readouterr().err
    ended = [client.get_run(r.info.run_id) for r in runs]
    assert [(r.info.status, r.data.tags.get(JOB_END_TAG)) for r in ended] == [
        ("KILLED", "TIMEOUT"), ("RUNNING", None), ("KILLED", "OUT_OF_MEMORY"), ("RUNNING", None)]
    first_end = ended[0].info.end_time
    assert first_end is not None and ended[1].info.end_time is None
    assert f"Job #0 (TIMEOUT) died before it could end its MLflow run {runs[0].info.run_id} (lr=0.1): ended it KILLED" in err
    assert "2 of 4 jobs ended; run collect again later" in err and client.get_run(parent).info.status == "RUNNING"

    slurm_states.write_text("9300_0|TIMEOUT|localhost\n9300_1|FAILED|localhost\n9300_2|OUT_OF_MEMORY|localhost\n"
                            "9300_3|CANCELLED by 0|localhost\n")
    assert compare.main(["collect", "--uri", uri, "--parent", parent, "--no-plots"]) == 1
    ended = [client.get_run(r.info.run_id) for r in runs]
    assert [(r.info.status, r.data.tags.get(JOB_END_TAG)) for r in ended] == [
        ("KILLED", "TIMEOUT"), ("FAILED", "FAILED"), ("KILLED", "OUT_OF_MEMORY"), ("KILLED", "CANCELLED")]
    assert ended[0].info.end_time == first_end, "a run already ended is left as it is"
    p = client.get_run(parent)
    assert p.info.status == "FAILED" and p.data.tags["sweep.failed_jobs"] == (
        "#0 (SLURM 9300_0, TIMEOUT); #1 (SLURM 9300_1, FAILED); #2 (SLURM 9300_2, OUT_OF_MEMORY); #3 (SLURM 9300_3, CANCELLED)")


def test_no_arguments_show_the_most_recent_sweep(sweep: tuple[str, str, dict[str, str]], capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    uri, parent, _ = sweep
    client = MlflowClient(tracking_uri=uri)
    older = client.create_experiment("older")  # an earlier sweep elsewhere in the store: not the one shown
    old_parent = client.create_run(older, run_name="old sweep", start_time=1_000, tags={SWEEP_PARENT_TAG: "eval/auc"}).info.run_id
    _child(client, older, old_parent, 0.5, "dlrm", 0.9)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # where a bare command looks (tracking.uri's default)
    assert compare.main(["--no-plots"]) == 0
    out, err = capsys.readouterr()
    assert f"showing the most recent sweep: sweep (--parent {parent}, experiment cmp" in err and "--experiment <name>" in err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["run", "status", "model._target_", "optim.lr"]
    assert [line.split()[4] for line in lines[2:]] == ["0.6800", "0.6500", "0.6100"], "the three trials of the newest sweep"


def test_no_arguments_without_a_sweep_show_the_default_experiment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"sqlite:///{tmp_path}/plain.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("recsys_runner")  # tracking.experiment's default
    for lr, auc in ((0.01, 0.6), (0.1, 0.7)):
        rid = client.create_run(exp, run_name=f"optim.lr={lr}").info.run_id
        client.log_batch(rid, metrics=[Metric("eval/auc", auc, 0, 30)], params=[Param("optim.lr", str(lr))])
        client.set_terminated(rid)
    assert compare.main(["--uri", uri, "--no-plots"]) == 0
    out, err = capsys.readouterr()
    assert "showing the runs of experiment recsys_runner (no sweep in this store)" in err
    assert [line.split()[2] for line in out.splitlines()[2:]] == ["0.1", "0.01"]


def test_no_arguments_on_an_empty_store_say_what_to_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"sqlite:///{tmp_path}/empty.db"
    MlflowClient(tracking_uri=uri).create_experiment("other")
    for argv, expected in [([], r"no sweep and no experiment 'recsys_runner' .*experiments there: other.*--experiment <name>"),
                           (["--experiment", "othr"], r"no MLflow experiment named 'othr' .*did you mean 'other'\? .*Fix: "
                                                      r"--experiment <one of them>")]:
        with pytest.raises(SystemExit) as stopped:  # one line, exit status 2, as every command's mistakes
            compare.main(["--uri", uri, "--no-plots", *argv])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and re.search(f"^Config error: {expected}", err, re.MULTILINE), err


@pytest.mark.parametrize("how", ["uri", "bare"])
def test_a_missing_store_is_not_created(how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``--uri sqlite:///missing/dir/x.db`` and a bare ``compare`` in an empty folder: one line naming the URI and how to
    point at the right store, exit status 2, and nothing left behind (no folder, no ``mlflow.db``)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if how == "uri":
        uri = f"sqlite:///{tmp_path}/missing/dir/x.db"
        assert compare.main(["--uri", uri, "--no-plots"]) == 2
    else:
        uri = f"sqlite:///{tmp_path}/mlflow.db"
        assert compare.main(["--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"no MLflow store at {uri}" in err and "creates no store" in err and "Fix: point --uri" in err
    assert ("(--uri)" if how == "uri" else "(the default, ./mlflow.db)") in err
    assert list(tmp_path.iterdir()) == [], "compare created something"
    # An empty database file is no store either.
    (tmp_path / "empty.db").touch()
    assert compare.main(["--uri", f"sqlite:///{tmp_path}/empty.db", "--no-plots"]) == 2
    assert "holds no MLflow tables" in capsys.readouterr().err


def test_ui_lines_for_a_server_and_a_local_store() -> None:
    """Every page printed carries ``?workflowType=machine_learning``: MLflow 3's UI otherwise opens an empty GenAI view."""
    assert compare.ui_lines("https://mlflow.example.org/", "3", "abc") == [
        "MLflow UI: https://mlflow.example.org/#/experiments/3/runs/abc?workflowType=machine_learning"]
    assert compare.ui_lines("sqlite:////data/my runs/mlflow.db", "3", port=5001) == [
        f"MLflow UI: {mlflow_command()} ui --backend-store-uri 'sqlite:////data/my runs/mlflow.db' --port 5001",
        "  then open http://127.0.0.1:5001/#/experiments/3?workflowType=machine_learning"]


def test_the_mlflow_command_printed_runs_in_a_shell_that_has_not_activated_the_venv(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``make run`` trains with ``.venv/bin/python`` without activating ``.venv``: a bare ``mlflow`` in the line it ends
    with would be "command not found" there, so the line names this environment's script unless ``PATH`` finds it."""
    own = Path(os.path.abspath(sys.executable)).parent / "mlflow"
    assert own.is_file(), "the venv that runs the tests has mlflow's script"
    monkeypatch.setenv("PATH", str(tmp_path))  # a shell without the venv on PATH
    assert compare.ui_lines("sqlite:////r/mlflow.db", "1")[0] == f"MLflow UI: {own} ui --backend-store-uri sqlite:////r/mlflow.db --port 5000"
    monkeypatch.setenv("PATH", f"{own.parent}{os.pathsep}{tmp_path}")  # an activated venv
    assert compare.ui_lines("sqlite:////r/mlflow.db", "1")[0] == "MLflow UI: mlflow ui --backend-store-uri sqlite:////r/mlflow.db --port 5000"


def test_ui_url_names_the_experiment_that_ran_last(sweep: tuple[str, str, dict[str, str]], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``make ui``'s line: the experiment whose run started last, not the one created last; on a store with no run
    yet (or none at all: nothing is created) a line saying so, status 0 so that the server still starts."""
    uri, parent, _ = sweep
    client = MlflowClient(tracking_uri=uri)
    older = client.create_experiment("created_later_run_earlier")
    client.create_run(older, start_time=1_000)
    assert compare.main(["--ui-url", "--uri", uri]) == 0
    cmp = client.get_run(parent).info.experiment_id
    assert capsys.readouterr().out == f"http://127.0.0.1:5000/#/experiments/{cmp}?workflowType=machine_learning\n"
    assert compare_ui.last_experiment_url(client, "http://tracking:5000", port=1) == (
        f"http://tracking:5000/#/experiments/{cmp}?workflowType=machine_learning")
    empty = f"sqlite:///{tmp_path}/empty.db"
    MlflowClient(tracking_uri=empty).create_experiment("nothing_ran")
    missing = f"sqlite:///{tmp_path}/missing/x.db"
    for store in (empty, missing):
        assert compare.main(["--ui-url", "--uri", store]) == 0
        assert capsys.readouterr().out == f"no run in {store} yet: the UI lists runs once they log there\n"
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("first", [True, False])
def test_a_nan_trial_is_never_the_best_and_lists_last(sweep: tuple[str, str, dict[str, str]], capsys: pytest.CaptureFixture[str],
                                                      first: bool) -> None:
    """A finished trial whose objective is NaN (a diverged run with train.nan_guard=false) is neither the sweep's best
    nor first in its tables, wherever it falls among the children: every comparison with NaN is false, so a ``max`` or
    ``sorted`` keyed on the bare value kept it where it started."""
    uri, parent, ids = sweep
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_run(parent).info.experiment_id
    if first:  # before the others in every listing order
        for rid in ids.values():
            client.delete_run(rid)
        nan_id = _child(client, exp, parent, 1.0, "dlrm", float("nan"))
        ids = {k: _child(client, exp, parent, lr, m, auc) for k, lr, m, auc in (("a", 0.01, "deepfm", 0.61),
                                                                                   ("b", 0.1, "deepfm", 0.68), ("c", 0.1, "dlrm", 0.65))}
    else:
        nan_id = _child(client, exp, parent, 1.0, "dlrm", float("nan"))
    assert compare.main(["collect", "--uri", uri, "--parent", parent, "--no-plots"]) == 0
    assert client.get_run(parent).data.tags["best.run_id"] == ids["b"]
    summary = json.loads(Path(client.download_artifacts(parent, "sweep_summary.json")).read_text())
    assert [r["run_id"] for r in summary["runs"]] == [ids["b"], ids["c"], ids["a"], nan_id]
    capsys.readouterr()
    assert compare.main(["--uri", uri, "--parent", parent, "--no-plots"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[-3] for r in rows] == ["0.6800", "0.6500", "0.6100", "nan"]


class _Health(http.server.BaseHTTPRequestHandler):
    """An MLflow UI that has started, as far as ``make ui``'s wait can tell: ``/health`` answers 200."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"OK")

    def log_message(self, *_: object) -> None:
        pass


def test_make_ui_prints_the_page_once_the_server_answers_or_says_the_server_ended(
        sweep: tuple[str, str, dict[str, str]], capsys: pytest.CaptureFixture[str]) -> None:
    """``make ui`` starts the server first and prints the page once it answers (``--wait-for-ui <its PID>``): a page printed
    before the ~15 s the UI takes to start was refused when opened at once. A server that ends first (a port in use) is
    said, pointing at its own error, instead of a page nobody serves; never a wait for nothing. So is a port another server
    answers on before this one could have started (the page would have been that server's)."""
    uri, parent, _ = sweep
    port, servers = free_port(), []

    def start() -> None:  # a second after the wait began: the port is bound and answers only from then on
        servers.append(http.server.HTTPServer(("127.0.0.1", port), _Health))
        servers[0].serve_forever()

    answering = threading.Timer(1.0, start)
    answering.start()
    try:
        started = time.monotonic()
        assert compare.main(["--ui-url", "--uri", uri, "--port", str(port), "--wait-for-ui", str(os.getpid())]) == 0
        assert time.monotonic() - started >= 1.0
    finally:
        answering.cancel()  # not started yet (the wait failed early): it never will be
        while answering.finished.is_set() and answering.is_alive() and not servers:
            time.sleep(0.01)  # started: its server is being made
        for server in servers:
            server.shutdown()
            server.server_close()
        answering.join()
    experiment = MlflowClient(tracking_uri=uri).get_run(parent).info.experiment_id
    assert capsys.readouterr().out == f"http://127.0.0.1:{port}/#/experiments/{experiment}?workflowType=machine_learning\n"
    ended = subprocess.Popen([sys.executable, "-c", "pass"])  # left unreaped, as make's shell leaves its server till `wait`
    while Path(f"/proc/{ended.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.05)
    started = time.monotonic()
    assert compare.main(["--ui-url", "--uri", uri, "--port", str(free_port()), "--wait-for-ui", str(ended.pid)]) == 0
    said = capsys.readouterr()
    assert time.monotonic() - started < 10 and said.out == ""
    assert f"the MLflow UI (PID {ended.pid}) ended before it answered on port" in said.err, said.err
    assert "Fix: make ui PORT=<a free port>" in said.err
    ended.wait()
    taken = http.server.HTTPServer(("127.0.0.1", free_port()), _Health)  # another server on the port from the start
    serving = threading.Thread(target=taken.serve_forever)
    serving.start()
    try:
        assert compare.main(["--ui-url", "--uri", uri, "--port", str(taken.server_port), "--wait-for-ui", str(os.getpid())]) == 0
    finally:
        taken.shutdown()
        serving.join()
        taken.server_close()
    said = capsys.readouterr()
    assert said.out == "" and f"cannot serve port {taken.server_port}: another server already answers there" in said.err
