"""The Parquet source: Parquet files read one row group at a time (a :class:`~recsys_runner.data.files.sources.Unit`
each), and what reading them needs of their Arrow types: dictionary columns read as their values (:func:`decoded`),
and files read together agreeing on each column's kind of values (:func:`type_clash`).

A file's footer tells its row groups and their row counts, so only the footers are read to cut the files into units; a
row group is read in tables of at most ``read_rows`` rows. The unit and what the sources share are in
:mod:`~recsys_runner.data.files.sources`; the delimited-text source is :mod:`~recsys_runner.data.files.csv_source`."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys_runner import stores, uris
from recsys_runner.data.encoding.keys import is_text
from recsys_runner.data.encoding.values import is_list
from recsys_runner.data.files.sources import (
    PARQUET_MAGIC,
    Unit,
    check_unique_names,
    closest_column,
    lacks_training_column,
    looks_like_text,
    read_head,
    repeated_names,
    skip_empty,
    without_repeats,
)
from recsys_runner.data.files.spread_sample import group_runs, take_runs
from recsys_runner.errors import DataError

PARQUET_REPEATS_FIX = ("write it again with a name of its own for each column (in pandas, df.columns.is_unique must hold), or "
                      "remove it from data.path")
"""The fix for a Parquet file whose schema repeats the name of a column read (:func:`check_unique_names`)."""


def _plain(t: pa.DataType) -> pa.DataType:
    """``t`` as the readers take it: a dictionary's values' type, a ``string_view`` (Polars' text) as ``string``."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.string() if pa.types.is_string_view(t) else t


def plain_schema(schema: pa.Schema) -> pa.Schema:
    """A Parquet file's Arrow schema with each dictionary-encoded column as its values' type (and text views as text), as
    :class:`ParquetSource` reads it (:func:`decoded`)."""
    if all(_plain(t) == t for t in schema.types):
        return schema
    return pa.schema([f.with_type(_plain(f.type)) for f in schema], metadata=schema.metadata)


def decoded(table: pa.Table) -> pa.Table:
    """``table`` with each dictionary-encoded column decoded to its values.

    Why: pandas writes a ``category`` column (and Spark a low-cardinality one may) as a Parquet dictionary column, which
    Arrow reads back as ``dictionary<values=string, …>``; its values are text, keyed as any text column is, but the
    encoder and the schema inference read a column's values by their type, and took the dictionary for neither text nor
    integers ("'a' is not an integer (encoding=hash); use encoding=hash for strings")."""
    plain = plain_schema(table.schema)
    return table if plain is table.schema else table.cast(plain)


def _family(t: pa.DataType) -> str | None:
    """What a column's Arrow type is for reading it: ``number`` (any integer or float width: files of one column may
    differ in it), ``text``, ``list<…>`` of one of these, another type's name (``bool``); ``None`` for a column of nulls
    only (it fits any type)."""
    if is_list(t):
        inner = _family(t.value_type)
        return "list" if inner is None else f"list<{inner}>"
    if pa.types.is_null(t):
        return None
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return "number"
    return "text" if is_text(t) else str(t)


def type_clash(columns: list[str], first: tuple[str, pa.Schema], other: tuple[str, pa.Schema],
               settings: str = "data.path, data.eval_path") -> DataError | None:
    """The error for the first of ``columns`` whose type differs in kind (:func:`_family`) between two Parquet files read
    together, each given as ``(path, Arrow schema)`` (``settings``: which settings named them); ``None`` when they agree.

    Why: an id column written as integers in one file and as text in another would key different rows of a vocabulary
    or a hash (``7`` and ``"7"`` are two values), so one file's ids would silently read rows trained by nothing."""
    for name in columns:
        if name not in first[1].names or name not in other[1].names:
            continue
        a, b = (_family(s.field(name).type) for _, s in (first, other))
        if a is None or b is None or a == b or (a.startswith("list") and b.startswith("list") and "list" in (a, b)):
            continue
        ta, tb = first[1].field(name).type, other[1].field(name).type
        return DataError(f"column {name!r} holds {ta} values in {first[0]} but {tb} values in {other[0]}: files read together "
                         f"({settings}) must agree on each column's type, or their values would not be encoded "
                         f"alike (text ids and integer ids key different rows). Fix: write {name!r} of {other[0]} as {ta}, as in "
                         f"{first[0]}")
    return None


class ParquetSource:
    """Parquet files, one unit per row group."""

    def __init__(self, files: list[str], columns: list[str], read_rows: int, reference: str | None = None) -> None:
        self.files, self.columns, self.read_rows = files, columns, read_rows
        self.reference = reference
        """For eval files: the first training file, so a column they lack but it holds is named as their mistake."""
        self.path_key, self.what = "data.eval_path", "eval file"
        """For that message: the setting naming these files and what one of them is."""
        self._footers: dict[str, pq.FileMetaData] = {}
        """Object-store files' footers, read once (a footer costs a round trip to the store)."""

    def units(self, say_skipped: bool = True) -> list[Unit]:
        """Every file's row groups, after checking that the files agree on the type of each column read (:func:`type_clash`).

        Files of 0 rows are skipped (:func:`skip_empty`, saying so unless ``say_skipped`` is false): :attr:`files` is then
        the files with rows.

        Raises:
            DataError: every file is empty; a file is unreadable, lacks a column, or holds a column as another kind of values.
        """
        units, empty = [], []
        reference: tuple[str, pa.Schema] | None = None
        for path in self.files:
            f = self._open(path)
            meta = f.metadata
            reference = reference or (path, plain_schema(f.schema_arrow))
            if (clash := type_clash(self.columns, reference, (path, plain_schema(f.schema_arrow)))) is not None:
                raise clash
            if meta.num_rows == 0:
                empty.append(path)  # its schema checked all the same: an empty file of other types is a writer to fix
                continue
            first = 0
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                if n:
                    units.append(Unit(path, g, first, n))
                first += n
        self.files = skip_empty(self.files, empty, "is an empty Parquet file (0 rows)", say_skipped)
        return units

    def has_rows(self, path: str) -> bool:
        """Whether ``path`` holds a row (its footer's count), without reading it: the files :meth:`units` reads."""
        return bool(self._open(path).metadata.num_rows)

    def check_types(self, reference: ParquetSource) -> None:
        """Refuse these files (``data.eval_path``'s, say) where a column read holds another kind of values than in
        ``reference``'s (``data.path``'s): the first file of each speaks for its source, whose own files agree
        (:meth:`units`).

        Raises:
            DataError: naming the column, both files and the fix (:func:`type_clash`).
        """
        mine, theirs = (plain_schema(source._open(source.files[0]).schema_arrow) for source in (self, reference))
        if (clash := type_clash(self.columns, (reference.files[0], theirs), (self.files[0], mine))) is not None:
            raise clash

    def _open(self, path: str) -> pq.ParquetFile:
        remote = uris.is_uri(path)
        if remote and path in self._footers:
            fs, rest = stores.arrow_filesystem(path)
            try:
                return pq.ParquetFile(rest, filesystem=fs, metadata=self._footers[path], pre_buffer=True)
            except OSError as e:
                raise stores.store_error(path, e) from None
        if stores.file_size(path) == 0:
            raise DataError(f"{path} is an empty file (0 bytes). Fix: remove it from data.path, or write it again")
        try:
            if remote:
                fs, rest = stores.arrow_filesystem(path)
                f = pq.ParquetFile(rest, filesystem=fs, pre_buffer=True)
                self._footers[path] = f.metadata
            else:
                f = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            if (refused := stores.failure(path, e)) is not None:
                raise refused from None
            head = read_head(path)
            if not head.startswith(PARQUET_MAGIC) and looks_like_text(head):
                first = head.split(b"\n", 1)[0].decode("utf-8", errors="replace").rstrip("\r")
                raise DataError(
                    f"{path} is not a Parquet file: it does not begin with Parquet's magic bytes {PARQUET_MAGIC.decode()}, and it "
                    f"looks like text (first line {first[:120]!r}). Fix: use data=csv for delimited text (CSV, TSV), or "
                    f"data=criteo for Criteo's TSV files; Parquet files come from python -m recsys_runner.data convert"
                ) from None
            raise DataError(
                f"{path} is not a readable Parquet file ({str(e).splitlines()[0]}): it is truncated or corrupt. "
                f"Fix: write it again, or remove it from data.path"
            ) from None
        names = f.schema_arrow.names
        check_unique_names(path, names, "its schema", PARQUET_REPEATS_FIX, self.columns)
        missing = [c for c in self.columns if c not in names]
        if missing:
            lacks = f"{path} has no column {missing[0]!r}" + (f" (nor {missing[1:]})" if len(missing) > 1 else "") + f"; its columns are {names}"
            if self.reference is not None and self._has(self.reference, missing[0]):
                raise DataError(lacks_training_column(path, missing, f"its columns are {names}", self.reference, self.path_key, self.what))
            if (holder := self._holding(missing[0], path)) is not None:
                raise DataError(f"{lacks}, but {holder} has it: files read together hold the same columns. Fix: write {path} with the "
                                f"column, or remove it from the setting that names it (data.path, data.eval_path)")
            raise DataError(f"{lacks}{closest_column(missing[0], names)}. Fix: correct the column names in data.label(s) / data.dense / "
                            f"data.sparse")
        return f

    def follow_training(self, first: str, train: ParquetSource, key: str, what: str) -> None:
        """Read these files as files with the training files' columns (``first``: the first training file; ``train`` its
        source), named by ``key`` and each a ``what`` in messages (:meth:`TabularData.open_files`)."""
        self.reference, self.path_key, self.what = first, key, what

    def _has(self, path: str, column: str) -> bool:
        """Whether the Parquet file ``path`` (another source's, already read) holds ``column``, by its footer."""
        fs, rest = stores.arrow_filesystem(path)
        try:
            return column in pq.read_schema(rest, filesystem=fs).names
        except (pa.ArrowException, OSError):
            return False

    def _holding(self, column: str, path: str) -> str | None:
        """The first of :attr:`files` (not ``path``) if it holds ``column``: then ``path`` is the odd file out, not the
        column name a mistake (a schema inferred from the first file, or written for it, names what the first file has)."""
        first = self.files[0]
        if first == path:
            return None
        try:
            return first if column in self._open(first).schema_arrow.names else None
        except DataError:  # the first file lacks it too, or cannot be read: the names are the mistake to report
            return None

    def sample(self, num_rows: int, spread: bool = False) -> pa.Table:
        """``num_rows`` rows of the files, every column, to infer a schema and fit encoders from: the first ones, or with
        ``spread`` rows spread over the files (:meth:`_spread`, :mod:`~recsys_runner.data.files.spread_sample`); every row, in order, where the files hold no more.

        Files after the first whose columns are named otherwise are not sampled (infer from those seen so far).

        Raises:
            DataError: the files hold no rows; a file is unreadable, or holds a column as another kind of values than the first.
        """
        if not spread:
            return self._head(num_rows)
        groups = self._like_row_groups()
        if sum(n for *_, n in groups) <= num_rows:
            return self._head(num_rows)  # every row, read exactly as the head sample reads it
        return self._spread(groups, num_rows)

    def _like_row_groups(self) -> list[tuple[str, int, int]]:
        """Each row group (file, index, rows) of the files, in order, up to the first file with rows whose columns are named
        otherwise than the first's (the head sample stops there too), after checking that their types agree
        (:func:`type_clash`); from the footers alone."""
        groups: list[tuple[str, int, int]] = []
        first: tuple[str, pa.Schema] | None = None
        for path in self.files:
            f = self._open(path)
            schema = plain_schema(f.schema_arrow)
            first = first or (path, schema)
            if schema.names != first[1].names:
                if f.metadata.num_rows:
                    break
                continue
            unique = [n for n in first[1].names if n not in repeated_names(first[1].names)]
            if (clash := type_clash(unique, first, (path, schema))) is not None:
                raise clash
            meta = f.metadata
            groups.extend((path, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups) if meta.row_group(g).num_rows)
        return groups

    def _spread(self, groups: list[tuple[str, int, int]], num_rows: int) -> pa.Table:
        """``num_rows`` rows of the row groups ``groups`` (holding more), in the runs
        :func:`~recsys_runner.data.files.spread_sample.group_runs` places: each row group read by one pass that stops at
        its last run's last row."""
        tables: list[pa.Table] = []
        for (path, g), runs in group_runs(groups, num_rows).items():
            f = self._open(path)
            batches = f.iter_batches(batch_size=min(runs[-1][1], self.read_rows), row_groups=[g], use_threads=False)
            try:
                tables.extend(take_runs((without_repeats(decoded(pa.Table.from_batches([rb]))) for rb in batches), runs))
            except (pa.ArrowException, OSError) as e:
                raise DataError(f"{path}, row group {g}: its rows cannot be read to infer a schema ({str(e).splitlines()[0]}); the "
                                f"file is corrupt. Fix: write it again, or remove it from data.path") from None
        return _concat(tables).combine_chunks()  # one chunk, not one per run: the fit's computations read it whole

    def _head(self, num_rows: int) -> pa.Table:
        """The first ``num_rows`` rows of the files (in order), every column."""
        tables: list[pa.Table] = []
        wanted = num_rows
        first: tuple[str, pa.Schema] | None = None
        for path in self.files:
            f = self._open(path)
            first = first or (path, plain_schema(f.schema_arrow))
            unique = [n for n in first[1].names if n not in repeated_names(first[1].names)]
            if f.schema_arrow.names == first[1].names and (clash := type_clash(unique, first, (path, plain_schema(f.schema_arrow)))):
                raise clash
            try:
                for rb in f.iter_batches(batch_size=min(wanted, self.read_rows), use_threads=False):
                    table = without_repeats(decoded(pa.Table.from_batches([rb])))
                    if tables and table.column_names != tables[0].column_names:
                        return _concat(tables)
                    tables.append(table)
                    wanted -= rb.num_rows
                    if wanted <= 0:
                        return _concat(tables)
            except (pa.ArrowException, OSError) as e:
                raise DataError(f"{path}: its first rows cannot be read to infer a schema ({str(e).splitlines()[0]}); the file is "
                                f"corrupt. Fix: write it again, or remove it from data.path") from None
        if not tables:  # an empty day: said as the reader says it (also when a checkpoint's encoders infer nothing)
            skip_empty(self.files, list(self.files), "is an empty Parquet file (0 rows)")
        return _concat(tables)

    def read(self, unit: Unit) -> Iterator[tuple[pa.Table, np.ndarray]]:
        """The row group as tables of at most ``read_rows`` rows, and the 0-based file row of each row."""
        f = self._open(unit.path)
        first = unit.first_row
        try:
            for rb in f.iter_batches(batch_size=self.read_rows, row_groups=[unit.index], columns=self.columns, use_threads=False):
                yield decoded(pa.Table.from_batches([rb])), np.arange(first, first + rb.num_rows)
                first += rb.num_rows
        except (pa.ArrowException, OSError) as e:
            if (refused := stores.failure(f"{unit.path} (row group {unit.index})", e)) is not None:
                raise refused from None
            raise DataError(
                f"{unit.path}, row group {unit.index}: cannot be read ({str(e).splitlines()[0]}); the file is corrupt. "
                f"Fix: write it again, or remove it from data.path"
            ) from None


def _concat(tables: list[pa.Table]) -> pa.Table:
    """Tables of files with the same columns as one (a column's integer or float widths may differ between files, as
    :func:`type_clash` allows: widened to one)."""
    return pa.concat_tables(tables, promote_options="permissive")
