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
"""

from __future__ import annotations

from dataclasses import dataclass

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
        pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        hit = self.keys[pos] == keys
        return np.where(hit, self.rows[pos], oov)
