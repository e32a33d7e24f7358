"""Evaluation metrics, decaying train metrics, and the train-progress meter.

Every metric is a torchmetrics :class:`~torchmetrics.Metric` whose states are synchronized over
the default process group in ``compute()`` so that **each value equals what one process computes
over the union of all ranks' data** — never an average of per-rank values:

* additive metrics (log loss, accuracy, NE, calibration, MAE, MSE, recall@k) keep sums and counts,
  which are summed across ranks before dividing;
* ranking metrics (AUC, grouped AUC, XAUC) keep every row (``cat`` states), gathered from all ranks,
  then computed once on the union. Grouped AUC therefore sees all of a group's rows even when they
  were spread over ranks, and every computation is invariant to the order of the rows.

Which metrics run is chosen by config (:class:`MetricsConfig`, a list of names per phase), through
an explicit registry (:data:`METRICS`): unknown names are errors that list the valid ones, and
registering a name twice is an error. :func:`build_eval_metrics` builds the eval collection and
:func:`build_train_metrics` the decaying train metrics (TorchEasyRec's ``TrainMetricWrapper``, with
``decay_rate`` and ``decay_step``). See ``docs/metrics.md`` for every definition.

Pointwise metrics take ``update(preds, labels)`` with ``preds`` probabilities (or regression
predictions) ``[B]`` and ``labels`` ``[B]`` (0/1, or real targets for XAUC, MAE, MSE); grouped AUC also
takes ``groups=`` ``[B]`` integer ids. Recall@k takes ``update(scores [Q, C], positives [Q])``.

Collectives: ``compute()`` is collective when a process group is initialized, so every rank must
call it, and every rank must have called ``update`` at least once (a rank without a gather state
would not join the gather).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import Metric, MetricCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError, require
from recsys_runner.tasks import Task

log = logging.getLogger(__name__)
_EPS = 1e-7


# --------------------------------------------------------------------------------------------
# Closed-form computations on one process's (or the gathered union's) rows.
# --------------------------------------------------------------------------------------------


def grouped_auc_parts(preds: Tensor, labels: Tensor, groups: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group AUC with tied predictions counted as half: ``(auc [G], positives [G], negatives [G])``.

    The Mann–Whitney form: within a group, ``auc = (Σ_pos rank − P(P+1)/2) / (P·N)`` with ranks
    ascending and averaged over ties. Groups are the distinct values of ``groups`` in ascending
    order; a group without both classes has ``auc`` NaN. ``labels`` count as positive when ``≥ 0.5``.
    """
    preds, positive = preds.detach().double().flatten(), (labels.detach().flatten() >= 0.5).double()
    group_idx = torch.unique(groups.flatten(), return_inverse=True)[1]
    num_groups = int(group_idx.max()) + 1 if group_idx.numel() else 0
    # Sorting (group, pred) pairs lexicographically gives each distinct pair its run of rows.
    pairs, row_to_pair, pair_counts = torch.unique(
        torch.stack([group_idx.double(), preds], dim=1), dim=0, return_inverse=True, return_counts=True
    )
    pair_group = pairs[:, 0].long()
    group_sizes = torch.zeros(num_groups, dtype=torch.float64, device=preds.device).index_add_(0, group_idx, torch.ones_like(preds))
    group_start = torch.cumsum(group_sizes, 0) - group_sizes
    rows_before = torch.cumsum(pair_counts, 0) - pair_counts
    pair_rank = rows_before.double() - group_start[pair_group] + (pair_counts.double() + 1) / 2
    row_rank = pair_rank[row_to_pair]
    num_pos = torch.zeros_like(group_sizes).index_add_(0, group_idx, positive)
    num_neg = group_sizes - num_pos
    rank_sum = torch.zeros_like(group_sizes).index_add_(0, group_idx, row_rank * positive)
    auc = (rank_sum - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)
    return torch.where((num_pos > 0) & (num_neg > 0), auc, torch.nan), num_pos, num_neg


def binary_auc(preds: Tensor, labels: Tensor) -> Tensor:
    """ROC AUC: the probability that a random positive outranks a random negative (ties ½); NaN
    without both classes."""
    auc, _, _ = grouped_auc_parts(preds, labels, torch.zeros_like(labels, dtype=torch.long))
    return auc[0] if auc.numel() else torch.tensor(torch.nan, dtype=torch.float64)


def grouped_auc(preds: Tensor, labels: Tensor, groups: Tensor, weighting: str = "impressions") -> Tensor:
    """Mean of per-group AUCs over the groups that have both classes.

    ``weighting="impressions"`` weights each group by its number of rows (the GAUC of Zhou et al.
    2018, DIN); ``"uniform"`` gives every group the same weight. NaN when no group has both classes.
    """
    if weighting not in ("impressions", "uniform"):
        raise ValueError(f"grouped AUC weighting must be 'impressions' or 'uniform', got {weighting!r}")
    auc, num_pos, num_neg = grouped_auc_parts(preds, labels, groups)
    valid = ~torch.isnan(auc)
    weights = (num_pos + num_neg) if weighting == "impressions" else torch.ones_like(auc)
    weights = weights[valid]
    if weights.numel() == 0:
        return torch.tensor(torch.nan, dtype=torch.float64, device=preds.device)
    return (auc[valid] * weights).sum() / weights.sum()


def xauc(preds: Tensor, targets: Tensor, max_pairs: int = 1 << 22, seed: int = 0) -> Tensor:
    """Pairwise ordering accuracy for real-valued targets (e.g. watch time).

    Over pairs ``(i, j)`` whose targets differ: 1 when the predictions are ordered like the targets,
    ½ when the predictions tie, 0 otherwise; the mean of that. Exact (all ``n(n−1)/2`` pairs) while
    that count is at most ``max_pairs``; above it, ``max_pairs`` pairs drawn uniformly with a
    generator seeded by ``seed``. The rows are first sorted by ``(target, pred)``, so the sampled
    value depends only on the multiset of rows, not on their order (nor on which rank held them).
    NaN when no pair has distinct targets.
    """
    p, t = preds.detach().double().flatten(), targets.detach().double().flatten()
    order = torch.argsort(p, stable=True)
    order = order[torch.argsort(t[order], stable=True)]
    p, t = p[order], t[order]
    n = p.numel()
    if n * (n - 1) // 2 <= max_pairs:
        score, valid = torch.zeros((), dtype=torch.float64, device=p.device), torch.zeros((), dtype=torch.float64, device=p.device)
        chunk = max(1, (1 << 22) // max(n, 1))
        cols = torch.arange(n, device=p.device)
        for start in range(0, n, chunk):
            rows = torch.arange(start, min(start + chunk, n), device=p.device)
            upper = cols.unsqueeze(0) > rows.unsqueeze(1)
            s, v = _pair_scores(p[rows].unsqueeze(1), p.unsqueeze(0), t[rows].unsqueeze(1), t.unsqueeze(0), upper)
            score, valid = score + s, valid + v
    else:
        g = torch.Generator(device="cpu").manual_seed(seed)
        i = torch.randint(n, (max_pairs,), generator=g).to(p.device)
        j = torch.randint(n - 1, (max_pairs,), generator=g).to(p.device)
        j = j + (j >= i).long()  # uniform over j != i
        score, valid = _pair_scores(p[i], p[j], t[i], t[j], None)
    return score / valid if valid > 0 else torch.tensor(torch.nan, dtype=torch.float64, device=p.device)


def _pair_scores(pi: Tensor, pj: Tensor, ti: Tensor, tj: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Sum of pair scores (1 concordant, ½ prediction tie) and count of pairs with distinct targets.

    With ``s = sign(Δpred)·sign(Δtarget)`` a valid pair scores ``(s + 1) / 2``; pairs with equal
    targets have ``sign(Δtarget) = 0`` and drop out of both sums.
    """
    target_sign = torch.sign(tj - ti).to(torch.int8)
    products = torch.sign(pj - pi).to(torch.int8) * target_sign
    if mask is not None:
        products, target_sign = products * mask, target_sign * mask
    valid = target_sign.abs().sum(dtype=torch.float64)
    return 0.5 * (products.sum(dtype=torch.float64) + valid), valid


def binary_entropy(p: Tensor) -> Tensor:
    """``−(p log p + (1−p) log(1−p))`` in nats."""
    p = p.double()
    return -(torch.xlogy(p, p) + torch.xlogy(1 - p, 1 - p))


# --------------------------------------------------------------------------------------------
# The metrics.
# --------------------------------------------------------------------------------------------


class _SumMetric(Metric):
    """Base of additive metrics: float64 sum states, summed across ranks before ``compute``."""

    full_state_update = False
    batch_exact: ClassVar[bool] = False
    """Whether one ``update`` on concatenated batches gives exactly the state of one ``update`` per batch (integer
    counts do; float sums may round differently), so deferred train updates may be batched."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        for name in names:
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")


class LogLoss(_SumMetric):
    """Mean binary cross-entropy of probabilities (clamped to ``[1e-7, 1 − 1e-7]``)."""

    total: Tensor
    count: Tensor

    def __init__(self) -> None:
        super().__init__("total", "count")

    def update(self, preds: Tensor, labels: Tensor) -> None:  # type: ignore[override]
        probs = preds.detach().double().clamp(_EPS, 1 - _EPS)
        self.total += F.binary_cross_entropy(probs, labels.detach().double(), reduction="sum")
        self.count += labels.numel()

    def compute(self) -> Tensor:
        return self.total / self.count.clamp_min(1)


class Accuracy(_SumMetric):
    """Share of rows whose thresholded prediction (``pred ≥ threshold``) equals the label."""

    batch_exact = True
    """Counts only: one ``update`` on several batches concatenated is exactly their updates in turn."""
    correct: Tensor
    count: Tensor

    def __init__(self, threshold: float = 0.5) -> None:
        super().__init__("correct", "count")
        self.threshold = threshold

    def update(self, preds: Tensor, labels: Tensor) -> None:  # type: ignore[override]
        self.correct += ((preds.detach() >= self.threshold) == (labels.detach() >= 0.5)).sum()
        self.count += labels.numel()

    def compute(self) -> Tensor:
        return self.correct / self.count.clamp_min(1)


class NormalizedEntropy(_SumMetric):
    """Log loss divided by the entropy of the base rate (He et al. 2014): below 1 beats predicting
    the average CTR for every row. NaN when the labels are all one class."""

    total: Tensor
    positives: Tensor
    count: Tensor

    def __init__(self) -> None:
        super().__init__("total", "positives", "count")

    def update(self, preds: Tensor, labels: Tensor) -> None:  # type: ignore[override]
        probs = preds.detach().double().clamp(_EPS, 1 - _EPS)
        self.total += F.binary_cross_entropy(probs, labels.detach().double(), reduction="sum")
        self.positives += labels.detach().double().sum()
        self.count += labels.numel()

    def compute(self) -> Tensor:
        count = self.count.clamp_min(1)
        base = binary_entropy(self.positives / count)
        return torch.where(base > 0, self.total / count / base, torch.nan)


class Calibration(_SumMetric):
    """``Σ preds / Σ labels``: 1 is calibrated, above 1 over-predicts (inf/NaN without positives)."""

    pred_sum: Tensor
    label_sum: Tensor

    def __init__(self) -> None:
        super().__init__("pred_sum", "label_sum")

    def update(self, preds: Tensor, labels: Tensor) -> None:  # type: ignore[override]
        self.pred_sum += preds.detach().double().sum()
        self.label_sum += labels.detach().double().sum()

    def compute(self) -> Tensor:
        return self.pred_sum / self.label_sum


class MeanAbsoluteError(_SumMetric):
    """``mean |pred − label|``."""

    total: Tensor
    count: Tensor

    def __init__(self) -> None:
        super().__init__("total", "count")

    def update(self, preds: Tensor, labels: Tensor) -> None:  # type: ignore[override]
        self.total += (preds.detach().double() - labels.detach().double()).abs().sum()
        self.count += labels.numel()

    def compute(self) -> Tensor:
        return self.total / self.count.clamp_min(1)


class MeanSquaredError(_SumMetric):
    """``mean (pred − label)²``."""

    total: Tensor
    count: Tensor

    def __init__(self) -> None:
        super().__init__("total", "count")

    def update(self, preds: Tensor, labels: Tensor) -> None:  # type: ignore[override]
        self.total += (preds.detach().double() - labels.detach().double()).pow(2).sum()
        self.count += labels.numel()

    def compute(self) -> Tensor:
        return self.total / self.count.clamp_min(1)


class RecallAtK(_SumMetric):
    """Share of queries whose positive candidate ranks in the top ``k`` of that query's scores.

    ``update(scores [Q, C], positives [Q])``: ``positives[q]`` is the index of query ``q``'s positive
    among its ``C`` candidates (e.g. the diagonal of an in-batch score matrix). The positive's rank
    is the number of *other* candidates scoring at least as high — ties count against it, so a
    constant scorer gets no credit.
    """

    hits: Tensor
    count: Tensor

    def __init__(self, k: int) -> None:
        super().__init__("hits", "count")
        self.k = k

    def update(self, scores: Tensor, positives: Tensor) -> None:  # type: ignore[override]
        scores = scores.detach()
        positive_scores = scores.gather(1, positives.long().view(-1, 1))
        rank = (scores >= positive_scores).sum(dim=1) - 1
        self.hits += (rank < self.k).sum()
        self.count += scores.shape[0]

    def compute(self) -> Tensor:
        return self.hits / self.count.clamp_min(1)


class _GatherMetric(Metric):
    """Base of ranking metrics: keeps every row; ``compute`` runs on all ranks' rows gathered."""

    full_state_update = False
    batch_exact: ClassVar[bool] = False
    """Whether one ``update`` on concatenated batches gives exactly the state of one ``update`` per batch (integer
    counts do; float sums may round differently), so deferred train updates may be batched."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        for name in names:
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def _rows(self, name: str) -> Tensor:
        state = getattr(self, name)
        if isinstance(state, list):
            return torch.cat(state) if state else torch.zeros(0, dtype=torch.long if name == "groups" else torch.float64, device=self.device)
        return state


class AUC(_GatherMetric):
    """Exact ROC AUC over all rows of all ranks (ties ½); see :func:`binary_auc`."""

    preds: list[Tensor]
    labels: list[Tensor]

    def __init__(self) -> None:
        super().__init__("preds", "labels")

    def update(self, preds: Tensor, labels: Tensor) -> None:  # type: ignore[override]
        self.preds.append(preds.detach().double().flatten())
        self.labels.append(labels.detach().double().flatten())

    def compute(self) -> Tensor:
        return binary_auc(self._rows("preds"), self._rows("labels"))


class GroupedAUC(_GatherMetric):
    """Grouped AUC over all ranks' ``(group, pred, label)`` rows; see :func:`grouped_auc`."""

    preds: list[Tensor]
    labels: list[Tensor]
    groups: list[Tensor]

    def __init__(self, weighting: str = "impressions") -> None:
        super().__init__("preds", "labels", "groups")
        self.weighting = weighting

    def update(self, preds: Tensor, labels: Tensor, groups: Tensor | None = None) -> None:  # type: ignore[override]
        if groups is None:
            raise ValueError("gauc needs groups=<[B] integer ids> in update(); the runner passes them when metrics.grouping_key is set")
        self.preds.append(preds.detach().double().flatten())
        self.labels.append(labels.detach().double().flatten())
        self.groups.append(groups.detach().long().flatten())

    def compute(self) -> Tensor:
        return grouped_auc(self._rows("preds"), self._rows("labels"), self._rows("groups"), self.weighting)


class XAUC(_GatherMetric):
    """XAUC over all ranks' rows; see :func:`xauc` (exact up to ``max_pairs`` pairs, then sampled)."""

    preds: list[Tensor]
    targets: list[Tensor]

    def __init__(self, max_pairs: int = 1 << 22, seed: int = 0) -> None:
        super().__init__("preds", "targets")
        self.max_pairs, self.seed = max_pairs, seed

    def update(self, preds: Tensor, labels: Tensor) -> None:  # type: ignore[override]
        self.preds.append(preds.detach().double().flatten())
        self.targets.append(labels.detach().double().flatten())

    def compute(self) -> Tensor:
        return xauc(self._rows("preds"), self._rows("targets"), self.max_pairs, self.seed)


class DecayAUC(_SumMetric):
    """AUC of an exponentially decayed history, for train-time logging (TorchEasyRec's DecayAUC).

    Predictions in ``[0, 1]`` are binned into ``num_bins`` equal bins; ``update`` counts positives
    and negatives per bin into a buffer, and :meth:`decay` folds the buffer into the history,
    ``history = rate · history + (1 − rate) · buffer`` (the first fold copies the buffer). ``compute``
    is the AUC of the history's weighted rows (rows in one bin tie). Bin counts are summed across ranks.
    """

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

    def update(self, preds: Tensor, labels: Tensor) -> None:  # type: ignore[override]
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


def histogram_auc(pos: Tensor, neg: Tensor) -> Tensor:
    """AUC of weighted rows binned by ascending score: ``Σ_b pos_b (neg_{<b} + ½ neg_b) / (Σpos · Σneg)``."""
    neg_below = torch.cumsum(neg, 0) - neg
    denominator = pos.sum() * neg.sum()
    return torch.where(denominator > 0, (pos * (neg_below + 0.5 * neg)).sum() / denominator, torch.nan)


# --------------------------------------------------------------------------------------------
# Decaying train metrics (TorchEasyRec's TrainMetricWrapper).
# --------------------------------------------------------------------------------------------


class DecayingMetric(nn.Module):
    """A train-time metric smoothed over windows of ``decay_step`` updates.

    ``update`` feeds the wrapped metric; every ``decay_step``-th update closes a window:

    * a :class:`DecayAUC` folds the window into its decayed history, and the value is its AUC;
    * any other metric is computed over the window (over all ranks) and reset, and the value becomes
      ``rate · value + (1 − rate) · window_value`` (the first window's value is taken as is).

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
        exact = isinstance(self.metric, _SumMetric | _GatherMetric) and self.metric.batch_exact
        i = 0
        while i < len(batches):
            chunk = batches[i:i + self.decay_step - self.num_updates % self.decay_step]
            if exact and len(chunk) > 1:
                self.metric.update(torch.cat([p.flatten() for p, _ in chunk]), torch.cat([t.flatten() for _, t in chunk]))
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
        first = self.num_updates == self.decay_step
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


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


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


# --------------------------------------------------------------------------------------------
# Config and registry.
# --------------------------------------------------------------------------------------------

Inputs = Literal["pointwise", "grouped", "retrieval"]


@dataclass(frozen=True)
class MetricEntry:
    """A registered metric: how to build it from the config, and what ``update`` takes."""

    factory: Callable[[MetricsConfig], Metric]
    inputs: Inputs
    doc: str


METRICS: dict[str, MetricEntry] = {}
"""The metric registry, by config name. ``recall@<k>`` is matched by :data:`RECALL_AT_K`."""

RECALL_AT_K = re.compile(r"recall@([0-9]+)")
"""Names ``recall@1``, ``recall@10`` …: :class:`RecallAtK` with that ``k``."""

NAME_PATTERNS: dict[str, Inputs] = {"recall@<k>": "retrieval"}
"""The metric names matched by a pattern rather than registered one by one, and their inputs."""


def register_metric(name: str, factory: Callable[[MetricsConfig], Metric], inputs: Inputs, doc: str) -> None:
    """Add a metric to :data:`METRICS`; a name may be registered once."""
    if name in METRICS or RECALL_AT_K.fullmatch(name):
        raise ValueError(f"metric {name!r} is already registered")
    METRICS[name] = MetricEntry(factory, inputs, doc)


register_metric("auc", lambda s: AUC(), "pointwise", "ROC AUC, exact over all ranks' rows")
register_metric("logloss", lambda s: LogLoss(), "pointwise", "mean binary cross-entropy")
register_metric("accuracy", lambda s: Accuracy(), "pointwise", "share of rows with (pred >= 0.5) == label")
register_metric("gauc", lambda s: GroupedAUC(s.gauc_weighting), "grouped", "AUC per metrics.grouping_key group, averaged")
register_metric("xauc", lambda s: XAUC(s.xauc_max_pairs), "pointwise", "pairwise ordering accuracy for real targets")
register_metric("ne", lambda s: NormalizedEntropy(), "pointwise", "log loss / entropy of the base rate")
register_metric("calibration", lambda s: Calibration(), "pointwise", "sum of preds / sum of labels")
register_metric("mae", lambda s: MeanAbsoluteError(), "pointwise", "mean absolute error")
register_metric("mse", lambda s: MeanSquaredError(), "pointwise", "mean squared error")


def metric_entry(name: str, key: str = "metrics") -> MetricEntry:
    """The registry entry for ``name``; :class:`ConfigError` listing the valid names otherwise."""
    if (m := RECALL_AT_K.fullmatch(name)) is not None:
        k = int(m.group(1))
        require(k > 0, f"{key}: {name!r} needs k >= 1, e.g. recall@10")
        return MetricEntry(lambda s: RecallAtK(k), "retrieval", f"recall at {k}")
    if name not in METRICS:
        raise ConfigError(f"{key}: unknown metric {name!r}. Valid names: {', '.join(sorted(METRICS))}, recall@<k> (e.g. recall@10)")
    return METRICS[name]


TRAIN_METRICS = {"auc", "logloss", "accuracy", "ne", "calibration", "mae", "mse", "xauc"}
"""Metrics that can decay at train time: those computed from the step's ``(preds, labels)`` alone."""


@dataclass(kw_only=True)
class MetricsConfig:
    """Which metrics to compute, by phase (a ``metrics`` section, or a task's field)."""

    eval: list[str] = field(default_factory=lambda: ["auc", "logloss"])
    """Eval metric names, each logged as ``eval/<name>``; see ``docs/metrics.md``. Pointwise and
    ``gauc`` metrics combine; ``recall@<k>`` (retrieval scores) only with other ``recall@<k>``."""
    train: list[str] = field(default_factory=lambda: ["auc"])
    """Decaying train metrics, logged as ``train/<name>`` at the log cadence (``[]`` for none)."""
    decay_rate: float = 0.9
    """Weight of the history when a train-metric window closes: ``value = rate·value + (1−rate)·window``."""
    decay_step: int = 100
    """Updates (micro-batches) per train-metric window."""
    grouping_key: str | None = None
    """Sparse feature whose id groups rows for ``gauc`` (e.g. a user id); one id per row."""
    gauc_weighting: str = "impressions"
    """``gauc`` weights each group by its rows (``impressions``) or equally (``uniform``)."""
    xauc_max_pairs: int = 1 << 22
    """``xauc`` is exact up to this many pairs, then computed on this many seeded random pairs."""

    def __post_init__(self) -> None:
        for phase, names in (("metrics.eval", self.eval), ("metrics.train", self.train)):
            duplicates = sorted({n for n in names if list(names).count(n) > 1})
            require(not duplicates, f"{phase} lists {duplicates} more than once; list each metric once")
            for name in names:
                metric_entry(name, phase)
        kinds = {metric_entry(n).inputs == "retrieval" for n in self.eval}
        require(
            len(kinds) <= 1,
            f"metrics.eval={list(self.eval)} mixes recall@<k> (query×candidate scores) with pointwise metrics "
            f"(per-row predictions); a task produces one or the other. Fix: keep only one kind",
        )
        untrainable = [n for n in self.train if n not in TRAIN_METRICS]
        require(
            not untrainable,
            f"metrics.train={list(self.train)}: {untrainable} cannot be computed at train time (they need grouping ids or "
            f"retrieval scores the train step does not return). Fix: move them to metrics.eval; train-time options: "
            f"{', '.join(sorted(TRAIN_METRICS))}",
        )
        require(
            "gauc" not in self.eval or self.grouping_key is not None,
            "metrics.eval lists gauc but metrics.grouping_key is not set. Fix: metrics.grouping_key=<sparse feature "
            "holding the group id, e.g. a user id>",
        )
        require(0 <= self.decay_rate < 1, f"metrics.decay_rate must be in [0, 1), got {self.decay_rate}")
        require(self.decay_step > 0, f"metrics.decay_step must be positive, got {self.decay_step}")
        require(
            self.gauc_weighting in ("impressions", "uniform"),
            f"metrics.gauc_weighting must be impressions or uniform, got {self.gauc_weighting!r}",
        )
        require(self.xauc_max_pairs > 0, f"metrics.xauc_max_pairs must be positive, got {self.xauc_max_pairs}")


def build_eval_metrics(spec: MetricsConfig, device: torch.device) -> MetricCollection:
    """The eval metrics ``spec.eval`` names, as one collection on ``device``.

    ``update(preds, labels, groups=ids)`` passes ``groups`` only to ``gauc``; ``compute()`` returns
    ``{name: value}`` (collective under a process group).
    """
    metrics = {name: metric_entry(name, "metrics.eval").factory(spec) for name in spec.eval}
    return MetricCollection(metrics, compute_groups=False).to(device)


def build_train_metrics(spec: MetricsConfig, device: torch.device, prefix: str = "train/") -> TrainMetrics:
    """The decaying train metrics ``spec.train`` names (``auc`` decays as :class:`DecayAUC`)."""
    metrics = {}
    for name in spec.train:
        inner = DecayAUC() if name == "auc" else metric_entry(name, "metrics.train").factory(spec)
        metrics[name] = DecayingMetric(inner, spec.decay_rate, spec.decay_step)
    return TrainMetrics(metrics, prefix).to(device)


# --------------------------------------------------------------------------------------------
# Per-task metrics: what the runner drives, fed with the TrainWrapper's (logits, labels).
# --------------------------------------------------------------------------------------------


def _task_spec(spec: MetricsConfig, task: Task) -> MetricsConfig:
    """``spec`` with the task's metric lists (:meth:`Task.eval_metric_names`, :meth:`Task.train_metric_names`)."""
    eval_names, train_names = task.eval_metric_names(spec.eval), task.train_metric_names(spec.train)
    if eval_names == list(spec.eval) and train_names == list(spec.train):
        return spec
    return replace(spec, eval=eval_names, train=train_names)


def _task_outputs(task: Task, index: int, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """One task's ``(preds, targets)`` from the TrainWrapper's ``(logits, labels)``: a named task's are
    column ``index`` of ``[B, T]``, an unnamed task's are the whole tensors; :meth:`Task.metric_inputs` does the rest."""
    if task.name is not None:
        logits, labels = logits[:, index], labels[:, index]
    return task.metric_inputs(logits, labels)


def check_task_metrics(spec: MetricsConfig, tasks: tuple[Task, ...], model: str = "the model") -> None:
    """Raise :class:`ConfigError` unless each task's eval metrics apply to what it produces.

    A task's ``metric_inputs_kinds`` say which registered metrics read its outputs: per-row predictions
    (pointwise and grouped metrics) or query×candidate scores (``recall@<k>``). ``model`` names the
    model in the message.
    """
    for task in tasks:
        key = "model.eval_metrics" if task.eval_metrics is not None else "metrics.eval"
        for name in task.eval_metric_names(spec.eval):
            if metric_entry(name, key).inputs in task.metric_inputs_kinds:
                continue
            valid = [n for n, e in sorted(METRICS.items()) if e.inputs in task.metric_inputs_kinds]
            valid += [p for p, inputs in NAME_PATTERNS.items() if inputs in task.metric_inputs_kinds]
            example = task.default_eval_metrics or ("auc",)
            raise ConfigError(
                f"{key} lists {name!r}; {model}'s eval is {task.metric_inputs_kinds[0]}, so only {', '.join(valid)} "
                f"appl{'ies' if len(valid) == 1 else 'y'}, e.g. [{','.join(example)}]"
            )


def metric_key(name: str) -> str:
    """The logged key of metric ``name``: ``recall@10`` → ``recall_at_10`` (MLflow keys cannot hold ``@``)."""
    return name.replace("@", "_at_")


def eval_key(task: Task, name: str) -> str:
    """The logged key of ``task``'s eval metric ``name``: ``eval/<task>/<metric>`` (``eval/<metric>`` for an
    unnamed task), through :func:`metric_key`; e.g. ``eval/auc``, ``eval/ctr/auc``, ``eval/recall_at_10``."""
    return f"eval/{'' if task.name is None else f'{task.name}/'}{metric_key(name)}"


def eval_metric_keys(spec: MetricsConfig, tasks: tuple[Task, ...]) -> list[str]:
    """Exactly the keys :meth:`TaskEvalMetrics.compute` returns for ``tasks`` and ``spec``, in its order.

    Known before training, so keys that name an eval metric (``train.objective``,
    ``checkpoint.best_metric``, ``train.early_stopping.metric``) are checked before the first step.
    """
    return [eval_key(task, name) for task in tasks for name in _task_spec(spec, task).eval]


class TaskEvalMetrics:
    """Each task's eval metrics, keyed by :func:`eval_key` (``eval/auc``, ``eval/ctr/auc``): :func:`eval_metric_keys`.

    ``update(logits, labels, groups=None)`` takes the TrainWrapper's ``(logits, labels)``; ``compute()``
    is collective under a process group, like :func:`build_eval_metrics`.
    """

    def __init__(self, spec: MetricsConfig, tasks: tuple[Task, ...], device: torch.device) -> None:
        self.tasks = tasks
        self.specs = [_task_spec(spec, t) for t in tasks]
        self.collections = [build_eval_metrics(s, device) for s in self.specs]

    def update(self, logits: Tensor, labels: Tensor, groups: Tensor | None = None) -> None:
        extra = {} if groups is None else {"groups": groups}
        for i, (task, metrics) in enumerate(zip(self.tasks, self.collections, strict=True)):
            # Only metrics whose update takes ``groups`` (gauc) get them: MetricCollection filters keyword
            # arguments by each metric's signature.
            metrics.update(*_task_outputs(task, i, logits, labels), **extra)

    def compute(self) -> dict[str, float]:
        """``{key: value}`` in :func:`eval_metric_keys` order: task by task, each task's metrics as configured."""
        out: dict[str, float] = {}
        for task, task_spec, metrics in zip(self.tasks, self.specs, self.collections, strict=True):
            values = metrics.compute()
            out |= {eval_key(task, name): float(values[name]) for name in task_spec.eval}
        return out


class TaskTrainMetrics:
    """Each task's decaying train metrics, fed with the TrainWrapper's ``(logits, labels)``.

    Keys ``train/<task>/<metric>`` (plain ``train/<metric>`` for an unnamed task). ``update`` runs every
    micro-batch, so it only keeps the batch's detached ``(logits, labels)`` (nothing without metrics); each task's
    ``(preds, targets)`` (its column, a ``sigmoid`` for a binary task) are made when the metrics take the kept
    batches in order (:meth:`TrainMetrics.update_many`): when read (``compute``, ``state_dict``) or when
    ``flush_every`` batches are kept — the same values as updating
    them every micro-batch, for a fraction of the per-step host work and no host sync.
    ``state_dict``/``load_state_dict`` checkpoint each rank's decaying state, so a resumed run logs the
    train metrics the uninterrupted run would.

    Args:
        flush_every: most micro-batches kept before the metrics take them (bounds the memory held);
            ``None``: ``spec.decay_step``.
    """

    def __init__(self, spec: MetricsConfig, tasks: tuple[Task, ...], device: torch.device, flush_every: int | None = None) -> None:
        self.tasks = tasks
        self.per_task = [build_train_metrics(_task_spec(spec, t), device, "train/" if t.name is None else f"train/{t.name}/") for t in tasks]
        self._active = [(i, t, m) for i, (t, m) in enumerate(zip(tasks, self.per_task, strict=True)) if len(m.metrics)]
        self.flush_every = max(1, flush_every if flush_every is not None else spec.decay_step)
        self._pending: list[tuple[Tensor, Tensor]] = []

    def update(self, logits: Tensor, labels: Tensor) -> None:
        if not self._active:
            return
        self._pending.append((logits, labels))  # per-task columns and sigmoid when flushed: no per-step ops
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Feed the kept micro-batches to the metrics, in order (every rank at the same steps: closing a window syncs)."""
        if not self._pending:
            return
        for i, task, metrics in self._active:
            metrics.update_many([_task_outputs(task, i, logits, labels) for logits, labels in self._pending])
        self._pending.clear()

    def compute(self) -> dict[str, float]:
        self.flush()
        out: dict[str, float] = {}
        for metrics in self.per_task:
            out |= metrics.compute()
        return out

    def state_dict(self) -> dict[str, Any]:
        """This rank's decaying state by logged key (:meth:`DecayingMetric.checkpoint_state`), and the saving rank."""
        self.flush()
        return {"rank": _rank(), "metrics": {key: m.checkpoint_state() for ms in self.per_task for key, m in ms.named_metrics()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`. A metric the checkpoint lacks (added to ``metrics.train`` since) starts
        fresh, one no longer configured is ignored. A rank resuming from another rank's file (more ranks than
        saved) takes the shared value and window position with an empty share of window and history, so no
        row is counted twice."""
        saved, own = state["metrics"], state["rank"] == _rank()
        self._pending.clear()
        fresh = []
        for metrics in self.per_task:
            for key, metric in metrics.named_metrics():
                if key in saved:
                    metric.load_checkpoint_state(saved[key], own=own)
                else:
                    fresh.append(key)
        if fresh:
            log.info("train metrics %s are not in the checkpoint and start fresh", fresh)


def grouping_ids(sparse: KeyedJaggedTensor, key: str) -> Tensor:
    """Each row's id of sparse feature ``key`` (the ``gauc`` group): ``[B]``.

    Raises:
        ConfigError: ``key`` is not a sparse feature, or some row has no or several ids.
    """
    if key not in sparse.keys():
        raise ConfigError(f"metrics.grouping_key={key!r} is not a sparse feature; the data has {', '.join(sparse.keys())}")
    jagged = sparse[key]
    if not bool((jagged.lengths() == 1).all()):
        raise ConfigError(f"metrics.grouping_key={key!r} must hold exactly one id per row (a user id, say); some rows have none or several")
    return jagged.values()


def eval_metrics(device: torch.device) -> MetricCollection:
    """Binary-classification eval metrics with the default config: ``auc`` and ``logloss``."""
    return build_eval_metrics(MetricsConfig(), device)


# --------------------------------------------------------------------------------------------
# Throughput.
# --------------------------------------------------------------------------------------------


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

