"""``python -m recsys_runner.data inspect``: a summary of data files as training would read them — per column its type,
nulls and distinct values (ids counted as text, as the readers keep them), each label's rate, and each list column's
lengths with the cap that keeps 99% of rows whole. Its own module because the counting rules (which columns count as
text, which as numbers) are the readers', restated for a summary; the command line stays in ``data/__main__.py``."""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recsys_runner.data.encoding.fit import InferConfig
from recsys_runner.data.encoding.roles import infer_column
from recsys_runner.data.encoding.values import parse_numbers
from recsys_runner.data.files.compression import detect, read_error
from recsys_runner.data.files.criteo_config import CRITEO_COLUMNS
from recsys_runner.data.files.npy_source import NpySource
from recsys_runner.data.files.sources import PARQUET_MAGIC, read_head
from recsys_runner.data.files.tabular_config import text_delimiter
from recsys_runner.data.locate import PARQUET_SUFFIXES, resolve_files
from recsys_runner.data.schema import DenseColumn, SparseColumn
from recsys_runner.data.schema_files import stored_schema
from recsys_runner.errors import DataError


def _tables(args: argparse.Namespace, shown_types: dict[str, pa.DataType]) -> tuple[list[str], Any]:
    """The files and their tables, one per batch. Text (``csv``, ``criteo``) is read as the training readers read it
    (:class:`~recsys_runner.data.files.csv_source.CsvSource`): every field a string, only an empty field missing, so
    ``007`` and ``7`` stay two values; ``shown_types`` gets, per column, the type Arrow infers from a file's first block,
    which is only shown (what a column looks like), never what values are counted by."""
    if args.format == "parquet":
        found = resolve_files(args.path, "path", PARQUET_SUFFIXES + (".npy",))
        files = [f for f in found if not f.endswith(".npy")]
        if not files:  # a folder of TorchRec's days was "a directory without data files with a name ending in .parquet"
            raise DataError(f"path={args.path!r} holds .npy files ({os.path.basename(found[-1])}) and no Parquet, and inspect reads Parquet unless "
                            f"--format says otherwise. Fix: --format criteo_npy for TorchRec's Criteo days (day_<i>_dense.npy, …)")
        for path in files:  # a text file read as Parquet was Arrow's traceback: "Parquet magic bytes not found in footer"
            if not read_head(path).startswith(PARQUET_MAGIC):
                raise DataError(f"{path} is not a Parquet file (it does not begin with {PARQUET_MAGIC.decode()}), and inspect reads "
                                f"Parquet unless --format says otherwise. Fix: --format csv for delimited text (CSV, TSV; "
                                f"--delimiter), --format criteo for Criteo's TSV files")

        def parquet_tables() -> Any:
            for path in files:
                yield from (pa.Table.from_batches([b]) for b in pq.ParquetFile(path).iter_batches(batch_size=65_536))

        return files, parquet_tables()
    files = resolve_files(args.path, "path", None)
    criteo = args.format == "criteo"
    delimiter = "\t" if criteo else text_delimiter(args.delimiter, "--delimiter ", "--delimiter ,")
    read_options = pacsv.ReadOptions(column_names=CRITEO_COLUMNS if criteo else None, autogenerate_column_names=False,
                                     use_threads=False)  # one thread: a bad row is then told with its line number

    def text_tables() -> Any:
        for path in files:
            yield from _text_file_tables(path, read_options, delimiter, criteo, shown_types)

    return files, text_tables()


NPY_BLOCK_ROWS = 65_536
"""Rows of a ``.npy`` day read at a time (as many as a Parquet batch of :func:`_tables`)."""


def npy_tables(source: NpySource) -> Any:
    """The tables of TorchRec's Criteo days (``--format criteo_npy``) as ``data=criteo_npy`` reads them, the ids before
    the modulo (their distinct values and range are what the tables are sized by)."""
    for unit in source.units():
        for table, _ in source.read(unit):
            yield table


def _sorted_unique(values: np.ndarray, runs: bool = False) -> np.ndarray:
    """``values``' distinct values, sorted: ``np.unique`` by a sort (NumPy 2's ``np.unique`` hashes integers instead,
    several times slower on a day's 32-bit hashed ids). ``runs``: ``values`` are sorted runs one after another, which a
    stable sort (timsort) merges rather than sorting afresh (~4x faster for a column's ids and a few blocks')."""
    ordered = np.sort(values, kind="stable" if runs else None)
    return ordered[np.concatenate([[True], ordered[1:] != ordered[:-1]])] if len(ordered) else ordered


BITMAP_IDS = 1 << 27
"""Ids below this are counted in a bitmap (a byte per id up to the highest seen: 128 MiB at most per column), no sort:
contiguous ids, as TorchRec's 1TB preprocessing leaves them (its largest table has ~40M rows)."""


class DistinctNumbers:
    """The distinct values of one numeric column without nulls (``--format criteo_npy``), counted in numpy: ids below
    :data:`BITMAP_IDS` marked in a bitmap; other values (spread ids, raw 32-bit hashes as ``tsv_to_npys`` writes them;
    dense floats) by each block's sorted unique values, merged into one sorted array whenever the blocks waiting are as
    many values as it holds (so each value is sorted a bounded number of times). Python sets took 5-7x as long (a
    generated day of 2M rows, ids of 0.1-2.9M distinct values: 26-41 s against 4-7 s; a full Criteo day is ~100 times
    that many rows). The count is the same, and so is its cap: past ``cap`` values the column
    is only "more than ``cap``"."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._bitmap: np.ndarray | None = None
        self._sorted: np.ndarray | None = None
        self._waiting: list[np.ndarray] = []
        self._waiting_size = 0
        self._over = False

    def add(self, values: np.ndarray) -> None:
        """Count ``values`` (one block of the column) too."""
        if self._over or not len(values):
            return
        if self._marked(values):
            return
        block = _sorted_unique(values)
        self._waiting.append(block)
        self._waiting_size += len(block)
        if self._sorted is None or self._waiting_size >= len(self._sorted):
            self._merge()

    def _marked(self, values: np.ndarray) -> bool:
        """Whether ``values`` went into the bitmap; where they cannot (not ids, or one too high), it becomes ids sorted."""
        fits = np.issubdtype(values.dtype, np.integer) and self._sorted is None and not self._waiting
        if fits and int(values.min()) >= 0 and (high := int(values.max())) < BITMAP_IDS:
            if self._bitmap is None or len(self._bitmap) <= high:
                had = 0 if self._bitmap is None else len(self._bitmap)
                grown = np.zeros(min(max(high + 1, 2 * had), BITMAP_IDS), dtype=bool)  # doubled: few copies as ids rise
                if self._bitmap is not None:
                    grown[:had] = self._bitmap
                self._bitmap = grown
            self._bitmap[values] = True
            return True
        if self._bitmap is not None:
            self._waiting.append(np.flatnonzero(self._bitmap).astype(values.dtype))
            self._waiting_size += len(self._waiting[-1])
            self._bitmap = None
        return False

    def _merge(self) -> None:
        if self._waiting:
            self._sorted = _sorted_unique(np.concatenate([*([] if self._sorted is None else [self._sorted]), *self._waiting]), runs=True)
            self._waiting, self._waiting_size = [], 0
        if self._sorted is not None and len(self._sorted) > self.cap:
            self._over, self._sorted = True, None

    def count(self) -> int | None:
        """The column's distinct values, or ``None`` past the cap."""
        if self._bitmap is not None:
            found = int(np.count_nonzero(self._bitmap))
            return None if found > self.cap else found
        self._merge()
        return None if self._over else 0 if self._sorted is None else len(self._sorted)


def npy_days_line(source: NpySource) -> str:
    """The rows of each day of ``source`` (``--format criteo_npy``): the days are the files' unit, not each file."""
    return f"{len(source.days)} day(s): " + ", ".join(f"day {d.day} {d.rows} rows" for d in source.days)


def widen_ranges(ranges: dict[str, tuple[int, int]], table: pa.Table) -> None:
    """``ranges`` (per ``cat_*`` column of TorchRec's days, its lowest and highest id) widened to ``table``'s ids."""
    for name in table.column_names:
        if name.startswith("cat_") and table.num_rows:
            ends = pc.min_max(table.column(name))
            lo, hi = ends["min"].as_py(), ends["max"].as_py()
            ranges[name] = (min(lo, ranges[name][0]), max(hi, ranges[name][1])) if name in ranges else (lo, hi)


SPREAD = 4
"""Ids whose highest is this many times a column's distinct count (or more) are spread (raw hashes, as ``tsv_to_npys``
writes them), not made contiguous: a table of ``highest + 1`` rows would be mostly unused."""


def npy_ids_line(ranges: dict[str, tuple[int, int]], distinct: dict[str, int | None]) -> str:
    """The range of the ids (``--format criteo_npy``; ``ranges``: per ``cat_*`` column its lowest and highest id) and,
    where every column's ids are contiguous enough (below :data:`SPREAD` times its ``distinct`` count, ``None``: counting
    stopped), the table sizes that give each id a row of its own, which ``data=criteo_npy`` otherwise takes modulo
    ``data.num_embeddings``."""
    lowest, highest = min(lo for lo, _ in ranges.values()), max(hi for _, hi in ranges.values())
    line = f"ids ({len(ranges)} columns): lowest {lowest}, highest {highest}"
    contiguous = lowest >= 0 and all(n is None or hi + 1 <= SPREAD * max(n, 1) for (_, hi), n in zip(ranges.values(), distinct.values(), strict=True))
    if not contiguous:
        return line + (" (spread, not contiguous: data=criteo_npy takes each id modulo its table's size, data.num_embeddings or "
                       "data.num_embeddings_per_feature)")
    sizes = ",".join(str(hi + 1) for _, hi in ranges.values())
    return line + f"; data.num_embeddings_per_feature=[{sizes}] gives every id a row of its own"


def _text_file_tables(path: str, read_options: pacsv.ReadOptions, delimiter: str, criteo: bool,
                      shown_types: dict[str, pa.DataType]) -> Any:
    """The text file ``path``'s blocks, every field a string (``shown_types`` gets the types Arrow infers); a line of the
    wrong number of fields or a damaged compressed file stops it with :func:`_unreadable`'s error."""
    bad: list[Any] = []  # the first line of a wrong number of fields, as Arrow's parser saw it

    def stop_at(row: Any) -> str:
        bad.append(row)
        return "error"

    options = pacsv.ParseOptions(delimiter=delimiter, invalid_row_handler=stop_at)
    try:
        typed = pacsv.open_csv(path, read_options=read_options, parse_options=options)
        for field in typed.schema:
            shown_types.setdefault(field.name, field.type)
        text = pacsv.ConvertOptions(column_types=dict.fromkeys(typed.schema.names, pa.string()), null_values=[""],
                                    strings_can_be_null=True, quoted_strings_can_be_null=True)
        reader = pacsv.open_csv(path, read_options=read_options, parse_options=options, convert_options=text)
        yield from (pa.Table.from_batches([b]) for b in reader)
    except (OSError, pa.ArrowInvalid) as e:
        raise _unreadable(path, e, bad[0] if bad else None, delimiter, criteo) from None


def _unreadable(path: str, e: BaseException, bad: Any, delimiter: str, criteo: bool) -> Exception:
    """Why the text file ``path`` cannot be counted, as training words it: a compressed file cut short or corrupt, a line of
    another number of fields than the first (``bad``: Arrow's ``InvalidRow``, e.g. the last line of a truncated download),
    or Arrow's own error where it is neither (naming the file)."""
    compression = detect(path, read_head(path))
    if bad is None and compression is not None:
        return read_error(path, compression, e, "the files inspected")
    if bad is None:
        return DataError(f"{path} cannot be read as delimited text ({str(e).splitlines()[0]}). Fix: check the file and --delimiter")
    line = "" if bad.number is None else f", line {bad.number}"
    layout = " (Criteo's layout: the label, 13 counts, 26 hex categoricals)" if criteo else ""
    return DataError(f"bad row in {path}{line}: expected {bad.expected_columns} fields{layout} separated by {delimiter!r}, found "
                     f"{bad.actual_columns} ({bad.text[:100]!r}); inspect stops at it, as training does (data.on_bad_rows=fail). "
                     f"Fix the line (a file cut short ends in a partial line: drop it, e.g. head -n -1), or check --delimiter")


TEXT = "text"
"""A text column's values counted as their text (ids: ``hash`` and ``vocab`` key ``007`` and ``7`` apart)."""
NUMBER = "number"
"""A text column's values counted as the numbers they parse to (dense features and labels: ``1.0`` is ``1``)."""


def text_counting(first: pa.Table, label_columns: list[str], criteo: bool) -> dict[str, str]:
    """How each column of a text file (``first``: its first table, every field a string) is counted, as training reads it:
    :data:`NUMBER` for labels and dense features, else :data:`TEXT`, or the separator (one character) that splits a
    multi-hot field into its ids. Criteo's columns are known (``int_*`` dense, ``cat_*`` ids); a CSV's are those the schema inference of
    ``data=csv`` gives (:func:`~recsys_runner.data.encoding.roles.infer_column`), and a column it leaves out is counted as
    text (a row id, or an empty one)."""
    counting: dict[str, str] = {}
    for name in first.column_names:
        if name in label_columns or (criteo and not name.startswith("cat_")):
            counting[name] = NUMBER
        elif criteo:
            counting[name] = TEXT
        else:
            column, _ = infer_column(name, first.column(name), InferConfig())
            counting[name] = NUMBER if isinstance(column, DenseColumn) else (column.separator if isinstance(column, SparseColumn) else None) or TEXT
    return counting


def split_lists(col: pa.Array, separator: str) -> pa.Array:
    """A multi-hot text field split into its ids, empty ids (``a||b``) dropped, as the row encoder drops them."""
    lists = pc.split_pattern(col, separator)
    flat = pc.list_flatten(lists)
    keep = pc.not_equal(flat, "")
    rows = pc.filter(pc.list_parent_indices(lists), keep)
    lengths = np.bincount(np.asarray(rows.to_numpy(zero_copy_only=False), dtype=np.int64), minlength=len(lists))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pc.filter(flat, keep), mask=pc.is_null(col))


def counted_values(col: pa.Array, counting: str) -> list[Any]:
    """The distinct values of ``col`` (nulls included as ``None``; lists flattened) as training tells them apart:
    :data:`NUMBER` parses text to floats (a text that is no number is counted as itself), else values as they are."""
    if counting == NUMBER:
        texts = col.drop_null()
        numbers, wrong = parse_numbers(texts)
        found: list[Any] = np.unique(numbers[~wrong]).tolist() + pc.unique(pc.filter(texts, pa.array(wrong))).to_pylist()
        return found + ([None] if col.null_count else [])
    flat = pc.list_flatten(col) if pa.types.is_list(col.type) or pa.types.is_large_list(col.type) else col
    return list(pc.unique(flat).to_pylist())


def _label_columns(args: argparse.Namespace, files: list[str]) -> list[str]:
    """``--label`` columns, else the stored schema's label columns (Parquet), else ``label``."""
    if args.label:
        return list(args.label)
    if args.format == "parquet":
        stored = stored_schema(files[0])
        if stored is not None:
            return stored.label_columns
    return ["label"]


def inspect(args: argparse.Namespace) -> None:
    types: dict[str, pa.DataType] = {}
    npy = None
    if args.format == "criteo_npy":
        files = resolve_files(args.path, "path", (".npy",))
        npy = NpySource(files, list(CRITEO_COLUMNS), NPY_BLOCK_ROWS, key="path")
        tables = npy_tables(npy)
    else:
        files, tables = _tables(args, types)
    label_columns = _label_columns(args, files)
    rows = 0
    sums: dict[str, float] = dict.fromkeys(label_columns, 0.0)
    labelled: dict[str, int] = dict.fromkeys(label_columns, 0)
    nulls: dict[str, int] = {}
    distinct: dict[str, set] = {}
    in_numpy: dict[str, DistinctNumbers] = {}  # criteo_npy: each column's values, counted in numpy
    lengths: dict[str, list[np.ndarray]] = {}
    counting: dict[str, str] | None = None  # text files: how each column is counted (text_counting)
    ranges: dict[str, tuple[int, int]] = {}  # criteo_npy: each id column's lowest and highest id
    for table in tables:
        rows += table.num_rows
        if npy is not None:
            widen_ranges(ranges, table)
        if args.format in ("csv", "criteo") and counting is None:
            counting = text_counting(table, label_columns, args.format == "criteo")
        for name in table.column_names:
            col = table.column(name)
            col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
            how = counting.get(name, TEXT) if counting is not None else TEXT
            if how not in (TEXT, NUMBER):  # a separator: the field's ids, as a list column
                col = split_lists(col, how)
            types.setdefault(name, col.type)
            nulls[name] = nulls.get(name, 0) + col.null_count
            if npy is not None:
                in_numpy.setdefault(name, DistinctNumbers(args.max_distinct)).add(col.to_numpy())
            elif len(seen := distinct.setdefault(name, set())) <= args.max_distinct:
                seen.update(counted_values(col, how))
            if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
                lengths.setdefault(name, []).append(pc.fill_null(pc.list_value_length(col), 0).to_numpy())
        for name in label_columns:
            if name in table.column_names:
                label = table.column(name).drop_null()
                numbers, wrong = parse_numbers(label.combine_chunks() if isinstance(label, pa.ChunkedArray) else label)
                labelled[name] += int((~wrong).sum())
                sums[name] += float(numbers[~wrong].sum())
    counts = {name: n.count() for name, n in in_numpy.items()}
    counts.update({name: None if len(seen) > args.max_distinct else len(seen - {None}) for name, seen in distinct.items()})
    print(f"{len(files)} file(s), {rows} rows")
    if npy is not None:
        print(npy_days_line(npy))
    for name in label_columns:
        if name in counts:
            print(f"label {name!r}: rate {sums[name] / max(labelled[name], 1):.4f} (mean over {labelled[name]} labelled rows)")
    print(f"{'column':<24} {'type':<20} {'nulls':>10} {'distinct':>10}")
    for name, typ in types.items():
        count = f">{args.max_distinct}" if counts[name] is None else str(counts[name])
        print(f"{name:<24} {str(typ):<20} {nulls[name]:>10} {count:>10}")
    for name, parts in lengths.items():
        print(list_lengths_line(name, np.concatenate(parts)))
    if ranges:
        print(npy_ids_line(ranges, {name: counts[name] for name in ranges}))


LONG_TAIL = 4
"""A list column whose longest list is this many times its 99th percentile (or more) has a long tail worth capping."""


def list_lengths_line(name: str, lengths: np.ndarray) -> str:
    """``inspect``'s line for the list column ``name`` of row lengths ``lengths``: the longest list and the 99th percentile,
    and, where the longest is far above it, the ``max_values`` cap (:class:`~recsys_runner.data.schema.SparseColumn`)
    that keeps 99% of rows whole: the few long rows otherwise set the cost of every batch they fall in."""
    longest = int(lengths.max()) if len(lengths) else 0
    p99 = int(np.ceil(np.percentile(lengths, 99))) if len(lengths) else 0
    line = f"list {name!r}: lengths max {longest}, p99 {p99} (over {len(lengths)} rows)"
    if longest > LONG_TAIL * max(p99, 1):
        cut = int((lengths > p99).sum())
        line += (f"; a long tail: data.sparse[{name}].max_values={p99} keeps 99% of rows whole and cuts {cut} "
                 f"(counted as data/truncated_lists)")
    return line
