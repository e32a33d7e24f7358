"""The vectorized encoder from Arrow columns of raw values to model inputs, checking every row — shared by training
and serving.

:class:`Encoder` turns one Arrow table of raw columns into :class:`~recsys_runner.data.encoding.encoded_rows.Rows` (NumPy
arrays) by a schema (a :class:`~recsys_runner.data.schema.Schema`, or the plain objects the served model builds from
``encoders.json``) and checks every row; a bad row either raises the encoder's ``error`` naming the file, row and column
(:class:`Location`), or is skipped and counted (``on_bad_rows: skip``). This module reads the sparse columns' values
into bags (lists, separators, nulls, ``max_values``, crosses) and keeps the bad-row bookkeeping; the ids of a flat array
of values by the column's encoding, and what a value that is no id is told, are
:mod:`~recsys_runner.data.encoding.sparse_ids`'. Labels and dense features are read as numbers by
:mod:`~recsys_runner.data.encoding.number_columns`, a weighted entry's weights by
:mod:`~recsys_runner.data.encoding.sparse_weights`, and histories are checked, truncated and given their event times by
:class:`~recsys_runner.data.encoding.histories.HistoryEncoder`. The stable keys of values (hashes, crosses) and the
hex/decimal parsing of ids are :mod:`~recsys_runner.data.encoding.keys`'s; numbers, bucket ids, vocabulary rows and
``id:weight`` pairs read from one flat array of values are :mod:`~recsys_runner.data.encoding.values`'.

**Standalone on purpose.** This module imports NumPy, PyArrow, :mod:`~recsys_runner.data.encoding.keys`,
:mod:`~recsys_runner.data.encoding.values`, :mod:`~recsys_runner.data.encoding.histories`,
:mod:`~recsys_runner.data.encoding.number_columns`, :mod:`~recsys_runner.data.encoding.sparse_ids`,
:mod:`~recsys_runner.data.encoding.sparse_weights` and :mod:`~recsys_runner.data.encoding.encoded_rows` only: the MLflow
model that ``export`` writes carries a copy of it (with those seven, :mod:`~recsys_runner.data.encoding.vocabulary` and
the ``served`` modules: :data:`~recsys_runner.data.encoding.served.SHIPPED`), so a server turns raw rows into exactly
the ids training used without recsys_runner, TorchRec or fbgemm installed. The schema is read by attribute
(duck-typed), never imported; training passes ``error=DataError``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING or __package__:
    from .encoded_rows import Rows
    from .histories import HistoryEncoder, truncate
    from .keys import cross_keys, is_text, raw_keys
    from .number_columns import dense_values, label_values
    from .sparse_ids import bad_id, flat_ids, float_ids, not_a_number
    from .sparse_weights import pair_weights, parallel_weights
    from .values import bucket_ids, combined, is_list, parse_numbers
else:  # inside the MLflow model: the copies of the modules it imports beside this one in its code/ directory
    _CODE = __name__.removeprefix("recsys_rows")  # "_<hash>": this copy's code set (served.SHIPPED says why)
    Rows = importlib.import_module(f"recsys_encoded_rows{_CODE}").Rows
    _histories = importlib.import_module(f"recsys_histories{_CODE}")
    HistoryEncoder, truncate = _histories.HistoryEncoder, _histories.truncate
    _keys = importlib.import_module(f"recsys_keys{_CODE}")
    cross_keys, is_text, raw_keys = _keys.cross_keys, _keys.is_text, _keys.raw_keys
    _numbers = importlib.import_module(f"recsys_number_columns{_CODE}")
    dense_values, label_values = _numbers.dense_values, _numbers.label_values
    _sparse_ids = importlib.import_module(f"recsys_sparse_ids{_CODE}")
    bad_id, flat_ids, float_ids, not_a_number = _sparse_ids.bad_id, _sparse_ids.flat_ids, _sparse_ids.float_ids, _sparse_ids.not_a_number
    _weights = importlib.import_module(f"recsys_sparse_weights{_CODE}")
    pair_weights, parallel_weights = _weights.pair_weights, _weights.parallel_weights
    _values = importlib.import_module(f"recsys_values{_CODE}")
    bucket_ids, combined, is_list, parse_numbers = _values.bucket_ids, _values.combined, _values.is_list, _values.parse_numbers

BAD_ROW_MODES = ("fail", "skip")
"""``data.on_bad_rows``: ``fail`` stops at the first bad row, ``skip`` drops and counts bad rows."""


@dataclass(frozen=True)
class Location:
    """Where a block of rows came from, for error messages: ``describe(i)`` names row ``i``."""

    path: str
    part: str
    """e.g. ``row group 3`` or ``lines 1-65536``."""
    file_rows: np.ndarray
    """0-based row number in the file of each row of the block."""
    line_offset: int | None = None
    """For text files: line number = file row + this (1-based, header counted); ``None`` for Parquet."""
    column_files: Mapping[str, str] | None = None
    """Where the columns of a row lie in files of their own (a day of TorchRec's ``.npy`` files: labels, dense, sparse),
    each column's file, so that a bad value names the file that holds it; ``None``: every column is in :attr:`path`."""

    def file_of(self, column: str | None) -> str:
        """The file that holds ``column`` (:attr:`path` unless :attr:`column_files` names another)."""
        return self.column_files.get(column, self.path) if self.column_files and column is not None else self.path

    def describe(self, i: int, column: str | None = None) -> str:
        """Row ``i`` of the block, in the file that holds ``column`` (the file's line for text)."""
        row, path = int(self.file_rows[i]), self.file_of(column)
        if self.line_offset is not None:
            return f"{path}, line {row + self.line_offset}"
        return f"{path}, {self.part}, row {row} of the file"


class Encoder:
    """Turns Arrow tables of raw columns into :class:`~recsys_runner.data.encoding.encoded_rows.Rows`, checking every row.

    Args:
        schema: the columns and how to encode them.
        on_bad_rows: ``fail`` raises ``error`` at the first bad row; ``skip`` drops bad
            rows and counts them in ``num_bad_rows``.
        error: the exception a bad row raises (training: :class:`~recsys_runner.errors.DataError`).
        required: single-valued sparse columns every row must have a value in, each with why (the end of the bad row's
            message): a next-item model's candidate column when it trains or evaluates, the item that came next, whose
            null an empty bag would read as item ``0``. Empty (the default): a null is an empty bag, as predict's top-k
            rows leave the candidate null.
        funnel: label tasks (of ``schema.labels``) that form a funnel, in order (``data.funnel``): a row whose later
            label is positive where the one before it is not (a conversion without a click) is a bad row, ``funnel_why``
            ending its message. Empty (the default): unchecked.

    Histories (``schema.sequences``) are checked and truncated by a :class:`~recsys_runner.data.encoding.histories.HistoryEncoder`;
    ``num_truncated_rows`` counts the rows whose history was longer than its ``max_len``.
    """

    fix = "Fix the data, or set data.on_bad_rows=skip to skip such rows (they are counted and logged)"
    """What a bad row's message ends with (the served model says how to fix a request instead)."""
    settings_fixes = True
    """Whether a bad value's message also names the training setting that would take it (``data.sparse[c].num_embeddings``):
    a fix for whoever trains, not for a client of the served model, whose model is fixed."""

    def __init__(self, schema: Any, on_bad_rows: str = "fail", error: type[Exception] = ValueError,
                 required: dict[str, str] | None = None, funnel: tuple[str, ...] = (), funnel_why: str = "") -> None:
        self.schema, self.error = schema, error
        self.required = required or {}
        self.funnel, self.funnel_why = funnel, funnel_why
        self.skip = on_bad_rows == "skip"
        self.num_bad_rows = 0
        self.histories = HistoryEncoder(schema, error)
        self.oov: dict[str, list[int]] = {c.name: [0, 0] for c in schema.sparse if c.encoding == "vocab"}
        """Per ``encoding: vocab`` column: values that read an OOV row (unseen when the vocabulary was fitted), and values."""
        self.capped: dict[str, list[int]] = {c.name: [0, 0] for c in schema.sparse if getattr(c, "max_values", None) is not None}
        """Per column with ``max_values``: rows whose list was cut to it, and the longest list seen."""

    def capped_line(self) -> str | None:
        """One log line of the rows whose lists were cut to their column's ``max_values`` (:attr:`capped`), or ``None``
        when none was: for the readers that log no ``data/truncated_lists`` (predict, the item catalogue), so that a cut
        is never silent."""
        caps = {c.name: getattr(c, "max_values", None) for c in self.schema.sparse}
        shown = [f"data.sparse[{name}] in {cut} rows (max_values={caps[name]}, the longest list {longest})"
                 for name, (cut, longest) in self.capped.items() if cut]
        return f"lists longer than max_values were cut to their first values: {', '.join(shown)}" if shown else None

    @property
    def num_truncated_rows(self) -> int:
        return self.histories.num_truncated_rows

    def encode(self, table: pa.Table, where: Location) -> Rows:
        return self.encode_kept(table, where)[0]

    def encode_kept(self, table: pa.Table, where: Location) -> tuple[Rows, np.ndarray | None]:
        """:meth:`encode`, and which rows of ``table`` it kept (``None``: all): each row's place in its file, for downsampling."""
        n = table.num_rows
        problems: list[tuple[str, str, np.ndarray, Callable[[int], str]]] = []

        def bad(column: str, mask: np.ndarray, what: Callable[[int], str]) -> None:
            if mask.any():
                problems.append((column, "", mask, what))

        labels = self._label(table, where, bad)
        if self.funnel:
            self._funnel(labels, bad)
        dense = np.empty((n, len(self.schema.dense)), dtype=np.float32)
        for j, col in enumerate(self.schema.dense):
            dense[:, j] = self._dense(col, _column(table, col.name), where, bad)
        bags = [self._bag(col, table, where, bad) for col in self.schema.sparse]
        for col, (_, lengths, _) in zip(self.schema.sparse, bags, strict=True):
            if col.name in self.required:
                bad(col.name, lengths == 0, self._missing(self.required[col.name]))
        sparse = self.histories.apply(table, [(ids, lengths) for ids, lengths, _ in bags], where, bad)
        weights = [w for _, _, w in bags]
        rows = Rows(labels, dense, sparse, weights + [None] * (len(sparse) - len(weights)) if any(w is not None for w in weights) else None)
        if not problems:
            return rows, None
        first = min(int(np.flatnonzero(mask)[0]) for _, _, mask, _ in problems)
        if not self.skip:
            column, _, _, what = next(p for p in problems if p[2][first])
            raise self.error(
                f"bad row in {where.describe(first, column)}, column {column!r}: {what(first)}. {self.fix}"
            )
        keep = ~np.logical_or.reduce([mask for _, _, mask, _ in problems])
        self.num_bad_rows += int(n - keep.sum())
        kept = np.flatnonzero(keep)
        return rows.take(kept), kept

    @staticmethod
    def _missing(why: str) -> Callable[[int], str]:
        """What a row missing a ``required`` column's value is told (``why``: the reason it needs one)."""
        return lambda _: f"it is missing (null or empty): {why}"

    # -- label --------------------------------------------------------------------------------------
    def _funnel(self, labels: np.ndarray, bad) -> None:
        """Each later task of :attr:`funnel` positive only where the one before it is, over the block at once (``labels
        [n, T]``; a label already bad reads 0, so its row is named for that)."""
        tasks, columns = list(self.schema.label_tasks), list(self.schema.label_columns)
        for before, after in zip(self.funnel[:-1], self.funnel[1:], strict=True):
            i, j = tasks.index(before), tasks.index(after)
            broken = (labels[:, j] > 0) & (labels[:, i] <= 0)
            bad(columns[j], broken, lambda r, before=before, after=after, i=i, j=j: (
                f"the label of task {after!r} is {labels[r, j]:g} where the label of task {before!r} before it (column "
                f"{columns[i]!r}) is {labels[r, i]:g}, but data.funnel={list(self.funnel)} has each later label positive only "
                f"on rows where the one before it is{self.funnel_why}"))

    def _label(self, table: pa.Table, where: Location, bad) -> np.ndarray:
        schema = self.schema
        columns = [label_values(table, column, task, schema.label_kind(task), schema.labels is not None, where, bad, self.error,
                                schema.label_threshold)
                   for column, task in zip(schema.label_columns, schema.label_tasks, strict=True)]
        return columns[0] if schema.labels is None else np.stack(columns, axis=1)

    # -- dense --------------------------------------------------------------------------------------
    def _dense(self, col: Any, arr: pa.ChunkedArray | pa.Array, where: Location, bad) -> np.ndarray:
        """Dense column ``col`` as the model reads it (:func:`~recsys_runner.data.encoding.number_columns.dense_values`)."""
        return dense_values(col, arr, where, bad, self.error)

    # -- sparse -------------------------------------------------------------------------------------
    def _bag(self, col: Any, table: pa.Table, where: Location, bad) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """A sparse entry of ``table``'s rows: (ids, lengths, and the float32 weight of each id for a weighted entry, else
        ``None``); a cross reads its crossed columns, a ``weights`` entry its weights column too."""
        if getattr(col, "cross", None):  # getattr: documents written before these fields were stored lack them
            return (*self._cross(col, table, where), None)
        weights = getattr(col, "weights", None)
        bag = self._jagged(col, _column(table, col.name), where, bad, None if weights is None else _column(table, weights))
        cap = getattr(col, "max_values", None)
        return bag if cap is None else self._capped(col.name, cap, *bag)

    def _capped(self, name: str, cap: int, ids: np.ndarray, lengths: np.ndarray,
                weights: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """A bag cut to its first ``cap`` values per row (``max_values``), its weights alike; counted in :attr:`capped`."""
        counts = self.capped[name]
        if len(lengths):
            counts[0] += int((lengths > cap).sum())
            counts[1] = max(counts[1], int(lengths.max()))
        cut, cut_lengths = truncate(ids, lengths, cap, "oldest")
        return cut, cut_lengths, None if weights is None else truncate(weights, lengths, cap, "oldest")[0]

    def _sparse(self, col: Any, arr: pa.ChunkedArray | pa.Array, where: Location, bad) -> tuple[np.ndarray, np.ndarray]:
        """One sparse column's (ids, lengths), its weights (if any) left out."""
        ids, lengths, _ = self._jagged(col, arr, where, bad)
        return ids, lengths

    def _jagged(self, col: Any, arr: pa.ChunkedArray | pa.Array, where: Location, bad,
                weights_arr: pa.ChunkedArray | pa.Array | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        arr = combined(arr)
        n = len(arr)
        pairs = bool(getattr(col, "weighted", False))
        weighted = pairs or weights_arr is not None
        listed = col.separator is not None or pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)
        if col.encoding == "bucketize" and not listed:
            return (*self._buckets(col, arr, bad), None)
        if col.encoding == "vocab" and not (listed or weighted or col.hex) and arr.type == pa.int64():
            return (*self._vocab_int64(col, arr), None)
        if pa.types.is_null(arr.type):
            lengths = np.zeros(n, dtype=np.int32)
            if weights_arr is not None:
                parallel_weights(col, weights_arr, lengths, where, bad, self.error)
            return np.zeros(0, dtype=np.int64), lengths, np.zeros(0, np.float32) if weighted else None
        if col.separator is not None and (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
            arr = pc.split_pattern(arr, col.separator)
        if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
            lengths = np.asarray(pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False), dtype=np.int32)
            flat = pc.list_flatten(arr)
            if is_text(flat.type) and len(flat):  # an empty element ("a||b", a list's ""): missing, dropped as fitting drops it
                flat = pc.if_else(pc.equal(flat, ""), pa.scalar(None, flat.type), flat)
            row_of = np.repeat(np.arange(n), lengths)
        else:
            lengths = np.where(np.asarray(arr.is_valid().to_numpy(zero_copy_only=False)), 1, 0).astype(np.int32)
            flat = arr.drop_null() if arr.null_count else arr
            row_of = np.flatnonzero(lengths) if arr.null_count else np.arange(n)
        weights = None if weights_arr is None else parallel_weights(col, weights_arr, lengths, where, bad, self.error)
        if flat.null_count:  # a null inside a list: drop the element, keep the row
            valid = np.asarray(flat.is_valid().to_numpy(zero_copy_only=False))
            lengths = lengths - np.bincount(row_of[~valid], minlength=n).astype(np.int32)
            row_of = row_of[valid]
            flat = flat.drop_null()
            weights = None if weights is None else weights[valid]
        if pairs:
            flat, weights = pair_weights(col, flat, row_of, n, where, bad, self.error)
        if pa.types.is_floating(flat.type) and col.encoding != "bucketize":
            raise self.error(f"{where.file_of(col.name)}, {where.part}: {float_ids(col, flat.type)}")
        ids, wrong = self._ids(col, flat)
        row_bad = np.zeros(n, dtype=bool)
        if wrong is not None and wrong.any():
            row_bad[row_of[wrong]] = True
            first_bad = {}
            for k in np.flatnonzero(wrong)[:1]:
                first_bad[int(row_of[k])] = flat[int(k)].as_py()
            # settings_fixes: a served model's client gets what is wrong, not how to train another model
            bad(col.name, row_bad, lambda i: bad_id(col, first_bad.get(i), self.settings_fixes))
            ids = np.where(wrong, 0, ids)
        return ids, lengths, weights

    def _cross(self, col: Any, table: pa.Table, where: Location) -> tuple[np.ndarray, np.ndarray]:
        """A cross's ids: per row, the keys of its crossed columns' raw values mixed in order (:func:`cross_keys`) and taken
        modulo ``num_embeddings``; a row missing any value gets an empty bag.

        Raises:
            error: a crossed column is a list column, or of a type whose values cannot be keyed.
        """
        n = table.num_rows
        keys, present = [], np.ones(n, bool)
        for name in col.cross:
            arr = combined(_column(table, name))
            valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool) if arr.null_count else np.ones(n, bool)
            part = np.zeros(n, np.uint64)
            if is_list(arr.type):
                raise self.error(f"{where.path}: column {name!r}, crossed by data.sparse[{col.name}], is a list column ({arr.type}); a cross "
                                 f"combines one value per row. Fix: cross single-valued columns")
            if not pa.types.is_null(arr.type):
                values, ok = raw_keys(arr.drop_null() if arr.null_count else arr)
                if ok is None:
                    raise self.error(f"{where.path}: column {name!r}, crossed by data.sparse[{col.name}], has type {arr.type}, whose "
                                     f"values cannot be crossed. Fix: cross text, integer, boolean or float columns")
                part[valid] = values
                valid[valid] = ok
            present &= valid
            keys.append(part)
        ids = (cross_keys(keys)[present] % np.uint64(col.size)).astype(np.int64)
        return ids, present.astype(np.int32)

    def _buckets(self, col: Any, arr: pa.Array, bad) -> tuple[np.ndarray, np.ndarray]:
        """A single-valued ``encoding: bucketize`` column: one id per row, a missing value reading bucket ``0``."""
        n = len(arr)
        valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool) if arr.null_count else np.ones(n, bool)
        numbers, wrong = np.zeros(n, np.float64), np.zeros(n, bool)
        numbers[valid], wrong[valid] = parse_numbers(arr.drop_null() if arr.null_count else arr)
        bad(col.name, wrong, lambda i: not_a_number(repr(arr[i].as_py()), col, self.settings_fixes))
        return bucket_ids(col, numbers, wrong), np.ones(n, dtype=np.int32)

    def _vocabulary(self, col: Any) -> Any:
        vocabulary = self.schema.vocabularies.get(col.name)
        assert vocabulary is not None, f"data.sparse[{col.name}] (encoding=vocab) has no vocabulary: build its schema with complete_schema"
        return vocabulary

    def _count_oov(self, col: Any, vocabulary: Any, ids: np.ndarray) -> None:
        counted = self.oov[col.name]
        counted[0] += int(np.count_nonzero(ids >= vocabulary.capacity))
        counted[1] += len(ids)

    def _vocab_int64(self, col: Any, arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """A single-valued int64 ``encoding: vocab`` column's (ids, lengths): the rows are gathered from the values as the
        file holds them, nulls' slots included, and the nulls dropped from the gathered rows, so the gather is the only
        pass over the values (no int64 value is a bad one)."""
        n = len(arr)
        values = np.frombuffer(arr.buffers()[1], dtype=np.int64, count=n, offset=arr.offset * 8) if n else np.zeros(0, np.int64)
        present = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool) if arr.null_count else None
        vocabulary = self._vocabulary(col)
        ids = vocabulary.lookup_ints(values, present)
        self._count_oov(col, vocabulary, ids)
        return ids, np.ones(n, np.int32) if present is None else present.astype(np.int32)

    def _ids(self, col: Any, flat: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
        """Encode a flat array of values to ids (:func:`~recsys_runner.data.encoding.sparse_ids.flat_ids`); also a mask of
        values that cannot be encoded. A vocabulary's OOV values are counted in :attr:`oov`."""
        vocabulary = self._vocabulary(col) if col.encoding == "vocab" else None
        ids, wrong = flat_ids(col, flat, vocabulary)
        if vocabulary is not None:
            self._count_oov(col, vocabulary, ids if wrong is None else ids[~wrong])
        return ids, wrong


def _column(table: pa.Table, name: str) -> pa.ChunkedArray:
    return table.column(name)

