"""What one optimizer step does beyond ``optimizer.step()``: accumulation, loss scaling, clipping, EMA.

TorchRec's train pipelines call ``optimizer.zero_grad()``, ``_backward(losses)`` and
``optimizer.step()`` once per batch. When any of these features is on, :class:`StepPolicy` wraps
the optimizer the pipeline sees and replaces the pipeline's ``_backward`` (the hook TorchEasyRec
also overrides); when all are off the builder hands the pipeline the plain optimizer, so the
default path costs nothing.

Gradient accumulation over ``N`` micro-batches: the loss is divided by ``N``, dense gradients
are summed, and the dense optimizer steps once per ``N`` micro-batches — exactly one step on the
``N``-times larger batch. **Fused embedding optimizers update rows inside backward**, so the
embedding tables still take one (``1/N``-sized) update per micro-batch: for SGD that sums to the
large-batch update except that later micro-batches see already-updated rows; for Adagrad-type
optimizers the accumulator also advances per micro-batch. Likewise clipping (``train.clip_grad``)
applies to the dense gradients only; the embedding kernels clip per element with
``optim.sparse.gradient_clipping``/``max_gradient``.

fp16 loss scaling: the scaled gradient flowing back into the embedding tables is divided by the
current scale on the way (a hook on every ``SparseArch`` output), and zeroed if it overflowed, so
the fused optimizer sees true gradients; the dense step is skipped on overflow by the GradScaler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from recsys_runner.ema import DenseEMA
from recsys_runner.errors import require

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


class _UnscaleGrad(torch.autograd.Function):
    """Identity forward; backward divides by the loss scale and zeroes a non-finite gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scaler: torch.amp.GradScaler) -> torch.Tensor:
        ctx.scaler = scaler
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        scale = ctx.scaler._get_scale_async()
        unscaled = grad / scale.to(grad.device)
        finite = torch.isfinite(unscaled).all()
        return torch.where(finite, unscaled, torch.zeros_like(unscaled)), None


class StepPolicy:
    """Stands in for the optimizer inside the train pipeline; see the module docstring."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, *, accumulation_steps: int = 1, scaler: torch.amp.GradScaler | None = None,
        clip: ClipConfig | None = None, ema: DenseEMA | None = None,
    ) -> None:
        self.optimizer, self.accumulation_steps, self.scaler, self.ema = optimizer, accumulation_steps, scaler, ema
        self.clip = clip if clip is not None and clip.max is not None else None
        self._micro = 0

    @property
    def active(self) -> bool:
        """Whether the pipeline needs this wrapper at all (else it gets the plain optimizer)."""
        return bool(self.accumulation_steps > 1 or self.scaler or self.clip or self.ema)

    def install(self, pipeline: Any, model: nn.Module) -> None:
        """Route the pipeline's backward through :meth:`backward`; hook embedding outputs for fp16."""
        pipeline._backward = self.backward
        if self.scaler is not None:
            from recsys_runner.models.common import SparseArch

            for module in model.modules():
                if isinstance(module, SparseArch):
                    module.register_forward_hook(lambda _m, _i, out: _UnscaleGrad.apply(out, self.scaler))

    # -- what the pipeline calls -----------------------------------------------------------------
    def backward(self, losses: torch.Tensor) -> None:
        loss = torch.sum(losses, dim=0)
        if self.accumulation_steps > 1:
            loss = loss / self.accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._micro == 0:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        self._micro += 1
        if self._micro < self.accumulation_steps:
            return
        self._micro = 0
        if self.clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            params = [p for g in self.optimizer.param_groups for p in g["params"] if getattr(p, "grad", None) is not None]
            limit = self.clip.max
            assert limit is not None, "ClipConfig validation guarantees train.clip_grad.max when clipping is on"
            if self.clip.mode == "norm":
                torch.nn.utils.clip_grad_norm_(params, limit, foreach=True)
            else:
                torch.nn.utils.clip_grad_value_(params, limit, foreach=True)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.ema is not None:
            self.ema.update()

    def reset(self) -> None:
        """Drop a partial accumulation (at an epoch boundary)."""
        if self._micro:
            self._micro = 0
            self.optimizer.zero_grad(set_to_none=True)

    @property
    def param_groups(self) -> Any:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
