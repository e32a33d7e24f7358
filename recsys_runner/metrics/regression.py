"""Regression metrics: mean absolute and mean squared error (sums, summed across ranks).

``update(preds, labels)`` with ``preds`` and ``labels`` real ``[B]``.
"""

from __future__ import annotations

from torch import Tensor

from recsys_runner.metrics.base import SumMetric


class MeanAbsoluteError(SumMetric):
    """``mean |pred − label|``."""

    higher_is_better = False

    total: Tensor
    count: Tensor

    def __init__(self) -> None:
        super().__init__("total", "count")

    def update(self, preds: Tensor, labels: Tensor) -> None:
        self.total += (preds.detach().double() - labels.detach().double()).abs().sum()
        self.count += labels.numel()

    def compute(self) -> Tensor:
        return self.total / self.count.clamp_min(1)


class MeanSquaredError(SumMetric):
    """``mean (pred − label)²``."""

    higher_is_better = False

    total: Tensor
    count: Tensor

    def __init__(self) -> None:
        super().__init__("total", "count")

    def update(self, preds: Tensor, labels: Tensor) -> None:
        self.total += (preds.detach().double() - labels.detach().double()).pow(2).sum()
        self.count += labels.numel()

    def compute(self) -> Tensor:
        return self.total / self.count.clamp_min(1)
