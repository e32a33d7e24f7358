"""Real training on CPU: each model learns, and the MLflow run records everything it should."""

from __future__ import annotations

import re

import pytest
from mlflow.tracking import MlflowClient

from recsys_runner.__main__ import run
from tests.test_interaction_models import TINY_SIZES


def finished_runs(uri: str, experiment: str) -> list:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r}"
    return client.search_runs([exp.experiment_id])


def experiment_of(cfg) -> str:
    return cfg.tracking.experiment


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=deepfm", "optim=adagrad"],
        ["model=dlrm", "optim=rowwise_adagrad"],
        ["model=deepfm", "optim/sparse=rowwise_adagrad", "optim/dense=adam", "optim.lr=0.01", "precision=bf16"],
        ["model=deepfm", "optim=sgd", "optim.lr=0.5", "scheduler=exponential_decay", "scheduler.warmup_steps=5", "scheduler.decay_steps=20"],
        ["model=deepfm", "distributed.pipeline=sparse_dist", "train.eval_every_steps=20", "scheduler=cosine", "scheduler.warmup_steps=5",
         "train.num_steps=60"],  # cosine spends half the run below half the lr
        ["model=dcn_v2", "optim=adagrad"],
        ["model=dcn_v2", "model.structure=parallel", "model.low_rank=null", "optim=rowwise_adagrad"],
        ["model=wide_deep", "optim=adagrad"],
        ["model=dcn_v2", "model.num_experts=4", "model.low_rank=16", "model.embedding_dim=8", "model.deep_layer_sizes=[64]", "optim=adagrad"],
        # the interaction models of issue 32 at test sizes; Adam on their dense parts (Adagrad's first steps move xDeepFM's
        # linear term by 4·lr per id, see LinearArch, and its loss is back up by step 30)
        *([f"model={name}", *TINY_SIZES[name], "optim/dense=adam", "optim.lr=0.01"] for name in sorted(TINY_SIZES)),
    ],
    ids=["deepfm-adagrad", "dlrm-rowwise", "deepfm-adam-bf16", "deepfm-sgd-expdecay", "deepfm-sparsedist-cosine",
         "dcn_v2-adagrad", "dcn_v2-parallel-fullrank-rowwise", "wide_deep-adagrad", "dcn_v2-mix-adagrad",
         *(f"{name}-adam" for name in sorted(TINY_SIZES))],
)
def test_model_trains_loss_falls_and_auc_beats_chance(make_cfg, mlflow_uri: str, overrides: list[str]) -> None:
    cfg = make_cfg(*overrides)
    auc = run(cfg)
    assert auc > 0.6, f"eval AUC {auc:.3f} after {cfg.train.num_steps} steps; the model did not learn"
    (mlrun,) = finished_runs(mlflow_uri, experiment_of(cfg))
    client = MlflowClient(tracking_uri=mlflow_uri)
    losses = [m.value for m in sorted(client.get_metric_history(mlrun.info.run_id, "train/loss"), key=lambda m: m.step)]
    assert len(losses) == cfg.train.num_steps // 10, losses  # steps 10, 20, 30 (…)
    assert losses[-1] < losses[0], f"train loss did not fall: {losses}"
    assert mlrun.data.metrics["eval/auc"] == pytest.approx(auc)


def test_mlflow_run_contents(make_cfg, mlflow_uri: str) -> None:
    cfg = make_cfg("model=dlrm", "optim.lr=0.07", "train.eval_every_steps=20", "scheduler=exponential_decay",
                   "scheduler.warmup_steps=10", "scheduler.decay_steps=10")
    run(cfg)
    (mlrun,) = finished_runs(mlflow_uri, experiment_of(cfg))
    client = MlflowClient(tracking_uri=mlflow_uri)
    run_id = mlrun.info.run_id
    assert mlrun.info.status == "FINISHED"

    params = mlrun.data.params
    assert params["model._target_"] == "recsys_runner.models.dlrm.DLRM"
    assert float(params["optim.sparse.lr"]) == 0.07 and float(params["optim.dense.lr"]) == 0.07
    assert params["train.num_steps"] == "30"
    assert params["data.batch_size"] == "256"

    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    assert set(history("train/loss")) == {10, 20, 30}
    assert all(v > 0 for v in history("train/samples_per_s").values())
    lr_sparse, lr_dense = history("lr/sparse"), history("lr/dense")
    assert set(lr_sparse) == {10, 20, 30}
    # warmup over 10 steps, then 0.5 ** ((t - 10) / 10); step 30 trains at t = 29 → 0.07 * 0.5 ** 1.9.
    assert lr_sparse[30] == pytest.approx(0.07 * 0.5 ** (19 / 10)) and lr_dense[30] == pytest.approx(lr_sparse[30])
    assert set(history("eval/auc")) == {20, 30} and set(history("eval/logloss")) == {20, 30}

    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "sharding_plan.txt"} <= artifacts
    config_text = client.download_artifacts(run_id, "config.yaml")
    assert "recsys_runner.models.dlrm.DLRM" in open(config_text).read()
    plan_text = open(client.download_artifacts(run_id, "sharding_plan.txt")).read()
    # Rows "param | sharding type | compute kernel | ranks": every table, table-wise on the one rank (on one rank the
    # planner may choose only table_wise or data_parallel, and at this size it picks table_wise).
    planned = dict(re.findall(r"^(t_cat_\d+)\s*\|\s*(\w+)\s*\|\s*\w+\s*\|\s*\[0\]", plan_text, re.MULTILINE))
    assert planned == {f"t_cat_{i}": "table_wise" for i in range(26)}, plan_text


def test_epochs_mode_runs_whole_epochs(make_cfg, mlflow_uri: str) -> None:
    # 32768 rows / 256 per batch = 128 batches per epoch; 2 epochs = 256 steps.
    cfg = make_cfg("train.num_steps=null", "train.num_epochs=2", "train.log_every_steps=64", "data.num_train_rows=32768")
    run(cfg)
    (mlrun,) = finished_runs(mlflow_uri, experiment_of(cfg))
    epochs = {m.step: m.value for m in MlflowClient(tracking_uri=mlflow_uri).get_metric_history(mlrun.info.run_id, "train/epoch")}
    assert max(epochs) == 256
    assert epochs[128] == 0 and epochs[192] == 1 and epochs[256] == 1


def test_configured_metrics_are_logged(make_cfg, mlflow_uri: str) -> None:
    cfg = make_cfg("metrics.eval=[auc,gauc,logloss,calibration]", "metrics.grouping_key=cat_0",
                   "metrics.train=[auc,logloss]", "metrics.decay_step=5")
    run(cfg)
    (mlrun,) = finished_runs(mlflow_uri, experiment_of(cfg))
    logged = mlrun.data.metrics
    assert {"eval/auc", "eval/gauc", "eval/logloss", "eval/calibration", "train/auc", "train/logloss"} <= set(logged)
    assert 0.5 < logged["eval/gauc"] <= 1.0 and 0.5 < logged["train/auc"] <= 1.0
    history = MlflowClient(tracking_uri=mlflow_uri).get_metric_history(mlrun.info.run_id, "train/auc")
    assert sorted(m.step for m in history) == [10, 20, 30]
