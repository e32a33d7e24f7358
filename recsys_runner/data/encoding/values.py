"""Raw values read as numbers and ids, and Arrow column types named: the per-value rules that the row encoder, fitting
and the served model share.

Numbers parsed from numbers or text (:func:`parse_numbers`), a dense column's ``clip`` and ``transform``
(:func:`dense_transformed`), bucket ids (:func:`bucket_ids`), ``id:weight`` pairs split (:func:`split_pairs`), the
vocabulary row of each value (:func:`vocab_rows`), and a column's Arrow type as ``encoders.json`` names it
(:func:`type_name`, :func:`arrow_type`). They are apart from :mod:`~recsys_runner.data.encoding.rows` because they
work on one flat array of values, with no table, row or bad-row bookkeeping, and because fitting
(:mod:`~recsys_runner.data.encoding.fit`), the stored document (:mod:`~recsys_runner.data.encoding.stored`), the
vocabulary (:mod:`~recsys_runner.data.encoding.vocabulary`) and the served model read them without the encoder.

**Standalone on purpose**, like :mod:`~recsys_runner.data.encoding.rows`: NumPy, PyArrow and
:mod:`~recsys_runner.data.encoding.keys` only, and copied into the MLflow model's ``code/``
(:data:`~recsys_runner.data.encoding.served.SHIPPED`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING or __package__:
    from .keys import cast_or_none, is_text, parse_hex, parse_texts, value_keys
else:  # inside the MLflow model: the copy of keys.py beside this one in its code/ directory, of this copy's code set
    _CODE = __name__.removeprefix("recsys_values")  # "_<hash>" (served.SHIPPED says why)
    _keys = importlib.import_module(f"recsys_keys{_CODE}")
    cast_or_none, is_text, parse_hex, parse_texts, value_keys = (_keys.cast_or_none, _keys.is_text, _keys.parse_hex, _keys.parse_texts,
                                                                 _keys.value_keys)



def combined(arr: pa.ChunkedArray | pa.Array) -> pa.Array:
    """A column's chunks as one array: the rules here, and the encoder's checks, read one flat array of values."""
    if isinstance(arr, pa.ChunkedArray):
        return arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    return arr

def type_name(t: pa.DataType) -> str:
    """A column's Arrow type as stored in ``encoders.json``'s ``column_types``: ``string``, ``int64``, ``float64``,
    ``bool``, ``null`` or ``list<…>`` of one of them (every integer width is ``int64``, every float ``float64``)."""
    if is_list(t):
        return f"list<{type_name(t.value_type)}>"
    if is_text(t):
        return "string"
    if pa.types.is_integer(t):
        return "int64"
    if pa.types.is_floating(t):
        return "float64"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_null(t):
        return "null"
    return str(t)


def arrow_type(name: str) -> pa.DataType:
    """The Arrow type of a :func:`type_name`."""
    if name.startswith("list<") and name.endswith(">"):
        return pa.list_(arrow_type(name[5:-1]))
    return {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_(), "null": pa.null()}[name]


def is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def dense_transformed(col: Any, values: np.ndarray) -> np.ndarray:
    """A dense column's filled float64 values after ``clip`` and ``transform``: what ``normalize`` scales, and what its
    ``mean`` / ``std`` are fitted on (:func:`recsys_runner.data.encoding.fit.complete_schema`)."""
    if col.clip is not None:
        values = np.clip(values, col.clip[0], col.clip[1])
    if col.transform == "log1p":
        values = np.log1p(np.maximum(values, 0.0))
    return values


def parse_numbers(flat: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A flat array without nulls (numbers, or text of numbers) as float64, and a mask of values that are not a number
    (text that does not parse, NaN, another type)."""
    if pa.types.is_integer(flat.type) or pa.types.is_floating(flat.type) or pa.types.is_boolean(flat.type) or pa.types.is_null(flat.type):
        numbers = np.asarray(flat.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False), dtype=np.float64)
        return numbers, np.isnan(numbers)
    if not (pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type)):
        return np.zeros(len(flat), np.float64), np.ones(len(flat), bool)
    cast = cast_or_none(flat, pa.float64())
    if cast is not None:
        numbers = np.asarray(cast.to_numpy(zero_copy_only=False), dtype=np.float64)
        return numbers, np.isnan(numbers)
    numbers, wrong = parse_texts(flat, PLAIN_FLOAT, plain_floats, float, np.float64)
    return numbers, wrong | np.isnan(numbers)


PLAIN_FLOAT = r"^[ \t]*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?[ \t]*$"
"""Decimal text that Arrow's cast reads as Python's ``float`` does (correctly rounded; spaces trimmed): read vectorized
by :func:`~recsys_runner.data.encoding.keys.parse_texts`. ``inf``, ``nan``, ``1_0`` and the like go through ``float``."""


def plain_floats(texts: pa.Array) -> np.ndarray:
    """Texts matching :data:`PLAIN_FLOAT` as float64."""
    return np.asarray(pc.ascii_trim(texts, " \t").cast(pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)


FEW_BOUNDARIES = 32
"""Up to this many boundaries a bucket id is counted by one comparison per boundary, ~7x faster than a binary search
(``np.searchsorted`` mispredicts a branch at each of its steps; bench.encoding, 10 quantiles)."""


def bucket_ids(col: Any, numbers: np.ndarray, wrong: np.ndarray) -> np.ndarray:
    """``encoding: bucketize``: the id of each number, the count of ``col.boundaries`` ``<=`` it (``0`` where ``wrong``)."""
    assert col.boundaries is not None, f"data.sparse[{col.name}] (encoding=bucketize) has no boundaries: build its schema with complete_schema"
    boundaries = np.asarray(col.boundaries, dtype=np.float64)
    if len(boundaries) <= FEW_BOUNDARIES and bool(np.all(boundaries[1:] >= boundaries[:-1])):  # sorted, no NaN
        counts = np.zeros(len(numbers), np.uint8)
        for boundary in boundaries:
            counts += numbers >= boundary  # a NaN number counts none, where a search puts it last: it is ``wrong`` anyway
        ids = widened(counts)
    else:
        ids = np.searchsorted(boundaries, numbers, side="right").astype(np.int64)
    return np.where(wrong, 0, ids) if wrong.any() else ids


def widened(ids: np.ndarray) -> np.ndarray:
    """``ids`` (of a narrower integer type) as int64, in Arrow's memory pool, whose pages are reused from batch to batch:
    a fresh NumPy array of a batch's ids lies above glibc's mmap threshold and is page-faulted in each time, which took
    longer than the gather or the comparisons that made the ids (bench.encoding)."""
    out = np.frombuffer(pa.allocate_buffer(len(ids) * 8), dtype=np.int64) if len(ids) else np.zeros(0, np.int64)
    np.copyto(out, ids)
    return out


def split_pairs(flat: pa.Array) -> tuple[pa.Array, np.ndarray, np.ndarray, np.ndarray]:
    """``id:weight`` texts (no nulls) split at their last ``:``: the ids (text), the weights (float32; 0 where wrong), a mask
    of the texts without ``:`` and one of the weights that are not finite numbers."""
    parts = pc.extract_regex(flat, r"^(?P<id>.*):(?P<weight>[^:]*)$")
    no_colon = ~np.asarray(parts.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    ids, texts = pc.fill_null(parts.field("id"), ""), pc.fill_null(parts.field("weight"), "")
    numbers, wrong = parse_numbers(texts)
    not_number = ~no_colon & (wrong | ~np.isfinite(numbers))
    return ids, np.where(no_colon | not_number, 0.0, numbers).astype(np.float32), no_colon, not_number


def vocab_rows(vocabulary: Any, flat: pa.Array, hex_digits: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """The row of each value of a flat array without nulls in ``vocabulary``, and a mask of values that cannot be keyed:
    ``vocabulary.lookup(value_keys(flat, hex_digits))``, but integers (and a ``hex`` column's parsed text) go by
    ``lookup_ints``, which reads their rows straight from a table without mixing them into keys."""
    if hex_digits and is_text(flat.type):
        values, not_hex = parse_hex(flat)
        return vocabulary.lookup_ints(values), not_hex
    if not hex_digits and pa.types.is_integer(flat.type):
        return vocabulary.lookup_ints(np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.int64)), None
    keys, wrong = value_keys(flat, hex_digits)
    return vocabulary.lookup(keys), wrong
