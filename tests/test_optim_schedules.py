"""Optimizers and lr schedules: closed forms, per-group schedules, part-wise optimizers, clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from mlflow.tracking import MlflowClient

from recsys_runner.__main__ import run
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.errors import ConfigError
from recsys_runner.optim.optimizers import DENSE, SPARSE, GroupedOptimizer, OptimizerGroup, dense_optimizers
from recsys_runner.optim.schedulers import (
    Constant,
    ConstantConfig,
    Cosine,
    CosineConfig,
    CosineRestarts,
    CosineRestartsConfig,
    ExponentialDecay,
    ExponentialDecayConfig,
    ManualStepConfig,
    lr_scheduler,
)
from recsys_runner.train.stepping import learning_rates

T = 100


def warm(step: int, n: int, start: float) -> float:
    return start + (1 - start) * step / n


@pytest.mark.parametrize(
    ("schedule", "closed_form"),
    [
        (Constant(make(ConstantConfig, warmup_steps=10, warmup_start=0.1), total_steps=T), lambda s: warm(s, 10, 0.1) if s < 10 else 1.0),
        (ExponentialDecay(make(ExponentialDecayConfig, decay_steps=20, decay_rate=0.5), total_steps=T), lambda s: 0.5 ** (s / 20)),
        (ExponentialDecay(make(ExponentialDecayConfig, decay_steps=20, decay_rate=0.5, staircase=True, min_factor=0.2, warmup_steps=5),
                          total_steps=T),
         lambda s: warm(s, 5, 0.0) if s < 5 else max(0.2, 0.5 ** math.floor((s - 5) / 20))),
        (Cosine(make(CosineConfig, warmup_steps=10, min_factor=0.1), total_steps=T),
         lambda s: warm(s, 10, 0.0) if s < 10 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min((s - 10) / 90, 1)))),
        (CosineRestarts(make(CosineRestartsConfig, cycle_steps=10, cycle_mult=2), total_steps=T),  # cycles [0,10) [10,30) [30,70) [70,150)
         lambda s: 0.5 * (1 + math.cos(math.pi * next((s - a) / (b - a) for a, b in [(0, 10), (10, 30), (30, 70), (70, 150)] if a <= s < b)))),
        (make(ManualStepConfig, boundaries=[30, 60], rates=[1.0, 0.3, 0.05], warmup_steps=10).build(total_steps=T),
         lambda s: warm(s, 10, 0.0) if s < 10 else (1.0 if s - 10 < 30 else 0.3 if s - 10 < 60 else 0.05)),
        (ExponentialDecay(make(ExponentialDecayConfig, by_epoch=True, decay_steps=2, decay_rate=0.5), total_steps=T, steps_per_epoch=10),
         lambda s: 0.5 ** ((s // 10) / 2)),
    ],
    ids=["constant-warmup", "exp", "exp-staircase-min-warmup", "cosine", "cosine-restarts", "manual-step", "exp-by-epoch"],
)
def test_schedule_matches_closed_form(schedule, closed_form) -> None:
    for step in range(T):
        assert schedule(step) == pytest.approx(closed_form(step)), f"step {step}"


def lr_history(uri: str, experiment: str) -> dict[str, dict[int, float]]:
    client = MlflowClient(tracking_uri=uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {k: {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, k)}
            for k in mlrun.data.metrics if k.startswith("lr/")}


def test_sparse_dense_and_part_have_their_own_lrs_and_schedules(make_cfg, mlflow_uri: str) -> None:
    cfg = make_cfg(
        "optim=sgd", "optim.sparse.lr=0.2", "optim.dense.lr=0.05",
        "+optim.parts.over={pattern: 'deep[.]0', optimizer: {_target_: torch.optim.SGD, lr: 0.01, momentum: 0.9}}",
        "+scheduler@optim.sparse_scheduler=exponential_decay", "optim.sparse_scheduler.warmup_steps=0", "optim.sparse_scheduler.decay_steps=10",
        "+scheduler@optim.parts.over.scheduler=manual_step", "optim.parts.over.scheduler.boundaries=[15]",
        "optim.parts.over.scheduler.rates=[1.0,0.1]",
    )
    assert math.isfinite(run(cfg))
    lrs = lr_history(mlflow_uri, cfg.tracking.experiment)
    assert set(lrs) == {"lr/sparse", "lr/dense", "lr/part.over"}
    assert lrs["lr/sparse"][30] == pytest.approx(0.2 * 0.5 ** (29 / 10))  # its own exponential decay; step 30 trains at t=29
    assert lrs["lr/dense"][30] == pytest.approx(0.05)  # the default (constant) schedule
    assert lrs["lr/part.over"][10] == pytest.approx(0.01) and lrs["lr/part.over"][20] == pytest.approx(0.001)


def test_the_logged_lr_is_the_lr_the_step_trained_with(make_cfg, mlflow_uri: str) -> None:
    # was: the loop logged the groups' lr after the scheduler stepped, i.e. the *next* step's: with a warmup from 0 the
    # log said step 1 trained at lr/4 while it trained at 0. Step s trains at base * schedule(s - 1); the summaries'
    # lrs (on steps that are not log steps) must agree with it too.
    cfg = make_cfg("optim=sgd", "optim.lr=0.4", "scheduler=constant", "scheduler.warmup_steps=4", "scheduler.warmup_start=0",
                   "train.num_steps=6", "train.log_every_steps=2", "train.summary_every_steps=1")
    assert math.isfinite(run(cfg))
    lrs = lr_history(mlflow_uri, cfg.tracking.experiment)
    expected = {1: 0.0, 2: 0.1, 3: 0.2, 4: 0.3, 5: 0.4, 6: 0.4}
    for key in ("lr/sparse", "lr/dense"):
        assert lrs[key] == pytest.approx(expected), key


def test_part_patterns_route_parameters_first_match_wins() -> None:
    params = {n: torch.nn.Parameter(torch.zeros(1)) for n in ["deep.w", "over_arch.w", "over_arch.b", "fm.w"]}
    sgd = lambda ps: torch.optim.SGD(ps.values(), lr=0.1)  # noqa: E731
    groups = dict(dense_optimizers(params, sgd, {"over": ("over_arch", sgd), "deep": (r"^deep\.", sgd)}))
    assert set(groups[OptimizerGroup.part("over")].params) == {"over_arch.w", "over_arch.b"}
    assert set(groups[OptimizerGroup.part("deep")].params) == {"deep.w"}
    assert set(groups[DENSE].params) == {"fm.w"}
    assert DENSE not in dict(dense_optimizers(params, sgd, {"all": (".", sgd)}))
    with pytest.raises(ConfigError, match="matches no dense parameter"):
        dense_optimizers(params, sgd, {"none": ("nothing_like_this", sgd)})


def test_optimizer_groups_keep_the_key_strings_of_checkpoints_and_lr_metrics() -> None:
    """``sparse``, ``dense``, ``part.<name>``: existing checkpoints (``optim/<key>.<param>/…``) and logged
    ``lr/<key>`` names depend on these exact strings."""
    assert (SPARSE.key, DENSE.key, OptimizerGroup.part("over").key) == ("sparse", "dense", "part.over")
    params = {n: torch.nn.Parameter(torch.ones(1)) for n in ["over_arch.w", "fm.w"]}
    adagrad = lambda ps: torch.optim.Adagrad(ps.values(), lr=0.1)  # noqa: E731
    optimizer = GroupedOptimizer(dense_optimizers(params, adagrad, {"over": ("over_arch", adagrad)}))
    assert [group for group, _ in optimizer.groups] == [OptimizerGroup.part("over"), DENSE]
    assert [key for key, _ in optimizer.optimizers] == ["part.over", "dense"]
    assert set(optimizer.state_dict()["state"]) == {"part.over.over_arch.w", "dense.fm.w"}
    scheduler = lr_scheduler(optimizer, {OptimizerGroup.part("over"): lambda step: 0.5}, lambda step: 1.0)
    assert learning_rates(optimizer) == {"lr/part.over": pytest.approx(0.05), "lr/dense": pytest.approx(0.1)}
    scheduler.step()
    assert learning_rates(optimizer) == {"lr/part.over": pytest.approx(0.05), "lr/dense": pytest.approx(0.1)}


@pytest.mark.parametrize(("config", "unmoved_steps"), [
    (ConstantConfig(warmup_steps=3, warmup_start=0.1), list(range(4, 40))),  # the warmup ends at step 3
    (ManualStepConfig(boundaries=[10, 25], rates=[1.0, 0.5, 0.1]), [s for s in range(2, 40) if s not in (10, 25)]),
    (CosineConfig(warmup_steps=5), []),
])
def test_scheduled_lr_steps_exactly_as_torchs_lambda_lr_and_says_when_it_moved(config, unmoved_steps: list[int]) -> None:
    """:class:`ScheduledLR` skips writing the lrs when no schedule moved them; the lrs, ``get_last_lr()`` and
    the state it would checkpoint stay those of torch's ``LambdaLR`` at every step, and ``moved`` is False exactly
    on the steps where the schedule stood still (then the fused kernels are not handed an lr). Its first step runs
    torch's own (with its optimizer-order check) and counts as moved."""
    def grouped() -> GroupedOptimizer:
        params = {n: torch.nn.Parameter(torch.ones(1)) for n in ["over_arch.w", "fm.w"]}
        sgd = lambda ps: torch.optim.SGD(ps.values(), lr=0.1)  # noqa: E731
        return GroupedOptimizer(dense_optimizers(params, sgd, {"over": ("over_arch", sgd)}))

    schedule = config.build(total_steps=40)
    ours_opt, theirs_opt = grouped(), grouped()
    ours = lr_scheduler(ours_opt, {OptimizerGroup.part("over"): lambda step: 0.5 * schedule(step)}, schedule)
    theirs = torch.optim.lr_scheduler.LambdaLR(theirs_opt, [lambda step: 0.5 * schedule(step), schedule])
    unmoved = []
    for step in range(1, 40):
        ours_opt.step()
        theirs_opt.step()
        ours.step()
        theirs.step()
        assert [g["lr"] for g in ours_opt.param_groups] == [g["lr"] for g in theirs_opt.param_groups], step
        assert ours.get_last_lr() == theirs.get_last_lr() and ours.last_epoch == theirs.last_epoch == step
        unmoved += [] if ours.moved else [step]
    assert unmoved == unmoved_steps
    state, reference = ours.state_dict(), theirs.state_dict()
    assert {k: v for k, v in state.items() if k != "lr_lambdas"} == {k: v for k, v in reference.items() if k != "lr_lambdas"}


@pytest.mark.parametrize("name", ["adam", "lamb", "lars_sgd", "partial_rowwise_adam", "partial_rowwise_lamb"])
def test_gpu_only_fused_optimizers_say_so_on_cpu(make_cfg, name: str) -> None:
    cfg = make_cfg(f"optim/sparse={name}")
    with pytest.raises(ConfigError, match="fbgemm implements only on GPU"):
        validate(cfg)


def test_lars_sgd_with_checkpoints_is_refused_on_cuda(make_cfg) -> None:
    from omegaconf import OmegaConf

    from recsys_runner.optim.sparse import check_sparse_on_device

    # validate() resolves distributed.device=cuda without touching a GPU
    with pytest.raises(ConfigError, match=r"optim/sparse=lars_sgd \(LarsSGD\) cannot be checkpointed: TorchRec cannot export its "
                                          r"optimizer state.*Fix: checkpoint=none, or another sparse optimizer"):
        validate(make_cfg("optim/sparse=lars_sgd", "distributed.device=cuda", "tracking=none"))
    for saving in ("checkpoint.every_steps=10", "checkpoint.best_metric=eval/auc"):
        with pytest.raises(ConfigError, match="cannot be checkpointed"):
            validate(make_cfg("optim/sparse=lars_sgd", "distributed.device=cuda", "checkpoint=none", saving, "tracking=none"))
    assert validate(make_cfg("optim/sparse=lars_sgd", "distributed.device=cuda", "checkpoint=none", "tracking=none"))
    assert validate(make_cfg("optim/sparse=lamb", "distributed.device=cuda", "tracking=none"))
    sparse = OmegaConf.to_object(make_cfg("optim/sparse=lars_sgd", "tracking=none").optim).sparse
    check_sparse_on_device(sparse, "cuda")  # no checkpoints: fine
    with pytest.raises(ConfigError, match="cannot be checkpointed"):
        check_sparse_on_device(sparse, "cuda", checkpoints=True)
    with pytest.raises(ConfigError, match="fbgemm implements only on GPU"):  # on CPU the missing kernel is the first problem
        check_sparse_on_device(sparse, "cpu", checkpoints=True)


def test_fused_kwargs_reach_fbgemm_as_its_enum(make_cfg) -> None:
    from omegaconf import OmegaConf

    from recsys_runner.optim.compat import WeightDecayMode
    from recsys_runner.optim.sparse import SparseLAMBConfig

    cfg = make_cfg("optim/sparse=lamb", "optim.sparse.weight_decay=0.01", "optim.sparse.weight_decay_mode=decouple",
                   "optim.sparse.gradient_clipping=true", "optim.sparse.max_gradient=5")
    sparse = OmegaConf.to_object(cfg.optim).sparse  # validate() stops here on CPU: LAMB is GPU only
    assert isinstance(sparse, SparseLAMBConfig) and sparse.optimizer_class().__name__ == "LAMB"
    kwargs = sparse.kwargs()
    assert kwargs["weight_decay_mode"] is WeightDecayMode.DECOUPLE and kwargs["max_gradient"] == 5.0 and kwargs["beta1"] == 0.9


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # A key the schema lacks: the project's check names it and the fix (without the +, Hydra refuses it earlier).
        (["+optim.sparse.bogus=1"], "unknown key optim.sparse.bogus. Fix: remove it"),
        (["scheduler=exponential_decay", "scheduler.decay_rate=-0.5"], "decay_rate must lie in"),
        (["optim.dense.weight_decay=-1"], "weight_decay must be >= 0"),
        (["optim/sparse=rowwise_adagrad", "optim.sparse.weight_decay=0.1"], "weight_decay_mode=none"),
        # the mode is right, but fbgemm's CPU kernel applies no weight decay at all (test_cpu_kernels_ignore_sparse_weight_decay)
        (["optim/sparse=rowwise_adagrad", "optim.sparse.weight_decay=0.1", "optim.sparse.weight_decay_mode=l2"],
         "fbgemm's CPU kernels (RowWiseAdagrad included) apply no weight decay"),
        # fbgemm's exact Adagrad kernel takes no weight decay; Adam's applies it decoupled whatever the mode says
        (["optim.sparse.weight_decay=0.1", "optim.sparse.weight_decay_mode=l2"], "Adagrad kernel has no weight decay"),
        (["optim/sparse=adam", "optim.sparse.weight_decay=0.1", "optim.sparse.weight_decay_mode=l2"],
         "Adam kernel ignores the mode and applies weight decay as decouple only"),
        (["optim/sparse=lars_sgd", "optim.sparse.weight_decay=0.1", "optim.sparse.weight_decay_mode=decouple"],
         "weight_decay_mode=l2"),
        (["scheduler=manual_step", "scheduler.boundaries=[5,3]", "scheduler.rates=[1,0.5,0.1]"], "strictly increasing"),
        # TorchEasyRec's learning_rates: one per size, lrs; here one more, multipliers
        (["scheduler=manual_step", "scheduler.boundaries=[5]", "scheduler.rates=[0.01]"],
         "rates are multipliers of the base lr, rates[0] before the first boundary (TorchEasyRec's learning_rates"),
        (["train.clip_grad.max=-1"], "clip_grad.max must be positive"),
        (["+optim.parts.x={pattern: '(', optimizer: {_target_: torch.optim.SGD}}"], "not a valid regular expression"),
        # a fused clipping bound without its switch trained unclipped, silently
        (["optim.sparse.max_gradient=0.5"], "optim.sparse.max_gradient=0.5 does nothing while optim.sparse.gradient_clipping is "
                                            "off (the bound applies only with the switch). Fix: optim.sparse.gradient_clipping=true"),
    ],
    ids=["unknown-key", "negative-decay", "negative-weight-decay", "decay-without-mode", "no-decay-on-cpu", "adagrad-has-no-decay", "adam-decays-decoupled",
         "lars-decays-l2", "boundaries", "rates-as-torcheasyrec-lrs", "clip", "bad-regex", "bound-without-clipping"],
)
def test_bad_settings_are_clear(make_cfg, overrides: list[str], message: str) -> None:
    cfg = make_cfg(*overrides)
    with pytest.raises(ConfigError) as raised:  # the project's own error, which the CLI prints as "Config error: ..."
        validate(cfg)
    assert message in str(raised.value), str(raised.value)


def test_warmup_longer_than_training_is_an_error(make_cfg) -> None:
    with pytest.raises(ConfigError, match="warmup_steps=100 exceeds the run's 30 training steps"):
        run(make_cfg("scheduler.warmup_steps=100", "tracking=none"))


SCHEDULE_OF_A_PART = "+optim.parts.deep={pattern: 'deep[.]', optimizer: {_target_: torch.optim.SGD}, scheduler: %s}"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+scheduler@optim.sparse_scheduler=exponential_decay", "optim.sparse_scheduler.decay_rate=2"],
         "optim.sparse_scheduler.decay_rate must lie in (0, 1], got 2.0; e.g. optim.sparse_scheduler.decay_rate=0.5"),
        (["+scheduler@optim.dense_scheduler=manual_step", "optim.dense_scheduler.rates=[1]"],
         "optim.dense_scheduler.rates needs one more entry than optim.dense_scheduler.boundaries"),
        ([SCHEDULE_OF_A_PART % "{_target_: recsys_runner.optim.schedulers.Cosine, warmup_start: 2}"],
         "optim.parts.deep.scheduler.warmup_start must lie in [0, 1], got 2"),
        (["scheduler=cosine", "scheduler.min_factor=2"], "Config error: scheduler.min_factor must lie in [0, 1]"),
    ],
    ids=["sparse", "dense", "part", "top-level"],
)
def test_a_group_schedules_mistake_names_its_own_key(make_cfg, overrides: list[str], message: str) -> None:
    # The schedules' checks are written for the top-level `scheduler`; in a group's slot they must name that slot's key,
    # or the fix they print (scheduler.decay_rate=0.5) would change another schedule and leave the mistake in place.
    with pytest.raises(ConfigError) as raised:
        validate(make_cfg(*overrides))
    assert message.removeprefix("Config error: ") in str(raised.value), str(raised.value)
    if not message.startswith("Config error: "):
        assert " scheduler." not in f" {raised.value}", str(raised.value)


def test_a_parts_optimizer_mistake_names_the_parts_key(make_cfg) -> None:
    # A part's optimizer is a DenseOptimizerConfig, whose checks name optim.dense.*: in a part they name the part's key
    with pytest.raises(ConfigError) as raised:
        validate(make_cfg("+optim.parts.deep={pattern: 'deep[.]', optimizer: {_target_: torch.optim.SGD, weight_decay: -1}}"))
    assert "optim.parts.deep.optimizer.weight_decay must be >= 0" in str(raised.value), str(raised.value)
    assert "optim.dense" not in str(raised.value), str(raised.value)
    with pytest.raises(ConfigError) as raised:  # checked when the part's parameters are known, as the model is built
        run(make_cfg("+optim.parts.deep={pattern: 'deep[.]', optimizer: {_target_: torch.optim.AdamW, no_decay_patterns: [nothing_here]}}",
                     "tracking=none"))
    assert "optim.parts.deep.optimizer.no_decay_patterns has 'nothing_here'" in str(raised.value), str(raised.value)
    assert "optim.dense" not in str(raised.value), str(raised.value)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [(["+scheduler@optim.sparse_scheduler=exponential_decay"], "optim.sparse_scheduler.warmup_steps"),
     ([SCHEDULE_OF_A_PART % "{_target_: recsys_runner.optim.schedulers.Constant, warmup_steps: 40}"], "optim.parts.deep.scheduler.warmup_steps")],
    ids=["sparse", "part"],
)
def test_a_group_schedules_warmup_longer_than_training_names_its_own_key(make_cfg, overrides: list[str], key: str) -> None:
    # exponential_decay's own warmup (100 steps) is longer than the 30 steps of the run: the key to lower is the group's
    with pytest.raises(ConfigError) as raised:
        run(make_cfg(*overrides, "tracking=none"))
    assert f"{key}=" in str(raised.value) and f"Fix: {key}<=30 " in str(raised.value), str(raised.value)


class TestSchedules:
    def test_constant_with_warmup(self) -> None:
        s = Constant(make(ConstantConfig, warmup_steps=10, warmup_start=0.1), total_steps=100)
        assert s(0) == pytest.approx(0.1)
        assert s(5) == pytest.approx(0.1 + 0.9 * 0.5)
        assert [s(t) for t in (10, 50, 99)] == [1.0, 1.0, 1.0]

    @pytest.mark.parametrize("staircase", [False, True])
    def test_exponential_decay_closed_form(self, staircase: bool) -> None:
        s = ExponentialDecay(make(ExponentialDecayConfig, decay_steps=100, decay_rate=0.5, staircase=staircase, min_factor=0.01,
                                  warmup_steps=20), total_steps=1000)
        for t in range(0, 1000, 7):
            if t < 20:
                expected = t / 20
            else:
                e = (t - 20) / 100
                expected = max(0.01, 0.5 ** (math.floor(e) if staircase else e))
            assert s(t) == pytest.approx(expected), t

    def test_cosine_closed_form(self) -> None:
        s = Cosine(make(CosineConfig, warmup_steps=10, min_factor=0.1), total_steps=110)
        assert s(0) == 0.0 and s(10) == pytest.approx(1.0)
        assert s(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
        assert s(110) == pytest.approx(0.1)

    def test_warmup_longer_than_training_is_an_error(self) -> None:
        with pytest.raises(ConfigError, match=r"scheduler.warmup_steps=200 exceeds the run's 100 training steps\. Fix: "
                                              r"scheduler.warmup_steps<=100 \(e.g. 10, a tenth of the run\), or train longer: "
                                              r"train.num_steps>=200$"):
            make(ConstantConfig, warmup_steps=200).build(total_steps=100)


@pytest.mark.parametrize("optimizer", ["EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD"])
def test_cpu_kernels_ignore_sparse_weight_decay(optimizer: str) -> None:
    # Why a sparse weight decay is refused on CPU: fbgemm's CPU kernels take the argument and do nothing with it, in
    # either mode. Two steps from rows of unequal magnitude, so that Adagrad's scale invariance cannot hide an L2 term.
    # If this starts failing, fbgemm has learnt weight decay on CPU and check_sparse_on_device may allow it.
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

    from recsys_runner.optim.compat import WeightDecayMode

    def row_after_two_steps(weight_decay: float, mode: WeightDecayMode) -> torch.Tensor:
        tbe = SplitTableBatchedEmbeddingBagsCodegen([(4, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                                    optimizer=EmbOptimType[optimizer], learning_rate=0.1,
                                                    weight_decay=weight_decay, weight_decay_mode=mode)
        with torch.no_grad():
            tbe.weights_host.copy_(torch.tensor([1.0, 10.0, 1.0, 10.0]).repeat(4))
        for _ in range(2):
            tbe(torch.tensor([1]), torch.tensor([0, 1])).sum().backward()
        return tbe.weights_host.detach().view(4, 4)[1].clone()

    plain = row_after_two_steps(0.0, WeightDecayMode.NONE)
    assert not torch.equal(plain, torch.tensor([1.0, 10.0, 1.0, 10.0]))  # the rows did train
    for mode in (WeightDecayMode.L2, WeightDecayMode.DECOUPLE):
        assert torch.equal(row_after_two_steps(0.5, mode), plain), mode
