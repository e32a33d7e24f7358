"""``precision.embedding_data_type=fp16``: embedding tables stored in half precision.

Trained for a few real steps on CPU by each fused optimizer fbgemm has there, with the sharded module's tables checked
to really be fp16; planned at half the size; saved and resumed (and converted, loudly, when a resume changes the
setting); scored by evaluate, predict and the exported MLflow model; and what fbgemm or TorchRec cannot train refused
by name (bf16 tables on CPU, data_parallel fp16 tables under an optimizer with state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from mlflow.tracking import MlflowClient
from torch import nn
from torchrec.distributed.types import EmbeddingModuleShardingPlan
from torchrec.types import DataType

from recsys_runner import evaluate
from recsys_runner.__main__ import run
from recsys_runner.bench.table_dtype import bench_table_dtype
from recsys_runner.build import build
from recsys_runner.checkpoint import resume_changes
from recsys_runner.config import validate
from recsys_runner.distributed.config import DistributedConfig
from recsys_runner.distributed.planner import table_constraints
from recsys_runner.errors import ConfigError
from recsys_runner.plan import dry_run
from recsys_runner.serving.files import MODEL_FILE
from recsys_runner.train.loop import train
from recsys_runner.train.signals import Interrupted
from tests.conftest import TINY, LogWarnings, hint_of, run_in_process
from tests.test_checkpoint import RESUMABLE, history
from tests.test_evaluate import _training_overrides, compose_entry
from tests.test_mlflow_model import ATOL, _click_rows, _scores, _trained

FP16 = "precision.embedding_data_type=fp16"
MIXED = "+precision.embedding_data_type_by_feature={cat_0: fp16, cat_3: fp16}"
"""Two of DeepFM's 26 features in fp16: their embedding and first-order tables (4 of 52), the others float32."""


def table_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of every embedding table of a sharded model, by state-dict key (copies)."""
    out = {}
    for key, value in model.state_dict().items():
        if key.endswith(".weight") and (".embedding_bags." in key or ".embeddings." in key):
            local = value.local_shards()[0].tensor if hasattr(value, "local_shards") else value
            out[key] = local.detach().clone()
    return out


def saved_table_dtypes(checkpoint: Path) -> set[torch.dtype]:
    """The dtypes of the embedding tables checkpoint ``checkpoint`` holds, as DCP recorded them."""
    saved = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {m.properties.dtype for k, m in saved.items() if k.startswith("model/") and ".embedding_bags." in k}


@pytest.mark.parametrize("optim", ["adagrad", "rowwise_adagrad", "sgd"])
def test_fp16_tables_train_on_cpu_with_each_fused_optimizer_it_has(make_cfg, optim: str) -> None:
    with LogWarnings() as warned:
        c = build(validate(make_cfg(f"optim={optim}", FP16, "train.num_steps=4", "tracking=none", "checkpoint=none")))
    assert any(m.startswith("precision.embedding_data_type=fp16 on CPU: fbgemm's CPU kernels round every embedding update to "
                            "the nearest fp16") for m in warned.messages), warned.messages
    try:
        sharded = c.loop.evaluator.model
        before = table_weights(sharded)
        assert len(before) == 52 and {t.dtype for t in before.values()} == {torch.float16}  # DeepFM: 26 + 26 first-order
        kernels = {p.compute_kernel for m in c.plan.plan.values() if isinstance(m, EmbeddingModuleShardingPlan) for p in m.values()}
        assert kernels == {"fused"}, kernels  # fbgemm's kernel, its weights_precision fp16
        assert c.distributed.summary.startswith("sharding plan: 52 tables on 1 rank: 52 table_wise (fused kernel); 52 tables in fp16; est.")
        train(c.loop)
        after = table_weights(sharded)
        assert {t.dtype for t in after.values()} == {torch.float16}
        assert all(torch.isfinite(t).all() for t in after.values())
        assert all(not torch.equal(before[k], after[k]) for k in after), "every table was looked up and updated"
        states = [v for state in c.loop.stepper.optimizer.state_dict()["state"].values() for v in state.values()
                  if isinstance(v, torch.Tensor) or hasattr(v, "local_shards")]
        local = [s.local_shards()[0].tensor if hasattr(s, "local_shards") else s for s in states]
        assert {t.dtype for t in local if t.numel() > 1} == (set() if optim == "sgd" else {torch.float32})  # state stays fp32
    finally:
        c.close()


def test_default_tables_stay_float32(make_cfg) -> None:
    with LogWarnings() as warned:
        c = build(validate(make_cfg("train.num_steps=1", "tracking=none", "checkpoint=none")))
    assert not any("embedding_data_type" in m for m in warned.messages), warned.messages
    try:
        assert {t.dtype for t in table_weights(c.loop.evaluator.model).values()} == {torch.float32}
        assert "in fp16" not in c.distributed.summary
    finally:
        c.close()


def test_on_cpu_an_update_below_half_an_fp16_step_is_lost_as_the_warning_says(make_cfg) -> None:
    # SGD moves a row by lr * its gradient: at 1e-5 that is far below an fp16 step of weights around 0.01-0.1, where fp32
    # still moves (only weights near 0 have steps that fine); fbgemm's CPU kernels round to the nearest fp16 (no stochastic rounding), so the fp16 tables stay as they were
    moved = {}
    for dtype in ("fp32", "fp16"):
        c = build(validate(make_cfg("optim=sgd", "optim.sparse.lr=1e-5", f"precision.embedding_data_type={dtype}",
                                    "train.num_steps=2", "tracking=none", "checkpoint=none")))
        try:
            before = table_weights(c.loop.evaluator.model)
            train(c.loop)
            after = table_weights(c.loop.evaluator.model)
            moved[dtype] = sum(int((before[k] != after[k]).sum()) for k in after)
        finally:
            c.close()
    assert moved["fp32"] > 1000 and moved["fp16"] < moved["fp32"] / 10, moved  # measured: 133096 vs 3688 (weights near 0)


def test_the_plan_budgets_fp16_tables_at_half_their_fp32_size_and_their_state_in_float32(make_cfg) -> None:
    sizes = ("data.num_embeddings=100000", "optim=sgd")  # tables dominate; SGD keeps no state (the state is float32 either way)
    wide, half = dry_run(make_cfg(*sizes)), dry_run(make_cfg(*sizes, FP16))
    assert wide.fits and half.fits
    assert half.ranks[0].ddr / wide.ranks[0].ddr == pytest.approx(0.5, abs=0.01)
    assert "; 52 tables in fp16; est." in str(half) and "in fp16" not in str(wide)
    # fbgemm keeps the optimizer state in float32 (measured: test_the_bench_measures_half_the_table_bytes_...): exact
    # Adagrad's state is one float32 per weight, so fp16 tables + state are 3/4 of fp32 ones, not the 1/2 TorchRec counts
    wide, half = dry_run(make_cfg(sizes[0], "optim=adagrad")), dry_run(make_cfg(sizes[0], "optim=adagrad", FP16))
    assert half.ranks[0].ddr / wide.ranks[0].ddr == pytest.approx(0.75, abs=0.01)


def test_bf16_and_unknown_table_types_are_refused_with_the_fix(make_cfg) -> None:
    with pytest.raises(ConfigError, match=r"precision.embedding_data_type=bf16 is not offered: fbgemm-gpu-cpu 1.8's CPU kernels "
                                          r"have no bfloat16 table.*Fix: precision.embedding_data_type=fp16"):
        validate(make_cfg("precision.embedding_data_type=bf16"))
    with pytest.raises(ConfigError, match=r"precision.embedding_data_type='FP16' is not one of \['fp32', 'fp16'\]. Fix: "):
        validate(make_cfg("precision.embedding_data_type=FP16"))


def test_fp16_tables_under_an_optimizer_with_state_are_never_data_parallel(make_cfg) -> None:
    # measured: data_parallel runs torch's Adagrad on the replicated fp16 table, whose eps rounds to 0 in fp16, and the
    # loss is NaN within 5 steps; the fused kernels keep the state in float32
    constraints = table_constraints(DistributedConfig(), ["t_a", "t_b"], world_size=1, half={"t_a"})
    assert constraints is not None
    assert constraints["t_a"].sharding_types == ["table_wise"] and constraints["t_b"].sharding_types == ["table_wise", "data_parallel"]
    with pytest.raises(ConfigError, match=r"table 't_cat_0' is stored in fp16 \(precision.embedding_data_type, or "
                                          r"embedding_data_type_by_feature for its features\) and trained by an optimizer with "
                                          r"state, which cannot be sharded data_parallel.*Fix: .*or fp32 for its features "
                                          r"\(precision.embedding_data_type / embedding_data_type_by_feature\), or optim/sparse=sgd"):
        build(validate(make_cfg(FP16, "distributed.sharding_types=[data_parallel]", "tracking=none", "checkpoint=none")))
    # SGD keeps no state: its data_parallel fp16 tables train
    c = build(validate(make_cfg(FP16, "optim=sgd", "distributed.sharding_types=[data_parallel]", "train.num_steps=3",
                                "tracking=none", "checkpoint=none")))
    try:
        assert "52 data_parallel (dense kernel); 52 tables in fp16" in c.distributed.summary
        train(c.loop)
        assert all(t.dtype == torch.float16 and torch.isfinite(t).all() for t in table_weights(c.loop.evaluator.model).values())
    finally:
        c.close()


@pytest.mark.parametrize(("tables", "saved"), [(FP16, {torch.float16}), (MIXED, {torch.float16, torch.float32})], ids=["fp16", "mixed"])
def test_fp16_tables_resume_exactly(make_cfg, mlflow_uri: str, tmp_path: Path, tables: str, saved: set[torch.dtype]) -> None:
    name = tables.rsplit(".", 1)[-1].split("=")[0]
    straight = make_cfg(*RESUMABLE, tables, f"checkpoint.dir={tmp_path}/a", f"tracking.experiment={name}_straight")
    run(straight)
    sliced = make_cfg(*RESUMABLE, tables, f"checkpoint.dir={tmp_path}/b", f"tracking.experiment={name}_sliced", "train.stop_after_steps=6")
    with pytest.raises(Interrupted, match="after step 6"):
        run(sliced)
    assert saved_table_dtypes(tmp_path / "b" / "step_00000006") == saved
    run(sliced)
    expected, resumed = history(mlflow_uri, f"{name}_straight"), history(mlflow_uri, f"{name}_sliced")
    assert sorted(resumed) == list(range(1, 13))
    assert resumed == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_a_resume_that_changes_the_table_type_converts_them_and_says_so(tmp_path: Path) -> None:
    argv = ["python", "-m", "recsys_runner", *[a for a in TINY if not a.startswith("train.num_steps")], "train.num_steps=6",
            "train.stop_after_steps=2", "tracking=none"]
    first = run_in_process(argv, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    command = hint_of(first.stderr)
    assert command is not None, first.stderr[-2000:]
    ckpt = Path(next(a for a in command if a.startswith("checkpoint.dir=")).split("=", 1)[1])
    assert saved_table_dtypes(ckpt / "step_00000002") == {torch.float32}
    for now, before, step, dtype, how in (("fp16", "fp32", 4, torch.float16, "to fp16 every weight is rounded"),
                                          ("fp32", "fp16", 6, torch.float32, "to fp32 they widen exactly")):
        resumed = run_in_process([*command, f"precision.embedding_data_type={now}"], tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        said = resumed.stdout + resumed.stderr
        assert (f"with changed settings: precision.embedding_data_type: {before} -> {now} (the checkpoint's embedding tables are "
                f"converted as they load: to fp16 every weight is rounded to 11 significant bits, to fp32 they widen exactly") in said, said[-3000:]
        assert how in said
        assert saved_table_dtypes(ckpt / f"step_{step:08d}") == {dtype}


def test_evaluate_scores_an_fp16_checkpoint_as_training_did(make_cfg, tmp_path: Path) -> None:
    extra = (FP16, "train.eval_max_batches=5", f"checkpoint.dir={tmp_path}/ck")
    overrides = _training_overrides(make_cfg, *extra)
    run(make_cfg(*extra))
    client = MlflowClient(tracking_uri=make_cfg().tracking.uri)
    (trained,) = client.search_runs([client.get_experiment_by_name(make_cfg().tracking.experiment).experiment_id])
    final = {k: v for k, v in trained.data.metrics.items() if k.startswith("eval/")}
    assert evaluate.run(compose_entry("evaluate", *overrides, f"load={tmp_path}/ck")) == final  # exactly


@pytest.mark.parametrize(("tables", "saved"), [(FP16, {torch.float16}),
                                               ("+precision.embedding_data_type_by_feature={tags: fp16}", {torch.float16, torch.float32})],
                         ids=["fp16", "mixed"])
def test_predict_and_the_exported_mlflow_model_score_an_fp16_checkpoint_alike(tmp_path: Path, tables: str,
                                                                             saved: set[torch.dtype]) -> None:
    # multi-hot tags: an fp16 nn.EmbeddingBag would round each pooled sum to fp16, where fbgemm's kernel (predict's) pools
    # in float32; export widens the tables to float32 (exact), so the served scores are predict's
    import mlflow.pyfunc
    import pandas as pd

    rng = np.random.default_rng(0)
    header = "click,user,item,price,tags"
    (tmp_path / "train.csv").write_text("\n".join([header, *_click_rows(rng, 3000, [f"u{k}" for k in range(50)])]) + "\n")
    (tmp_path / "score.csv").write_text("\n".join([header, *_click_rows(rng, 300, [f"u{k}" for k in range(40, 70)])]) + "\n")
    data = ["data=csv", f"data.path={tmp_path}/train.csv", "data.batch_size=128", "data.sparse=[{name: user}, {name: item}, "
            "{name: tags, separator: '|', pooling: mean}]", "data.dense=[{name: price, normalize: zscore}]", "data.label=click",
            "model=deepfm", "distributed.device=cpu", "tracking=none", tables]
    with LogWarnings() as warned:
        trained: dict[str, Any] = _trained(tmp_path, data, 20)
        assert saved_table_dtypes(trained["checkpoint"]) == saved
        reference = _scores(data, trained["checkpoint"], tmp_path / "score.csv", tmp_path / "predicted")["score"].to_numpy()
    assert not any("converted as they load" in m for m in warned.messages), warned.messages  # export widens by design
    served = mlflow.pyfunc.load_model(str(trained["model"])).predict(pd.read_csv(tmp_path / "score.csv", dtype=str))["score"]
    np.testing.assert_allclose(served.to_numpy(), reference, atol=ATOL)
    program = torch.export.load(str(trained["model"].parent / MODEL_FILE))
    assert {t.dtype for t in program.state_dict.values() if t.is_floating_point()} == {torch.float32}


def test_the_bench_measures_half_the_table_bytes_and_the_same_float32_state() -> None:
    result = bench_table_dtype(["data.num_embeddings=1000", "distributed.device=cpu"], steps=20, rounds=1)
    wide, half = result["types"]["fp32"], result["types"]["fp16"]
    assert half["weights"] * 2 == wide["weights"] == 26 * 1000 * (16 + 4) * 4  # 26 tables of 16 floats and 26 of 4, float32
    assert half["state"] == wide["state"] == wide["weights"]  # exact Adagrad: one float32 per weight, whatever the table holds
    assert "52 tables in fp16" in half["plan"] and half["samples_per_s"] > 0 and wide["samples_per_s"] > 0


def test_a_checkpoint_from_before_the_setting_resumes_as_fp32_without_a_warning() -> None:
    path = Path("/ck/step_00000004")
    older = resume_changes.Launched([], {"model": "deepfm", "optim.lr": 0.05}, "/a")  # its composed config has no such key
    assert resume_changes.check_changes(older, resume_changes.Launched([], {"model": "deepfm", "optim.lr": 0.05,
                                                            "precision.embedding_data_type": "fp32"}, "/a"), path) == ()
    (change,) = resume_changes.check_changes(older, resume_changes.Launched([], {"model": "deepfm", "optim.lr": 0.05,
                                                                 "precision.embedding_data_type": "fp16"}, "/a"), path)
    assert change.line().startswith("precision.embedding_data_type: fp32 -> fp16 (the checkpoint's embedding tables are converted")


# -- per feature: precision.embedding_data_type_by_feature -----------------------------------------------------------
def test_each_table_takes_the_type_of_the_features_reading_it_and_trains(make_cfg) -> None:
    with LogWarnings() as warned:
        c = build(validate(make_cfg(MIXED, "train.num_steps=3", "tracking=none", "checkpoint=none")))
    assert any(m.startswith("fp16 tables of precision.embedding_data_type_by_feature on CPU: fbgemm's CPU kernels round")
               for m in warned.messages), warned.messages
    try:
        before = table_weights(c.loop.evaluator.model)
        half = {k.rsplit(".", 2)[-2] for k, t in before.items() if t.dtype == torch.float16}
        assert half == {"t_cat_0", "t_cat_3", "first_order_t_cat_0", "first_order_t_cat_3"}, half
        assert {t.dtype for t in before.values()} == {torch.float16, torch.float32}
        assert "52 table_wise (fused kernel); 4 tables in fp16; est." in c.distributed.summary
        train(c.loop)
        after = table_weights(c.loop.evaluator.model)
        assert all(after[k].dtype == before[k].dtype and torch.isfinite(after[k]).all() for k in after)
        assert all(not torch.equal(before[k], after[k]) for k in after), "every table was looked up and updated"
    finally:
        c.close()


def test_a_feature_named_in_the_mapping_overrides_the_global_type_both_ways(make_cfg) -> None:
    c = build(validate(make_cfg(FP16, "+precision.embedding_data_type_by_feature={cat_5: fp32}", "train.num_steps=1",
                                "tracking=none", "checkpoint=none")))
    try:
        wide = {k.rsplit(".", 2)[-2] for k, t in table_weights(c.loop.evaluator.model).items() if t.dtype == torch.float32}
        assert wide == {"t_cat_5", "first_order_t_cat_5"}, wide
    finally:
        c.close()


def test_an_unknown_feature_a_bf16_one_and_a_shared_table_of_two_types_are_refused_with_the_fix(make_cfg) -> None:
    with pytest.raises(ConfigError, match=r"precision.embedding_data_type_by_feature names 'cat0' \(closest: cat_0\), which the "
                                          r"data has no sparse feature of; its sparse features: cat_0, cat_1, .*Fix: name one"):
        dry_run(make_cfg("+precision.embedding_data_type_by_feature={cat0: fp16}"))
    with pytest.raises(ConfigError, match=r"precision.embedding_data_type_by_feature.cat_1=bf16 is not offered: .*Fix: "
                                          r"precision.embedding_data_type_by_feature.cat_1=fp16"):
        validate(make_cfg("+precision.embedding_data_type_by_feature={cat_1: bf16}"))
    with pytest.raises(ConfigError, match=r"embedding_data_type_by_feature.cat_1='half' is not one of \['fp32', 'fp16'\]"):
        validate(make_cfg("+precision.embedding_data_type_by_feature={cat_1: half}"))
    precision = validate(make_cfg("+precision.embedding_data_type_by_feature={item_id: fp16, hist_item_id: fp32}")).precision
    assert precision.table_data_type("t_user", ["user_id"]) == DataType.FP32
    assert precision.table_data_type("item", ["item_id", "candidate"]) == DataType.FP16  # an unnamed reader takes the named one's
    with pytest.raises(ConfigError, match=r"gives table 'item' more than one type: item_id: fp16, hist_item_id: fp32; the "
                                          r"features \['item_id', 'hist_item_id'\] share its rows. Fix: give them one type"):
        precision.table_data_type("item", ["item_id", "hist_item_id"])


def test_the_plan_and_the_data_parallel_refusal_hold_per_table(make_cfg) -> None:
    # 13 of 26 features in fp16 under exact Adagrad: half the tables at 3/4 of their fp32 bytes (the state stays float32)
    sizes = ("data.num_embeddings=100000", "optim=adagrad")
    some = "+precision.embedding_data_type_by_feature={" + ", ".join(f"cat_{i}: fp16" for i in range(13)) + "}"
    wide, mixed = dry_run(make_cfg(*sizes)), dry_run(make_cfg(*sizes, some))
    assert mixed.ranks[0].ddr / wide.ranks[0].ddr == pytest.approx(0.875, abs=0.01)
    assert "; 26 tables in fp16; est." in str(mixed)
    with pytest.raises(ConfigError, match=r"table 't_cat_0' is stored in fp16 .* cannot be sharded data_parallel"):
        build(validate(make_cfg(MIXED, "distributed.sharding_types=[data_parallel]", "tracking=none", "checkpoint=none")))


# -- converting stored tables, loudly ---------------------------------------------------------------------------------
def _conversions(messages: list[str]) -> list[str]:
    return [m for m in messages if "converted as they load" in m]


def test_evaluate_and_init_from_that_convert_the_stored_tables_say_which_and_how(make_cfg, tmp_path: Path) -> None:
    extra = ("train.num_steps=4", "train.eval_max_batches=2", f"checkpoint.dir={tmp_path}/ck")
    overrides = _training_overrides(make_cfg, *extra)
    run(make_cfg(*extra))
    ckpt = tmp_path / "ck" / "step_00000004"
    assert saved_table_dtypes(ckpt) == {torch.float32}
    with LogWarnings() as warned:
        evaluate.run(compose_entry("evaluate", *overrides, f"load={ckpt}"))
    assert _conversions(warned.messages) == [], warned.messages  # loaded as stored: nothing to say
    with LogWarnings() as warned:
        evaluate.run(compose_entry("evaluate", *overrides, f"load={ckpt}", MIXED))
    (said,) = _conversions(warned.messages)
    assert said.startswith(f"loading {ckpt}: its embedding tables are stored in other types than this run's "
                           f"precision.embedding_data_type / embedding_data_type_by_feature, and are converted as they load: "
                           f"fp32 -> fp16: "), said
    assert "(4 tables) (to fp16 every weight is rounded to 11 significant bits" in said
    assert "scores may differ slightly from the stored run's" in said and "t_cat_1," not in said
    assert {"t_cat_0", "t_cat_3", "first_order_t_cat_0", "first_order_t_cat_3"} <= set(said.replace(",", " ").split())
    with LogWarnings() as warned:
        run(make_cfg("train.num_steps=2", FP16, f"checkpoint.init_from={ckpt}", f"checkpoint.dir={tmp_path}/ft", "tracking=none"))
    (said,) = _conversions(warned.messages)
    assert said.startswith(f"init_from {ckpt}: its embedding tables are stored in other types") and "fp32 -> fp16: " in said
    assert "(52 tables)" in said, said
    assert saved_table_dtypes(tmp_path / "ft" / "step_00000002") == {torch.float16}


def test_a_resume_that_changes_a_feature_s_table_type_warns_as_one_that_changes_every_table() -> None:
    path, before = Path("/ck/step_00000004"), {"model": "deepfm", "precision.embedding_data_type": "fp32"}
    saved = resume_changes.Launched([], before, "/a")
    assert resume_changes.check_changes(saved, resume_changes.Launched([], dict(before), "/a"), path) == ()  # an empty mapping: no key either side
    (change,) = resume_changes.check_changes(saved, resume_changes.Launched([], before | {"precision.embedding_data_type_by_feature.cat_0": "fp16"},
                                                            "/a"), path)
    assert change.line() == ("precision.embedding_data_type_by_feature.cat_0: (unset) -> fp16 (the checkpoint's embedding tables "
                             "are converted as they load: to fp16 every weight is rounded to 11 significant bits, to fp32 they "
                             "widen exactly; their optimizer state is float32 either way and loads as it was)")
