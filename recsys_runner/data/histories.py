"""Histories in file data: list columns checked for equal lengths per group, truncated to ``max_len``, event times carried.

A ``data.sequences`` group names list columns (Parquet ``list<…>``; in CSV/TSV one field with the column's ``separator``
between events, oldest first) that describe the same events, so they have equal lengths in every row, and optionally
a timestamps column (int64 event times, same lengths). :class:`HistoryEncoder` runs after the
:class:`~recsys_runner.data.encoder.Encoder` has encoded every sparse column: it flags rows whose lists in one group
differ in length (bad rows), keeps the most recent ``max_len`` events of longer histories (or the oldest, ``truncate:
oldest``) and counts such rows, and appends the event times in :attr:`~recsys_runner.features.FeatureSpec.kjt_keys`
order. :func:`token_cuts` cuts a block of rows into ``data.batch_tokens`` batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_runner.data.schema import Schema
from recsys_runner.data.tokens import padded_slices, row_tokens, token_slices
from recsys_runner.errors import DataError
from recsys_runner.features import SequenceGroup

Jagged = tuple[np.ndarray, np.ndarray]
"""One feature of a block of rows: flat values and per-row lengths."""


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def check_list_columns(schema: Schema, arrow_schema: pa.Schema, path: str) -> None:
    """Every history and timestamps column of ``schema`` is a list column of the Parquet file ``path``.

    Raises:
        DataError: naming the file, the column, its type and the fix; before the first step.
    """
    for group in schema.sequences:
        for name in [*group.features, *([group.timestamps] if group.timestamps else [])]:
            if name in arrow_schema.names and not _is_list(arrow_schema.field(name).type):
                raise not_a_list(path, name, group, arrow_schema.field(name).type)


def not_a_list(path: str, name: str, group: SequenceGroup, typ: pa.DataType) -> DataError:
    what = "event times (int64)" if name == group.timestamps else "ids or strings"
    return DataError(f"{path}: column {name!r} is in history data.sequences.{group.name} but has type {typ}, not a list. Fix: write "
                     f"it as a list column of {what}, oldest event first (an empty list or null for no history), e.g. with "
                     f"python -m recsys_runner.data sequences; or remove it from data.sequences.{group.name}")


def truncate(values: np.ndarray, lengths: np.ndarray, max_len: int, keep: str) -> Jagged:
    """Each row's list cut to ``max_len`` values: its last (``keep="recent"``) or first (``"oldest"``) ones."""
    if not len(lengths) or int(lengths.max()) <= max_len:
        return values, lengths
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    position = np.arange(len(values), dtype=np.int64) - np.repeat(starts, lengths)
    row_length = np.repeat(lengths, lengths).astype(np.int64)
    kept = position >= row_length - max_len if keep == "recent" else position < max_len
    return values[kept], np.minimum(lengths, max_len).astype(lengths.dtype)


class HistoryEncoder:
    """Checks, truncates and completes the histories of encoded rows (see the module docstring).

    ``num_truncated_rows`` counts rows with a history longer than its group's ``max_len``.
    """

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.index = {c.name: j for j, c in enumerate(schema.sparse)}
        self.separators = {c.name: c.separator for c in schema.sparse}
        self.num_truncated_rows = 0

    def apply(self, table: pa.Table, sparse: list[Jagged], where: Any, bad: Callable[..., None]) -> list[Jagged]:
        """``sparse`` (one entry per ``schema.sparse`` column) with histories truncated, then each group's event times.

        Raises:
            DataError: a history column of a typed (Parquet) table is not a list column.
        """
        if not self.schema.sequences:
            return sparse
        out, times = list(sparse), []
        truncated = np.zeros(table.num_rows, dtype=bool)
        for group in self.schema.sequences:
            for f in group.features:
                typ = table.column(f).type
                if not (_is_list(typ) or pa.types.is_null(typ) or (_is_text(typ) and self.separators[f] is not None)):
                    raise not_a_list(where.path, f, group, typ)
            named = [(f, out[self.index[f]]) for f in group.features]
            if group.timestamps is not None:
                named.append((group.timestamps, self._times(group, table.column(group.timestamps), where, bad)))
            self._check_lengths(group, named, bad)
            for name, (values, lengths) in named:
                truncated |= lengths > group.max_len
                cut = truncate(values, lengths, group.max_len, group.truncate)
                if name == group.timestamps:
                    times.append(cut)
                else:
                    out[self.index[name]] = cut
        self.num_truncated_rows += int(truncated.sum())
        return out + times

    @staticmethod
    def _check_lengths(group: SequenceGroup, named: list[tuple[str, Jagged]], bad: Callable[..., None]) -> None:
        first, (_, lengths) = named[0][0], named[0][1]
        for name, (_, other) in named[1:]:
            unequal = other != lengths
            bad(name, unequal, lambda i, name=name, other=other: (
                f"its list has {int(other[i])} value(s) but {first!r} has {int(lengths[i])}: the lists of history "
                f"data.sequences.{group.name} ({', '.join(n for n, _ in named)}) describe the same events, one value per "
                f"event. Fix the row so that they have equal lengths"))

    def _times(self, group: SequenceGroup, arr: Any, where: Any, bad: Callable[..., None]) -> Jagged:
        """The event times of ``group``: an int64 list column (or text split at the group's separator)."""
        arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
        name, n = group.timestamps, len(arr)
        assert name is not None
        separator = self.separators[group.features[0]]
        if pa.types.is_null(arr.type):
            return np.zeros(0, np.int64), np.zeros(n, np.int32)
        if _is_text(arr.type) and separator is not None:
            arr = pc.split_pattern(arr, separator)
        if not _is_list(arr.type):
            raise not_a_list(where.path, name, group, arr.type)
        lengths = np.asarray(pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False), dtype=np.int32)
        flat = pc.list_flatten(arr)
        row_of = np.repeat(np.arange(n), lengths)
        if flat.null_count:  # a missing time inside a list: a bad row (the element is dropped to keep the arrays aligned)
            missing = ~np.asarray(flat.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
            bad(name, np.bincount(row_of[missing], minlength=n) > 0, lambda i: "an event time inside the list is missing (null). "
                "Fix: give every event of the history a time")
            lengths = lengths - np.bincount(row_of[missing], minlength=n).astype(np.int32)
            row_of, flat = row_of[~missing], flat.drop_null()
        if _is_text(flat.type):
            values, wrong = _parse_times(flat)
            bad(name, np.bincount(row_of[wrong], minlength=n) > 0, lambda i: "an event time is not an integer (int64, e.g. seconds). "
                "Fix: write integer times")
            return values, lengths
        if pa.types.is_integer(flat.type) or pa.types.is_timestamp(flat.type):
            return np.asarray(flat.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64), lengths
        raise DataError(f"{where.path}: column {name!r} (event times of data.sequences.{group.name}) holds {flat.type}; event "
                        f"times are integers (int64, e.g. seconds). Fix: write them as list<int64>")


def _parse_times(flat: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Decimal integer strings → int64 and a mask of those that are not integers."""
    try:
        return np.asarray(flat.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64), np.zeros(len(flat), bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        values, wrong = np.zeros(len(flat), np.int64), np.zeros(len(flat), bool)
        for i, text in enumerate(flat.to_pylist()):
            try:
                values[i] = int(text)
            except (ValueError, OverflowError):
                wrong[i] = True
        return values, wrong


def history_costs(schema: Schema, sparse: list[Jagged]) -> np.ndarray:
    """Each row's tokens (:func:`~recsys_runner.data.tokens.row_tokens`): the lengths of each group's first feature, summed."""
    index = {c.name: j for j, c in enumerate(schema.sparse)}
    lengths = sum(sparse[index[g.features[0]]][1].astype(np.int64) for g in schema.sequences)
    return row_tokens(np.asarray(lengths))


def token_cuts(costs: np.ndarray, budget: int, final: bool, padded: bool = False) -> tuple[list[tuple[int, int]], int]:
    """Batches of ``budget`` tokens over a block of rows with ``costs``, and how many rows they use; ``padded``: each
    batch's rows × its largest cost within the budget (:func:`~recsys_runner.data.tokens.padded_slices`, for rows
    sorted by cost).

    Until the ``final`` block the last (possibly under-full) slice is held back for the next rows.
    """
    slices = padded_slices(costs, budget) if padded else token_slices(costs, budget)
    if not final and slices:
        slices = slices[:-1]
    return slices, (slices[-1][1] if slices else 0)


def expected_rows(sample: pa.Table, schema: Schema, batch_tokens: int) -> int:
    """Rows a ``batch_tokens`` batch holds on average, from the history lengths of a sample of the training rows: the
    data module's ``batch_size`` (the sharding planner's cost model reads it)."""
    total = np.zeros(sample.num_rows, np.int64)
    for group in schema.sequences:
        name = group.features[0]
        arr = sample.column(name).combine_chunks()
        separator = next(c.separator for c in schema.sparse if c.name == name)
        if _is_text(arr.type) and separator is not None:
            arr = pc.split_pattern(arr, separator)
        if _is_list(arr.type):
            lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
            total += np.minimum(np.asarray(lengths, np.int64), group.max_len)
    mean_cost = float(row_tokens(total).mean()) if len(total) else 1.0
    return max(1, int(batch_tokens / mean_cost))
