"""Dense weight decay exclusions (``optim.dense.no_decay_1d``, ``optim.dense.no_decay_patterns``): the param groups of a
real composed model, the updates they make over real steps, a resume with them, and the settings that cannot work."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torchrec.optim.keyed import KeyedOptimizer

from recsys_runner.__main__ import run
from recsys_runner.build import build
from recsys_runner.checkpoint.resume_changes import treatment
from recsys_runner.config import validate
from recsys_runner.errors import ConfigError
from recsys_runner.optim.optimizers import DENSE, OptimizerGroup, decay_summary
from recsys_runner.train.signals import Interrupted
from tests.conftest import LogWarnings
from tests.test_checkpoint import history

# MaskNet has what the exclusions are for: Linear biases and LayerNorm weights and biases beside its matrices.
MASKNET = ["model=masknet", "tracking=none", "checkpoint=none"]


def dense_groups(optimizer: KeyedOptimizer) -> list[tuple[float, set[str]]]:
    """``(weight_decay, parameter names)`` of each param group of a keyed dense optimizer, in order."""
    name_of = {id(p): name for name, p in optimizer.params.items()}
    return [(group["weight_decay"], {name_of[id(p)] for p in group["params"]}) for group in optimizer.param_groups]


def built_dense_groups(make_cfg: Any, *overrides: str) -> tuple[list[tuple[float, set[str]]], dict[str, int]]:
    """The dense optimizer's groups (:func:`dense_groups`) of the built run, and every dense parameter's ``ndim``."""
    c = build(validate(make_cfg(*MASKNET, *overrides)))
    try:
        (group, optimizer), = c.loop.stepper.policy.dense.groups
        assert group == DENSE
        return dense_groups(optimizer), {name: p.ndim for name, p in optimizer.params.items()}
    finally:
        c.close()


def test_no_decay_1d_puts_biases_and_norm_weights_in_an_undecayed_group(make_cfg: Any) -> None:
    groups, ndim = built_dense_groups(make_cfg, "optim/dense=adamw", "optim.dense.no_decay_1d=true")
    (decay, decayed), (no_decay, excluded) = groups
    assert (decay, no_decay) == (0.01, 0.0)
    assert decayed == {n for n, d in ndim.items() if d >= 2} and excluded == {n for n, d in ndim.items() if d <= 1}
    assert any(n.endswith("norm.weight") for n in excluded) and any(n.endswith("norm.bias") for n in excluded)
    assert any(n.endswith(".bias") and "norm" not in n for n in excluded)
    # MaskNet's per-field LayerNorm keeps a [fields, D] gain and bias: matrices, so the ndim rule decays them (a pattern
    # excludes them, below); every other decayed tensor is a Linear weight
    assert {"model.field_norm.weight", "model.field_norm.bias"} <= decayed
    assert all(n.endswith(".weight") for n in decayed - {"model.field_norm.bias"})


def test_no_decay_patterns_exclude_by_name_only(make_cfg: Any) -> None:
    groups, ndim = built_dense_groups(make_cfg, "optim/dense=adamw", "optim.dense.weight_decay=0.05", "optim.dense.no_decay_patterns=[norm]")
    (decay, decayed), (no_decay, excluded) = groups
    assert (decay, no_decay) == (0.05, 0.0)
    assert excluded == {n for n in ndim if "norm" in n} and "model.field_norm.bias" in excluded
    assert any(n.endswith(".bias") for n in decayed)  # other biases keep their decay


def test_without_exclusions_every_parameter_is_decayed_as_before(make_cfg: Any) -> None:
    groups, ndim = built_dense_groups(make_cfg, "optim/dense=adamw")
    assert groups == [(0.01, set(ndim))]


def test_the_build_logs_how_many_tensors_are_decayed_and_excluded(make_cfg: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="recsys_runner"):
        _, ndim = built_dense_groups(make_cfg, "optim/dense=adamw", "optim.dense.no_decay_1d=true")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weight decay:")]
    matrices, vectors = sum(d >= 2 for d in ndim.values()), sum(d <= 1 for d in ndim.values())
    assert len(said) == 1 and f"dense decays {matrices} tensors (" in said[0] and f"by 0.01, excludes {vectors} (" in said[0], said


def test_over_real_steps_a_bias_is_not_decayed_while_a_weight_is(make_cfg: Any) -> None:
    """Plain SGD, ``p <- p - lr * (grad + wd * p)`` for a decayed parameter and ``p - lr * grad`` for an excluded one:
    checked on every dense tensor at each of 4 real steps, from its value and gradient just before the step."""
    lr, wd = 0.05, 0.5
    c = build(validate(make_cfg(*MASKNET, "optim=sgd", f"optim.dense.lr={lr}", f"optim.dense.weight_decay={wd}",
                                "optim.dense.no_decay_1d=true")))
    before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def remember(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if isinstance(optimizer, torch.optim.SGD):
            before.update({id(p): (p.detach().clone(), p.grad.detach().clone())
                           for g in optimizer.param_groups for p in g["params"] if p.grad is not None})

    handle = register_optimizer_step_pre_hook(remember)
    try:
        (_, optimizer), = c.loop.stepper.policy.dense.groups
        names = {id(p): n for n, p in optimizer.params.items()}
        batches = iter([c.loop.data.batch(0, i) for i in range(4)])  # type: ignore[attr-defined]
        decay_moved = {"weight": 0.0, "bias": 0.0}
        for _ in range(4):
            before.clear()
            assert c.loop.stepper.step(batches) is not None
            assert set(before) == set(names)
            for pid, (value, grad) in before.items():
                param = next(p for p in optimizer.params.values() if id(p) == pid)
                decayed = param.ndim >= 2
                expected = value - lr * (grad + wd * value) if decayed else value - lr * grad
                assert torch.allclose(param.detach(), expected, rtol=1e-5, atol=1e-7), names[pid]
                decay_moved["weight" if decayed else "bias"] += float((lr * wd * value).abs().sum())
        assert decay_moved["bias"] > 1e-2 and decay_moved["weight"] > 1e-2  # the decay term was not too small to see
    finally:
        handle.remove()
        c.close()


def test_resume_with_exclusions_gives_the_uninterrupted_loss_curve(make_cfg: Any, mlflow_uri: str, tmp_path: Path) -> None:
    """AdamW's moments of both groups are saved and restored: stopped after step 4 and resumed, every step's loss is the
    uninterrupted run's."""
    common = ["model=masknet", "optim=rowwise_adagrad", "optim/dense=adamw", "optim.dense.lr=0.003", "optim.dense.weight_decay=0.1",
              "optim.dense.no_decay_1d=true", "scheduler=cosine", "scheduler.warmup_steps=2", "train.num_steps=8", "train.log_every_steps=1"]
    run(make_cfg(*common, f"checkpoint.dir={tmp_path}/a", "tracking.experiment=wd_straight"))
    sliced = make_cfg(*common, f"checkpoint.dir={tmp_path}/b", "tracking.experiment=wd_sliced", "train.stop_after_steps=4")
    with pytest.raises(Interrupted, match="after step 4"):
        run(sliced)
    run(sliced)
    expected, resumed = history(mlflow_uri, "wd_straight"), history(mlflow_uri, "wd_sliced")
    assert sorted(resumed) == sorted(expected) == list(range(1, 9))
    for step in range(1, 9):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), f"step {step}: {resumed[step]} vs {expected[step]}"


def test_exclusions_without_weight_decay_are_warned_about_not_refused(make_cfg: Any) -> None:
    """A no-op, said once: a sweep over weight_decay that includes 0 keeps one set of exclusions for all its runs."""
    with LogWarnings() as warned:
        groups, ndim = built_dense_groups(make_cfg, "optim/dense=adam", "optim.dense.no_decay_1d=true")
    assert groups == [(0.0, set(ndim))]
    assert [m for m in warned.messages if "no_decay" in m] == [
        "optim.dense.no_decay_1d/no_decay_patterns do nothing: optim.dense.weight_decay=0, so no parameter is decayed. "
        "Set optim.dense.weight_decay (e.g. 0.01) for them to matter"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["+optim.parts.x={pattern: 'blocks[.]1', optimizer: {_target_: torch.optim.Rprop, weight_decay: 0.1}}"],
     r"optim\.parts\.x\.optimizer: .*torch\.optim\.Rprop takes no weight_decay argument.* Fix: optim\.parts\.x\.optimizer\.weight_decay=0"),
    (["+optim.parts.x={pattern: 'blocks[.]1', optimizer: {_target_: torch.optim.Rprop, no_decay_1d: true}}"],
     r"optim\.parts\.x\.optimizer: .*exclude parameters from the weight decay of torch\.optim\.Rprop, which has none"),
    (["optim.dense.no_decay_patterns=['(']"], r"optim\.dense\.no_decay_patterns has '\(', not a valid regular expression"),
], ids=["rprop-weight-decay", "rprop-exclusions", "bad-regex"])
def test_settings_that_cannot_work_are_refused_before_the_build(make_cfg: Any, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(*MASKNET, *overrides))


def test_a_pattern_matching_no_parameter_is_refused_at_the_build(make_cfg: Any) -> None:
    with pytest.raises(ConfigError, match=r"optim\.dense\.no_decay_patterns has 'layer_norm', which matches none of this optimizer's "
                                          r"\d+ parameters, e\.g\. \['model\.blocks"):
        built_dense_groups(make_cfg, "optim/dense=adamw", "optim.dense.no_decay_patterns=[layer_norm]")


def test_an_optimizer_without_weight_decay_trains_as_a_part(make_cfg: Any) -> None:
    """torch.optim.Rprop takes neither weight_decay nor a list default as a dataclass field would: its generated config
    (tuple defaults as list factories) builds it without the weight_decay it has no argument for."""
    c = build(validate(make_cfg(*MASKNET, "+optim.parts.x={pattern: 'blocks[.]1', optimizer: {_target_: torch.optim.Rprop}}")))
    try:
        groups = dict(c.loop.stepper.policy.dense.groups)
        assert list(groups[OptimizerGroup.part("x")].param_groups[0]["etas"]) == [0.5, 1.2]  # Rprop's, from its signature
        assert decay_summary(c.loop.stepper.policy.dense.groups) is None
        batches = iter([c.loop.data.batch(0, i) for i in range(2)])  # type: ignore[attr-defined]
        assert all(c.loop.stepper.step(batches) is not None for _ in range(2))
    finally:
        c.close()


def test_a_resume_that_changes_the_exclusions_is_warned_about_not_refused() -> None:
    """The groups are rebuilt from the resumed config (checkpoints hold the state per parameter name), so a changed
    exclusion takes effect from the resumed step, as a changed weight_decay does."""
    for key in ("optim.dense.no_decay_1d", "optim.dense.no_decay_patterns", "optim.parts.x.optimizer.no_decay_1d"):
        assert treatment(key) == treatment("optim.dense.weight_decay") and treatment(key)[0] == "warn", key
