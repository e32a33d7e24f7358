"""``python -m recsys_runner.data convert|inspect|sequences``: text → Parquet conversion, a data summary, and an interaction log → rows with histories.

``convert`` reads CSV/TSV/Criteo files with a schema, encodes them exactly as training would
(fills, transforms, hashing, hex parsing, id checks) and writes Parquet files of model-ready columns
(binary labels int8, regression labels float32, dense float32, sparse int64 or list<int64>) with the
schema (the label column or the task → label column mapping included) stored in the file, so
``data=parquet data.path=<out>`` needs no column list::

    python -m recsys_runner.data convert --format criteo --num-embeddings 1000000 day_0.tsv out/
    python -m recsys_runner.data convert --format csv --schema schema.yaml logs/*.csv out/
    python -m recsys_runner.data convert --format csv ratings.csv out/ --label rating --label-threshold 4   # schema inferred
    python -m recsys_runner.data convert --format criteo_npy /data/criteo_1tb_npy/ out/   # TorchRec's .npy days: day_<i>.parquet

``inspect`` prints a file's (or directory's) columns and types, row count, the rate (mean) of each
label column, per column the null count and the number of distinct values, and per list (multi-hot) column the longest
list and the 99th percentile of the lengths, to choose ``max_values`` by. Text files are counted as training reads them:
every field as text (``007`` and ``7`` two ids), a dense column's or label's numbers as numbers, a multi-hot field's ids
(the columns' roles inferred as ``data=csv`` infers them). Label columns: the
``--label`` options, else those of the schema stored by ``convert``, else ``label``::

    python -m recsys_runner.data inspect out/ [--format parquet|csv|criteo|criteo_npy] [--label click --label conversion]

``--format criteo_npy`` reads TorchRec's Criteo days as ``data=criteo_npy`` does; ``inspect`` adds the rows of each day and
the range of the ids (with the table sizes that give each its own row where they are contiguous).

``sequences`` turns an interaction log (user, item, time, optional label or rating, item side columns) into rows
whose histories hold each user's earlier events only (:mod:`recsys_runner.data.sequences.interactions`), one per event or
one per user (``--rows``), split by time, leave-last-out or leave-two-out, with the schema stored and the id mapping
written beside them (``--vocab``: an earlier one); a CSV log whose id columns the type inference would merge (``007`` and
``7``) is refused (``--ids-as-text`` reads them as text); exact duplicate events are dropped and counted (``--duplicates``), and
a used output folder is refused unless ``--overwrite`` (:mod:`recsys_runner.data.sequences.output`)::

    python -m recsys_runner.data sequences events.csv out/ --user user --item item --time ts --side category \
        --max-len 50 --split time --eval-from 1700000000

``sequences`` ends like the project's other commands on SIGTERM, SIGINT or SIGUSR1: the signal stops it where it is
(:class:`~recsys_runner.train.signals.RaiseOnSignal`), the staged files are deleted, one line says that nothing was kept
and the command that redoes it, and the exit status is ``128 + signal``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys_runner.data.encoding.encoded_rows import Rows
from recsys_runner.data.encoding.fit import InferConfig, complete_schema
from recsys_runner.data.encoding.rows import Encoder, Location
from recsys_runner.data.files.csv_source import CsvSource
from recsys_runner.data.files.npy_source import NpySource
from recsys_runner.data.files.sources import skip_empty
from recsys_runner.data.files.tabular_config import (
    CRITEO_COLUMNS,
    CRITEO_MISSING_TEXTS,
    CRITEO_NUM_SPARSE,
    criteo_columns,
    criteo_schema,
    text_delimiter,
)
from recsys_runner.data.inspect import inspect
from recsys_runner.data.locate import resolve_files
from recsys_runner.data.schema import DenseColumn, Schema, SparseColumn
from recsys_runner.data.schema_files import SCHEMA_METADATA_KEY, read_schema_file, schema_json, schema_yaml
from recsys_runner.data.sequences.coverage import vocab_line
from recsys_runner.data.sequences.events import DUPLICATES, LogSpec
from recsys_runner.data.sequences.interactions import convert_log
from recsys_runner.data.sequences.mapping import EarlierVocab
from recsys_runner.data.sequences.output import OUTPUT_FILES
from recsys_runner.data.sequences.splits import LEAVE_TWO_OUT_MIN_EVENTS, ROWS, SPLITS, part_names
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.noise import quiet_known_noise
from recsys_runner.progress import MODES as PROGRESS_MODES
from recsys_runner.progress import Progress
from recsys_runner.staging import unwritable
from recsys_runner.train import signals  # the one import up the layers (pyproject.toml, docs/architecture.md)

INPUTS = "convert's inputs"
"""What names the files ``convert`` reads, in the fixes its messages give (a damaged file: "remove it from convert's
inputs"): its positional paths, not ``data.path``, which a training run's messages name."""


def converted_schema(schema: Schema) -> Schema:
    """The schema of converted files: values already transformed, ids already in range."""
    return Schema(
        label=schema.label,
        labels=schema.labels,
        label_kinds=schema.label_kinds,
        dense=[DenseColumn(name=d.name) for d in schema.dense],
        sparse=[SparseColumn(name=s.name, num_embeddings=s.num_embeddings, pooling=s.pooling, embedding_dim=s.embedding_dim, table=s.table,
                             managed_collision=s.managed_collision)  # raw ids stay raw: the model maps them
                for s in schema.sparse],
        sequences=list(schema.sequences),
    )


def rows_to_table(rows: Rows, schema: Schema, multi_hot: list[bool]) -> pa.Table:
    labels = rows.labels.reshape(len(rows), -1)
    cols: dict[str, pa.Array] = {}
    for t, (column, task) in enumerate(zip(schema.label_columns, schema.label_tasks, strict=True)):
        dtype = np.float32 if schema.label_kind(task) == "regression" else np.int8
        cols[column] = pa.array(labels[:, t].astype(dtype))
    for j, d in enumerate(schema.dense):
        cols[d.name] = pa.array(rows.dense[:, j].astype(np.float32))
    lists = [(s.name, multi) for s, multi in zip(schema.sparse, multi_hot, strict=True)] + [(t, True) for t in schema.timestamp_columns]
    for (values, lengths), (name, multi) in zip(rows.sparse, lists, strict=True):
        if multi:
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            cols[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int64()))
        else:
            present = lengths.astype(bool)
            full = np.zeros(len(lengths), np.int64)
            full[present] = values
            cols[name] = pa.array(full, pa.int64(), mask=~present)
    return pa.table(cols)


def _check_label(label: str | None, path: str, names: list[str]) -> None:
    """Refuse a ``--label`` that is not a column of ``path`` (its header's ``names``) before a schema is inferred and
    printed around it: the training settings' message (data.label(s) / data.dense / data.sparse) named no flag."""
    if label is None or label in names:
        return
    close = difflib.get_close_matches(label, names, n=1, cutoff=0.6)
    fix = f"--label {close[0]}" if close else "--label <one of them>"
    raise DataError(f"--label {label!r} is not a column of {path}: its header lists {names}"
                    + (f" (did you mean {close[0]}?)" if close else "") + f". Fix: {fix}")


def inferred_csv_schema(args: argparse.Namespace, files: list[str]) -> tuple[Schema, dict[str, Any]]:
    """``--format csv`` without ``--schema``: the schema inferred from a sample of the files' rows exactly as a training run
    on ``data=csv`` infers it (:mod:`recsys_runner.data.encoding.fit`), and the reader options; printed as a schema file
    to keep, edit and pass back as ``--schema`` (or ``data.schema=`` to train on the text files)."""
    options: dict[str, Any] = {"delimiter": text_delimiter(args.delimiter, "--delimiter ", "--delimiter ,"), "header": True,
                               "column_names": None, "null_values": [""]}
    sampler = CsvSource(files, [], block_rows=args.row_group_rows, on_bad_rows=args.on_bad_rows, path_key=INPUTS, **options)
    infer = InferConfig(sample_rows=args.sample_rows, exclude=list(args.exclude))
    where = f"the input {files[0]}" + (f" (and {len(files) - 1} more file(s))" if len(files) > 1 else "")
    _check_label(args.label, files[0], sampler.names(files[0]))
    try:
        done = complete_schema(label=args.label, labels=None, label_kinds=None, label_threshold=args.label_threshold, dense=[],
                               sparse=[], sample=lambda: sampler.sample(infer.sample_rows, spread=True), config=infer, where=where,
                               column_names=sampler.header_names)
    except DataError as e:  # the inference speaks of data.* settings; here they are flags
        raise DataError(str(e).replace("data.label_threshold=", "--label-threshold ").replace("data.label=", "--label ")
                        .replace("data.labels=", "--schema with labels: ")) from None
    print(f"schema inferred ({done.summary()}). To keep or edit it, save the lines below as a file and pass "
          f"--schema <file>:\n{schema_yaml(done.schema, {'delimiter': options['delimiter']}, done.notes)}")
    return done.schema, options


def output_folder(output: str) -> None:
    """The folder ``convert`` writes into, made, or refused before anything is read: a file, or one that cannot be written
    (now, not with a raw OSError after the first file is converted)."""
    if os.path.exists(output) and not os.path.isdir(output):
        raise ConfigError(f"the output folder {output} is a file. Fix: name a folder for the Parquet files")
    if found := unwritable(Path(output)):
        raise ConfigError(f"the output folder {output} cannot be written: {found[1]}. Fix: {found[2]}, or another output folder")
    os.makedirs(output, exist_ok=True)


class ParquetOut:
    """One converted file, opened at its first rows (an input of no rows writes none) with the schema stored."""

    def __init__(self, target: str, schema: Schema, multi_hot: list[bool], row_group_rows: int) -> None:
        self.target, self.schema, self.multi_hot, self.row_group_rows = target, schema, multi_hot, row_group_rows
        self.writer: pq.ParquetWriter | None = None

    def write(self, rows: Rows) -> int:
        """Writes ``rows``; returns how many."""
        out = rows_to_table(rows, self.schema, self.multi_hot)
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.target, out.schema.with_metadata({SCHEMA_METADATA_KEY: schema_json(self.schema)}))
        self.writer.write_table(out, row_group_size=self.row_group_rows)
        return out.num_rows

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def say_converted(total: int, inputs: str, skipped: int, output: str) -> None:
    """``convert``'s last lines: what it wrote (from ``inputs``: ``3 file(s)``), and how to train on it."""
    print(f"converted {total} rows from {inputs} into {output}" + (f"; skipped {skipped} bad rows" if skipped else ""))
    print(f"train with: python -m recsys_runner data=parquet data.path={output}")
    print("note: a hash eval split (data.eval_fraction) keys rows by file name, so these files hold out other rows than their "
          "sources did: evaluate a checkpoint trained on the sources on the sources (docs/data.md, 'Eval split')")


def table_sizes(args: argparse.Namespace) -> list[int]:
    """The 26 Criteo table sizes: ``--num-embeddings-per-feature`` (comma-separated), else ``--num-embeddings`` for all.

    Raises:
        ConfigError: not 26 positive integers.
    """
    if args.num_embeddings_per_feature is None:
        return [args.num_embeddings] * CRITEO_NUM_SPARSE
    try:
        sizes = [int(n) for n in args.num_embeddings_per_feature.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) != CRITEO_NUM_SPARSE or min(sizes) <= 0:
        raise ConfigError(f"--num-embeddings-per-feature {args.num_embeddings_per_feature!r} must be {CRITEO_NUM_SPARSE} positive "
                          f"integers separated by commas, one table size per Criteo categorical (cat_0 … cat_25)")
    return sizes


def convert_npy(args: argparse.Namespace) -> None:
    """``--format criteo_npy``: TorchRec's Criteo days → ``<output>/day_<i>.parquet`` each, encoded as ``data=criteo_npy``
    reads them (dense values as they are, ids modulo the table sizes), for readers the ``.npy`` files do not serve (an
    object store, another tool)."""
    if args.categorical_encoding != "mod":
        raise ConfigError(f"--categorical-encoding {args.categorical_encoding}: TorchRec's days hold integer ids, taken modulo the "
                          f"table size as data=criteo_npy takes them. Fix: leave --categorical-encoding mod")
    dense, sparse = criteo_columns(list(table_sizes(args)), "mod", "none", hex_ids=False)
    schema = Schema(label="label", dense=dense, sparse=sparse)
    source = NpySource([f for p in args.inputs for f in resolve_files(p, "input", (".npy",))], schema.columns, args.row_group_rows,
                       key=INPUTS)
    encoder, out_schema = Encoder(schema, args.on_bad_rows, DataError), converted_schema(schema)
    output_folder(args.output)
    units, total = source.units(), 0
    with Progress(sum(u.num_rows for u in units), unit="rows", desc="convert", mode=args.progress) as progress:
        for day in source.days:
            out = ParquetOut(os.path.join(args.output, f"day_{day.day}.parquet"), out_schema, [False] * len(sparse), args.row_group_rows)
            for unit in (u for u in units if u.path == day.dense):
                for table, file_rows in source.read(unit):
                    total += out.write(encoder.encode(table, Location(unit.path, unit.part, file_rows, None, source.column_files(unit.path))))
                progress.update(unit.num_rows, rows=total)
            out.close()
            progress.write(f"day {day.day} ({os.path.basename(day.dense)}, …) -> {out.target}")
    say_converted(total, f"{len(source.days)} day(s)", encoder.num_bad_rows, args.output)


def convert(args: argparse.Namespace) -> None:
    if args.format == "criteo_npy":
        return convert_npy(args)
    if args.format == "criteo":
        schema = criteo_schema(table_sizes(args), args.categorical_encoding)
        options: dict[str, Any] = {"delimiter": "\t", "header": False, "column_names": CRITEO_COLUMNS, "null_values": CRITEO_MISSING_TEXTS}
    elif args.schema:
        parts, reader = read_schema_file(args.schema)  # the form a training run logs when it infers a schema
        if parts["label"] is None and parts["labels"] is None:
            parts["label"] = "label"
        options = {"delimiter": reader.get("delimiter", ","), "header": reader.get("header", True),
                   "column_names": reader.get("column_names"), "null_values": reader.get("null_values", [""])}
    files = [f for p in args.inputs for f in resolve_files(p, "input", None)]
    if args.format == "csv" and not args.schema:
        schema, options = inferred_csv_schema(args, files)
    elif args.schema:  # vocabularies (and sizes left out) come from the files, as in training
        sampler = CsvSource(files, [], block_rows=args.row_group_rows, on_bad_rows=args.on_bad_rows, path_key=INPUTS, **options)
        infer = InferConfig(sample_rows=args.sample_rows)
        schema = complete_schema(**parts, sample=lambda: sampler.sample(infer.sample_rows, spread=True), config=infer, where=f"the input {files[0]}").schema
    weighted = [s.name for s in schema.sparse if s.is_weighted]
    if weighted:  # the converted files hold ids only
        raise ConfigError(f"--schema lists the weighted columns {weighted}, whose weights convert would drop (it writes ids only). "
                          f"Fix: train on the text files with data=csv data.schema=<file>, or drop weighted / weights from them")
    source = CsvSource(files, schema.columns, block_rows=args.row_group_rows, on_bad_rows=args.on_bad_rows, path_key=INPUTS,
                       **options)
    if args.format == "criteo" and files[0].endswith(".npy"):  # its first line has no tab either, but its fix differs
        raise DataError(f"{files[0]} is a NumPy file, not Criteo's TSV, which convert reads unless --format says otherwise. Fix: "
                        f"--format criteo_npy for TorchRec's Criteo days (day_<i>_dense.npy, …)")
    if args.format == "criteo" and (first := source.headers.first_lines(files[0], 1)) and "\t" not in first[0]:
        # the default format: a CSV given without --format was a bad row whose fix named data.delimiter, no flag
        raise DataError(f"{files[0]} is not Criteo's TSV (its first line has no tab: {first[0][:100]!r}), which convert reads "
                        f"unless --format says otherwise. Fix: --format csv (its schema inferred, or --schema <file>)")
    files = skip_empty(files, [f for f in files if not source.has_rows(f)], "has a header line but no rows")  # as training does
    encoder = Encoder(schema, args.on_bad_rows, DataError)
    out_schema = converted_schema(schema)
    multi_hot = [s.separator is not None for s in schema.sparse]
    output_folder(args.output)
    total = 0
    # Progress in input bytes: known up front, unlike rows, and it moves within one large file.
    with Progress(sum(os.path.getsize(f) for f in files), unit="B", unit_scale=True, desc="convert", mode=args.progress) as progress:
        for path in files:
            target = os.path.join(args.output, os.path.splitext(os.path.basename(path))[0] + ".parquet")
            out, done = ParquetOut(target, out_schema, multi_hot, args.row_group_rows), 0
            for unit in source._index(path):
                for table, file_rows in source.read(unit):
                    total += out.write(encoder.encode(table, Location(path, unit.part, file_rows, source.line_offset(path))))
                start, stop = unit.byte_range
                progress.update(stop - start, rows=total)
                done += stop - start
            out.close()
            progress.update(os.path.getsize(path) - done)  # the header line, if any
            progress.write(f"{path} -> {target}")
    say_converted(total, f"{len(files)} file(s)", encoder.num_bad_rows + source.num_bad_rows, args.output)


def sequences(args: argparse.Namespace) -> None:
    """``sequences``: the log → ``<output>/<part>.parquet`` for each part of the split and the id mapping (:mod:`recsys_runner.data.sequences.interactions`),
    under the signal guard every command has (module docstring); a signal that comes while the finished output is moved
    into place waits for it (``signals.deferred``) and then stops the command saying the output is complete."""
    spec = LogSpec(user=args.user, item=args.item, time=args.time, label=args.label, label_threshold=args.label_threshold,
                   sides=list(args.side), max_len=args.max_len, split=args.split, eval_from=args.eval_from, valid_from=args.valid_from,
                   rows=args.rows, duplicates=args.duplicates, vocab=args.vocab, oov_buckets=args.oov_buckets or 1,
                   ids_as_text=args.ids_as_text, column_names=args.column_names.split(",") if args.column_names else None)
    if args.vocab is not None and args.oov_buckets is not None:
        raise ConfigError(f"--oov-buckets {args.oov_buckets} with --vocab: the tables keep the earlier output's sizes (its ids and its "
                          f"OOV rows), so a model trained on it reads the new rows. Fix: drop --oov-buckets")
    delimiter = text_delimiter(args.delimiter, "--delimiter ", "--delimiter ,")
    out = args.output.rstrip("/")
    with signals.RaiseOnSignal("during sequences") as guard:
        rows = convert_log(args.log, args.output, spec, args.format, delimiter, args.row_group_rows, overwrite=args.overwrite,
                           committing=signals.deferred)
        late = guard.signum
    copies = rows.num_duplicates
    said = f"{copies} of them exact duplicates of an earlier event ({'dropped' if spec.duplicates == 'drop' else 'kept'}, " if copies \
        else "no exact duplicates ("
    print(f"read {rows.num_events} events from {args.log}; {said}--duplicates {spec.duplicates})")
    if rows.num_short_users:
        print(f"{rows.num_short_users} user(s) have fewer than {LEAVE_TWO_OUT_MIN_EVENTS} events: --split leave-two-out gives them no valid "
              f"or test row (all their events are training rows)")
    for part, count in rows.cold_rows.items():
        if count:
            print(f"{count} of the {rows.parts[part].num_rows} {part} rows are of users without a training row (a user's single event "
                  f"under --split leave-last-out, or all of a user's events held out): the model never trained on these users, "
                  f"and their histories hold no training event")
    for table, count in rows.unseen.items():
        print(f"--vocab {args.vocab}: {count} {table} id(s) of this log are not in its mapping (each reads an OOV row)")
    if args.vocab is not None and args.ids_as_text is None and EarlierVocab.load(args.vocab).ids_as_text:
        print(f"--vocab {args.vocab}: its mapping read the id columns as text (--ids-as-text), and so did this run")
    if args.vocab is not None:
        for part, coverage in rows.coverage.items():
            print(vocab_line(args.vocab, part, coverage))
    names = part_names(spec.split, spec.valid_from)
    written = ", ".join(f"{rows.parts[n].num_rows} {'training' if n == 'train' else n} rows to {out}/{n}.parquet" for n in names)
    per = "one per user: its whole sequence, up to" if spec.rows == "per-user" else "histories: up to"
    print(f"wrote {written} ({spec.rows} rows, {per} {spec.max_len} earlier events per row) and the id mapping to {out}/vocab.json")
    model = "sasrec" if spec.rows == "per-user" else "din"
    held = "valid" if "valid" in names else "eval"
    print(f"train with: python -m recsys_runner model={model} data=parquet data.path={out}/train.parquet data.eval_path={out}/{held}.parquet")
    if late is not None:  # it came while the output was moved into place, which finished first
        raise signals.Interrupted(late, None, None, when="as sequences ended", finished=True)


def interrupted_message(e: signals.Interrupted, output: str, argv: list[str]) -> str:
    """What a signal left (the one line of ``lifecycle.interrupted_message``, for a command without an MLflow run)."""
    if e.finished:
        return f"Interrupted: {e}; the output in {output} was complete and is kept, nothing to redo."
    command = shlex.join(["python", "-m", "recsys_runner.data", *argv])
    return f"Interrupted: {e}; nothing was kept ({output} is as it was before); redo it with: {command}"


def _sequences_parser(sub: Any) -> None:
    s = sub.add_parser("sequences", help="an interaction log -> rows with user histories (train.parquet, eval.parquet or valid/test) "
                                         "and the id mapping (vocab.json, vocab/)")
    s.add_argument("log", help="the log: a Parquet or CSV/TSV file (or a directory or glob of them)")
    s.add_argument("output", help="output directory (train.parquet, eval.parquet or valid.parquet and test.parquet, vocab.json, vocab/)")
    s.add_argument("--user", default="user", help="the user column")
    s.add_argument("--item", default="item", help="the item column")
    s.add_argument("--time", default="timestamp", help="the event time column (integers, e.g. Unix seconds, or dates/timestamps of any unit: "
                                                        "Unix seconds, a fraction floored)")
    s.add_argument("--label", help="a 0/1 label column, or a rating with --label-threshold (default: every event is a positive)")
    s.add_argument("--label-threshold", type=float, help="label = (--label column >= this), e.g. a rating of 4")
    s.add_argument("--side", action="append", default=[], help="an item side column such as category (repeatable): "
                                                               "a candidate feature and its history hist_<side>")
    s.add_argument("--max-len", type=int, default=50, help="the longest history kept (the most recent events)")
    s.add_argument("--rows", choices=list(ROWS), default="per-event",
                   help="per-event: a row per event (every model); per-user: a row per user holding its whole sequence, its last "
                        "event the candidate (next-item models: sasrec, hstu)")
    s.add_argument("--split", choices=list(SPLITS), default="leave-last-out",
                   help="time: events at or after --eval-from are eval rows (with --valid-from: valid, then test); leave-last-out: "
                        "each user's last event is; leave-two-out: the last is test, the one before valid")
    s.add_argument("--eval-from", type=int, help="--split time: the first eval (test) time, in the time column's units")
    s.add_argument("--valid-from", type=int, help="--split time: the first valid time (before --eval-from): train, valid, test files")
    s.add_argument("--vocab", help="an earlier output folder: encode this log with its id mapping (unseen ids read OOV rows, counted)")
    s.add_argument("--oov-buckets", type=int, help="rows after each table's ids for ids a later --vocab run has not seen (default 1; "
                                                   "with --vocab the earlier output's)")
    s.add_argument("--ids-as-text", action=argparse.BooleanOptionalAction, default=None,
                   help="read the id columns (--user, --item, --side) as text: '007' and '7' two ids (a Parquet integer column as its "
                        "decimal text). Default: as inferred, refused where that would merge ids; with --vocab: as its mapping was read")
    s.add_argument("--format", choices=["auto", "parquet", "csv"], default="auto", help="auto: Parquet by file name, else text")
    s.add_argument("--delimiter", default=",", help="text logs: the field delimiter (a character, or tab/comma/semicolon/pipe)")
    s.add_argument("--column-names", help="a text log without a header line (MovieLens' u.data): its columns' names in file order, "
                                          "comma-separated, e.g. user,item,rating,timestamp; every line is then an event")
    s.add_argument("--row-group-rows", type=int, default=65_536)
    s.add_argument("--duplicates", choices=list(DUPLICATES), default="drop",
                   help="events equal in every column read (user, item, time, label, sides): drop all but the first, keep them "
                        "(leave-last-out then holds out a user's last event with its copies), or fail naming the first")
    s.add_argument("--overwrite", action="store_true",
                   help=f"replace an earlier output in the output folder as a whole (else a folder that holds anything is refused; "
                        f"one holding other files than {', '.join(OUTPUT_FILES)} and vocab/ is refused even so)")


@contextlib.contextmanager
def notes_shown() -> Iterator[None]:
    """The notes the data modules log at INFO while a command runs, printed as ``INFO <note>`` on stderr: which files of a
    folder are read and which not (its subdirectories, a README), empty part files skipped. Training shows them through
    Hydra's logging; here Python's default level (WARNING) dropped them, so ``inspect`` of a folder counted its top
    files alone without a word about the subdirectory beside them. Restored afterwards: tests call :func:`main` in
    process."""
    logger = logging.getLogger("recsys_runner")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the root handler a library installs would print each note a second time
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recsys_runner.data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="CSV/TSV/Criteo (TSV or TorchRec's .npy days) -> Parquet with the schema")
    c.add_argument("inputs", nargs="+", help="input files, directories or globs")
    c.add_argument("output", help="output directory")
    c.add_argument("--format", choices=["criteo", "csv", "criteo_npy"], default="criteo",
                   help="criteo_npy: TorchRec's preprocessed Criteo days (day_<i>_{dense,sparse,labels}.npy) -> day_<i>.parquet, "
                        "encoded as data=criteo_npy reads them")
    c.add_argument("--schema", help="csv: YAML file with label (or labels, label_kinds), dense, sparse (as in data.*); "
                                    "without it the schema is inferred from a sample of the files' rows and printed")
    c.add_argument("--label", help="csv without --schema: the label column (default: one named label, click, clicked, …)")
    c.add_argument("--label-threshold", type=float, help="csv without --schema: label = (label column >= this), e.g. a rating of 4")
    c.add_argument("--exclude", action="append", default=[], help="csv without --schema: a column not to use as a feature (repeatable)")
    c.add_argument("--delimiter", default=",", help="csv without --schema: the field delimiter (a character, or tab/comma/semicolon/pipe)")
    c.add_argument("--sample-rows", type=int, default=InferConfig.sample_rows, help="csv: rows read to infer the schema and fit vocabularies, in runs spread over the "
                   "files (compressed files: each one's first rows)")
    c.add_argument("--num-embeddings", type=int, default=100_000, help="criteo: table size of every categorical (default: %(default)s, fixed: "
                   "a small file gets tables larger than its rows; data=criteo sizes them from the files)")
    c.add_argument("--num-embeddings-per-feature", help="criteo, criteo_npy: the 26 table sizes, comma-separated (instead of "
                   "--num-embeddings), e.g. TorchRec's Criteo 1TB sizes (docs/data.md)")
    c.add_argument("--categorical-encoding", choices=["mod", "hash"], default="mod", help="criteo: hex value modulo the table size, or a hash")
    c.add_argument("--row-group-rows", type=int, default=65_536)
    c.add_argument("--on-bad-rows", choices=["fail", "skip"], default="fail")
    c.add_argument("--progress", choices=list(PROGRESS_MODES), default="auto",
                   help="auto: a progress bar on a terminal, plain lines otherwise; bar: always; log: never")
    i = sub.add_parser("inspect", help="columns, row count, label rate, nulls, cardinality")
    i.add_argument("path", help="a file, directory or glob")
    i.add_argument("--format", choices=["parquet", "csv", "criteo", "criteo_npy"], default="parquet",
                   help="criteo_npy: TorchRec's preprocessed Criteo days (day_<i>_{dense,sparse,labels}.npy), as data=criteo_npy reads them")
    i.add_argument("--delimiter", default=",")
    i.add_argument("--label", action="append", help="a label column (repeat for several); default: the stored schema's, else 'label'")
    i.add_argument("--max-distinct", type=int, default=1_000_000, help="stop counting distinct values above this")
    _sequences_parser(sub)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    quiet_known_noise()
    try:
        with notes_shown():
            {"convert": convert, "inspect": inspect, "sequences": sequences}[args.command](args)
    except (DataError, ConfigError) as e:
        print(f"{e.label}: {e}", file=sys.stderr)
        return 2
    except signals.Interrupted as e:  # only sequences holds the signals (its output is staged); 128 + signal, as every command
        print(interrupted_message(e, args.output, argv), file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
