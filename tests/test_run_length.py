"""How long a run trains and what it reports when the user says little: the data's default length (one epoch
of a file, a step count for synthetic data), ``train.num_epochs`` alone, the many-epochs warning,
``train.eval_every_epochs``, the best eval beside the last, and ``distributed.num_threads``."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from recsys_runner.__main__ import run
from recsys_runner.build import MANY_EPOCHS, build
from recsys_runner.config import validate
from recsys_runner.data.generated.generate import write_criteo_parquet
from recsys_runner.data.generated.synthetic_config import DEFAULT_NUM_STEPS
from recsys_runner.distributed.env import auto_num_threads, idle_cpus, usable_cores
from recsys_runner.errors import ConfigError
from recsys_runner.train.evaluation import BestEval
from tests.conftest import TINY

NO_LENGTH = [a for a in TINY if not a.startswith("train.num_steps")]
"""TINY without its train.num_steps: the length is left to the run's defaults."""
FILE = ["data=parquet", "data.batch_size=256", "train.log_every_steps=1", "train.eval_every_steps=null", "distributed.device=cpu"]


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2400 rows, 10% held out for eval: 2160 train rows = 8 full batches of 256, one epoch = 8 steps."""
    path = tmp_path_factory.mktemp("small") / "part-0.parquet"
    write_criteo_parquet(str(path), 2400, seed=4, num_embeddings=1000, row_group_rows=600)
    return path


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """A build sets torch's process-wide thread count; leave it as the other tests found it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _history(uri: str, experiment: str, key: str) -> dict[int, float]:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    (mlrun,) = client.search_runs([exp.experiment_id])
    return {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, key)}


def _params(uri: str, experiment: str) -> dict[str, str]:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    (mlrun,) = client.search_runs([exp.experiment_id])
    return mlrun.data.params


def _built_length(cfg) -> tuple[int, int | None]:
    """(total steps, steps per epoch) of the run ``cfg`` builds."""
    c = build(validate(cfg))
    try:
        return c.loop.total_steps, c.loop.steps_per_epoch
    finally:
        c.close()


def test_num_epochs_alone_trains_that_many_epochs(make_cfg, mlflow_uri: str) -> None:
    # 4096 rows / 256 per batch = 16 steps per epoch; two epochs = 32 steps, with no train.num_steps=null needed.
    cfg = make_cfg(*NO_LENGTH, "train.num_epochs=2", "data.num_train_rows=4096", "train.log_every_steps=8", tiny=False)
    run(cfg)
    epochs = _history(mlflow_uri, cfg.tracking.experiment, "train/epoch")
    assert max(epochs) == 32 and epochs[16] == 0 and epochs[24] == 1
    params = _params(mlflow_uri, cfg.tracking.experiment)  # the length the run decided, beside the settings as given
    assert (params["train.num_epochs"], params["train.num_steps"], params["run.total_steps"], params["run.steps_per_epoch"]) == \
        ("2", "None", "32", "16")


def test_steps_and_epochs_both_set_is_an_error_naming_the_fix(make_cfg) -> None:
    with pytest.raises(ConfigError, match=r"train.num_steps=30 and train.num_epochs=2 are both set.*train.num_epochs=2 train.num_steps=null"):
        validate(make_cfg("train.num_epochs=2", "tracking=none"))  # TINY sets train.num_steps=30
    # a preset that trains for an epoch (every experiment=*_taobao), shortened to a few steps as a first try does: the fix
    # said "train.num_steps=50 alone", which is what was typed
    with pytest.raises(ConfigError, match=r"train.num_steps=50 and train.num_epochs=1 are both set.*"
                                          r"Fix: train.num_steps=50 train.num_epochs=null for the steps"):
        validate(make_cfg("experiment=esmm_taobao", "train.num_steps=50", "tracking=none", tiny=False))


def test_synthetic_data_defaults_to_its_step_count(make_cfg) -> None:
    assert _built_length(make_cfg(*NO_LENGTH, "tracking=none", tiny=False))[0] == DEFAULT_NUM_STEPS


def test_file_data_trains_one_epoch_by_default(make_cfg, mlflow_uri: str, small_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = make_cfg(*FILE, f"data.path={small_file}", tiny=False)
    total, per_epoch = _built_length(cfg)
    assert total == per_epoch == 8
    with caplog.at_level(logging.INFO, logger="recsys_runner"):
        run(cfg)
    steps = _history(mlflow_uri, cfg.tracking.experiment, "train/loss")
    assert max(steps) == 8, "one pass over the file"
    params = _params(mlflow_uri, cfg.tracking.experiment)
    assert (params["train.num_steps"], params["run.total_steps"], params["run.steps_per_epoch"]) == ("None", "8", "8")
    assert "training one epoch of the data: 8 steps" in caplog.text
    assert "epochs of this data" not in caplog.text


def test_many_epochs_of_a_small_file_warn(make_cfg, small_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    steps = 8 * (MANY_EPOCHS + 5)  # 15 epochs of 8 steps
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        assert _built_length(make_cfg(*FILE, f"data.path={small_file}", f"train.num_steps={steps}", "tracking=none", tiny=False))[0] == steps
    assert f"train.num_steps={steps} is 15.0 epochs of this data (8 steps each)" in caplog.text
    assert "train.num_epochs=1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        _built_length(make_cfg(*FILE, f"data.path={small_file}", "train.num_steps=40", "tracking=none", tiny=False))
    assert "epochs of this data" not in caplog.text, "5 epochs is not many"


def test_file_data_of_unknown_length_asks_for_steps(make_cfg, small_file: Path) -> None:
    """With data.on_bad_rows=skip an epoch's length is known only after reading, so neither the one-epoch default
    nor train.eval_every_epochs can be counted in steps."""
    with pytest.raises(ConfigError, match=r"the default length, one epoch of the data,.*Fix: set train.num_steps"):
        _built_length(make_cfg(*FILE, f"data.path={small_file}", "data.on_bad_rows=skip", "tracking=none", tiny=False))
    with pytest.raises(ConfigError, match=r"train.eval_every_epochs=1 needs data whose epoch length is known.*train.eval_every_steps"):
        _built_length(make_cfg(*FILE, f"data.path={small_file}", "data.on_bad_rows=skip", "train.num_steps=4",
                               "train.eval_every_epochs=1", "tracking=none", tiny=False))


@pytest.mark.parametrize(("every", "evals"), [(1, [8, 16, 24]), (2, [16, 24])])
def test_eval_every_epochs_evaluates_at_epoch_ends(make_cfg, mlflow_uri: str, every: int, evals: list[int]) -> None:
    # 2048 rows / 256 = 8 steps per epoch, 3 epochs; the end of the run always evaluates (step 24).
    cfg = make_cfg(*NO_LENGTH, "data.num_train_rows=2048", "train.num_epochs=3", f"train.eval_every_epochs={every}",
                   "train.eval_max_batches=2", tiny=False)
    run(cfg)
    assert sorted(_history(mlflow_uri, cfg.tracking.experiment, "eval/auc")) == evals


def test_eval_every_epochs_combines_with_eval_every_steps(make_cfg, mlflow_uri: str) -> None:
    cfg = make_cfg(*NO_LENGTH, "data.num_train_rows=2048", "train.num_epochs=2", "train.eval_every_epochs=1",
                   "train.eval_every_steps=5", "train.eval_max_batches=2", tiny=False)
    run(cfg)
    assert sorted(_history(mlflow_uri, cfg.tracking.experiment, "eval/auc")) == [5, 8, 10, 15, 16]


def test_early_stopping_accepts_epoch_evaluations(make_cfg) -> None:
    spec = validate(make_cfg("train.early_stopping.patience=2", "train.eval_every_epochs=1", "tracking=none"))
    assert spec.train.early_stopping.patience == 2
    with pytest.raises(ConfigError, match="train.eval_every_steps .* or train.eval_every_epochs"):
        validate(make_cfg("train.early_stopping.patience=2", "tracking=none"))


def test_best_eval_keeps_the_peak_not_the_last() -> None:
    best = BestEval(metric="eval/auc", mode="max")
    logged = [best.update({"eval/auc": v}, step) for step, v in ((10, 0.60), (20, 0.71), (30, 0.70))]
    assert logged == [{"best/eval/auc": 0.60, "best/step": 10.0}, {"best/eval/auc": 0.71, "best/step": 20.0}, {}]
    assert best.summary({"eval/auc": 0.70}) == "best eval/auc=0.71 at step 20; last 0.7"
    lower = BestEval(metric="eval/logloss", mode="min")
    lower.update({"eval/logloss": 0.5}, 1)
    lower.update({"eval/logloss": 0.6}, 2)
    assert (lower.value, lower.step) == (0.5, 1)
    resumed = BestEval(metric="eval/auc", mode="max")
    resumed.load_state_dict(best.state_dict())
    assert (resumed.value, resumed.step) == (0.71, 20)


def test_best_eval_passes_over_nan_evaluations() -> None:
    """An evaluation whose watched metric is NaN is never the best, and the finite ones after it still count."""
    best = BestEval(metric="eval/auc", mode="max")
    assert best.update({"eval/auc": math.nan}, 10) == {}
    assert best.summary({"eval/auc": math.nan}) == "no finite eval/auc logged; last nan"
    assert best.update({"eval/auc": 0.6}, 20) == {"best/eval/auc": 0.6, "best/step": 20.0}
    assert best.update({"eval/auc": math.nan}, 30) == {} and (best.value, best.step) == (0.6, 20)


def test_run_logs_best_eval_beside_the_last(make_cfg, mlflow_uri: str, caplog: pytest.LogCaptureFixture) -> None:
    cfg = make_cfg("train.eval_every_steps=10", "train.eval_max_batches=4")
    with caplog.at_level(logging.INFO, logger="recsys_runner"):
        last = run(cfg)
    auc = _history(mlflow_uri, cfg.tracking.experiment, "eval/auc")
    best = _history(mlflow_uri, cfg.tracking.experiment, "best/eval/auc")
    best_step = _history(mlflow_uri, cfg.tracking.experiment, "best/step")
    peak = max(auc, key=lambda s: (auc[s], -s))
    assert sorted(auc) == [10, 20, 30] and last == auc[30]
    assert best[max(best)] == auc[peak] >= last and best_step[max(best_step)] == peak
    assert f"best eval/auc={auc[peak]:.4g} at step {peak}; last {last:.4g}" in caplog.text


def test_best_eval_follows_the_checkpoint_metric_and_its_direction(make_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    cfg = make_cfg("train.eval_every_steps=10", "train.eval_max_batches=4", "metrics.eval=[auc,logloss]",
                   "checkpoint.best_metric=eval/logloss", "checkpoint.best_mode=min", f"checkpoint.dir={tmp_path}")
    run(cfg)
    loss = _history(mlflow_uri, cfg.tracking.experiment, "eval/logloss")
    best = _history(mlflow_uri, cfg.tracking.experiment, "best/eval/logloss")
    assert best[max(best)] == min(loss.values())


def test_threads_auto_and_explicit(make_cfg, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(7)  # whatever ran before: the build decides
    with caplog.at_level(logging.INFO, logger="recsys_runner"):
        _built_length(make_cfg("tracking=none"))
    chosen = torch.get_num_threads()
    assert 1 <= chosen <= usable_cores()
    assert f"torch CPU threads per rank: {chosen} (auto: {usable_cores()} usable physical cores" in caplog.text
    _built_length(make_cfg("distributed.num_threads=1", "tracking=none"))
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # an explicit choice of the user or launcher wins over auto
    _built_length(make_cfg("tracking=none"))
    assert torch.get_num_threads() == 3
    assert auto_num_threads(4) == (3, "OMP_NUM_THREADS=3")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert auto_num_threads(1_000)[0] == 1, "never fewer than one thread per rank"


def test_auto_threads_take_only_the_idle_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU kept busy here (a spinning child process pinned to it) is not counted as idle."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the tests set it (conftest.py); auto is what is tested here
    cpus = sorted(os.sched_getaffinity(0))
    idle = idle_cpus(0.5)
    assert idle is not None and 0.0 <= idle <= len(cpus) + 0.01
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {cpus[0]}))
    try:
        time.sleep(0.3)
        busy = idle_cpus(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert busy is not None and busy <= len(cpus) - 0.5, "the spinning CPU is at most half idle"
    threads, why = auto_num_threads(1, sample_s=0.5)
    assert 1 <= threads <= usable_cores() and "CPUs idle" in why


def test_threads_setting_is_validated(make_cfg) -> None:
    with pytest.raises(ConfigError, match=r"distributed.num_threads=0 must be a positive number or auto"):
        validate(make_cfg("distributed.num_threads=0", "tracking=none"))
