"""Regression metrics: mean absolute and mean squared error (sums, summed across ranks).

``update(preds, labels)`` with ``preds`` and ``labels`` real ``[B]``.
"""

from __future__ import annotations

from torch import Tensor

from recsys_runner.metrics.base import SumMetric


class _MeanRowError(SumMetric):
    """``mean error(pred, label)`` over rows: a float64 sum and a count, summed across ranks."""

    higher_is_better = False

    total: Tensor
    count: Tensor

    def __init__(self) -> None:
        super().__init__("total", "count")

    @staticmethod
    def row_errors(diff: Tensor) -> Tensor:
        """Each row's error from ``pred - label`` (float64)."""
        raise NotImplementedError

    def update(self, preds: Tensor, labels: Tensor) -> None:
        self.total += self.row_errors(preds.detach().double() - labels.detach().double()).sum()
        self.count += labels.numel()

    def compute(self) -> Tensor:
        return self.total / self.count.clamp_min(1)


class MeanAbsoluteError(_MeanRowError):
    """``mean |pred − label|``."""

    @staticmethod
    def row_errors(diff: Tensor) -> Tensor:
        return diff.abs()


class MeanSquaredError(_MeanRowError):
    """``mean (pred − label)²``."""

    @staticmethod
    def row_errors(diff: Tensor) -> Tensor:
        return diff.pow(2)
