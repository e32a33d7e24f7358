"""The train pipeline: which TorchRec pipeline (or :class:`~recsys_runner.train.stepping.LeanPipeline`) runs the steps,
and the pipeline's model detached for an eval between steps."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist
from torchrec.distributed.train_pipeline import utils as pipeline_utils
from torchrec.distributed.train_pipeline.train_pipelines import PrefetchTrainPipelineSparseDist, TrainPipelineSemiSync

from recsys_runner.distributed.config import cuda_pipeline_reason
from recsys_runner.distributed.env import DistEnv
from recsys_runner.errors import ConfigError
from recsys_runner.train.stepping import LeanPipeline, Pipeline, PolicyPipelineBase, PolicyPipelineSparseDist, StepPolicy


class SubtreeLeafTracer(pipeline_utils.Tracer):
    """TorchRec's pipeline tracer with its ``extend_leaf_fqn`` option on: every module *inside* an embedding-free module
    is a leaf too, not only the module of that exact name.

    ``TrainPipelineSparseDist`` (``distributed.pipeline=sparse_dist``, the default on a GPU) traces the model with
    ``torch.fx`` to find its embedding lookups, treating each embedding-free child as an opaque leaf. By default a leaf
    is matched by its exact name, so towers kept in a ``ModuleDict`` (``towers.ctr``) or blocks in a ``ModuleList``
    (``blocks.0``) are traced through, and their shape-dependent code (``x.shape`` unpacked, a width compared) stops
    the trace. With the option they stay opaque, as the model's author meant (``tests/test_pipelines.py``).
    """

    def __init__(self, leaf_modules: list[str] | None = None, extend_leaf_fqn: bool = True) -> None:
        super().__init__(leaf_modules=leaf_modules, extend_leaf_fqn=True)


pipeline_utils.Tracer = SubtreeLeafTracer  # what _rewrite_model builds its tracer from


def make_pipeline(
    kind: str, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer, policy: StepPolicy | None = None, *,
    annotate: bool = False, semi_sync_start_batch: int = 100,
) -> Pipeline:
    """The train pipeline chosen by ``distributed.pipeline`` (``kind``) for a model sharded on ``env``'s device.

    ``base`` on a CPU is :class:`~recsys_runner.train.stepping.LeanPipeline` (batches are made where the model is);
    on a GPU it is TorchRec's ``TrainPipelineBase``, which copies the next batch on a side stream. With an
    active step policy (accumulation, loss scaling, clipping, EMA) the pipeline runs the policy's backward and
    dense step (:mod:`recsys_runner.train.stepping`) and steps the fused optimizer; otherwise it steps ``optimizer``
    once per batch. ``annotate`` keeps the profiler ranges of the lean pipeline (``train.profile``).

    ``semi_sync`` and ``prefetch`` are TorchRec's ``TrainPipelineSemiSync`` (after ``semi_sync_start_batch`` batches,
    embeddings looked up one update older) and ``PrefetchTrainPipelineSparseDist`` (UVM cache prefetch, CUDA only);
    they run no step policy.

    Raises:
        ConfigError: ``semi_sync``/``prefetch`` with an active step policy, or on a CPU.
    """
    if kind == "auto":
        # several GPUs: overlap the next batch's input distribution; one GPU has none to overlap, and TorchRec's base
        # pipeline (which still copies the next batch on a side stream) measured 1.13x its samples/s on an H200
        kind = "sparse_dist" if env.device.type == "cuda" and env.world_size > 1 else "base"
    active = policy is not None and policy.active
    if kind in ("semi_sync", "prefetch"):
        if active:
            raise ConfigError(f"distributed.pipeline={kind} runs TorchRec's own backward and cannot apply gradient accumulation, "
                              f"fp16 loss scaling, clipping or EMA. Fix: distributed.pipeline=sparse_dist with those, or drop "
                              f"train.grad_accum_steps / precision=fp16 / train.clip_grad / train.ema")
        if env.device.type != "cuda":
            raise ConfigError(cuda_pipeline_reason(kind))
        if kind == "prefetch":
            return PrefetchTrainPipelineSparseDist(model, optimizer, env.device, execute_all_batches=True)
        return TrainPipelineSemiSync(model, optimizer, env.device, execute_all_batches=True, start_batch=semi_sync_start_batch)
    if kind == "base" and env.device.type == "cpu":
        if active:
            assert policy is not None
            return LeanPipeline(model, policy.sparse, policy=policy, annotate=annotate)
        return LeanPipeline(model, optimizer, annotate=annotate)
    if active:
        assert policy is not None
        with_policy = PolicyPipelineSparseDist if kind == "sparse_dist" else PolicyPipelineBase
        return with_policy(model, policy, env.device)
    if kind == "sparse_dist":
        return TrainPipelineSparseDist(model, optimizer, env.device, execute_all_batches=True)
    return TrainPipelineBase(model, optimizer, env.device)


@contextlib.contextmanager
def detached(pipeline: Pipeline | None, model: nn.Module) -> Iterator[nn.Module]:
    """The pipeline's model with its original forward, for evaluation between training steps (``model`` itself without a
    pipeline: nothing trains).

    TrainPipelineSparseDist rewrites the sharded modules' forward to read pre-distributed inputs;
    detaching restores it and keeps in-flight training batches, which resume after ``attach``.
    """
    if isinstance(pipeline, TrainPipelineSparseDist):
        original = pipeline.detach()
        try:
            yield original
        finally:
            pipeline.attach(original)
    else:
        yield model
