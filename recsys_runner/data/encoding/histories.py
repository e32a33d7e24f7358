"""Histories of encoded rows: each ``data.sequences`` group's lists checked for equal lengths, cut to ``max_len`` and
given their event times, after the row encoder has encoded every sparse column.

:class:`HistoryEncoder` is the step :class:`~recsys_runner.data.encoding.rows.Encoder` runs last: it reads the lists
the encoder made of a group's columns, flags rows whose lists differ in length (bad rows), keeps the most recent
``max_len`` events (or the oldest, ``truncate: oldest``) and counts such rows, and appends each group's event times.
:func:`truncate` is the cut, also applied to an item catalogue's histories
(:mod:`~recsys_runner.data.catalogue.item_files`). It is apart from the encoder because it works on whole groups of
columns after the per-column encoding; what histories in file data are, and how they cut batches, is
:mod:`recsys_runner.data.sequences`'.

**Standalone on purpose**, like :mod:`~recsys_runner.data.encoding.rows`: NumPy, PyArrow,
:mod:`~recsys_runner.data.encoding.keys` and :mod:`~recsys_runner.data.encoding.values` only, and copied into the
MLflow model's ``code/`` (:data:`~recsys_runner.data.encoding.served.SHIPPED`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING or __package__:
    from .keys import is_text, parse_int
    from .values import is_list
else:  # inside the MLflow model: the copies of keys.py and values.py beside this one in its code/ directory
    _CODE = __name__.removeprefix("recsys_histories")  # "_<hash>": this copy's code set (served.SHIPPED says why)
    _keys = importlib.import_module(f"recsys_keys{_CODE}")
    is_text, parse_int = _keys.is_text, _keys.parse_int
    is_list = importlib.import_module(f"recsys_values{_CODE}").is_list

Jagged = tuple[np.ndarray, np.ndarray]
"""One feature of a block of rows: flat values and per-row lengths."""


def not_a_list(path: str, name: str, group: Any, typ: pa.DataType, error: type[Exception] = ValueError) -> Exception:
    what = "event times (int64)" if name == group.timestamps else "ids or strings"
    return error(f"{path}: column {name!r} is in history data.sequences.{group.name} but has type {typ}, not a list. Fix: write "
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

    def __init__(self, schema: Any, error: type[Exception] = ValueError) -> None:
        self.schema, self.error = schema, error
        self.index = {c.name: j for j, c in enumerate(schema.sparse)}
        self.separators = {c.name: c.separator for c in schema.sparse}
        self.num_truncated_rows = 0

    def apply(self, table: pa.Table, sparse: list[Jagged], where: Any, bad: Callable[..., None]) -> list[Jagged]:
        """``sparse`` (one entry per ``schema.sparse`` column) with histories truncated, then each group's event times.

        Raises:
            error: a history column of a typed (Parquet) table is not a list column.
        """
        if not self.schema.sequences:
            return sparse
        out, times = list(sparse), []
        truncated = np.zeros(table.num_rows, dtype=bool)
        for group in self.schema.sequences:
            for f in group.features:
                typ = table.column(f).type
                if not (is_list(typ) or pa.types.is_null(typ) or (is_text(typ) and self.separators[f] is not None)):
                    raise not_a_list(where.path, f, group, typ, self.error)
            for f in group.features:
                self._missing_ids(f, table.column(f), self.separators[f], bad)
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
    def _check_lengths(group: Any, named: list[tuple[str, Jagged]], bad: Callable[..., None]) -> None:
        first, (_, lengths) = named[0][0], named[0][1]
        for name, (_, other) in named[1:]:
            unequal = other != lengths
            bad(name, unequal, lambda i, name=name, other=other: (
                f"its list has {int(other[i])} value(s) but {first!r} has {int(lengths[i])}: the lists of history "
                f"data.sequences.{group.name} ({', '.join(n for n, _ in named)}) describe the same events, one value per "
                f"event. Fix the row so that they have equal lengths"))

    @staticmethod
    def _missing_ids(name: str, arr: Any, separator: str | None, bad: Callable[..., None]) -> None:
        """Flag rows with a missing element inside a history feature's list (a null, an empty text, ``12||7`` in a CSV
        field): the encoder drops such an element (a multi-hot bag keeps its other ids), which in a history silently
        loses the event from that list alone, out of step with the group's other lists and times (said as their unequal
        lengths, naming another column) or, alone in its group, unsaid. An empty field or list is no history."""
        arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
        if is_text(arr.type) and separator is not None:
            arr = pc.split_pattern(pc.if_else(pc.equal(arr, ""), pa.scalar(None, arr.type), arr), separator)
        if not is_list(arr.type):
            return
        flat = pc.list_flatten(arr)
        empty = pc.equal(flat, "") if is_text(flat.type) else None
        if not flat.null_count and not (empty is not None and pc.any(empty).as_py()):
            return
        lengths = np.asarray(pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False), dtype=np.int64)
        row_of = np.repeat(np.arange(len(arr)), lengths)
        missing = ~np.asarray(flat.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        if empty is not None:
            missing |= np.asarray(pc.fill_null(empty, False).to_numpy(zero_copy_only=False), dtype=bool)
        bad(name, np.bincount(row_of[missing], minlength=len(arr)) > 0, lambda i: "an id inside the history list is missing (null or "
            "empty), so its event would drop out of this list alone. Fix: give every event of the history its id (or leave the "
            "event out of every list of the group)")

    @staticmethod
    def _oldest_first(name: str, times: Jagged, bad: Callable[..., None]) -> None:
        """Flag rows whose event times fall: a history lists its events oldest first (truncation keeps the most recent
        by position, and models read positions in order), so a newest-first list would keep its oldest events and be read
        backwards, unsaid."""
        values, lengths = times
        n = len(lengths)
        if len(values) < 2:
            return
        row_of = np.repeat(np.arange(n), lengths)
        falls = (values[1:] < values[:-1]) & (row_of[1:] == row_of[:-1])
        bad(name, np.bincount(row_of[1:][falls], minlength=n) > 0, lambda i: "its event times fall (an event earlier than the one "
            "listed before it): a history lists its events oldest first. Fix: write each history oldest event first (reverse a "
            "newest-first list)")

    def _times(self, group: Any, arr: Any, where: Any, bad: Callable[..., None]) -> Jagged:
        times = self._event_times(group, arr, where, bad)
        assert group.timestamps is not None
        self._oldest_first(group.timestamps, times, bad)
        return times

    def _event_times(self, group: Any, arr: Any, where: Any, bad: Callable[..., None]) -> Jagged:
        """The event times of ``group``: an int64 list column (or text split at the group's separator)."""
        arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
        name, n = group.timestamps, len(arr)
        assert name is not None
        separator = self.separators[group.features[0]]
        if pa.types.is_null(arr.type):
            return np.zeros(0, np.int64), np.zeros(n, np.int32)
        if is_text(arr.type) and separator is not None:
            arr = pc.split_pattern(arr, separator)
        if not is_list(arr.type):
            raise not_a_list(where.path, name, group, arr.type, self.error)
        lengths = np.asarray(pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False), dtype=np.int32)
        flat = pc.list_flatten(arr)
        row_of = np.repeat(np.arange(n), lengths)
        if flat.null_count:  # a missing time inside a list: a bad row (the element is dropped to keep the arrays aligned)
            missing = ~np.asarray(flat.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
            bad(name, np.bincount(row_of[missing], minlength=n) > 0, lambda i: "an event time inside the list is missing (null). "
                "Fix: give every event of the history a time")
            lengths = lengths - np.bincount(row_of[missing], minlength=n).astype(np.int32)
            row_of, flat = row_of[~missing], flat.drop_null()
        if is_text(flat.type):
            values, wrong = parse_int(flat)
            bad(name, np.bincount(row_of[wrong], minlength=n) > 0, lambda i: "an event time is not an integer (int64, e.g. seconds). "
                "Fix: write integer times")
            return values, lengths
        if pa.types.is_timestamp(flat.type):  # Unix seconds, a fraction floored (as python -m recsys_runner.data sequences)
            units = np.asarray(flat.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)
            return np.floor_divide(units, {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}[flat.type.unit]), lengths
        if pa.types.is_integer(flat.type):
            return np.asarray(flat.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64), lengths
        raise self.error(f"{where.path}: column {name!r} (event times of data.sequences.{group.name}) holds {flat.type}; event "
                        f"times are integers (int64, e.g. seconds). Fix: write them as list<int64>")
