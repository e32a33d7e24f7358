"""``data.items.path`` read as files: one items file, or a folder (a glob, an object-store prefix) of part files as
Spark, Hive or pandas write a table, listed, checked and read as the training files are.

Why here: the catalogue's encoding (:mod:`recsys_runner.data.catalogue.item_files`) is the same for one file and for
many; which files a setting names (:func:`~recsys_runner.data.locate.resolve_files`), which of them hold no rows
(:func:`~recsys_runner.data.files.sources.skip_empty`) and whether Parquet parts agree on their columns' types
(:func:`~recsys_runner.data.files.parquet_source.type_clash`) are the file sources' concerns, shared with ``data.path``. The
parts' digest goes into the run's dataset inputs (``split_files()["items"]``), so a catalogue folder that grew or changed
since a checkpoint was trained is a warning at evaluate, predict and resume, not a silent change of the ranked items.

Delimited-text parts are read by the training files' own source (:class:`~recsys_runner.data.files.csv_source.CsvSource`)
with the training files' reader settings (:func:`items_text`): a catalogue exported alongside the interactions, with the
same null markers and the same header convention, encodes the same raw value to the same id; a catalogue laid out
otherwise says so with ``data.items.header`` / ``data.items.column_names``, and one that does not read as configured is
an error naming the file and the key, not items read under the wrong names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys_runner import stores
from recsys_runner.data.catalogue.item_files import ItemParts
from recsys_runner.data.files.csv_source import CsvSource
from recsys_runner.data.files.layout import looks_like_data, split_fields
from recsys_runner.data.files.parquet_source import type_clash
from recsys_runner.data.files.sources import PARQUET_MAGIC, read_head, skip_empty
from recsys_runner.data.files.tabular_config import CsvDataConfig, TabularDataConfig
from recsys_runner.data.locate import PARQUET_SUFFIXES, resolve_files
from recsys_runner.errors import DataError, UserError

__all__ = ["ItemsText", "items_text", "read_item_parts"]

log = logging.getLogger(__name__)

KEY = "data.items.path"
BLOCK_ROWS = 1 << 16
"""Lines per unit of a plain-text items file (the whole catalogue is read, so this only bounds one parse)."""


@dataclass(frozen=True)
class ItemsText:
    """How delimited-text items files are read (:func:`items_text`)."""

    delimiter: str
    header: bool
    """Each file's first line names its columns."""
    column_names: list[str] | None
    """All columns in file order (``None``: the header line's)."""
    null_values: list[str]
    on_bad_rows: str
    follows_training: bool
    """``header`` is the training files' (``data.items.header=null``): a file laid out otherwise is refused, naming the key."""
    names_said: str
    """What names the columns of a file without a header line, for messages."""
    names_key: str | None
    """The setting ``column_names`` comes from (``data.items.column_names``, ``data.column_names``), ``None``: each file's
    header line; a configured column missing from those names is said to be that setting's, the likelier mistake."""
    own_layout: bool
    """``data.items.header`` or ``data.items.column_names`` is set: said to have no effect on Parquet items files."""


def items_text(config: TabularDataConfig) -> ItemsText:
    """The reader settings of ``config``'s text items files: the training files' delimiter, null markers and bad-row
    policy (beside Parquet or Criteo training files: ``,``, empty fields null), their header convention unless
    ``data.items.header`` says otherwise, and the catalogue's own ``data.items.column_names``, else its header's names, else
    (no header line) ``data.column_names``.

    Why the training files' settings: a catalogue is exported with the interactions, by the same tool; read with other
    null markers, an ``NA`` item feature would be an id of its own, an item the training rows never showed.
    """
    items = config.items
    csv = config if isinstance(config, CsvDataConfig) else None
    header = (csv is None or csv.header is not False) if items.header is None else items.header
    trained = csv.column_names if csv is not None else None
    names = items.column_names or (None if header else trained)
    assert header or names, "TabularDataConfig checks that a header-less catalogue has column names"
    said = ("data.items.column_names" if items.column_names else
            "data.column_names (the training files' columns, in file order; data.items.column_names names the catalogue's own)"
            if trained else "data.items.column_names=[...] (to set: the names of all its columns, in file order)")
    return ItemsText(delimiter=(csv.delimiter if csv is not None else None) or ",", header=header, column_names=names,
                     null_values=list(csv.null_values) if csv is not None else [""], on_bad_rows=config.on_bad_rows,
                     follows_training=csv is not None and items.header is None, names_said=said,
                     names_key="data.items.column_names" if items.column_names else None if header else "data.column_names",
                     own_layout=items.header is not None or items.column_names is not None)


def read_item_parts(path: str, columns: list[str], text: ItemsText) -> ItemParts:
    """``columns`` of the items file ``path``, or of every part file of the folder (glob, prefix) it names, in file
    order: Parquet when the files' names end in ``.parquet`` (``.parq``, ``.pq``), else delimited text read with ``text``
    (every column as text, missing values null, as the training reader gives text columns to the encoder).

    Parts without rows are skipped, said in one line (:func:`~recsys_runner.data.files.sources.skip_empty`): a
    partitioned writer leaves them.

    Raises:
        DataError: the path names no file, or a folder of Parquet parts and other files; a part is empty (0 bytes),
            unreadable, laid out otherwise than ``text`` says (a header line where none is expected or none where one is, a
            line of another number of fields than the names), lacks one of ``columns`` or holds a column as another kind
            of values than the first part; every part is without rows. Each names the file and the fix.
    """
    files = resolve_files(path, KEY, None)
    parquet = [f for f in files if f.endswith(PARQUET_SUFFIXES)]
    if parquet and len(parquet) < len(files):
        other = next(f for f in files if not f.endswith(PARQUET_SUFFIXES))
        raise DataError(f"{KEY}={path!r} names Parquet part files ({parquet[0]}) and other files ({other}): the catalogue is read "
                        f"as one table, of one format. Fix: point {KEY} at a folder of one format, or remove {other}")
    if not parquet:
        return _read_text(path, files, columns, text)
    if text.own_layout:
        log.warning("%s=%r is Parquet: data.items.header and data.items.column_names lay out delimited text and have no effect. "
                    "Fix: drop them", KEY, path)
    tables = [_read_parquet(f, columns, path) for f in files]
    empty = [f for f, t in zip(files, tables, strict=True) if t.num_rows == 0]
    kept = skip_empty(files, empty, "has no items (no rows)", key=KEY)
    tables = [t for t in tables if t.num_rows]
    for f, t in zip(kept[1:], tables[1:], strict=True):
        if (clash := type_clash(columns, (kept[0], tables[0].schema), (f, t.schema), KEY)) is not None:
            raise clash
    file_rows = np.concatenate([np.arange(t.num_rows) for t in tables])
    return ItemParts(path, tuple(kept), _starts(tables), pa.concat_tables(tables, promote_options="permissive"), file_rows, None)


def _starts(tables: list[pa.Table]) -> np.ndarray:
    """The first row of each of ``tables`` in their concatenation."""
    return np.cumsum([0, *(t.num_rows for t in tables)])[:-1]


def _what(path: str, setting: str) -> str:
    """One items file, for a message: ``data.items.path`` itself, or a part of the folder it names."""
    return f"{path} (data.items.path)" if path == setting else f"{path} (a part of data.items.path={setting!r})"


def _missing(what: str, column: str, names: list[str], named_by: str | None = None) -> DataError:
    """A configured column the file lacks; ``named_by``: the setting that named the file's columns where its header did
    not (``data.items.column_names``), so the message says where ``names`` come from and that it may be the mistake."""
    if named_by is None:
        return DataError(f"{what} has no column {column!r}, which data.items names; its columns are {names}. "
                         f"Fix: add the column to the file, or correct data.items.id / features / popularity")
    return DataError(f"{what} has no column {column!r}, which data.items names; {named_by} names its columns {names}. "
                     f"Fix: correct {named_by} (every column of the file, in file order), or data.items.id / features / "
                     f"popularity")


def _read_parquet(path: str, columns: list[str], setting: str) -> pa.Table:
    """``columns`` of one Parquet items file; ``setting``: ``data.items.path`` as given (a file, or the folder of this part)."""
    what = _what(path, setting)
    try:
        if stores.file_size(path) == 0:
            raise DataError(f"{what} is an empty file (0 bytes). Fix: remove it, or write it again")
        fs, where = stores.arrow_filesystem(path)
        names = pq.read_schema(where, filesystem=fs).names
        if missing := [c for c in columns if c not in names]:
            raise _missing(what, missing[0], names)
        return pq.read_table(where, columns=columns, filesystem=fs)
    except (OSError, pa.ArrowException) as e:
        raise _unreadable(path, what, e) from None


def _unreadable(path: str, what: str, e: Exception) -> UserError:
    """The error of an items file that cannot be read: the store's refusal (:func:`~recsys_runner.stores.failure`), or
    the reader's first line and the fix."""
    if (refused := stores.failure(path, e, key=KEY)) is not None:
        return refused
    return DataError(f"{what} cannot be read ({str(e).splitlines()[0]}). Fix: correct or write the file again, or point {KEY} "
                     f"at the items file or folder (Parquet, or delimited text as data.items.header and data.delimiter say)")


def _read_text(path: str, files: list[str], columns: list[str], text: ItemsText) -> ItemParts:
    """The text items ``files`` of ``data.items.path`` ``path``, read by the training files' source with ``text``'s
    settings; each file's layout checked first (:func:`_check_layout`), so a wrong one is said with the catalogue's keys."""
    source = CsvSource(files, columns, delimiter=text.delimiter, header=text.header, column_names=text.column_names,
                       null_values=text.null_values, block_rows=BLOCK_ROWS, on_bad_rows=text.on_bad_rows,
                       header_key="data.items.header", follows_training=text.follows_training, names_key="data.items.column_names",
                       names_said=text.names_said, path_key=KEY, what="items file")
    pieces: dict[str, list[tuple[pa.Table, np.ndarray]]] = {f: [] for f in files}
    try:
        for f in files:
            _check_layout(f, source, columns, text, _what(f, path))
        for unit in source.units():  # header-alone parts skipped, said in one line; every part so: an error
            pieces[unit.path].extend(source.read(unit))
    except (OSError, pa.ArrowException) as e:
        failed = getattr(e, "filename", None) or path
        raise _unreadable(str(failed), _what(str(failed), path), e) from None
    if source.num_bad_rows:
        log.warning("%s (data.items.path): %d bad lines skipped (data.on_bad_rows=skip): their items are not in the catalogue",
                    path, source.num_bad_rows)
    kept = [f for f in source.files if pieces[f]]
    tables = [pa.concat_tables([t for t, _ in pieces[f]]) for f in kept]
    file_rows = np.concatenate([rows for f in kept for _, rows in pieces[f]])
    return ItemParts(path, tuple(kept), _starts(tables), pa.concat_tables(tables), file_rows, 2 if text.header else 1)


def _check_layout(path: str, source: CsvSource, columns: list[str], text: ItemsText, what: str) -> None:
    """Refuse a text items file that would be misread: empty, Parquet or binary, a header line where ``text`` expects
    none (or data where it expects one), a column of ``columns`` it lacks, or, without a header line, a first line of
    another number of fields than the names."""
    if stores.file_size(path) == 0:
        raise DataError(f"{what} is an empty file (0 bytes). Fix: remove it, or write it again")
    if read_head(path).startswith(PARQUET_MAGIC):
        raise DataError(f"{what} is a Parquet file (it begins with {PARQUET_MAGIC.decode()}), but its name does not end in "
                        f"{', '.join(PARQUET_SUFFIXES)}, so it would be read as delimited text. Fix: rename it, e.g. "
                        f"{path}.parquet")
    names = source.headers.inspect(path, None)[0]
    lines = source.headers.first_lines(path)
    if text.header:
        if (missing := [c for c in columns if c not in names]) and looks_like_data(lines, text.delimiter):
            raise DataError(source.headers.not_a_header(path, missing[0], lines[0]))
        if missing:
            raise _missing(what, missing[0], names, text.names_key)
        return
    fields = len(split_fields(lines[0], text.delimiter)) if lines else len(names)
    if fields != len(names):
        raise DataError(f"{what}: its first line {lines[0][:100]!r} has {fields} field(s) split by {text.delimiter!r}, but "
                        f"{text.names_said} names {len(names)} columns {names}: the items file has no header line and is laid "
                        f"out otherwise. Fix: data.items.column_names=[...] (its {fields} columns, in file order)")
    if missing := [c for c in columns if c not in names]:
        raise _missing(what, missing[0], names, text.names_key)
