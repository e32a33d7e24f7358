"""File sources: cut the files ``data.path`` names (:mod:`recsys_runner.data.locate`) into units of known row counts, read them.

A :class:`Unit` is the smallest piece of a file that is read on its own: a Parquet row group, a
block of ``block_rows`` lines of a CSV file (found by one newline scan of the file, no parsing), or a whole
compressed text file (gzip, bz2, zstd: :mod:`~recsys_runner.data.files.compression`), whose lines are counted by
decompressing it once and which is read as one stream. Units know their row counts up front, so rows can be split
between ranks and workers exactly. Reading a unit streams Arrow tables of bounded size; nothing reads a whole file.

This module holds the unit and what the sources share (a file's first bytes, the read errors, empty files skipped,
the checks of column names); the Parquet source is :mod:`~recsys_runner.data.files.parquet_source`, the delimited-text
source :mod:`~recsys_runner.data.files.csv_source`."""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Collection
from dataclasses import dataclass

import pyarrow as pa

from recsys_runner import stores, uris
from recsys_runner.data.encoding.roles import REPEATED_KEY
from recsys_runner.errors import DataError, UserError

log = logging.getLogger(__name__)

PARQUET_MAGIC = b"PAR1"
"""The 4 bytes every Parquet file begins (and ends) with."""

SNIFF_BYTES = 4096
"""How many first bytes of a file tell its format (Parquet's magic, text or binary, a compression)."""


def read_head(path: str) -> bytes:
    """The first bytes of ``path``, to recognize its format."""
    try:
        with stores.open_input(path) as f:
            return f.read(SNIFF_BYTES)
    except OSError as e:
        raise unreadable(path, e) from None


def unreadable(path: str, e: OSError) -> UserError:
    """The error for a file that cannot be opened or read: the store's own (naming the store) for a URI, else one naming the
    path and the fix."""
    if uris.is_uri(path):
        return stores.store_error(path, e)
    return DataError(f"{path} cannot be read ({e.strerror or e}). Fix: check that it exists and that you may read it, or remove it from data.path")


def skip_empty(files: list[str], empty: list[str], what: str, say: bool = True, key: str = "the setting that names them") -> list[str]:
    """``files`` less the ``empty`` ones, said in one log line (rank 0; not when ``say`` is false: files already said, as
    ``data.eval_path`` naming ``data.path``'s folder); every file empty is an error (``what``: how the first looks) naming
    ``key``, the setting that named the files (``data.items.path``), as the fix to change.

    Why: Spark, Hive and pandas' partitioned writers leave a part file per partition, also one with no rows (a header
    line; a Parquet footer of 0 rows). Such a file holds nothing to train on, so refusing it would only make the user delete
    it by hand; skipping it silently would hide a folder that lost its data, hence the count, and the error when nothing
    is left.

    Raises:
        DataError: every file is empty, naming the first.
    """
    if not empty:
        return files
    if len(empty) == len(files):
        every = f"{files[0]} {what}" + (f", as do all {len(files)} files read with it" if len(files) > 1 else "")
        raise DataError(f"{every}: there are no rows to read. Fix: point {key} at files with rows, or write the data again")
    if say and int(os.environ.get("RANK", "0")) == 0:
        shown = ", ".join(os.path.basename(f) for f in empty[:3]) + (", …" if len(empty) > 3 else "")
        log.info("%d of %d files in %s have no rows and are skipped (%s): empty part files, as partitioned writers leave them",
                 len(empty), len(files), os.path.dirname(empty[0]) or ".", shown)
    skipped = set(empty)
    return [f for f in files if f not in skipped]


def repeated_names(names: list[str]) -> list[str]:
    """The names that ``names`` holds more than once, each once, in order."""
    return list(dict.fromkeys(n for i, n in enumerate(names) if n in names[:i]))


def check_unique_names(path: str, names: list[str], listed_by: str, fix: str, read: Collection[str] | None = None) -> None:
    """Refuse a file whose columns (``names``, as ``listed_by`` lists them: its header line, its Parquet schema, a setting)
    repeat the name of a column that is ``read`` (``None``: any name), with ``fix``.

    Why: every column is read by its name. Of two columns of one name a CSV reader read the first, silently, and Arrow
    refused a Parquet file's with a ``KeyError`` from deep inside it; which of them was meant cannot be told. A repeated
    name the run does not read (two ``unused`` columns of an export) is no such question, and such columns are left
    alone: a schema inferred from the files never proposes them (:func:`without_repeats`).

    Raises:
        DataError: naming the file, the first repeated name read and how often it occurs.
    """
    repeated = [n for n in repeated_names(names) if read is None or n in read]
    if repeated:
        raise DataError(f"{path}: {listed_by} names the column {repeated[0]!r} {names.count(repeated[0])} times (its columns are "
                        f"{names}); columns are read by their names, so which one is meant cannot be told. Fix: {fix}")


def without_repeats(table: pa.Table) -> pa.Table:
    """``table`` (a sample of a file, every column) without the columns whose name it repeats, those names listed in its
    schema's metadata (:data:`~recsys_runner.data.encoding.roles.REPEATED_KEY`) for an inferred schema to say they were
    left out.

    Why: which of two columns of one name holds what the name says cannot be told, so none of them is read; the sample a
    schema is inferred from leaves them out rather than propose one, and a run that names such a column is refused
    (:func:`check_unique_names`)."""
    repeated = repeated_names(table.column_names)
    if not repeated:
        return table
    kept = table.select([i for i, n in enumerate(table.column_names) if n not in repeated])
    return kept.replace_schema_metadata({**(kept.schema.metadata or {}), REPEATED_KEY: "\n".join(repeated).encode()})


def looks_like_text(head: bytes) -> bool:
    """Whether a file's first bytes look like text (no NUL byte: binary formats have plenty)."""
    return b"\x00" not in head


@dataclass(frozen=True)
class Unit:
    """A row group of a Parquet file or a block of lines of a text file."""

    path: str
    index: int
    """Row-group number, or block number."""
    first_row: int
    """0-based row number (in the file) of the unit's first row."""
    num_rows: int
    byte_range: tuple[int, int] = (0, 0)
    """Text files: the block's ``[start, stop)`` byte offsets."""
    compression: str | None = None
    """A compressed text file's compression: the unit is the whole file, read as one stream from its start."""
    row_block: bool = False
    """A block of rows of an array file (a day of ``.npy`` files, :mod:`~recsys_runner.data.files.npy_source`)."""

    @property
    def part(self) -> str:
        if self.byte_range != (0, 0) or self.compression is not None or self.row_block:
            return f"rows {self.first_row}-{self.first_row + self.num_rows - 1}"
        return f"row group {self.index}"


def closest_column(name: str, names: list[str]) -> str:
    """`` (did you mean 'is_clicked'?)`` when one of the file's columns ``names`` is spelled close to the missing ``name`` (a
    label a preset names ``click`` that a copy of the file calls otherwise), else ``""``."""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def lacks_training_column(path: str, missing: list[str], listed: str, reference: str, path_key: str, what: str) -> str:
    """The message for an eval file (``path``, named by ``path_key``) without a column the training file ``reference`` holds:
    the file is the mistake, not the config's column names, so the fix is to the file or the setting naming it.

    Why: the generic message ("correct the column names in data.label(s) / data.dense / data.sparse") sent the user to
    the config, whose names are right: they are the training files' columns."""
    nor = f" (nor {missing[1:]})" if len(missing) > 1 else ""
    return (f"{path} has no column {missing[0]!r}{nor} ({listed}), but the training files (data.path) have it, e.g. {reference}: "
            f"{what}s ({path_key}) are read with the training files' columns. Fix: write {path} with the column {missing[0]!r}, or "
            f"point {path_key} at files that hold the training files' columns")
