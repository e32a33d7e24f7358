"""Evaluation and train-progress metrics.

Eval metrics are torchmetrics objects whose states are synchronized over the default process
group in ``compute()``: AUC gathers every rank's predictions and labels, log loss sums, so each
value equals what one process would compute over the union of all ranks' data — not an average
of per-rank values.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import BinaryAUROC


class LogLoss(Metric):
    """Mean binary cross-entropy of probabilities, summed across ranks before dividing."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, probs: torch.Tensor, labels: torch.Tensor) -> None:  # type: ignore[override]
        losses = F.binary_cross_entropy(probs.double().clamp(1e-7, 1 - 1e-7), labels.double(), reduction="sum")
        self.total += losses
        self.count += labels.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.count.clamp_min(1)


def eval_metrics(device: torch.device) -> MetricCollection:
    """Binary-classification eval metrics: ``auc`` and ``logloss``."""
    return MetricCollection({"auc": BinaryAUROC(), "logloss": LogLoss()}).to(device)


class Throughput:
    """Running train loss, samples/s and ETA between two log points.

    The loss is accumulated as a tensor and read (one device sync) only when logged.
    """

    def __init__(self, total_steps: int, global_batch_size: int) -> None:
        self.total_steps = total_steps
        self.global_batch_size = global_batch_size
        self._loss_sum: torch.Tensor | None = None
        self._steps = 0
        self._since = time.perf_counter()

    def update(self, loss: torch.Tensor) -> None:
        if self._loss_sum is None:
            self._loss_sum = loss.detach().clone().float()
        else:
            self._loss_sum.add_(loss.detach())
        self._steps += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Exclude the enclosed time (evaluation) from the samples/s window."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._since += time.perf_counter() - start

    def flush(self, step: int) -> dict[str, float]:
        """Metrics since the last flush; resets the window."""
        now = time.perf_counter()
        elapsed = max(now - self._since, 1e-9)
        steps = max(self._steps, 1)
        rate = self._steps * self.global_batch_size / elapsed
        out = {
            "train/loss": float(self._loss_sum) / steps if self._loss_sum is not None else float("nan"),
            "train/samples_per_s": rate,
            "train/eta_s": (self.total_steps - step) * elapsed / steps,
        }
        self._loss_sum, self._steps, self._since = None, 0, now
        return out
