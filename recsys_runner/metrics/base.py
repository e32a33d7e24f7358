"""The two state layouts every metric class builds on: additive sums and kept rows.

States are synchronized over the default process group in ``compute()`` (:mod:`recsys_runner.metrics.state`), so
**each value equals what one process computes over the union of all ranks' data** — never an average of per-rank
values:

* :class:`SumMetric`: float64 sum states (log loss, accuracy, NE, calibration, MAE, MSE, recall@k, DecayAUC's
  bins), summed across ranks before ``compute`` divides;
* :class:`GatherMetric`: every row kept (``cat`` states; AUC, grouped AUC, XAUC), gathered from all ranks,
  then computed once on the union. Grouped AUC therefore sees all of a group's rows even when they were
  spread over ranks, and every computation is invariant to the order of the rows.

Collectives: ``compute()`` is collective when a process group is initialized, so every rank must call it, in the
same order; a rank that holds no rows (never updated) joins the gathers with none.

Each metric class states its direction in the ``higher_is_better`` class attribute (``None``: best
at a target value, e.g. calibration at 1); :func:`recsys_runner.metrics.registry.higher_is_better` reads it.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from recsys_runner.metrics.state import Metric


class RecMetric(Metric):
    """Base of every metric here (on :class:`~recsys_runner.metrics.state.Metric`, which says how states combine over
    ranks): whether batches may be merged before ``update``."""

    batch_exact: ClassVar[bool] = False
    """Whether one ``update`` on concatenated batches gives exactly the state of one ``update`` per batch (integer
    counts do; float sums may round differently), so deferred train updates may be batched."""


class SumMetric(RecMetric):
    """Base of additive metrics: float64 sum states, summed across ranks before ``compute``."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        for name in names:
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    @staticmethod
    def mean(total: Tensor, count: Tensor) -> Tensor:
        """``total / count``, NaN over no rows: a mean of nothing is undefined, as AUC over one class is. A 0 there would
        read as a perfect log loss or error (a masked task's eval without one masked row) and, in a decaying train
        metric, pull the smoothed value toward it (:class:`~recsys_runner.metrics.decay.DecayingMetric` passes over a
        NaN window)."""
        return torch.where(count > 0, total / count.clamp_min(1), torch.nan)


class GatherMetric(RecMetric):
    """Base of ranking metrics: keeps every row; ``compute`` runs on all ranks' rows gathered."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        for name in names:
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def _rows(self, name: str) -> Tensor:
        state = getattr(self, name)
        if isinstance(state, list):
            return torch.cat(state) if state else torch.zeros(0, dtype=torch.long if name == "groups" else torch.float64, device=self.device)
        return state
