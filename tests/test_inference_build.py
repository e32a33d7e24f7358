"""The inference graph evaluate and predict build (``inference_build.py``): no optimizer, schedule or train pipeline,
and the checkpoint's weights score exactly as the training's own evaluation did."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from recsys_runner import build as training_build
from recsys_runner.__main__ import run as train
from recsys_runner.config import validate
from recsys_runner.inference_build import Inference, build_inference
from recsys_runner.optim import optimizers, sparse
from recsys_runner.train import pipeline

TRAINING_ONLY = {"optimizer", "lr_scheduler", "policy", "pipeline", "stepper", "loop", "early_stopping", "train_metrics"}


def _training_only(*_: object, **__: object) -> None:
    raise AssertionError("the inference build made a part of training")


def test_inference_builds_no_optimizer_and_scores_like_training(make_cfg: Callable[..., DictConfig], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # EMA weights for eval and a batch cap: the inference graph must honour both to reproduce training's numbers.
    cfg = make_cfg("train.ema.decay=0.9", "train.ema.eval_with_ema=true", "train.eval_max_batches=5", f"checkpoint.dir={tmp_path}/ck")
    train(cfg)
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    (trained,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    final = {k: v for k, v in trained.data.metrics.items() if k.startswith("eval/")}

    for module, names in ((training_build, ("apply_sparse_optimizer", "dense_optimizers", "make_pipeline", "make_lr_scheduler")),
                          (sparse, ("apply_sparse_optimizer",)), (optimizers, ("dense_optimizers",)), (pipeline, ("make_pipeline",))):
        for name in names:
            monkeypatch.setattr(module, name, _training_only)
    built = build_inference(validate(cfg), weights=tmp_path / "ck" / "step_00000030")
    try:
        assert not {f.name for f in dataclasses.fields(Inference)} & TRAINING_ONLY
        assert built.ema is not None and built.evaluator.ema is built.ema
        assert built.state.step == 30 and built.state.run_id == trained.info.run_id
        assert built.evaluator.evaluate() == final  # exactly, not approximately
    finally:
        built.close()
