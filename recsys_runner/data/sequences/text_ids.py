"""A text log's id columns read without merging ids: the check that inferred types keep every raw id, and ``--ids-as-text``.

Arrow infers each CSV column's type, so an all-digit id column is read as integers: ``"007"`` and ``"7"`` become the
one id 7 (also ``"+7"``, ``" 7"``), ``"1e3"`` and ``"1000"`` the float 1000, an id beyond int64 a float. Reading every
id column as text would renumber every existing integer-id log (integers are numbered by value, text by its bytes), so
the default stays inference, and :func:`check_lossless` refuses a file where it is lossy: a raw id (user, item, side)
whose text is not what its inferred value writes back (what the vocab files would hold). ``--ids-as-text``
(:func:`as_text`) reads the id columns as text instead: every distinct text one id. Vectorized: one more read of the
id columns as text, one cast and one comparison per column. May import ``stores`` and ``errors``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from recsys_runner import stores
from recsys_runner.errors import DataError

__all__ = ["as_text", "check_lossless", "check_promotion", "read_text_columns"]


def read_text_columns(path: str, delimiter: str, columns: list[str], column_names: list[str] | None = None) -> pa.Table:
    """``columns`` of the delimited text file ``path`` read as text, exactly as written (an empty field is ``""``);
    ``column_names``: the file's columns for a file without a header line (``--column-names``)."""
    with stores.open_input(path) as stream:
        return pacsv.read_csv(stream, read_options=pacsv.ReadOptions(column_names=column_names),
                              parse_options=pacsv.ParseOptions(delimiter=delimiter),
                              convert_options=pacsv.ConvertOptions(include_columns=columns, column_types=dict.fromkeys(columns, pa.string())))


def inferred_id_columns(table: pa.Table, columns: list[str]) -> list[str]:
    """Those of the id ``columns`` that Arrow's inference read as something else than text: the ones to check."""
    return [c for c in columns if not pa.types.is_string(table.schema.field(c).type)]


def check_lossless(typed: pa.Table, texts: pa.Table, where: str, roles: dict[str, str]) -> None:
    """Refuse a text log whose inferred id columns (``typed``) lose a raw id: one whose text (``texts``, the same columns
    read as text) differs from what its value writes back. ``roles``: each column's flag (``--user``) for the message.

    Raises:
        DataError: naming the file, the column, the row, the raw id, what it is read as (and another raw id it would
            merge with, when the file holds one) and the fix (``--ids-as-text``).
    """
    for column in texts.column_names:
        values = typed.column(column).combine_chunks()
        raw = texts.column(column).combine_chunks()
        written = values.cast(pa.string())
        lossy = pc.fill_null(pc.and_(values.is_valid(), pc.not_equal(raw, written)), False)
        if not pc.any(lossy).as_py():
            continue
        row = int(np.flatnonzero(np.asarray(lossy.to_numpy(zero_copy_only=False)))[0])
        value, reads = raw[row].as_py(), written[row].as_py()
        others = pc.fill_null(pc.and_(pc.equal(values, values[row]), pc.not_equal(raw, value)), False)
        if pc.any(others).as_py():
            other = int(np.flatnonzero(np.asarray(others.to_numpy(zero_copy_only=False)))[0])
            merged = f", the same id as {raw[other].as_py()!r} in row {other}: the two would be one {column} without a word"
        else:
            merged = f", so its vocab file would hold {reads!r}, not the id as logged, and any other text read as {reads!r} would be the same id"
        raise DataError(f"{where}, row {row} (0-based, header not counted): the {roles.get(column, 'id')} column {column!r} is read as "
                        f"{values.type} (Arrow infers each column's type), which reads the id {value!r} as {reads!r}{merged}. Ids spelled "
                        f"differently (leading zeros, a '+', spaces, '1e3', an id beyond int64) must stay apart. Fix: --ids-as-text "
                        f"(reads the id columns as text: every distinct text one id; a new mapping, numbered by text, recorded in "
                        f"vocab.json so a later --vocab run reads alike), or clean the log's {column} column")


def as_text(table: pa.Table, columns: list[str]) -> pa.Table:
    """``table`` with the id ``columns`` as text (``--ids-as-text``): integers as their decimal text, an empty text field
    missing (so the log is refused naming its row, as an empty field of an inferred column is)."""
    for column in columns:
        i = table.schema.get_field_index(column)
        arr = table.column(i)
        if pa.types.is_integer(arr.type) or pa.types.is_large_string(arr.type):
            arr = arr.cast(pa.string())
        if pa.types.is_string(arr.type):
            arr = pc.if_else(pc.equal(arr, ""), pa.scalar(None, pa.string()), arr)
        table = table.set_column(i, column, arr)
    return table


EXACT_FLOAT = 2**53
"""The largest magnitude below which every integer is exactly a float64: beyond it two ids can round to one float."""


def check_promotion(tables: list[pa.Table], files: list[str], ids: list[str]) -> None:
    """Refuse files of one log whose id column is integers in one and floats in another when joining them would merge
    ids: the files' tables are concatenated with the column promoted to float64, where an integer id beyond 2**53 rounds
    (``9007199254740993`` reads as ``9007199254740992``, another id). Below it the promotion is exact (``7`` and ``7.0``
    are one id, as in one file of floats), so such logs read as before.

    Raises:
        DataError: naming the file, the column, the id and what it would read as, and the fix (``--ids-as-text``).
    """
    for column in ids:
        types = [t.schema.field(column).type for t in tables]
        if not (any(pa.types.is_floating(t) for t in types) and any(pa.types.is_integer(t) for t in types)):
            continue
        for table, path, typ in zip(tables, files, types, strict=True):
            if not pa.types.is_integer(typ):
                continue
            values = table.column(column).combine_chunks()
            if typ.bit_width < 64:  # int32 and narrower are exact floats
                continue
            beyond = pc.greater(values, pa.scalar(EXACT_FLOAT, typ))
            if pa.types.is_signed_integer(typ):
                beyond = pc.or_(beyond, pc.less(values, pa.scalar(-EXACT_FLOAT, typ)))
            beyond = pc.fill_null(beyond, False)
            if pc.any(beyond).as_py():
                row = int(np.flatnonzero(np.asarray(beyond.to_numpy(zero_copy_only=False)))[0])
                value = values[row].as_py()
                float_file = files[next(i for i, t in enumerate(types) if pa.types.is_floating(t))]
                raise DataError(f"{path}, row {row} (0-based, header not counted): the id column {column!r} holds integers here but "
                                f"floats in {float_file}, so the files are joined as floats, which read the id {value} as "
                                f"{float(value):.0f}: ids beyond 2**53 would merge without a word. Fix: --ids-as-text (reads the id "
                                f"columns of every file as text), or write the {column} column as integers in every file")
