"""Label and dense columns read as numbers by the row encoder (:class:`~recsys_runner.data.encoding.rows.Encoder`): each
label checked against its task's kind (0/1, a class index, a finite number, or compared with ``data.label_threshold``),
each dense value filled, clipped, transformed and normalized; a value that is not a number makes its row bad. A typed
(Parquet) column of a type that is not numbers is a schema mistake, named for the whole column (:func:`is_number_type`,
:func:`not_numbers`, which the file data options also check when they start).

Apart from :mod:`~recsys_runner.data.encoding.rows` and :mod:`~recsys_runner.data.encoding.sparse_ids`, which keep the
sparse columns' ids, because numbers and ids share nothing but the bad-row bookkeeping the encoder hands in (``bad``, ``error``).

**Standalone on purpose**, like :mod:`~recsys_runner.data.encoding.rows`: NumPy, PyArrow,
:mod:`~recsys_runner.data.encoding.values` and :mod:`~recsys_runner.data.encoding.keys` only, and copied into the MLflow
model's ``code/`` (:data:`~recsys_runner.data.encoding.served.SHIPPED`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

if TYPE_CHECKING or __package__:
    from .keys import cast_or_none, parse_texts
    from .values import PLAIN_FLOAT, combined, dense_transformed, plain_floats
else:  # inside the MLflow model: the copies of keys.py and values.py beside this one in its code/ directory
    _CODE = __name__.removeprefix("recsys_number_columns")  # "_<hash>": this copy's code set (served.SHIPPED says why)
    _keys = importlib.import_module(f"recsys_keys{_CODE}")
    cast_or_none, parse_texts = _keys.cast_or_none, _keys.parse_texts
    _values = importlib.import_module(f"recsys_values{_CODE}")
    PLAIN_FLOAT, combined = _values.PLAIN_FLOAT, _values.combined
    dense_transformed, plain_floats = _values.dense_transformed, _values.plain_floats

if TYPE_CHECKING:
    from .rows import Location


def label_values(table: pa.Table, name: str, task: str, kind: str, multi: bool, where: Location, bad, error: type[Exception],
                 threshold: float | None = None) -> np.ndarray:
    """Label column ``name`` (of task ``task``, of kind ``kind``; ``multi``: one of several labels) as float32, each label
    checked against its kind; ``threshold`` (``data.label_threshold``): values at or above it are 1, the others 0."""
    arr = _numeric(table.column(name), name, where, bad, error, label=True)
    null = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool) if arr.null_count else np.zeros(len(arr), bool)
    values = np.asarray(arr.fill_null(0.0).to_numpy(zero_copy_only=False), dtype=np.float64)
    of = f" (task {task!r})" if multi else ""
    bad(name, null, lambda i: f"the label{of} is missing (null or empty)")
    if threshold is not None:
        wrong = ~null & ~np.isfinite(values)
        bad(name, wrong, lambda i: f"the label is {_shown(float(values[i]))}, not a finite number to compare with data.label_threshold")
        return np.where(null | wrong, 0, values >= threshold).astype(np.float32)
    if kind == "regression":
        wrong = ~null & ~(np.abs(values) <= FLOAT32_MAX)  # NaN, infinity, and what float32 would read as infinity
        bad(name, wrong, lambda i: f"the label{of} is {_shown(float(values[i]))}, but a regression label must be finite (within "
                                   f"±3.4e38, a 32-bit float's range, as the model reads it)")
    elif kind == "multiclass":
        wrong = ~null & ~(np.isfinite(values) & (values >= 0) & (values == np.round(values)))
        bad(name, wrong, lambda i: f"the label{of} is {_shown(float(values[i]))}, but a multiclass label is a class index (an integer >= 0)")
    else:
        wrong = ~null & (values != 0) & (values != 1)
        hint = (f"; a float label: data.label_kinds.{task}=regression, a class index: data.label_kinds.{task}=multiclass "
                f"(the data reads each label by data.label_kinds, the model trains it by model.task_specs.{task}.kind: "
                f"set both)" if multi
                else "; a rating or score: data.label_threshold=<value> makes values >= it positive")
        bad(name, wrong, lambda i: f"the label{of} is {_shown(float(values[i]))}, but the task is binary (BCE) and needs 0 or 1{hint}")
    return np.where(null | wrong, 0, values).astype(np.float32)


def dense_values(col: Any, arr: pa.ChunkedArray | pa.Array, where: Location, bad, error: type[Exception]) -> np.ndarray:
    """Dense column ``col`` as float64: a missing value its ``fill``, then ``clip``, ``transform`` and ``normalize``; a value
    that is not a finite number makes its row bad."""
    arr = _numeric(arr, col.name, where, bad, error, label=False)
    read = np.asarray(arr.fill_null(col.fill).to_numpy(zero_copy_only=False), dtype=np.float64)
    nonfinite = ~np.isfinite(read)
    scaled = f", and data.dense[{col.name}].normalize=zscore scales finite numbers only" if col.normalize == "zscore" else ""
    bad(col.name, nonfinite, lambda i: f"the value is {_shown(float(read[i]))}, not a finite number (a missing value takes "
                                       f"data.dense[{col.name}].fill; NaN and infinity are bad rows{scaled})")
    values = np.where(nonfinite, col.fill, read) if nonfinite.any() else read
    values = dense_transformed(col, values)
    if col.normalize == "zscore":
        assert col.mean is not None and col.std is not None, (f"data.dense[{col.name}] (normalize=zscore) has no mean/std: "
                                                              f"build its schema with complete_schema")
        values = (values - col.mean) / col.std
    beyond = np.abs(values) > FLOAT32_MAX
    bad(col.name, beyond, lambda i: f"the value is {_shown(float(read[i]))}{_as_read(col, float(values[i]))}, beyond the range of a "
                                    f"32-bit float (±3.4e38), which the model's dense input is: it would read as infinity. Log-scale "
                                    f"it (data.dense[{col.name}].transform=log1p) or clip it (data.dense[{col.name}].clip=[low, high])")
    return np.where(beyond, 0.0, values) if beyond.any() else values


def _as_read(col: Any, value: float) -> str:
    """What a dense value became after its column's ``transform``/``normalize``, for a message (``""`` when neither is set)."""
    changed = col.transform != "none" or col.normalize == "zscore"
    return f" ({_shown(value)} after data.dense[{col.name}]'s transform and normalize)" if changed else ""


TEXT_TRUTHS = {"true": 1.0, "false": 0.0}
"""A text label field that reads as a number (any case, e.g. pandas' ``True``/``False``): a text file's boolean label reads
as a Parquet ``bool`` column does, 1 and 0."""
FLOAT32_MAX = float(np.finfo(np.float32).max)
"""The largest magnitude a float32 holds: dense features and labels reach the model as float32, where more is infinity."""


def _shown(value: float) -> str:
    """A float for a message: ``nan``, ``inf``, ``-inf``, or the number (``2``, ``0.5``)."""
    return f"{value:g}"


def is_number_type(t: pa.DataType) -> bool:
    """Whether a typed (Parquet) column of ``t`` reads as numbers, as a label or a dense feature must: integers, floats,
    decimals (a SQL export's ``DECIMAL(10, 2)`` amount, read as the nearest float64), booleans, or nulls only."""
    return (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_boolean(t)
            or pa.types.is_null(t))


def not_numbers(name: str, dtype: pa.DataType, label: bool) -> str:
    """Why a typed column of ``dtype`` (not :func:`is_number_type`) cannot be read as a label (``label``) or a dense
    feature, and the fix, which differs: a text feature is a sparse one, but a label must be written as numbers."""
    if label:
        return (f"column {name!r} holds {dtype} values, but it is a label, and a label is a number: 0 or 1 for a binary task, "
                f"a class index (0, 1, 2, ...) for a multiclass one, any number for regression (data.label_kinds). Fix: write "
                f"it as numbers, e.g. in pandas df[{name!r}] = (df[{name!r}] == '<positive value>').astype('int8') (classes: "
                f"df[{name!r}].astype('category').cat.codes), or point data.label / data.labels at the numeric label column")
    return (f"column {name!r} holds {dtype} values, but data.dense reads numbers. Fix: move it to data.sparse (text values are "
            f"hashed or given a vocabulary), or write it as a numeric type")


def _numeric(arr: pa.ChunkedArray | pa.Array, name: str, where: Location, bad, error: type[Exception], label: bool) -> pa.Array:
    """``arr`` as float64 (nulls kept); text files' fields are parsed, and unparsable ones are bad rows.

    A typed (Parquet) column of a non-numeric type is a schema mistake, reported for the whole column (``label``: the
    column is a label, whose fix differs from a dense feature's, :func:`not_numbers`).
    """
    arr = combined(arr)
    if is_number_type(arr.type):
        return arr.cast(pa.float64(), safe=False)  # unsafe: an int64 beyond 2**53 (a ns timestamp) rounds, as a float does
    if (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)) and where.line_offset is not None:
        cast = cast_or_none(arr, pa.float64())
        if cast is not None:
            return cast
        truths = TEXT_TRUTHS if label else {}

        def number(text: str) -> float:
            word = text.strip().lower()
            return truths[word] if word in truths else float(text)

        # a missing field stays missing (the label's check, the dense fill), also in a block with a bad field, where it
        # had read as 0; one vectorized parse of the plain numbers, Python once per other distinct text (``True``)
        null = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        values, wrong = parse_texts(arr.fill_null("0"), PLAIN_FLOAT, plain_floats, number, np.float64)
        what = (", but it is a label, and a label is a number: 0 or 1 for a binary task (true/false also read as 1/0), a class "
                "index for a multiclass one, any number for regression (data.label_kinds)" if label else "")
        bad(name, wrong, lambda i: f"{arr[i].as_py()!r} is not a number{what}")
        return pa.array(values, pa.float64(), mask=null)
    raise error(f"{where.file_of(name)}, {where.part}: {not_numbers(name, arr.type, label)}")
