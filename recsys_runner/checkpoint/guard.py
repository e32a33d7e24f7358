"""The NaN guard's facts (``train.nan_guard``): a non-finite loss or weights stop training before a checkpoint
of them is written, with :class:`NonFiniteLossError` naming the last good checkpoint.

Checked only where numbers are already on the host (a log step, before a checkpoint), so they add no per-step cost;
only once a value is non-finite are a multi-task model's per-task losses read (:func:`task_causes`), to name the task.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recsys_runner.models.train_wrapper import TrainWrapper


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss; the last good checkpoint (``checkpoint``) is left intact."""

    def __init__(self, message: str, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


def check_finite(loss: float, step: int, last_checkpoint: str | None, what: str | None = None, tasks: str | None = None) -> None:
    """Raise :class:`NonFiniteLossError` with what to do when ``loss`` is NaN or infinite.

    ``what`` replaces "train loss is <loss>" in the message (e.g. for non-finite weights); ``tasks`` names the tasks
    whose losses went non-finite and their fixes (:func:`task_causes`)."""
    if math.isfinite(loss):
        return
    where = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no good checkpoint exists"
    raise NonFiniteLossError(
        f"{what or f'train loss is {loss}'} at step {step}; training stopped ({where}). "
        f"{f'Non-finite since the last log step: {tasks}. ' if tasks else ''}Usual causes: a learning rate too "
        f"high (optim.lr, optim.sparse.lr, optim.dense.lr), fp16 without loss scaling, or bad input data. "
        f"Lower the lr or add train.clip_grad.max=1.0, then resume from the last good checkpoint with that change "
        f"(set train.nan_guard=false to train on regardless).",
        last_checkpoint,
    )


def task_causes(model: nn.Module) -> str | None:
    """Which of ``model``'s tasks had a NaN or infinite loss since the last log step, each with its kind's likely fix
    (e.g. a regression task's huge amounts); ``None`` for a model of one task, or when every task's loss stayed finite
    (the weights went bad after the last loss). One host sync: called only once a value is known non-finite."""
    wrapper = next((m for m in model.modules() if isinstance(m, TrainWrapper)), None)
    bad = wrapper.nonfinite_tasks() if wrapper is not None else []
    causes = [f"task {task.name!r} ({task.kind}) has loss {loss}" + (f": {fix}" if (fix := task.nonfinite_fix()) else "")
              for task, loss in bad]
    return "; ".join(causes) or None


def finite_state(model: nn.Module, world_size: int, device: torch.device) -> bool:
    """Whether every floating tensor of ``model``'s state is finite on every rank.

    Checked before a checkpoint is written: the loss of step ``n`` is computed before step ``n``'s
    update, so a finite loss does not prove finite weights. One pass over the state, cheap next to
    writing it.
    """
    flags = [torch.isfinite(t).all() for v in model.state_dict().values() for t in _local_tensors(v)
             if t.is_floating_point() and t.numel()]
    ok = torch.stack(flags).all().to(device=device, dtype=torch.int32) if flags else torch.ones((), dtype=torch.int32, device=device)
    if world_size > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def _local_tensors(value: Any) -> list[torch.Tensor]:
    """This rank's tensors of a state-dict value: a ShardedTensor's local shards, a DTensor's local part, or itself."""
    if hasattr(value, "local_shards"):
        return [shard.tensor for shard in value.local_shards()]
    if hasattr(value, "to_local"):
        return [value.to_local()]
    return [value] if isinstance(value, torch.Tensor) else []
