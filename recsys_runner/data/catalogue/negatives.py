"""Sampled negatives for two-tower training, drawn from the item catalogue inside the data pipeline.

In-batch softmax scores each query against the other rows' items only, so the negatives it sees are as popular as the
positives and the catalogue's tail is never a negative. ``data.negatives`` appends ``num_negatives`` (``K``) catalogue
items to every *training* batch, shared by all its queries: the batch's ``KeyedJaggedTensor`` has ``B + K`` rows, the
last ``K`` with the item features only (looked up in the :class:`~recsys_runner.data.catalogue.items.ItemTable`, every other key
empty), dense columns 0 except the item's own, labels :data:`LABEL_PAD`. ``FeatureSpec.sampled_items = K`` tells the
model. Eval batches carry none (full-corpus evaluation scores against every item).

The draw is made where the batch is made (in a DataLoader worker when ``data.num_workers > 0``) from a seed that is a
function of the data's ``seed`` and the batch's identity alone (generated data: its batch index; files: epoch, shard and
batch number in the shard), so it is reproducible, the same on resume (which skips the batches already trained) and
independent between ranks, which read disjoint batches. ``docs/retrieval.md`` says when to use which kind.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from recsys_runner.data.catalogue.items import ItemTable
from recsys_runner.errors import ConfigError, require
from recsys_runner.features import FeatureSpec

__all__ = ["DISTRIBUTIONS", "LABEL_PAD", "MinedNegatives", "NegativeSampler", "NegativesConfig", "append_rows"]

DISTRIBUTIONS = ("uniform", "popularity")
"""How sampled negatives are drawn: every item equally, or in proportion to ``popularity ** alpha``."""
LABEL_PAD = 0.0
"""The label of a sampled row (every label column): not an interaction. A two-tower model reads no labels; a model that
did would see the sampled items as non-clicks."""
_SALT = 0x5A3D_1E6A
"""Mixed into every draw's seed, so that negatives are not correlated with the data's other uses of ``seed``."""


FILES_HARD_FIX = "declare it in data.sparse as a list column with the item id's encoding (e.g. table: item)"
"""How files get a ``data.negatives.hard_column`` (:meth:`NegativesConfig.check`); generated data passes its own fix."""


@dataclass(kw_only=True)
class NegativesConfig:
    """``data.negatives``: catalogue items appended to every training batch as shared negatives (needs an item table:
    ``data=synthetic_retrieval`` generates one, files take ``data.items``)."""

    num_negatives: int = 0
    """``K``: sampled items appended to every training batch, shared by its queries; 0: in-batch negatives only."""
    distribution: str = "uniform"
    """``uniform`` (every catalogue item alike: the tail gets its share) or ``popularity`` (``∝ popularity ** alpha``, the
    word2vec unigram rule: close to what in-batch negatives see, softened). Draws are with replacement."""
    alpha: float = 0.75
    """The exponent of ``distribution: popularity``: 1 follows the training data's item frequency, 0 is uniform."""
    hard_column: str | None = None
    """A list column of the training files (declared in ``data.sparse`` with the item id's encoding, e.g. ``table: item``)
    holding per-row hard negative item ids; ``hard_ratio`` of the ``K`` come from the batch's lists. ``null``: none."""
    hard_ratio: float = 0.25
    """The share of the ``K`` taken from ``hard_column`` (the rest sampled; all of them when a batch names too few)."""
    mined_ratio: float = 0.0
    """The share of the ``K`` mined from the previous full-corpus eval's item index (each refresh keeps, per catalogue item,
    the ``mined_top_k`` items that index scores highest against it): drawn from the lists of the batch's positives, never
    one of the batch's positives. Needs a full-corpus metric in ``model.eval_metrics`` (the refresh); 0: none."""
    mined_top_k: int = 50
    """How many top-scoring items are kept per catalogue item at each refresh (the pool ``mined_ratio`` draws from)."""

    def __post_init__(self) -> None:
        require(self.num_negatives >= 0, f"data.negatives.num_negatives must be >= 0, got {self.num_negatives}. Fix: e.g. 256, or 0 for none")
        require(self.distribution in DISTRIBUTIONS,
                f"data.negatives.distribution={self.distribution!r} must be one of {list(DISTRIBUTIONS)}")
        require(self.alpha >= 0, f"data.negatives.alpha must be >= 0, got {self.alpha}. Fix: 0.75 (1: raw popularity, 0: uniform)")
        require(0 <= self.hard_ratio <= 1, f"data.negatives.hard_ratio must lie in [0, 1], got {self.hard_ratio}")
        require(0 <= self.mined_ratio <= 1, f"data.negatives.mined_ratio must lie in [0, 1], got {self.mined_ratio}")
        require(self.mined_top_k > 0, f"data.negatives.mined_top_k must be positive, got {self.mined_top_k}. Fix: e.g. 50")
        # a share of none: the sampler is off, and nothing would read (or check) the column or the mined pool
        unused = {key: off for key, value, off in (("hard_column", self.hard_column, "null"), ("mined_ratio", self.mined_ratio, "0"))
                  if value not in (None, 0)}
        require(self.enabled or not unused,
                f"{' and '.join(f'data.negatives.{key}={getattr(self, key)}' for key in unused)} would do nothing: "
                f"data.negatives.num_negatives=0 samples no negatives to take a share of (in-batch negatives only). Fix: "
                f"data.negatives.num_negatives=256 (for example), or {' '.join(f'data.negatives.{k}={v}' for k, v in unused.items())}")
        require(self.hard_ratio + self.mined_ratio <= 1 or self.hard_column is None,
                f"data.negatives.hard_ratio + mined_ratio = {self.hard_ratio + self.mined_ratio} exceeds 1: together they are "
                f"shares of the same K. Fix: lower one of them")

    @property
    def enabled(self) -> bool:
        return self.num_negatives > 0

    def check(self, table: ItemTable | None, features: FeatureSpec, where: str, hard_fix: str = FILES_HARD_FIX) -> None:
        """Raise :class:`ConfigError` when negatives are asked for but cannot be drawn: no item table (``where`` says how to get
        one), more negatives than items, or a ``hard_column`` the data does not have (``hard_fix``: how this data gets one)."""
        if not self.enabled:
            return
        if table is None:
            raise ConfigError(f"data.negatives.num_negatives={self.num_negatives} samples catalogue items, but {where}")
        require(self.num_negatives <= len(table),
                f"data.negatives.num_negatives={self.num_negatives} is larger than the item table ({len(table)} items): the draws "
                f"would mostly repeat items. Fix: data.negatives.num_negatives<={len(table)}")
        require(self.mined_ratio == 0 or self.mined_top_k < len(table),
                f"data.negatives.mined_top_k={self.mined_top_k} must be smaller than the item table ({len(table)} items)")
        require(self.hard_column is None or self.hard_column in features.kjt_keys,
                f"data.negatives.hard_column={self.hard_column!r} is not a sparse column of the data ({', '.join(features.kjt_keys)}). "
                f"Fix: {hard_fix}")


class NegativeSampler:
    """Draws ``K`` item rows per training batch from ``table`` and appends them to the batch's tensors.

    Built once in the main process (the weights are prepared there) and copied into DataLoader workers with the data module.
    """

    def __init__(self, config: NegativesConfig, table: ItemTable, features: FeatureSpec, seed: int) -> None:
        self.config, self.table, self.seed = config, table, seed
        self.keys, self.dense_names = features.kjt_keys, features.dense_names
        weights = table.popularity ** config.alpha if config.distribution == "popularity" else np.ones(len(table))
        total = float(weights.sum())
        if not np.isfinite(total) or total <= 0:  # no popularity known anywhere: uniform is the only honest choice
            weights, total = np.ones(len(table)), float(len(table))
        self.probabilities = weights / total
        """Each item's chance per draw (what a logQ correction subtracts the log of)."""
        self._cdf = np.cumsum(self.probabilities)
        self._hard = self.keys.index(config.hard_column) if config.hard_column is not None else None
        self.mined = MinedNegatives(len(table), config.mined_top_k) if config.mined_ratio > 0 else None
        """The lists mined at the last index refresh (``None`` without ``mined_ratio``): shared memory, so a refresh in the
        training process reaches DataLoader workers already running."""
        self._positive = self.keys.index(table.id_feature)

    @property
    def num_negatives(self) -> int:
        return self.config.num_negatives

    def features(self, spec: FeatureSpec) -> FeatureSpec:
        """``spec`` declaring the ``K`` sampled rows of every training batch."""
        return replace(spec, sampled_items=self.num_negatives)

    def draw(self, key: Sequence[int], hard_ids: np.ndarray | None = None, positives: np.ndarray | None = None) -> np.ndarray:
        """``K`` table rows for the batch identified by ``key`` (a pure function of ``seed``, ``key`` and the mined lists):
        up to ``hard_ratio · K`` of them from ``hard_ids`` (encoded item ids; those not in the table are passed over), then
        up to ``mined_ratio · K`` from the mined lists of ``positives`` (the batch's positive table rows; none of them is
        drawn), the rest from :attr:`probabilities`, in that order."""
        rng = np.random.default_rng([self.seed & 0xFFFF_FFFF, _SALT, *(int(k) for k in key)])
        k = self.num_negatives
        hard = np.zeros(0, np.int64)
        if hard_ids is not None and hard_ids.size:
            index, found = self.table.index_of(hard_ids)
            known = index[found]
            if known.size:
                hard = known[rng.integers(0, known.size, min(round(self.config.hard_ratio * k), k))]
        mined = np.zeros(0, np.int64)
        if self.mined is not None and positives is not None and positives.size:
            pool = self.mined.pool(positives)
            if pool.size:
                mined = pool[rng.integers(0, pool.size, min(round(self.config.mined_ratio * k), k - hard.size))]
        rest = k - hard.size - mined.size
        if self.config.distribution == "uniform":
            sampled = rng.integers(0, len(self.table), rest)
        else:
            sampled = np.minimum(np.searchsorted(self._cdf, rng.random(rest) * self._cdf[-1], side="right"), len(self.table) - 1)
        return np.concatenate([hard, mined, sampled]).astype(np.int64)

    def extend(self, tensors: tuple[torch.Tensor, ...], key: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """A batch's ``(dense, values, lengths, labels)`` (values and lengths key-major over :attr:`keys`) with ``K`` sampled
        item rows appended; what follows the four tensors in ``tensors`` is passed through."""
        dense, values, lengths, labels = tensors[:4]
        rows = labels.shape[0]
        hard_ids = _column(values, lengths, len(self.keys), rows, self._hard)[0].numpy() if self._hard is not None else None
        positives = self._positives(values, lengths, rows) if self.mined is not None else None
        item_dense, kjt = self.table.rows(self.draw(key, hard_ids, positives), list(self.keys), tuple(self.dense_names))
        appended = append_rows((dense, values, lengths, labels), (item_dense, kjt.values(), kjt.lengths()), len(self.keys))
        return (*appended, *tensors[4:])

    def extend_stream(self, stream: Iterator[tuple], epoch: int, shard: int) -> Iterator[tuple]:
        """A shard's training batch tuples (file data, :mod:`~recsys_runner.data.files.shard_stream`) with the sampled rows
        appended to each (:meth:`extend`), seeded by (epoch, shard, batch number): markers (skipped-row counts, worker
        errors) pass as they are."""
        number = 0
        for item in stream:
            if isinstance(item[0], str) or item[3] is None:
                yield item
                continue
            yield self.extend(item, (epoch, shard, number))
            number += 1

    def _positives(self, values: torch.Tensor, lengths: torch.Tensor, rows: int) -> np.ndarray:
        """The table rows of the batch's positives (each row's first item id; ids not in the table are left out)."""
        ids, counts = _column(values, lengths, len(self.keys), rows, self._positive)
        starts = (torch.cumsum(counts, 0) - counts)[counts > 0]
        index, found = self.table.index_of(ids[starts].numpy())
        return index[found]


class MinedNegatives:
    """Hard negatives mined from the model's own index: per catalogue item ``i``, the ``top_k`` other items the previous
    full-corpus eval's item vectors score highest against ``i``'s vector (``<v_i, v_j>``, ``j != i``).

    A query trained towards its positive ``i`` sits near ``v_i``, so these are the items the previous index retrieves
    for such a query that are not ``i``: the "previous model's top results that were not the positive", keyed by the
    positive rather than by the query so that every training row finds its list without a user catalogue. The lists
    are a ``[N, top_k]`` tensor of table rows in shared memory (``-1``: not mined yet), made before any DataLoader
    worker starts: :meth:`refresh` in the training process rewrites it in place and running workers read the new lists.
    """

    def __init__(self, num_items: int, top_k: int) -> None:
        self.top_k = min(top_k, max(num_items - 1, 0))
        self.lists = torch.full((num_items, self.top_k), -1, dtype=torch.int64).share_memory_()
        self.refreshes = torch.zeros(1, dtype=torch.int64).share_memory_()
        """How many refreshes the lists have seen (0: none yet, every draw is sampled)."""

    def pool(self, positives: np.ndarray) -> np.ndarray:
        """The mined items of table rows ``positives`` (repeats kept: an item listed for several positives is drawn more
        often), less ``positives`` themselves; empty before the first refresh."""
        lists = self.lists.numpy()[positives]
        pool = lists[lists >= 0]
        return pool[~np.isin(pool, positives)]

    def refresh(self, index: torch.Tensor, chunk_rows: int) -> None:
        """Mine every item's list from the item vectors ``index [N, O]`` (on any device) and :meth:`store` them (one
        process; ``train/corpus.py`` splits the rows over ranks with :meth:`mine`)."""
        n = index.shape[0]
        self.store(torch.cat([self.mine(index, start, min(chunk_rows, n - start), chunk_rows) for start in range(0, n, chunk_rows)]))

    def mine(self, index: torch.Tensor, start: int, count: int, chunk_rows: int) -> torch.Tensor:
        """The lists of items ``start … start+count-1`` ``[count, top_k]`` (on ``index``'s device): each one's ``top_k``
        other rows of ``index [N, O]`` by score, ``chunk_rows`` items scored at once (memory ``count × (chunk_rows +
        top_k)`` scores; all rows together cost ``N² · O``)."""
        require(index.shape[0] == self.lists.shape[0], f"the item index has {index.shape[0]} rows, the mined lists {self.lists.shape[0]}")
        return _top_others(index, start, count, self.top_k, chunk_rows)

    def store(self, lists: torch.Tensor) -> None:
        """Replace every item's list with ``lists [N, top_k]`` (table rows), in place: what running workers read next."""
        self.lists.copy_(lists)
        self.refreshes += 1


def _top_others(index: torch.Tensor, start: int, count: int, k: int, chunk_rows: int) -> torch.Tensor:
    """The ``k`` rows of ``index`` scoring highest against each of rows ``start … start+count-1``, itself excluded."""
    queries = index[start:start + count]
    own = torch.arange(start, start + count, device=index.device)
    top_scores = torch.full((count, 0), float("-inf"), dtype=index.dtype, device=index.device)
    top_rows = torch.zeros((count, 0), dtype=torch.long, device=index.device)
    for first in range(0, index.shape[0], chunk_rows):
        scores = queries @ index[first:first + chunk_rows].t()
        inside = (own >= first) & (own < first + scores.shape[1])
        scores[inside.nonzero().view(-1), own[inside] - first] = float("-inf")
        best, at = scores.topk(min(k, scores.shape[1]), dim=1)
        top_scores, pick = torch.cat([top_scores, best], dim=1).topk(min(k, top_scores.shape[1] + best.shape[1]), dim=1)
        top_rows = torch.cat([top_rows, at + first], dim=1).gather(1, pick)
    return top_rows


def _column(values: torch.Tensor, lengths: torch.Tensor, num_keys: int, rows: int, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key ``key``'s ``(values, lengths [rows])`` of a batch whose values and lengths are key-major over ``num_keys``."""
    per_row = lengths.view(num_keys, rows)
    start = int(per_row[:key].sum())
    counts = per_row[key]
    return values[start:start + int(counts.sum())], counts


def append_rows(batch: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...], num_keys: int) -> tuple[torch.Tensor, ...]:
    """``(dense [B, n], values, lengths [F·B], labels)`` with ``(dense [K, n], values, lengths [F·K])`` appended as rows
    ``B … B+K-1``: each key's values and lengths stay contiguous (a KJT is key-major), labels padded with :data:`LABEL_PAD`."""
    dense, values, lengths, labels = batch
    extra_dense, extra_values, extra_lengths = rows
    b, k = labels.shape[0], extra_dense.shape[0]
    lengths_bk = lengths.view(num_keys, b)
    extra_bk = extra_lengths.to(lengths.dtype).view(num_keys, k)
    real = torch.split(values, lengths_bk.sum(1).tolist())
    extra = torch.split(extra_values.to(values.dtype), extra_bk.sum(1).tolist())
    merged = torch.cat([part for pair in zip(real, extra, strict=True) for part in pair])
    pad = torch.full((k, *labels.shape[1:]), LABEL_PAD, dtype=labels.dtype)
    return (torch.cat([dense, extra_dense.to(dense.dtype)]), merged, torch.cat([lengths_bk, extra_bk], dim=1).reshape(-1),
            torch.cat([labels, pad]))
