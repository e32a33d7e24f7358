"""Task kinds as objects (``recsys_runner.tasks``): each owns its loss, targets, metric inputs and default metrics."""

from __future__ import annotations

import pytest
import torch

from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.errors import ConfigError
from recsys_runner.metrics.registry import MetricsConfig
from recsys_runner.metrics.tasks import check_task_metrics, eval_metric_keys
from recsys_runner.tasks import SINGLE_TASK, TASK_KINDS, BinaryTask, InBatchSoftmaxTask, RegressionTask, task_kind


def test_each_kind_owns_its_loss_targets_and_metric_inputs() -> None:
    logits, labels = torch.tensor([0.0, 2.0]), torch.tensor([[1.0, 0.5], [0.0, -1.0]])
    binary, regression = BinaryTask("ctr", column=0), RegressionTask("watch", column=1)
    assert torch.equal(binary.targets(logits, labels), labels[:, 0])
    assert float(binary.loss(logits, labels[:, 0])) == pytest.approx(float(torch.log1p(torch.exp(torch.tensor(-0.0))) + torch.log1p(torch.exp(torch.tensor(2.0)))) / 2)
    assert torch.equal(binary.metric_inputs(logits, labels[:, 0])[0], torch.sigmoid(logits))
    assert float(regression.loss(logits, labels[:, 1])) == pytest.approx(((0.0 - 0.5) ** 2 + (2.0 + 1.0) ** 2) / 2)
    assert torch.equal(regression.metric_inputs(logits, labels[:, 1])[0], logits)
    scores = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    retrieval = InBatchSoftmaxTask()
    positives = retrieval.targets(scores, labels)
    assert positives.tolist() == [0, 1]
    assert float(retrieval.loss(scores, positives)) == pytest.approx(float(torch.nn.functional.cross_entropy(scores, positives)))


def test_default_metrics_come_from_the_kind_unless_the_task_sets_its_own() -> None:
    spec = MetricsConfig(eval=["auc", "logloss"], train=["auc"])
    assert SINGLE_TASK == (BinaryTask(),)
    assert BinaryTask().eval_metric_names(spec.eval) == ["auc", "logloss"] and BinaryTask().train_metric_names(spec.train) == ["auc"]
    assert RegressionTask("w").eval_metric_names(spec.eval) == ["mse", "mae"] and RegressionTask("w").train_metric_names(spec.train) == ["mse"]
    assert InBatchSoftmaxTask().eval_metric_names(spec.eval) == ["inbatch_recall@10"] and InBatchSoftmaxTask().train_metric_names(spec.train) == []
    assert InBatchSoftmaxTask(eval_metrics=("recall@5",)).eval_metric_names(spec.eval) == ["recall@5"]
    keys = eval_metric_keys(spec, (BinaryTask("ctr", column=0), RegressionTask("watch", column=1)))
    assert keys == ["eval/ctr/auc", "eval/ctr/logloss", "eval/watch/mse", "eval/watch/mae"]


def test_kind_names_are_read_in_one_registry() -> None:
    assert {name: cls.__name__ for name, cls in TASK_KINDS.items()} == {
        "binary": "BinaryTask", "regression": "RegressionTask", "huber": "HuberTask", "multiclass": "MulticlassTask",
        "retrieval": "InBatchSoftmaxTask", "next_item": "NextItemTask"}
    assert task_kind("regression", "model.task_kinds") is RegressionTask
    with pytest.raises(ConfigError, match=r"model.task_kinds has \['ordinal'\]; each must be one of \['binary', 'regression', 'huber', 'multiclass'\]"):
        task_kind("ordinal", "model.task_kinds")


def test_a_tasks_eval_metrics_must_read_what_it_produces(make_cfg) -> None:
    with pytest.raises(ConfigError, match=r"metrics.eval lists 'recall@10'; DeepFM's eval is pointwise, so only accuracy, auc, "):
        check_task_metrics(MetricsConfig(eval=["recall@10"]), SINGLE_TASK, "DeepFM")
    # the default metrics.eval (pointwise) is not checked against a task with its own metrics; a changed one is refused
    # there, as it would change nothing (tests/test_config_strict.py, "eval-metrics-no-task-reads")
    check_task_metrics(MetricsConfig(), (InBatchSoftmaxTask(eval_metrics=("recall@1",)),), "DSSM")
    cfg = make_cfg("model=deepfm", "metrics.eval=[recall@10]", "tracking=none")
    with pytest.raises(ConfigError, match=r"metrics.eval lists 'recall@10'; DeepFM's eval is pointwise"):
        build(validate(cfg)).close()
