"""``evaluate.importance=permutation``: each feature's metric change with its rows shuffled (``recsys_runner/importance.py``).

A Parquet file whose label follows one sparse feature and one dense column, beside a noise id, a noise dense column and a
weighted variable-length noise list: after a short training, shuffling the signal features costs AUC, shuffling the noise
ones nothing; reruns agree; the KJT row permutation moves whole lists (weights too) and leaves every other key alone."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner import evaluate
from recsys_runner.__main__ import run as train
from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec, SequenceGroup, SparseFeature
from recsys_runner.importance import (
    Feature,
    Importance,
    change_name,
    changes,
    input_features,
    metric_keys,
    permute_kjt_rows,
    permute_rows,
    selected,
)
from recsys_runner.runtime import Launch
from tests.test_evaluate import compose_entry


def test_kjt_row_permutation_moves_whole_weighted_lists() -> None:
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3, 10, 11, 12, 13]),
                            lengths=torch.tensor([2, 0, 1, 1, 2, 1], dtype=torch.int32),
                            weights=torch.tensor([0.1, 0.2, 0.3, 1.0, 1.1, 1.2, 1.3]))
    out = permute_kjt_rows(kjt, ("a",), torch.tensor([2, 0, 1]))
    a, b = out["a"], out["b"]
    assert a.lengths().tolist() == [1, 2, 0] and a.values().tolist() == [3, 1, 2]
    assert a.weights().tolist() == pytest.approx([0.3, 0.1, 0.2])
    assert b.lengths().tolist() == [1, 2, 1] and b.values().tolist() == [10, 11, 12, 13]  # untouched
    assert b.weights().tolist() == pytest.approx([1.0, 1.1, 1.2, 1.3])
    assert out.lengths().dtype == torch.int32 and out.length_per_key() == kjt.length_per_key() and out.stride() == 3


def test_history_group_moves_as_one_and_dense_columns_alone() -> None:
    spec = FeatureSpec(dense_names=("x", "y"), sparse=(SparseFeature("item", 10), SparseFeature("hist", 10)),
                       sequences=(SequenceGroup("clicks", ("hist",), max_len=4, timestamps="hist_ts"),))
    assert [(f.name, f.kind) for f in input_features(spec)] == [("x", "dense"), ("y", "dense"), ("item", "sparse"),
                                                                 ("clicks", "history")]
    assert [f.name for f in selected(input_features(spec), ["clicks", "x"])] == ["x", "clicks"]  # the data's order
    with pytest.raises(ConfigError, match=r"'hist', a column of history group 'clicks'.*Fix: evaluate.importance_features=\[clicks\]"):
        selected(input_features(spec), ["hist"])
    (group,) = [f for f in input_features(spec) if f.kind == "history"]
    assert group.keys == ("hist", "hist_ts")
    kjt = KeyedJaggedTensor(keys=["item", "hist", "hist_ts"], values=torch.tensor([5, 6, 1, 2, 3, 100, 200, 300]),
                            lengths=torch.tensor([1, 1, 2, 1, 2, 1], dtype=torch.int32))
    batch = Batch(dense_features=torch.tensor([[1.0, 10.0], [2.0, 20.0]]), sparse_features=kjt, labels=torch.tensor([0.0, 1.0]))
    moved = permute_rows(batch, group, torch.tensor([1, 0]))
    assert moved.sparse_features["hist"].values().tolist() == [3, 1, 2]
    assert moved.sparse_features["hist_ts"].values().tolist() == [300, 100, 200]  # the same rows' times with them
    assert moved.sparse_features["item"].values().tolist() == [5, 6] and moved.labels.tolist() == [0.0, 1.0]
    dense = permute_rows(batch, Feature("y", "dense", columns=(1,)), torch.tensor([1, 0]))
    assert dense.dense_features.tolist() == [[1.0, 20.0], [2.0, 10.0]] and batch.dense_features[0, 1] == 10.0


def test_metric_names_kept_valid() -> None:
    assert [change_name(k) for k in ("eval/ctr/auc", "eval/ctr/logloss", "eval/recall_at_10", "eval/calibration")] == \
        ["ctr/auc_drop", "ctr/logloss_rise", "recall_at_10_drop", "calibration_error_rise"]
    # calibration is best at 1: a shuffle that brings 0.94 to 0.96 makes it better, so the change is negative
    moved = changes({"eval/calibration": 0.94, "eval/auc": 0.7}, {"eval/calibration": 0.96, "eval/auc": 0.69})
    assert moved["calibration_error_rise"] == pytest.approx(-0.02) and moved["auc_drop"] == pytest.approx(0.01)
    assert changes({"eval/calibration": 1.1}, {"eval/calibration": 0.8})["calibration_error_rise"] == pytest.approx(0.1)
    rows = [Importance(Feature(name, "sparse"), {}, {"auc_drop": 0.1}) for name in ("a:b/c", "a_b_c", "..")]
    assert list(metric_keys(rows)) == ["importance/a_b_c/auc_drop", "importance/a_b_c_2/auc_drop", "importance/__/auc_drop"]


def _signal_parquet(path: Path, rows: int, seed: int) -> None:
    """``label`` follows ``sig`` (an id, 0-9 lean negative, 10-19 positive) and ``dense_sig``; the rest is noise."""
    rng = np.random.default_rng(seed)
    sig, dense_sig = rng.integers(0, 20, rows), rng.normal(size=rows)
    logit = np.where(sig >= 10, 2.5, -2.5) + 1.5 * dense_sig
    lengths = rng.integers(0, 4, rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tags = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(rng.integers(0, 30, offsets[-1])))
    tag_w = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(rng.uniform(0.5, 2, offsets[-1]), pa.float32()))
    pq.write_table(pa.table({"label": (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int8), "sig": sig,
                             "noise": rng.integers(0, 20, rows), "dense_sig": dense_sig, "dense_noise": rng.normal(size=rows),
                             "tags": tags, "tag_w": tag_w}), path)


DATA = ["data=parquet", "data.label=label", "data.batch_size=256", "data.dense=[{name: dense_sig}, {name: dense_noise}]",
        "data.sparse=[{name: sig, num_embeddings: 20}, {name: noise, num_embeddings: 20}, "
        "{name: tags, num_embeddings: 30, weights: tag_w}]",
        "optim=adagrad", "optim.lr=0.1", "train.num_steps=40", "train.log_every_steps=20", "train.eval_every_steps=null",
        "distributed.device=cpu"]


@pytest.mark.slow
def test_permutation_importance_finds_the_signal(make_cfg: Callable[..., DictConfig], mlflow_uri: str, tmp_path: Path) -> None:
    _signal_parquet(tmp_path / "train.parquet", 10240, seed=1)
    _signal_parquet(tmp_path / "eval.parquet", 2048, seed=2)
    data = [*DATA, f"data.path={tmp_path}/train.parquet", f"data.eval_path={tmp_path}/eval.parquet",
            f"checkpoint.dir={tmp_path}/ck"]
    cfg = make_cfg(*data, tiny=False)
    train(cfg)
    overrides = [*data, f"tracking.uri={cfg.tracking.uri}", f"tracking.experiment={cfg.tracking.experiment}",
                 f"load={tmp_path}/ck", "evaluate.importance=permutation"]

    def measured(name: str, *extra: str) -> dict:
        evaluate.run(compose_entry("evaluate", *overrides, *extra), Launch(output_dir=tmp_path / name))
        assert (tmp_path / name / "importance.csv").read_text().startswith("feature,kind,auc_drop,logloss_rise,")
        return json.loads((tmp_path / name / "importance.json").read_text())

    first = measured("first")
    drops = {f["feature"]: f["changes"]["auc_drop"] for f in first["features"]}
    assert [f["feature"] for f in first["features"]][:2] == ["sig", "dense_sig"], drops  # most important first
    assert drops["sig"] > 0.15 and drops["dense_sig"] > 0.03, drops
    assert all(abs(drops[n]) < 0.01 for n in ("noise", "dense_noise", "tags")), drops
    assert {f["feature"]: f["changes"]["logloss_rise"] for f in first["features"]}["sig"] > 0.1
    assert measured("again") == first  # the same seed: the same shuffles, the same numbers

    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    run = client.search_runs([experiment.experiment_id], "tags.entry = 'evaluate'")[0]
    assert run.data.metrics["importance/sig/auc_drop"] == pytest.approx(drops["sig"])
    assert {"importance.csv", "importance.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}

    subset = measured("subset", "evaluate.importance_features=[tags,sig]")  # the data's order; same numbers as in all
    assert [(f["feature"], f["changes"]["auc_drop"]) for f in subset["features"]] == [("sig", drops["sig"]), ("tags", drops["tags"])]
    with pytest.raises(ConfigError, match=r"names 'sgi', which is no input feature of the data \(did you mean sig\?\)"):
        evaluate.run(compose_entry("evaluate", *overrides, "evaluate.importance_features=[sgi]"))
    with pytest.raises(ConfigError, match=r"evaluate.importance=none measures nothing. Fix: add evaluate.importance=permutation"):
        evaluate.run(compose_entry("evaluate", *overrides, "evaluate.importance=none", "evaluate.importance_features=[sig]"))
