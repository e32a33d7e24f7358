"""Retrieval metrics: in-batch recall@k over query×candidate score matrices (``inbatch_recall@k``), HR@k and NDCG@k of a
true item ranked against a whole item table (sums and counts, summed across ranks; :mod:`recsys_runner.metrics.corpus`
has the chunked full-corpus pass, ``mrr`` and ``coverage@k``).

Shape legend: ``Q`` queries, ``C`` candidates, ``B`` rows, ``N`` items in the table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from recsys_runner.metrics.base import SumMetric


class RecallAtK(SumMetric):
    """Share of queries whose positive candidate ranks in the top ``k`` of that query's scores.

    ``update(scores [Q, C], positives [Q])``: ``positives[q]`` is the index of query ``q``'s positive
    among its ``C`` candidates (e.g. the diagonal of an in-batch score matrix). The positive's rank
    is the number of *other* candidates scoring at least as high — ties count against it, so a
    constant scorer gets no credit; a positive scored NaN is a miss.
    """

    higher_is_better = True

    hits: Tensor
    count: Tensor

    def __init__(self, k: int) -> None:
        super().__init__("hits", "count")
        self.k = k

    def update(self, scores: Tensor, positives: Tensor) -> None:
        scores = scores.detach()
        positive_scores = scores.gather(1, positives.long().view(-1, 1))
        rank = (scores >= positive_scores).sum(dim=1) - 1  # a NaN positive compares false with all: rank -1, yet a miss
        self.hits += ((rank < self.k) & ~torch.isnan(positive_scores.view(-1))).sum()
        self.count += scores.shape[0]

    def compute(self) -> Tensor:
        return self.mean(self.hits, self.count)


@dataclass(frozen=True)
class Ranked:
    """Rows already ranked against a whole item table, for the full-table metrics' ``update`` instead of a score
    matrix: a chunked full-corpus pass (:func:`recsys_runner.metrics.corpus.corpus_ranks`) never holds ``[B, N]``.

    Attributes:
        ranks: ``[B]`` float64, each row's target rank as :func:`target_ranks` counts it (``inf``: not in the table).
        top: ``[B, K]`` each row's top ``K`` item rows, best first (for ``coverage@k``, ``k <= K``).
        num_items: ``N``, the table's size.
    """

    ranks: Tensor
    top: Tensor
    num_items: int
    exact_top: Tensor | None = None
    """``[B, K]`` the exact top ``K`` when ``ranks`` and ``top`` come from an approximate index (``ann_recall@k``
    compares the two); ``None`` when they are exact."""


def _given(targets: Tensor | None) -> Tensor:
    """``targets``, which a score matrix needs beside it."""
    if targets is None:
        raise ValueError("update(scores, targets) needs the targets beside a score matrix")
    return targets


def target_ranks(scores: Tensor, targets: Tensor) -> Tensor:
    """Each row's rank of its target among all ``N`` candidates, exactly: ``[B]`` float64.

    ``scores [B, N]`` (a row's score of every item of the table), ``targets [B]`` (the index of the row's true item).
    The rank is the number of items scoring strictly higher than the target, plus half of the *other* items scoring
    exactly the same (ties count half, so a constant scorer gets the expected rank ``(N-1)/2`` of a random one):
    0 for a target strictly on top. A target scored NaN is a miss (``inf``): a NaN compares false with every score, so
    counted as the others it would rank -0.5, a hit at every ``k``. A target outside ``0 … N-1`` is no candidate (a
    next-item model scores only the items it may recommend, never the table's OOV rows: docs/metrics.md) and a miss too.
    """
    scores = scores.detach()
    targets = targets.long()
    candidate = (targets >= 0) & (targets < scores.shape[1])
    target_scores = scores.gather(1, torch.where(candidate, targets, 0).view(-1, 1))
    higher = (scores > target_scores).sum(dim=1).double()
    ties = (scores == target_scores).sum(dim=1).double() - 1
    ranks = unranked_if_nan(higher + 0.5 * ties, target_scores.view(-1))
    return torch.where(candidate, ranks, torch.full_like(ranks, float("inf")))


def unranked_if_nan(ranks: Tensor, target_scores: Tensor) -> Tensor:
    """``ranks [B]`` with ``inf`` (a miss) where the target's score ``target_scores [B]`` is NaN."""
    return torch.where(torch.isnan(target_scores), torch.full_like(ranks, float("inf")), ranks)


class HitRateAtK(SumMetric):
    """HR@k: share of rows whose true item ranks in the top ``k`` of the whole item table (rank ``< k``,
    :func:`target_ranks`; a target tied with others has a fractional rank).

    ``update(scores [B, N], targets [B])``: each row's score of every item and the index of its true item. Each row's
    gain (:meth:`gain`) and the row count are float64 sums, summed across ranks before ``compute`` divides, so the
    value over several ranks equals one process's over all their rows.
    """

    higher_is_better = True

    total: Tensor
    count: Tensor

    def __init__(self, k: int) -> None:
        super().__init__("total", "count")
        self.k = k

    def gain(self, rank: Tensor) -> Tensor:
        """Each row's value ``[B]`` from its target's rank ``[B]``: 1 for a hit, else 0."""
        return (rank < self.k).double()

    def update(self, scores: Tensor | Ranked, targets: Tensor | None = None) -> None:
        ranks = scores.ranks if isinstance(scores, Ranked) else target_ranks(scores, _given(targets))
        self.total += self.gain(ranks.double()).sum()
        self.count += ranks.shape[0]

    def compute(self) -> Tensor:
        return self.mean(self.total, self.count)


class NDCGAtK(HitRateAtK):
    """NDCG@k with one relevant item: ``1 / log2(rank + 2)`` when the true item's rank (:func:`target_ranks`) is
    ``< k``, else 0, averaged over rows (1 for a target on top); same inputs and reduction as :class:`HitRateAtK`."""

    def gain(self, rank: Tensor) -> Tensor:
        return torch.where(rank < self.k, 1.0 / torch.log2(rank + 2), torch.zeros_like(rank))
