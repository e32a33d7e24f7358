"""Full-corpus retrieval metrics: each query's true item ranked exactly against every item of a catalogue.

In-batch recall (``inbatch_recall@k``) ranks the positive among the batch's few hundred candidates, which flatters a
model that only separates popular items; serving retrieves from the whole catalogue, so these metrics rank against
all ``N`` items. The scores ``Q × N`` are never held at once: :func:`corpus_ranks` walks the index in chunks of
``chunk_rows`` items, so memory is ``Q × (chunk_rows + k)`` whatever ``N``; :func:`corpus_top_k` is its one-sweep
form for a top ``k`` without targets (``predict``'s), returning the rows with their scores.

The metrics are the full-table ranking metrics (``recall@k`` = ``hr@k`` with one relevant item, ``ndcg@k``, ``mrr``,
``coverage@k``): a next-item model feeds them ``update(scores [B, N], targets [B])``, a two-tower corpus pass feeds
them ``update(Ranked(ranks [Q], top [Q, K], N))`` from :func:`corpus_ranks` (ties as in
:func:`~recsys_runner.metrics.retrieval.target_ranks`: strictly higher items plus half the tied ones; a target not in
the catalogue, or whose score is NaN, has rank ``inf``, a miss). Sums and the covered item rows are combined over ranks before ``compute``,
so the value over several ranks is one process's over all queries.

Shape legend: ``Q`` queries, ``N`` items, ``O`` vector width, ``K`` the largest ``k`` asked for. A query may be ``I`` vectors
``[Q, I, O]`` (a multi-interest user, ``model=mind``): an item's score is then the best of its ``I`` products.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from recsys_runner.errors import ConfigError
from recsys_runner.metrics.base import GatherMetric, SumMetric
from recsys_runner.metrics.retrieval import HitRateAtK, Ranked, unranked_if_nan
from recsys_runner.metrics.top_k import chunk_top_k, in_order, merge_top_k

__all__ = ["AnnRecallAtK", "MeanReciprocalRank", "CoverageAtK", "check_k_below", "corpus_ranks", "corpus_k", "corpus_top_k"]


def corpus_top_k(queries: Tensor, index: Tensor, k: int, chunk_rows: int, seen: Tensor | None = None,
                 between: Callable[[], None] | None = None) -> tuple[Tensor, Tensor]:
    """Each query's top ``k`` items and their scores, exactly, in one sweep over the chunks: what ``predict`` writes.

    Args:
        queries: ``[Q, O]`` query vectors.
        index: ``[N, O]`` item vectors (the score of item ``i`` is ``queries @ index[i]``).
        k: how many top items to return per query (``<= N``).
        chunk_rows: items scored at once; memory is ``Q × (chunk_rows + k)`` scores.
        seen: ``[Q, L]`` item rows each query's user has seen (``-1``: padding), which score ``-inf``; ``None``: nothing
            excluded.
        between: called after each chunk (a caller's check that may raise), or ``None``.

    Returns:
        ``(scores [Q, k], rows [Q, k] int64)``, best first, exactly tied items by their row, lowest first, whatever
        ``chunk_rows`` (:mod:`~recsys_runner.metrics.top_k`): the scores are the chunk matmul's own (a seen row that had
        to fill a short list scores ``-inf``), the rows those :func:`corpus_ranks` returns as its top.
    """
    no_target = torch.full((queries.shape[0],), -1, dtype=torch.long, device=queries.device)
    return _sweep(queries, index, k, chunk_rows, _SeenMask(seen, no_target, index.shape[0], chunk_rows), between)


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
        ``(ranks [Q] float64, top [Q, k] int64)``. Two passes over the chunks: the first (:func:`corpus_top_k`'s sweep)
        reads each target's score from the very matmul that scores it among the others, so the comparison in the
        second is exact (a separately computed dot product may differ in the last bit and miscount ties); the second is
        skipped when no query has a target in the catalogue (every rank is then ``inf``).
    """
    q, n = queries.shape[0], index.shape[0]
    known = targets >= 0
    target_scores = torch.full((q,), float("nan"), dtype=queries.dtype, device=queries.device)
    rows = torch.arange(q, device=queries.device)

    def read_targets(start: int, scores: Tensor) -> None:
        inside = known & (targets >= start) & (targets < start + scores.shape[1])
        target_scores[inside] = scores[rows[inside], targets[inside] - start]

    mask = _SeenMask(seen, targets, n, chunk_rows)
    _, top_rows = _sweep(queries, index, k, chunk_rows, mask, between, read_targets)
    if not bool(known.any()):
        return torch.full((q,), math.inf, dtype=torch.float64, device=queries.device), top_rows
    higher = torch.zeros(q, dtype=torch.float64, device=queries.device)
    ties = torch.zeros(q, dtype=torch.float64, device=queries.device)
    column = target_scores.view(-1, 1)
    scored = _ChunkScores(queries, index, chunk_rows)
    for start in range(0, n, chunk_rows):
        scores = mask.apply(scored(start), start)
        higher += (scores > column).sum(dim=1)
        ties += (scores == column).sum(dim=1)
        if between is not None:
            between()
    ranks = unranked_if_nan(higher + 0.5 * (ties - 1), target_scores)  # a NaN target score is a miss, not rank -0.5
    return torch.where(known, ranks, torch.full_like(ranks, math.inf)), top_rows


def _sweep(queries: Tensor, index: Tensor, k: int, chunk_rows: int, mask: _SeenMask, between: Callable[[], None] | None,
           each: Callable[[int, Tensor], None] | None = None) -> tuple[Tensor, Tensor]:
    """The one chunked pass of :func:`corpus_top_k` and :func:`corpus_ranks`: each chunk's scores (``mask`` applied,
    handed to ``each(start, scores)``), their top ``k`` merged into the running top ``k`` → ``(scores, rows)``."""
    q, n = queries.shape[0], index.shape[0]
    top_scores = torch.full((q, 0), float("-inf"), dtype=queries.dtype, device=queries.device)
    top_rows = torch.zeros((q, 0), dtype=torch.long, device=queries.device)
    scored = _ChunkScores(queries, index, chunk_rows)
    for start in range(0, n, chunk_rows):
        scores = mask.apply(scored(start), start)
        if each is not None:
            each(start, scores)
        best, at = chunk_top_k(scores, k)  # the chunk's own top k, then merged with the running top k; ties: lowest row
        top_scores, top_rows = merge_top_k(top_scores, top_rows, best, at + start, k)
        if between is not None:
            between()
    return in_order(top_scores, top_rows)


class _ChunkScores:
    """``queries @ index[start : start + chunk_rows].T``, each full chunk written into one buffer held for the pass: a
    fresh ``Q × chunk_rows`` result per chunk (32 MiB at 1024 × 8192) is a new mapping of the allocator's, paid in page
    faults on every chunk (a third of the matmul's time on a 2-core CPU); the values are the very same matmul's.

    Multi-interest queries ``[Q, I, O]`` (MIND: ``I`` vectors per user) score an item by their best vector, ``max_i``
    of the ``I`` products: what serving with ``I`` vectors returns."""

    def __init__(self, queries: Tensor, index: Tensor, chunk_rows: int) -> None:
        self.queries, self.index, self.chunk_rows = queries, index, chunk_rows
        self.buffer: Tensor | None = None

    def __call__(self, start: int) -> Tensor:
        chunk = self.index[start:start + self.chunk_rows]
        if self.queries.dim() == 3:
            return (self.queries @ chunk.t().unsqueeze(0)).amax(dim=1)
        if chunk.shape[0] < self.chunk_rows or (torch.is_grad_enabled() and (self.queries.requires_grad or chunk.requires_grad)):
            return self.queries @ chunk.t()  # the last, short chunk; or a graph being recorded (out= records none)
        if self.buffer is None:
            self.buffer = torch.empty((self.queries.shape[0], self.chunk_rows), dtype=torch.result_type(self.queries, chunk),
                                      device=self.queries.device)
        return torch.mm(self.queries, chunk.t(), out=self.buffer)


class _SeenMask:
    """Each query's ``seen [Q, L]`` rows (``-1`` padding) other than its target, as ``(query, row)`` pairs sorted by row
    once, so that a chunk's share is a slice (found by binary search) set to ``-inf`` in one indexed write; the same
    entries in every pass, so a target's rank counts unseen items only."""

    def __init__(self, seen: Tensor | None, targets: Tensor, num_items: int, chunk_rows: int) -> None:
        self.queries: Tensor | None = None
        if seen is None:
            return
        wanted = (seen >= 0) & (seen < num_items) & (seen != targets.view(-1, 1))
        queries, columns = wanted.nonzero(as_tuple=True)
        rows, order = seen[queries, columns].sort(stable=True)
        self.queries, self.rows = queries[order], rows
        starts = torch.arange(0, num_items + chunk_rows, chunk_rows, device=seen.device)
        self.bounds = torch.searchsorted(rows, starts).tolist()
        self.chunk_rows = chunk_rows

    def apply(self, scores: Tensor, start: int) -> Tensor:
        """``scores [Q, C]`` of items ``start … start + C - 1`` with the seen ones among them at ``-inf`` (in place)."""
        if self.queries is None:
            return scores
        chunk = start // self.chunk_rows
        lo, hi = self.bounds[chunk], self.bounds[chunk + 1]
        if hi > lo:
            scores[self.queries[lo:hi], self.rows[lo:hi] - start] = float("-inf")
        return scores


def check_k_below(names: list[str], candidates: int, key: str, among: str, more: str) -> None:
    """Refuse an ``@k`` metric of ``names`` (as config key ``key`` lists them) whose ``k`` is at least ``candidates``,
    the number of items each eval row ranks its true item among: its top ``k`` then holds every candidate, so
    ``hr@k``, ``recall@k`` and ``coverage@k`` are 1 whatever the model and ``ndcg@k`` cuts nothing: a perfect score
    that measures nothing, which a comparison with a published ``@k`` would take at face value.

    The one check of every path that ranks, each before training: a two-tower model's catalogue (:func:`corpus_k`), a
    next-item model's item table, sampled negatives (``model.eval_negatives + 1`` candidates), in-batch candidates
    (the eval batch's rows) (:func:`recsys_runner.metrics.tasks.check_task_metrics`).

    Args:
        among: what the candidates are, for the message (``"the item catalogue's items"``).
        more: the other fix, ranking among more candidates; ``{k}`` in it stands for the largest ``k`` refused
            (``"model.eval_negatives={k}"``).

    Raises:
        ConfigError: naming the metrics, the first one's ``k``, the candidate count and both fixes.
    """
    too_big = [(name, k) for name in names if "@" in name and (k := int(name.rsplit("@", 1)[1])) >= candidates]
    if too_big:
        name, k = too_big[0]
        largest = max(k for _, k in too_big)
        example = f"{name.split('@')[0]}@{min(10, max(candidates - 1, 1))}"
        raise ConfigError(f"{key} lists {[n for n, _ in too_big]}, but each eval row ranks its true item among only {candidates} "
                          f"candidates ({among}): a top k of k={k} >= {candidates} holds every one of them, so {name} is a "
                          f"perfect score whatever the model. Fix: k < {candidates}, e.g. {example}, or {more.format(k=largest)}")


def corpus_k(names: list[str], candidates: int, key: str, among: str, more: str) -> int:
    """The largest ``k`` of the ``@k`` corpus metrics ``names`` (1 for none): how many top items :func:`corpus_ranks`
    keeps.

    Raises:
        ConfigError: some ``k`` is not below the ``candidates`` each query ranks among (:func:`check_k_below`).
    """
    check_k_below(names, candidates, key, among, more)
    return max((int(name.rsplit("@", 1)[1]) for name in names if "@" in name), default=1)


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
    rows). Each rank keeps one mask over the catalogue's ``N`` rows (``covered``, a list of that one bool tensor, set
    in place; rows outside ``0 … N-1``, an approximate search's ``-1`` padding, count nowhere) and the catalogue size;
    ``compute`` gathers the ranks' masks and counts the rows any of them holds. Memory is ``N`` bytes whatever the
    number of queries: the distinct rows of each batch's top ``k``, kept per batch as float64, grew with every batch
    (330 MB, 30 s of updates and a 1.75 GB peak in ``compute`` at 2M queries' top 100 of 100k items, one thread;
    docs/performance.md, "At scale"). Items tied at the ``k``-th place are cut as ``topk`` cuts them (arbitrarily among exact ties).
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
        top = scores.top[:, : self.k].reshape(-1)
        mask = self._mask(scores.num_items, top.device)
        mask.scatter_(0, top[(top >= 0) & (top < scores.num_items)], True)
        self.items = torch.clamp_min(self.items, float(scores.num_items))

    def _mask(self, num_items: int, device: torch.device) -> Tensor:
        """This rank's mask over ``num_items`` rows, made (or widened, keeping its rows) on first need."""
        if not self.covered:
            self.covered.append(torch.zeros(num_items, dtype=torch.bool, device=device))
        elif self.covered[0].numel() < num_items:
            self.covered[0] = torch.cat([self.covered[0], self.covered[0].new_zeros(num_items - self.covered[0].numel())])
        return self.covered[0]

    def compute(self) -> Tensor:
        masks, width = self._rows("covered"), int(self.items)
        if masks.numel() == 0:  # no rank ranked a row
            return torch.zeros((), dtype=torch.float64, device=self.device)
        if masks.numel() % width:
            raise RuntimeError(f"coverage@{self.k}: the ranks ranked against catalogues of different sizes (masks of "
                               f"{masks.numel()} rows in all, the largest catalogue {width} items)")
        return masks.view(-1, width).any(dim=0).sum() / self.items


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
        return self.mean(self.total, self.count)
