"""The train-progress meter: running loss, samples/s and ETA between two log points."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from torch import Tensor


class Throughput:
    """Running train loss, samples/s and ETA between two log points.

    The loss is accumulated as a tensor and read (one device sync) only when logged.
    """

    def __init__(self, total_steps: int, global_batch_size: int) -> None:
        self.total_steps = total_steps
        self.global_batch_size = global_batch_size
        self._loss_sum: Tensor | None = None
        self._steps = 0
        self._since = time.perf_counter()

    def update(self, loss: Tensor) -> None:
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
