"""A sparse column's values as ids, by its encoding, and what a value that is no id is told — for the row encoder
(:class:`~recsys_runner.data.encoding.rows.Encoder`).

:func:`flat_ids` encodes one flat array of values (``id``, ``mod``, ``hash``, ``raw``, ``vocab``, ``bucketize``) and
marks the values that cannot be encoded; :func:`bad_id` says why such a value is no id of its column (with the training
setting that would take it, unless the encoder is a served model's, whose client cannot change the model);
:func:`float_ids` refuses a typed column of floats once for the whole column.

Apart from :mod:`~recsys_runner.data.encoding.rows`, which reads the columns of a table into flat arrays of values and
back into rows and keeps the bad-row bookkeeping (which rows are bad, skipped or counted; a vocabulary's OOV counts):
the rules here work on one flat array of values and one column's settings, and fitting
(:mod:`~recsys_runner.data.encoding.fit`) and the file readers (:mod:`~recsys_runner.data.files.tabular`) refuse float
ids with :func:`float_ids` too.

**Standalone on purpose**, like :mod:`~recsys_runner.data.encoding.rows`: NumPy, PyArrow,
:mod:`~recsys_runner.data.encoding.keys` and :mod:`~recsys_runner.data.encoding.values` only, and copied into the
MLflow model's ``code/`` (:data:`~recsys_runner.data.encoding.served.SHIPPED`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING or __package__:
    from .keys import as_ids, fnv1a64, parse_hex, parse_int, splitmix64
    from .values import bucket_ids, parse_numbers, vocab_rows
else:  # inside the MLflow model: the copies of the modules it imports beside this one in its code/ directory
    _CODE = __name__.removeprefix("recsys_sparse_ids")  # "_<hash>": this copy's code set (served.SHIPPED says why)
    _keys = importlib.import_module(f"recsys_keys{_CODE}")
    as_ids, fnv1a64, parse_hex, parse_int, splitmix64 = _keys.as_ids, _keys.fnv1a64, _keys.parse_hex, _keys.parse_int, _keys.splitmix64
    _values = importlib.import_module(f"recsys_values{_CODE}")
    bucket_ids, parse_numbers, vocab_rows = _values.bucket_ids, _values.parse_numbers, _values.vocab_rows


def flat_ids(col: Any, flat: pa.Array, vocabulary: Any = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Encode a flat array of values (no nulls) to ids by ``col.encoding``; also a mask of values that cannot be encoded
    (``None``: every value can). ``vocabulary``: an ``encoding: vocab`` column's, whose rows the values read."""
    flat = as_ids(flat)  # booleans: the ids 0/1
    is_text = pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type)
    if col.encoding == "bucketize":
        numbers, not_numbers = parse_numbers(flat)
        return bucket_ids(col, numbers, not_numbers), not_numbers
    if col.encoding == "vocab":
        return vocab_rows(vocabulary, flat, col.hex)
    if col.encoding == "hash":
        if is_text:
            return (fnv1a64(flat) % np.uint64(col.size)).astype(np.int64), None
        if not pa.types.is_integer(flat.type):
            return np.zeros(len(flat), np.int64), np.ones(len(flat), bool)
        v = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.int64).view(np.uint64)
        return (splitmix64(v) % np.uint64(col.size)).astype(np.int64), None
    if col.hex:
        if not is_text:
            return np.zeros(len(flat), np.int64), np.ones(len(flat), bool)
        values, wrong = parse_hex(flat)
    elif is_text and col.encoding == "raw":
        return raw_text(flat, col)
    elif is_text:
        values, wrong = parse_int(flat)
    elif pa.types.is_unsigned_integer(flat.type) and flat.type.bit_width == 64:
        raw = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.uint64)
        wrong = raw > np.uint64(np.iinfo(np.int64).max)  # would wrap to a negative int64
        values = np.where(wrong, np.uint64(0), raw).astype(np.int64)
    elif pa.types.is_integer(flat.type):
        values, wrong = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.int64), None
    else:
        return np.zeros(len(flat), np.int64), np.ones(len(flat), bool)
    if col.encoding == "mod":
        return np.mod(values, col.size), wrong
    limit = col.managed_collision.input_hash_size if col.managed_collision is not None else col.size
    out = (values < 0) | (values >= limit)
    return values, out if wrong is None else (out | wrong)


def raw_text(flat: pa.Array, col: Any) -> tuple[np.ndarray, None]:
    """``encoding: raw`` text: a non-negative integer written as text is that id, any other value its FNV-1a hash, both modulo the
    raw id space, so the managed-collision module sees every value as one stable id (never a bad row)."""
    assert col.managed_collision is not None, "encoding=raw is a managed-collision column's"
    space = col.managed_collision.input_hash_size
    digits = pc.fill_null(pc.match_substring_regex(flat, r"^[0-9]{1,18}$"), False)
    values = np.asarray(pc.if_else(digits, flat, "0").cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)
    hashed = (fnv1a64(flat) % np.uint64(space)).astype(np.int64)
    return np.where(np.asarray(digits.to_numpy(zero_copy_only=False), dtype=bool), np.mod(values, space), hashed), None


def bad_id(col: Any, value: object, told: bool) -> str:
    """Why ``value`` (a raw value :func:`flat_ids` marked; ``None``: one not shown) is no id of ``col``; ``told``: also
    name the training setting that would take it (``False`` for a served model's client, whose model is fixed)."""
    shown = f"{value!r}" if value is not None else "a value"
    if beyond_int64(value, col.hex):
        how = "hex=false encoding=hash" if col.hex else "encoding=hash"
        return (f"{shown} does not fit in a signed 64-bit integer: ids must lie in [-2**63, 2**63)" +
                (f". Hash such ids into the table with data.sparse[{col.name}].{how} (docs/data.md, 'Sparse column "
                 f"fields')" if told else ""))
    if col.encoding == "bucketize":
        return not_a_number(shown, col, told)
    if col.hex:
        return f"{shown} is not a hexadecimal string"
    if col.encoding == "vocab":
        return f"{shown} is neither text nor an integer (encoding=vocab)"
    if col.encoding == "raw":
        space = col.managed_collision.input_hash_size if col.managed_collision is not None else 0
        return (f"raw id {shown} is outside [0, {space})" + (f". Raise data.sparse[{col.name}].managed_collision."
                f"input_hash_size, or pass the ids as text (hashed into it)" if told else
                ": send the id as text, which the model hashes into that range"))
    if col.encoding == "id" and isinstance(value, str) and parse_int(pa.array([value]))[1].any():
        return f"{shown} is not an integer, which encoding=id reads (ids in [0, {col.num_embeddings}))" + \
            ("; use encoding=hash for text" if told else "")
    if col.encoding == "id":
        return (f"id {shown} is outside [0, {col.num_embeddings}) (encoding=id)" +
                (f". Raise data.sparse[{col.name}].num_embeddings, or use encoding=mod or hash" if told else
                 f": the model's table for {col.name!r} has {col.num_embeddings} rows"))
    return f"{shown} is not an integer (encoding={col.encoding})" + ("; use encoding=hash for strings" if told else "")


def float_ids(col: Any, dtype: pa.DataType) -> str:
    """Why a typed column of floats cannot be a sparse column's ids, and the ways out. Said once for the column: every
    row would otherwise be a bad row reported as an id out of range (``82.0`` is not an id of any table)."""
    return (f"column {col.name!r} holds {dtype} values, but data.sparse[{col.name}] "
            f"(encoding={col.encoding}) reads ids: integers or text. Fix: write the column as int64 (pandas turns an id column "
            f"with a missing value into float64; its nullable 'Int64' dtype keeps integers), move it to data.dense if it is a "
            f"number, or bucketize it (data.sparse[{col.name}].boundaries or quantiles)")


def not_a_number(shown: str, col: Any, settings_fixes: bool = True) -> str:
    """Why ``shown`` is no value of an ``encoding: bucketize`` column (:func:`bad_id`)."""
    if not settings_fixes:
        return f"{shown} is not a number, which the model reads from this column (its values are bucketized)"
    return (f"{shown} is not a number, which encoding=bucketize reads (data.sparse[{col.name}].boundaries/quantiles). Fix the value, "
            f"or drop the boundaries to treat the column as ids")


def beyond_int64(value: object, hex_digits: bool) -> bool:
    """Whether ``value`` (a raw sparse value from a file) is an integer outside int64's range."""
    if isinstance(value, str):
        try:
            value = int(value, 16 if hex_digits else 10)
        except ValueError:
            return False
    return isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63
