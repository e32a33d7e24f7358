"""Every model trains under TorchRec's ``TrainPipelineSparseDist``, the pipeline ``distributed.pipeline=auto`` picks on a
GPU: it rewrites the model by tracing it with ``torch.fx``, so a forward that iterates a submodule's output (a list of
per-task tensors, a ``KeyedTensor``'s dict) fails there while the plain loop on a CPU runs it. Found on an H200 for PLE
and for managed-collision tables; this runs the same pipeline on the CPU for every model in ``conf/model``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.train.loop import train

MODELS = sorted(p.stem for p in (Path(CONFIG_PATH) / "model").glob("*.yaml"))

PIPELINED = ["distributed.pipeline=sparse_dist", "tracking=none", "checkpoint=none", "train.num_steps=3",
             "data.num_train_rows=4096", "data.num_eval_rows=512"]


def _train(make_cfg, *overrides: str) -> dict[str, float]:
    c = build(validate(make_cfg(*overrides, *PIPELINED)))
    try:
        return train(c.loop)
    finally:
        c.close()


@pytest.mark.parametrize("model", MODELS)
def test_every_model_trains_under_the_sparse_dist_pipeline(make_cfg, model: str) -> None:
    final = _train(make_cfg, f"model={model}")
    assert final and all(math.isfinite(v) for v in final.values()), final


@pytest.mark.parametrize("model", ["ple", "dbmtl", "mmoe"])
def test_pareto_weighting_trains_under_the_sparse_dist_pipeline(make_cfg, model: str) -> None:
    final = _train(make_cfg, f"model={model}", "train.loss_weighting.kind=pareto")
    assert all(math.isfinite(v) for v in final.values()), final


def test_managed_collision_tables_train_under_the_sparse_dist_pipeline(make_cfg) -> None:
    final = _train(make_cfg, "model=deepfm", "data.managed_collision={features: [cat_0, cat_1], eviction_interval: 2}")
    assert all(math.isfinite(v) for v in final.values()), final


def test_a_multiclass_task_trains_under_the_sparse_dist_pipeline(make_cfg) -> None:
    """Its label check (a value-dependent raise) is an fx leaf; traced inline it stopped the pipeline on an H200."""
    final = _train(make_cfg, "model=mmoe", "model.tasks=[ctr,category]", "+model.task_specs.category={kind: multiclass, num_classes: 5}")
    assert "eval/category/accuracy" in final and all(math.isfinite(v) for v in final.values()), final
