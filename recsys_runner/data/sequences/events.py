"""An interaction log read and encoded: the columns it names, each event's ids, time and label, and its repeated lines.

:func:`read_log` reads the columns the command names (:class:`LogSpec`: ``--user``, ``--item``, ``--time``,
``--label``, ``--side``) from Parquet or delimited text, local or in an object store, and refuses a log without rows
by name, and a text log whose id columns Arrow's type inference would merge (``--ids-as-text`` reads them as text:
:mod:`~recsys_runner.data.sequences.text_ids`). :func:`encode` numbers each table's distinct raw values in sorted order (or encodes them with an earlier
output's mapping, ``--vocab``), reads the times as integers and the labels as 0/1, and marks each line that repeats
an earlier one exactly (:func:`identical_events`): :class:`Events`, one entry per line of the log.

A room of its own below :mod:`recsys_runner.data.sequences.interactions`: reading and encoding a log builds no history
and writes nothing, and the rows with histories are made from :class:`Events` alone, so ``interactions`` imports this
module, never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recsys_runner import stores
from recsys_runner.data.locate import PARQUET_SUFFIXES, resolve_files
from recsys_runner.data.sequences import text_ids
from recsys_runner.data.sequences.mapping import EarlierVocab, Table, check_writable, sorted_codes
from recsys_runner.data.sequences.splits import ROWS, SPLITS
from recsys_runner.errors import ConfigError, DataError

__all__ = ["DUPLICATES", "LogSpec"]
DUPLICATES = ("drop", "keep", "fail")
"""What ``--duplicates`` does with repeated events (:mod:`~recsys_runner.data.sequences.interactions`): drop the
copies, keep them, or refuse the log."""


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
    column_names: list[str] | None = None
    """The names of a text log's columns in file order (``--column-names``), for a log without a header line (MovieLens'
    ``u.data``, ``ratings.dat`` once its ``::`` are tabs): every line is then an event. ``None``: the first line names them."""
    vocab: str | None = None
    """An earlier output folder whose id mapping encodes this log (``--vocab``); ``None``: a new mapping."""
    ids_as_text: bool | None = None
    """Read the id columns (user, item, sides) as text (``--ids-as-text``; :mod:`~recsys_runner.data.sequences.text_ids`);
    ``False``: as Arrow infers them, refused where that loses an id; ``None``: the earlier mapping's with ``vocab``, else
    ``False``."""
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
        if self.column_names is not None:
            repeated = sorted({c for c in self.column_names if self.column_names.count(c) > 1})
            if repeated or not all(self.column_names):
                raise ConfigError(f"--column-names {','.join(self.column_names)} names {'the column ' + repr(repeated[0]) + ' twice' if repeated else 'a column with no name'}"
                                  f": each column of the log has one name. Fix: one distinct name per column, in file order")
            if unnamed := [c for c in names if c not in self.column_names]:
                raise ConfigError(f"--column-names {','.join(self.column_names)} lacks {unnamed}, which --user, --item, --time, --label "
                                  f"or --side read. Fix: name the log's columns in file order and give those names to the flags")

    @property
    def columns(self) -> list[str]:
        return [self.user, self.item, self.time, *([self.label] if self.label else []), *self.sides]

    @property
    def id_roles(self) -> dict[str, str]:
        """Each id column (the ones numbered into a table) → its flag, for messages."""
        return {self.user: "--user", self.item: "--item", **dict.fromkeys(self.sides, "--side")}


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
    read: list[str] = []
    empty: list[tuple[str, str]] = []
    for f in files:
        if stores.file_size(f) == 0:  # no header, no footer: nothing to name columns by, and no events
            empty.append((f, "0 bytes"))
            continue
        fs, in_fs = stores.arrow_filesystem(f)
        if parquet and spec.column_names is not None:
            raise ConfigError(f"--column-names names the columns of a text log without a header line, but {f} is Parquet, which "
                              f"names its own ({pq.read_schema(in_fs, filesystem=fs).names}). Fix: drop --column-names")
        first = [] if parquet else _header(f, delimiter)
        names = pq.read_schema(in_fs, filesystem=fs).names if parquet else spec.column_names or first
        if spec.column_names is not None and first == spec.column_names:
            raise DataError(f"{f} has a header line ({delimiter.join(first)}), but --column-names reads every line as an event. Fix: "
                            f"drop --column-names (the header names the columns)")
        if spec.column_names is not None and len(first) != len(names):
            raise DataError(f"{f}: its first line {delimiter.join(first)[:100]!r} splits into {len(first)} field(s) by --delimiter "
                            f"{delimiter!r}, but --column-names names {len(names)} columns {names}.{_layout_fix(first, delimiter)}")
        missing = [c for c in spec.columns if c not in names]
        if missing:
            raise DataError(f"{f} has no column(s) {missing}; its columns are {names}."
                            + (_layout_fix(first, delimiter) or " Fix: name the log's columns with --user, --item, --time, --label and --side"))
        ids = list(spec.id_roles)
        if parquet:
            table = pq.read_table(in_fs, columns=spec.columns, filesystem=fs)
        else:
            with stores.open_input(f) as stream:
                text = dict.fromkeys(ids, pa.string()) if spec.ids_as_text else {}
                table = pacsv.read_csv(stream, read_options=pacsv.ReadOptions(column_names=spec.column_names),
                                       parse_options=pacsv.ParseOptions(delimiter=delimiter),
                                       convert_options=pacsv.ConvertOptions(include_columns=spec.columns, column_types=text))
            inferred = [] if spec.ids_as_text else text_ids.inferred_id_columns(table, ids)
            if inferred and table.num_rows:  # the raw text of ids read as numbers (or dates): lost in the reading?
                raw = text_ids.read_text_columns(f, delimiter, inferred, spec.column_names)
                text_ids.check_lossless(table, raw, f, spec.id_roles)
        table = _plain_columns(table)
        if spec.ids_as_text:
            table = text_ids.as_text(table, ids)
        if table.num_rows == 0:
            empty.append((f, "a Parquet file of 0 rows" if parquet else "a header line only"))
            continue
        tables.append(table)
        read.append(f)
    if not tables:
        which = empty[0][1] if len(empty) == 1 else "in each file: " + "; ".join(f"{f}: {what}" for f, what in empty)
        raise DataError(f"the log {where} is empty (rows: 0, {which}): there are no events to make rows of. Fix: point the command "
                        f"at the log's events (one per line: user, item, time), or check the export that wrote it")
    return _concat(tables, read, spec.columns, list(spec.id_roles)) if len(tables) > 1 else tables[0], where


def _plain_columns(table: pa.Table) -> pa.Table:
    """``table`` with dictionary-encoded columns (a pandas ``category`` column written to Parquet) as their values: the id
    numbering sorts and matches values, which pyarrow's kernels refuse for a dictionary column (``Array type doesn't
    match type of values set``), and files of one log may hold a column encoded in one and plain in another."""
    for i, f in enumerate(table.schema):
        if pa.types.is_dictionary(f.type):
            table = table.set_column(i, f.name, table.column(i).cast(f.type.value_type))
    return table


def _concat(tables: list[pa.Table], files: list[str], columns: list[str], ids: list[str]) -> pa.Table:
    """The files' tables as one (integer widths and the like promoted); ``ids``: the id columns, for the fix.

    Raises:
        DataError: a column of different kinds in two files (ids as integers in one, text in another: ``1`` and ``"1"``
            would be two ids), naming both files and the fix; integer ids beyond 2**53 in one file and floats in another
            (:func:`~recsys_runner.data.sequences.text_ids.check_promotion`).
    """
    text_ids.check_promotion(tables, files, ids)
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid):
        for c in columns:
            types = [t.schema.field(c).type for t in tables]
            other = next((i for i, typ in enumerate(types) if typ != types[0]), None)
            if other is not None:
                raise DataError(f"the log's column {c!r} holds {types[0]} in {files[0]} but {types[other]} in {files[other]}: the files "
                                f"of one log hold each column as one kind of values (an id 1 and an id '1' would be two ids). Fix: "
                                f"write the column with one type in every file" + (", or --ids-as-text (reads the id columns of every file as "
                                "text)" if c in ids else "")) from None
        raise


def _header(path: str, delimiter: str) -> list[str]:
    with stores.open_input(path) as f:
        return f.readline().decode("utf-8", errors="replace").rstrip("\r\n").split(delimiter)


def _layout_fix(first: list[str], delimiter: str) -> str:
    """The fix for a text log whose first line (``first``, split by ``delimiter``) does not name the columns asked for, when
    it tells why: fields separated by ``::`` (MovieLens ml-1m's ``ratings.dat``), or a line of data (a log without a
    header line, as ``u.data``); ``""`` otherwise."""
    line = delimiter.join(first)
    if "::" in line and len(first) == 1:
        return (" Its fields are separated by '::' (MovieLens ml-1m's ratings.dat), which is no one-character delimiter, and it has "
                "no header line. Fix: sed 's/::/\\t/g' ratings.dat > ratings.tsv, then --delimiter tab --column-names "
                "user,item,rating,timestamp (and --user user --item item --time timestamp)")
    if any(_is_number(v.strip()) for v in first):  # a number (an id, a time) is no column name anyone writes
        return (f" Its first line {line[:100]!r} is data, not a header naming the columns: a log without a header line (as MovieLens' "
                f"u.data). Fix: name its {len(first)} columns in file order with --column-names, e.g. --column-names "
                f"{','.join(['user', 'item', 'rating', 'timestamp'][:len(first)] if len(first) <= 4 else [f'c{i}' for i in range(len(first))])}")
    return ""


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _no_nulls(arr: pa.ChunkedArray, column: str, where: str) -> pa.Array:
    """The column as one array, refused where a value is missing: null, or NaN (a float column's missing value, which
    would otherwise become an id ``nan`` shared by every such event, or a label 0)."""
    arr = arr.combine_chunks()
    if pa.types.is_nested(arr.type):
        raise DataError(f"{where}: column {column!r} holds {arr.type} values, one list per line; an event has one user, one item, one "
                        f"time, one label and one value of each side. Fix: one event per line (explode the lists first), or name "
                        f"another column")
    missing = arr.is_null(nan_is_null=True) if pa.types.is_floating(arr.type) else arr.is_null()
    if pc.any(missing).as_py():
        row = int(np.flatnonzero(np.asarray(missing.to_numpy(zero_copy_only=False)))[0])
        raise DataError(f"{where}, row {row} (0-based, header not counted): column {column!r} is missing (null or NaN). Fix: every "
                        f"event needs a value in each column the command reads (--user, --item, --time, --label, --side); drop or "
                        f"fill such lines")
    return arr


SECONDS = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
"""Units of an Arrow timestamp per second: times are kept in whole seconds."""


def event_times(arr: pa.ChunkedArray, column: str, where: str) -> np.ndarray:
    """The time column as int64: integers as they are, dates and timestamps (of any unit, with a time zone or not) in
    Unix seconds, a fraction of a second floored (pandas writes ``datetime64[ns]``: events of one second are then
    simultaneous, so none is in another's per-event history).

    Raises:
        DataError: a null, a column of another type, or integers beyond int64 (naming it and the fix).
    """
    arr = _no_nulls(arr, column, where)
    if pa.types.is_date(arr.type):
        arr = arr.cast(pa.timestamp("ms")) if pa.types.is_date64(arr.type) else arr.cast(pa.timestamp("s"))
    if pa.types.is_timestamp(arr.type):
        units = np.asarray(arr.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)
        return np.floor_divide(units, SECONDS[arr.type.unit])
    if not pa.types.is_integer(arr.type):
        raise DataError(f"{where}: the time column {column!r} has type {arr.type}; event times are integers (e.g. Unix seconds) "
                        f"or timestamps. Fix: --time <an integer time column>, or convert it first")
    try:
        arr = arr.cast(pa.int64())
    except pa.ArrowInvalid:
        raise DataError(f"{where}: the time column {column!r} ({arr.type}) holds times beyond int64 (the largest "
                        f"{pc.max(arr).as_py()}). Fix: times in seconds (or another unit that fits int64)") from None
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
    """What orders a user's events at one time: the codes of item, sides and raw label
    (:func:`~recsys_runner.data.sequences.interactions.history_bounds`)."""

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


def duplicates_message(table: pa.Table, events: Events, where: str) -> str:
    """``--duplicates fail``'s refusal: how many lines repeat an earlier one, the first of them and the line it repeats."""
    row = int(np.flatnonzero(events.copy)[0])
    first = int(np.flatnonzero(events.same == events.same[row])[0])
    values = table.slice(row, 1).to_pylist()[0]
    return (f"{where}: {int(events.copy.sum())} event(s) repeat an earlier one exactly (equal in every column read: "
            f"{list(table.column_names)}); the first is row {row}, a copy of row {first} (0-based, header not counted): {values}. "
            f"Fix: --duplicates drop to drop the copies (the default), or --duplicates keep if they are distinct events")

