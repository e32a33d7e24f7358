"""Learning-rate schedules as pure functions ``step → multiplier`` of each group's base lr.

Each schedule is a small callable class that takes its config dataclass (``CosineConfig`` …, all
:class:`SchedulerConfig` subclasses, the schemas of ``conf/scheduler/*.yaml``) plus the runtime counts only
the builder knows: ``config.build(total_steps=…, steps_per_epoch=…)``. :func:`lr_scheduler`
wraps them in one ``torch.optim.lr_scheduler.LambdaLR`` over the combined optimizer with one
function per param group: by default the top-level ``scheduler`` drives every lr (sparse, dense,
each part); ``optim.sparse_scheduler``, ``optim.dense_scheduler`` and ``optim.parts.<name>.scheduler``
replace it for their group. The fused sparse optimizer picks up its new lr on the next ``step()``.
Being closed-form, every schedule is testable against its formula.

Every schedule has a linear warmup (``warmup_steps``, starting at ``warmup_start`` × base lr) and
counts its own step parameters from the end of the warmup. With ``by_epoch=true`` every count
(warmup, decay, boundaries, cycles) is in epochs and the lr changes only at epoch boundaries.
"""

from __future__ import annotations

import abc
import bisect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from recsys_runner.configurable import Configurable
from recsys_runner.errors import ConfigError, require

if TYPE_CHECKING:
    from recsys_runner.optim.optimizers import GroupedOptimizer, OptimizerGroup


def _warmup(step: int, warmup_steps: int, warmup_start: float) -> float | None:
    """Linear warmup multiplier from ``warmup_start`` to 1, or ``None`` once warmup is over."""
    if step < warmup_steps:
        return warmup_start + (1.0 - warmup_start) * step / warmup_steps
    return None


_SCHEDULER_KEY = re.compile(r"(?<![\w.])scheduler\.")


def schedule_error(where: str, error: ConfigError) -> ConfigError:
    """``error`` of a schedule's config or build, with its keys named where the schedule sits.

    The checks below name the top-level ``scheduler.<key>``, but the same configs also sit in
    ``optim.sparse_scheduler``, ``optim.dense_scheduler`` and ``optim.parts.<name>.scheduler``; there the fix is to
    change ``optim.sparse_scheduler.warmup_steps``, and ``scheduler.warmup_steps`` would change another schedule.
    """
    if where == "scheduler":
        return error
    return ConfigError(_SCHEDULER_KEY.sub(f"{where}.", str(error)))


@dataclass(kw_only=True)
class SchedulerConfig(Configurable):
    """Base of every schedule's config: the warmup every schedule has. ``_target_`` names a :class:`Schedule`."""

    warmup_steps: int = 0
    """Steps of linear warmup before the schedule proper starts (epochs if ``by_epoch``)."""
    warmup_start: float = 0.0
    """Multiplier of the base lr at step 0 of the warmup (TorchEasyRec's warmup_learning_rate / lr)."""
    by_epoch: bool = False
    """Count every step parameter of this schedule in epochs; the lr then changes once per epoch."""

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 0, f"scheduler.warmup_steps must be >= 0, got {self.warmup_steps}")
        require(0 <= self.warmup_start <= 1, f"scheduler.warmup_start must lie in [0, 1], got {self.warmup_start}")

    def build(self, *, total_steps: int, steps_per_epoch: int | None = None) -> Schedule:
        """The schedule for a run of ``total_steps`` optimizer steps (``steps_per_epoch`` of them per epoch, if known)."""
        schedule = self.component_class()(self, total_steps=total_steps, steps_per_epoch=steps_per_epoch)
        assert isinstance(schedule, Schedule), f"{self._target_} is not a recsys_runner.optim.schedulers.Schedule"
        return schedule


@dataclass(kw_only=True)
class ConstantConfig(SchedulerConfig):
    """Schema of ``conf/scheduler/constant.yaml``."""

    _target_: str = "recsys_runner.optim.schedulers.Constant"


@dataclass(kw_only=True)
class ExponentialDecayConfig(SchedulerConfig):
    """Schema of ``conf/scheduler/exponential_decay.yaml``."""

    _target_: str = "recsys_runner.optim.schedulers.ExponentialDecay"
    decay_steps: int = 1000
    """The lr is multiplied by ``decay_rate`` every ``decay_steps`` steps after warmup."""
    decay_rate: float = 0.5
    """Factor per ``decay_steps``, in (0, 1]."""
    staircase: bool = False
    """Decay in discrete jumps (``floor``) instead of continuously."""
    min_factor: float = 0.0
    """Floor of the multiplier (a minimum lr as a fraction of the base lr)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.decay_steps > 0, f"scheduler.decay_steps must be positive, got {self.decay_steps}")
        require(0 < self.decay_rate <= 1, f"scheduler.decay_rate must lie in (0, 1], got {self.decay_rate}; "
                "e.g. scheduler.decay_rate=0.5 halves the lr every scheduler.decay_steps")
        require(0 <= self.min_factor <= 1, f"scheduler.min_factor must lie in [0, 1], got {self.min_factor}")


@dataclass(kw_only=True)
class CosineConfig(SchedulerConfig):
    """Schema of ``conf/scheduler/cosine.yaml``."""

    _target_: str = "recsys_runner.optim.schedulers.Cosine"
    min_factor: float = 0.0
    """Multiplier reached at the last step."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.min_factor <= 1, f"scheduler.min_factor must lie in [0, 1], got {self.min_factor}")


@dataclass(kw_only=True)
class CosineRestartsConfig(CosineConfig):
    """Schema of ``conf/scheduler/cosine_restarts.yaml`` (SGDR: cosine with warm restarts)."""

    _target_: str = "recsys_runner.optim.schedulers.CosineRestarts"
    cycle_steps: int = 1000
    """Length of the first cosine cycle after warmup."""
    cycle_mult: int = 1
    """Each cycle is this many times longer than the previous one (1 = equal cycles)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.cycle_steps > 0, f"scheduler.cycle_steps must be positive, got {self.cycle_steps}")
        require(self.cycle_mult >= 1, f"scheduler.cycle_mult must be >= 1, got {self.cycle_mult}")


@dataclass(kw_only=True)
class ManualStepConfig(SchedulerConfig):
    """Schema of ``conf/scheduler/manual_step.yaml``: piecewise-constant multipliers."""

    _target_: str = "recsys_runner.optim.schedulers.ManualStep"
    boundaries: list[int] = field(default_factory=lambda: [1000, 2000])
    """Steps after warmup at which the next rate starts, strictly increasing."""
    rates: list[float] = field(default_factory=lambda: [1.0, 0.1, 0.01])
    """Multipliers of the base lr: ``rates[i]`` until ``boundaries[i]``; one more than boundaries."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.rates) == len(self.boundaries) + 1,
                f"scheduler.rates needs one more entry than scheduler.boundaries, got {len(self.rates)} rates "
                f"for {len(self.boundaries)} boundaries: rates are multipliers of the base lr, rates[0] before the first "
                f"boundary (TorchEasyRec's learning_rates [x, y] at schedule_sizes [a, b] are lrs after each size: here "
                f"scheduler.boundaries=[a,b] scheduler.rates=[1,x/lr,y/lr])")
        require(all(b > 0 for b in self.boundaries) and list(self.boundaries) == sorted(set(self.boundaries)),
                f"scheduler.boundaries must be positive and strictly increasing, got {self.boundaries}")
        require(all(r >= 0 for r in self.rates), f"scheduler.rates must be >= 0, got {self.rates}")


class Schedule(abc.ABC):
    """``step → multiplier`` of the base lr: the warmup, then :meth:`after_warmup`. Built by :meth:`SchedulerConfig.build`.

    ``total_steps`` and ``warmup_steps`` are in epochs when ``config.by_epoch`` (``steps_per_epoch`` is then required).
    """

    def __init__(self, config: SchedulerConfig, *, total_steps: int, steps_per_epoch: int | None = None) -> None:
        if config.by_epoch:
            if not steps_per_epoch:
                raise ConfigError("scheduler.by_epoch=true needs a dataset whose epoch length is known up front; "
                                  "set scheduler.by_epoch=false")
            total = math.ceil(total_steps / steps_per_epoch)
        else:
            total = total_steps
        unit = "epochs" if config.by_epoch else "training steps"
        if config.warmup_steps > total:
            raise ConfigError(
                f"scheduler.warmup_steps={config.warmup_steps} exceeds the run's {total} {unit}. Fix: "
                f"scheduler.warmup_steps<={total} (e.g. {max(total // 10, 1)}, a tenth of the run), or train longer: "
                f"{'train.num_epochs' if config.by_epoch else 'train.num_steps'}>={config.warmup_steps}"
            )
        self.total_steps, self.warmup_steps, self.warmup_start = total, config.warmup_steps, config.warmup_start
        self.steps_per_epoch = steps_per_epoch if config.by_epoch else None

    def __call__(self, step: int) -> float:
        if self.steps_per_epoch:
            step //= self.steps_per_epoch
        warm = _warmup(step, self.warmup_steps, self.warmup_start)
        return warm if warm is not None else self.after_warmup(step - self.warmup_steps)

    @abc.abstractmethod
    def after_warmup(self, step: int) -> float:
        """Multiplier ``step`` steps after warmup ended."""


class Constant(Schedule):
    """``1`` after an optional linear warmup."""

    def __init__(self, config: ConstantConfig, *, total_steps: int, steps_per_epoch: int | None = None) -> None:
        super().__init__(config, total_steps=total_steps, steps_per_epoch=steps_per_epoch)

    def after_warmup(self, step: int) -> float:
        return 1.0


class ExponentialDecay(Schedule):
    """``max(min_factor, decay_rate ** (t / decay_steps))`` after warmup (``floor`` if staircase)."""

    def __init__(self, config: ExponentialDecayConfig, *, total_steps: int, steps_per_epoch: int | None = None) -> None:
        super().__init__(config, total_steps=total_steps, steps_per_epoch=steps_per_epoch)
        self.config = config

    def after_warmup(self, step: int) -> float:
        c = self.config
        exponent = step / c.decay_steps
        if c.staircase:
            exponent = math.floor(exponent)
        return max(c.min_factor, c.decay_rate**exponent)


def _half_cosine(progress: float, min_factor: float) -> float:
    return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))


class Cosine(Schedule):
    """Half-cosine from 1 down to ``min_factor`` over the steps after warmup."""

    def __init__(self, config: CosineConfig, *, total_steps: int, steps_per_epoch: int | None = None) -> None:
        super().__init__(config, total_steps=total_steps, steps_per_epoch=steps_per_epoch)
        self.config = config

    def after_warmup(self, step: int) -> float:
        span = max(self.total_steps - self.warmup_steps, 1)
        return _half_cosine(min(step / span, 1.0), self.config.min_factor)


class CosineRestarts(Schedule):
    """Cosine from 1 to ``min_factor`` over each cycle, restarting at 1; cycle ``i`` lasts
    ``cycle_steps * cycle_mult**i`` steps (SGDR)."""

    def __init__(self, config: CosineRestartsConfig, *, total_steps: int, steps_per_epoch: int | None = None) -> None:
        super().__init__(config, total_steps=total_steps, steps_per_epoch=steps_per_epoch)
        self.config = config

    def after_warmup(self, step: int) -> float:
        length = self.config.cycle_steps
        while step >= length:
            step -= length
            length *= self.config.cycle_mult
        return _half_cosine(step / length, self.config.min_factor)


class ManualStep(Schedule):
    """``rates[i]`` for ``boundaries[i-1] <= t < boundaries[i]`` (t counted after warmup)."""

    def __init__(self, config: ManualStepConfig, *, total_steps: int, steps_per_epoch: int | None = None) -> None:
        super().__init__(config, total_steps=total_steps, steps_per_epoch=steps_per_epoch)
        self.config = config

    def after_warmup(self, step: int) -> float:
        return self.config.rates[bisect.bisect_right(self.config.boundaries, step)]


class ScheduledLR(torch.optim.lr_scheduler.LambdaLR):
    """torch's ``LambdaLR`` whose step leaves the param groups alone when no schedule moved an lr.

    Why: torch's step reads the combined optimizer's ``param_groups`` (a list built on every read) four
    times and rewrites every group's lr, ~80 µs of host work per step; with a constant schedule, or any
    schedule between its changes (``by_epoch``, ``manual_step``), nothing changes. The lrs, ``last_epoch``,
    ``get_last_lr()`` and the state dict are those of ``LambdaLR``. :attr:`moved` says whether the last
    step changed an lr, so that the fused kernels are handed a new lr only then (:class:`~recsys_runner.train.stepping.Stepper`).
    The first step always counts as moved (it runs torch's own step, with its check that the optimizer stepped first).
    """

    moved: bool = True

    def step(self, epoch: int | None = None) -> None:
        last = getattr(self, "_last_lr", None)  # absent during LambdaLR's own first step, in its __init__
        if epoch is None and self._step_count > 1 and last is not None and all(isinstance(lr, float) for lr in last):
            step = self.last_epoch + 1
            if [base * schedule(step) for base, schedule in zip(self.base_lrs, self.lr_lambdas, strict=True)] == last:
                self._step_count += 1
                self.last_epoch = step
                self.moved = False
                return
        super().step(epoch)
        self.moved = True

    def applied_lrs(self) -> list[float]:
        """Each param group's lr *during* the optimizer step that the last :meth:`step` call closed: what that step
        trained with and what the loop logs at it. ``get_last_lr()`` (and the groups' ``lr``) is already the next
        step's, which differs under warmup and decay. Before any step: the first step's."""
        step = self.last_epoch - 1
        if step < 0:
            return [float(lr) for lr in self.get_last_lr()]
        return [float(base * schedule(step)) for base, schedule in zip(self.base_lrs, self.lr_lambdas, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        """``LambdaLR``'s state dict: :attr:`moved` is a per-step flag, not state."""
        return {k: v for k, v in super().state_dict().items() if k != "moved"}


def lr_scheduler(
    optimizer: GroupedOptimizer, schedules: Mapping[OptimizerGroup, Callable[[int], float]], default: Callable[[int], float]
) -> ScheduledLR:
    """One :class:`ScheduledLR` whose function for each param group is its optimizer group's schedule.

    ``schedules`` maps an optimizer group (sparse, dense, a part) to its schedule; the others use ``default``.
    """
    lambdas = [schedules.get(group, default) for group, opt in optimizer.groups for _ in opt.param_groups]
    return ScheduledLR(optimizer, lr_lambda=lambdas)


class SchedulePosition:
    """Checkpoint view of a ``LambdaLR``: only its position (the step count), not lrs or the schedules' parameters.

    ``LambdaLR.state_dict`` also stores each schedule object's attributes, its base lrs and its last
    lrs; loading those would silently replace a relaunch's settings with the old ones: a longer
    ``train.num_steps``, another schedule, or the lower ``optim.lr`` a NaN-guard stop asks for. The
    lrs are recomputed from this run's base lrs and schedules at the restored position.
    """

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, int]:
        return {"last_epoch": self.scheduler.last_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Move this run's scheduler to the saved step, through its public ``state_dict``/``load_state_dict``:
        its own state (this run's base lrs and schedules) with only the position replaced."""
        s = self.scheduler
        step = int(state["last_epoch"])
        lrs = [base * schedule(step) for base, schedule in zip(s.base_lrs, s.lr_lambdas, strict=True)]
        s.load_state_dict({**s.state_dict(), "last_epoch": step, "_step_count": step + 1, "_last_lr": lrs})
        for group, lr in zip(s.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
