"""Early stopping: stop training when an eval metric stopped improving.

Small and stateful, checked by the runner only after an eval, where the numbers are already on the host.
A non-finite loss is the other reason to stop: the NaN guard (:mod:`recsys_runner.checkpoint.guard`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recsys_runner.errors import require
from recsys_runner.metrics.registry import DEFAULT_OBJECTIVE, improved

_MODES = ("max", "min")


@dataclass(kw_only=True)
class EarlyStoppingConfig:
    """``train.early_stopping``: stop when an eval metric has not improved for a while."""

    patience: int | None = None
    """Evaluations without improvement before training stops; ``null`` turns early stopping off.
    Evaluations happen every ``train.eval_every_steps``."""
    metric: str = DEFAULT_OBJECTIVE
    """The eval metric watched, as logged (``eval/auc``, ``eval/logloss``)."""
    mode: str | None = None
    """``null``: the metric's own direction (AUC higher is better, log loss lower;
    :func:`recsys_runner.metrics.registry.higher_is_better`), set by ``validate()``. ``max``/``min`` only for a metric
    without one; one contradicting the metric's direction is refused."""
    min_delta: float = 0.0
    """An improvement smaller than this does not count."""

    def __post_init__(self) -> None:
        require(self.patience is None or self.patience > 0, f"train.early_stopping.patience must be positive or null, got {self.patience}")
        require(self.mode in (None, *_MODES), f"train.early_stopping.mode={self.mode!r} must be one of {_MODES} or null")
        require(self.min_delta >= 0, f"train.early_stopping.min_delta must be >= 0, got {self.min_delta}")
        require(self.metric.startswith("eval/"), f"train.early_stopping.metric={self.metric!r} must be an eval metric, e.g. eval/auc")


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
        if improved(value, self.best, c.mode == "max", c.min_delta):
            self.best, self.bad_evals = value, 0
        else:
            self.bad_evals += 1
        return self.bad_evals >= c.patience

    def stopped(self) -> bool:
        """Whether the evaluations recorded so far say to stop (a run resumed at the step where it stopped early)."""
        return self.config.patience is not None and self.bad_evals >= self.config.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad_evals = state.get("best"), int(state.get("bad_evals", 0))
