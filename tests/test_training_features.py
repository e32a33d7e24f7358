"""Precision, accumulation, clipping, EMA, early stopping, NaN guard, profiling, the debug presets, signals."""

from __future__ import annotations

import json
import math
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow.tracking import MlflowClient
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineBase
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.__main__ import run
from recsys_runner.build import build
from recsys_runner.checkpoint.guard import NonFiniteLossError
from recsys_runner.checkpoint.storage import is_complete, list_checkpoints
from recsys_runner.config import validate
from recsys_runner.runtime import Launch
from recsys_runner.train.ema import DenseEMA
from recsys_runner.train.signals import Interrupted
from recsys_runner.train.stepping import LeanPipeline, PolicyPipelineBase, PolicyPipelineSparseDist
from tests.conftest import TINY, LogWarnings, hint_of, run_in_process, signal_in_process


def the_run(uri: str, experiment: str):
    client = MlflowClient(tracking_uri=uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, mlrun


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_trains(make_cfg, mlflow_uri: str, precision: str) -> None:
    cfg = make_cfg(f"precision={precision}", "optim/sparse=rowwise_adagrad", "optim/dense=adam", "optim.dense.lr=0.01")
    auc = run(cfg)
    assert auc > 0.55  # fp16's first steps can overflow and be skipped while the loss scale settles
    client, mlrun = the_run(mlflow_uri, cfg.tracking.experiment)
    losses = [m.value for m in sorted(client.get_metric_history(mlrun.info.run_id, "train/loss"), key=lambda m: m.step)]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_fp16_scaler_settings_reach_the_grad_scaler(make_cfg) -> None:
    cfg = make_cfg("precision=fp16", "precision.grad_scaler.init_scale=1024", "precision.grad_scaler.growth_interval=7", "tracking=none")
    c = build(validate(cfg))
    try:
        policy = c.loop.stepper.policy
        assert policy.scaler is not None and policy.scaler.get_scale() == 1024.0
        assert policy.scaler.get_growth_interval() == 7
        assert isinstance(c.loop.stepper.pipeline, LeanPipeline) and c.loop.stepper.pipeline.policy is policy
    finally:
        c.close()


def test_scaler_settings_with_loss_scaling_off_are_warned_about(make_cfg) -> None:
    # only fp16 (or enabled=true) scales the loss, so a migrated precision.grad_scaler.init_scale under bf16 was silently
    # unused
    with LogWarnings() as warned:
        build(validate(make_cfg("precision=bf16", "precision.grad_scaler.init_scale=1024", "tracking=none"))).close()
    assert any(m.startswith("precision.grad_scaler.init_scale=1024.0 does nothing: loss scaling is off with "
                            "precision.dtype=bf16") for m in warned.messages), warned.messages
    with LogWarnings() as warned:
        build(validate(make_cfg("precision=fp16", "precision.grad_scaler.init_scale=1024", "tracking=none"))).close()
    assert not any("loss scaling is off" in m for m in warned.messages), warned.messages


def _scaler_after(make_cfg, *overrides: str, steps: int, resumed_from: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The step policy's state after ``steps`` fp16 steps (after loading ``resumed_from`` first), and its scaler's."""
    c = build(validate(make_cfg("precision=fp16", *overrides, "tracking=none")))
    try:
        policy = c.loop.stepper.policy
        if resumed_from is not None:
            policy.load_state_dict(resumed_from)
        batches = iter([c.loop.data.batch(0, i) for i in range(steps)])  # type: ignore[attr-defined]
        c.loop.stepper.reset()
        for _ in range(steps):
            assert c.loop.stepper.step(batches) is not None
        assert policy.scaler is not None
        return policy.state_dict(), policy.scaler.state_dict()
    finally:
        c.close()


def test_a_resume_continues_the_loss_scale_under_the_new_grad_scaler_settings(make_cfg) -> None:
    # was: torch's GradScaler.load_state_dict put back the saved growth_factor / backoff_factor / growth_interval, so a
    # resume that changed them kept the old ones (while the resume warning said each change takes effect), and a count
    # of good steps past a lowered growth_interval never grew the scale again.
    saved, scaler = _scaler_after(make_cfg, "precision.grad_scaler.init_scale=1024", steps=5)
    assert scaler["_growth_tracker"] == 5 and scaler["growth_interval"] == 2000
    _, resumed = _scaler_after(make_cfg, "precision.grad_scaler.init_scale=1024", "precision.grad_scaler.growth_interval=3",
                               "precision.grad_scaler.growth_factor=4", steps=1, resumed_from=saved)
    # the count (5) is capped at 3 - 1: the first resumed good step grows the scale by the new factor, and counts anew
    assert resumed == {"scale": 1024.0 * 4, "growth_factor": 4.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 0}
    _, unchanged = _scaler_after(make_cfg, "precision.grad_scaler.init_scale=1024", steps=1, resumed_from=saved)
    assert unchanged == {**scaler, "_growth_tracker": 6}  # nothing changed: the saved state goes on
    _, restarted = _scaler_after(make_cfg, "precision.grad_scaler.init_scale=256", steps=1, resumed_from=saved)
    assert restarted["scale"] == 256.0 and restarted["_growth_tracker"] == 1  # a new init_scale starts the scale over


def test_accumulated_fp16_steps_unscale_and_update_the_scale_once_per_optimizer_step(make_cfg) -> None:
    # growth_interval=1 doubles the scale at every scaler.update(): 8 micro-batches of train.grad_accum_steps=4 are two
    # optimizer steps, so two updates (x4), not eight (x256); and the scaler steps the dense optimizers twice.
    c = build(validate(make_cfg("precision=fp16", "precision.grad_scaler.init_scale=64", "precision.grad_scaler.growth_interval=1",
                                "train.grad_accum_steps=4", "tracking=none")))
    try:
        policy = c.loop.stepper.policy
        assert policy.scaler is not None
        steps: list[int] = []
        original = policy.scaler.step
        policy.scaler.step = lambda optimizer, *a, **k: (steps.append(1), original(optimizer, *a, **k))[1]  # type: ignore[method-assign]
        batches = iter([c.loop.data.batch(0, i) for i in range(8)])  # type: ignore[attr-defined]
        c.loop.stepper.reset()
        for _ in range(2):
            assert c.loop.stepper.step(batches) is not None
        assert policy.scaler.get_scale() == 64.0 * 4 and len(steps) == 2
    finally:
        c.close()


FP16_RESUME = ["precision=fp16", "precision.grad_scaler.init_scale=1e6", "precision.grad_scaler.growth_interval=2", "optim/dense=adam",
               "optim.dense.lr=0.003", "train.num_steps=4", "train.log_every_steps=1", "train.eval_max_batches=1", "checkpoint.keep_last=1"]
"""A scale that overflows at first (steps 1 and 2 skipped, 1e6 -> 2.5e5, measured) and grows after 2 good steps (step 4):
a resume at step 2 that lost the scale would overflow and skip step 3 again, one that lost the count would not grow."""

FP16_RESUME_LOGGED = {"train/loss_scale": {1: 5e5, 2: 2.5e5, 3: 2.5e5, 4: 5e5}, "train/skipped_steps": {1: 1, 2: 2, 3: 2, 4: 2}}
"""What FP16_RESUME's run logs at each step: the scale after the step (the next step's), the dense steps skipped so far."""


def test_an_fp16_resume_continues_the_uninterrupted_runs_loss_scale(make_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    straight = make_cfg(*FP16_RESUME, f"checkpoint.dir={tmp_path}/a", "tracking.experiment=fp16_straight")
    run(straight)
    sliced = make_cfg(*FP16_RESUME, f"checkpoint.dir={tmp_path}/b", "tracking.experiment=fp16_sliced", "train.stop_after_steps=2")
    with pytest.raises(Interrupted, match="after step 2"):
        run(sliced)
    run(sliced)
    (a,), (b,) = list_checkpoints(tmp_path / "a"), list_checkpoints(tmp_path / "b")
    scalers = [torch.load(ckpt / "rank0.pt", weights_only=False)["objects"]["policy"]["scaler"] for ckpt in (a, b)]
    assert a.name == b.name == "step_00000004" and scalers[0] == scalers[1] == {
        "scale": 5e5, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2, "_growth_tracker": 0}, scalers
    client = MlflowClient(tracking_uri=mlflow_uri)
    runs = [the_run(mlflow_uri, cfg.tracking.experiment)[1].info.run_id for cfg in (straight, sliced)]
    losses = [{m.step: m.value for m in client.get_metric_history(r, "train/loss")} for r in runs]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6) and sorted(losses[1]) == list(range(1, 5))
    # the loss scale and the skipped steps are logged with the train metrics; the count goes on across the resume
    # (was: neither logged, so an fp16 run's skipped steps were invisible)
    for r in runs:
        assert {k: {m.step: m.value for m in client.get_metric_history(r, k)} for k in FP16_RESUME_LOGGED} == FP16_RESUME_LOGGED
    assert [torch.load(ckpt / "rank0.pt", weights_only=False)["objects"]["policy"]["skipped_steps"] for ckpt in (a, b)] == [2, 2]


def test_a_skipped_fp16_step_leaves_the_ema_and_advances_the_lr_schedule(make_cfg) -> None:
    # At a scale of 1e30 every fp16 step overflows and the GradScaler skips the dense step: the weights stay, so the EMA
    # must stay too (was: it moved towards the unchanged weights, here from zeros to half of them). The lr schedule
    # follows the run's step, skipped or not (docs/training.md): after two skipped steps the warmup is at its step 1.
    c = build(validate(make_cfg("precision=fp16", "precision.grad_scaler.init_scale=1e30", "train.ema.decay=0.5",
                                "scheduler=constant", "scheduler.warmup_steps=4", "optim.dense.lr=0.1", "tracking=none")))
    try:
        policy, stepper = c.loop.stepper.policy, c.loop.stepper
        assert policy.ema is not None and policy.loss_scaling is not None
        for shadow in policy.ema.shadow:
            shadow.zero_()
        before = [p.detach().clone() for p in policy.ema.params]
        batches = iter([c.loop.data.batch(0, i) for i in range(2)])  # type: ignore[attr-defined]
        stepper.reset()
        for _ in range(2):
            assert stepper.step(batches) is not None
        assert policy.loss_scaling.skipped_steps == 2 and stepper.loss_scale() == pytest.approx({"train/loss_scale": 2.5e29, "train/skipped_steps": 2.0})
        assert all(torch.equal(p, b) for p, b in zip(policy.ema.params, before, strict=True))
        assert all(not s.any() for s in policy.ema.shadow)
        assert stepper.lr_scheduler.last_epoch == 2 and stepper.learning_rates()["lr/dense"] == pytest.approx(0.1 * 1 / 4)
    finally:
        c.close()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_clipping_bounds_the_true_dense_gradients_under_loss_scaling(make_cfg, precision: str) -> None:
    # fp16's dense gradients are scaled by 65536 until the scaler unscales them: clipping them before that would clip
    # the scaled norm to train.clip_grad.max, and the step would be 65536 times too small. With SGD at lr 1 one step
    # moves the dense weights by exactly the clipped gradient: its norm must be train.clip_grad.max in fp16 as in fp32.
    c = build(validate(make_cfg(f"precision={precision}", "train.clip_grad.max=0.001", "optim=sgd", "optim.dense.lr=1.0",
                                "optim.sparse.lr=1e-30", "scheduler=constant", "tracking=none")))
    try:
        before = [p.detach().clone() for name, p in c.loop.evaluator.model.named_parameters() if "embedding" not in name]
        c.loop.stepper.pipeline.progress(iter([c.loop.data.batch(0, 0)]))  # type: ignore[attr-defined]
        after = [p.detach() for name, p in c.loop.evaluator.model.named_parameters() if "embedding" not in name]
        moved = float(torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(after, before, strict=True))))
        assert (c.loop.stepper.policy.scaler is not None) == (precision == "fp16")
        assert moved == pytest.approx(0.001, rel=1e-3)
    finally:
        c.close()


def test_fp16_gradient_norm_summaries_are_of_the_unscaled_gradients(make_cfg, mlflow_uri: str) -> None:
    # grad_norm/dense and grad_norm/sparse are documented as taken after fp16 unscaling: at step 1 (the weights as
    # initialized, the same batch) they must be fp32's, not 256 times them. The summary's hook on the embedding outputs
    # sees the gradient below the loss scaler's unscaling (it is prepended), the dense one after the scaler's step.
    norms = {}
    for precision in ("fp32", "fp16"):
        cfg = make_cfg(f"precision={precision}", "precision.grad_scaler.init_scale=256", "train.num_steps=1",
                       "train.summary_every_steps=1", f"tracking.experiment=grad_norms_{precision}")
        run(cfg)
        client, mlrun = the_run(mlflow_uri, cfg.tracking.experiment)
        norms[precision] = {k: mlrun.data.metrics[k] for k in ("grad_norm/dense", "grad_norm/sparse")}
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=1e-2), norms


def _concat(batches: list[Batch]) -> Batch:
    jts = [b.sparse_features.to_dict() for b in batches]
    merged = {}
    for key in jts[0]:
        values = torch.cat([jt[key].values() for jt in jts])
        lengths = torch.cat([jt[key].lengths() for jt in jts])
        merged[key] = (values, lengths)
    keys = list(merged)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat([merged[k][0] for k in keys]), lengths=torch.cat([merged[k][1] for k in keys]))
    return Batch(dense_features=torch.cat([b.dense_features for b in batches]), sparse_features=kjt,
                 labels=torch.cat([b.labels for b in batches]))


@pytest.mark.parametrize("pipeline", ["base", "sparse_dist"])
def test_dense_accumulation_equals_one_large_batch(make_cfg, pipeline: str) -> None:
    # The fused sparse optimizer updates in every micro-batch by design; with a vanishing sparse lr
    # the embeddings stay put and the dense step must equal one step on the concatenated batch.
    common = ["optim=sgd", "optim.dense.lr=0.5", "optim.sparse.lr=1e-30", "tracking=none", "train.clip_grad.max=0.5",
              f"distributed.pipeline={pipeline}"]
    small = make_cfg(*common, "data.batch_size=64", "train.grad_accum_steps=4")
    large = make_cfg(*common, "data.batch_size=256")
    c_small, c_large = build(validate(small)), build(validate(large))
    try:
        micro = [c_small.loop.data.batch(0, i) for i in range(4)]  # type: ignore[attr-defined]
        it = iter(micro)
        for _ in range(4):
            c_small.loop.stepper.pipeline.progress(it)
        c_large.loop.stepper.pipeline.progress(iter([_concat(micro)]))
        for (name, a), (_, b) in zip(c_small.loop.evaluator.model.named_parameters(), c_large.loop.evaluator.model.named_parameters(), strict=True):
            if "embedding" not in name:
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name
    finally:
        c_small.close()
        c_large.close()


def _policy_run(make_cfg, *overrides: str, steps: int = 8, torchrec_base: bool = False,
                tiny: bool = True) -> tuple[list[float], list[torch.Tensor], Any]:
    """Per-batch losses, the dense parameters after ``steps`` batches, and the step policy's pipeline class;
    ``torchrec_base``: through TorchRec's TrainPipelineBase (what ``base`` is on a GPU) instead of the built one;
    ``tiny``: on top of the TINY settings (of the click data; a sequence model's data takes its own)."""
    cfg = make_cfg(*overrides, "tracking=none", tiny=tiny)
    c = build(validate(cfg))
    try:
        if torchrec_base:
            policy, model = c.loop.stepper.policy, c.loop.evaluator.model
            c.loop.stepper.pipeline = (PolicyPipelineBase(model, policy, torch.device("cpu")) if policy.active
                                       else TrainPipelineBase(model, policy.dense, torch.device("cpu")))
        batches = iter([c.loop.data.batch(0, i) for i in range(steps)])  # type: ignore[attr-defined]
        losses = [float(c.loop.stepper.pipeline.progress(batches)[0]) for _ in range(steps)]
        dense = [p.detach().clone() for name, p in c.loop.evaluator.model.named_parameters() if "embedding" not in name]
        return losses, dense, type(c.loop.stepper.pipeline)
    finally:
        c.close()


def test_both_pipelines_run_the_step_policy_alike_on_cpu(make_cfg) -> None:
    # Accumulation, fp16 loss scaling, clipping and EMA go through TrainPipelineBase and
    # TrainPipelineSparseDist subclasses; on one CPU rank both must train identically.
    common = ["precision=fp16", "train.grad_accum_steps=2", "train.clip_grad.max=0.5", "train.ema.decay=0.9"]
    base = _policy_run(make_cfg, *common, "distributed.pipeline=base")
    sparse_dist = _policy_run(make_cfg, *common, "distributed.pipeline=sparse_dist")
    assert base[2] is LeanPipeline and sparse_dist[2] is PolicyPipelineSparseDist
    assert sparse_dist[0] == pytest.approx(base[0], rel=1e-6)
    for a, b in zip(base[1], sparse_dist[1], strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("policy", [[], ["train.grad_accum_steps=2", "train.clip_grad.max=0.5", "train.ema.decay=0.9"]],
                         ids=["plain", "policy"])
def test_the_lean_pipeline_trains_exactly_as_torchrecs_base_pipeline(make_cfg, policy: list[str]) -> None:
    # On a CPU, distributed.pipeline=base is LeanPipeline (no per-batch device copy or profiler ranges);
    # it must be the same computation as TorchRec's TrainPipelineBase, bit for bit.
    lean = _policy_run(make_cfg, *policy, "distributed.pipeline=base")
    torchrec = _policy_run(make_cfg, *policy, "distributed.pipeline=base", torchrec_base=True)
    assert lean[2] is LeanPipeline and torchrec[2] in (TrainPipelineBase, PolicyPipelineBase)
    assert lean[0] == torchrec[0]
    for a, b in zip(lean[1], torchrec[1], strict=True):
        assert torch.equal(a, b)


SEQUENCES = ["model=sasrec", "data=synthetic_sequences", "data.num_items=2000", "data.max_len=20", "data.batch_size=128",
             "data.num_train_rows=2048", "model.embedding_dim=32", "distributed.device=cpu"]
"""A small SASRec on CPU (without the TINY settings of the click data)."""


@pytest.mark.parametrize("model", [["model=wide_deep"], [*SEQUENCES, "precision.grad_scaler.init_scale=256"]],
                         ids=["wide_deep", "sasrec"])
def test_fp16_unscales_every_embedding_lookup(make_cfg, model: list[str]) -> None:
    # wide_deep's wide part has an EmbeddingBagCollection of its own, outside SparseArch: its fused
    # SGD update must see the true gradient too, or the loss explodes by the loss scale (65536).
    # sasrec's EmbeddingCollection gives {feature: JaggedTensor}: was a TypeError at the first step, so precision=fp16
    # failed with every sequence model (SASRec, HSTU, DIN, MIND, BST). Its first step overflows at the default scale of
    # 65536 and is skipped (the dense part then diverges from fp32's path); at 256 none does, and fp16 follows fp32 closely.
    tiny = "model=sasrec" not in model
    fp32 = _policy_run(make_cfg, *model, "optim=sgd", "precision=fp32", steps=6, tiny=tiny)[0]
    fp16 = _policy_run(make_cfg, *model, "optim=sgd", "precision=fp16", steps=6, tiny=tiny)[0]
    assert fp16 == pytest.approx(fp32, rel=0.05)


def _step_of_each_tensor(make_cfg, *overrides: str) -> dict[str, torch.Tensor]:
    """What one optimizer step (fused SGD, lr pushed) changed of each floating tensor of the model's state."""
    c = build(validate(make_cfg("optim=sgd", "scheduler=constant", "tracking=none", *overrides)))
    try:
        def state() -> dict[str, torch.Tensor]:
            return {k: (v.local_shards()[0].tensor if hasattr(v, "local_shards") else v).detach().clone()  # one rank: whole
                    for k, v in c.loop.evaluator.model.state_dict().items() if v.is_floating_point()}
        before = state()
        c.loop.stepper.reset()
        assert c.loop.stepper.step(iter([c.loop.data.batch(0, 0)])) is not None  # type: ignore[attr-defined]
        return {k: v - before[k] for k, v in state().items()}
    finally:
        c.close()


MANAGED = "data.managed_collision={features: [cat_0, cat_1], input_hash_size: 1000000, eviction_interval: 2}"


@pytest.mark.parametrize("tables", [["distributed.sharding_types=[data_parallel]"], ["data.num_embeddings=100", MANAGED]],
                         ids=["data_parallel", "managed_collision"])
def test_loss_scaling_gives_every_table_its_true_gradient(make_cfg, tables: list[str]) -> None:
    # In float32 a loss scale of 256 is exact arithmetic: one step with the scaler on must move every table and dense
    # weight as without it. Was: data_parallel tables (trained by the dense optimizer) had their gradient unscaled twice,
    # by the embedding hook and by the GradScaler, and moved 1/256 as far (1/65536 at fp16's default scale) — the planner
    # picks data_parallel for small tables, here DeepFM's first-order ones at 100 rows; a managed-collision collection's
    # (tensor, remapped ids) output was a TypeError under fp16.
    plain = _step_of_each_tensor(make_cfg, *tables)
    scaled = _step_of_each_tensor(make_cfg, *tables, "precision.grad_scaler.enabled=true", "precision.grad_scaler.init_scale=256")
    assert any("first_order" in k and float(v.norm()) > 0 for k, v in plain.items())
    for key, moved in plain.items():
        assert torch.allclose(scaled[key], moved, rtol=1e-4, atol=1e-9), key


def test_ema_follows_its_formula_and_can_evaluate(make_cfg) -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    ema = DenseEMA({"p": p}, decay=0.9)
    with torch.no_grad():
        p.fill_(1.0)
    ema.update()
    ema.update()
    assert torch.allclose(ema.shadow[0], torch.full((2,), 1 - 0.9**2))
    with ema.swapped_in():
        assert torch.allclose(p, torch.full((2,), 0.19))
    assert torch.allclose(p, torch.ones(2))
    assert run(make_cfg("train.ema.decay=0.9", "train.ema.eval_with_ema=true", "tracking=none")) > 0.55


def test_init_from_a_checkpoint_without_ema_starts_the_average_at_the_loaded_weights(make_cfg, tmp_path: Path) -> None:
    """Fine-tuning with train.ema.decay from a run that had none (the usual order: a baseline, then a tuned run) crashed
    with a KeyError inside DenseEMA.load_state_dict; an average kept at its fresh (random) weights would have scored an
    untrained model under eval_with_ema. It starts at the weights loaded: with a negligible lr the fine-tune's first EMA
    eval is the checkpoint's own."""
    source = run(make_cfg("tracking=none", f"checkpoint.dir={tmp_path}/base"))
    tuned = run(make_cfg("tracking=none", f"checkpoint.dir={tmp_path}/tuned", f"checkpoint.init_from={tmp_path}/base",
                         "train.ema.decay=0.999", "train.ema.eval_with_ema=true", "optim.lr=1e-9", "train.num_steps=1",
                         "train.sanity_eval_batches=0"))
    assert tuned == pytest.approx(source, abs=1e-4)


def test_early_stopping_stops_after_patience(make_cfg, mlflow_uri: str) -> None:
    cfg = make_cfg("train.num_steps=30", "train.eval_every_steps=5", "train.eval_max_batches=2",
                   "train.early_stopping.patience=2", "train.early_stopping.min_delta=1.0")  # nothing improves by 1.0
    run(cfg)
    client, mlrun = the_run(mlflow_uri, cfg.tracking.experiment)
    evals = sorted(m.step for m in client.get_metric_history(mlrun.info.run_id, "eval/auc"))
    assert evals == [5, 10, 15]  # the first eval sets the best; two without improvement stop it


def test_nan_guard_stops_and_sets_aside_checkpoints_no_finite_loss_followed(make_cfg, tmp_path: Path, mlflow_uri: str) -> None:
    cfg = make_cfg("optim=sgd", "optim.lr=1e30", "train.log_every_steps=1", "checkpoint.every_steps=1", f"checkpoint.dir={tmp_path}")
    # The first update already diverges: step 1's checkpoint is what produced step 2's NaN, so it is not "good".
    # (test_run_safety.py::test_nan_guard_hint_resumes_from_a_truly_good_checkpoint covers a good one being named.)
    with pytest.raises(NonFiniteLossError, match=r"train loss is (nan|inf) at step 2; training stopped \(no good checkpoint exists\)"):
        run(cfg)
    assert list_checkpoints(tmp_path) == [] and is_complete(tmp_path / "diverged-step_00000001")
    _, mlrun = the_run(mlflow_uri, cfg.tracking.experiment)
    assert mlrun.info.status == "FAILED"


def test_profile_preset_stores_a_trace(make_cfg, mlflow_uri: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The trace is kept in the run's folder, where a log line says it is, as well as in MLflow: only rank 0 logs to
    MLflow, so a trace kept only as an artifact (written into a temporary folder first, and left there) was lost on
    every other rank and with tracking=none."""
    cfg = make_cfg("debug=profile", "train.profile.wait=1", "train.profile.active=2", "train.num_steps=6", "train.log_every_steps=3")
    with caplog.at_level("INFO", logger="recsys_runner.train.profiling"):
        run(cfg, launch=Launch(output_dir=tmp_path))  # a CLI launch's run folder
    client, mlrun = the_run(mlflow_uri, cfg.tracking.experiment)
    names = {a.path for a in client.list_artifacts(mlrun.info.run_id, "profile")}
    assert {"profile/trace_rank0.json", "profile/key_averages.txt", "profile/breakdown.txt"} <= names
    folder = tmp_path / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["breakdown_rank0.txt", "key_averages_rank0.txt", "trace_rank0.json"]
    assert json.loads((folder / "trace_rank0.json").read_text())["traceEvents"]
    assert f"profile: rank 0's trace of steps 4-5 written to {folder / 'trace_rank0.json'} (open it in" in caplog.text


@pytest.mark.parametrize("preset", ["debug=fast", "debug=overfit"])
def test_debug_presets_compose(make_cfg, preset: str) -> None:
    """The debug presets compose and validate, and check only a few eval batches and nothing at the end. The experiment
    presets' best metric and one epoch: tests/test_presets.py (test_every_preset_composes_and_validates)."""
    spec = validate(make_cfg(preset, tiny=False))
    assert spec.checkpoint.at_end is False and spec.train.eval_max_batches == 2


@pytest.mark.slow
def test_sigterm_checkpoints_and_the_printed_command_resumes_into_the_same_run(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    num_steps = 60  # the signal comes at step 5: ~55 steps (each logged to MLflow) for it to land before the end
    args = [*[a for a in TINY if not a.startswith("train.")], f"train.num_steps={num_steps}", "train.log_every_steps=1",
            "train.eval_every_steps=null", "train.eval_max_batches=2", f"tracking.uri={uri}", "tracking.experiment=sigterm"]
    # in this process as python -m runs it, a real SIGTERM sent by another thread at the step 5 line (signal_in_process)
    code, out, _ = signal_in_process([sys.executable, "-m", "recsys_runner", *args], tmp_path, f"step 5/{num_steps}", signal.SIGTERM, 0.0)
    assert code == 128 + signal.SIGTERM, out
    command = hint_of(out)  # the default checkpoint dir is this launch's Hydra run dir: the hint names it
    assert command is not None, out[-2000:]
    ckpt_dir = Path(next(a for a in command if a.startswith("checkpoint.dir=")).split("=", 1)[1])
    (ckpt,) = list_checkpoints(ckpt_dir)
    stopped_at = int(ckpt.name.split("_")[1])
    client = MlflowClient(tracking_uri=uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("sigterm").experiment_id])
    assert mlrun.info.status == "KILLED"

    again = run_in_process(command, tmp_path)  # as python -m runs it, without its imports (run as typed: test_run_safety)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {ckpt}" in again.stderr + again.stdout
    (mlrun,) = client.search_runs([client.get_experiment_by_name("sigterm").experiment_id])
    assert mlrun.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(mlrun.info.run_id, "train/loss"))
    assert 5 <= stopped_at < num_steps and steps == list(range(1, num_steps + 1)), (stopped_at, steps[:10])


def _embedding_rows_after(make_cfg, *overrides: str, steps: int = 12) -> list[torch.Tensor]:
    """The embedding tables after ``steps`` optimizer steps driven by the loop's Stepper (scheduler and lr pushes included)."""
    c = build(validate(make_cfg("scheduler=cosine", "scheduler.warmup_steps=5", "train.num_steps=12", *overrides, "tracking=none")))
    try:
        batches = iter([c.loop.data.batch(0, i) for i in range(steps)])  # type: ignore[attr-defined]
        c.loop.stepper.reset()
        for _ in range(steps):
            assert c.loop.stepper.step(batches) is not None
        tables = [t for name, t in c.loop.evaluator.model.state_dict().items() if "embedding_bags" in name]
        return [(t.local_shards()[0].tensor if hasattr(t, "local_shards") else t).detach().clone() for t in tables]  # one rank: the whole table
    finally:
        c.close()


def test_the_sparse_lr_reaches_the_kernels_as_when_pushed_every_step(make_cfg) -> None:
    # The Stepper pushes the fused optimizer's lr only when the schedule changes it; an active step policy
    # (here clipping at a bound no gradient reaches: numerically a no-op) makes the pipeline step the fused
    # optimizer, i.e. push it, every batch. With a warmup + cosine schedule the lr changes every step, so any
    # push that came late or not at all would show in the embedding rows.
    pushed_on_change = _embedding_rows_after(make_cfg)
    pushed_every_step = _embedding_rows_after(make_cfg, "train.clip_grad.max=1e9")
    assert len(pushed_on_change) > 0
    for a, b in zip(pushed_on_change, pushed_every_step, strict=True):
        assert torch.equal(a, b)
    constant_lr = _embedding_rows_after(make_cfg, "scheduler=constant")
    assert not all(torch.equal(a, b) for a, b in zip(pushed_on_change, constant_lr, strict=True))  # the schedule mattered


def _tables_after_micro_batches(make_cfg, *overrides: str, micro_batches: int = 4) -> list[torch.Tensor]:
    """The embedding tables after ``micro_batches`` batches of 64 rows through the pipeline (dense lr vanishing)."""
    c = build(validate(make_cfg(*overrides, "optim.dense.lr=1e-30", "optim.sparse.lr=0.1", "data.batch_size=64",
                                "scheduler=constant", "tracking=none")))
    try:
        batches = iter([c.loop.data.batch(0, i) for i in range(micro_batches)])  # type: ignore[attr-defined]
        c.loop.stepper.reset()
        for _ in range(micro_batches):
            c.loop.stepper.pipeline.progress(batches)
        tables = [t for name, t in c.loop.evaluator.model.state_dict().items() if "embedding_bags" in name]
        return [(t.local_shards()[0].tensor if hasattr(t, "local_shards") else t).detach().clone() for t in tables]
    finally:
        c.close()


def test_accumulation_leaves_adaptive_sparse_updates_as_without_it(make_cfg) -> None:
    # The fused kernels update the rows at every micro-batch. Row-wise Adagrad normalizes the gradient, so the loss's
    # 1/N cancels: 4 micro-batches with train.grad_accum_steps=4 move the tables as 4 plain steps do (the docs once said
    # "1/N-sized updates"), and the run must say so. SGD's updates do shrink by 1/N (and it gets no warning).
    start = _tables_after_micro_batches(make_cfg, micro_batches=0)
    with LogWarnings() as warned:
        accumulated = _tables_after_micro_batches(make_cfg, "optim/sparse=rowwise_adagrad", "train.grad_accum_steps=4")
    assert any("the fused RowWiseAdagrad still updates the embedding tables at every micro-batch" in m for m in warned.messages)
    plain = _tables_after_micro_batches(make_cfg, "optim/sparse=rowwise_adagrad")
    for a, p, s in zip(accumulated, plain, start, strict=True):
        assert torch.allclose(a, p, atol=1e-2 * float((p - s).abs().max())), "Adagrad's accumulated step differs from plain steps"
    with LogWarnings() as warned:
        sgd_accumulated = _tables_after_micro_batches(make_cfg, "optim/sparse=sgd", "train.grad_accum_steps=4")
    assert not any("grad_accum_steps" in m for m in warned.messages), warned.messages
    sgd_plain = _tables_after_micro_batches(make_cfg, "optim/sparse=sgd")
    moved = [float(sum((t - s).norm() for t, s in zip(tables, start, strict=True))) for tables in (sgd_accumulated, sgd_plain)]
    assert moved[0] == pytest.approx(moved[1] / 4, rel=0.1), moved


def test_an_accumulated_steps_loss_is_its_whole_batchs(make_cfg) -> None:
    # was: Stepper.step returned the last micro-batch's loss, so train/loss (and the NaN guard before a checkpoint) saw
    # 1/N of the rows: a NaN in an earlier micro-batch, which poisons the shared dense step, went unnoticed. The step's
    # loss is now the mean over its micro-batches: the loss of the concatenated batch (lrs vanishing, nothing moves).
    common = ["optim=sgd", "optim.lr=1e-30", "tracking=none", "scheduler=constant"]
    small = build(validate(make_cfg(*common, "data.batch_size=64", "train.grad_accum_steps=4")))
    large = build(validate(make_cfg(*common, "data.batch_size=256")))
    try:
        micro = [small.loop.data.batch(0, i) for i in range(4)]  # type: ignore[attr-defined]
        small.loop.stepper.reset()
        large.loop.stepper.reset()
        accumulated = small.loop.stepper.step(iter(micro))
        whole = large.loop.stepper.step(iter([_concat(micro)]))
        assert accumulated is not None and whole is not None
        assert float(accumulated) == pytest.approx(float(whole), rel=1e-5)
    finally:
        small.close()
        large.close()


def test_a_run_not_in_float32_says_its_precision_once_at_start() -> None:
    # bf16/fp16 showed only in the MLflow params: nothing in the log said the run computed in half precision
    from recsys_runner.train.precision import PrecisionConfig

    cpu = torch.device("cpu")
    assert PrecisionConfig().build().line(cpu) is None  # float32 throughout: nothing to say
    assert PrecisionConfig(dtype="bf16").build().line(cpu) == (
        "precision: dense compute bf16 (autocast on cpu; weights and optimizer fp32), embedding tables fp32, loss scaling off")
    assert PrecisionConfig(dtype="fp16").build().line(cpu).endswith("loss scaling on")
    assert "embedding tables fp16" in PrecisionConfig(embedding_data_type="fp16").build().line(cpu)
