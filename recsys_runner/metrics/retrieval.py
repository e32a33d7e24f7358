"""Retrieval metrics: recall@k over query×candidate score matrices (counts, summed across ranks)."""

from __future__ import annotations

from torch import Tensor

from recsys_runner.metrics.base import SumMetric


class RecallAtK(SumMetric):
    """Share of queries whose positive candidate ranks in the top ``k`` of that query's scores.

    ``update(scores [Q, C], positives [Q])``: ``positives[q]`` is the index of query ``q``'s positive
    among its ``C`` candidates (e.g. the diagonal of an in-batch score matrix). The positive's rank
    is the number of *other* candidates scoring at least as high — ties count against it, so a
    constant scorer gets no credit.
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
        rank = (scores >= positive_scores).sum(dim=1) - 1
        self.hits += (rank < self.k).sum()
        self.count += scores.shape[0]

    def compute(self) -> Tensor:
        return self.hits / self.count.clamp_min(1)
