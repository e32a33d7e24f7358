"""Runs a sweep's ended jobs left RUNNING (``tracking/sweep_jobs.py``): a run from a runner older than ``sweep.job_num``,
found only where the job's overrides single it out, never guessed; a job that completed while the tracking store was
gone, whose run is left to its replay file while there is one and ended at the job's end time where there is none. On
``collect``'s side, against SLURM's account of the jobs as submitit reads it (``sacct`` faked as in
tests/conftest.py's ``slurm_states``); tests/test_sweeps_dead_jobs.py runs the waiting launchers for real.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from recsys_runner import compare
from recsys_runner.configurable import make
from recsys_runner.tracking.__main__ import main as tracking_main
from recsys_runner.tracking.outbox import UNSENT_DIR_TAG, replay
from recsys_runner.tracking.sweep import EXPECTED_JOBS_TAG
from recsys_runner.tracking.sweep_jobs import (
    JOB_END_TAG,
    SLURM_JOB_IDS_TAG,
    SUBMITIT_FOLDER_TAG,
    JobEnd,
    end_left_runs,
    overrides_on_disk,
)
from recsys_runner.tracking.sweep_names import JOB_NUM_TAG
from recsys_runner.tracking.sweep_summary import SWEEP_PARENT_TAG
from recsys_runner.tracking.tracker import PARENT_RUN_ENV, MlflowTracker, MlflowTrackingConfig
from tests.conftest import REPO, TINY, copied_store, free_port, run_cli, run_in_process
from tests.slurm_cluster import SlurmCluster, slurm_cluster_fixture  # noqa: F401 - provides the slurm_cluster fixture
from tests.store_gone import HOOK, refuse_run_ends


def _store(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch, created_store: Path) -> tuple[str, MlflowClient, str]:
    monkeypatch.chdir(tmp_path)  # the parent's summary table goes to ./mlruns
    uri = copied_store(created_store, tmp_path, f"{name}.db")
    client = MlflowClient(tracking_uri=uri)
    return uri, client, client.create_experiment(name)


def _parent(client: MlflowClient, exp: str, array: str, num_jobs: int, sweep_dir: Path) -> str:
    ids = " ".join(f"{array}_{num}" for num in range(num_jobs))
    return client.create_run(exp, run_name="sweep", tags={
        SWEEP_PARENT_TAG: "eval/auc", EXPECTED_JOBS_TAG: str(num_jobs), SLURM_JOB_IDS_TAG: ids, "sweep.dir": str(sweep_dir),
        SUBMITIT_FOLDER_TAG: f"{sweep_dir}/.submitit/%j"}).info.run_id


def _old_child(client: MlflowClient, exp: str, parent: str, overrides: str) -> str:
    """A child as a runner before ``sweep.job_num`` logged it: its overrides tag, no job number, RUNNING."""
    run = client.create_run(exp, run_name=overrides.replace("optim.", ""),
                            tags={"mlflow.parentRunId": parent, "hydra.overrides": overrides})
    client.log_metric(run.info.run_id, "train/loss", 0.5, step=10)
    return run.info.run_id


def _job_folder(sweep_dir: Path, num: int, overrides: list[str]) -> None:
    """What Hydra writes into a job's folder when the job starts: ``.hydra/hydra.yaml`` with its number and overrides."""
    hydra = sweep_dir / str(num) / ".hydra"
    hydra.mkdir(parents=True)
    (hydra / "hydra.yaml").write_text(json.dumps({"hydra": {"job": {"num": num, "name": "__main__"},
                                                            "overrides": {"task": overrides, "hydra": []}}}))


def _collect(uri: str, parent: str) -> int:
    return compare.main(["collect", "--uri", uri, "--parent", parent, "--no-plots"])


def test_an_older_runners_runs_are_ended_where_the_jobs_overrides_single_them_out(
        tmp_path: Path, slurm_states: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        created_store: Path) -> None:
    """A sweep started before runs carried ``sweep.job_num``: its dead jobs' runs were never found and stayed RUNNING.
    Each job's overrides, from its folder under the sweep dir, match exactly one run: that run is ended; the run of the
    job SLURM says still runs is not touched."""
    uri, client, exp = _store(tmp_path, "older", monkeypatch, created_store)
    sweep_dir = tmp_path / "multirun"
    parent = _parent(client, exp, "9400", 3, sweep_dir)
    overrides = [["optim.lr=0.1", "seed=1"], ["optim.lr=0.2", "seed=1"], ["optim.lr=0.3", "seed=1"]]
    runs = [_old_child(client, exp, parent, " ".join(o)) for o in overrides]
    for num, o in enumerate(overrides):
        _job_folder(sweep_dir, num, o)
    slurm_states.write_text("9400_0|TIMEOUT|localhost\n9400_1|RUNNING|localhost\n9400_2|CANCELLED by 0|localhost\n")
    assert _collect(uri, parent) == 1
    err = capsys.readouterr().err
    ended = [client.get_run(r) for r in runs]
    assert [(r.info.status, r.data.tags.get(JOB_END_TAG)) for r in ended] == [
        ("KILLED", "TIMEOUT"), ("RUNNING", None), ("KILLED", "CANCELLED")], err
    assert f"Job #0 (TIMEOUT) died before it could end its MLflow run {runs[0]} (lr=0.1 seed=1): ended it KILLED" in err
    assert "cannot be told" not in err


@pytest.mark.parametrize("case", ["two jobs alike", "a job's folder missing"])
def test_an_older_runners_runs_are_never_guessed(case: str, tmp_path: Path, slurm_states: Path,
                                                 capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                                 created_store: Path) -> None:
    """Where the overrides do not single a run out — two jobs tried the same values, or a job's folder is missing (not
    started, or shared), so another job could carry the same ones — no run is ended: a note names the sweep, the jobs,
    the RUNNING runs and the command that ends one, once per collect, and that command ends it."""
    uri, client, exp = _store(tmp_path, "guess", monkeypatch, created_store)
    sweep_dir = tmp_path / "multirun"
    parent = _parent(client, exp, "9500", 2, sweep_dir)
    overrides = [["optim.lr=0.1"], ["optim.lr=0.1"]] if case == "two jobs alike" else [["optim.lr=0.1"], ["optim.lr=0.2"]]
    runs = [_old_child(client, exp, parent, " ".join(o)) for o in overrides]
    for num, o in enumerate(overrides[: 2 if case == "two jobs alike" else 1]):
        _job_folder(sweep_dir, num, o)
    slurm_states.write_text("9500_0|OUT_OF_MEMORY|localhost\n9500_1|RUNNING|localhost\n")
    assert _collect(uri, parent) == 1
    err = capsys.readouterr().err
    assert [client.get_run(r).info.status for r in runs] == ["RUNNING", "RUNNING"], err
    assert err.count("cannot be told safely") == 1, err
    note = next(line for line in err.splitlines() if "cannot be told safely" in line)
    assert f"Sweep {parent}: job(s) #0 (OUT_OF_MEMORY) ended" in note and "None was ended" in note
    assert all(run in note for run in runs), note
    assert f"python -m recsys_runner.tracking end <run id> --uri {uri}" in note

    tracking_main(["end", runs[0], "--uri", uri])
    assert client.get_run(runs[0]).info.status == "KILLED" and client.get_run(runs[1]).info.status == "RUNNING"
    assert f"ended MLflow run {runs[0]}" in capsys.readouterr().out
    for argv, line in [([runs[0], "--uri", uri], f"MLflow run {runs[0]} (lr=0.1) has ended already: KILLED"),
                       ([runs[0], "--uri", f"sqlite:///{tmp_path}/absent.db"], "no MLflow store at"),
                       (["0" * 32, "--uri", uri], f"no MLflow run {'0' * 32} in {uri}. Fix: pass the store")]:
        with pytest.raises(SystemExit) as stopped:  # a user's mistake: one line and exit status 2, as every command
            tracking_main(["end", *argv])
        assert stopped.value.code == 2 and f"Tracking error: {line}" in capsys.readouterr().err
    assert not (tmp_path / "absent.db").exists()


def test_a_job_folder_shared_by_two_jobs_leaves_their_overrides_unknown(tmp_path: Path) -> None:
    _job_folder(tmp_path, 0, ["optim.lr=0.1"])
    _job_folder(tmp_path / "again", 0, ["optim.lr=0.2"])
    assert overrides_on_disk(str(tmp_path), 1) is None
    assert overrides_on_disk(str(tmp_path / "again"), 1) == {0: "optim.lr=0.2"}
    assert overrides_on_disk(str(tmp_path / "none"), 1) is None


def test_a_run_started_before_its_batch_was_launched_is_not_its_jobs(tmp_path: Path, store_uri: str) -> None:
    """The waiting launcher knows its batch's overrides (an Optuna sweep launches batch after batch): an older runner's
    RUNNING run with the same overrides that started before the batch is an earlier trial's, never this job's."""
    client = MlflowClient(tracking_uri=store_uri)
    exp = client.create_experiment("batch")
    parent = client.create_run(exp, run_name="sweep", tags={SWEEP_PARENT_TAG: "eval/auc"}).info.run_id
    earlier = _old_child(client, exp, parent, "optim.lr=0.1")
    since = int(time.time() * 1000) + 1000
    left = end_left_runs(client, parent, {3: JobEnd("DIED")}, lambda: {3: "optim.lr=0.1"}, since_ms=since)
    assert left.ended == [] and client.get_run(earlier).info.status == "RUNNING"
    assert "cannot be told safely" in left.notes[0]
    left = end_left_runs(client, parent, {3: JobEnd("DIED")}, lambda: {3: "optim.lr=0.1"}, since_ms=0)
    assert left.ended == [earlier] and client.get_run(earlier).data.tags[JOB_END_TAG] == "DIED"


def _tracked_run_whose_end_is_lost(uri: str, job_num: int) -> str:
    """A sweep job's run logged by the real tracker, whose end the store does not take (it went away:
    tests/store_gone.py): the tracker writes the run's end to its replay file in the directory it started in."""
    tracker = MlflowTracker(make(MlflowTrackingConfig, uri=uri, experiment="lost", flush_timeout_s=0.0))
    tracker.start(run_name=f"lr=0.{job_num + 1}", tags={JOB_NUM_TAG: str(job_num)}, params={})  # a child of $PARENT_RUN_ENV
    tracker.log_metrics({"eval/auc": 0.6 + job_num / 10}, step=10)
    run_id = str(tracker.run_id)
    tracker.finish("FINISHED")
    return run_id


def test_a_completed_jobs_run_left_running_waits_for_its_replay_else_is_ended_at_the_jobs_end(
        tmp_path: Path, slurm_states: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        created_store: Path) -> None:
    """Two jobs SLURM says COMPLETED whose runs stayed RUNNING: the store was gone at their end. Job #0's end waits in its
    replay file: its run is left to the replay, collect says the command, and the sweep's summary waits. Job #1's file
    is gone: nothing else would end its run, so it is ended FINISHED at the job's end time, tagged why. Once the replay
    has run, collect summarizes the sweep."""
    uri, client, exp = _store(tmp_path, "lost", monkeypatch, created_store)
    sweep_dir = tmp_path / "multirun"
    parent = _parent(client, exp, "9600", 2, sweep_dir)
    monkeypatch.setenv(PARENT_RUN_ENV, parent)
    refuse_run_ends(monkeypatch.setattr, lost_job=None)
    waiting, lost = (_tracked_run_whose_end_is_lost(uri, num) for num in range(2))
    files = {run: tmp_path / f"mlflow_unsent_{run}.json" for run in (waiting, lost)}
    assert all(f.exists() for f in files.values()), "the tracker keeps a run's end the store did not take"
    assert client.get_run(waiting).data.tags[UNSENT_DIR_TAG] == str(tmp_path)
    files[lost].unlink()
    result = sweep_dir / ".submitit" / "9600_1" / "9600_1_0_result.pkl"
    result.parent.mkdir(parents=True)
    result.write_bytes(b"")
    job_end = int(time.time()) - 600
    os.utime(result, (job_end, job_end))
    slurm_states.write_text("9600_0|COMPLETED|localhost\n9600_1|COMPLETED|localhost\n")

    assert _collect(uri, parent) == 1
    err = capsys.readouterr().err
    assert client.get_run(waiting).info.status == "RUNNING" and JOB_END_TAG not in client.get_run(waiting).data.tags
    assert (f"Job #0 (COMPLETED) ended, but the tracking store was gone when its MLflow run {waiting} (lr=0.1) ended: the "
            f"run stays RUNNING until its end and last metrics are sent with: python -m recsys_runner.tracking replay "
            f"{files[waiting]}") in err
    ended = client.get_run(lost)
    assert ended.info.status == "FINISHED" and ended.info.end_time == job_end * 1000
    assert ended.data.tags[JOB_END_TAG].startswith("COMPLETED: the run's end never reached the tracking store")
    assert f"Job #1 (COMPLETED) ended, but its MLflow run {lost} (lr=0.2) never got its end" in err
    assert "1 run(s) wait for their replay" in err and client.get_run(parent).info.status == "RUNNING"

    replay(files[waiting])
    assert _collect(uri, parent) == 0
    assert client.get_run(waiting).info.status == "FINISHED"
    p = client.get_run(parent)
    assert p.info.status == "FINISHED" and p.data.tags["best.run_id"] == lost


def _sweep_whose_store_is_gone_as_its_jobs_end(tmp_path: Path, uri: str, *launcher: str,
                                                monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """Job #0's end waits in its replay file, so its run is left RUNNING and the replay command said once; job #1's file
    is lost, so its run, which nothing else would end, is ended FINISHED at the job's end, tagged why. Once the replay
    has run, ``collect`` summarizes the sweep. The store is tests/store_gone.py's: in the job processes (a
    ``sitecustomize`` hook) for a submitit ``launcher``; in this process, given ``monkeypatch``, for the default
    in-process launcher (``basic_keep_going``), run as ``python -m recsys_runner`` runs it."""
    args = ["-m", *launcher, "optim.lr=0.01,0.1", *TINY, "train.num_steps=10", "tracking.flush_timeout_s=0",
            f"tracking.uri={uri}", "tracking.experiment=gone"]
    if monkeypatch is not None:
        refuse_run_ends(monkeypatch.setattr)
        out = run_in_process([sys.executable, "-m", "recsys_runner", *args], tmp_path)
    else:
        hooks = tmp_path / "hooks"
        hooks.mkdir()
        (hooks / "sitecustomize.py").write_text(HOOK)
        out = run_cli(*args, cwd=tmp_path, timeout=600, env={"PYTHONPATH": f"{hooks}:{REPO}"})
    said, ended_by_ms = out.stdout + out.stderr, int(time.time() * 1000)
    assert out.returncode == 0, said[-3000:]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("gone").experiment_id])
    (parent,) = [r for r in runs if SWEEP_PARENT_TAG in r.data.tags]
    children = {r.data.tags[JOB_NUM_TAG]: r for r in runs if JOB_NUM_TAG in r.data.tags}
    waiting, lost = children["0"], children["1"]
    spool = tmp_path / f"mlflow_unsent_{waiting.info.run_id}.json"
    assert waiting.info.status == "RUNNING" and spool.exists(), said[-3000:]
    assert said.count(f"python -m recsys_runner.tracking replay {spool}") == 1, said[-3000:]
    assert lost.info.status == "FINISHED" and lost.data.tags[JOB_END_TAG].startswith("COMPLETED: the run's end never"), said[-3000:]
    if monkeypatch is None:
        results = list((tmp_path / "multirun").glob("*/*/.submitit/*/*_result.pkl"))
        assert lost.info.end_time in {int(p.stat().st_mtime * 1000) for p in results}, "ended at its job's end"
    else:  # ended as its job returned
        assert lost.info.start_time < lost.info.end_time <= ended_by_ms
    assert f"Job #1 (COMPLETED) ended, but its MLflow run {lost.info.run_id} (lr=0.1) never got its end" in out.stderr
    assert parent.info.status == "RUNNING", "the summary waits for the replay"
    assert "every job has ended, but 1 of 2 child runs are still RUNNING" in said and "still running or queued" not in said
    assert "Could not check" not in said

    replay(spool)
    assert compare.main(["collect", "--uri", uri, "--parent", parent.info.run_id, "--no-plots"]) == 0
    assert client.get_run(waiting.info.run_id).info.status == "FINISHED"
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"


def test_in_process_sweep_whose_store_was_gone_as_its_jobs_ended(tmp_path: Path, store_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default launcher (``basic_keep_going``) runs the jobs in this process: each job's end is known as it returns,
    and a run it left RUNNING is left to its replay file or ended, as the waiting launchers do."""
    _sweep_whose_store_is_gone_as_its_jobs_end(tmp_path, store_uri, monkeypatch=monkeypatch)


@pytest.mark.slow
def test_submitit_local_sweep_whose_store_was_gone_as_its_jobs_ended(tmp_path: Path, store_uri: str) -> None:
    """A real ``submitit_local`` sweep whose jobs complete while the tracking store is gone at their runs' end."""
    _sweep_whose_store_is_gone_as_its_jobs_end(tmp_path, store_uri, "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5")


@pytest.mark.slow
def test_slurm_sweep_whose_store_was_gone_as_its_jobs_ended(slurm_cluster: SlurmCluster, tmp_path: Path, store_uri: str) -> None:
    """The same against the real test SLURM cluster (tests/slurm_cluster.py), with the waiting ``submitit_slurm``."""
    _sweep_whose_store_is_gone_as_its_jobs_end(tmp_path, store_uri, "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=10",
                                               "hydra.launcher.cpus_per_task=1")


def test_a_store_gone_at_the_sweeps_end_is_said_only_where_a_died_jobs_run_is_left_unknown(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The launchers' check of their jobs' runs against a tracking server that is gone (nothing listens on its port):
    a healthy sweep, whose jobs all returned (each ended its own run, or said where its replay file is), prints nothing;
    a sweep with a job that died names it, and the command that ends its run once the store is back."""
    from omegaconf import OmegaConf

    from hydra_plugins.recsys_runner_detached import _end_left_runs

    uri = f"http://127.0.0.1:{free_port()}"
    config = OmegaConf.create({"tracking": {"uri": uri}})
    monkeypatch.setenv(PARENT_RUN_ENV, "0123456789abcdef")
    overrides = {0: "optim.lr=0.1", 1: "optim.lr=0.2"}
    healthy = {0: JobEnd("COMPLETED", returned=True), 1: JobEnd("FAILED", returned=True)}
    started = time.monotonic()
    _end_left_runs(config, healthy, overrides, 0)
    _end_left_runs(config, healthy, overrides, 0, tracker_said_replays=True)
    assert capsys.readouterr().err == ""
    assert time.monotonic() - started < 60, "no minutes of MLflow's HTTP retries"

    _end_left_runs(config, {0: JobEnd("COMPLETED", returned=True), 1: JobEnd("DIED")}, overrides, 0)
    err = capsys.readouterr().err
    assert err.startswith("Could not check the MLflow runs of the sweep's jobs (") and err.count("\n") == 1, err
    assert "job(s) #1 (DIED) died" in err and f"python -m recsys_runner.tracking end <run id> --uri {uri}" in err


def test_a_run_the_store_would_not_end_is_named_and_the_others_still_ended(store_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store fails as one left run is ended: that run is named with the command that ends it (its status as the
    check would have set it), and the next job's run is still ended."""
    client = MlflowClient(tracking_uri=store_uri)
    exp = client.create_experiment("flaky")
    parent = client.create_run(exp, run_name="sweep", tags={SWEEP_PARENT_TAG: "eval/auc"}).info.run_id
    runs = [client.create_run(exp, run_name=f"lr=0.{num + 1}", tags={"mlflow.parentRunId": parent, JOB_NUM_TAG: str(num)})
            .info.run_id for num in range(2)]
    real = client.set_terminated

    def flaky(run_id: str, **kwargs: Any) -> None:
        if run_id == runs[0]:
            raise ConnectionError("tracking store gone")
        real(run_id, **kwargs)

    monkeypatch.setattr(client, "set_terminated", flaky)
    left = end_left_runs(client, parent, {0: JobEnd("TIMEOUT"), 1: JobEnd("DIED")})
    assert left.ended == [runs[1]] and client.get_run(runs[1]).info.status == "KILLED"
    assert client.get_run(runs[0]).info.status == "RUNNING"
    (note,) = left.notes
    assert note.startswith(f"Job #0 (TIMEOUT) ended, but its MLflow run {runs[0]} (lr=0.1), left RUNNING, could not be "
                           f"ended (ConnectionError: tracking store gone)"), note
    assert note.endswith(f"python -m recsys_runner.tracking end {runs[0]} --status KILLED --uri {client.tracking_uri}")
