"""Exponential moving average of the dense weights, optionally used for evaluation.

After every dense optimizer step taken ``shadow ← decay·shadow + (1 − decay)·param`` for each dense parameter
(one fused ``_foreach_lerp_``, no host sync); not after one the fp16 loss scaler skipped, which left the weights as they were. Embedding tables are excluded: they are updated
sparsely in backward by fbgemm, and an EMA of a 10⁸-row table would double its memory.
With ``train.ema.eval_with_ema=true`` evaluation swaps the EMA weights in and back out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from recsys_runner.errors import require


@dataclass(kw_only=True)
class EmaConfig:
    """``train.ema``: a moving average of the dense weights."""

    decay: float | None = None
    """EMA decay per optimizer step, e.g. 0.999; ``null`` turns EMA off."""
    eval_with_ema: bool = False
    """Evaluate (and pick the best checkpoint) with the EMA weights instead of the raw ones."""

    def __post_init__(self) -> None:
        require(self.decay is None or 0 < self.decay < 1, f"train.ema.decay must lie in (0, 1) or be null, got {self.decay}")
        require(not self.eval_with_ema or self.decay is not None, "train.ema.eval_with_ema=true needs train.ema.decay, e.g. 0.999")


class DenseEMA:
    """Shadow copies of ``params`` (the dense parameters by name) and their moving average."""

    def __init__(self, params: Mapping[str, nn.Parameter], decay: float) -> None:
        self.names = list(params)
        self.params = [params[n] for n in self.names]
        self.shadow = [p.detach().clone() for p in self.params]
        self.decay = decay

    @torch.no_grad()
    def update(self) -> None:
        """Move the shadow weights towards the current ones."""
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1.0 - self.decay)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """Within the block the model's dense parameters hold the EMA weights."""
        for p, s in zip(self.params, self.shadow, strict=True):
            tmp = p.detach().clone()
            p.copy_(s)
            s.copy_(tmp)
        try:
            yield
        finally:
            for p, s in zip(self.params, self.shadow, strict=True):
                tmp = p.detach().clone()
                p.copy_(s)
                s.copy_(tmp)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.shadow, strict=True))

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load the averages ``state`` holds; a weight it has none for starts its average at the weight as it is now.

        Why: a fine-tune (``checkpoint.init_from``) from a checkpoint written without ``train.ema.decay``, or one whose
        EMA tensor has another shape, hands over only the averages it has, after the model's weights were loaded. An
        average begins at the weights it averages (as a new run's begins at its initial weights), so those start at the
        loaded weights, not at the random ones this object was built with: evaluated with ``eval_with_ema`` they would
        score an untrained model. A resume never gets here without every one (the ``resume`` rule asks for them all)."""
        with torch.no_grad():
            for n, p, s in zip(self.names, self.params, self.shadow, strict=True):
                s.copy_(state[n] if n in state else p.detach())
