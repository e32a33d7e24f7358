"""The model as TorchRec's train pipelines drive it: the model's tasks' losses combined into one, ``(loss, output)`` out.

:class:`TrainWrapper` wraps any ``(dense, sparse) → output`` model (every architecture, a user's own) for training,
evaluation and planning; :class:`TaskWeighting` is how a multi-task model's per-task losses become the one trained on
(fixed weights here; ``train/weighting.py`` subclasses it with learned and Pareto weights, which read the model's
:func:`shared_representation`).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn
from torchrec.datasets.utils import Batch

from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec
from recsys_runner.tasks import SINGLE_TASK, Task, calibrated

__all__ = ["TaskWeighting", "TrainWrapper", "shared_representation"]


class TaskWeighting(nn.Module):
    """How a multi-task model's per-task losses ``[T]`` become the one loss it is trained on: fixed weights.

    The TrainWrapper owns one (``train.loss_weighting``: ``recsys_runner/train/weighting.py`` subclasses it with learned
    and Pareto weights), so its parameters are trained by the dense optimizer and its buffers are checkpointed with
    the model. It also keeps the per-task losses of the steps since they were last read (:meth:`logged`), without a
    host sync per step.

    Args:
        names: the task names, in output order.
        weights: each task's configured weight (``Task.weight``).
    """

    wants_shared_module = False
    """Whether this weighting ever reads the model's shared representation (:func:`shared_representation`)."""
    _base: torch.Tensor
    _loss_sum: torch.Tensor

    def __init__(self, names: list[str], weights: list[float]) -> None:
        super().__init__()
        self.names = list(names)
        self.register_buffer("_base", torch.tensor(weights, dtype=torch.float32), persistent=False)
        self.register_buffer("_loss_sum", torch.zeros(len(names)), persistent=False)
        self._loss_count = 0

    def wants_shared(self) -> bool:
        """Whether this training forward needs the model's shared representation (its per-task gradients)."""
        return False

    def weights(self) -> torch.Tensor:
        """The weight each task's loss has in the sum, ``[T]`` (detached)."""
        return self._base

    def combine(self, losses: torch.Tensor, per_task: list[torch.Tensor], shared: list[torch.Tensor] | None) -> torch.Tensor:
        """The loss trained on, from the per-task losses ``[T]`` (``per_task``: the same as scalars, each with only its own
        task's graph; ``shared``: the captured representation, if wanted)."""
        return (losses * self._base).sum()

    def forward(self, per_task: list[torch.Tensor], shared: list[torch.Tensor] | None = None) -> torch.Tensor:
        losses = torch.stack(per_task)
        if self.training and torch.is_grad_enabled():
            self._loss_sum.add_(losses.detach().to(self._loss_sum.dtype))
            self._loss_count += 1
        return self.combine(losses, per_task, shared)

    def logged(self) -> dict[str, float]:
        """``train/loss/<task>`` (mean since the last call) and ``train/weight/<task>``; resets the mean."""
        out: dict[str, float] = {}
        if self._loss_count:
            means = (self._loss_sum / self._loss_count).tolist()
            out |= {f"train/loss/{n}": float(v) for n, v in zip(self.names, means, strict=True)}
            self._loss_sum.zero_()
            self._loss_count = 0
        out |= {f"train/weight/{n}": float(v) for n, v in zip(self.names, self.weights().tolist(), strict=True)}
        return out

    def nonfinite(self) -> dict[str, float]:
        """The tasks whose loss was NaN or infinite in a step since the losses were last read (:meth:`logged`), with
        their mean over those steps; one host sync, so read only after the NaN guard found the loss non-finite."""
        if not self._loss_count:
            return {}
        means = (self._loss_sum / self._loss_count).tolist()
        return {n: float(v) for n, v in zip(self.names, means, strict=True) if not math.isfinite(v)}


def shared_representation(model: nn.Module) -> nn.Module | None:
    """The submodule whose output every task reads: the model class's ``shared_module`` (a dotted name, e.g.
    MMoE's ``experts``), or ``None`` when the model declares none. Its output (a tensor, or a tuple/list of them) is
    what Pareto weighting takes each task's gradient with respect to (MGDA-UB)."""
    name: Any = getattr(type(model), "shared_module", None)
    return model.get_submodule(name) if isinstance(name, str) else None


class TrainWrapper(nn.Module):
    """Adapts a ``(dense, sparse) → output`` model to TorchRec's train pipelines.

    A TrainPipeline calls ``model(batch)`` and expects ``(loss, output)``; this wrapper computes the
    loss of the model's tasks (:mod:`recsys_runner.tasks`: each task's own loss on its own targets — a weighted mean over
    rows for a task with a sample-weight column or a mask — combined by its :class:`TaskWeighting`: fixed weights unless
    ``weighting`` is given) and returns detached ``(loss, logits, labels)`` for metrics:

    * unnamed task (a model without ``tasks``, or a retrieval model): the model returns one tensor;
      ``logits`` is that output (``[B]``, or scores ``[B, C]``) and ``labels`` the task's targets
      (the labels ``[B]``, or the positives' indices ``[B]``); a task whose model returns its targets itself
      (next-item: ``(scores, targets)``) takes both from the output (:meth:`~recsys_runner.tasks.Task.output_and_targets`);
    * named tasks (a multi-task model returning ``{task: logits [B]}``, ``[B, C]`` for a multi-class task): ``logits [B, ΣW]``
      the outputs side by side in task order (``[B, T]`` when no task is multi-class; each task's columns:
      :func:`~recsys_runner.tasks.output_columns`), ``labels [B, T]`` each task's targets in the same order.

    The dense forward runs under the precision policy's autocast; the loss is always computed in float32.

    ``logit_shift`` (``log(data.negative_rate)``, :func:`~recsys_runner.tasks.logit_shift`): in eval mode the ``logits``
    returned are the model's plus it, the probability on all rows of a model trained on downsampled negatives, so that
    the evaluation, evaluate and predict score corrected outputs; the loss, and in training the logits the decaying train
    metrics read, are the model's own (they are of the downsampled rows it trains on). Only for one binary task.

    Raises:
        ConfigError: a model with one unnamed labelled output is given data with several labels.
    """

    def __init__(self, model: nn.Module, autocast: torch.autocast | None = None, features: FeatureSpec | None = None,
                 weighting: TaskWeighting | None = None, logit_shift: float = 0.0) -> None:
        super().__init__()
        self.model = model
        self.logit_shift = logit_shift
        self._autocast_args = None if autocast is None else (autocast.device, autocast.fast_dtype)
        self.tasks: tuple[Task, ...] = tuple(getattr(model, "tasks", SINGLE_TASK))
        self._named = any(t.name is not None for t in self.tasks)
        if weighting is not None and not self._named:
            raise ConfigError(f"train.loss_weighting.kind={getattr(weighting, 'kind', '?')!r} weights the losses of several tasks, but "
                              f"{type(model).__name__} has one. Fix: train.loss_weighting.kind=fixed, or a multi-task model (model=mmoe)")
        self.weighting: TaskWeighting | None = None
        if self._named:
            self.weighting = weighting or TaskWeighting([str(t.name) for t in self.tasks], [t.weight for t in self.tasks])
        self._capture, self._shared = False, cast(list[torch.Tensor] | None, None)
        if self.weighting is not None and self.weighting.wants_shared_module:
            shared = shared_representation(model)
            if shared is None:
                raise ConfigError(f"train.loss_weighting.kind=pareto takes each task's gradient on the representation the tasks share, "
                                  f"but {type(model).__name__} declares none (a class attribute shared_module naming that submodule, "
                                  f"as MMoE's 'experts'). Fix: train.loss_weighting.kind=uncertainty or fixed")
            shared.register_forward_hook(self._keep_shared)
        if logit_shift and not (len(self.tasks) == 1 and self.tasks[0].kind == "binary"):
            raise ConfigError(f"data.negative_rate corrects the logit of one binary task, but {type(model).__name__} has tasks "
                              f"{[(t.name, t.kind) for t in self.tasks]}. Fix: data.negative_rate=null")
        if features is not None and features.multi_label and any(t.reads_labels and t.column is None for t in self.tasks):
            raise ConfigError(
                f"{type(model).__name__} has one output but the data has labels {list(features.label_names)}. Fix: a "
                f"multi-task model (model=mmoe), or single-label data (data.tasks=null / data.label=<column>)"
            )

    def nonfinite_tasks(self) -> list[tuple[Task, float]]:
        """The tasks whose loss went NaN or infinite since the losses were last logged, with that mean loss (empty for a
        model of one task); one host sync, for the NaN guard's message (:func:`~recsys_runner.checkpoint.guard.task_causes`)."""
        bad = self.weighting.nonfinite() if self.weighting is not None else {}
        return [(t, bad[str(t.name)]) for t in self.tasks if str(t.name) in bad]

    def _keep_shared(self, _module: nn.Module, _inputs: Any, output: Any) -> None:
        if self._capture:
            self._shared = list(output) if isinstance(output, list | tuple) else [output]

    def _task_loss(self, task: Task, output: torch.Tensor, target: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One task's loss from its own output alone (so that its gradient reaches only its own path): the mean row
        loss, or for a task with a sample-weight column or a mask (only where another task is positive) the weighted mean
        over its rows (0 in a batch without any). The labels were checked on the host (sample weights ``>= 0``:
        :func:`~recsys_runner.tasks.check_batch_labels`)."""
        rows = task.row_losses(output, target.float())
        if task.weight_column is None and task.mask_column is None:
            return rows.mean()
        w = torch.ones_like(rows) if task.weight_column is None else labels[:, task.weight_column].float()  # >= 0: checked on the host
        if task.mask_column is not None:
            w = w * (labels[:, task.mask_column] > 0)
        return (rows * w).sum() / w.sum().clamp_min(1e-12)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        self._capture = self.weighting is not None and self.training and torch.is_grad_enabled() and self.weighting.wants_shared()
        if self._autocast_args is None:
            out = self.model(batch.dense_features, batch.sparse_features)
        else:
            device, dtype = self._autocast_args
            with torch.autocast(device_type=device, dtype=dtype):
                out = self.model(batch.dense_features, batch.sparse_features)
        if self.weighting is not None:  # each task's loss from its own output, combined by the weighting
            outputs = [out[t.name].float() for t in self.tasks]
            targets = [task.targets(output, batch.labels) for task, output in zip(self.tasks, outputs, strict=True)]
            per_task = [self._task_loss(t, o, y, batch.labels) for t, o, y in zip(self.tasks, outputs, targets, strict=True)]
            logits = torch.cat([o.reshape(o.shape[0], -1) for o in outputs], dim=1)
            labels = torch.stack(targets, dim=1).float()
            shared, self._shared, self._capture = self._shared, None, False
            loss = self.weighting(per_task, shared)
        else:  # one unnamed task: no per-step lists; a weight of 1 (x * 1.0 == x exactly) costs no op
            (task,) = self.tasks
            logits, labels = task.output_and_targets(out, batch.labels)
            loss = task.loss(logits, labels)
            if task.weight != 1:
                loss = task.weight * loss
        if not self.training:
            logits = calibrated(logits, self.logit_shift)
        return loss, (loss.detach(), logits.detach(), labels.detach())
