"""Decaying train metrics (TorchEasyRec's ``TrainMetricWrapper`` and ``DecayAUC``), apart from eval.

:class:`DecayingMetric` smooths any metric over windows of ``decay_step`` updates; :class:`DecayAUC` keeps an
exponentially decayed histogram instead of rows; :class:`TrainMetrics` is one task's set, keyed ``train/<name>``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from recsys_runner.metrics.base import GatherMetric, SumMetric
from recsys_runner.metrics.functional import histogram_auc
from recsys_runner.metrics.state import Metric


class DecayAUC(SumMetric):
    """AUC of an exponentially decayed history, for train-time logging (TorchEasyRec's DecayAUC).

    Predictions in ``[0, 1]`` are binned into ``num_bins`` equal bins; ``update`` counts positives
    and negatives per bin into a buffer, and :meth:`decay` folds the buffer into the history,
    ``history = rate · history + (1 − rate) · buffer`` (the first fold copies the buffer). ``compute``
    is the AUC of the history's weighted rows (rows in one bin tie). Bin counts are summed across ranks.
    """

    higher_is_better = True

    batch_exact = True
    """Bin counts only (integers in float64): one ``update`` on several batches concatenated is exactly their
    updates in turn."""
    pos_hist: Tensor
    neg_hist: Tensor
    pos_buffer: Tensor
    neg_buffer: Tensor
    folds: Tensor

    def __init__(self, num_bins: int = 1000) -> None:
        super().__init__()
        self.num_bins = num_bins
        for name in ("pos_hist", "neg_hist", "pos_buffer", "neg_buffer"):
            self.add_state(name, default=torch.zeros(num_bins, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("folds", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")

    def update(self, preds: Tensor, labels: Tensor) -> None:
        p = preds.detach().double().flatten()
        # A diverged step (NaN/inf predictions) must not crash the metric before the NaN guard
        # reports it: such rows are left out of the bins.
        finite = torch.isfinite(p).double()
        bins = (torch.nan_to_num(p, nan=0.0).clamp(0, 1) * self.num_bins).long().clamp_max(self.num_bins - 1)
        positive = (labels.detach().flatten() >= 0.5).double()
        # index_add_ rather than bincount: the same integer counts in any order, and no host sync (CUDA's
        # bincount reads the largest bin back to the host to size its output).
        self.pos_buffer.index_add_(0, bins, positive * finite)
        self.neg_buffer.index_add_(0, bins, (1 - positive) * finite)

    def decay(self, rate: float) -> None:
        """Fold the buffer into the decayed history and clear it."""
        first = bool(self.folds == 0)
        self.pos_hist = self.pos_buffer.clone() if first else rate * self.pos_hist + (1 - rate) * self.pos_buffer
        self.neg_hist = self.neg_buffer.clone() if first else rate * self.neg_hist + (1 - rate) * self.neg_buffer
        self.pos_buffer, self.neg_buffer = torch.zeros_like(self.pos_buffer), torch.zeros_like(self.neg_buffer)
        self.folds += 1
        self._computed = None

    def compute(self) -> Tensor:
        return histogram_auc(self.pos_hist, self.neg_hist)


class DecayingMetric(nn.Module):
    """A train-time metric smoothed over windows of ``decay_step`` updates.

    ``update`` feeds the wrapped metric; every ``decay_step``-th update closes a window:

    * a :class:`DecayAUC` folds the window into its decayed history, and the value is its AUC;
    * any other metric is computed over the window (over all ranks) and reset, and the value becomes
      ``rate · value + (1 − rate) · window_value`` (the first window's value is taken as is). A window over which
      the metric is undefined (NaN: no rows, as a masked task's window may have, or one class for ``ne``) leaves
      the value as it was, rather than turning it NaN for the rest of the run; the windows around it decay as if
      it were not there.

    Before the first window closes, ``compute`` returns the metric over the updates so far. Closing a
    window and ``compute`` synchronize ranks, so every rank must call them at the same steps — the
    runner updates on every step and computes at the log cadence, on every rank.

    Example::

        auc = DecayingMetric(DecayAUC(), decay_rate=0.9, decay_step=100)
        auc.update(torch.sigmoid(logits), labels)   # every step
        auc.compute()                              # at the log cadence
    """

    metric: Metric
    value: Tensor

    def __init__(self, metric: Metric, decay_rate: float, decay_step: int) -> None:
        super().__init__()
        metric.persistent(True)  # its states (the open window, DecayAUC's history) belong in checkpoints
        self.metric = metric
        self.decay_rate, self.decay_step = decay_rate, decay_step
        self.register_buffer("value", torch.tensor(torch.nan, dtype=torch.float64))
        self.num_updates = 0

    def update(self, preds: Tensor, labels: Tensor) -> None:
        self.update_many([(preds, labels)])

    def update_many(self, batches: Sequence[tuple[Tensor, Tensor]]) -> None:
        """:meth:`update` with each ``(preds, labels)`` of ``batches`` in turn, with the same result.

        A metric whose ``update`` on concatenated batches is exactly its updates in turn (its class sets
        ``batch_exact``, e.g. :class:`DecayAUC`) takes each window's share of ``batches`` in one ``update``;
        any other (float sums, whose rounding depends on the order) takes them one by one.
        """
        exact = isinstance(self.metric, SumMetric | GatherMetric) and self.metric.batch_exact
        i = 0
        while i < len(batches):
            chunk = batches[i:i + self.decay_step - self.num_updates % self.decay_step]
            if exact and len(chunk) > 1:
                self.metric.update(torch.cat([p if p.dim() == 2 else p.flatten() for p, _ in chunk]),
                                   torch.cat([t.flatten() for _, t in chunk]))
            else:
                for preds, labels in chunk:
                    self.metric.update(preds, labels)
            self.num_updates += len(chunk)
            i += len(chunk)
            if self.num_updates % self.decay_step == 0:
                self._close_window()

    def _close_window(self) -> None:
        if isinstance(self.metric, DecayAUC):
            self.metric.decay(self.decay_rate)
            self.value = self.metric.compute().to(self.value)
            return
        window = self.metric.compute().to(self.value)
        self.metric.reset()
        if torch.isnan(window):  # undefined over this window (no rows, one class for ne): the value stays as it was
            return
        first = bool(torch.isnan(self.value))  # no defined window before this one
        self.value = window if first else self.decay_rate * self.value + (1 - self.decay_rate) * window

    def compute(self) -> Tensor:
        if self.num_updates < self.decay_step:
            if isinstance(self.metric, DecayAUC):
                return histogram_auc(*_synced_sums(self.metric.pos_buffer, self.metric.neg_buffer))
            return self.metric.compute() if self.num_updates else self.value
        return self.value

    def checkpoint_state(self) -> dict[str, Any]:
        """This rank's progress, on CPU: the update count, the decayed value (the same on every rank) and the
        wrapped metric's states (this rank's share of the open window; DecayAUC's history)."""
        return {"num_updates": self.num_updates, "value": self.value.cpu(), "metric": _moved(self.metric.state_dict(), torch.device("cpu"))}

    def load_checkpoint_state(self, state: Mapping[str, Any], own: bool = True) -> None:
        """Continue from :meth:`checkpoint_state`; ``own=False`` (another rank's state) takes only the shared
        update count and value, and starts this rank's share of the window and history empty."""
        self.metric.reset()
        if own:
            self.metric.load_state_dict(_moved(state["metric"], self.value.device))
        self.value = state["value"].to(self.value)
        self.num_updates = int(state["num_updates"])


def _moved(states: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """Metric states (tensors, or lists of tensors for row-keeping metrics) on ``device``."""
    return {k: [t.to(device) for t in v] if isinstance(v, list) else v.to(device) for k, v in states.items()}


def _synced_sums(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` summed over the process group (copies; unchanged without one)."""
    out = tuple(t.clone() for t in tensors)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        for t in out:
            torch.distributed.all_reduce(t)
    return out


class TrainMetrics(nn.Module):
    """The configured decaying train metrics; ``compute()`` gives ``{"<prefix><name>": value}`` (``train/auc``)."""

    metrics: nn.ModuleDict

    def __init__(self, metrics: dict[str, DecayingMetric], prefix: str = "train/") -> None:
        super().__init__()
        self.metrics = nn.ModuleDict(metrics)
        self.prefix = prefix

    def update(self, preds: Tensor, labels: Tensor) -> None:
        self.update_many([(preds, labels)])

    def update_many(self, batches: Sequence[tuple[Tensor, Tensor]]) -> None:
        """:meth:`update` with each ``(preds, labels)`` of ``batches`` in turn (:meth:`DecayingMetric.update_many`)."""
        for _, metric in self._items():
            metric.update_many(batches)

    def compute(self) -> dict[str, float]:
        return {key: float(metric.compute()) for key, metric in self.named_metrics()}

    def named_metrics(self) -> Iterator[tuple[str, DecayingMetric]]:
        """``(logged key, metric)`` pairs, e.g. ``("train/auc", DecayingMetric(DecayAUC(), …))``."""
        for name, metric in self._items():
            yield f"{self.prefix}{name}", metric

    def _items(self) -> Iterator[tuple[str, DecayingMetric]]:
        for name, metric in self.metrics.items():
            assert isinstance(metric, DecayingMetric)
            yield name, metric
