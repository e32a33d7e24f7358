"""``python -m recsys_runner.data convert``: CSV/TSV/Criteo text (or TorchRec's Criteo ``.npy`` days) → Parquet files of
model-ready columns with the schema stored in them, encoded exactly as training encodes (the command's usage is in
:mod:`recsys_runner.data.__main__`'s docstring, its ``--help``).

Apart from the command line because it is a concern of its own: the schema it writes, the rows it encodes, the output
folder it refuses or fills; ``inspect`` (:mod:`recsys_runner.data.inspect`) and ``sequences``
(:mod:`recsys_runner.data.sequences`) have theirs.
"""

from __future__ import annotations

import argparse
import difflib
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys_runner.data.encoding.encoded_rows import Rows
from recsys_runner.data.encoding.fit import InferConfig, complete_schema
from recsys_runner.data.encoding.rows import Encoder, Location
from recsys_runner.data.files.criteo_config import (
    CRITEO_COLUMNS,
    CRITEO_MISSING_TEXTS,
    CRITEO_NUM_SPARSE,
    criteo_columns,
    criteo_schema,
)
from recsys_runner.data.files.csv_source import CsvSource
from recsys_runner.data.files.npy_source import NpySource
from recsys_runner.data.files.sources import skip_empty
from recsys_runner.data.files.tabular_config import text_delimiter
from recsys_runner.data.locate import resolve_files
from recsys_runner.data.schema import DenseColumn, Schema, SparseColumn
from recsys_runner.data.schema_files import SCHEMA_METADATA_KEY, read_schema_file, schema_json, schema_yaml
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.progress import MODES as PROGRESS_MODES
from recsys_runner.progress import Progress
from recsys_runner.staging import unwritable

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


def convert_parser(sub: Any) -> None:
    """``convert``'s arguments, on the command line's subparsers ``sub``."""
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
