"""Multiruns as MLflow parent + children: a grid, an Optuna search, and the submitit_local launcher with a failed job
(a submitit_local sweep that ends well, its parent FINISHED, is tests/test_slurm_preempt.py's local preemption); a
sweep's own folder and its swept keys checked before it starts. The submitit_local launcher (a process of its own:
submitit's pickling of the job left the suite's config dataclasses broken for the tests after it) and a sweep whose
parent is ended at the process's exit run as commands; the grid and Optuna ones run in this
process as ``python -m`` would run them (:func:`tests.conftest.run_in_process`: the same multirun, its jobs and
callbacks, without ~10 s of imports)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from recsys_runner import compare
from recsys_runner.errors import ConfigError
from recsys_runner.sweep import first_job_overrides
from recsys_runner.tracking.store import mlflow_command
from recsys_runner.tracking.sweep import check_direction
from recsys_runner.tracking.sweep_jobs import own_failure
from recsys_runner.tracking.sweep_names import (
    JOB_NUM_TAG,
    SWEPT_KEYS_ENV,
    child_name,
    child_params,
    job_swept_values,
    sweep_name,
    swept_ranges,
)
from recsys_runner.tracking.sweep_summary import SWEEP_PARENT_TAG, _override_pairs
from recsys_runner.tracking.tracker import PARENT_RUN_ENV
from tests.conftest import REPO, TINY, copied_store, run_cli, run_in_process

TRAIN = [sys.executable, "-m", "recsys_runner"]


def _parent_and_children(uri: str, experiment: str) -> tuple[object, list]:
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parents = [r for r in runs if SWEEP_PARENT_TAG in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in runs]
    (parent,) = parents
    children = [r for r in runs if r is not parent]
    assert all(r.data.tags.get("mlflow.parentRunId") == parent.info.run_id for r in children)
    return parent, children


def test_optuna_sweep_logs_parent_with_best_trial(tmp_path: Path, store_uri: str) -> None:
    uri = store_uri
    out = run_in_process([*TRAIN, "-m", "--config-dir", str(REPO / "sweeps"), "--config-name", "optuna_lr", *TINY, "train.num_steps=10",
                          "hydra.sweeper.n_trials=3", f"tracking.uri={uri}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    parent, children = _parent_and_children(uri, "optuna_lr")
    assert len(children) == 3 and all(r.info.status == "FINISHED" for r in children)
    best = max(children, key=lambda r: r.data.metrics["eval/auc"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["best.run_id"] == best.info.run_id
    assert parent.data.metrics["best/eval/auc"] == pytest.approx(best.data.metrics["eval/auc"])
    # The parent's best.* params are the swept values only, not the overrides every trial shared.
    swept = {k: v for k, v in parent.data.params.items() if k.startswith("best.")}
    assert set(swept) == {"best.optim.sparse.lr", "best.optim.dense.lr", "best.model"}, swept
    assert float(swept["best.optim.sparse.lr"]) == pytest.approx(float(best.data.params["optim.sparse.lr"]))
    # What the sweep tried, on the parent and on every child alike (the UI's parallel-coordinates chart).
    assert parent.data.tags["sweep.params"] == "optim.sparse.lr,optim.dense.lr,model"
    assert parent.data.params["sweep.range.optim.sparse.lr"] == "tag(log, interval(0.005, 0.5))"
    assert parent.info.run_name.startswith("sweep optim.sparse.lr=interval(0.005,0.5) optim.dense.lr=interval(")
    keys = {"swept.optim.sparse.lr", "swept.optim.dense.lr", "swept.model"}
    assert all({k for k in r.data.params if k.startswith("swept.")} == keys for r in children)
    assert all(r.info.run_name.startswith("sparse.lr=") and f"model={r.data.params['swept.model']}" in r.info.run_name
               for r in children), [r.info.run_name for r in children]
    # Optuna saw the same objective: its best value is the best child's AUC.
    (results,) = (tmp_path / "multirun").glob("*/*/optimization_results.yaml")
    # the value, not a prefix of its text: "0.6543996" rounded to 6 places begins "0.6544", which its text does not
    # (a chance of about 1 in 200 for whatever AUC this machine's kernels train)
    assert OmegaConf.load(results).best_value == pytest.approx(best.data.metrics["eval/auc"], abs=1e-9)


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory, created_store: Path) -> tuple[str, Path]:
    """One real 3-point grid (``optim.lr=0.01,0.05,0.1``) into a sqlite store, shared by the tests that read it."""
    tmp_path = tmp_path_factory.mktemp("grid")
    uri = copied_store(created_store, tmp_path, "grid.db")
    out = run_in_process([*TRAIN, "-m", "optim.lr=0.01,0.05,0.1", *TINY, "train.num_steps=10", f"tracking.uri={uri}",
                          "tracking.experiment=grid"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (tmp_path / "output.txt").write_text(out.stdout)
    return uri, tmp_path


def test_grid_multirun_is_one_parent_with_children(grid: tuple[str, Path]) -> None:
    uri, tmp_path = grid
    parent, children = _parent_and_children(uri, "grid")
    # It ends as every command does: how to compare its jobs, and the parent's page in the MLflow UI.
    end = [line.split("] ", 1)[-1].removeprefix("- ") for line in (tmp_path / "output.txt").read_text().splitlines()[-3:]]
    assert end == [f"compare its jobs (a table and plots): python -m recsys_runner.compare --parent {parent.info.run_id} --uri {uri}",
                   f"MLflow UI: {mlflow_command()} ui --backend-store-uri {uri} --port 5000",
                   f"  then open http://127.0.0.1:5000/#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}"
                   "?workflowType=machine_learning"], end
    assert len(children) == 3 and parent.info.status == "FINISHED"
    # Each run names its job (what a launcher that sees a job die finds its run by: tracking/sweep_jobs.py).
    assert {r.data.tags[JOB_NUM_TAG]: r.data.params["optim.lr"] for r in children} == {"0": "0.01", "1": "0.05", "2": "0.1"}
    aucs = sorted(r.data.metrics["eval/auc"] for r in children)
    assert aucs[-1] > aucs[-2], aucs  # one best child, so the check below names it
    best = max(children, key=lambda r: r.data.metrics["eval/auc"])  # eval/auc: higher is better
    assert parent.data.tags["best.run_id"] == best.info.run_id
    assert parent.data.params["best.optim.lr"] == best.data.params["swept.optim.lr"]
    assert parent.data.metrics["best/eval/auc"] == pytest.approx(best.data.metrics["eval/auc"])
    assert PARENT_RUN_ENV not in os.environ and SWEPT_KEYS_ENV not in os.environ, "the sweep's environment is put back"


def test_grid_parent_and_children_say_what_was_swept(grid: tuple[str, Path]) -> None:
    """What the UI's runs table and parallel-coordinates chart read: the parent's name, range and swept keys, each
    child named by its value with the same ``swept.*`` params, and the summary table of every child."""
    uri, _ = grid
    parent, children = _parent_and_children(uri, "grid")
    assert parent.info.run_name == "sweep optim.lr=0.01,0.05,0.1"
    assert parent.data.params["sweep.range.optim.lr"] == "0.01,0.05,0.1"
    assert parent.data.tags["sweep.params"] == "optim.lr"
    assert sorted(r.info.run_name for r in children) == ["lr=0.01", "lr=0.05", "lr=0.1"]
    assert {frozenset(k for k in r.data.params if k.startswith("swept.")) for r in children} == {frozenset({"swept.optim.lr"})}
    assert sorted(r.data.params["swept.optim.lr"] for r in children) == ["0.01", "0.05", "0.1"]
    client = MlflowClient(tracking_uri=uri)
    summary = json.loads(Path(client.download_artifacts(parent.info.run_id, "sweep_summary.json")).read_text())
    rows = summary["runs"]
    assert summary["objective"] == "eval/auc" and len(rows) == 3
    assert rows[0]["run_id"] == parent.data.tags["best.run_id"], "best first"
    assert {r["run_name"]: r["swept.optim.lr"] for r in rows} == {r.info.run_name: r.data.params["swept.optim.lr"] for r in children}
    assert all(r["status"] == "FINISHED" and isinstance(r["eval/auc"], float) and r["train/loss"] is not None for r in rows)
    csv_text = Path(client.download_artifacts(parent.info.run_id, "sweep_summary.csv")).read_text()
    assert csv_text.splitlines()[0].startswith("run_id,run_name,status,swept.optim.lr,eval/auc,")
    assert len(csv_text.splitlines()) == 4


def test_compare_prints_how_to_open_the_sweep_in_the_ui(grid: tuple[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    uri, _ = grid
    parent, _ = _parent_and_children(uri, "grid")
    experiment = parent.info.experiment_id
    assert compare.main(["--uri", uri, "--no-plots"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2 + 3 and "MLflow UI" not in out, "stdout stays the table"
    assert f"MLflow UI: {mlflow_command()} ui --backend-store-uri {uri} --port 5000" in err.splitlines()
    page = f"http://127.0.0.1:5000/#/experiments/{experiment}/runs/{parent.info.run_id}?workflowType=machine_learning"
    assert f"  then open {page}" in err.splitlines()
    # make ui: the page of the experiment that ran last, on the port it serves
    assert compare.main(["--ui-url", "--uri", uri, "--port", "5001"]) == 0
    assert capsys.readouterr().out.strip() == f"http://127.0.0.1:5001/#/experiments/{experiment}?workflowType=machine_learning"


def test_single_run_has_no_parent(make_cfg, mlflow_uri: str) -> None:
    from recsys_runner.__main__ import run

    run(make_cfg("train.num_steps=5"))
    client = MlflowClient(tracking_uri=mlflow_uri)
    (r,) = client.search_runs([client.get_experiment_by_name("test_single_run_has_no_parent").experiment_id])
    assert "mlflow.parentRunId" not in r.data.tags


def test_swept_ranges_come_from_the_sweeper_and_the_command_line() -> None:
    """Sweeps in ``hydra.sweeper.params`` (a sweep file's) and in the command line's overrides; fixed values are not
    swept; the command line's sweep of a key replaces the file's."""
    config = OmegaConf.create({"hydra": {
        "sweeper": {"params": {"optim.sparse.lr": "tag(log, interval(0.005, 0.5))", "model": "choice(deepfm, dlrm)",
                               "seed": "0", "optim.lr": "0.1,0.2"}},
        "overrides": {"task": ["optim.lr=0.01,0.05", "data.batch_size=64", "+x.y=range(1,4)", "tracking.uri=sqlite\\:///a.db"]}}})
    ranges = swept_ranges(config)
    assert ranges == {"optim.sparse.lr": "tag(log, interval(0.005, 0.5))", "model": "choice(deepfm, dlrm)",
                      "optim.lr": "0.01,0.05", "x.y": "range(1,4)"}
    name = sweep_name(ranges) or ""
    assert name.startswith("sweep optim.sparse.lr=interval(0.005,0.5) model=deepfm,dlrm optim.lr=0.01,0.05 ")
    assert len(name) == 80 and name.endswith("…"), "clipped"
    assert sweep_name({"optim.lr": "0.01,0.1", "model": "deepfm,dlrm"}) == "sweep optim.lr=0.01,0.1 model=deepfm,dlrm"
    assert sweep_name({}) is None and swept_ranges(OmegaConf.create({"hydra": {"overrides": {"task": ["a=1"]}}})) == {}


def test_child_name_and_params(monkeypatch: pytest.MonkeyPatch) -> None:
    """Named by the values tried: each key's last component, more of it where two would clash; Optuna's long floats
    short in the name, exact in the params; nothing outside a sweep."""
    overrides = ["optim.sparse.lr=0.0334721651", "optim.dense.lr=0.001", "model=dlrm", "+model.dropout=0.1",
                 "tracking.uri=sqlite\\:///a.db"]
    assert job_swept_values(overrides) == {}
    monkeypatch.setenv(SWEPT_KEYS_ENV, "optim.sparse.lr,optim.dense.lr,model,model.dropout")
    assert job_swept_values(overrides) == {}, "a parent run is what makes a sweep"
    monkeypatch.setenv(PARENT_RUN_ENV, "abc")
    values = job_swept_values(overrides)
    assert child_name(values) == "sparse.lr=0.03347 dense.lr=0.001 model=dlrm dropout=0.1"
    assert child_name({"lr": "1", "optim.lr": "2", "model": "m"}) == "lr=1 optim.lr=2 model=m"
    assert child_params(values) == {"swept.optim.sparse.lr": "0.0334721651", "swept.optim.dense.lr": "0.001",
                                    "swept.model": "dlrm", "swept.model.dropout": "0.1"}
    assert child_name({}) is None


def test_override_pairs() -> None:
    assert _override_pairs("optim.lr=0.1 +x.y=2 model=dlrm bare") == [("optim.lr", "0.1"), ("x.y", "2"), ("model", "dlrm")]


def test_a_failed_job_does_not_stop_the_sweep_and_the_parent_ends_failed_naming_it(tmp_path: Path, store_uri: str) -> None:
    """A job's config error (its exit 2) neither stops the jobs after it (KeepGoingLauncher) nor leaves the parent RUNNING
    (the multirun ends without ``on_multirun_end``). A fresh process, since the parent is ended at the process's exit."""
    uri = store_uri
    out = run_cli("-m", "optim.lr=-1,0.1", *TINY, "train.num_steps=5", "train.log_every_steps=5",
                  f"tracking.uri={uri}", "tracking.experiment=failed", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert lines[-2].startswith("Config error: optim.sparse.lr must be positive, got -1.0"), out.stderr[-3000:]
    assert lines[-1].startswith("Sweep failed (failed job(s): #0 optim.lr=-1); 1 of 1 child runs finished; "
                                "MLflow parent run "), lines[-1]
    parent, (child,) = _parent_and_children(uri, "failed")
    assert child.info.status == "FINISHED" and child.info.run_name == "lr=0.1"
    assert parent.info.status == "FAILED" and lines[-1].endswith(f"{parent.info.run_id} ended FAILED.")
    assert parent.data.tags["sweep.failed_jobs"] == "#0 optim.lr=-1"
    assert "1 of 2 jobs failed: #0 (exit 2)" in out.stdout
    assert parent.data.tags["best.run_id"] == child.info.run_id and parent.data.tags["sweep.num_finished"] == "1"
    table = MlflowClient(tracking_uri=uri).download_artifacts(parent.info.run_id, "sweep_summary.json", str(tmp_path))
    summary = json.loads(Path(table).read_text())
    assert [r["run_name"] for r in summary["runs"]] == ["lr=0.1"]


def test_optuna_direction_against_the_objective_is_refused_before_any_run(tmp_path: Path, store_uri: str) -> None:
    """The Optuna sweeper's default direction is minimize: with the default objective eval/auc it would search for the
    worst trials. Refused with one line before the parent run or any job exists."""
    uri = store_uri
    out = run_in_process([*TRAIN, "-m", "hydra/sweeper=optuna", "optim.lr=interval(0.01,0.1)", *TINY,
                          f"tracking.uri={uri}", "tracking.experiment=direction"], tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip() == (
        "Config error: hydra.sweeper.direction=minimize but the objective eval/auc (the jobs' default; train.objective is "
        "unset) is better higher: the search would chase its worst trials. Fix: hydra.sweeper.direction=maximize, or choose "
        "another train.objective")
    assert MlflowClient(tracking_uri=uri).get_experiment_by_name("direction") is None


def test_two_sweeps_started_in_the_same_second_get_folders_of_their_own(tmp_path: Path, store_uri: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hydra's default sweep folder is to the second: a second sweep started in the same second got the first one's, and
    its job 0 resumed the first sweep's finished job 0 from its checkpoint (another lr, the same result, not a word).
    Each sweep's folder is its own (``${new_dir:…}``): ``<time>`` and ``<time>_2``, each job trained from step 0."""
    import datetime as dt

    import hydra.core.utils

    class SameSecond(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> SameSecond:
            return cls(2030, 1, 2, 3, 4, 5)

    monkeypatch.setattr(hydra.core.utils, "datetime", SameSecond)  # what Hydra's ${now:…} reads
    uri = store_uri
    for lr in ("0.01", "0.1"):
        out = run_in_process([*TRAIN, "-m", f"optim.lr={lr}", *TINY, "train.num_steps=5", f"tracking.uri={uri}",
                              f"tracking.experiment=same_{lr}"], tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "multirun" / "2030-01-02").iterdir()) == ["03-04-05", "03-04-05_2"]
    (first, _), (second, (child,)) = (_parent_and_children(uri, f"same_{lr}") for lr in ("0.01", "0.1"))
    assert first.data.tags["sweep.dir"].endswith("/03-04-05") and second.data.tags["sweep.dir"].endswith("/03-04-05_2")
    assert child.data.params["optim.lr"] == "0.1" and "resumed" not in child.data.tags, child.data.tags
    assert child.data.tags["checkpoint_dir"] == f"{tmp_path}/multirun/2030-01-02/03-04-05_2/0/checkpoints"


def test_new_dir_claims_the_next_free_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from recsys_runner.paths import new_dir

    base = tmp_path / "multirun" / "12-00-00"
    assert new_dir(str(base)) == str(base) and base.is_dir()
    assert new_dir(str(base)) == f"{base}_2" and new_dir(str(base)) == f"{base}_3"
    monkeypatch.setenv("RANK", "1")  # a torchrun rank but 0: one launch with rank 0, whose run folder holds the checkpoints
    assert new_dir(str(base)) == str(base) and not Path(f"{base}_4").exists()
    monkeypatch.setenv("RANK", "0")
    assert new_dir(str(base)) == f"{base}_4"


def test_a_typo_in_a_swept_key_is_a_config_error_before_the_parent_run(tmp_path: Path, store_uri: str) -> None:
    """``-m optim.lrr=0.1,0.2`` was Hydra's error when it composed the first job, after the sweep's parent run was
    created: an empty FAILED parent. Now one line naming the key and the closest one, before anything is created."""
    uri = store_uri
    for swept, key, fix in (("optim.lrr=0.1,0.2", "optim.lrr", "optim.lr"), ("+train.num_step=3,4", "train.num_step", "train.num_steps")):
        out = run_in_process([*TRAIN, "-m", swept, *TINY, f"tracking.uri={uri}", "tracking.experiment=typo"], tmp_path)
        assert out.returncode == 2, out.stderr[-3000:]
        (line,) = out.stderr.strip().splitlines()
        # the command line's check (overrides.py, on the sweep's first value) or the sweep's (sweep.py), whichever sees it
        assert line.startswith("Config error: ") and key.rpartition(".")[2] in line and f"did you mean {fix}?" in line, line
    assert MlflowClient(tracking_uri=uri).get_experiment_by_name("typo") is None
    assert not (tmp_path / "multirun").exists()


@pytest.mark.parametrize(("sweep", "key", "fix", "option"), [
    (["model=deepfm,dlrm", "model.embedding_dimm=8,16"], "model.embedding_dimm", "model.embedding_dim", "model=deepfm"),
    (["model=deepfm,dlrm", "model.deep_layer_sizes=[8]"], "model.deep_layer_sizes", "model.dense_arch_layer_sizes", "model=dlrm"),
])
def test_a_key_an_option_of_a_swept_group_lacks_is_a_config_error_before_the_parent_run(
        tmp_path: Path, store_uri: str, sweep: list[str], key: str, fix: str, option: str) -> None:
    """A key under a swept group (a typo, or a key only some options have) was Hydra's error when it composed that
    option's first job, after the parent run existed (an empty FAILED parent). Each option's config is checked first."""
    uri = store_uri
    out = run_in_process([*TRAIN, "-m", *sweep, *TINY, f"tracking.uri={uri}", "tracking.experiment=group_typo"], tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = out.stderr.strip().splitlines()
    # the command line's check (overrides.py) sees the first option's typo; a key only another option lacks, the sweep's
    assert line.startswith("Config error: ") and key.rpartition(".")[2] in line and f"did you mean {fix}?" in line, line
    if option != "model=deepfm":
        assert f"for the sweep's jobs with {option}" in line and line.endswith("Nothing was started."), line
    assert MlflowClient(tracking_uri=uri).get_experiment_by_name("group_typo") is None
    assert not (tmp_path / "multirun").exists()


def test_swept_keys_that_exist_or_go_into_free_form_maps_pass(make_cfg) -> None:
    """What :func:`check_swept_keys` leaves alone: existing keys, a key added to a free-form map, config groups and the
    keys under a swept group (each job's option decides), Hydra's own keys."""
    from recsys_runner.config_keys import check_swept_keys

    config = make_cfg()
    OmegaConf.set_struct(config, False)
    config.hydra = {"runtime": {"choices": {"model": "deepfm", "optim": "adagrad"}}, "overrides": {"task": [
        "optim.lr=0.1,0.2", "+checkpoint.name_map.a=b,c", "model=deepfm,dlrm", "model.anything=1,2", "hydra.launcher.x=1,2",
        "train.num_stepz=5"]}}  # not swept: Hydra composed the multirun's config with it, or refused it first
    check_swept_keys(config)


@pytest.mark.slow
def test_submitit_local_waits_for_every_job_and_names_a_failed_one(tmp_path: Path, store_uri: str) -> None:
    """``submitit_local`` stopped at the first failed job with submitit's traceback, the parent left RUNNING. Now it waits
    for every job, names the failed one in a line (its own error), and ends the parent FAILED naming it (exit 1), as
    ``submitit_slurm`` does. The failed job left its error as its result, read at once: its exit (a ``SystemExit``) left
    none, and the launcher waited submitit's 15 s for one before it read the job's stderr; that stderr holds the job's
    line, no traceback."""
    uri = store_uri
    out = run_cli("-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5", "optim.lr=-1,0.1", *TINY,
                  "train.num_steps=5", f"tracking.uri={uri}", "tracking.experiment=local_failed", cwd=tmp_path, timeout=600)
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    error = ("Config error: optim.sparse.lr must be positive, got -1.0. Fix: e.g. optim.sparse.lr=0.01 where it is set, "
             "else optim.lr=0.01 (its default)")
    assert lines[-2] == f"Job #0 failed: {error}", lines[-3:]
    results = list((tmp_path / "multirun").glob("*/*/.submitit/*/*_result.pkl"))
    assert len(results) == 2 and [own_failure(r) for r in results].count(error) == 1, results
    (failed,) = [r for r in results if own_failure(r) == error]
    job_err = failed.with_name(failed.name.replace("_result.pkl", "_log.err")).read_text()
    assert error in job_err.splitlines() and "Traceback" not in job_err, job_err[-3000:]
    assert lines[-1].startswith("Sweep failed (failed job(s): #0 optim.lr=-1); 1 of 1 child runs finished"), lines[-1]
    assert "Traceback" not in out.stderr and "validated against ConfigStore schema" not in out.stderr
    parent, (child,) = _parent_and_children(uri, "local_failed")
    assert child.info.status == "FINISHED" and child.info.run_name == "lr=0.1"
    assert parent.info.status == "FAILED" and parent.data.tags["sweep.failed_jobs"] == "#0 optim.lr=-1"
    assert parent.data.tags["best.run_id"] == child.info.run_id


def test_a_sweep_jobs_crash_is_raised_again_in_its_process_its_own_failure_as_job_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job side of the plugin's submitit launchers (their ``__call__``, run in the job's process): Hydra's ``run_job``
    keeps a crash of the task as a ``FAILED`` return, which submitit would write as the job's success (exit 0, SLURM
    ``COMPLETED``); it is raised again, the error itself, so that submitit writes it as the job's error. A failure of the
    command's own (:class:`~recsys_runner.errors.Failed`) becomes a ``JobFailed`` with its status and message; a return
    that completed passes as it is."""
    from hydra.core.utils import JobReturn, JobStatus

    from hydra_plugins.recsys_runner_detached import DetachedSlurmLauncher, WaitingLocalLauncher
    from recsys_runner.errors import Failed
    from recsys_runner.tracking.sweep_jobs import JobFailed

    crash = RuntimeError("CUDA out of memory")
    outcomes: list[Any] = []

    def job(self: Any, *args: Any, **kwargs: Any) -> JobReturn:
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    for launcher in (object.__new__(WaitingLocalLauncher), object.__new__(DetachedSlurmLauncher)):
        # the plugin's base class as these launchers hold it: Hydra's plugin scan may have imported its module again since
        base = next(c for c in type(launcher).__mro__ if c.__name__ == "BaseSubmititLauncher")
        monkeypatch.setattr(base, "__call__", job)
        outcomes[:] = [JobReturn(status=JobStatus.FAILED, _return_value=crash)]
        with pytest.raises(RuntimeError) as raised:
            launcher([], "", 0, "1", {})
        assert raised.value is crash
        outcomes[:] = [Failed(2, "Config error: optim.sparse.lr must be positive")]
        with pytest.raises(JobFailed) as failed:
            launcher([], "", 0, "1", {})
        assert failed.value.code == 2 and str(failed.value) == "Config error: optim.sparse.lr must be positive"
        done = JobReturn(status=JobStatus.COMPLETED, _return_value=0.7)
        outcomes[:] = [done]
        assert launcher([], "", 0, "1", {}) is done


def test_detached_slurm_launcher_is_a_discoverable_hydra_plugin() -> None:
    """Hydra instantiates launchers only from scanned hydra_plugins modules (needs a wheel or a compat editable install)."""
    from hydra.core.plugins import Plugins
    from hydra.plugins.launcher import Launcher

    names = {f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Launcher)}
    assert "hydra_plugins.recsys_runner_detached.DetachedSlurmLauncher" in names


def test_detached_launcher_submits_without_waiting(tmp_path: Path) -> None:
    """Inside the plugin's own launch the executor's jobs answer results() with their id at once; the name is restored."""
    import submitit
    from hydra.core.utils import JobStatus

    from hydra_plugins.recsys_runner_detached import _results_are_job_ids

    library_executor, ran = submitit.AutoExecutor, []
    with _results_are_job_ids():
        executor = submitit.AutoExecutor(folder=tmp_path, cluster="debug")  # a debug job runs when its results are asked for
        jobs = executor.map_array(ran.append, [1, 2])
        (returned,) = jobs[1].results()
    assert submitit.AutoExecutor is library_executor
    assert returned.status == JobStatus.COMPLETED and returned.return_value == jobs[1].job_id
    assert ran == [], "nothing waited for the jobs, so none ran"
    (control,) = library_executor(folder=tmp_path, cluster="debug").map_array(ran.append, [1])
    control.results()
    assert ran == [1], "the library's own debug job does run when its results are asked for"


def test_sweep_objective_follows_train_objective_and_direction(tmp_path: Path, store_uri: str) -> None:
    from recsys_runner.metrics.registry import higher_is_better

    assert higher_is_better("eval/auc") and higher_is_better("eval/ctr/auc") and higher_is_better("eval/recall_at_10")
    assert not higher_is_better("eval/logloss") and not higher_is_better("eval/cvr/logloss") and not higher_is_better("eval/mse")
    uri = store_uri
    out = run_in_process([*TRAIN, "-m", "optim.lr=0.001,0.1", *TINY, "train.num_steps=10", "train.objective=eval/logloss",
                          f"tracking.uri={uri}", "tracking.experiment=obj"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    parent, children = _parent_and_children(uri, "obj")
    best = min(children, key=lambda r: r.data.metrics["eval/logloss"])
    assert parent.data.tags["sweep.objective"] == "eval/logloss"
    assert parent.data.tags["best.run_id"] == best.info.run_id
    assert parent.data.metrics["best/eval/logloss"] == pytest.approx(best.data.metrics["eval/logloss"])


REGRESSION = ["model=mmoe", "model.tasks=[watch]", "model.task_kinds=[regression]"]
"""A model whose one task is a regression: it logs eval/watch/mse and eval/watch/mae, no eval/auc."""


def test_check_direction_follows_the_objective_the_jobs_report() -> None:
    """The direction is checked against the objective given (a regression model's default, eval/<task>/mse), not against
    eval/auc, which such jobs never log."""
    maximize = OmegaConf.create({"hydra": {"sweeper": {"direction": "maximize"}}, "train": {"objective": None}})
    with pytest.raises(ConfigError, match=r"hydra.sweeper.direction=maximize but the objective eval/watch/mse \(the jobs' "
                                          r"default; train.objective is unset\) is better lower.*Fix: hydra.sweeper.direction=minimize"):
        check_direction(maximize, "eval/watch/mse")
    check_direction(maximize, "eval/hr_at_10")
    check_direction(OmegaConf.create({"hydra": {"sweeper": {"direction": "minimize"}}}), "eval/watch/mse")


def test_optuna_direction_is_checked_against_a_regression_models_default_objective(tmp_path: Path, store_uri: str) -> None:
    """Without train.objective, a regression model's jobs report eval/watch/mse: maximizing it is refused before any job,
    and Optuna's default (minimize) is what it wants."""
    uri = store_uri
    out = run_in_process([*TRAIN, "-m", "hydra/sweeper=optuna", "hydra.sweeper.direction=maximize", "optim.lr=interval(0.01,0.1)",
                          *REGRESSION, *TINY, f"tracking.uri={uri}", "tracking.experiment=regression_direction"], tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().startswith("Config error: hydra.sweeper.direction=maximize but the objective eval/watch/mse (the "
                                         "jobs' default; train.objective is unset) is better lower"), out.stderr[-3000:]
    assert MlflowClient(tracking_uri=uri).get_experiment_by_name("regression_direction") is None


def test_the_first_job_takes_each_swept_config_group_at_its_first_option() -> None:
    """What the parent composes to resolve the jobs' default objective: a swept hyperparameter keeps the config's value
    (a job refusing its value fails alone), a swept group (which may change the eval keys) its first option."""
    config = OmegaConf.create({"hydra": {"runtime": {"choices": {"model": "deepfm", "optim": "adam"}},
                                         "sweeper": {"params": {"model": "choice(sasrec, dssm)", "optim.lr": "interval(0.01, 0.1)"}},
                                         "overrides": {"task": ["optim=adagrad,adam", "data.batch_size=64", "optim.lr=-1,0.1",
                                                                "train.num_steps=range(2,5)"]}}})
    assert first_job_overrides(config) == ["model=sasrec", "optim=adagrad", "data.batch_size=64"]


@pytest.mark.parametrize(("sweep", "objective", "best"), [
    (["optim.lr=0.01,0.1", *REGRESSION], "eval/watch/mse", min),
    (["model=mmoe,ple"], "eval/ctr/auc", max),  # a swept group: its first option's tasks (ctr, cvr), not the base model's
    (["optim.lr=0.01,0.1", "model=dssm"], "eval/inbatch_recall_at_1", max),  # dssm's eval_metrics: inbatch_recall@1, @10, @50
])
def test_sweep_without_objective_ranks_by_the_jobs_default(tmp_path: Path, store_uri: str, sweep: list[str], objective: str,
                                                          best: Any) -> None:
    """A regression, a multi-task or a retrieval model's sweep without train.objective: the parent records the objective
    its jobs report and finds their best trial under it (eval/auc, which they never log, found none)."""
    uri = store_uri
    out = run_in_process([*TRAIN, "-m", *sweep, *TINY, "train.num_steps=4", "data.num_eval_rows=1024", f"tracking.uri={uri}",
                          "tracking.experiment=default_objective"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    parent, children = _parent_and_children(uri, "default_objective")
    assert len(children) == 2 and all(objective in r.data.metrics for r in children)
    assert parent.data.tags["sweep.objective"] == objective
    winner = best(children, key=lambda r: r.data.metrics[objective])
    assert parent.data.tags["best.run_id"] == winner.info.run_id
    assert parent.data.metrics[f"best/{objective}"] == pytest.approx(winner.data.metrics[objective])


def test_a_sweep_whose_jobs_default_to_different_objectives_must_name_train_objective(tmp_path: Path, store_uri: str) -> None:
    """model=deepfm,dssm without train.objective: deepfm's jobs would report eval/auc, dssm's eval/inbatch_recall_at_1,
    and the parent ranked both by the first. Refused before any run, naming each job's default."""
    uri = store_uri
    out = run_in_process([*TRAIN, "-m", "model=deepfm,dssm", *TINY, f"tracking.uri={uri}", "tracking.experiment=mixed"], tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("Config error: the sweep's jobs would report different objectives (train.objective is unset, so "
                           "each takes its model's default: model=deepfm -> eval/auc; model=dssm -> eval/inbatch_recall_at_1)"), line
    assert "Fix: set train.objective" in line, line
    assert MlflowClient(tracking_uri=uri).get_experiment_by_name("mixed") is None
