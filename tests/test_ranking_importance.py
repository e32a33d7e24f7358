"""``evaluate.importance=permutation`` of models that rank items (``recsys_runner/importance.py``): only the query side moves.

A next-item model (sasrec, a few seconds of training, ``metrics.exclude_seen`` on): its history group carries its HR@k and
NDCG@k, the features it does not read measure exactly 0, its candidates (the true next items) are not offered and are
refused by name, reruns agree, the MLflow run has the keys. A two-tower model (dssm with a full-corpus pass and
``data.items.seen``): the evaluator's passes with the batch left as it is equal the plain evaluate, the seen column (read
by the mask only) measures exactly 0, the item tower's features are refused. The mask of a next-item model reads the
row's own history, not the shuffled input."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from torchrec.datasets.utils import Batch

from recsys_runner import evaluate
from recsys_runner.__main__ import run as train
from recsys_runner.config import validate
from recsys_runner.errors import ConfigError
from recsys_runner.importance import input_features, item_side, permute_rows, selected
from recsys_runner.inference_build import build_inference
from recsys_runner.metrics.registry import MetricsConfig
from recsys_runner.runtime import Launch
from recsys_runner.train import corpus
from recsys_runner.train.corpus import item_index, use_ranking_protocol
from tests.test_evaluate import compose_entry
from tests.test_exclude_seen import _model_and_data, train_two_tower
from tests.test_next_item import SMALL


def test_next_item_mask_reads_the_rows_own_history_not_the_shuffled_input() -> None:
    """With ``protocol_rows`` set, the scores are the shuffled input's, masked by each row's own history."""
    wrapper, model, data = _model_and_data()
    (group,) = [f for f in input_features(data.features) if f.kind == "history"]  # type: ignore[attr-defined]
    batch = next(iter(data.eval_batches(0, 1)))  # type: ignore[attr-defined]
    order = torch.roll(torch.arange(batch.labels.shape[0]), 1)
    moved = permute_rows(batch, group, order)
    with torch.no_grad():
        use_ranking_protocol(wrapper, data, MetricsConfig(exclude_seen=False), two_tower=False)
        _, (_, plain, targets) = wrapper(moved)
        use_ranking_protocol(wrapper, data, MetricsConfig(exclude_seen=True), two_tower=False)
        model.protocol_rows = batch.sparse_features
        _, (_, masked, _) = wrapper(moved)
        model.protocol_rows = None
        _, (_, masked_by_input, _) = wrapper(moved)
    own, shuffled = batch.sparse_features["hist_item_id"], moved.sparse_features["hist_item_id"]
    differ = 0
    for row, (ids, other) in enumerate(zip(torch.split(own.values(), own.lengths().tolist()),
                                           torch.split(shuffled.values(), shuffled.lengths().tolist()), strict=True)):
        unseen = torch.ones(plain.shape[1], dtype=torch.bool)
        unseen[ids] = False
        unseen[targets[row]] = True
        assert torch.equal(masked[row][unseen], plain[row][unseen]) and bool(torch.isneginf(masked[row][~unseen]).all())
        if set(other.tolist()) - set(ids.tolist()) - {int(targets[row])}:
            assert not torch.equal(masked[row], masked_by_input[row])  # the input's history would have masked others
            differ += 1
    assert differ > batch.labels.shape[0] // 2


@pytest.mark.slow
def test_next_item_importance_is_the_historys(make_cfg: Callable[..., DictConfig], mlflow_uri: str, tmp_path: Path) -> None:
    train_overrides = [o for o in SMALL if o != "checkpoint=none"] + [
        "train.num_steps=60", "data.num_eval_rows=1024", "metrics.exclude_seen=true", f"checkpoint.dir={tmp_path}/ck"]
    cfg = make_cfg(*train_overrides, tiny=False)
    train(cfg)
    overrides = [*train_overrides, f"tracking.uri={cfg.tracking.uri}", f"tracking.experiment={cfg.tracking.experiment}",
                 f"load={tmp_path}/ck", "evaluate.importance=permutation"]

    def measured(name: str) -> dict:
        metrics = evaluate.run(compose_entry("evaluate", *overrides), Launch(output_dir=tmp_path / name))
        out = json.loads((tmp_path / name / "importance.json").read_text())
        assert out["base"] == metrics
        return out

    first = measured("first")
    rows = {f["feature"]: f for f in first["features"]}
    assert set(rows) == {"int_0", "int_1", "user_id", "hist"}, "the candidates item_id and category are the target's"
    assert first["features"][0]["feature"] == "hist" and rows["hist"]["kind"] == "history"
    hist = rows["hist"]["changes"]
    assert set(hist) == {"hr_at_10_drop", "ndcg_at_10_drop", "hr_at_50_drop", "mrr_drop"}
    assert hist["hr_at_10_drop"] > 0.1 and hist["ndcg_at_10_drop"] > 0.05, hist
    for name in ("int_0", "int_1", "user_id"):  # SASRec reads the history alone: exactly nothing changes
        assert rows[name]["metrics"] == first["base"] and all(v == 0 for v in rows[name]["changes"].values()), rows[name]
    assert measured("again") == first  # the same seed: the same shuffles, the same numbers
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    run = client.search_runs([experiment.experiment_id], "tags.entry = 'evaluate'")[0]
    assert run.data.metrics["importance/hist/hr_at_10_drop"] == pytest.approx(hist["hr_at_10_drop"])
    with pytest.raises(ConfigError, match=r"names 'item_id', the row's candidate \(history feature hist_item_id's\).*"
                                          r"Only the query side is measured: \['int_0', 'int_1', 'user_id', 'hist'\]"):
        evaluate.run(compose_entry("evaluate", *overrides, "evaluate.importance_features=[item_id]"))


@pytest.mark.slow
def test_two_tower_importance_moves_the_query_side_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train_overrides, checkpoint = train_two_tower(tmp_path)
    overrides = [*train_overrides, f"load={checkpoint}", "metrics.exclude_seen=true", "evaluate.importance=permutation",
                 "model.eval_metrics=[recall@10,mrr,inbatch_recall@10]"]  # the full-corpus and the in-batch pass
    built = build_inference(validate(compose_entry("evaluate", *overrides)), weights=checkpoint)
    try:
        assert built.evaluator is not None and built.evaluator.corpus is not None
        plain = built.evaluator.evaluate()
        assert built.evaluator.evaluate(rewrite=lambda n, batch: Batch(batch.dense_features.clone(), batch.sparse_features,
                                                                      batch.labels)) == plain
        item = item_side(built.model, built.tasks, built.data.features)
        assert set(item) == {"item_id", "cate"}
        assert [f.name for f in selected(input_features(built.data.features), [], item)] == ["user_id", "hist", "seen"]
    finally:
        built.close()
    built_indexes = []

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        built_indexes.append(1)
        return item_index(*args, **kwargs)

    monkeypatch.setattr(corpus, "item_index", counted)
    metrics = evaluate.run(compose_entry("evaluate", *overrides), Launch(output_dir=tmp_path / "out"))
    assert len(built_indexes) == 2, "the metrics' pass, then the first feature's: the other two reuse its item index"
    assert metrics == plain and set(metrics) >= {"eval/recall_at_10", "eval/mrr", "eval/inbatch_recall_at_10"}
    out = json.loads((tmp_path / "out" / "importance.json").read_text())
    rows = {f["feature"]: f for f in out["features"]}
    assert set(rows) == {"user_id", "hist", "seen"} and out["base"] == metrics
    assert rows["seen"]["metrics"] == metrics, "data.items.seen feeds the mask only, which reads each row's own"
    assert set(rows["user_id"]["changes"]) >= {"recall_at_10_drop", "mrr_drop", "inbatch_recall_at_10_drop"}
    assert rows["user_id"]["metrics"] != metrics, "the user tower reads user_id"
    with pytest.raises(ConfigError, match=r"names 'cate', an item-tower feature \(model.item_features\)"):
        evaluate.run(compose_entry("evaluate", *overrides, "evaluate.importance_features=[cate]"))
