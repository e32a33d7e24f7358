"""Vocabularies of id columns sized from the data: each value seen in the sample gets a row of its own, every
other value is hashed into a few out-of-vocabulary (OOV) rows after them.

A column with ``encoding: vocab`` (what an unsized id column becomes when the sample covers it, see
:mod:`recsys_runner.data.encoding.fit`) has ``num_embeddings = capacity + oov_buckets`` rows: rows ``[0, capacity)`` belong to
the values of the sample of the training files (the most frequent first; ties by key), rows
``[capacity, num_embeddings)`` are shared by every other value, by a stable hash. So an id seen in training never
shares a row with an id unseen in training: a cold-start user reads an OOV row, not the row a trained user owns.

Values are keyed by the stable 64-bit hashes the ``hash`` encoding uses (:func:`~recsys_runner.data.encoding.keys.fnv1a64`
of the text, :func:`~recsys_runner.data.encoding.keys.splitmix64` of an integer or of a ``hex`` column's parsed value), so
a vocabulary is a sorted array of keys and a lookup one hash probe; integers whose range is modest are read from a
direct table of that range instead, one gather per value (:meth:`Vocabulary.lookup_ints`). It is fitted once, when training starts, and
stored with every checkpoint (:mod:`recsys_runner.data.encoding.stored`); evaluate, predict, resume and export read it back.
Fine-tuning on new files with ``data.vocabulary=refit`` fits it anew, and :func:`carry_rows` says which trained row each
row of the new table starts from (the same id's).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING or __package__:
    from . import keys as _keys
    from . import values as _values
else:  # inside the MLflow model: the copies of keys.py and values.py beside this one in its code/ directory
    _CODE = __name__.removeprefix("recsys_vocabulary")  # "_<hash>": this copy's code set (served.SHIPPED says why)
    _keys = importlib.import_module(f"recsys_keys{_CODE}")
    _values = importlib.import_module(f"recsys_values{_CODE}")

DIRECT_SLACK, DIRECT_MIN, DIRECT_MAX = 4, 1 << 16, 1 << 25
"""A vocabulary of integers reads them from a direct table (:meth:`Vocabulary.lookup_ints`) when the integers it holds
span at most ``DIRECT_SLACK`` x its size + ``DIRECT_MIN`` values, and never more than ``DIRECT_MAX`` (8 bytes a value:
about what a hash index of the same keys takes); wider (hashed or sparse ids, text) it hashes them."""


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
        oov = self._oov_rows(keys)
        if not len(self.keys):
            return oov
        pos = self._index.get_indexer(keys)  # a hash lookup: ~3x a searchsorted of unsorted queries (bench.encoding)
        return np.where(pos >= 0, self.rows[np.maximum(pos, 0)], oov)

    def lookup_ints(self, values: np.ndarray, present: np.ndarray | None = None) -> np.ndarray:
        """The row of each integer (int64) of ``values[present]`` (all when ``present`` is ``None``), keyed by its
        :func:`~recsys_runner.data.encoding.keys.splitmix64`: exactly ``lookup(splitmix64(values[present]))``, but when the
        vocabulary's integers span a modest range one gather from a table of every integer of that range (its own row or
        its OOV row) instead of a mix, a hash and a probe per value. ``values`` outside ``present`` may hold anything
        (the slots of a column's nulls)."""
        direct = self._direct
        if direct is None or not len(values):
            kept = values if present is None else values[present]
            return self.lookup(_keys.splitmix64(kept.view(np.uint64)))
        first, table = direct
        if int(values.min()) >= first and int(values.max()) < first + len(table):
            gathered = table.take(values - first if first else values)
            if present is not None:
                gathered = gathered[present]
            return _values.widened(gathered)
        # Some values lie outside the table: no key of the vocabulary is theirs (uint64 arithmetic: wraps, never overflows).
        kept = values if present is None else values[present]
        offsets = kept.view(np.uint64) - np.uint64(first % 2**64)
        outside = offsets >= np.uint64(len(table))
        rows = table.take(np.where(outside, np.uint64(0), offsets).view(np.int64)).astype(np.int64)
        rows[outside] = self._oov_rows(_keys.splitmix64(kept[outside].view(np.uint64)))
        return rows

    def _oov_rows(self, keys: np.ndarray) -> np.ndarray:
        """The OOV row of each key (uint64): ``capacity + key mod oov_buckets``."""
        return self.capacity + (keys % np.uint64(self.oov_buckets)).astype(np.int64)

    @cached_property
    def _direct(self) -> tuple[int, np.ndarray] | None:
        """(first integer, the row of it and of each integer after it) covering every integer the vocabulary holds (its
        keys unmixed), from 0 when that costs little more, so the values index it as they are; ``None`` when they span
        too wide a range (:data:`DIRECT_SLACK`) or the vocabulary is empty. Built on the first :meth:`lookup_ints`."""
        if not len(self.keys):
            return None
        held = _keys.unsplitmix64(self.keys).view(np.int64)
        first, last = int(held.min()), int(held.max())
        limit = min(DIRECT_SLACK * len(held) + DIRECT_MIN, DIRECT_MAX)
        if last - first + 1 > limit:
            return None
        if 0 < first and last + 1 <= limit:
            first = 0
        table = self._oov_rows(_keys.splitmix64(np.arange(first, last + 1, dtype=np.int64).view(np.uint64)))
        table[held - first] = self.rows
        return first, table.astype(_narrowest(self.capacity + self.oov_buckets))

    @cached_property
    def _index(self) -> Any:
        """``keys`` as a pandas hash index (built on the first lookup; the keys are distinct)."""
        import pandas as pd

        return pd.Index(self.keys)


def _narrowest(rows: int) -> type[np.integer]:
    """The narrowest integer type of rows ``[0, rows)``: a direct table that fits the CPU's caches is read ~3x faster
    (bench.encoding: 26 tables of 100,000 int64 values each spilled out of L2, most of a gather's reads missing it)."""
    return np.uint16 if rows <= 1 << 16 else np.int32 if rows <= 1 << 31 else np.int64


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
    grown_from: int | None = None
    """``data.vocabulary=extend``: the rows of the trained table the new one grows (every trained id keeps its row);
    ``None`` for a refit."""

    def line(self, table: str) -> str:
        """The log line of ``table``'s carry: one a table (an extend's says how the table grew)."""
        if self.grown_from is not None:
            return (f"{table}: {self.carried} trained ids keep their rows, {self.new} new ids get fresh rows "
                    f"({self.grown_from} -> {len(self.old_rows)} rows)")
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


def grown(old: Vocabulary, new: Vocabulary) -> tuple[Vocabulary, int]:
    """``old`` grown by the ids of ``new`` it lacks (``data.vocabulary=extend``), and how many: every id of ``old`` keeps
    its row, the others take the rows after them in ``new``'s order (the most frequent first), first the rows ``old``
    reserved and left unused, then new ones; its OOV buckets stay ``old``'s, after the grown capacity."""
    added = np.setdiff1d(new.keys, old.keys, assume_unique=True)
    added = added[np.argsort(new.rows[np.searchsorted(new.keys, added)], kind="stable")]
    first = old.size if not old.size or int(old.rows.max()) == old.size - 1 else old.capacity  # ids hold rows 0..size-1
    keys = np.concatenate([old.keys, added])
    rows = np.concatenate([old.rows, np.arange(first, first + len(added), dtype=np.int64)])
    by_key = np.argsort(keys, kind="stable")
    return Vocabulary(keys[by_key], rows[by_key], max(old.capacity, first + len(added)), old.oov_buckets), len(added)
