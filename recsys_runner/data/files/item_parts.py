"""``data.items.path`` read as files: one items file, or a folder (a glob, an object-store prefix) of part files as
Spark, Hive or pandas write a table, listed, checked and read as the training files are.

Why here: the catalogue's encoding (:mod:`recsys_runner.data.catalogue.item_files`) is the same for one file and for
many; which files a setting names (:func:`~recsys_runner.data.locate.resolve_files`), which of them hold no rows
(:func:`~recsys_runner.data.files.sources.skip_empty`) and whether Parquet parts agree on their columns' types
(:func:`~recsys_runner.data.files.sources.type_clash`) are the file sources' concerns, shared with ``data.path``. The
parts' digest goes into the run's dataset inputs (``split_files()["items"]``), so a catalogue folder that grew or changed
since a checkpoint was trained is a warning at evaluate, predict and resume, not a silent change of the ranked items.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recsys_runner import stores
from recsys_runner.data.catalogue.item_files import ItemParts
from recsys_runner.data.files import compression as compressed
from recsys_runner.data.files.sources import PARQUET_MAGIC, read_head, skip_empty, type_clash
from recsys_runner.data.locate import PARQUET_SUFFIXES, resolve_files
from recsys_runner.errors import DataError

__all__ = ["read_item_parts"]

KEY = "data.items.path"


def read_item_parts(path: str, columns: list[str], delimiter: str) -> ItemParts:
    """``columns`` of the items file ``path``, or of every part file of the folder (glob, prefix) it names, in file
    order: Parquet when the files' names end in ``.parquet`` (``.parq``, ``.pq``), else delimited text with a header line
    (``delimiter``; every column read as text, as the training reader gives text columns to the encoder).

    Parts without rows are skipped, said in one line (:func:`~recsys_runner.data.files.sources.skip_empty`): a
    partitioned writer leaves them.

    Raises:
        DataError: the path names no file, or a folder of Parquet parts and other files; a part is empty (0 bytes),
            unreadable, lacks one of ``columns`` or holds a column as another kind of values than the first part; every
            part is without rows. Each names the file and the fix.
    """
    files = resolve_files(path, KEY, None)
    parquet = [f for f in files if f.endswith(PARQUET_SUFFIXES)]
    if parquet and len(parquet) < len(files):
        other = next(f for f in files if not f.endswith(PARQUET_SUFFIXES))
        raise DataError(f"{KEY}={path!r} names Parquet part files ({parquet[0]}) and other files ({other}): the catalogue is read "
                        f"as one table, of one format. Fix: point {KEY} at a folder of one format, or remove {other}")
    tables = [_read(f, columns, delimiter, path) for f in files]
    empty = [f for f, t in zip(files, tables, strict=True) if t.num_rows == 0]
    kept = skip_empty(files, empty, "has no items (no rows)")
    tables = [t for t in tables if t.num_rows]
    for f, t in zip(kept[1:], tables[1:], strict=True):
        if (clash := type_clash(columns, (kept[0], tables[0].schema), (f, t.schema), KEY)) is not None:
            raise clash
    starts = np.cumsum([0, *(t.num_rows for t in tables)])[:-1]
    return ItemParts(path, tuple(kept), starts, pa.concat_tables(tables, promote_options="permissive"), text=not parquet)


def _read(path: str, columns: list[str], delimiter: str, setting: str) -> pa.Table:
    """``columns`` of one items file (text columns as strings; a gzip, bz2 or zstd text file decompressed as the training
    reader does); ``setting``: ``data.items.path`` as given (a file, or the folder of this part)."""
    what = f"{path} (data.items.path)" if path == setting else f"{path} (a part of data.items.path={setting!r})"
    parquet = path.endswith(PARQUET_SUFFIXES)
    try:
        if stores.file_size(path) == 0:
            raise DataError(f"{what} is an empty file (0 bytes). Fix: remove it, or write it again")
        fs, where = stores.arrow_filesystem(path)
        if parquet:
            names = pq.read_schema(where, filesystem=fs).names
        else:
            head = read_head(path)
            if head.startswith(PARQUET_MAGIC):
                raise DataError(f"{what} is a Parquet file (it begins with {PARQUET_MAGIC.decode()}), but its name does not end in "
                                f"{', '.join(PARQUET_SUFFIXES)}, so it would be read as delimited text. Fix: rename it, e.g. "
                                f"{path}.parquet")
            codec = compressed.detect(path, head)
            with compressed.open_text(path, codec) as f:
                names = f.readline().decode("utf-8").rstrip("\r\n").split(delimiter)
        missing = [c for c in columns if c not in names]
        if missing:
            raise DataError(f"{what} has no column {missing[0]!r}, which data.items names; its columns are {names}. "
                            f"Fix: add the column to the file, or correct data.items.id / features / popularity")
        if parquet:
            return pq.read_table(where, columns=columns, filesystem=fs)
        with compressed.open_text(path, codec) as f:
            return pacsv.read_csv(f, parse_options=pacsv.ParseOptions(delimiter=delimiter),
                                  convert_options=pacsv.ConvertOptions(include_columns=columns,
                                                                       column_types=dict.fromkeys(columns, pa.string())))
    except UnicodeDecodeError:
        raise DataError(f"{what}: its header line is not UTF-8 text. Fix: write the file as UTF-8 (Parquet, or delimited text "
                        f"with a header line)") from None
    except (OSError, pa.ArrowException) as e:
        if (refused := stores.failure(path, e, key=KEY)) is not None:
            raise refused from None
        raise DataError(f"{what} cannot be read ({str(e).splitlines()[0]}). Fix: correct or write the file again, or point {KEY} "
                        f"at the items file or folder (Parquet, or delimited text with a header line and data.delimiter's "
                        f"{delimiter!r} between fields)") from None
