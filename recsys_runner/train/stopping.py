"""Reasons to stop training early: an eval metric that stopped improving, a non-finite loss.

Both are small, stateful and checked by the runner only at points where it already has numbers
on the host (after an eval, at a log step, before a checkpoint), so they add no per-step cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recsys_runner.errors import require

_MODES = ("max", "min")


@dataclass(kw_only=True)
class EarlyStoppingConfig:
    """``train.early_stopping``: stop when an eval metric has not improved for a while."""

    patience: int | None = None
    """Evaluations without improvement before training stops; ``null`` turns early stopping off.
    Evaluations happen every ``train.eval_every_steps``."""
    metric: str = "eval/auc"
    """The eval metric watched, as logged (``eval/auc``, ``eval/logloss``)."""
    mode: str = "max"
    """``max`` if higher is better (AUC), ``min`` if lower is better (log loss)."""
    min_delta: float = 0.0
    """An improvement smaller than this does not count."""

    def __post_init__(self) -> None:
        require(self.patience is None or self.patience > 0, f"train.early_stopping.patience must be positive or null, got {self.patience}")
        require(self.mode in _MODES, f"train.early_stopping.mode={self.mode!r} must be one of {_MODES}")
        require(self.min_delta >= 0, f"train.early_stopping.min_delta must be >= 0, got {self.min_delta}")
        require(self.metric.startswith("eval/"), f"train.early_stopping.metric={self.metric!r} must be an eval metric, e.g. eval/auc")


def improved(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` in direction ``mode``."""
    if best is None:
        return True
    return value > best + min_delta if mode == "max" else value < best - min_delta


class EarlyStopping:
    """Counts evaluations without improvement; :meth:`update` says when to stop."""

    def __init__(self, config: EarlyStoppingConfig) -> None:
        self.config = config
        self.best: float | None = None
        self.bad_evals = 0

    def update(self, metrics: dict[str, float]) -> bool:
        """Record one evaluation; ``True`` when training should stop."""
        c = self.config
        if c.patience is None:
            return False
        value = metrics[c.metric]
        if improved(value, self.best, c.mode, c.min_delta):
            self.best, self.bad_evals = value, 0
        else:
            self.bad_evals += 1
        return self.bad_evals >= c.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad_evals = state.get("best"), int(state.get("bad_evals", 0))


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss; the last good checkpoint (``checkpoint``) is left intact."""

    def __init__(self, message: str, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


def check_finite(loss: float, step: int, last_checkpoint: str | None, what: str | None = None) -> None:
    """Raise :class:`NonFiniteLossError` with what to do when ``loss`` is NaN or infinite.

    ``what`` replaces "train loss is <loss>" in the message (e.g. for non-finite weights)."""
    if math.isfinite(loss):
        return
    where = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no good checkpoint exists"
    raise NonFiniteLossError(
        f"{what or f'train loss is {loss}'} at step {step}; training stopped ({where}). Usual causes: a learning rate too "
        f"high (optim.lr, optim.sparse.lr, optim.dense.lr), fp16 without loss scaling, or bad input data. "
        f"Lower the lr or add train.clip_grad.max=1.0, then resume from the last good checkpoint with that change "
        f"(set train.nan_guard=false to train on regardless).",
        last_checkpoint,
    )


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
