"""The two state layouts every metric class builds on: additive sums and kept rows.

States are synchronized over the default process group in ``compute()`` (:mod:`recsys_runner.metrics.state`), so
**each value equals what one process computes over the union of all ranks' data** — never an average of per-rank
values:

* :class:`SumMetric`: float64 sum states (log loss, accuracy, NE, calibration, MAE, MSE, recall@k, DecayAUC's
  bins), summed across ranks before ``compute`` divides;
* :class:`GatherMetric`: every row kept (``cat`` states; AUC, grouped AUC, XAUC, coverage@k's mask). Binary AUC
  and grouped AUC combine over ranks without copying the union onto any rank
  (:mod:`recsys_runner.metrics.sharded`): rows are routed to the rank owning their prediction's (AUC) or group id's
  (grouped AUC) range, each rank scores its range, and exact integer rank sums or the groups' ``(auc, weight)`` come
  back — each rank holds about its share, whatever the world size. XAUC, the multi-class macro AUC and coverage@k
  gather every rank's rows onto every rank and compute once on the union. Either way grouped AUC sees all of a
  group's rows even when they were spread over ranks, and every computation is invariant to the order of the rows.

Collectives: ``compute()`` is collective when a process group is initialized, so every rank must call it, in the
same order; a rank that holds no rows (never updated) joins the routing or the gathers with none.

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


MERGE_PIECES = 64
"""A list state's pieces kept by :meth:`GatherMetric.keep` are concatenated into one every this many."""


class GatherMetric(RecMetric):
    """Base of ranking metrics: keeps every row; ``compute`` runs on all ranks' rows gathered, unless the metric routes
    them itself (:meth:`~recsys_runner.metrics.state.Metric._compute_sharded`: AUC, grouped AUC)."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        self._pieces: dict[str, int] = {}
        for name in names:
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def keep(self, name: str, rows: Tensor) -> None:
        """Append a batch's ``rows`` to list state ``name``; every :data:`MERGE_PIECES` appends, the last ones become one
        tensor (the same rows in the same order, so every value is unchanged).

        Why: one small tensor kept per eval batch, between the batch's large short-lived buffers (the model's outputs,
        its sparse ids), fragments the allocator's heap: at 2M rows grouped AUC's 25 MB of kept rows held the process's
        RSS ~285 MB higher in most runs; merged, ~50 MB (docs/performance.md, "At scale")."""
        state = getattr(self, name)
        state.append(rows)
        self._pieces[name] = self._pieces.get(name, 0) + 1
        if self._pieces[name] >= MERGE_PIECES:
            state[-MERGE_PIECES:] = [torch.cat(state[-MERGE_PIECES:])]
            self._pieces[name] = 0

    def reset(self) -> None:
        super().reset()
        self._pieces.clear()

    def _rows(self, name: str) -> Tensor:
        state = getattr(self, name)
        if isinstance(state, list):
            return torch.cat(state) if state else torch.zeros(0, dtype=torch.long if name == "groups" else torch.float64, device=self.device)
        return state
