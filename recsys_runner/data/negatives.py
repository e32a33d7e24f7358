"""Sampled negatives for two-tower training, drawn from the item catalogue inside the data pipeline.

In-batch softmax scores each query against the other rows' items only, so the negatives it sees are as popular as the
positives and the catalogue's tail is never a negative. ``data.negatives`` appends ``num_negatives`` (``K``) catalogue
items to every *training* batch, shared by all its queries: the batch's ``KeyedJaggedTensor`` has ``B + K`` rows, the
last ``K`` with the item features only (looked up in the :class:`~recsys_runner.data.items.ItemTable`, every other key
empty), dense columns 0 except the item's own, labels :data:`LABEL_PAD`. ``FeatureSpec.sampled_items = K`` tells the
model. Eval batches carry none (full-corpus evaluation scores against every item).

The draw is made where the batch is made (in a DataLoader worker when ``data.num_workers > 0``) from a seed that is a
function of the data's ``seed`` and the batch's identity alone (generated data: its batch index; files: epoch, shard and
batch number in the shard), so it is reproducible, the same on resume (which skips the batches already trained) and
independent between ranks, which read disjoint batches. ``docs/retrieval.md`` says when to use which kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from recsys_runner.data.items import ItemTable
from recsys_runner.errors import ConfigError, require
from recsys_runner.features import FeatureSpec

__all__ = ["DISTRIBUTIONS", "LABEL_PAD", "NegativeSampler", "NegativesConfig", "append_rows"]

DISTRIBUTIONS = ("uniform", "popularity")
"""How sampled negatives are drawn: every item equally, or in proportion to ``popularity ** alpha``."""
LABEL_PAD = 0.0
"""The label of a sampled row (every label column): not an interaction. A two-tower model reads no labels; a model that
did would see the sampled items as non-clicks."""
_SALT = 0x5A3D_1E6A
"""Mixed into every draw's seed, so that negatives are not correlated with the data's other uses of ``seed``."""


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

    def __post_init__(self) -> None:
        require(self.num_negatives >= 0, f"data.negatives.num_negatives must be >= 0, got {self.num_negatives}. Fix: e.g. 256, or 0 for none")
        require(self.distribution in DISTRIBUTIONS,
                f"data.negatives.distribution={self.distribution!r} must be one of {list(DISTRIBUTIONS)}")
        require(self.alpha >= 0, f"data.negatives.alpha must be >= 0, got {self.alpha}. Fix: 0.75 (1: raw popularity, 0: uniform)")
        require(0 <= self.hard_ratio <= 1, f"data.negatives.hard_ratio must lie in [0, 1], got {self.hard_ratio}")

    @property
    def enabled(self) -> bool:
        return self.num_negatives > 0

    def check(self, table: ItemTable | None, features: FeatureSpec, where: str) -> None:
        """Raise :class:`ConfigError` when negatives are asked for but cannot be drawn: no item table (``where`` says how to get
        one), more negatives than items, or a ``hard_column`` the data does not have."""
        if not self.enabled:
            return
        if table is None:
            raise ConfigError(f"data.negatives.num_negatives={self.num_negatives} samples catalogue items, but {where}")
        require(self.num_negatives <= len(table),
                f"data.negatives.num_negatives={self.num_negatives} is larger than the item table ({len(table)} items): the draws "
                f"would mostly repeat items. Fix: data.negatives.num_negatives<={len(table)}")
        require(self.hard_column is None or self.hard_column in features.kjt_keys,
                f"data.negatives.hard_column={self.hard_column!r} is not a sparse column of the data ({', '.join(features.kjt_keys)}). "
                f"Fix: declare it in data.sparse as a list column with the item id's encoding (e.g. table: item)")


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

    @property
    def num_negatives(self) -> int:
        return self.config.num_negatives

    def features(self, spec: FeatureSpec) -> FeatureSpec:
        """``spec`` declaring the ``K`` sampled rows of every training batch."""
        return replace(spec, sampled_items=self.num_negatives)

    def draw(self, key: Sequence[int], hard_ids: np.ndarray | None = None) -> np.ndarray:
        """``K`` table rows for the batch identified by ``key`` (a pure function of ``seed`` and ``key``): up to
        ``hard_ratio · K`` of them from ``hard_ids`` (encoded item ids; those not in the table are passed over), the rest
        from :attr:`probabilities`."""
        rng = np.random.default_rng([self.seed & 0xFFFF_FFFF, _SALT, *(int(k) for k in key)])
        k = self.num_negatives
        hard = np.zeros(0, np.int64)
        if hard_ids is not None and hard_ids.size:
            index, found = self.table.index_of(hard_ids)
            known = index[found]
            if known.size:
                hard = known[rng.integers(0, known.size, min(round(self.config.hard_ratio * k), k))]
        if self.config.distribution == "uniform":
            sampled = rng.integers(0, len(self.table), k - hard.size)
        else:
            sampled = np.minimum(np.searchsorted(self._cdf, rng.random(k - hard.size) * self._cdf[-1], side="right"), len(self.table) - 1)
        return np.concatenate([hard, sampled]).astype(np.int64)

    def extend(self, tensors: tuple[torch.Tensor, ...], key: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """A batch's ``(dense, values, lengths, labels)`` (values and lengths key-major over :attr:`keys`) with ``K`` sampled
        item rows appended; what follows the four tensors in ``tensors`` is passed through."""
        dense, values, lengths, labels = tensors[:4]
        hard_ids = self._hard_ids(values, lengths, labels.shape[0]) if self._hard is not None else None
        item_dense, kjt = self.table.rows(self.draw(key, hard_ids), list(self.keys), tuple(self.dense_names))
        appended = append_rows((dense, values, lengths, labels), (item_dense, kjt.values(), kjt.lengths()), len(self.keys))
        return (*appended, *tensors[4:])

    def _hard_ids(self, values: torch.Tensor, lengths: torch.Tensor, rows: int) -> np.ndarray:
        """The ``hard_column`` ids of every row of a batch, flattened."""
        assert self._hard is not None
        per_key = lengths.view(len(self.keys), rows).sum(1).tolist()
        start = int(sum(per_key[: self._hard]))
        return values[start : start + int(per_key[self._hard])].numpy()


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
