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

How the log is read and its events encoded (ids, times, labels, which lines repeat an earlier one) is
:mod:`recsys_runner.data.sequences.events`; where the rows go (the output folder refused when used, files staged and
moved into place whole) is :mod:`recsys_runner.data.sequences.output`.

Everything is vectorized (one sort by user and time, per-user running offsets, one gather per list column).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys_runner import stores
from recsys_runner.data.schema import Schema, SparseColumn
from recsys_runner.data.schema_files import SCHEMA_METADATA_KEY, schema_json
from recsys_runner.data.sequences.coverage import PartCoverage, Spans, part_coverage
from recsys_runner.data.sequences.events import Events, LogSpec, duplicates_message, encode, read_log
from recsys_runner.data.sequences.mapping import VOCAB_METADATA_KEY, EarlierVocab, Table, write_vocab
from recsys_runner.data.sequences.output import StagedOutput
from recsys_runner.data.sequences.splits import (
    ROWS_METADATA_KEY,
    Sorted,
    part_names,
    per_user_rows,
    sorted_layout,
    split_parts,
)
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.features import SequenceGroup

__all__ = ["LogRows", "convert_log", "log_to_rows"]
HISTORY_GROUP = "hist"


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


def part_tables(events: Events, h: Histories, spec: LogSpec) -> tuple[dict[str, pa.Table], dict[str, Spans], int]:
    """Each part's rows (:func:`~recsys_runner.data.sequences.splits.split_parts`; a held-out event takes its copies
    along, so a held-out row is never also a training row), per event or per user; where each row's candidate and
    history lie among the sorted events; and the users leave-two-out leaves in train only (fewer than 3 events)."""
    layout: Sorted = sorted_layout(events.user[h.order], events.same[h.order])
    parts, short = split_parts(spec.split, events.time[h.order], layout, spec.eval_from, spec.valid_from)
    tables, spans = {}, {}
    for name, mask in parts.items():
        if spec.rows == "per-user":
            rows, begin, end = per_user_rows(mask, layout, spec.max_len)
        else:
            rows = np.flatnonzero(mask)
            begin, end = h.begin[rows], h.end[rows]
        tables[name] = rows_table(events, h, rows, (begin, end))
        spans[name] = Spans(rows, begin, end)
    return tables, spans, short


def coverage(events: Events, h: Histories, spans: dict[str, Spans], oov_buckets: int) -> dict[str, PartCoverage]:
    """Each part's :class:`~recsys_runner.data.sequences.coverage.PartCoverage`: users told apart by their raw ids
    (:attr:`Events.user`, never the ids the rows hold, which new users share); a user or item unseen by the mapping is
    one whose id is an OOV row (past the table's values)."""
    o = h.order
    new_user = events.ids["user_id"][o] >= events.sizes["user_id"] - oov_buckets
    new_item = events.ids["item_id"][o] >= events.sizes["item_id"] - oov_buckets
    return part_coverage(events.user[o], new_user, new_item, spans)


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
    coverage: dict[str, PartCoverage] = field(default_factory=dict)
    """Per part, what its rows hold that the model has not trained on (:mod:`~recsys_runner.data.sequences.coverage`):
    rows of users without a training row, and with ``--vocab`` users and items the earlier mapping has not seen."""

    @property
    def cold_rows(self) -> dict[str, int]:
        """Per held-out part, its rows of users (raw ids) without a training row (a user's single event under
        leave-last-out, or all of a user's events at or after ``--eval-from``): rows of a user the model never trained
        on, whose histories hold no training event. Counted so that the command says it, as the eval's cold-start share."""
        return {name: c.untrained_rows for name, c in self.coverage.items() if name != "train"}

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
            split without rows (naming the split and the fix), or a bad column (see
            :func:`~recsys_runner.data.sequences.events.encode_log`).
    """
    encoded = encode(table, spec, where, earlier)
    events = encoded.events
    copies = int(events.copy.sum())
    if copies and spec.duplicates == "fail":
        raise DataError(duplicates_message(table, events, where))
    if copies and spec.duplicates == "drop":  # the first copy stays: ids, numbered by sorted value, do not change
        events = events.take(~events.copy)
    h = history_bounds(events.user, events.time, spec.max_len, ties=events.ties)
    parts, spans, short = part_tables(events, h, spec)
    how = {"time": f"--split time --eval-from {spec.eval_from}" + (f" --valid-from {spec.valid_from}" if spec.valid_from is not None else ""),
           }.get(spec.split, f"--split {spec.split}")
    for name, rows in parts.items():
        if not rows.num_rows:
            fix = "an --eval-from (and --valid-from) between those times, or another --split" if spec.split == "time" else \
                "users with at least 3 events, or --split leave-last-out" if spec.split == "leave-two-out" else "another --split"
            raise DataError(f"{where}: {how} leaves no {'training' if name == 'train' else name} rows ({len(events.time)} events, times "
                            f"{int(events.time.min())} … {int(events.time.max())}). Fix: {fix}")
    return LogRows(parts, rows_schema(events, spec), table.num_rows, copies, encoded.tables, encoded.unseen, short,
                   coverage(events, h, spans, earlier.oov_buckets if earlier else spec.oov_buckets))


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
    mapping is copied (it is the one the ids follow), and the log's id columns are read as its were read (``ids_as_text``:
    ``None`` follows it, the other setting is refused).

    ``overwrite``: replace an earlier output there (else it is refused, before the log is read). ``committing`` is entered
    around the move into place: the command line holds signals back there (``train.signals.deferred``).
    """
    earlier = EarlierVocab.load(spec.vocab) if spec.vocab is not None else None
    if earlier is not None:
        if spec.ids_as_text is not None and spec.ids_as_text != earlier.ids_as_text:
            how = ("read the earlier log's id columns as text (--ids-as-text)" if earlier.ids_as_text
                   else "read the earlier log's id columns as Arrow infers them (no --ids-as-text)")
            raise ConfigError(f"--vocab {spec.vocab} {how}, but this run {'does not' if earlier.ids_as_text else 'does'}: the same id "
                              f"would be keyed differently ('7' as text or 7 as a number) and read another row. Fix: drop "
                              f"--{'no-' if earlier.ids_as_text else ''}ids-as-text (a --vocab run reads ids as its mapping did)")
        spec = replace(spec, oov_buckets=earlier.oov_buckets, ids_as_text=earlier.ids_as_text)
    staged = StagedOutput(output, overwrite)
    table, where = read_log(path, spec, fmt, delimiter)
    rows = log_to_rows(table, spec, where, earlier)
    with staged:
        for name in part_names(spec.split, spec.valid_from):
            write_rows(rows.parts[name], rows.schema, staged.file(f"{name}.parquet"), row_group_rows, spec.rows)
        if earlier is None:
            write_vocab(staged.path, rows.tables, spec.oov_buckets, bool(spec.ids_as_text))
        else:
            earlier.copy_to(staged.path)
        with committing():
            staged.commit()
    return rows
