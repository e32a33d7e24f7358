"""Multiruns as MLflow parent + children: a grid, an Optuna search, and the submitit_local launcher. The Optuna search
and the launcher run as commands; the grid ones run in this process as ``python -m`` would run them
(:func:`tests.conftest.run_in_process`: the same multirun, its jobs and callbacks, without ~10 s of imports)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from recsys_runner.tracking.sweep import SWEEP_PARENT_TAG, _override_pairs
from tests.conftest import REPO, TINY, run_cli, run_in_process

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


def test_optuna_sweep_logs_parent_with_best_trial(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/optuna.db"
    out = run_cli("-m", "--config-dir", str(REPO / "sweeps"), "--config-name", "optuna_lr", *TINY, "train.num_steps=10",
                  "hydra.sweeper.n_trials=3", f"tracking.uri={uri}", cwd=tmp_path, timeout=600)
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
    # Optuna saw the same objective: its best value is the best child's AUC.
    (results,) = (tmp_path / "multirun").glob("*/*/optimization_results.yaml")
    assert f"{best.data.metrics['eval/auc']:.6f}"[:6] in results.read_text()


def test_grid_multirun_is_one_parent_with_children(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/grid.db"
    out = run_in_process([*TRAIN, "-m", "optim.lr=0.01,0.1", *TINY, "train.num_steps=10", f"tracking.uri={uri}",
                          "tracking.experiment=grid"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    parent, children = _parent_and_children(uri, "grid")
    assert len(children) == 2 and parent.info.status == "FINISHED"
    assert parent.data.params["best.optim.lr"] in {"0.01", "0.1"}


def test_single_run_has_no_parent(make_cfg, mlflow_uri: str) -> None:
    from recsys_runner.__main__ import run

    run(make_cfg("train.num_steps=5"))
    client = MlflowClient(tracking_uri=mlflow_uri)
    (r,) = client.search_runs([client.get_experiment_by_name("test_single_run_has_no_parent").experiment_id])
    assert "mlflow.parentRunId" not in r.data.tags


def test_override_pairs() -> None:
    assert _override_pairs("optim.lr=0.1 +x.y=2 model=dlrm bare") == [("optim.lr", "0.1"), ("x.y", "2"), ("model", "dlrm")]


@pytest.mark.slow
def test_submitit_local_jobs_are_children(tmp_path: Path) -> None:
    """Jobs in submitit subprocesses find the parent run (env var survives pickling and the subprocess)."""
    uri = f"sqlite:///{tmp_path}/local.db"
    out = run_cli("-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5", "optim.lr=0.01,0.1", *TINY,
                  "train.num_steps=10", f"tracking.uri={uri}", "tracking.experiment=local", cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    parent, children = _parent_and_children(uri, "local")
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children)
    assert parent.info.status == "FINISHED" and "best/eval/auc" in parent.data.metrics
    assert list((tmp_path / "multirun").glob("*/*/.submitit/*/*_result.pkl"))


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


def test_sweep_objective_follows_train_objective_and_direction(tmp_path: Path) -> None:
    from recsys_runner.metrics.registry import higher_is_better

    assert higher_is_better("eval/auc") and higher_is_better("eval/ctr/auc") and higher_is_better("eval/recall_at_10")
    assert not higher_is_better("eval/logloss") and not higher_is_better("eval/cvr/logloss") and not higher_is_better("eval/mse")
    uri = f"sqlite:///{tmp_path}/obj.db"
    out = run_in_process([*TRAIN, "-m", "optim.lr=0.001,0.1", *TINY, "train.num_steps=10", "train.objective=eval/logloss",
                          f"tracking.uri={uri}", "tracking.experiment=obj"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    parent, children = _parent_and_children(uri, "obj")
    best = min(children, key=lambda r: r.data.metrics["eval/logloss"])
    assert parent.data.tags["sweep.objective"] == "eval/logloss"
    assert parent.data.tags["best.run_id"] == best.info.run_id
    assert parent.data.metrics["best/eval/logloss"] == pytest.approx(best.data.metrics["eval/logloss"])
