"""Learning-rate schedules as pure functions ``step → multiplier`` of each group's base lr.

Each schedule is a small callable class, instantiated as a partial from ``conf/scheduler/*.yaml``
and completed by the builder with ``total_steps``. The builder wraps it in
``torch.optim.lr_scheduler.LambdaLR`` over the combined (sparse + dense) optimizer, so one schedule
drives both learning rates; the fused sparse optimizer picks up its new lr on the next ``step()``.
Being closed-form, every schedule is trivially testable against its formula.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

from recsys_runner.errors import ConfigError, require


def _warmup(step: int, warmup_steps: int, warmup_start: float) -> float | None:
    """Linear warmup multiplier from ``warmup_start`` to 1, or ``None`` once warmup is over."""
    if step < warmup_steps:
        return warmup_start + (1.0 - warmup_start) * step / warmup_steps
    return None


@dataclass(kw_only=True)
class _WarmupConfig:
    warmup_steps: int = 0
    """Steps of linear warmup before the schedule proper starts."""
    warmup_start: float = 0.0
    """Multiplier of the base lr at step 0 of the warmup."""

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 0, f"scheduler.warmup_steps must be >= 0, got {self.warmup_steps}")
        require(0 <= self.warmup_start <= 1, f"scheduler.warmup_start must lie in [0, 1], got {self.warmup_start}")


@dataclass(kw_only=True)
class ConstantConfig(_WarmupConfig):
    """Schema of ``conf/scheduler/constant.yaml``."""

    _target_: str = "recsys_runner.scheduler.Constant"
    _partial_: bool = True


@dataclass(kw_only=True)
class ExponentialDecayConfig(_WarmupConfig):
    """Schema of ``conf/scheduler/exponential_decay.yaml``."""

    _target_: str = "recsys_runner.scheduler.ExponentialDecay"
    _partial_: bool = True
    decay_steps: int = 1000
    """The lr is multiplied by ``decay_rate`` every ``decay_steps`` steps after warmup."""
    decay_rate: float = 0.5
    staircase: bool = False
    """Decay in discrete jumps (``floor``) instead of continuously."""
    min_factor: float = 0.0
    """Floor of the multiplier (a minimum lr as a fraction of the base lr)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.decay_steps > 0, f"scheduler.decay_steps must be positive, got {self.decay_steps}")
        require(0 < self.decay_rate <= 1, f"scheduler.decay_rate must lie in (0, 1], got {self.decay_rate}")
        require(0 <= self.min_factor <= 1, f"scheduler.min_factor must lie in [0, 1], got {self.min_factor}")


@dataclass(kw_only=True)
class CosineConfig(_WarmupConfig):
    """Schema of ``conf/scheduler/cosine.yaml``."""

    _target_: str = "recsys_runner.scheduler.Cosine"
    _partial_: bool = True
    min_factor: float = 0.0
    """Multiplier reached at the last step."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.min_factor <= 1, f"scheduler.min_factor must lie in [0, 1], got {self.min_factor}")


class _Schedule(abc.ABC):
    def __init__(self, *, total_steps: int, warmup_steps: int = 0, warmup_start: float = 0.0) -> None:
        if warmup_steps > total_steps:
            raise ConfigError(
                f"scheduler.warmup_steps={warmup_steps} exceeds the run's {total_steps} training steps; "
                f"lower scheduler.warmup_steps or train longer"
            )
        self.total_steps, self.warmup_steps, self.warmup_start = total_steps, warmup_steps, warmup_start

    def __call__(self, step: int) -> float:
        warm = _warmup(step, self.warmup_steps, self.warmup_start)
        return warm if warm is not None else self.after_warmup(step - self.warmup_steps)

    @abc.abstractmethod
    def after_warmup(self, step: int) -> float:
        """Multiplier ``step`` steps after warmup ended."""


class Constant(_Schedule):
    """``1`` after an optional linear warmup."""

    def after_warmup(self, step: int) -> float:
        return 1.0


class ExponentialDecay(_Schedule):
    """``max(min_factor, decay_rate ** (t / decay_steps))`` after warmup (``floor`` if staircase)."""

    def __init__(
        self, *, total_steps: int, decay_steps: int, decay_rate: float, staircase: bool = False,
        min_factor: float = 0.0, warmup_steps: int = 0, warmup_start: float = 0.0,
    ) -> None:
        super().__init__(total_steps=total_steps, warmup_steps=warmup_steps, warmup_start=warmup_start)
        self.decay_steps, self.decay_rate, self.staircase, self.min_factor = decay_steps, decay_rate, staircase, min_factor

    def after_warmup(self, step: int) -> float:
        exponent = step / self.decay_steps
        if self.staircase:
            exponent = math.floor(exponent)
        return max(self.min_factor, self.decay_rate**exponent)


class Cosine(_Schedule):
    """Half-cosine from 1 down to ``min_factor`` over the steps after warmup."""

    def __init__(self, *, total_steps: int, min_factor: float = 0.0, warmup_steps: int = 0, warmup_start: float = 0.0) -> None:
        super().__init__(total_steps=total_steps, warmup_steps=warmup_steps, warmup_start=warmup_start)
        self.min_factor = min_factor

    def after_warmup(self, step: int) -> float:
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min(step / span, 1.0)
        return self.min_factor + (1 - self.min_factor) * 0.5 * (1 + math.cos(math.pi * progress))
