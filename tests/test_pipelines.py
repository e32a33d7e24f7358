"""Every model trains under TorchRec's ``TrainPipelineSparseDist``, the pipeline ``distributed.pipeline=auto`` picks on a
GPU: it rewrites the model by tracing it with ``torch.fx``, so a forward that iterates a submodule's output (a list of
per-task tensors, a ``KeyedTensor``'s dict) fails there while the plain loop on a CPU runs it. Found on an H200 for PLE
and for managed-collision tables; this runs the same pipeline on the CPU for every model in ``conf/model``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward

from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.train.loop import train
from recsys_runner.train.summaries import top_sharded_modules

MODELS = sorted(p.stem for p in (Path(CONFIG_PATH) / "model").glob("*.yaml"))

PIPELINED = ["distributed.pipeline=sparse_dist", "tracking=none", "checkpoint=none", "train.num_steps=3",
             "data.num_train_rows=4096", "data.num_eval_rows=512"]


def _train(make_cfg, *overrides: str) -> dict[str, float]:
    """Train a few steps under the pipeline; checks that it really pipelined: its first rewrite of the model gave every
    top-level sharded module (each embedding lookup) the pipeline's forward, as TorchRec does for the lookups its
    ``torch.fx`` trace finds. A lookup the trace misses keeps its own forward and trains unpipelined."""
    c = build(validate(make_cfg(*overrides, *PIPELINED)))
    try:
        pipeline = c.loop.stepper.pipeline
        assert isinstance(pipeline, TrainPipelineSparseDist), type(pipeline)
        rewrites: list[tuple[list[str], list[str]]] = []
        rewrite = pipeline._pipeline_model

        def recorded(*args: Any, **kwargs: Any) -> None:
            rewrite(*args, **kwargs)
            lookups = top_sharded_modules(pipeline._model)
            rewrites.append(([type(m).__name__ for m in lookups if isinstance(m.forward, PipelinedForward)],
                             [type(m).__name__ for m in lookups]))

        pipeline._pipeline_model = recorded  # type: ignore[method-assign]
        final = train(c.loop)
    finally:
        c.close()
    assert rewrites, "the pipeline never rewrote the model"
    pipelined, lookups = rewrites[0]
    assert lookups and pipelined == lookups, f"pipelined {pipelined} of the lookups {lookups}"
    return final


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
