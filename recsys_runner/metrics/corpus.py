"""Full-corpus retrieval metrics: each query's true item ranked exactly against every item of a catalogue.

In-batch recall (``inbatch_recall@k``) ranks the positive among the batch's few hundred candidates, which flatters a
model that only separates popular items; serving retrieves from the whole catalogue, so these metrics rank against
all ``N`` items. The scores ``Q × N`` are never held at once: :func:`corpus_ranks` walks the index in chunks of
``chunk_rows`` items, so memory is ``Q × (chunk_rows + k)`` whatever ``N``.

The metrics are the full-table ranking metrics (``recall@k`` = ``hr@k`` with one relevant item, ``ndcg@k``, ``mrr``,
``coverage@k``): a next-item model feeds them ``update(scores [B, N], targets [B])``, a two-tower corpus pass feeds
them ``update(Ranked(ranks [Q], top [Q, K], N))`` from :func:`corpus_ranks` (ties as in
:func:`~recsys_runner.metrics.retrieval.target_ranks`: strictly higher items plus half the tied ones; a target not in
the catalogue has rank ``inf``, a miss). Sums and the covered item rows are combined over ranks before ``compute``,
so the value over several ranks is one process's over all queries.

Shape legend: ``Q`` queries, ``N`` items, ``O`` vector width, ``K`` the largest ``k`` asked for.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from recsys_runner.errors import ConfigError
from recsys_runner.metrics.base import GatherMetric, SumMetric
from recsys_runner.metrics.retrieval import HitRateAtK, Ranked

__all__ = ["AnnRecallAtK", "MeanReciprocalRank", "CoverageAtK", "corpus_ranks", "corpus_k"]


def corpus_ranks(queries: Tensor, index: Tensor, targets: Tensor, k: int, chunk_rows: int,
                 between: Callable[[], None] | None = None, seen: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Each query's target rank among all items and its top ``k`` item rows, exactly, chunk by chunk.

    Args:
        queries: ``[Q, O]`` query vectors.
        index: ``[N, O]`` item vectors (the score of item ``i`` is ``queries @ index[i]``).
        targets: ``[Q]`` each query's true item row in ``index``; ``-1`` when it is not in the catalogue (rank ``inf``).
        k: how many top items to return per query (``<= N``).
        chunk_rows: items scored at once; memory is ``Q × (chunk_rows + k)`` scores.
        between: called after each chunk's scoring (a caller's check that may raise to abandon the ranking: the
            training loop's pending-signal check), or ``None``.
        seen: ``[Q, L]`` item rows each query's user has seen (``-1``: padding), which score ``-inf`` unless the row is
            the query's target (``metrics.exclude_seen``); ``None``: nothing excluded.

    Returns:
        ``(ranks [Q] float64, top [Q, k] int64)``. Two passes over the chunks: the first reads each target's score
        from the very matmul that scores it among the others, so the comparison in the second is exact (a separately
        computed dot product may differ in the last bit and miscount ties).
    """
    q, n = queries.shape[0], index.shape[0]
    known = targets >= 0
    target_scores = torch.full((q,), float("nan"), dtype=queries.dtype, device=queries.device)
    top_scores = torch.full((q, 0), float("-inf"), dtype=queries.dtype, device=queries.device)
    top_rows = torch.zeros((q, 0), dtype=torch.long, device=queries.device)
    rows = torch.arange(q, device=queries.device)
    for start in range(0, n, chunk_rows):
        scores = _unseen(queries @ index[start:start + chunk_rows].t(), seen, targets, start)
        inside = known & (targets >= start) & (targets < start + scores.shape[1])
        target_scores[inside] = scores[rows[inside], targets[inside] - start]
        best, at = scores.topk(min(k, scores.shape[1]), dim=1)  # the chunk's own top k, then merged with the running top k
        top_scores, pick = torch.cat([top_scores, best], dim=1).topk(min(k, top_scores.shape[1] + best.shape[1]), dim=1)
        top_rows = torch.cat([top_rows, at + start], dim=1).gather(1, pick)
        if between is not None:
            between()
    higher = torch.zeros(q, dtype=torch.float64, device=queries.device)
    ties = torch.zeros(q, dtype=torch.float64, device=queries.device)
    column = target_scores.view(-1, 1)
    for start in range(0, n, chunk_rows):
        scores = _unseen(queries @ index[start:start + chunk_rows].t(), seen, targets, start)
        higher += (scores > column).sum(dim=1)
        ties += (scores == column).sum(dim=1)
        if between is not None:
            between()
    ranks = higher + 0.5 * (ties - 1)
    return torch.where(known, ranks, torch.full_like(ranks, math.inf)), top_rows


def _unseen(scores: Tensor, seen: Tensor | None, targets: Tensor, start: int) -> Tensor:
    """``scores [Q, C]`` of items ``start … start + C - 1`` with each query's ``seen`` rows among them at ``-inf``, except
    its target: the same entries in both passes of :func:`corpus_ranks`, so the target's rank counts unseen items only."""
    if seen is None:
        return scores
    inside = (seen >= start) & (seen < start + scores.shape[1]) & (seen != targets.view(-1, 1))
    q, j = inside.nonzero(as_tuple=True)
    scores[q, seen[q, j] - start] = float("-inf")
    return scores


def corpus_k(names: list[str], num_items: int, key: str) -> int:
    """The largest ``k`` of the ``@k`` corpus metrics ``names`` (1 for none): how many top items :func:`corpus_ranks`
    keeps.

    Raises:
        ConfigError: some ``k`` exceeds the catalogue's ``num_items``, naming the config key ``key``.
    """
    ks = [int(name.rsplit("@", 1)[1]) for name in names if "@" in name]
    too_big = [name for name, k in zip([n for n in names if "@" in n], ks, strict=True) if k > num_items]
    if too_big:
        raise ConfigError(f"{key} lists {too_big}, but the item catalogue has only {num_items} items; k counts items of "
                         f"the catalogue. Fix: k <= {num_items}, e.g. {too_big[0].split('@')[0]}@{min(10, num_items)}")
    return max(ks, default=1)


class MeanReciprocalRank(HitRateAtK):
    """``mrr``: the mean of ``1 / (rank + 1)`` over rows (1 for a target on top, 0 for one not in the catalogue); no
    cut-off, so it sees how far down the misses of ``recall@k`` are. Same inputs and reduction as ``hr@k``."""

    def __init__(self) -> None:
        super().__init__(0)

    def gain(self, rank: Tensor) -> Tensor:
        return 1.0 / (rank + 1)


class CoverageAtK(GatherMetric):
    """``coverage@k``: the share of catalogue items that appear in some row's top ``k``: a model that retrieves the
    same popular items for everyone covers little of the catalogue, whatever its recall.

    ``update(scores [B, N], targets [B])`` (full-table scores) or ``update(Ranked(...))`` (a chunked corpus pass's top
    rows). Keeps the distinct item rows of each update's top ``k``, gathered from all ranks, and the catalogue size;
    items tied at the ``k``-th place are cut as ``topk`` cuts them (arbitrarily among exact ties).
    """

    higher_is_better = True

    covered: list[Tensor]
    items: Tensor

    def __init__(self, k: int) -> None:
        super().__init__("covered")
        self.k = k
        self.add_state("items", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")

    def update(self, scores: Tensor | Ranked, targets: Tensor | None = None) -> None:
        if not isinstance(scores, Ranked):
            scores = Ranked(torch.zeros(0), scores.detach().topk(min(self.k, scores.shape[1]), dim=1).indices, scores.shape[1])
        top = scores.top[:, : self.k].reshape(-1).unique()
        self.covered.append(top[top >= 0].double())  # an approximate search pads a short list with -1
        self.items = torch.clamp_min(self.items, float(scores.num_items))

    def compute(self) -> Tensor:
        return self._rows("covered").unique().numel() / self.items.clamp_min(1)


class AnnRecallAtK(SumMetric):
    """``ann_recall@k``: the share of the exact top ``k`` that an approximate index (``model.index=faiss``) returns in
    its top ``k``, averaged over rows: how much the full-corpus metrics lose to the approximation. 1 for an exact
    index (a :class:`Ranked` without ``exact_top``, or full-table scores)."""

    higher_is_better = True

    total: Tensor
    count: Tensor

    def __init__(self, k: int) -> None:
        super().__init__("total", "count")
        self.k = k

    def update(self, scores: Tensor | Ranked, targets: Tensor | None = None) -> None:
        rows = scores.ranks.shape[0] if isinstance(scores, Ranked) else scores.shape[0]
        if isinstance(scores, Ranked) and scores.exact_top is not None:
            found, exact = scores.top[:, : self.k], scores.exact_top[:, : self.k]
            shared = (found.unsqueeze(2) == exact.unsqueeze(1)).any(dim=2).sum(dim=1).double()
            self.total += (shared / max(exact.shape[1], 1)).sum()
        else:
            self.total += rows
        self.count += rows

    def compute(self) -> Tensor:
        return self.total / self.count.clamp_min(1)
