"""Training summaries (``train.summary_every_steps``): in MLflow and in a TensorBoard event file, and their numbers."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata

from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.distributed.env import DistEnv
from recsys_runner.errors import ConfigError
from recsys_runner.tracking.tracker import NullTracker
from recsys_runner.train.summaries import _local_row_norms, histogram
from tests.conftest import TINY, run_in_process


def test_summaries_reach_mlflow_and_a_tensorboard_event_file(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    done = run_in_process([sys.executable, "-m", "recsys_runner", *TINY, "train.num_steps=20", "train.summary_every_steps=5",  # as -m runs it
                           "train.summary_histograms=true", "tracking.tensorboard=true", f"tracking.uri={uri}",
                           "tracking.experiment=summaries", "checkpoint=none"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("summaries").experiment_id])
    run_id, metrics = run.info.run_id, run.data.metrics
    summary_keys = ["grad_norm/dense", "grad_norm/sparse", "embedding/t_cat_0/row_norm_mean", "embedding/t_cat_0/row_norm_max",
                    "embedding/t_cat_0/row_norm_min"]
    for key in summary_keys:
        assert [m.step for m in client.get_metric_history(run_id, key)] == [5, 10, 15, 20], key
    assert 0 < metrics["grad_norm/dense"] and 0 < metrics["grad_norm/sparse"]
    assert 0 <= metrics["embedding/t_cat_0/row_norm_min"] <= metrics["embedding/t_cat_0/row_norm_mean"] \
        <= metrics["embedding/t_cat_0/row_norm_max"]
    # lrs: the loop logs them at its log steps (10, 20), the summaries on the others, never twice at one step
    assert [m.step for m in client.get_metric_history(run_id, "lr/dense")] == [5, 10, 15, 20]
    assert [m.step for m in client.get_metric_history(run_id, "lr/sparse")] == [5, 10, 15, 20]

    artifacts = [a.path for a in client.list_artifacts(run_id, "summaries")]
    assert artifacts == [f"summaries/histograms_step_{s:08d}.json" for s in (5, 10, 15, 20)]
    hists = json.loads(Path(client.download_artifacts(run_id, artifacts[-1], str(tmp_path))).read_text())
    grads = [k for k in hists if k.startswith("hist/grad/")]
    assert grads and all(k.replace("/grad/", "/param/") in hists for k in grads)
    assert sum(hists[grads[0]]["bucket_counts"]) == hists[grads[0]]["num"] > 0

    (logdir,) = tmp_path.glob("outputs/*/*/tensorboard")  # under the run's Hydra folder: tensorboard --logdir <run dir>
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {*summary_keys, "lr/dense", "train/loss", "eval/auc"} <= set(scalars)
    assert [e.step for e in events.Scalars("grad_norm/sparse")] == [5, 10, 15, 20]
    assert events.Scalars("grad_norm/dense")[-1].value == pytest.approx(metrics["grad_norm/dense"], rel=1e-6)
    assert set(events.Tags()["histograms"]) == set(hists)


class _Recorder(NullTracker):
    """A tracker that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.metrics.setdefault(step, {}).update(metrics)


def test_gradient_norms_equal_the_hand_computation_on_logistic_regression(make_cfg) -> None:
    """``model=lr``: ``logit_i = Σ_f Σ_d pooled[i, f, d] + vᵀ x_i + c + b`` with a mean BCE loss, so with ``r = (p − y) / B``
    the gradient is ``r_i`` at every one of the 4·F pooled entries of row i (sparse norm ``√(4F)·‖r‖``), ``Xᵀ r`` for
    ``v`` and ``Σ r`` for each bias (dense norm ``√(‖Xᵀ r‖² + 2 (Σ r)²)``)."""
    run = validate(make_cfg("model=lr", "optim=sgd", "train.summary_every_steps=1", "tracking=none", "checkpoint=none"))
    c = build(run)
    try:
        recorder = _Recorder()
        c.loop.summaries.tracker = recorder
        batch = next(iter(c.loop.data.train_batches(0, 0, 1)))
        _, logits, labels = c.loop.stepper.pipeline.progress(iter([batch]))
        c.loop.summaries.after_step(1)
    finally:
        c.close()
    r = (torch.sigmoid(logits.double().flatten()) - labels.double().flatten()) / labels.numel()
    x = batch.dense_features.double()
    num_features = len(c.loop.data.features.sparse_names)
    logged = recorder.metrics[1]
    assert logged["grad_norm/sparse"] == pytest.approx(float((4 * num_features) ** 0.5 * r.norm()), rel=1e-5)
    assert logged["grad_norm/dense"] == pytest.approx(float((x.T @ r).pow(2).sum() + 2 * r.sum() ** 2) ** 0.5, rel=1e-5)
    assert logged["lr/sparse"] == pytest.approx(run.optim.sparse.lr) and logged["lr/dense"] == pytest.approx(run.optim.dense.lr)
    # zero-initialised LR weights after one SGD step: the rows this batch looked up moved, the others are still 0
    assert logged["embedding/linear_t_cat_0/row_norm_min"] == 0.0 < logged["embedding/linear_t_cat_0/row_norm_max"]


@pytest.fixture
def one_rank() -> Iterator[DistEnv]:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo")
    dist.destroy_process_group()


@pytest.mark.parametrize("split", ["rows", "columns"])
def test_row_norms_of_a_sharded_table_are_those_of_the_whole_table(one_rank: DistEnv, split: str) -> None:
    """Row-wise shards are taken as they are; column-wise shards of a row are put back together before its norm. One
    rank holds both shards here; split over 2 gloo ranks (each rank its own rows; column shards' squares all-reduced, the
    row counted on rank 0) in ``tests/test_metrics_distributed.py``'s launch."""
    table = torch.randn(6, 4, dtype=torch.float64)
    halves = [(0, 3, 0, 4), (3, 3, 0, 4)] if split == "rows" else [(0, 6, 0, 2), (0, 6, 2, 2)]
    shards = [Shard(table[r:r + nr, c:c + nc].clone(), ShardMetadata([r, c], [nr, nc], "rank:0/cpu")) for r, nr, c, nc in halves]
    sharded = ShardedTensor._init_from_local_shards(shards, [6, 4])
    assert torch.allclose(_local_row_norms(sharded, one_rank).sort().values, table.norm(dim=1).sort().values)


def test_histogram_counts_every_value() -> None:
    h = histogram(torch.tensor([0.0, 1.0, 1.0, 2.0, 4.0]), bins=4)
    assert (h.min, h.max, h.num, h.sum, h.sum_squares) == (0.0, 4.0, 5, 8.0, 22.0)
    assert h.bucket_limits == [1.0, 2.0, 3.0, 4.0] and h.bucket_counts == [1, 2, 1, 1]
    assert histogram(torch.zeros(3)).bucket_counts == [3]


def test_histograms_need_summaries(make_cfg) -> None:
    with pytest.raises(ConfigError, match="train.summary_histograms=true has no effect without summaries"):
        validate(make_cfg("train.summary_histograms=true", "tracking=none"))


def test_a_resume_into_the_same_tensorboard_folder_shows_each_step_once(tmp_path: Path, mlflow_uri: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A run resumed from the checkpoint of step 4 trains steps 5-12 again into the same ``./tensorboard``: the writer's
    ``purge_step`` makes TensorBoard drop the first launch's points after step 4, so each step shows once."""
    from hydra import compose, initialize_config_dir

    from recsys_runner.__main__ import run
    from recsys_runner.config import register_configs
    from recsys_runner.paths import CONFIG_PATH

    monkeypatch.chdir(tmp_path)  # from Python the event files go to ./tensorboard: both launches write there
    register_configs()
    base = [*TINY, "train.num_steps=12", "train.log_every_steps=1", "tracking.tensorboard=true", f"tracking.uri={mlflow_uri}",
            "tracking.experiment=tb_resume", f"checkpoint.dir={tmp_path}/ck", "checkpoint.every_steps=4", "checkpoint.keep_last=null"]

    def launch(*extra: str) -> None:
        with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
            run(compose(config_name="config", overrides=[*base, *extra]))

    launch()
    launch(f"checkpoint.resume={tmp_path}/ck/step_00000004")  # steps 5-12 are trained, and logged, again
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == list(range(1, 13)), steps  # without the purge: 1..12 then 5..12 again
    assert [e.step for e in events.Scalars("eval/auc")] == [12]
