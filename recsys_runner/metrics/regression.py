"""Regression metrics: mean absolute and mean squared error (sums, summed across ranks).

``update(preds, labels)`` with ``preds`` and ``labels`` real ``[B]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from recsys_runner.metrics.base import SumMetric


class _MeanRowError(SumMetric):
    """``mean error(pred, label)`` over rows: a float64 sum and a count, summed across ranks."""

    higher_is_better = False

    total: Tensor
    count: Tensor

    def __init__(self, row_errors: Callable[[Tensor], Tensor]) -> None:
        super().__init__("total", "count")
        self.row_errors = row_errors
        """Each row's error from ``pred - label`` (float64)."""

    def update(self, preds: Tensor, labels: Tensor) -> None:
        self.total += self.row_errors(preds.detach().double() - labels.detach().double()).sum()
        self.count += labels.numel()

    def compute(self) -> Tensor:
        return self.mean(self.total, self.count)


class MeanAbsoluteError(_MeanRowError):
    """``mean |pred − label|``."""

    def __init__(self) -> None:
        super().__init__(torch.abs)


class MeanSquaredError(_MeanRowError):
    """``mean (pred − label)²``."""

    def __init__(self) -> None:
        super().__init__(torch.square)
