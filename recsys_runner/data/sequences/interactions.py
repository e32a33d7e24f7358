"""An interaction log → training rows with user histories (``python -m recsys_runner.data sequences``).

The log has one event per line: a user, an item, a time, optionally a label (or a rating made 0/1 by a threshold;
without one every event is a positive, label 1) and item side columns (``category``). Each event becomes one row:
the event's ``user_id``, ``item_id`` and side columns (the candidate), its ``label`` and time ``ts``, and the user's
history — ``hist_item_id``, ``hist_<side>`` and ``hist_ts``, oldest first — made of that user's events *strictly
before* it in time, at most ``max_len`` of them (the most recent). Events at the same time as the row's own event
are not before it (nor is the event itself): a basket logged at one second never shows one of its items in another's
history, so a model cannot read an event's label-bearing item from its own history.

Rows are split by time (``--split time --eval-from T``: events at or after ``T`` are eval rows, their histories still
hold the user's earlier training events; ``--valid-from`` adds a valid window), leave-last-out or leave-two-out, one
row per event or one per user (:mod:`recsys_runner.data.sequences.splits`). A user's events are ordered by time, ties
by their ids. Ids number each table's distinct raw values in sorted order (users, items, each side column; items and
histories in one id space), so a shuffled log gives the same rows, and the mapping is written beside the rows
(:mod:`recsys_runner.data.sequences.mapping`; ``--vocab`` encodes with an earlier one). The files carry the schema in
their Parquet metadata (the form ``convert`` writes), so ``data=parquet data.path=<out>/train.parquet
data.eval_path=<out>/eval.parquet`` needs nothing else.

**Duplicate events.** Two lines of the log are the same event when they hold equal values in every column the
command reads (``--user``, ``--item``, ``--time``, ``--label`` and each ``--side``; columns it does not read never
reach a row, so they play no part). ``duplicates="drop"`` (the default) keeps the first copy in log order and drops
the rest, so the rows are those of the log without its copies; ``"fail"`` refuses the log, naming the first copy and
the line it repeats; ``"keep"`` keeps them (a later history holds every copy), and leave-last-out then holds out the
user's last event *with all its copies*, so no eval row is also a training row. An empty log (no rows: a 0-byte
file, a header line only, a Parquet file of 0 rows) is refused by name.

Where the rows go (the output folder refused when used, files staged and moved into place whole) is
:mod:`recsys_runner.data.sequences.output`.

Everything is vectorized (one sort by user and time, per-user running offsets, one gather per list column).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recsys_runner import stores
from recsys_runner.data.locate import PARQUET_SUFFIXES, resolve_files
from recsys_runner.data.schema import Schema, SparseColumn
from recsys_runner.data.schema_files import SCHEMA_METADATA_KEY, schema_json
from recsys_runner.data.sequences.mapping import (
    VOCAB_METADATA_KEY,
    EarlierVocab,
    Table,
    check_writable,
    sorted_codes,
    write_vocab,
)
from recsys_runner.data.sequences.output import StagedOutput
from recsys_runner.data.sequences.splits import (
    ROWS,
    ROWS_METADATA_KEY,
    SPLITS,
    Sorted,
    part_names,
    per_user_rows,
    sorted_layout,
    split_parts,
)
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.features import SequenceGroup

__all__ = ["DUPLICATES", "ROWS", "SPLITS", "LogSpec", "LogRows", "convert_log", "log_to_rows"]
DUPLICATES = ("drop", "keep", "fail")
"""What ``--duplicates`` does with repeated events (module docstring): drop the copies, keep them, or refuse the log."""
HISTORY_GROUP = "hist"


@dataclass(kw_only=True)
class LogSpec:
    """What the log's columns are and how rows are made of it (the command's flags)."""

    user: str = "user"
    item: str = "item"
    time: str = "timestamp"
    label: str | None = None
    """A 0/1 label column, or a rating with ``label_threshold``; ``None``: every event is a positive (label 1)."""
    label_threshold: float | None = None
    sides: list[str] = field(default_factory=list)
    """Item side columns (``category``): each becomes a candidate feature and a history ``hist_<side>``."""
    max_len: int = 50
    split: str = "leave-last-out"
    eval_from: int | None = None
    """``split="time"``: the first eval (with ``valid_from``: test) time."""
    valid_from: int | None = None
    """``split="time"``: the first valid time (before ``eval_from``); ``None``: no valid rows."""
    rows: str = "per-event"
    """``per-event``: a row per event; ``per-user``: a row per user and part (:mod:`~recsys_runner.data.sequences.splits`)."""
    duplicates: str = "drop"
    """Repeated events (equal in every column read): ``drop`` all but the first, ``keep`` them, or ``fail``."""
    vocab: str | None = None
    """An earlier output folder whose id mapping encodes this log (``--vocab``); ``None``: a new mapping."""
    oov_buckets: int = 1
    """Rows after each table's ids shared by raw ids a ``--vocab`` run has not seen (a new mapping reserves them too,
    so both outputs' tables have one size); with ``vocab`` the earlier output's number."""

    def __post_init__(self) -> None:
        if self.duplicates not in DUPLICATES:
            raise ConfigError(f"--duplicates {self.duplicates!r} must be one of {list(DUPLICATES)}")
        if self.max_len <= 0:
            raise ConfigError(f"--max-len must be positive, got {self.max_len}")
        if self.split not in SPLITS:
            raise ConfigError(f"--split {self.split!r} must be one of {list(SPLITS)}")
        if self.rows not in ROWS:
            raise ConfigError(f"--rows {self.rows!r} must be one of {list(ROWS)}")
        if self.oov_buckets < 1:
            raise ConfigError(f"--oov-buckets must be at least 1 (the rows unseen ids of a later --vocab run read), got {self.oov_buckets}")
        if self.split != "time" and (self.eval_from is not None or self.valid_from is not None):
            raise ConfigError(f"--eval-from / --valid-from apply to --split time, not --split {self.split}. Fix: drop them, or --split time")
        if self.valid_from is not None and self.eval_from is not None and self.valid_from >= self.eval_from:
            raise ConfigError(f"--valid-from {self.valid_from} must come before --eval-from {self.eval_from}: valid rows are the events in "
                              f"[valid-from, eval-from), test rows those from eval-from on")
        taken = {"user_id", "item_id", "item", "label", "ts"}
        clash = [s for s in self.sides if s in taken or f"hist_{s}" in taken]
        if clash:
            raise ConfigError(f"--side {clash[0]} names an output column or table of its own ({sorted(taken)}). Fix: rename the log's column")
        if self.split == "time" and self.eval_from is None:
            raise ConfigError("--split time needs --eval-from <time>: events at or after it are eval rows. Fix: e.g. "
                              "--eval-from 1700000000 (in the units of the time column), or --split leave-last-out")
        if self.label_threshold is not None and self.label is None:
            raise ConfigError("--label-threshold needs --label <rating column>")
        names = [self.user, self.item, self.time, *([self.label] if self.label else []), *self.sides]
        if len(set(names)) != len(names):
            raise ConfigError(f"the columns {names} (--user, --item, --time, --label, --side) repeat; each has one role")

    @property
    def columns(self) -> list[str]:
        return [self.user, self.item, self.time, *([self.label] if self.label else []), *self.sides]


def read_log(path: str, spec: LogSpec, fmt: str = "auto", delimiter: str = ",") -> tuple[pa.Table, str]:
    """The log's columns (``spec.columns``) from Parquet or delimited text (local files or object-store URIs), and a name
    for messages.

    Raises:
        DataError: no such file, a missing column (naming the columns there are), or a log without rows (naming it).
    """
    files = resolve_files(path, "the log", None)
    parquet = fmt == "parquet" or (fmt == "auto" and all(f.endswith(PARQUET_SUFFIXES) for f in files))
    where = files[0] + (f" (and {len(files) - 1} more file(s))" if len(files) > 1 else "")
    tables: list[pa.Table] = []
    empty: list[tuple[str, str]] = []
    for f in files:
        if stores.file_size(f) == 0:  # no header, no footer: nothing to name columns by, and no events
            empty.append((f, "0 bytes"))
            continue
        fs, in_fs = stores.arrow_filesystem(f)
        names = pq.read_schema(in_fs, filesystem=fs).names if parquet else _header(f, delimiter)
        missing = [c for c in spec.columns if c not in names]
        if missing:
            raise DataError(f"{f} has no column(s) {missing}; its columns are {names}. Fix: name the log's columns with --user, "
                            f"--item, --time, --label and --side")
        if parquet:
            table = pq.read_table(in_fs, columns=spec.columns, filesystem=fs)
        else:
            with stores.open_input(f) as stream:
                table = pacsv.read_csv(stream, parse_options=pacsv.ParseOptions(delimiter=delimiter),
                                       convert_options=pacsv.ConvertOptions(include_columns=spec.columns))
        if table.num_rows == 0:
            empty.append((f, "a Parquet file of 0 rows" if parquet else "a header line only"))
            continue
        tables.append(table)
    if not tables:
        which = empty[0][1] if len(empty) == 1 else "in each file: " + "; ".join(f"{f}: {what}" for f, what in empty)
        raise DataError(f"the log {where} is empty (rows: 0, {which}): there are no events to make rows of. Fix: point the command "
                        f"at the log's events (one per line: user, item, time), or check the export that wrote it")
    return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0], where


def _header(path: str, delimiter: str) -> list[str]:
    with stores.open_input(path) as f:
        return f.readline().decode("utf-8", errors="replace").rstrip("\r\n").split(delimiter)


def _no_nulls(arr: pa.ChunkedArray, column: str, where: str) -> pa.Array:
    arr = arr.combine_chunks()
    if arr.null_count:
        row = int(np.flatnonzero(np.asarray(arr.is_null().to_numpy(zero_copy_only=False)))[0])
        raise DataError(f"{where}, row {row} (0-based, header not counted): column {column!r} is missing. Fix: every event needs a "
                        f"user, an item and a time; drop such lines")
    return arr


def event_times(arr: pa.ChunkedArray, column: str, where: str) -> np.ndarray:
    """The time column as int64 (integers as they are, timestamps in seconds).

    Raises:
        DataError: a null, or a column of another type (naming it and the fix).
    """
    arr = _no_nulls(arr, column, where)
    if pa.types.is_timestamp(arr.type) or pa.types.is_date(arr.type):
        arr = arr.cast(pa.timestamp("s")).cast(pa.int64())
    if not pa.types.is_integer(arr.type):
        raise DataError(f"{where}: the time column {column!r} has type {arr.type}; event times are integers (e.g. Unix seconds) "
                        f"or timestamps. Fix: --time <an integer time column>, or convert it first")
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.int64)


def event_labels(table: pa.Table, spec: LogSpec, where: str) -> np.ndarray:
    """Each event's label (int8): the label column (0/1), a rating ``>= label_threshold``, or 1 without a label column."""
    if spec.label is None:
        return np.ones(table.num_rows, np.int8)
    arr = _no_nulls(table.column(spec.label), spec.label, where)
    if not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type)):
        raise DataError(f"{where}: the label column {spec.label!r} has type {arr.type}, not a number. Fix: --label <a 0/1 or rating column>")
    values = np.asarray(arr.cast(pa.float64()).to_numpy(zero_copy_only=False))
    if spec.label_threshold is not None:
        return (values >= spec.label_threshold).astype(np.int8)
    wrong = np.flatnonzero((values != 0) & (values != 1))
    if len(wrong):
        raise DataError(f"{where}, row {int(wrong[0])}: the label {spec.label!r} is {values[wrong[0]]:g}, not 0 or 1. Fix: a rating "
                        f"needs --label-threshold <value> (ratings >= it are positives)")
    return values.astype(np.int8)


def dense_ids(arr: pa.ChunkedArray, column: str, where: str) -> tuple[np.ndarray, pa.Array]:
    """Ids ``0 … n-1`` of a column's values numbered in sorted order (:func:`~recsys_runner.data.sequences.mapping.sorted_codes`),
    and the ``n`` distinct values in id order."""
    return sorted_codes(_no_nulls(arr, column, where))


@dataclass(frozen=True)
class Histories:
    """Events sorted by (user, time, their ids, input order) and each one's history ``[begin, end)`` in that order."""

    order: np.ndarray
    """Input row of each sorted event."""
    begin: np.ndarray
    end: np.ndarray
    last: np.ndarray
    """Whether the sorted event is its user's last one."""


def history_bounds(users: np.ndarray, times: np.ndarray, max_len: int, inclusive: bool = False,
                   ties: tuple[np.ndarray, ...] = ()) -> Histories:
    """Each event's history: the same user's events strictly before it in time (at most ``max_len``, the most recent).

    Events are sorted by user, then time, then ``ties`` (codes, the first deciding first: the event's ids, so that a
    shuffled log sorts alike), then input order. ``inclusive=True`` builds the *leaky* history (events up to and
    including the event itself): only for tests that check that the leakage check catches it.
    """
    n = len(users)
    order = np.lexsort((np.arange(n), *reversed(ties), times, users))
    u, t = users[order], times[order]
    index = np.arange(n)
    new_user = np.ones(n, bool)
    new_user[1:] = u[1:] != u[:-1]
    user_start = np.maximum.accumulate(np.where(new_user, index, 0)) if n else index
    new_time = new_user.copy()
    new_time[1:] |= t[1:] != t[:-1]
    time_start = np.maximum.accumulate(np.where(new_time, index, 0)) if n else index
    end = index + 1 if inclusive else time_start
    begin = np.maximum(user_start, end - max_len)
    last = np.ones(n, bool)
    last[:-1] = new_user[1:]
    return Histories(order, begin, end, last)


def gather_lists(values: np.ndarray, begin: np.ndarray, end: np.ndarray) -> pa.Array:
    """``[values[begin[i]:end[i]] for i]`` as an Arrow list array, in one gather."""
    lengths = (end - begin).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    index = np.repeat(begin - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    list_type = pa.ListArray if offsets[-1] < 2**31 else pa.LargeListArray
    off_type = pa.int32() if list_type is pa.ListArray else pa.int64()
    return list_type.from_arrays(pa.array(offsets, off_type), pa.array(values[index], pa.int64()))


@dataclass
class Events:
    """The log encoded: per input row its user, item and side codes (raw values numbered in sorted order: which user,
    which item), time and label; the ids the rows hold (the codes, or an earlier mapping's ids with ``--vocab``); and
    each id space's size."""

    user: np.ndarray
    item: np.ndarray
    sides: dict[str, np.ndarray]
    time: np.ndarray
    label: np.ndarray
    sizes: dict[str, int]
    """Rows of each table (``user_id``, ``item_id``, each side): its ids and the OOV rows."""
    same: np.ndarray
    """Per input row, which event it is (equal in every column read: :func:`identical_events`): copies share a number."""
    copy: np.ndarray
    """Whether the row repeats an earlier row of the log (one with the same :attr:`same`)."""
    ids: dict[str, np.ndarray]
    """Per output column (``user_id``, ``item_id``, each side), the id each input row holds."""
    ties: tuple[np.ndarray, ...]
    """What orders a user's events at one time: the codes of item, sides and raw label (:func:`history_bounds`)."""

    def take(self, rows: np.ndarray) -> Events:
        """The events of input rows ``rows`` (a mask or indices), in that order; ids and sizes unchanged."""
        return Events(self.user[rows], self.item[rows], {k: v[rows] for k, v in self.sides.items()}, self.time[rows], self.label[rows],
                      self.sizes, self.same[rows], self.copy[rows], {k: v[rows] for k, v in self.ids.items()},
                      tuple(t[rows] for t in self.ties))


@dataclass(frozen=True)
class Encoded:
    """:func:`encode_log`'s result: the events, the mapping to write (new ids: each table's raw values in id order) and,
    with ``--vocab``, per table the distinct raw ids the earlier mapping has not seen."""

    events: Events
    tables: list[Table]
    unseen: dict[str, int]


def identical_events(codes: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """For columns given as codes (equal code, equal value), per row: the number of its group of identical rows, and
    whether an earlier row (in input order) is in its group. One sort of all columns, then neighbours compared."""
    n = len(codes[0])
    order = np.lexsort((np.arange(n), *reversed(codes)))  # the last key sorts first: input order within a group
    new = np.zeros(n, bool)  # the row starts a group: the first row, or one that differs from its neighbour in any column
    new[:1] = True
    for c in codes:
        in_order = c[order]
        new[1:] |= in_order[1:] != in_order[:-1]
    same, copy = np.empty(n, np.int64), np.empty(n, bool)
    same[order] = np.cumsum(new) - 1
    copy[order] = ~new
    return same, copy


def encode_log(table: pa.Table, spec: LogSpec, where: str) -> Events:
    """Ids, times and labels of the log's events (see :func:`dense_ids`, :func:`event_times`, :func:`event_labels`), and
    which of them repeat an earlier one: equal values in every column read (:func:`identical_events` over the raw values)."""
    return encode(table, spec, where).events


def encode(table: pa.Table, spec: LogSpec, where: str, earlier: EarlierVocab | None = None) -> Encoded:
    """:func:`encode_log`, with the mapping: new ids (sorted raw values), or ``earlier``'s ids (``--vocab``)."""
    # table name, output column, log column
    spaces = [("user_id", "user_id", spec.user), ("item", "item_id", spec.item), *((s, s, s) for s in spec.sides)]
    codes, ids, sizes, tables, unseen = {}, {}, {}, [], {}
    for name, column, log_column in spaces:
        arr = _no_nulls(table.column(log_column), log_column, where)
        codes[column], values = sorted_codes(arr)
        check_writable(values, name, where)
        if earlier is None:
            ids[column], sizes[column] = codes[column], len(values) + spec.oov_buckets
        else:
            ids[column], unseen[name] = earlier.encode(name, arr, where)
            sizes[column] = earlier.size(name)
        columns = (column, f"hist_{column}") if name != "user_id" else (column,)
        tables.append(Table(name, log_column, ("item_id", "hist_item_id") if name == "item" else columns, values))
    time, label = event_times(table.column(spec.time), spec.time, where), event_labels(table, spec, where)
    raw = [dense_ids(table.column(c), c, where)[0] for c in (spec.time, *([spec.label] if spec.label else []))]  # as logged
    sides = {s: codes[s] for s in spec.sides}
    same, copy = identical_events([codes["user_id"], codes["item_id"], *sides.values(), *raw])
    ties = (codes["item_id"], *sides.values(), *raw[1:])
    events = Events(codes["user_id"], codes["item_id"], sides, time, label, sizes, same, copy, ids, ties)
    return Encoded(events, tables, unseen)


def rows_table(events: Events, h: Histories, rows: np.ndarray, bounds: tuple[np.ndarray, np.ndarray] | None = None) -> pa.Table:
    """The output rows for sorted positions ``rows``: candidate, sides, histories, time and label; each row's history
    ``[begin, end)`` of sorted positions is ``bounds``, else the event's own (:func:`history_bounds`)."""
    o = h.order
    begin, end = bounds if bounds is not None else (h.begin[rows], h.end[rows])
    ids = {k: v[o] for k, v in events.ids.items()}
    cols: dict[str, pa.Array] = {"user_id": pa.array(ids["user_id"][rows]), "item_id": pa.array(ids["item_id"][rows])}
    for side in events.sides:
        cols[side] = pa.array(ids[side][rows])
    cols["hist_item_id"] = gather_lists(ids["item_id"], begin, end)
    for side in events.sides:
        cols[f"hist_{side}"] = gather_lists(ids[side], begin, end)
    cols["hist_ts"] = gather_lists(events.time[o], begin, end)
    cols["ts"] = pa.array(events.time[o][rows])
    cols["label"] = pa.array(events.label[o][rows])
    return pa.table(cols)


def rows_schema(events: Events, spec: LogSpec) -> Schema:
    """The schema stored with the rows: ``label``; ``user_id``; ``item_id`` and ``hist_item_id`` on table ``item``; each side
    and its history on a table of the side's name; the history group ``hist`` with its timestamps ``hist_ts``."""
    sparse = [SparseColumn(name="user_id", num_embeddings=events.sizes["user_id"]),
              SparseColumn(name="item_id", num_embeddings=events.sizes["item_id"], table="item")]
    sparse += [SparseColumn(name=s, num_embeddings=events.sizes[s], table=s) for s in spec.sides]
    sparse.append(SparseColumn(name="hist_item_id", num_embeddings=events.sizes["item_id"], table="item"))
    sparse += [SparseColumn(name=f"hist_{s}", num_embeddings=events.sizes[s], table=s) for s in spec.sides]
    group = SequenceGroup(HISTORY_GROUP, ("hist_item_id", *(f"hist_{s}" for s in spec.sides)), spec.max_len, "recent", "hist_ts")
    return Schema(label="label", sparse=sparse, sequences=[group])


def part_tables(events: Events, h: Histories, spec: LogSpec) -> tuple[dict[str, pa.Table], int]:
    """Each part's rows (:func:`~recsys_runner.data.sequences.splits.split_parts`; a held-out event takes its copies
    along, so a held-out row is never also a training row), per event or per user; and the users leave-two-out leaves
    in train only (fewer than 3 events)."""
    layout: Sorted = sorted_layout(events.user[h.order], events.same[h.order])
    parts, short = split_parts(spec.split, events.time[h.order], layout, spec.eval_from, spec.valid_from)
    tables = {}
    for name, mask in parts.items():
        if spec.rows == "per-user":
            rows, begin, end = per_user_rows(mask, layout, spec.max_len)
            tables[name] = rows_table(events, h, rows, (begin, end))
        else:
            tables[name] = rows_table(events, h, np.flatnonzero(mask))
    return tables, short


@dataclass(frozen=True)
class LogRows:
    """What :func:`log_to_rows` made of a log: each part's rows (``train`` and ``eval``, or ``train``, ``valid`` and
    ``test``), their schema, the mapping, and the log's counts."""

    parts: dict[str, pa.Table]
    schema: Schema
    num_events: int
    """Lines (rows) of the log."""
    num_duplicates: int
    """Of them, copies of an earlier line (dropped with ``duplicates="drop"``, kept with ``"keep"``)."""
    tables: list[Table]
    """The mapping: each table's raw values in id order (with ``--vocab``: those of this log, not written)."""
    unseen: dict[str, int]
    """With ``--vocab``: per table, the distinct raw ids the earlier mapping has not seen (each reads an OOV row)."""
    num_short_users: int = 0
    """Leave-two-out: users with fewer than 3 events, all of whose events are training rows (no valid/test row)."""

    @property
    def train(self) -> pa.Table:
        """The training rows."""
        return self.parts["train"]

    @property
    def held(self) -> pa.Table:
        """The held-out rows of the last part: ``eval`` (or ``test``)."""
        return self.parts["eval" if "eval" in self.parts else "test"]


def log_to_rows(table: pa.Table, spec: LogSpec, where: str, earlier: EarlierVocab | None = None) -> LogRows:
    """Each part's rows and their schema (see the module docstring); ``earlier``: the mapping of ``--vocab``.

    Raises:
        DataError: duplicate events with ``duplicates="fail"`` (naming the first copy, the line it repeats and the fix), a
            split without rows (naming the split and the fix), or a bad column (see :func:`encode_log`).
    """
    encoded = encode(table, spec, where, earlier)
    events = encoded.events
    copies = int(events.copy.sum())
    if copies and spec.duplicates == "fail":
        raise DataError(duplicates_message(table, events, where))
    if copies and spec.duplicates == "drop":  # the first copy stays: ids, numbered by sorted value, do not change
        events = events.take(~events.copy)
    h = history_bounds(events.user, events.time, spec.max_len, ties=events.ties)
    parts, short = part_tables(events, h, spec)
    how = {"time": f"--split time --eval-from {spec.eval_from}" + (f" --valid-from {spec.valid_from}" if spec.valid_from is not None else ""),
           }.get(spec.split, f"--split {spec.split}")
    for name, rows in parts.items():
        if not rows.num_rows:
            fix = "an --eval-from (and --valid-from) between those times, or another --split" if spec.split == "time" else \
                "users with at least 3 events, or --split leave-last-out" if spec.split == "leave-two-out" else "another --split"
            raise DataError(f"{where}: {how} leaves no {'training' if name == 'train' else name} rows ({len(events.time)} events, times "
                            f"{int(events.time.min(initial=0))} … {int(events.time.max(initial=0))}). Fix: {fix}")
    return LogRows(parts, rows_schema(events, spec), table.num_rows, copies, encoded.tables, encoded.unseen, short)


def duplicates_message(table: pa.Table, events: Events, where: str) -> str:
    """``--duplicates fail``'s refusal: how many lines repeat an earlier one, the first of them and the line it repeats."""
    row = int(np.flatnonzero(events.copy)[0])
    first = int(np.flatnonzero(events.same == events.same[row])[0])
    values = table.slice(row, 1).to_pylist()[0]
    return (f"{where}: {int(events.copy.sum())} event(s) repeat an earlier one exactly (equal in every column read: "
            f"{list(table.column_names)}); the first is row {row}, a copy of row {first} (0-based, header not counted): {values}. "
            f"Fix: --duplicates drop to drop the copies (the default), or --duplicates keep if they are distinct events")


def write_rows(table: pa.Table, schema: Schema, path: str, row_group_rows: int = 65_536, rows: str = "per-event") -> None:
    """``table`` as a Parquet file with ``schema`` in its metadata (the form ``convert`` stores), the row kind ``rows``
    and where the mapping is (:data:`~recsys_runner.data.sequences.mapping.VOCAB_METADATA_KEY`: this folder), one row
    group at a time (a signal is taken between row groups, not only after the whole file)."""
    table = table.replace_schema_metadata({SCHEMA_METADATA_KEY: schema_json(schema), ROWS_METADATA_KEY: rows.encode(),
                                           VOCAB_METADATA_KEY: b"."})
    fs, in_fs = stores.arrow_filesystem(path)
    with pq.ParquetWriter(in_fs, table.schema, filesystem=fs) as writer:
        for start in range(0, table.num_rows, row_group_rows) or [0]:
            writer.write_table(table.slice(start, row_group_rows), row_group_size=row_group_rows)


def convert_log(path: str, output: str, spec: LogSpec, fmt: str = "auto", delimiter: str = ",", row_group_rows: int = 65_536, *,
                overwrite: bool = False, committing: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext) -> LogRows:
    """``<output>/<part>.parquet`` for each part of the split (``train``, ``eval``; or ``train``, ``valid``, ``test``)
    and the mapping (``vocab.json``, ``vocab/``: :mod:`~recsys_runner.data.sequences.mapping`) from the log at ``path``
    (a folder or an object-store prefix), staged and moved into place whole
    (:class:`~recsys_runner.data.sequences.output.StagedOutput`); the rows. With ``spec.vocab`` the earlier output's
    mapping is copied (it is the one the ids follow).

    ``overwrite``: replace an earlier output there (else it is refused, before the log is read). ``committing`` is entered
    around the move into place: the command line holds signals back there (``train.signals.deferred``).
    """
    earlier = EarlierVocab.load(spec.vocab) if spec.vocab is not None else None
    if earlier is not None:
        spec = replace(spec, oov_buckets=earlier.oov_buckets)
    staged = StagedOutput(output, overwrite)
    table, where = read_log(path, spec, fmt, delimiter)
    rows = log_to_rows(table, spec, where, earlier)
    with staged:
        for name in part_names(spec.split, spec.valid_from):
            write_rows(rows.parts[name], rows.schema, staged.file(f"{name}.parquet"), row_group_rows, spec.rows)
        if earlier is None:
            write_vocab(staged.path, rows.tables, spec.oov_buckets)
        else:
            earlier.copy_to(staged.path)
        with committing():
            staged.commit()
    return rows
