"""Multi-task (MMoE) and retrieval (DSSM) training on synthetic data, per-task MLflow keys, and the
task abstraction's losses and config errors."""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from torchrec.datasets.utils import Batch

from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.generated.synthetic import SyntheticData
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.errors import ConfigError
from recsys_runner.models.train_wrapper import TrainWrapper
from recsys_runner.tasks import BinaryTask, RegressionTask
from recsys_runner.train.loop import train
from tests.conftest import FixedHeads


def train_logged(cfg: DictConfig) -> dict[str, float]:
    """Build and train as ``python -m recsys_runner`` does, with an MLflow run; the final eval metrics."""
    c = build(validate(cfg))
    try:
        c.loop.tracker.start(run_name="test", tags={}, params={})
        final = train(c.loop)
        c.loop.tracker.finish("FINISHED")
    finally:
        c.close()
    return final


def logged_metrics(uri: str, experiment: str) -> tuple[MlflowClient, str, dict[str, float]]:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    (mlrun,) = client.search_runs([exp.experiment_id])
    return client, mlrun.info.run_id, mlrun.data.metrics


def test_mmoe_learns_every_task_and_logs_per_task_keys(make_cfg, mlflow_uri: str) -> None:
    cfg = make_cfg("model=mmoe", "data=synthetic_multitask", "optim=adagrad", "optim.lr=0.05", "metrics.train=[auc,logloss]",
                   "metrics.decay_step=5", "model.loss_weights=[1.0,2.0]")
    final = train_logged(cfg)
    assert final["eval/ctr/auc"] > 0.6 and final["eval/cvr/auc"] > 0.6, final
    client, run_id, logged = logged_metrics(mlflow_uri, cfg.tracking.experiment)
    assert {"eval/ctr/auc", "eval/ctr/logloss", "eval/cvr/auc", "eval/cvr/logloss",
            "train/ctr/auc", "train/cvr/auc", "train/ctr/logloss", "train/cvr/logloss"} <= set(logged)
    assert "eval/auc" not in logged and "train/auc" not in logged
    assert logged["eval/cvr/auc"] == pytest.approx(final["eval/cvr/auc"])
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/cvr/auc")) == [10, 20, 30]


def test_dssm_recall_far_above_random_candidates(make_cfg, mlflow_uri: str) -> None:
    cfg = make_cfg("model=dssm", "data=synthetic_retrieval", "optim=adagrad", "optim.lr=0.1", "model.logq_correction=false",
                   "model.eval_metrics=[inbatch_recall@10,inbatch_recall@50]")
    final = train_logged(cfg)
    random_rate = 10 / 256  # the positive among 256 in-batch candidates, ranked at random
    assert final["eval/inbatch_recall_at_10"] > 3 * random_rate, final
    assert final["eval/inbatch_recall_at_50"] > final["eval/inbatch_recall_at_10"]
    _, _, logged = logged_metrics(mlflow_uri, cfg.tracking.experiment)
    assert {"eval/inbatch_recall_at_10", "eval/inbatch_recall_at_50", "train/loss"} <= set(logged)
    assert not any(k.startswith("train/auc") for k in logged)


def test_train_wrapper_weights_bce_and_mse_per_task() -> None:
    ctr, reg = torch.tensor([0.0, 2.0]), torch.tensor([1.5, -1.0])
    labels = torch.tensor([[9.0, 1.0, 0.5], [9.0, 0.0, -1.0]])  # column 0 belongs to no task
    tasks = (BinaryTask("ctr", column=1, weight=2.0), RegressionTask("watch", column=2, weight=0.5))
    wrapper = TrainWrapper(FixedHeads(tasks, {"ctr": ctr, "watch": reg}))
    loss, (_, logits, targets) = wrapper(Batch(dense_features=torch.zeros(2, 1), sparse_features=None, labels=labels))  # type: ignore[arg-type]
    bce = (torch.log1p(torch.exp(-torch.tensor(0.0))) + torch.log1p(torch.exp(torch.tensor(2.0)))) / 2
    mse = ((1.5 - 0.5) ** 2 + 0.0) / 2
    assert float(loss) == pytest.approx(2.0 * float(bce) + 0.5 * mse, rel=1e-6)
    assert torch.equal(logits, torch.stack([ctr, reg], 1)) and torch.equal(targets, labels[:, 1:])


def test_synthetic_multitask_labels_follow_the_funnel() -> None:
    data = SyntheticData(make(SyntheticDataConfig, batch_size=4096, num_dense=3, num_sparse=4, num_embeddings=100, tasks=["ctr", "cvr"]))
    labels = data.batch(0, 0).labels
    assert labels.shape == (4096, 2) and data.features.label_names == ("ctr", "cvr")
    assert bool((labels[:, 1] <= labels[:, 0]).all()), "a conversion without a click"
    assert 0.1 < float(labels[:, 0].mean()) < 0.5 and 0.02 < float(labels[:, 1].mean()) < float(labels[:, 0].mean())
    assert torch.equal(labels, data.batch(0, 0).labels)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=mmoe", "model.tasks=[ctr,ltv]"],
         r"model.tasks=\['ctr', 'ltv'\]: task\(s\) \['ltv'\] have no label column; the data's label\(s\): \['ctr', 'cvr'\]"),
        (["model=mmoe", "model.loss_weights=[1.0]"], r"model.loss_weights=\[1.0\] has 1 entries but model.tasks=\['ctr', 'cvr'\] has 2"),
        (["model=mmoe", "model.task_kinds=[binary,ordinal]"], r"model.task_kinds has \['ordinal'\]; each must be one of"),
        (["model=mmoe", "data=synthetic", "data.tasks=[click]"],
         r"task\(s\) \['ctr', 'cvr'\] have no label column; the data's label\(s\): \['click'\]"),
        (["model=deepfm"], r"DeepFM has one output but the data has labels \['ctr', 'cvr'\]. Fix: a multi-task model"),
        (["model=dssm", "model.user_features=[user_id]"],
         r"model.user_features has \['user_id'\], which the data does not have. Valid feature names: cat_0, cat_1, .*int_0"),
        (["model=dssm", "model.item_features=[cat_0]"], r"features \['cat_0'\] are in both model.user_features and model.item_features"),
        (["model=dssm", "model.eval_metrics=[auc]"], r"DSSM's eval is retrieval, so only mrr, .*inbatch_recall@<k>.* apply"),
        (["model=mmoe", "model.expert_layer_sizes=[]"], "model.expert_layer_sizes must list at least one layer size"),
    ],
)
def test_bad_task_configs_say_what_to_fix(make_cfg, overrides: list[str], message: str) -> None:
    data = [] if any(o.startswith("data=") for o in overrides) else ["data=synthetic_multitask"]
    cfg = make_cfg(*data, *overrides, "tracking=none")
    with pytest.raises(ConfigError, match=message):
        build(validate(cfg)).close()


def test_cli_entry_returns_the_task_objective(make_cfg, mlflow_uri: str) -> None:
    from recsys_runner.__main__ import objective, run

    assert objective({"eval/ctr/auc": 0.7, "eval/cvr/auc": 0.6}, None) == 0.7
    assert objective({"eval/auc": 0.6, "eval/logloss": 0.5}, None) == 0.6
    with pytest.raises(ConfigError, match=r"train.objective='eval/auc' is not among this model's eval metrics"):
        objective({"eval/ctr/auc": 0.7}, "eval/auc")
    cfg = make_cfg("model=mmoe", "data=synthetic_multitask", "train.objective=eval/cvr/auc")
    value = run(cfg)
    _, _, logged = logged_metrics(mlflow_uri, cfg.tracking.experiment)
    assert logged["eval/cvr/auc"] != pytest.approx(logged["eval/ctr/auc"], abs=1e-3), logged  # the check tells them apart
    assert value == pytest.approx(logged["eval/cvr/auc"], rel=1e-9), (value, logged)
