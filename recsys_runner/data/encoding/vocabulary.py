"""Vocabularies of id columns sized from the data: each value seen in the sample gets a row of its own, every
other value is hashed into a few out-of-vocabulary (OOV) rows after them.

A column with ``encoding: vocab`` (what an unsized id column becomes when the sample covers it, see
:mod:`recsys_runner.data.encoding.fit`) has ``num_embeddings = capacity + oov_buckets`` rows: rows ``[0, capacity)`` belong to
the values of the sample of the training files (the most frequent first; ties by key), rows
``[capacity, num_embeddings)`` are shared by every other value, by a stable hash. So an id seen in training never
shares a row with an id unseen in training: a cold-start user reads an OOV row, not the row a trained user owns.

Values are keyed by the stable 64-bit hashes the ``hash`` encoding uses (:func:`~recsys_runner.data.encoding.rows.fnv1a64`
of the text, :func:`~recsys_runner.data.encoding.rows.splitmix64` of an integer or of a ``hex`` column's parsed value), so
a vocabulary is a sorted array of keys and a lookup one ``searchsorted``. It is fitted once, when training starts, and
stored with every checkpoint (:mod:`recsys_runner.data.encoding.stored`); evaluate, predict, resume and export read it back.
Fine-tuning on new files with ``data.vocabulary=refit`` fits it anew, and :func:`carry_rows` says which trained row each
row of the new table starts from (the same id's).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Vocabulary:
    """The rows of one ``encoding: vocab`` column: ``keys`` (sorted) → ``rows``, then ``oov_buckets`` shared rows."""

    keys: np.ndarray
    """Keys of the in-vocabulary values, ascending (uint64)."""
    rows: np.ndarray
    """Row of each of ``keys`` (int64, in ``[0, capacity)``)."""
    capacity: int
    """Rows reserved for in-vocabulary values (``num_embeddings - oov_buckets``); the first OOV row."""
    oov_buckets: int

    @staticmethod
    def build(keys: np.ndarray, capacity: int, oov_buckets: int) -> Vocabulary:
        """The vocabulary of the sampled ``keys`` (with repeats): the ``capacity`` most frequent get rows 0, 1, …"""
        unique, counts = np.unique(keys.astype(np.uint64, copy=False), return_counts=True)
        order = np.lexsort((unique, -counts))[:capacity]  # most frequent first, ties by key: stable everywhere
        kept = unique[order]
        by_key = np.argsort(kept)
        return Vocabulary(kept[by_key], np.arange(len(kept), dtype=np.int64)[by_key], capacity, oov_buckets)

    @property
    def size(self) -> int:
        """Values with a row of their own."""
        return len(self.keys)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The row of each key: its own when in the vocabulary, else ``capacity + key mod oov_buckets``."""
        keys = keys.astype(np.uint64, copy=False)
        oov = self.capacity + (keys % np.uint64(self.oov_buckets)).astype(np.int64)
        if not len(self.keys):
            return oov
        pos = self._index.get_indexer(keys)  # a hash lookup: ~3x a searchsorted of unsorted queries (bench.encoding)
        return np.where(pos >= 0, self.rows[np.maximum(pos, 0)], oov)

    @cached_property
    def _index(self) -> Any:
        """``keys`` as a pandas hash index (built on the first lookup; the keys are distinct)."""
        import pandas as pd

        return pd.Index(self.keys)


@dataclass(frozen=True)
class RowCarry:
    """Where the rows of a vocabulary fitted anew (``data.vocabulary=refit``) start from: the trained table's row of the
    same id, or a fresh row (:func:`carry_rows`)."""

    old_rows: np.ndarray
    """Per row of the new table (``capacity + oov_buckets`` of them), the trained table's row it starts from (int64);
    ``-1``: it keeps its fresh (initialized) value."""
    carried: int
    """Ids in both vocabularies: their trained rows move to their new positions."""
    new: int
    """Ids only in the new vocabulary: their rows start fresh."""
    dropped: int
    """Ids only in the old vocabulary: their trained rows are left behind (such an id now reads an OOV row)."""
    oov_carried: bool
    """The OOV rows were carried over, bucket by bucket (the number of buckets is unchanged), else they start fresh."""

    def line(self, table: str) -> str:
        """The log line of ``table``'s carry."""
        oov = "its OOV rows carried over" if self.oov_carried else "its OOV rows start fresh"
        return (f"{table}: {self.carried} rows carried over, {self.new} new ids start fresh, {self.dropped} old ids not in the "
                f"new vocabulary; {oov}")


def carry_rows(old: Vocabulary, new: Vocabulary) -> RowCarry:
    """How the trained rows of ``old``'s table seed ``new``'s: an id in both keeps its trained row (moved to its new
    position), an id only in ``new`` starts fresh; OOV bucket ``b`` keeps its trained row when both have as many
    buckets (a value hashes to the same bucket then); the rows of ``new``'s capacity that no id holds start fresh."""
    old_rows = np.full(new.capacity + new.oov_buckets, -1, dtype=np.int64)
    _, in_new, in_old = np.intersect1d(new.keys, old.keys, assume_unique=True, return_indices=True)
    old_rows[new.rows[in_new]] = old.rows[in_old]
    oov_carried = old.oov_buckets == new.oov_buckets
    if oov_carried:
        old_rows[new.capacity:] = np.arange(old.capacity, old.capacity + old.oov_buckets, dtype=np.int64)
    return RowCarry(old_rows, carried=len(in_new), new=new.size - len(in_new), dropped=old.size - len(in_new), oov_carried=oov_carried)
