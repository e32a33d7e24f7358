"""A swept model key either takes effect or stops the run with one Config error naming the key and the fix: found by
trying each model's keys at unusual and wrong values (dogfood6). Config-only checks: nothing here trains."""

from __future__ import annotations

import logging

import pytest

from recsys_runner.configurable import make
from recsys_runner.distributed.config import DistributedConfig
from recsys_runner.distributed.planner import table_constraints
from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec, SparseFeature
from recsys_runner.models.bst import BSTConfig
from recsys_runner.models.dbmtl import DBMTLConfig
from recsys_runner.models.din import DINConfig
from recsys_runner.models.dssm import DSSMConfig
from recsys_runner.models.esmm import ESMMConfig
from recsys_runner.models.hstu_rank import HSTURankConfig
from recsys_runner.models.masknet import MaskNetConfig
from recsys_runner.models.mind import MINDConfig
from recsys_runner.models.mmoe import MMoEConfig
from recsys_runner.models.ple import PLEConfig
from recsys_runner.models.sasrec import SASRecConfig
from recsys_runner.overrides import explain


@pytest.mark.parametrize("cls", [DSSMConfig, MINDConfig, SASRecConfig])
def test_an_empty_eval_metrics_list_is_refused(cls: type) -> None:
    """``model.eval_metrics=[]`` logged the task's default metrics (hr@10, ndcg@10, hr@50; inbatch_recall@10), silently."""
    with pytest.raises(ConfigError, match=r"model.eval_metrics=\[\] lists no metric.*Fix: list the metrics to log, e.g. "
                                          r"model.eval_metrics=\[\w+@10,"):
        make(cls, eval_metrics=[])
    assert make(cls, eval_metrics=["mrr"]).eval_metrics == ["mrr"]


def test_an_empty_task_eval_metrics_list_is_refused() -> None:
    """``model.task_specs.<task>.eval_metrics=[]`` logged the task kind's default metrics (or ``metrics.eval``), silently,
    where the same task's ``train_metrics=[]`` means none."""
    with pytest.raises(ConfigError, match=r"model.task_specs.ctr.eval_metrics=\[\] lists no metric.*Fix: list the metrics to log, "
                                          r"e.g. model.task_specs.ctr.eval_metrics=\[auc\]"):
        make(MMoEConfig, task_specs={"ctr": {"eval_metrics": []}})
    assert make(MMoEConfig, task_specs={"ctr": {"eval_metrics": ["auc"], "train_metrics": []}}).task_specs["ctr"].train_metrics == []


@pytest.mark.parametrize(("cls", "values", "unread", "setting", "read"), [
    (BSTConfig, {"num_time_buckets": 8}, "model.num_time_buckets=8 has", "model.position=time_gap", {"position": "time_gap"}),
    (SASRecConfig, {"time_buckets": 16}, "model.time_buckets=16 has", "model.block=hstu", {"block": "hstu"}),
    (DINConfig, {"use_history": False, "attention_layer_sizes": [64, 8]}, "model.attention_layer_sizes=[64,8] has",
     "model.use_history=true", {"use_history": True}),
    (DSSMConfig, {"logq_correction": False, "logq_alpha": 0.1, "logq_buckets": 64},
     "model.logq_buckets=64, model.logq_alpha=0.1 have", "model.logq_correction=true", {"logq_correction": True}),
    (MINDConfig, {"logq_correction": False, "logq_source": "item_table"}, "model.logq_source=item_table has",
     "model.logq_correction=true", {"logq_correction": True}),
])
def test_a_key_another_setting_leaves_unread_is_warned_of(caplog: pytest.LogCaptureFixture, cls: type, values: dict[str, object],
                                                          unread: str, setting: str, read: dict[str, object]) -> None:
    """A hyperparameter set where the model does not read it (BST's time buckets with recency positions, SASRec's with
    its own block, DIN's attention MLP in its ablation without history, the logQ estimator's without the correction) trained the same model as without it, without a word:
    a sweep over it ran the same run N times. A warning, since an A/B of the setting with the others fixed is meant."""
    with caplog.at_level(logging.WARNING, logger="recsys_runner.models.common"):
        make(cls, **values)
        assert [r.getMessage() for r in caplog.records] == [
            f"{unread} no effect: the model reads {'it' if unread.endswith(' has') else 'them'} only with {setting}"]
        caplog.clear()
        make(cls, **{**values, **read})   # read: no warning
        make(cls)
    assert not caplog.records


def test_a_masknet_reduction_ratio_that_leaves_no_aggregation_unit_is_refused() -> None:
    """Each mask's aggregation layer is ``round(ratio × width)`` wide; a ratio that rounded to 0 was made 1 unit, silently.
    Serial blocks of 8 at 0.05: the mask over the 12 fields' floats gets 0.6 units (1), over the first block's 8 0.4 (none)."""
    features = FeatureSpec(dense_names=("x",), sparse=(SparseFeature("a", 10), SparseFeature("b", 10)))
    config = make(MaskNetConfig, embedding_dim=4, structure="serial", block_sizes=[8, 8], reduction_ratio=0.05, deep_layer_sizes=[])
    with pytest.raises(ConfigError, match=r"model.reduction_ratio=0.05 makes the aggregation layer of the mask over a 8-wide vector "
                                          r"0.4 units wide, which rounds to none. Fix: model.reduction_ratio=0.12 or more"):
        config.build(features=features)
    model = make(MaskNetConfig, embedding_dim=4, structure="serial", block_sizes=[8, 8], reduction_ratio=0.125,
                 deep_layer_sizes=[]).build(features=features)
    assert [block.mask[0].out_features for block in model.blocks] == [2, 1]   # round(0.125 × 12), round(0.125 × 8)


def test_a_sharding_type_a_history_table_cannot_take_is_a_config_error() -> None:
    """A history's table (an EmbeddingCollection's: SASRec's, BST's ``item``) given ``table_column_wise``, which only pooled
    tables take, reached TorchRec's planner: a RuntimeError ("No available sharding type and compute kernel combination
    ... for item") after the model was built, naming no key. A type it can take among those given is kept."""
    config = make(DistributedConfig, device="cpu", tables={"item": {"sharding_types": ["table_column_wise"]}})
    with pytest.raises(ConfigError, match=r"table 'item' is read unpooled .*its sharder takes only \['table_wise', 'column_wise', "
                                          r"'row_wise'\] on cpu, and the sharding types \['table_column_wise'\] leave nothing else. "
                                          r"Fix: \+distributed.tables.item.sharding_types=\[table_wise\]"):
        table_constraints(config, ["item", "t_user"], 1, unpooled={"item"})
    config = make(DistributedConfig, device="cpu", tables={"item": {"sharding_types": ["table_column_wise", "column_wise"]},
                                                           "t_user": {"sharding_types": ["table_column_wise"]}})
    constraints = table_constraints(config, ["item", "t_user"], 1, unpooled={"item"})
    assert constraints is not None
    assert (constraints["item"].sharding_types, constraints["t_user"].sharding_types) == (["column_wise"], ["table_column_wise"])


@pytest.mark.parametrize(("cls", "values", "message"), [
    (MMoEConfig, {"num_experts": 0}, "model.num_experts must be positive, got 0. Fix: e.g. model.num_experts=4"),
    (MMoEConfig, {"loss_weights": [0, 0]}, "model.loss_weights=[0.0, 0.0] must be >= 0 and not all 0. Fix: e.g. model.loss_weights=null"),
    (PLEConfig, {"num_levels": 0}, "model.num_levels must be at least 1, got 0. Fix: e.g. model.num_levels=2"),
    (DBMTLConfig, {"num_experts": -1}, "model.num_experts must be 0 (no expert layer) or more, got -1. Fix: e.g. model.num_experts=0"),
    (ESMMConfig, {"cvr_weight": -0.5}, "model.cvr_weight must be >= 0, got -0.5. Fix: e.g. model.cvr_weight=0 (that loss off)"),
    (HSTURankConfig, {"time_buckets": -1}, "model.time_buckets must be >= 0, got -1. Fix: e.g. model.time_buckets=128"),
    (SASRecConfig, {"num_blocks": 0}, "model.num_blocks must be positive, got 0. Fix: e.g. model.num_blocks=2"),
    (SASRecConfig, {"attention_block": -1}, "model.attention_block must be >= 0 (0: padded), got -1. Fix: e.g. model.attention_block=32"),
    (SASRecConfig, {"temperature": 0}, "model.temperature must be positive, got 0.0. Fix: e.g. model.temperature=0.05"),
    (DSSMConfig, {"temperature": -1}, "model.temperature must be positive, got -1.0. Fix: e.g. model.temperature=0.05"),
])
def test_an_out_of_range_count_or_weight_names_the_fix(cls: type, values: dict[str, object], message: str) -> None:
    """These said what was wrong but not what to set (``model.num_experts must be positive, got 0``), as the other keys do."""
    with pytest.raises(ConfigError) as raised:
        make(cls, **values)
    assert str(raised.value) == message or str(raised.value).startswith(message), str(raised.value)


@pytest.mark.parametrize(("overrides", "expected"), [
    (["model.deep_layer_sizes=[null]"], "model.deep_layer_sizes=[null]: its entry model.deep_layer_sizes[0] (Invalid type assigned: "
                                        "NoneType is not a subclass of int. value: None). Fix: e.g. its default "
                                        "model.deep_layer_sizes=[256,128,64]"),
    (["model=dlrm", "model.dense_arch_layer_sizes=null"], "model.dense_arch_layer_sizes=null: model.dense_arch_layer_sizes is a "
                                                          "list, not null (field 'model.dense_arch_layer_sizes' is not Optional). "
                                                          "Fix: e.g. its default model.dense_arch_layer_sizes=[64,null]"),
])
def test_a_layer_list_given_a_wrong_entry_or_null_names_a_list_that_composes(overrides: list[str], expected: str) -> None:
    """An entry of the wrong type (``[null]``, ``[a]``, ``[64.5]``) was Hydra's multi-line "Error merging override" (exit 1);
    ``null`` for the list was told to write ``[null]``, which fails so. Both now give the default as an override writes it
    (it was printed as Python's ``[64, None]``)."""
    with pytest.raises(ConfigError) as raised:
        explain("config", overrides)
    assert str(raised.value) == expected
