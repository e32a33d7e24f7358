"""The default data serves every model: ``model=mmoe`` and ``model=dssm`` without a ``data=`` override
train on synthetic data shaped by the model's declared needs (its tasks, its towers) and learn;
data read from files keeps its columns and is refused when it lacks a model's labels."""

from __future__ import annotations

import logging
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.generated.generate import write_criteo_parquet
from recsys_runner.data.generated.synthetic import SyntheticData
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
from recsys_runner.errors import ConfigError
from recsys_runner.train.loop import train


def trained(cfg: DictConfig) -> tuple[dict[str, float], SyntheticData]:
    """Build and train as ``python -m recsys_runner`` does; the final eval metrics and the data trained on."""
    c = build(validate(cfg))
    try:
        return train(c.loop), c.loop.data  # type: ignore[return-value]
    finally:
        c.close()


def test_mmoe_learns_both_tasks_on_the_default_data(make_cfg) -> None:
    final, data = trained(make_cfg("model=mmoe", "tracking=none"))
    assert data.features.label_names == ("ctr", "cvr")
    assert final["eval/ctr/auc"] > 0.6 and final["eval/cvr/auc"] > 0.6, final


def test_dssm_retrieves_far_above_random_on_the_default_data(make_cfg) -> None:
    # in-batch recall rewards the uncorrected softmax (its candidates come as its negatives did); logQ: test_corpus_eval.py
    final, _ = trained(make_cfg("model=dssm", "model.logq_correction=false", "tracking=none"))
    candidates = 256  # data.batch_size in TINY: each query's in-batch candidates
    assert final["eval/inbatch_recall_at_10"] > 3 * 10 / candidates, final
    assert final["eval/inbatch_recall_at_50"] > 2 * 50 / candidates, final


def test_a_regression_task_gets_a_learnable_amount(make_cfg) -> None:
    cfg = make_cfg("model=mmoe", "model.tasks=[ctr,watch]", "model.task_kinds=[binary,regression]", "tracking=none")
    final, data = trained(cfg)
    watch = torch.cat([b.labels[:, 1] for b in data.eval_batches(0, 1)])
    assert final["eval/watch/mse"] < 0.7 * float(watch.var()), (final, float(watch.var()))  # beats predicting the mean
    assert final["eval/ctr/auc"] > 0.6, final


@pytest.mark.parametrize(
    ("overrides", "changes"),
    [
        (["model=deepfm"], {}),
        (["model=mmoe"], {"tasks": ["ctr", "cvr"]}),
        (["model=mmoe", "model.tasks=[ctr,watch]", "model.task_kinds=[binary,regression]"],
         {"tasks": ["ctr", "watch"], "label_kinds": {"watch": "regression"}}),
        (["model=dssm"], {"user_feature": "cat_0", "item_features": ["cat_1"], "user_item_clusters": 16}),
        (["model=dssm", "model.user_features=[int_0,cat_3]", "model.item_features=[cat_5,int_1,cat_2]"],
         {"user_feature": "cat_3", "item_features": ["cat_5", "cat_2"], "user_item_clusters": 16}),
        (["model=mmoe", "data=synthetic_multitask"], {}),  # explicit data.tasks win
        (["model=dssm", "data=synthetic_retrieval"], {"user_feature": "cat_0", "item_features": ["cat_1"]}),
        (["model=mmoe", "data=parquet", "data.path=unused.parquet"], {}),  # files have fixed labels
    ],
)
def test_the_data_follows_what_the_model_declares(make_cfg, overrides: list[str], changes: dict) -> None:
    run = validate(make_cfg(*overrides, "distributed.device=cpu", "tracking=none", tiny=False))
    served = run.data.for_model(run.model.data_needs())
    assert {f.name: getattr(served, f.name) for f in fields(served) if getattr(served, f.name) != getattr(run.data, f.name)} == changes
    assert (served is run.data) == (not changes)  # a new config when anything changes; the configured one is left alone


def test_pairs_link_every_item_feature_to_the_user_cluster() -> None:
    data = SyntheticData(make(SyntheticDataConfig, batch_size=2048, num_dense=2, num_sparse=5, num_embeddings=100, user_item_clusters=4,
                         user_feature="cat_2", item_features=["cat_0", "cat_3"]))
    ids = data.batch(0, 0).sparse_features.to_dict()
    user = ids["cat_2"].values() % 4
    assert torch.equal(ids["cat_0"].values() % 4, user) and torch.equal(ids["cat_3"].values() % 4, user)
    assert not torch.equal(ids["cat_1"].values() % 4, user)  # not an item: independent


def test_synthetic_regression_labels_are_amounts() -> None:
    data = SyntheticData(make(SyntheticDataConfig, batch_size=4096, num_dense=3, num_sparse=4, num_embeddings=100, tasks=["ctr", "watch", "cvr"],
                         label_kinds={"watch": "regression"}))
    labels = data.batch(0, 0).labels
    click, watch, cvr = labels.unbind(1)
    assert bool((watch > 0).all()) and len(torch.unique(watch)) > 1000  # an amount on every row, not a 0/1 label
    assert set(cvr.unique().tolist()) == {0.0, 1.0} and bool((cvr <= click).all())
    binary = SyntheticData(make(SyntheticDataConfig, batch_size=4096, num_dense=3, num_sparse=4, num_embeddings=100, tasks=["ctr", "watch", "cvr"]))
    assert torch.equal(binary.batch(0, 0).labels[:, 0], click)  # the click does not depend on the other tasks' kinds


def test_file_backed_data_without_the_labels_is_still_refused(make_cfg, tmp_path: Path) -> None:
    write_criteo_parquet(str(tmp_path / "d.parquet"), 600)
    cfg = make_cfg("model=mmoe", "data=parquet", f"data.path={tmp_path}/d.parquet", "data.batch_size=64", "distributed.device=cpu",
                   "tracking=none", tiny=False)
    with pytest.raises(ConfigError, match=r"task\(s\) \['ctr', 'cvr'\] have no label column.*single \[B\] label.*data.labels="):
        build(validate(cfg)).close()


def test_tasks_on_generated_histories_get_a_label_each(make_cfg) -> None:
    """``model=hstu_rank model.tasks=[ctr,cvr]`` on the default data: the histories it becomes carry the model's tasks as
    ``data=synthetic`` would (``data.tasks``; once refused as one click label), and the model binds a head to each."""
    c = build(validate(make_cfg("model=hstu_rank", "model.tasks=[ctr,cvr]", "distributed.device=cpu", "tracking=none", tiny=False)))
    try:
        assert c.loop.data.features.label_names == ("ctr", "cvr")
    finally:
        c.close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=dssm", "model.user_features=[int_0]"],
         r"data=synthetic links each \(user, item\) pair through a sparse feature of each tower, but the model's user tower has none.*Fix:"),
        (["model=dssm", "model.user_features=[user_id]"], r"model.user_features has \['user_id'\], which the data does not have"),
        (["data.label_kinds={ctr: regression}"], r"data.label_kinds=\{'ctr': 'regression'\} is set but data.tasks is null.*Fix:"),
        (["data.tasks=[ctr]", "data.label_kinds={cvr: regression}"], r"data.label_kinds names \['cvr'\], which are not in data.tasks"),
        (["data.tasks=[ctr]", "data.label_kinds={ctr: ordinal}"], r"data.label_kinds has kind\(s\) \['ordinal'\]"),
        (["data.user_item_clusters=8", "data.item_features=[int_0]"], r"name \['int_0'\], which are not sparse columns.*Fix:"),
        (["data.user_item_clusters=8", "data.user_feature=cat_1"], r"item columns \['cat_1'\] \(data.item_features\) must be at least one and not the user column 'cat_1'.*Fix:"),
    ],
)
def test_mistakes_say_what_to_fix(make_cfg, overrides: list[str], message: str) -> None:
    cfg = make_cfg(*overrides, "tracking=none")
    with pytest.raises(ConfigError, match=message):
        build(validate(cfg)).close()


# --- checks on the data as the model gets it (issue 30) ----------------------------------------------------------------

def test_batch_tokens_is_checked_on_the_data_the_model_gets(make_cfg) -> None:
    """``model=din data.batch_tokens=4096``: the default data becomes histories for DIN, whose tokens the budget counts, so
    it is accepted; a model without histories is refused at validation, and so is a budget the histories cannot meet."""
    run = validate(make_cfg("model=din", "data.batch_tokens=4096", "tracking=none", tiny=False))
    assert isinstance(run.served_data, SyntheticSequencesConfig) and run.served_data.batch_tokens == 4096
    with pytest.raises(ConfigError, match=r"data\.batch_tokens=4096 .*no histories for this model.*model=din"):
        validate(make_cfg("model=deepfm", "data.batch_tokens=4096", "tracking=none", tiny=False))
    with pytest.raises(ConfigError, match=r"data\.batch_tokens=20 .*max_len=50"):  # the generated histories' own check
        validate(make_cfg("model=din", "data.batch_tokens=20", "tracking=none", tiny=False))


def test_task_labels_generated_data_ignores_are_named_in_one_warning(make_cfg, caplog: pytest.LogCaptureFixture) -> None:
    """``+model.task_specs.cvr={label: buy}`` picks a column of files; generated data draws every task's label, so the
    setting has no effect there: one warning names each such label, once per run (validate and build)."""
    cfg = make_cfg("model=mmoe", "+model.task_specs.cvr={label: buy}", "+model.task_specs.ctr={label: click}", "tracking=none")
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        build(validate(cfg)).close()
    said = [r.getMessage() for r in caplog.records if "task_specs" in r.getMessage()]
    assert len(said) == 1, said
    assert "model.task_specs.ctr.label=click" in said[0] and "model.task_specs.cvr.label=buy" in said[0]
    assert "no effect" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        validate(make_cfg("model=mmoe", "+model.task_specs.cvr={weight: 2.0}", "tracking=none"))
    assert not [r for r in caplog.records if "task_specs" in r.getMessage()]


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [(["data.hard_negatives=0"], r"Fix: data\.hard_negatives=8 \(the generated data then lists"),
     (["data.negatives.hard_column=shown"], r"Fix: data\.negatives\.hard_column=hard_items, the list column data\.hard_negatives=8 generates")],
)
def test_a_missing_hard_negative_column_on_generated_data_names_the_generated_fix(make_cfg, overrides: list[str], fix: str) -> None:
    run = validate(make_cfg("experiment=dssm_hard_negatives", *overrides, "tracking=none"))
    with pytest.raises(ConfigError, match=r"data\.negatives\.hard_column='\w+' is not a sparse column of the data") as raised:
        run.served_data.build(device="cpu")
    assert re.search(fix, str(raised.value)) and "data.sparse" not in str(raised.value)
