"""What one optimizer step does beyond ``optimizer.step()``: accumulation, loss scaling, clipping, EMA.

TorchRec's train pipelines run, per batch, ``optimizer.zero_grad()``, the forward, ``_backward(losses)``
and ``optimizer.step()``. When any of these features is on, the builder takes a subclass of the chosen
pipeline (:class:`PolicyPipelineBase`, :class:`PolicyPipelineSparseDist`) that overrides ``_backward``
— the backward hook TorchRec's pipelines define for subclasses (TorchEasyRec overrides it too) — to
call :meth:`StepPolicy.backward`, and hands the pipeline the **fused sparse optimizer** as its
optimizer. That is what really happens per batch: the embedding rows are updated inside backward by
fbgemm, and the fused optimizer's ``zero_grad``/``step`` only push the current learning rate into the
kernels. The dense optimizers are the policy's own: it zeroes their gradients at a step's first
micro-batch and steps them after its last. When all features are off the builder hands TorchRec's own
pipeline the whole optimizer, so the default path costs nothing.

Gradient accumulation over ``N`` micro-batches: the loss is divided by ``N``, dense gradients
are summed, and the dense optimizer steps once per ``N`` micro-batches — exactly one step on the
``N``-times larger batch. **Fused embedding optimizers update rows inside backward**, so the
embedding tables still take one update per micro-batch: for SGD it is ``1/N``-sized and they sum to
the large-batch update except that later micro-batches see already-updated rows; every other fused
optimizer normalizes the gradient (Adagrad, Adam: ``g / sqrt(sum g²)``; LAMB, LARS: a trust ratio),
so the ``1/N`` cancels and each micro-batch is a full-size step, exactly as without accumulation
(the builder warns: :func:`~recsys_runner.optim.sparse.sparse_accumulation_warning`). Likewise clipping (``train.clip_grad``)
applies to the dense gradients only; the embedding kernels clip per element with
``optim.sparse.gradient_clipping``/``max_gradient``.

With several ranks DistributedModelParallel wraps the dense part in DDP, whose backward all-reduces the dense
gradients. Under accumulation only a step's last micro-batch needs that: the others run in DDP's ``no_sync``
(:meth:`StepPolicy.micro_batch`, entered by the :class:`Stepper` around each micro-batch's forward and backward), so
their gradients sum locally and the last backward all-reduces the sum — one all-reduce per optimizer step instead of
``N``, the same gradients — from the run's second optimizer step on: TorchRec builds that DDP with ``static_graph=True``,
and a static-graph DDP whose first backward runs in ``no_sync`` fails an internal assert (pytorch/pytorch#143580; the
fix, pytorch/pytorch#187732, also found it then stops all-reducing), so the first step all-reduces every micro-batch, as
before, and lets DDP record its graph. Only DMP's own DDP (:func:`dense_ddp`): the embedding tables' communication is not DDP's,
and TorchRec's DDP around ``data_parallel`` tables runs their fused update after its all-reduce, so it must keep
all-reducing every micro-batch for the tables to update every micro-batch as above.

fp16 loss scaling (``precision.grad_scaler``) is :class:`~recsys_runner.train.loss_scale.LossScaling`'s: the policy
scales the loss, has the scaler unscale the dense gradients before clipping and step the dense optimizers (a step whose
gradients overflowed is skipped); the gradient reaching the embedding tables is unscaled on its way
(:mod:`recsys_runner.train.loss_scale`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.nn.parallel import DistributedDataParallel
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipeline, TrainPipelineBase, TrainPipelineSparseDist
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer

from recsys_runner.errors import require
from recsys_runner.metrics.tasks import TaskTrainMetrics
from recsys_runner.models.train_wrapper import TaskWeighting
from recsys_runner.optim.optimizers import GroupedOptimizer
from recsys_runner.optim.schedulers import ScheduledLR
from recsys_runner.train.ema import DenseEMA
from recsys_runner.train.loss_scale import LossScaling

_CLIP_MODES = ("norm", "value")


@dataclass(kw_only=True)
class ClipConfig:
    """``train.clip_grad``: clipping of the dense gradients (global over all dense parameters)."""

    mode: str = "norm"
    """``norm``: scale all dense gradients so their global L2 norm is at most ``max``;
    ``value``: clamp each gradient element to ``[-max, max]``."""
    max: float | None = None
    """The threshold; ``null`` turns clipping off."""

    def __post_init__(self) -> None:
        require(self.mode in _CLIP_MODES, f"train.clip_grad.mode={self.mode!r} must be one of {_CLIP_MODES}")
        require(self.max is None or self.max > 0, f"train.clip_grad.max must be positive or null, got {self.max}")


def dense_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP that DistributedModelParallel wrapped the dense part of ``model`` in (several ranks), or ``None`` (one rank).

    DMP holds it as its direct child; deeper DDPs are TorchRec's own around ``data_parallel`` embedding lookups, whose
    all-reduce drives those tables' fused update and must not be skipped (the module docstring).
    """
    return next((child for child in model.children() if isinstance(child, DistributedDataParallel)), None)


class StepPolicy:
    """Backward and dense step of one micro-batch; see the module docstring.

    Args:
        sparse: the fused embedding optimizer — what the pipeline zeroes and steps every batch.
        dense: the dense optimizers (one, or several part-wise ones combined) — stepped here.
        accumulation_steps: micro-batches per dense step (``train.grad_accum_steps``).
        scaler: fp16 loss scaler, or ``None``.
        clip: dense gradient clipping (off when ``clip.max`` is ``None``).
        ema: moving average of the dense weights, updated after every dense step taken (not after one the loss scaler
            skipped: the weights did not change).
        ddp: the DDP of the dense part (:func:`dense_ddp`), whose gradient all-reduce :meth:`micro_batch` skips in all
            but a step's last micro-batch; ``None`` with one rank.
    """

    def __init__(
        self, *, sparse: KeyedOptimizer, dense: CombinedOptimizer, accumulation_steps: int = 1,
        scaler: torch.amp.GradScaler | None = None, clip: ClipConfig | None = None, ema: DenseEMA | None = None,
        ddp: DistributedDataParallel | None = None,
    ) -> None:
        self.sparse, self.dense = sparse, dense
        self.accumulation_steps, self.ema, self.ddp = accumulation_steps, ema, ddp
        self.loss_scaling = LossScaling(scaler, dense) if scaler is not None else None
        """fp16 loss scaling around the loss, the embedding lookups and the dense step; ``None`` without a scaler."""
        self.clip = clip if clip is not None and clip.max is not None else None
        self._micro = 0
        self._stepped = False
        """Whether a dense step was taken in this process: a static-graph DDP's first iteration must all-reduce."""

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 loss scaler (``precision.grad_scaler``), or ``None``."""
        return self.loss_scaling.scaler if self.loss_scaling is not None else None

    @property
    def active(self) -> bool:
        """Whether the pipeline needs the policy at all (else TorchRec's pipeline gets the plain optimizer)."""
        return bool(self.accumulation_steps > 1 or self.loss_scaling or self.clip or self.ema)

    def hook_embeddings(self, model: nn.Module) -> None:
        """With a loss scaler, unscale the gradient reaching each top-level sharded module (embedding lookups)."""
        if self.loss_scaling is not None:
            self.loss_scaling.hook_embeddings(model, self.dense)

    def micro_batch(self) -> contextlib.AbstractContextManager[None]:
        """What the next micro-batch's forward and backward run in: DDP's ``no_sync`` unless it is its step's last (or
        there is no DDP, or no dense step was taken yet in this process: the module docstring), so the dense gradients are
        all-reduced once per optimizer step. DDP decides in its forward whether the backward will all-reduce, so the
        forward must be inside too (the :class:`Stepper` wraps the pipeline's whole ``progress``)."""
        if self.ddp is not None and self._stepped and self._micro < self.accumulation_steps - 1:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    # -- what the pipeline's _backward calls ------------------------------------------------------
    def backward(self, losses: torch.Tensor) -> None:
        """Backward of one micro-batch's loss; after a step's last micro-batch, the dense step."""
        if self._micro == 0:
            self.dense.zero_grad(set_to_none=True)
        loss = torch.sum(losses, dim=0)
        if self.accumulation_steps > 1:
            loss = loss / self.accumulation_steps
        if self.loss_scaling is not None:
            loss = self.loss_scaling.scale(loss)
        loss.backward()
        self._micro += 1
        if self._micro == self.accumulation_steps:
            self._micro = 0
            self._dense_step()

    def _dense_step(self) -> None:
        scaling = self.loss_scaling
        if scaling is not None:
            scaling.rescale_replicated_tables()
        if self.clip is not None:
            if scaling is not None:
                scaling.unscale_(self.dense)
            params = [p for g in self.dense.param_groups for p in g["params"] if getattr(p, "grad", None) is not None]
            limit = self.clip.max
            assert limit is not None, "ClipConfig validation guarantees train.clip_grad.max when clipping is on"
            if self.clip.mode == "norm":
                torch.nn.utils.clip_grad_norm_(params, limit, foreach=True)
            else:
                torch.nn.utils.clip_grad_value_(params, limit, foreach=True)
        if scaling is None:
            self.dense.step()
            taken = True
        else:
            taken = scaling.step(self.dense)
        if self.ema is not None and taken:  # a step the scaler skipped left the weights as they were: nothing to average
            self.ema.update()
        self._stepped = True

    def reset(self) -> None:
        """Drop a partial accumulation (at an epoch boundary)."""
        if self._micro:
            self._micro = 0
            self.dense.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        """The loss scaling's state (:meth:`LossScaling.state_dict`); ``{"scaler": None}`` without a scaler."""
        return self.loss_scaling.state_dict() if self.loss_scaling is not None else {"scaler": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the checkpoint's loss scaling (:meth:`LossScaling.load_state_dict`); nothing to do without a scaler."""
        if self.loss_scaling is not None:
            self.loss_scaling.load_state_dict(state)


class PolicyPipelineBase(TrainPipelineBase):
    """TorchRec's ``TrainPipelineBase`` whose backward is :meth:`StepPolicy.backward` (dense step included)."""

    def __init__(self, model: nn.Module, policy: StepPolicy, device: torch.device) -> None:
        super().__init__(model, policy.sparse, device)
        self.policy = policy
        policy.hook_embeddings(model)

    def _backward(self, losses: torch.Tensor) -> None:
        with record_function("## backward (step policy) ##"):
            self.policy.backward(losses)


class PolicyPipelineSparseDist(TrainPipelineSparseDist):
    """TorchRec's ``TrainPipelineSparseDist`` whose backward is :meth:`StepPolicy.backward` (dense step included)."""

    def __init__(self, model: nn.Module, policy: StepPolicy, device: torch.device) -> None:
        super().__init__(model, policy.sparse, device, execute_all_batches=True)
        self.policy = policy
        policy.hook_embeddings(model)

    def _backward(self, losses: torch.Tensor) -> None:
        with record_function("## backward (step policy) ##"):
            self.policy.backward(losses)


class LeanPipeline(TrainPipeline[Batch, Any]):
    """TorchRec's ``TrainPipelineBase`` for batches that are already where the model is (a CPU run).

    The same contract and order per batch — fetch the next batch, ``optimizer.zero_grad()``, forward,
    backward (the step policy's when one is given), ``optimizer.step()``, the output of the forward
    returned, ``StopIteration`` on the call after the last batch — minus the per-batch host work that
    buys nothing when host and device are one: the copy of each batch "to the device" (a new
    KeyedJaggedTensor per batch on CPU), the profiler ranges around each phase (kept with
    ``annotate``, i.e. when ``train.profile`` is on) and TorchRec's event-logging decorator. On a CPU
    with a tiny model that work is a visible share of the step (regime (c) of ``make bench``). It
    holds no private state of TorchRec's classes, so it behaves the same on every TorchRec release.

    Args:
        model: the DistributedModelParallel model; ``model(batch) -> (losses, output)``.
        optimizer: stepped and zeroed once per batch (the dense optimizers, or the fused one with a policy).
        policy: the step policy whose :meth:`StepPolicy.backward` runs instead of ``losses.sum().backward()``.
        annotate: wrap the phases in ``record_function`` ranges, as TorchRec does (for the profiler's trace).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, policy: StepPolicy | None = None,
                 annotate: bool = False) -> None:
        super().__init__()
        self._model, self._optimizer, self.policy, self.annotate = model, optimizer, policy, annotate
        if policy is not None:
            policy.hook_embeddings(model)
        self._next: Batch | None = None
        self._connected = False

    def progress(self, dataloader_iter: Iterator[Batch]) -> Any:
        if not self._connected:
            self._next, self._connected = next(dataloader_iter, None), True
        batch = self._next
        if batch is None:
            raise StopIteration
        self._next = next(dataloader_iter, None)
        if not self.annotate:
            return self._step(batch)
        with record_function("## lean pipeline step ##"):
            return self._step(batch)

    def _step(self, batch: Batch) -> Any:
        training = self._model.training
        if training:
            self._optimizer.zero_grad()
        losses, output = self._model(batch)
        if training:
            if self.policy is not None:
                self.policy.backward(losses)
            else:  # the TrainWrapper's loss is already a scalar: no sum op (and backward node) per step
                (losses if losses.dim() == 0 else torch.sum(losses, dim=0)).backward()
            self._optimizer.step()
        return output

    def reset(self) -> None:
        """Forget the fetched next batch (a new epoch starts a new iterator)."""
        self._next, self._connected = None, False


Pipeline: TypeAlias = TrainPipelineBase | TrainPipelineSparseDist | LeanPipeline
"""The pipelines ``distributed.pipeline`` chooses from (:meth:`recsys_runner.distributed.sharding.Distributed.pipeline`)."""


@dataclass
class Stepper:
    """One optimizer step of the train loop: its micro-batches through the pipeline, then the lr schedule.

    What the loop drives per step, in one object: the pipeline (forward, backward, sparse update),
    the policy's partial accumulation (dropped with the pipeline's prefetched batches at an epoch
    boundary), the decaying train metrics fed from each micro-batch, and the schedule advanced once
    per optimizer step.

    The fused embedding optimizer's ``zero_grad``/``step`` only push the current learning rate into
    fbgemm's kernels (the rows are updated inside backward). The pipeline is therefore given the dense
    optimizers alone (or, with an active policy, the fused one it must call anyway), and the stepper
    pushes the sparse lr itself when it changes: at the start of an epoch (the first, or a restored
    position) and after a scheduler step that moved it. Same lrs as pushing every step, without the
    per-step host work of stepping optimizers that do nothing.
    """

    pipeline: Pipeline
    policy: StepPolicy
    lr_scheduler: ScheduledLR
    optimizer: GroupedOptimizer
    train_metrics: TaskTrainMetrics
    accumulation_steps: int = 1
    weighting: TaskWeighting | None = None
    """A multi-task model's loss weighting, whose per-task losses and weights are logged (:meth:`task_losses`)."""

    def __post_init__(self) -> None:
        self._pushed_sparse_lrs: list[float] | None = None

    def reset(self) -> None:
        """Start an epoch: no batch in flight, no partial accumulation, the kernels at the current sparse lr."""
        self.pipeline.reset()
        self.policy.reset()
        self._push_sparse_lr(force=True)

    def step(self, batches: Iterator[Batch]) -> torch.Tensor | None:
        """One optimizer step; its loss, or ``None`` when the data ended before the step did.

        With accumulation the loss is the mean over the step's micro-batches (the loss of the step's whole batch, which
        the dense step follows), not the last micro-batch's: the logged ``train/loss`` covers every row trained, and a
        non-finite loss in any micro-batch, which poisons the shared dense step, reaches the NaN guard before the
        step's checkpoint."""
        loss: torch.Tensor | None = None
        for _ in range(self.accumulation_steps):
            try:
                with self.policy.micro_batch():  # no dense all-reduce but in the step's last micro-batch
                    micro, logits, labels = self.pipeline.progress(batches)
            except StopIteration:
                return None
            loss = micro if loss is None else loss + micro  # on the device: no sync
            self.train_metrics.update(logits, labels)
        self.lr_scheduler.step()
        if self.lr_scheduler.moved:
            self._push_sparse_lr()
        return loss / self.accumulation_steps if loss is not None and self.accumulation_steps > 1 else loss

    def _push_sparse_lr(self, force: bool = False) -> None:
        """Hand the fused optimizer's current lr to the kernels (its ``step()`` does only that) if it changed."""
        sparse = self.policy.sparse
        lrs = [group["lr"] for group in sparse.param_groups]
        if force or lrs != self._pushed_sparse_lrs:
            sparse.step()
            self._pushed_sparse_lrs = lrs

    def task_losses(self) -> dict[str, float]:
        """``train/loss/<task>`` (mean over the steps since the last call) and ``train/weight/<task>``; empty for one task."""
        return self.weighting.logged() if self.weighting is not None else {}

    def loss_scale(self) -> dict[str, float]:
        """``train/loss_scale`` and ``train/skipped_steps`` under fp16 loss scaling (:meth:`LossScaling.logged`); empty
        without a scaler."""
        return self.policy.loss_scaling.logged() if self.policy.loss_scaling is not None else {}

    def learning_rates(self) -> dict[str, float]:
        """The lr of each optimizer group during the step just taken, as logged (:func:`learning_rates`,
        :meth:`~recsys_runner.optim.schedulers.ScheduledLR.applied_lrs`)."""
        return learning_rates(self.optimizer, self.lr_scheduler.applied_lrs())


def learning_rates(optimizer: GroupedOptimizer, lrs: list[float] | None = None) -> dict[str, float]:
    """The lr of each optimizer group (``lr/sparse``, ``lr/dense``, ``lr/part.<name>``); when the parameter groups
    of one optimizer differ in lr, each of them (``lr/<group>/<i>``). ``lrs``: one per param group of ``optimizer``, in
    its order (the step's applied lrs); ``None``: the groups' current ``lr``."""
    flat = iter(lrs if lrs is not None else [float(g["lr"]) for g in optimizer.param_groups])
    out: dict[str, float] = {}
    for group, opt in optimizer.groups:
        values = [float(next(flat)) for _ in opt.param_groups]
        if len(set(values)) == 1:
            out[f"lr/{group.key}"] = values[0]
        else:
            out |= {f"lr/{group.key}/{i}": v for i, v in enumerate(values)}
    return out
