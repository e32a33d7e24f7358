"""The training loop's throughput window (``train/loss``, ``train/samples_per_s``, ``train/eta_s``)."""

from __future__ import annotations

import pytest
import torch

from recsys_runner.train.throughput import Throughput


def test_throughput_window() -> None:
    meter = Throughput(total_steps=10, global_batch_size=100)
    for v in (1.0, 3.0):
        meter.update(torch.tensor(v))
    out = meter.flush(step=2)
    assert out["train/loss"] == pytest.approx(2.0) and out["train/samples_per_s"] > 0 and out["train/eta_s"] >= 0
