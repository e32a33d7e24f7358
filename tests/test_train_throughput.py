"""The training loop's throughput window (``train/loss``, ``train/samples_per_s``, ``train/eta_s``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from recsys_runner.train import throughput
from recsys_runner.train.throughput import Throughput


class _Clock:
    """``time.perf_counter`` under the test's control: it reads ``now``, which the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_throughput_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two steps of 100 assumed rows in 4 s, a 3 s eval paused out: 50 rows/s, and the 8 steps left at 2 s a step
    are 16 s; the next window starts at the flush."""
    clock = _Clock()
    monkeypatch.setattr(throughput, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    meter = Throughput(total_steps=10, global_batch_size=100)
    for v in (1.0, 3.0):
        meter.update(torch.tensor(v))
        clock.now += 2.0
    with meter.paused():
        clock.now += 3.0
    out = meter.flush(step=2)
    assert out == pytest.approx({"train/loss": 2.0, "train/samples_per_s": 50.0, "train/eta_s": 16.0})
    meter.update(torch.tensor(5.0))
    clock.now += 1.0
    assert meter.flush(step=3) == pytest.approx({"train/loss": 5.0, "train/samples_per_s": 100.0, "train/eta_s": 7.0})
