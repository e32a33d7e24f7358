"""The weights of a weighted sparse entry, read by the row encoder (:class:`~recsys_runner.data.encoding.rows.Encoder`):
``id:weight`` text split into ids and weights (``weighted: true``, :func:`pair_weights`), or a column of its own holding
one weight per value (``weights: <column>``, :func:`parallel_weights`); a value without its weight, or a weight that is
not a finite number, makes its row bad.

Apart from :mod:`~recsys_runner.data.encoding.rows` and :mod:`~recsys_runner.data.encoding.sparse_ids`, which keep the
sparse columns' ids, because a weight is a number read beside an id: it shares with the ids only the rows it lies in and
the bad-row bookkeeping the encoder hands in (``bad``, ``error``), as :mod:`~recsys_runner.data.encoding.number_columns`
does for labels and dense features.

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
    from .keys import is_text
    from .values import combined, is_list, parse_numbers, split_pairs
else:  # inside the MLflow model: the copies of the modules it imports beside this one in its code/ directory
    _CODE = __name__.removeprefix("recsys_sparse_weights")  # "_<hash>": this copy's code set (served.SHIPPED says why)
    is_text = importlib.import_module(f"recsys_keys{_CODE}").is_text
    _values = importlib.import_module(f"recsys_values{_CODE}")
    combined, is_list, parse_numbers, split_pairs = _values.combined, _values.is_list, _values.parse_numbers, _values.split_pairs

if TYPE_CHECKING:
    from .rows import Location


def pair_weights(col: Any, flat: pa.Array, row_of: np.ndarray, n: int, where: Location, bad,
                 error: type[Exception]) -> tuple[pa.Array, np.ndarray]:
    """``weighted: true``: the ids and the weights of ``id:weight`` values (no nulls); a value without ``:`` or whose
    weight is not a finite number makes its row bad.

    Raises:
        error: the column holds no text (a typed column of numbers or lists of numbers cannot carry pairs).
    """
    if not is_text(flat.type):
        raise error(f"{where.path}: column {col.name!r} holds {flat.type} values, but data.sparse[{col.name}].weighted=true reads "
                    f"'id:weight' text (e.g. \"12:0.5|7:2\"). Fix: write the pairs as text, or the weights as a column of "
                    f"their own (data.sparse[{col.name}].weights=<column>, weighted=false)")
    ids, weights, no_colon, not_number = split_pairs(flat)
    for mask, what in ((no_colon, "is not an 'id:weight' pair (it has no ':')"), (not_number, "has a weight that is not a finite number")):
        if mask.any():
            k = int(np.flatnonzero(mask)[0])  # the first such value, in the first row that has one
            value, first_row = flat[k].as_py(), int(row_of[k])
            bad(col.name, np.bincount(row_of[mask], minlength=n) > 0,
                lambda i, value=value, first_row=first_row, what=what: (
                    f"{value!r} {what}" if i == first_row else f"a value {what}") +
                f"; data.sparse[{col.name}].weighted=true reads values like 12:0.5 (the id, ':', its weight)")
    return ids, weights


def parallel_weights(col: Any, arr: pa.ChunkedArray | pa.Array, lengths: np.ndarray, where: Location, bad,
                     error: type[Exception]) -> np.ndarray:
    """The float32 weight of each value of ``col`` (``lengths`` values per row, nulls inside lists still counted) from its
    ``weights`` column: a list column, or text split at ``col.separator``. A row whose weights are not as many as its
    values, or not finite numbers, is bad (its weights read 0).

    Raises:
        error: the weights column is neither numbers, text nor lists of them.
    """
    name, arr, n = col.weights, combined(arr), len(lengths)
    if col.separator is not None and is_text(arr.type):
        arr = pc.split_pattern(arr, col.separator)
    if pa.types.is_null(arr.type):
        counts, flat = np.zeros(n, np.int32), pa.array([], pa.float64())
    elif is_list(arr.type):
        counts = np.asarray(pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False), dtype=np.int32)
        flat = pc.list_flatten(arr)
    elif is_text(arr.type) or pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type):
        counts = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=np.int32)
        flat = arr.drop_null() if arr.null_count else arr
    else:
        raise error(f"{where.path}: column {name!r} (the weights of data.sparse[{col.name}]) has type {arr.type}; weights are "
                    f"numbers, one per value of {col.name!r}. Fix: write it as a list of floats (or text split at the "
                    f"column's separator)")
    valid = np.asarray(flat.is_valid().to_numpy(zero_copy_only=False), dtype=bool) if flat.null_count else np.ones(len(flat), bool)
    numbers, wrong = np.zeros(len(flat), np.float64), ~valid
    numbers[valid], wrong[valid] = parse_numbers(flat.drop_null() if flat.null_count else flat)
    wrong |= ~np.isfinite(numbers)
    row_of = np.repeat(np.arange(n), counts)
    unequal = counts != lengths
    bad(name, unequal, lambda i: f"it has {int(counts[i])} weight(s) but {col.name!r} has {int(lengths[i])} value(s): its i-th weight "
                                 f"weighs the i-th value (data.sparse[{col.name}].weights). Fix the row so that both lists have equal lengths")
    if wrong.any():
        k = int(np.flatnonzero(wrong)[0])
        value, first_row = flat[k].as_py(), int(row_of[k])
        bad(name, np.bincount(row_of[wrong], minlength=n) > 0,
            lambda i: (f"the weight {value!r}" if i == first_row else "a weight") + " is not a finite number (data.sparse["
                      f"{col.name}].weights)")
    numbers = np.where(wrong, 0.0, numbers).astype(np.float32)
    if not unequal.any():
        return numbers
    out = np.zeros(int(lengths.sum()), np.float32)  # rows of unequal lengths are bad: their values weigh 0
    out[np.repeat(~unequal, lengths)] = numbers[np.repeat(~unequal, counts)]
    return out
