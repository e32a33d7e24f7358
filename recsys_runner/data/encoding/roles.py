"""Each sampled column's role when a data config lists no columns: the label, a dense or a sparse feature, or left out.

When ``data=csv`` / ``data=parquet`` get no ``data.dense`` / ``data.sparse`` (and no ``data.schema`` file, nor a
schema stored by ``convert``), a sample of ``data.infer.sample_rows`` rows decides (:attr:`~recsys_runner.data.encoding.fit.InferConfig.sample_rows`):

* the **label**: ``data.label`` / ``data.labels`` when set, else the first column named (any case) one of
  :data:`LABEL_NAMES` (``label``, ``click``, ``target`` …); otherwise a :class:`DataError` lists the columns and
  the fix (``data.label=<column>``);
* per other column (``data.infer.exclude`` left out):

  - a Parquet list column, or text whose values contain a ``data.infer.separators`` character (``|``) → a
    multi-hot sparse feature (``separator`` set for text);
  - text that is not a number in every sampled row (Criteo's hex, Avazu's ``site_id``), or an integer beyond
    64 bits → a sparse feature, ``encoding: hash``;
  - integers → a sparse feature (ids, codes, small counts: Avazu's ``C14``, MovieLens' ``item``), unless more
    than ``data.infer.dense_min_distinct_fraction`` of the sampled rows have distinct values (a measurement,
    a timestamp) → dense; but never dense when the column's name says it is an identifier (:func:`id_named`:
    ``id``, ``user_id``, ``movieId``, ``itemID``): a sample of a table with many users holds mostly distinct
    user ids, and a number line through ids (``log1p`` of a user id) is no feature; nor is an id-named column of
    whole floats (``6.0``: pandas writes an integer column holding nulls as floats), read as ids;
  - other numbers (floats, booleans) → dense;
  - ``log1p`` for a dense column whose sampled values are all ``>= 0``, else none;
  - a text column (or one of integers beyond 64 bits, or an id-named integer column) whose every sampled value
    differs (at least :data:`ROW_ID_MIN_ROWS` rows) is a row id (Avazu's ``id``) and is left out, as is a column that is empty
    in the sample.

A sparse column found here is not sized yet: :func:`~recsys_runner.data.encoding.fit.complete_schema`, which asks for
the roles, sizes it with the others.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_runner.data.encoding.keys import is_text
from recsys_runner.data.schema import DenseColumn, SparseColumn
from recsys_runner.errors import DataError

if TYPE_CHECKING:  # data.infer's settings: fit.py, which asks for the roles, holds the config of the whole inference
    from recsys_runner.data.encoding.fit import InferConfig

LABEL_NAMES = ("label", "click", "clicked", "is_click", "target", "y")
"""Column names (compared case-insensitively, in this order) taken for the label when ``data.label`` is not set."""
ROW_ID_MIN_ROWS = 100
"""A text column with a different value in every one of at least this many sampled rows is a row id."""
_INTEGER = re.compile(r"^[+-]?\d+$")
_ID_WORD = re.compile(r"(?:^|[_\-. ])id$", re.IGNORECASE)
_ID_CAMEL = re.compile(r"[a-z0-9](?:Id|ID)$")


def id_named(name: str) -> bool:
    """Whether a column's name says it holds identifiers: ``id``, or ending in ``_id`` / ``-id`` / ``.id`` (any case),
    or camel case ``…Id`` / ``…ID`` (``userId``, ``itemID``); not ``paid`` or ``valid``."""
    return bool(_ID_WORD.search(name) or _ID_CAMEL.search(name))


def _kind(arr: pa.Array) -> tuple[str, pa.Array]:
    """``integer``, ``float``, ``text`` or ``other`` for a sampled column with nulls dropped, and the values
    (text parsed to numbers when every value is one)."""
    if is_text(arr.type):
        try:
            return "integer", arr.cast(pa.int64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
        if all(_INTEGER.match(t) for t in arr.to_pylist()):
            return "text", arr  # an integer beyond 64 bits: hashed as text
        try:
            return "float", arr.cast(pa.float64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return "text", arr
    if pa.types.is_integer(arr.type):
        return "integer", arr
    if pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type):
        return "float", arr.cast(pa.float64())
    return "other", arr  # binary, dictionary, decimal, temporal: the encoder reads none of them as is


def _whole(values: pa.Array) -> bool:
    """Whether every sampled number is a whole number (integers; floats such as ``6.0``, how pandas writes an integer
    column with nulls): an id-named column of them holds ids, whatever type the writer gave them."""
    if pa.types.is_integer(values.type):
        return True
    numbers = np.asarray(values.cast(pa.float64()).to_numpy(zero_copy_only=False))
    return bool(np.isfinite(numbers).all() and (numbers == np.floor(numbers)).all())


def infer_column(name: str, arr: pa.Array, config: InferConfig) -> tuple[DenseColumn | SparseColumn | None, str | None]:
    """One sampled column's role: a dense or (not yet sized) sparse column, or ``None`` with the reason it is left out."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    present = arr.drop_null()
    if is_text(present.type):
        present = pc.filter(present, pc.not_equal(present, ""))
    rows = len(present)
    if rows == 0:
        return None, f"{name!r}: empty in the sample"
    if pa.types.is_list(present.type) or pa.types.is_large_list(present.type):
        item = present.type.value_type
        if not (pa.types.is_integer(item) or pa.types.is_string(item) or pa.types.is_large_string(item)):
            return None, f"{name!r}: a list of {item}, not of ids or strings"
        return SparseColumn(name=name), None  # sized (vocab or hash) by complete_schema
    if is_text(present.type):
        separator = next((s for s in config.separators if pc.any(pc.match_substring(present, s)).as_py()), None)
        if separator is not None:
            return SparseColumn(name=name, separator=separator), None
    kind, values = _kind(present)
    if kind == "other":
        return None, f"{name!r}: type {arr.type} is neither a number, text nor a list (list it in data.dense / data.sparse after converting it)"
    distinct = len(pc.unique(values))
    identifiers = kind == "text" or (kind in ("integer", "float") and id_named(name) and _whole(values))
    if identifiers and distinct == rows and rows >= ROW_ID_MIN_ROWS:
        return None, f"{name!r}: a different value in every sampled row (a row id?); add it to data.sparse to use it"
    if identifiers or (kind == "integer" and distinct <= config.dense_min_distinct_fraction * rows):
        return SparseColumn(name=name), None
    numbers = np.asarray(values.cast(pa.float64()).to_numpy(zero_copy_only=False))
    transform = "log1p" if bool((numbers[np.isfinite(numbers)] >= 0).all()) else "none"
    return DenseColumn(name=name, transform=transform), None


def detect_label(columns: list[str], where: str) -> str:
    """The label column among ``columns``: the first named one of :data:`LABEL_NAMES` (any case)."""
    lowered = {c.lower(): c for c in reversed(columns)}
    for name in LABEL_NAMES:
        if name in lowered:
            return lowered[name]
    raise DataError(
        f"no label column in {where}: none of its columns {columns} is named {' / '.join(LABEL_NAMES)}. Fix: name it, "
        f"e.g. data.label={columns[0]} (a 0/1 column; a rating or score with data.label_threshold=<value>), or "
        f"data.labels='{{ctr: click, cvr: conversion}}' for several"
    )


REPEATED_KEY = b"recsys_runner.repeated_columns"
"""The key of a sampled table's schema metadata that lists, one per line, the names the files repeat: their columns were
left out of the sample (:func:`~recsys_runner.data.files.sources.without_repeats`), and the inferred schema says so."""


def repeated_in_sample(t: pa.Table) -> list[str]:
    """The column names the sampled files repeat, whose columns the sample ``t`` leaves out (:data:`REPEATED_KEY`)."""
    listed = (t.schema.metadata or {}).get(REPEATED_KEY, b"")
    return [n for n in listed.decode().split("\n") if n]


def infer_columns(t: pa.Table, skip: set[str], config: InferConfig, where: str) -> tuple[list[DenseColumn], list[SparseColumn], list[str]]:
    """The dense and sparse columns of the sampled table ``t`` (``skip`` left out), and notes on the columns left out.

    Raises:
        DataError: no sparse column is left.
    """
    dense: list[DenseColumn] = []
    sparse: list[SparseColumn] = []
    notes = [f"left out {name!r}: the files name more than one column so, and which is meant cannot be told (rename one to read it)"
             for name in repeated_in_sample(t) if name not in skip]
    for name in t.column_names:
        if name in skip:
            continue
        column, note = infer_column(name, t.column(name), config)
        if isinstance(column, DenseColumn):
            dense.append(column)
        elif isinstance(column, SparseColumn):
            sparse.append(column)
        if note is not None:
            notes.append(f"left out {note}")
    if not sparse:
        raise DataError(f"inferred no sparse (categorical) column in {where}: the models need at least one. Columns: dense "
                        f"{[d.name for d in dense]}; {'; '.join(notes) or 'nothing left out'}. Fix: list the columns, e.g. "
                        f"'data.sparse=[{{name: {(dense[0].name if dense else 'item_id')}}}]' (sized from the data)")
    return dense, sparse, notes
