"""Binary-classification metrics: log loss, accuracy, NE, calibration (sums); AUC, grouped AUC, XAUC (kept rows).

``update(preds, labels)`` with ``preds`` probabilities ``[B]`` and ``labels`` ``[B]`` (0/1; real targets for
XAUC); grouped AUC also takes ``groups=`` ``[B]`` integer ids. Log loss, accuracy and AUC also take a multi-class task's
class probabilities ``[B, C]`` with class indices ``[B]`` (multi-class log loss, argmax accuracy, macro one-vs-rest
AUC). Definitions: ``docs/metrics.md``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from recsys_runner.metrics import sharded
from recsys_runner.metrics.base import GatherMetric, SumMetric
from recsys_runner.metrics.functional import EPS, binary_auc, binary_entropy, grouped_auc, xauc


class LogLoss(SumMetric):
    """Mean binary cross-entropy of probabilities (clamped to ``[1e-7, 1 − 1e-7]``); with class probabilities ``[B, C]``,
    the mean of ``−log p(true class)`` (clamped below at ``1e-7``)."""

    higher_is_better = False

    total: Tensor
    count: Tensor

    def __init__(self) -> None:
        super().__init__("total", "count")

    def update(self, preds: Tensor, labels: Tensor) -> None:
        if preds.dim() == 2:  # class probabilities [B, C]: -log p(true class)
            true = preds.detach().double().gather(1, labels.detach().long().unsqueeze(1))
            self.total -= true.clamp_min(EPS).log().sum()
        else:
            probs = preds.detach().double().clamp(EPS, 1 - EPS)
            self.total += F.binary_cross_entropy(probs, labels.detach().double(), reduction="sum")
        self.count += labels.numel()

    def compute(self) -> Tensor:
        return self.mean(self.total, self.count)


class Accuracy(SumMetric):
    """Share of rows whose thresholded prediction (``pred ≥ threshold``) equals the label; with class probabilities
    ``[B, C]``, whose most probable class is the label."""

    higher_is_better = True

    batch_exact = True
    """Counts only: one ``update`` on several batches concatenated is exactly their updates in turn."""
    correct: Tensor
    count: Tensor

    def __init__(self, threshold: float = 0.5) -> None:
        super().__init__("correct", "count")
        self.threshold = threshold

    def update(self, preds: Tensor, labels: Tensor) -> None:
        if preds.dim() == 2:  # class probabilities [B, C]: the most probable class is the prediction
            self.correct += (preds.detach().argmax(dim=1) == labels.detach().long()).sum()
        else:
            self.correct += ((preds.detach() >= self.threshold) == (labels.detach() >= 0.5)).sum()
        self.count += labels.numel()

    def compute(self) -> Tensor:
        return self.mean(self.correct, self.count)


class NormalizedEntropy(SumMetric):
    """Log loss divided by the entropy of the base rate (He et al. 2014): below 1 beats predicting
    the average CTR for every row. NaN when the labels are all one class."""

    higher_is_better = False

    total: Tensor
    positives: Tensor
    count: Tensor

    def __init__(self) -> None:
        super().__init__("total", "positives", "count")

    def update(self, preds: Tensor, labels: Tensor) -> None:
        probs = preds.detach().double().clamp(EPS, 1 - EPS)
        self.total += F.binary_cross_entropy(probs, labels.detach().double(), reduction="sum")
        self.positives += labels.detach().double().sum()
        self.count += labels.numel()

    def compute(self) -> Tensor:
        count = self.count.clamp_min(1)
        base = binary_entropy(self.positives / count)
        return torch.where(base > 0, self.total / count / base, torch.nan)


class Calibration(SumMetric):
    """``Σ preds / Σ labels``: 1 is calibrated, above 1 over-predicts (inf/NaN without positives)."""

    higher_is_better = None
    """Neither: 1 is best (above over-predicts, below under-predicts), so it ranks no runs."""

    pred_sum: Tensor
    label_sum: Tensor

    def __init__(self) -> None:
        super().__init__("pred_sum", "label_sum")

    def update(self, preds: Tensor, labels: Tensor) -> None:
        self.pred_sum += preds.detach().double().sum()
        self.label_sum += labels.detach().double().sum()

    def compute(self) -> Tensor:
        return self.pred_sum / self.label_sum


def ranked_preds(preds: Tensor) -> Tensor:
    """A batch's predictions as AUC and grouped AUC keep them: in their own floating dtype (float32 from the model), a
    copy (not a view that would hold the batch's whole output). Only their order and ties count, which a conversion to
    float64, exact, would not change: 4 bytes a row rather than 8 (docs/performance.md, "At scale")."""
    kept = preds.detach()
    return kept.clone() if kept.is_floating_point() else kept.double()


def positives(labels: Tensor) -> Tensor:
    """A batch's 0/1 labels as AUC and grouped AUC keep them: ``label ≥ 0.5`` as one byte a row, all they read."""
    return (labels.detach() >= 0.5).flatten()


def group_ids(groups: Tensor) -> Tensor:
    """A batch's group ids as grouped AUC keeps them: int64, a copy. The runner's are a view of the batch's sparse ids
    (``KeyedJaggedTensor.__getitem__`` slices the values of every feature): kept as such they held every feature's ids
    of every eval batch, 26 times the group ids' own 8 bytes a row on Criteo-shaped data."""
    ids = groups.detach().flatten()
    return ids.clone() if ids.dtype == torch.long else ids.long()


class AUC(GatherMetric):
    """Exact ROC AUC over all rows of all ranks (ties ½); see :func:`binary_auc`. With class probabilities ``[B, C]``
    and class indices: the macro one-vs-rest AUC, the mean over the classes present (with some rows of another class too)
    of the AUC of ``p[:, c]`` for ``label == c``. Over several ranks the binary AUC is sharded (rows routed by
    prediction range, :mod:`~recsys_runner.metrics.sharded`); the macro AUC gathers every rank's rows."""

    higher_is_better = True

    preds: list[Tensor]
    labels: list[Tensor]

    def __init__(self) -> None:
        super().__init__("preds", "labels")

    def update(self, preds: Tensor, labels: Tensor) -> None:
        if preds.dim() == 2:  # class probabilities [B, C] and class indices
            self.keep("preds", ranked_preds(preds))
            self.keep("labels", labels.detach().long().flatten())
        else:
            self.keep("preds", ranked_preds(preds).flatten())
            self.keep("labels", positives(labels))

    def compute(self) -> Tensor:
        preds, labels = self._rows("preds"), self._rows("labels")
        if preds.dim() < 2:
            return binary_auc(preds, labels)
        per_class = torch.stack([binary_auc(preds[:, c], (labels == c).double()) for c in range(preds.shape[1])])
        present = per_class[~torch.isnan(per_class)]
        return present.mean() if present.numel() else torch.tensor(torch.nan, dtype=torch.float64, device=preds.device)

    def _compute_sharded(self) -> Tensor | None:
        """Binary AUC over several ranks by a sample sort of the rows by prediction (:func:`sharded.auc_over_ranks`):
        each rank holds about its share, not the union; ``None`` (gather) for class probabilities (macro AUC)."""
        return sharded.auc_over_ranks(self._rows("preds"), self._rows("labels"))


class GroupedAUC(GatherMetric):
    """Grouped AUC over all ranks' ``(group, pred, label)`` rows; see :func:`grouped_auc`."""

    higher_is_better = True

    preds: list[Tensor]
    labels: list[Tensor]
    groups: list[Tensor]

    def __init__(self, weighting: str = "impressions") -> None:
        super().__init__("preds", "labels", "groups")
        self.weighting = weighting

    def update(self, preds: Tensor, labels: Tensor, groups: Tensor | None = None) -> None:
        if groups is None:
            raise ValueError("gauc needs groups=<[B] integer ids> in update(); the runner passes them when metrics.grouping_key is set")
        self.keep("preds", ranked_preds(preds).flatten())
        self.keep("labels", positives(labels))
        self.keep("groups", group_ids(groups))

    def compute(self) -> Tensor:
        return grouped_auc(self._rows("preds"), self._rows("labels"), self._rows("groups"), self.weighting)

    def _compute_sharded(self) -> Tensor:
        """Over several ranks, every group's rows routed to one rank (:func:`sharded.grouped_auc_over_ranks`): each rank
        holds about its share of the rows, and only the groups' ``(auc, weight)`` are gathered."""
        return sharded.grouped_auc_over_ranks(self._rows("preds"), self._rows("labels"), self._rows("groups"), self.weighting)


class XAUC(GatherMetric):
    """XAUC over all ranks' rows; see :func:`xauc` (exact up to ``max_pairs`` pairs, then sampled). Gathers every rank's
    rows onto every rank (pairs, unlike ranks, do not split by range)."""

    higher_is_better = True

    preds: list[Tensor]
    targets: list[Tensor]

    def __init__(self, max_pairs: int = 1 << 22, seed: int = 0) -> None:
        super().__init__("preds", "targets")
        self.max_pairs, self.seed = max_pairs, seed

    def update(self, preds: Tensor, labels: Tensor) -> None:
        self.keep("preds", preds.detach().double().flatten())
        self.keep("targets", labels.detach().double().flatten())

    def compute(self) -> Tensor:
        return xauc(self._rows("preds"), self._rows("targets"), self.max_pairs, self.seed)
