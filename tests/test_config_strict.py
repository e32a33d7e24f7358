"""Nothing is silently ignored or checked late: unknown keys (even added with ``+``) and keys naming
an eval metric or a feature fail before the first step and before an MLflow run exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from recsys_runner.__main__ import run
from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.config_keys import TORCHEASYREC_KEYS
from recsys_runner.errors import ConfigError
from recsys_runner.metrics.tasks import eval_metric_keys
from recsys_runner.optim.config import PartConfig
from recsys_runner.optim.optimizers import DenseSGDConfig
from recsys_runner.optim.schedulers import ManualStepConfig
from tests.conftest import TINY, run_cli, run_in_process

STEP_LINE = re.compile(r"\bstep \d+/\d+")
"""A training log line (``step 10/30 train/loss=…``)."""


def _cli(tmp_path: Path, *overrides: str, process: bool = True) -> subprocess.CompletedProcess[str]:
    """The training command: a process, or (``process=False``) in this one as ``python -m`` runs it
    (:func:`tests.conftest.run_in_process`: the same exit status and output, without ~10 s of imports)."""
    args = [*TINY, f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.experiment=strict", "distributed.device=cpu", *overrides]
    if process:
        return run_cli(*args, cwd=tmp_path, timeout=300)
    return run_in_process([sys.executable, "-m", "recsys_runner", *args], tmp_path)


def _runs(tmp_path: Path) -> list[Any]:
    """The MLflow runs of experiment ``strict`` in ``tmp_path``'s store (none when no store was created)."""
    if not (tmp_path / "mlflow.db").exists():
        return []
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("strict")
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


def _assert_config_error(out: subprocess.CompletedProcess[str], *fragments: str) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert "Config error: " in out.stderr, text[-3000:]
    for fragment in fragments:
        assert fragment in out.stderr, f"{fragment!r} missing from:\n{out.stderr}"
    assert "Traceback" not in out.stderr


# ----- 3. unknown keys are errors, even with + ---------------------------------------------------


UNKNOWN_KEYS = {
    "top-level": ("+foo=1", ["unknown key foo.", "Fix: remove it", "the top-level keys are model, data, optim"]),
    "train": ("+train.num_step=5", ["unknown key train.num_step (did you mean train.num_steps?)", "Fix: set train.num_steps instead"]),
    "nested-group": ("+model.embeding_dim=8", ["unknown key model.embeding_dim (did you mean model.embedding_dim?)",
                                               "the keys of model are embedding_dim, dense_arch_layer_sizes, deep_layer_sizes"]),
}


def test_cli_rejects_unknown_keys_added_with_plus(tmp_path: Path) -> None:
    """One case through the CLI (exit 2, the one-line error, no step, no MLflow run); every case in-process below."""
    override, fragments = UNKNOWN_KEYS["train"]
    out = _cli(tmp_path, override)
    _assert_config_error(out, *fragments)
    assert not STEP_LINE.search(out.stdout + out.stderr)
    assert _runs(tmp_path) == []


@pytest.mark.parametrize("case", list(UNKNOWN_KEYS))
def test_unknown_keys_added_with_plus_are_refused_before_a_run_starts(make_cfg, mlflow_uri: str, case: str) -> None:
    override, fragments = UNKNOWN_KEYS[case]
    _assert_refused_before_a_run(make_cfg(override), mlflow_uri, fragments)


def _assert_refused_before_a_run(cfg: Any, mlflow_uri: str, fragments: list[str]) -> None:
    """What the CLI runs (``recsys_runner.__main__.run``: ``validate`` then ``build``) refuses ``cfg`` with a one-line
    :class:`ConfigError` holding ``fragments`` before the tracker starts a run, so before the first step."""
    with pytest.raises(ConfigError) as raised:
        run(cfg)
    message = f"{raised.value.label}: {raised.value}"
    assert message.startswith("Config error: ") and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from:\n{message}"
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    assert experiment is None or client.search_runs([experiment.experiment_id]) == [], "an MLflow run was created before the check"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+train.clip_grad.mx=1.0"], r"unknown key train.clip_grad.mx \(did you mean train.clip_grad.max\?\)"),
        (["+lr=0.1"], r"unknown key lr \(did you mean optim.lr\?\)"),
        # A structured value under an Any field is checked at its own level…
        (["+scheduler@optim.sparse_scheduler=cosine", "+optim.sparse_scheduler.warmup=5"],
         r"unknown key optim.sparse_scheduler.warmup \(did you mean optim.sparse_scheduler.warmup_steps\?\)"),
        # …and so is one inside a free-form map (optim.parts.<name> is free, its scheduler is a ManualStepConfig).
        (["+optim.parts.deep={pattern: 'deep[.]', optimizer: {_target_: torch.optim.SGD, lr: 0.1}}",
          "+scheduler@optim.parts.deep.scheduler=manual_step", "+optim.parts.deep.scheduler.boundary=[5]"],
         r"unknown key optim.parts.deep.scheduler.boundary \(did you mean optim.parts.deep.scheduler.boundaries\?\)"),
        (["+train.num_step=5", "+foo=1"], r"unknown key train.num_step .*Also unknown: foo\.$"),
        (["+train.fine_tune_checkpoint=/ckpt"], r"unknown key train.fine_tune_checkpoint: fine_tune_checkpoint is TorchEasyRec's "
                                                r"name; here it is checkpoint.init_from. Fix: checkpoint.init_from=/ckpt \("),
    ],
    ids=["nested-dataclass", "wrong-section", "any-field-value", "free-form-map-value", "several", "torcheasyrec-name"],
)
def test_validate_rejects_unknown_keys_at_every_level(make_cfg, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(*overrides, "tracking=none"))


def test_every_torcheasyrec_name_points_at_a_key_we_have(make_cfg) -> None:
    """Each whole key of ``TORCHEASYREC_KEYS`` (a fix the message prints) is one of the config's; a name in the same
    section is checked where it is used (``model.learning_rate`` has none: ``tests/test_cli.py``)."""
    configs = [make_cfg("tracking=none"), make_cfg("tracking=none", "data=parquet", tiny=False)]  # data.path: the file options' key
    for name, entry in TORCHEASYREC_KEYS.items():
        if "/" in entry.ours:
            assert entry.ours.replace("/", ".") in {"optim.sparse", "optim.dense"}, name
        elif "." in entry.ours or entry.top:
            assert any(OmegaConf.select(cfg, entry.ours, default="absent") != "absent" for cfg in configs), (name, entry.ours)


def test_free_form_map_entries_are_still_accepted(make_cfg) -> None:
    cfg = make_cfg(
        "+checkpoint.name_map.a=b",
        "+optim.parts.deep={pattern: 'deep[.]', optimizer: {_target_: torch.optim.SGD, _partial_: true, lr: 0.1}}",
        "+scheduler@optim.parts.deep.scheduler=manual_step",
        "+distributed.tables={t_cat_0: {sharding_types: [data_parallel]}}",
        "tracking=none",
    )
    run = validate(cfg)
    assert run.checkpoint.name_map == {"a": "b"}
    part = run.optim.parts["deep"]
    assert isinstance(part, PartConfig) and part.pattern == "deep[.]"
    # the old `_partial_: true` is still accepted; the optimizer is typed by its schema and inherits optim.lr only if unset
    assert isinstance(part.optimizer, DenseSGDConfig) and part.optimizer.lr == 0.1
    assert isinstance(part.scheduler, ManualStepConfig)
    assert run.distributed.tables["t_cat_0"].sharding_types == ["data_parallel"]


# ----- 4. every check before the first step -------------------------------------------------------


KEY_CHECKS = {
    "objective": (["train.objective=eval/nonexistent"],
                  ["train.objective='eval/nonexistent' is not an eval metric this run logs", "valid: eval/auc, eval/logloss"]),
    "best-metric": (["checkpoint.best_metric=eval/acu", "checkpoint.dir=ckpt"],
                    ["checkpoint.best_metric='eval/acu' is not an eval metric this run logs (closest: eval/auc)",
                     "valid: eval/auc, eval/logloss", "Fix: checkpoint.best_metric=eval/auc"]),
    "early-stopping-metric": (["train.early_stopping.patience=2", "train.eval_every_steps=10", "train.early_stopping.metric=eval/loglos"],
                              ["train.early_stopping.metric='eval/loglos' is not an eval metric this run logs (closest: eval/logloss)",
                               "Fix: train.early_stopping.metric=eval/logloss"]),
    # Early stopping off (no patience): a metric set for it is still checked, with how to turn it on.
    "early-stopping-off-metric": (["train.early_stopping.metric=eval/loglos"],
                                  ["train.early_stopping.metric='eval/loglos' is not an eval metric this run logs (closest: eval/logloss)",
                                   "Fix: train.early_stopping.metric=eval/logloss; early stopping is off until train.early_stopping.patience is set"]),
    # TorchEasyRec's metric name: the closest key logged was eval/auc, another metric
    "torcheasyrec-metric-name": (["checkpoint.best_metric=eval/grouped_auc", "checkpoint.dir=ckpt"],
                                 ["checkpoint.best_metric='eval/grouped_auc' names the metric as TorchEasyRec does; here it is "
                                  "eval/gauc, which this run does not log (it logs eval/auc, eval/logloss). Fix: add gauc to "
                                  "metrics.eval and set checkpoint.best_metric=eval/gauc"]),
    "grouping-key": (["metrics.eval=[auc,gauc]", "metrics.grouping_key=cat_00"],
                     ["metrics.grouping_key='cat_00' is not a sparse feature of the data (closest: cat_0)", "valid: cat_0, cat_1,"]),
    "multitask-objective": (["model=mmoe", "data=synthetic_multitask", "train.objective=eval/auc"],
                            ["train.objective='eval/auc' is not an eval metric this run logs", "valid: eval/ctr/auc, eval/ctr/logloss, "
                             "eval/cvr/auc, eval/cvr/logloss"]),
    # A two-tower model's task takes model.eval_metrics: metrics.eval would change nothing, silently.
    "eval-metrics-no-task-reads": (["model=dssm", "metrics.eval=[auc]"],
                                   ["metrics.eval=['auc'] has no effect: DSSM's tasks take their own eval metrics (its task: "
                                    "inbatch_recall@1,inbatch_recall@10,inbatch_recall@50)", "Fix: set them where the model takes them"]),
}
"""Keys naming an eval metric or a feature that the run would not log or read, with what the error must say."""


def test_cli_checks_metric_and_feature_keys_before_training(tmp_path: Path) -> None:
    """One case through the CLI (the other cases run in-process below, through the same ``validate`` + ``build``): exit 2,
    the one-line error, no training step and no MLflow run. In this process as ``python -m`` runs it (the command's own
    process: test_cli_rejects_unknown_keys_added_with_plus above, the same exit-2 path)."""
    overrides, fragments = KEY_CHECKS["best-metric"]
    out = _cli(tmp_path, *overrides, process=False)
    _assert_config_error(out, *fragments)
    assert not STEP_LINE.search(out.stdout + out.stderr), "training started before the check"
    assert _runs(tmp_path) == [], "an MLflow run was created before the check"


@pytest.mark.parametrize("case", list(KEY_CHECKS))
def test_metric_and_feature_keys_are_checked_before_a_run_starts(make_cfg, mlflow_uri: str, tmp_path: Path, case: str) -> None:
    """What the CLI runs (``recsys_runner.__main__.run``: ``validate`` then ``build``) refuses each case with its message
    before the tracker starts a run, so before the first step."""
    overrides, fragments = KEY_CHECKS[case]
    overrides = [f"checkpoint.dir={tmp_path}/ckpt" if o == "checkpoint.dir=ckpt" else o for o in overrides]
    _assert_refused_before_a_run(make_cfg(*overrides), mlflow_uri, fragments)


def test_early_stopping_metric_is_checked_when_set_even_with_early_stopping_off(make_cfg) -> None:
    """Unknown ``train.early_stopping.metric``: an error with ``patience`` set, and also without it when the metric was
    set (its default, which a regression model does not log, is then not checked); a known one without ``patience``
    is fine."""
    from recsys_runner.config_metrics import check_eval_keys
    from recsys_runner.tasks import SINGLE_TASK, RegressionTask

    tasks = SINGLE_TASK
    names = ["cat_0"]
    for extra in ([], ["train.early_stopping.patience=2", "train.eval_every_steps=10"]):
        with pytest.raises(ConfigError, match=r"train\.early_stopping\.metric='eval/nope' is not an eval metric"):
            check_eval_keys(validate(make_cfg("train.early_stopping.metric=eval/nope", *extra, "tracking=none")), tasks, names)
    check_eval_keys(validate(make_cfg("train.early_stopping.metric=eval/logloss", "tracking=none")), tasks, names)
    check_eval_keys(validate(make_cfg("train.objective=eval/mse", "tracking=none")), (RegressionTask(),), names)  # default: unchecked


def test_a_task_metric_of_a_multitask_model_is_accepted(make_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    """The keys of the check above, naming a task's metric, pass it and the run trains, evaluates and finishes (in-process:
    ``recsys_runner.__main__.run``, what the CLI calls)."""
    cfg = make_cfg("model=mmoe", "data=synthetic_multitask", "train.num_steps=10", "train.objective=eval/ctr/auc",
                   "train.eval_every_steps=5", "train.early_stopping.patience=3", "train.early_stopping.metric=eval/cvr/logloss",
                   "train.early_stopping.mode=min", "checkpoint.best_metric=eval/ctr/auc", f"checkpoint.dir={tmp_path}/ckpt")
    objective = run(cfg)
    client = MlflowClient(tracking_uri=mlflow_uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    assert mlrun.info.status == "FINISHED" and objective == pytest.approx(mlrun.data.metrics["eval/ctr/auc"])
    assert "train/loss" in mlrun.data.metrics and "best/eval/ctr/auc" in mlrun.data.metrics


@pytest.mark.parametrize(
    "overrides",
    [
        ["metrics.eval=[auc,logloss,gauc,ne,calibration]", "metrics.grouping_key=cat_0"],
        ["model=mmoe", "data=synthetic_multitask", "model.task_kinds=[binary,regression]",
         "data.label_kinds={cvr: regression}"],
        ["model=dssm", "data=synthetic_retrieval"],
    ],
    ids=["single-task", "multitask", "retrieval"],
)
def test_eval_metric_keys_are_exactly_what_evaluate_logs(make_cfg, overrides: list[str]) -> None:
    cfg = make_cfg(*overrides, "train.eval_max_batches=2", "tracking=none")
    c = build(validate(cfg))
    try:
        assert list(c.loop.evaluator.evaluate()) == eval_metric_keys(c.run.metrics, c.loop.evaluator.tasks)
    finally:
        c.close()


def test_a_part_may_use_any_torch_optim_class(make_cfg) -> None:
    """A torch.optim class we ship no config for gets one generated from its signature: its keys are checked."""
    run = validate(make_cfg("+optim.parts.deep={pattern: 'deep[.]', optimizer: {_target_: torch.optim.RMSprop, alpha: 0.9}}",
                            "optim.lr=0.03", "tracking=none"))
    optimizer = run.optim.part_configs()["deep"].optimizer
    assert type(optimizer).__name__ == "RMSpropConfig" and optimizer.lr == 0.03 and optimizer.alpha == 0.9  # type: ignore[attr-defined]
    built = optimizer.build({"w": torch.nn.Parameter(torch.zeros(2))})
    assert isinstance(built, torch.optim.RMSprop) and built.param_groups[0]["alpha"] == 0.9
    with pytest.raises(ConfigError, match=r"optim\.parts\.deep\.optimizer: RMSpropConfig: Key 'alpah' not in 'RMSpropConfig'"):
        validate(make_cfg("+optim.parts.deep={pattern: 'deep[.]', optimizer: {_target_: torch.optim.RMSprop, alpah: 0.9}}", "tracking=none"))


def test_best_checkpoint_and_early_stopping_follow_the_metrics_own_direction(make_cfg: Any) -> None:
    run = validate(make_cfg("checkpoint.best_metric=eval/logloss", "train.eval_every_steps=5",
                            "train.early_stopping.patience=2", "train.early_stopping.metric=eval/auc"))
    assert run.checkpoint.best_mode == "min" and run.train.early_stopping.mode == "max"
    with pytest.raises(ConfigError, match=r"checkpoint.best_mode=max contradicts eval/logloss.*Fix: drop checkpoint.best_mode"):
        validate(make_cfg("checkpoint.best_metric=eval/logloss", "checkpoint.best_mode=max"))
    with pytest.raises(ConfigError, match=r"train.early_stopping.mode must be max or min for eval/calibration"):
        validate(make_cfg("metrics.eval=[auc,calibration]", "train.eval_every_steps=5", "train.early_stopping.patience=2",
                          "train.early_stopping.metric=eval/calibration"))
