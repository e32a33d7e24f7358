"""Decaying train metrics survive a resume: a run stopped halfway and resumed logs exactly the train
metrics of the uninterrupted run (their windows, decayed values and AUC histories are checkpointed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from recsys_runner.__main__ import run
from recsys_runner.metrics.registry import MetricsConfig
from recsys_runner.metrics.tasks import TaskTrainMetrics, _task_outputs
from recsys_runner.tasks import SINGLE_TASK, BinaryTask
from recsys_runner.train.signals import Interrupted

# Windows of 4 updates: the stop at step 6 falls mid-window (2 updates into the second), after one
# window closed, so the saved state holds a decayed value, an AUC history and a partial window.
# Every decaying kind: DecayAUC's binned history, and windowed sums for the others.
SETTING = ["train.num_steps=12", "train.log_every_steps=1", "metrics.decay_step=4", "metrics.decay_rate=0.5",
           "metrics.train=[auc,logloss,accuracy,ne,calibration]", "optim=adagrad", "optim.lr=0.05"]
TRAIN_KEYS = ["train/auc", "train/logloss", "train/accuracy", "train/ne", "train/calibration"]


def histories(uri: str, experiment: str, keys: list[str]) -> dict[str, dict[int, float]]:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    (mlrun,) = client.search_runs([exp.experiment_id])
    return {key: {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, key)} for key in keys}


def test_resumed_train_metrics_match_the_uninterrupted_run(make_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    run(make_cfg(*SETTING, f"checkpoint.dir={tmp_path}/a", "tracking.experiment=train_metrics_straight"))
    second = [*SETTING, f"checkpoint.dir={tmp_path}/b", "tracking.experiment=train_metrics_sliced"]
    with pytest.raises(Interrupted, match="after step 6"):
        run(make_cfg(*second, "train.stop_after_steps=6"))
    run(make_cfg(*second))  # resumes at step 6 and finishes 7..12 into the same MLflow run
    expected = histories(mlflow_uri, "train_metrics_straight", [*TRAIN_KEYS, "train/loss"])
    resumed = histories(mlflow_uri, "train_metrics_sliced", [*TRAIN_KEYS, "train/loss"])
    for key in ["train/loss", *TRAIN_KEYS]:
        assert sorted(resumed[key]) == list(range(1, 13)), key
        for step in range(1, 13):
            assert resumed[key][step] == pytest.approx(expected[key][step], rel=1e-6, abs=1e-9), (
                f"{key} at step {step}: resumed {resumed[key][step]} vs uninterrupted {expected[key][step]}")
    # The windows really decayed: the compared values are not all one number.
    assert len({round(v, 9) for v in expected["train/auc"].values()}) > 3


def feed(metrics: TaskTrainMetrics, steps: range, rows: int = 64) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        labels = (torch.rand(rows, 2, generator=g) < 0.3).float()
        logits = torch.randn(rows, 2, generator=g) + 2 * labels
        metrics.update(logits, labels)


TWO_TASKS = (BinaryTask("ctr", column=0), BinaryTask("cvr", column=1))
SPEC = MetricsConfig(train=["auc", "logloss", "xauc"], decay_step=3, decay_rate=0.7)


def test_state_round_trips_through_a_checkpoint_file(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    straight = TaskTrainMetrics(SPEC, TWO_TASKS, cpu)
    feed(straight, range(10))
    first = TaskTrainMetrics(SPEC, TWO_TASKS, cpu)
    feed(first, range(5))
    torch.save(first.state_dict(), tmp_path / "rank0.pt")
    second = TaskTrainMetrics(SPEC, TWO_TASKS, cpu)
    second.load_state_dict(torch.load(tmp_path / "rank0.pt", weights_only=False))
    feed(second, range(5, 10))
    assert second.compute() == pytest.approx(straight.compute(), rel=1e-12)
    assert set(straight.compute()) == {f"train/{t}/{m}" for t in ("ctr", "cvr") for m in ("auc", "logloss", "xauc")}


def test_metrics_added_or_dropped_between_runs_start_fresh_or_are_ignored() -> None:
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, generator=g), (torch.rand(32, generator=g) < 0.4).float()) for _ in range(4)]
    saved = TaskTrainMetrics(MetricsConfig(train=["auc", "accuracy"], decay_step=2), SINGLE_TASK, cpu)
    for logits, labels in batches[:3]:
        saved.update(logits, labels)
    resumed = TaskTrainMetrics(MetricsConfig(train=["auc", "logloss"], decay_step=2), SINGLE_TASK, cpu)
    resumed.load_state_dict(saved.state_dict())
    fresh = TaskTrainMetrics(MetricsConfig(train=["logloss"], decay_step=2), SINGLE_TASK, cpu)
    for metrics in (saved, resumed, fresh):
        metrics.update(*batches[3])
    values = resumed.compute()
    assert values["train/auc"] == pytest.approx(saved.compute()["train/auc"], rel=1e-12)  # continued: 2 windows
    assert values["train/logloss"] == pytest.approx(fresh.compute()["train/logloss"], rel=1e-12)  # added: fresh
    assert "train/accuracy" not in values


ALL_TRAIN = ["auc", "logloss", "accuracy", "ne", "calibration", "mae", "mse", "xauc"]


@pytest.mark.parametrize("flush_every", [1, 2, 3, 5, 100])
def test_kept_micro_batches_give_exactly_the_per_step_values(flush_every: int) -> None:
    """TaskTrainMetrics keeps each micro-batch's outputs and feeds them to the metrics later, a window's worth at
    once where that is exact: the values read at any step equal those of metrics updated on every micro-batch."""
    cpu = torch.device("cpu")
    spec = MetricsConfig(train=ALL_TRAIN, decay_step=3, decay_rate=0.7)
    deferred = TaskTrainMetrics(spec, TWO_TASKS, cpu, flush_every=flush_every)
    reference = TaskTrainMetrics(spec, TWO_TASKS, cpu)
    for step in range(14):
        g = torch.Generator().manual_seed(step)
        rows = 37 + 5 * step  # batch sizes differ (a last partial batch)
        labels = (torch.rand(rows, 2, generator=g) < 0.3).float()
        logits = torch.randn(rows, 2, generator=g) + 2 * labels
        deferred.update(logits, labels)
        for view, metrics in reference._active:  # the per-step path: every metric updated right away
            for metric in metrics.metrics.values():
                metric.update(*_task_outputs(view, logits, labels))
        if step % 4 == 1:  # read at a log step, mid-window or not
            assert deferred.compute() == reference.compute()
    assert deferred.compute() == reference.compute()
    saved = deferred.state_dict()["metrics"]
    for key, state in reference.state_dict()["metrics"].items():
        assert saved[key]["num_updates"] == state["num_updates"]
        for name, value in state["metric"].items():
            mine = saved[key]["metric"][name]
            assert all(torch.equal(a, b) for a, b in zip(mine, value, strict=True)) if isinstance(value, list) else torch.equal(mine, value)
