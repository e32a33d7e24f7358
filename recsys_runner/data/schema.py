"""Column schema of tabular data and the vectorized encoder from Arrow columns to model inputs.

A data config lists a ``label`` column (or, for multi-task models, ``labels``: task name → column,
each ``binary`` or ``regression`` by ``label_kinds``), ``dense`` columns (each with a missing-value fill and a
transform) and ``sparse`` columns (integer ids, hashed values or hexadecimal strings; single- or
multi-hot). :class:`Encoder` turns one Arrow table of raw columns into :class:`Rows` (NumPy arrays)
and checks every row; a bad row either raises :class:`DataError` naming the file, row and column,
or is skipped and counted (``on_bad_rows: skip``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import yaml

from recsys_runner.errors import ConfigError, DataError, require
from recsys_runner.features import POOLINGS, FeatureSpec, SparseFeature, check_embedding_dim

DENSE_TRANSFORMS = ("none", "log1p")
SPARSE_ENCODINGS = ("id", "mod", "hash")
BAD_ROW_MODES = ("fail", "skip")
LABEL_KINDS = ("binary", "regression")
"""How a label column is checked: ``binary`` (every value 0 or 1) or ``regression`` (any finite float)."""


@dataclass(kw_only=True)
class DenseColumn:
    """One float input column (an entry of ``data.dense``)."""

    name: str
    """Column name in the file (or in ``data.column_names`` for header-less CSV)."""
    transform: str = "none"
    """``none``, or ``log1p``: clamp negatives to 0, then ``log(1 + x)`` (the usual Criteo count transform)."""
    fill: float = 0.0
    """Value used where the field is missing (null / empty / the CSV missing-value token)."""

    def __post_init__(self) -> None:
        require(self.transform in DENSE_TRANSFORMS, f"data.dense[{self.name}].transform={self.transform!r} must be one of {DENSE_TRANSFORMS}")
        require(math.isfinite(self.fill), f"data.dense[{self.name}].fill must be a finite number, got {self.fill}")


@dataclass(kw_only=True)
class SparseColumn:
    """One categorical input column (an entry of ``data.sparse``); it becomes one sparse feature."""

    name: str
    """Column name in the file; also the feature's name."""
    num_embeddings: int | None = None
    """Rows of the feature's embedding table: ids must lie in ``[0, num_embeddings)``. ``null``: sized from the
    data, the number of distinct values in a sample of the files times ``data.infer.bucket_margin``, rounded up
    (``recsys_runner/data/infer.py``; the run logs the size it chose)."""
    encoding: str | None = None
    """``id``: values are ids already (an id outside the table is a bad row); ``mod``: integer value
    modulo ``num_embeddings``; ``hash``: any value (string or integer) hashed into ``num_embeddings`` buckets.
    ``null``: ``id`` when ``num_embeddings`` is given, ``hash`` when the data sizes it (``mod`` with ``hex``)."""
    hex: bool = False
    """Values are hexadecimal strings (Criteo's categoricals), parsed to integers before ``encoding``."""
    separator: str | None = None
    """Multi-hot in CSV: the delimiter between values inside one field (e.g. ``"|"``). Parquet list
    columns are multi-hot without it. ``null``: one value per field."""
    pooling: str = "sum"
    """How a multi-hot bag becomes one vector: ``sum`` or ``mean``."""
    embedding_dim: int | None = None
    """Width of this feature's table; ``null`` takes ``model.embedding_dim`` (models whose arches combine embeddings
    pairwise, DeepFM and DLRM, need one width: their ``same_embedding_width``)."""
    table: str | None = None
    """Name of a table shared with other features; ``null`` gives the feature its own table."""

    def __post_init__(self) -> None:
        key = f"data.sparse[{self.name}]"
        if self.encoding is None:
            self.encoding = "id" if self.num_embeddings is not None else ("mod" if self.hex else "hash")
        require(self.num_embeddings is None or self.num_embeddings > 0, f"{key}.num_embeddings must be positive, got {self.num_embeddings}")
        require(self.encoding in SPARSE_ENCODINGS, f"{key}.encoding={self.encoding!r} must be one of {SPARSE_ENCODINGS}")
        require(self.pooling in POOLINGS, f"{key}.pooling={self.pooling!r} must be one of {sorted(POOLINGS)}")
        if self.embedding_dim is not None:
            check_embedding_dim(f"{key}.embedding_dim", self.embedding_dim)
        require(self.separator is None or len(self.separator) > 0, f"{key}.separator must be a non-empty string or null")
        require(not (self.hex and self.encoding == "hash"),
                f"{key}: hex=true parses values to integers, which encoding=hash does not need; use encoding=mod with hex=true, or hex=false")

    @property
    def size(self) -> int:
        """``num_embeddings`` once known (a :class:`Schema`'s columns are always sized)."""
        assert self.num_embeddings is not None, f"data.sparse[{self.name}] is not sized yet"
        return self.num_embeddings

    def feature(self) -> SparseFeature:
        return SparseFeature(self.name, self.size, self.embedding_dim, self.pooling, self.table)


def check_labels(label: str | None, labels: dict[str, str] | None, label_kinds: dict[str, str] | None) -> None:
    """Exactly one of ``label`` / ``labels``; distinct label columns; ``label_kinds`` naming tasks of ``labels``.

    Raises:
        ConfigError: naming the key and the fix.
    """
    require(label is None or labels is None,
            f"data.label={label!r} and data.labels={labels} are both set; a file has one label column or a "
            f"mapping of task names to label columns. Fix: data.label=null (several labels) or data.labels=null (one label)")
    require(label is not None or labels is not None,
            "no label column: set data.label=<column> (one binary label) or data.labels='{ctr: click, cvr: conversion}' "
            "(task name -> column, one label per task of a multi-task model)")
    if labels is not None:
        require(len(labels) > 0, "data.labels is empty; give task name -> column, e.g. data.labels='{ctr: click, cvr: conversion}', "
                "or use data.label=<column> for one label")
        columns = list(labels.values())
        shared = sorted({c for c in columns if columns.count(c) > 1})
        require(not shared, f"data.labels={labels} reads column(s) {shared} for several tasks; give each task its own column")
    kinds = label_kinds or {}
    if kinds:
        require(labels is not None, f"data.label_kinds={kinds} needs data.labels (task name -> column); a single data.label is binary")
        unknown = sorted(set(kinds) - set(labels or {}))
        require(not unknown, f"data.label_kinds names task(s) {unknown} that are not in data.labels={labels}; "
                f"valid task names: {list(labels or {})}")
        wrong = {t: k for t, k in kinds.items() if k not in LABEL_KINDS}
        require(not wrong, f"data.label_kinds has {wrong}; each kind must be one of {LABEL_KINDS}")


@dataclass(kw_only=True)
class Schema:
    """Label(s), dense and sparse columns together.

    Exactly one of ``label`` (one binary label, ``labels [n]``) and ``labels`` (task name → column,
    ``labels [n, T]`` in the mapping's order) is set; ``label_kinds`` maps some of ``labels``' tasks
    to ``regression`` (any finite float), the others are ``binary`` (0 or 1).
    """

    label: str | None = None
    labels: dict[str, str] | None = None
    label_kinds: dict[str, str] | None = None
    label_threshold: float | None = None
    """A numeric ``label`` column made binary: ``1`` where the value is ``>=`` this (ratings → clicks), else ``0``."""
    dense: list[DenseColumn] = field(default_factory=list)
    sparse: list[SparseColumn] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_labels(self.label, self.labels, self.label_kinds)
        require(self.label_threshold is None or (self.labels is None and math.isfinite(self.label_threshold)),
                f"data.label_threshold={self.label_threshold} applies to one data.label (a finite number), not to data.labels")
        unsized = [c.name for c in self.sparse if c.num_embeddings is None]
        require(not unsized, f"data.sparse columns {unsized} have no num_embeddings; they are sized from the data when the data "
                f"module is built (recsys_runner/data/infer.py)")
        names = [*self.label_columns, *(c.name for c in self.dense), *(c.name for c in self.sparse)]
        dupes = sorted({n for n in names if names.count(n) > 1})
        require(not dupes, f"columns {dupes} appear more than once among data.label(s), data.dense and data.sparse; each column has one role")
        require(len(self.sparse) > 0, "data.sparse lists no columns: the models need at least one sparse feature, "
                "e.g. data.sparse=[{name: item_id, num_embeddings: 100000}]")

    @property
    def label_columns(self) -> list[str]:
        """The label columns in ``Rows.labels`` column order (one for a single label)."""
        return list(self.labels.values()) if self.labels is not None else [self.label]  # type: ignore[list-item]

    @property
    def label_tasks(self) -> list[str]:
        """Per label column: its task name (the column name itself for a single label)."""
        return list(self.labels) if self.labels is not None else [self.label]  # type: ignore[list-item]

    def label_kind(self, task: str) -> str:
        return (self.label_kinds or {}).get(task, "binary")

    @property
    def columns(self) -> list[str]:
        return [*self.label_columns, *(c.name for c in self.dense), *(c.name for c in self.sparse)]

    def features(self) -> FeatureSpec:
        label: str | tuple[str, ...] = tuple(self.labels) if self.labels is not None else self.label  # type: ignore[assignment]
        spec = FeatureSpec(tuple(c.name for c in self.dense), tuple(c.feature() for c in self.sparse), label)
        spec.embedding_tables(1)  # tables shared by several features must agree: fail at build, not at shard time
        return spec


SCHEMA_KEYS = ("label", "labels", "label_kinds", "label_threshold", "dense", "sparse")
"""The keys of a schema file (``data.schema=<file>``, ``convert --schema``) that describe the columns."""
READER_KEYS = ("delimiter", "header", "column_names", "null_values")
"""The keys of a schema file that say how to read delimited text (CSV/TSV options of ``data=csv``)."""


def schema_from_mapping(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The :class:`Schema` fields and the text-reader options (:data:`READER_KEYS` present) a schema file's mapping holds.

    The form is the one the runner prints when it infers a schema, and the one ``convert --schema`` reads:
    ``label`` (or ``labels`` / ``label_kinds``), ``label_threshold``, ``dense``, ``sparse`` as in ``data.*``,
    and optionally ``delimiter``, ``header``, ``column_names``, ``null_values``. The fields are keyword
    arguments of :class:`Schema` (columns built and checked); a sparse column without ``num_embeddings`` is
    sized from the data by the data module, so ``Schema(**fields)`` alone refuses it.

    Raises:
        ConfigError: an unknown key or an invalid column, naming ``where``.
    """
    require(isinstance(raw, dict), f"{where} must hold a mapping with {', '.join(SCHEMA_KEYS)}, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(SCHEMA_KEYS) - set(READER_KEYS))
    require(not unknown, f"{where} has unknown key(s) {unknown}; a schema file has {', '.join(SCHEMA_KEYS + READER_KEYS)}")
    try:
        dense = [DenseColumn(**d) for d in raw.get("dense") or []]
        sparse = [SparseColumn(**c) for c in raw.get("sparse") or []]
    except TypeError as e:  # an unknown field in a column entry
        raise ConfigError(f"{where}: {e}. Column fields: dense {[f.name for f in fields(DenseColumn)]}, "
                          f"sparse {[f.name for f in fields(SparseColumn)]}") from None
    parts = {"label": raw.get("label"), "labels": raw.get("labels"), "label_kinds": raw.get("label_kinds"),
             "label_threshold": raw.get("label_threshold"), "dense": dense, "sparse": sparse}
    return parts, {k: raw[k] for k in READER_KEYS if k in raw}


def read_schema_file(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`schema_from_mapping` of the YAML file ``path`` (``data.schema=<path>``)."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"data.schema={path!r} cannot be read ({e.strerror or e}). Fix: point data.schema at a schema YAML file "
                          f"(the one a run prints when it infers the schema)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"data.schema={path!r} is not valid YAML ({str(e).splitlines()[0]})") from None
    return schema_from_mapping(raw, f"data.schema={path!r}")


def schema_yaml(schema: Schema, reader: dict[str, Any] | None = None, notes: list[str] | None = None) -> str:
    """``schema`` (and the text-reader options) as a schema file: what :func:`read_schema_file` reads back.

    Fields at their defaults are left out of each column; ``notes`` become comment lines at the top.
    """
    out: dict[str, Any] = {}
    if schema.labels is not None:
        out["labels"] = dict(schema.labels)
        if schema.label_kinds:
            out["label_kinds"] = dict(schema.label_kinds)
    else:
        out["label"] = schema.label
    if schema.label_threshold is not None:
        out["label_threshold"] = schema.label_threshold
    out["dense"] = [_non_default(c) for c in schema.dense]
    out["sparse"] = [_non_default(c) for c in schema.sparse]
    out.update(reader or {})
    text = yaml.safe_dump(out, sort_keys=False, default_flow_style=None, width=200)
    return "".join(f"# {n}\n" for n in notes or []) + text


def _non_default(column: DenseColumn | SparseColumn) -> dict[str, Any]:
    """A column's fields that differ from their defaults (``name`` always; a sparse column's size and encoding always)."""
    keep = {"name", "num_embeddings", "encoding"}
    return {f.name: getattr(column, f.name) for f in fields(column)
            if f.name in keep or getattr(column, f.name) != f.default}


@dataclass
class Rows:
    """A block of encoded rows: ``labels [n]`` (or ``[n, T]``, several labels), ``dense [n, N]`` and per sparse feature (values, lengths)."""

    labels: np.ndarray
    dense: np.ndarray
    sparse: list[tuple[np.ndarray, np.ndarray]]
    _offsets: list[np.ndarray | None] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        if len(parts) == 1:
            return parts[0]
        return Rows(
            np.concatenate([p.labels for p in parts]),
            np.concatenate([p.dense for p in parts]),
            [(np.concatenate([p.sparse[j][0] for p in parts]), np.concatenate([p.sparse[j][1] for p in parts]))
             for j in range(len(parts[0].sparse))],
        )

    def offsets(self) -> list[np.ndarray | None]:
        """Per feature: start offsets ``[n+1]`` of each row's values; ``None`` when every row has one value."""
        if self._offsets is None:
            self._offsets = [
                None if values.shape[0] == lengths.shape[0] and bool((lengths == 1).all())
                else np.concatenate([[0], np.cumsum(lengths)])
                for values, lengths in self.sparse
            ]
        return self._offsets

    def slice(self, start: int, stop: int) -> Rows:
        sparse = []
        for (values, lengths), offsets in zip(self.sparse, self.offsets(), strict=True):
            if offsets is None:
                sparse.append((values[start:stop], lengths[start:stop]))
            else:
                sparse.append((values[offsets[start]:offsets[stop]], lengths[start:stop]))
        return Rows(self.labels[start:stop], self.dense[start:stop], sparse)

    def take(self, index: np.ndarray) -> Rows:
        sparse = []
        for (values, lengths), offsets in zip(self.sparse, self.offsets(), strict=True):
            if offsets is None:
                sparse.append((values[index], lengths[index]))
                continue
            new_lengths = lengths[index]
            if int(lengths.max(initial=0)) <= 1:  # single-valued with some missing: gather through a padded column
                padded = np.zeros(lengths.shape[0], dtype=values.dtype)
                padded[lengths.astype(bool)] = values
                sparse.append((padded[index][new_lengths.astype(bool)], new_lengths))
                continue
            starts = offsets[:-1][index]
            total = int(new_lengths.sum())
            new_starts = np.concatenate([[0], np.cumsum(new_lengths)])[:-1]
            gather = np.arange(total) + np.repeat(starts - new_starts, new_lengths)
            sparse.append((values[gather], new_lengths))
        return Rows(self.labels[index], self.dense[index], sparse)


@dataclass(frozen=True)
class Location:
    """Where a block of rows came from, for error messages: ``describe(i)`` names row ``i``."""

    path: str
    part: str
    """e.g. ``row group 3`` or ``lines 1-65536``."""
    file_rows: np.ndarray
    """0-based row number in the file of each row of the block."""
    line_offset: int | None = None
    """For text files: line number = file row + this (1-based, header counted); ``None`` for Parquet."""

    def describe(self, i: int) -> str:
        row = int(self.file_rows[i])
        if self.line_offset is not None:
            return f"{self.path}, line {row + self.line_offset}"
        return f"{self.path}, {self.part}, row {row} of the file"


class Encoder:
    """Turns Arrow tables of raw columns into :class:`Rows`, checking every row.

    Args:
        schema: the columns and how to encode them.
        on_bad_rows: ``fail`` raises :class:`DataError` at the first bad row; ``skip`` drops bad
            rows and counts them in ``num_bad_rows``.
    """

    def __init__(self, schema: Schema, on_bad_rows: str = "fail") -> None:
        self.schema = schema
        self.skip = on_bad_rows == "skip"
        self.num_bad_rows = 0

    def encode(self, table: pa.Table, where: Location) -> Rows:
        n = table.num_rows
        problems: list[tuple[str, str, np.ndarray, Callable[[int], str]]] = []

        def bad(column: str, mask: np.ndarray, what: Callable[[int], str]) -> None:
            if mask.any():
                problems.append((column, "", mask, what))

        labels = self._label(table, where, bad)
        dense = np.empty((n, len(self.schema.dense)), dtype=np.float32)
        for j, col in enumerate(self.schema.dense):
            dense[:, j] = self._dense(col, _column(table, col.name), where, bad)
        sparse = [self._sparse(col, _column(table, col.name), where, bad) for col in self.schema.sparse]
        rows = Rows(labels, dense, sparse)
        if not problems:
            return rows
        first = min(int(np.flatnonzero(mask)[0]) for _, _, mask, _ in problems)
        if not self.skip:
            column, _, _, what = next(p for p in problems if p[2][first])
            raise DataError(
                f"bad row in {where.describe(first)}, column {column!r}: {what(first)}. Fix the data, or set "
                f"data.on_bad_rows=skip to skip such rows (they are counted and logged)"
            )
        keep = ~np.logical_or.reduce([mask for _, _, mask, _ in problems])
        self.num_bad_rows += int(n - keep.sum())
        return rows.take(np.flatnonzero(keep))

    # -- label --------------------------------------------------------------------------------------
    def _label(self, table: pa.Table, where: Location, bad) -> np.ndarray:
        schema = self.schema
        columns = [self._label_column(table, column, task, schema.label_kind(task), schema.labels is not None, where, bad,
                                      schema.label_threshold)
                   for column, task in zip(schema.label_columns, schema.label_tasks, strict=True)]
        return columns[0] if schema.labels is None else np.stack(columns, axis=1)

    @staticmethod
    def _label_column(table: pa.Table, name: str, task: str, kind: str, multi: bool, where: Location, bad,
                      threshold: float | None = None) -> np.ndarray:
        arr = _numeric(_column(table, name), name, where, bad)
        null = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool) if arr.null_count else np.zeros(len(arr), bool)
        values = np.asarray(arr.fill_null(0.0).to_numpy(zero_copy_only=False), dtype=np.float64)
        of = f" (task {task!r})" if multi else ""
        bad(name, null, lambda i: f"the label{of} is missing (null or empty)")
        if threshold is not None:
            wrong = ~null & ~np.isfinite(values)
            bad(name, wrong, lambda i: f"the label is {_shown(float(values[i]))}, not a finite number to compare with data.label_threshold")
            return np.where(null | wrong, 0, values >= threshold).astype(np.float32)
        if kind == "regression":
            wrong = ~null & ~np.isfinite(values)
            bad(name, wrong, lambda i: f"the label{of} is {_shown(float(values[i]))}, but a regression label must be finite")
        else:
            wrong = ~null & (values != 0) & (values != 1)
            hint = (f"; a float label: data.label_kinds.{task}=regression" if multi
                    else "; a rating or score: data.label_threshold=<value> makes values >= it positive")
            bad(name, wrong, lambda i: f"the label{of} is {_shown(float(values[i]))}, but the task is binary (BCE) and needs 0 or 1{hint}")
        return np.where(null | wrong, 0, values).astype(np.float32)

    # -- dense --------------------------------------------------------------------------------------
    def _dense(self, col: DenseColumn, arr: pa.ChunkedArray | pa.Array, where: Location, bad) -> np.ndarray:
        arr = _numeric(arr, col.name, where, bad)
        read = np.asarray(arr.fill_null(col.fill).to_numpy(zero_copy_only=False), dtype=np.float64)
        nonfinite = ~np.isfinite(read)
        bad(col.name, nonfinite, lambda i: f"the value is {_shown(float(read[i]))}, not a finite number (a missing value takes "
                                           f"data.dense[{col.name}].fill; NaN and infinity are bad rows)")
        values = np.where(nonfinite, col.fill, read) if nonfinite.any() else read
        if col.transform == "log1p":
            values = np.log1p(np.maximum(values, 0.0))
        return values

    # -- sparse -------------------------------------------------------------------------------------
    def _sparse(self, col: SparseColumn, arr: pa.ChunkedArray | pa.Array, where: Location, bad) -> tuple[np.ndarray, np.ndarray]:
        arr = _combined(arr)
        n = len(arr)
        if pa.types.is_null(arr.type):
            return np.zeros(0, dtype=np.int64), np.zeros(n, dtype=np.int32)
        if col.separator is not None and (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
            arr = pc.split_pattern(arr, col.separator)
        if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
            lengths = np.asarray(pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False), dtype=np.int32)
            flat = pc.list_flatten(arr)
            row_of = np.repeat(np.arange(n), lengths)
        else:
            lengths = np.where(np.asarray(arr.is_valid().to_numpy(zero_copy_only=False)), 1, 0).astype(np.int32)
            flat = arr.drop_null() if arr.null_count else arr
            row_of = np.flatnonzero(lengths) if arr.null_count else np.arange(n)
        if flat.null_count:  # a null inside a list: drop the element, keep the row
            valid = np.asarray(flat.is_valid().to_numpy(zero_copy_only=False))
            lengths = lengths - np.bincount(row_of[~valid], minlength=n).astype(np.int32)
            row_of = row_of[valid]
            flat = flat.drop_null()
        ids, wrong = self._ids(col, flat)
        row_bad = np.zeros(n, dtype=bool)
        if wrong is not None and wrong.any():
            row_bad[row_of[wrong]] = True
            first_bad = {}
            for k in np.flatnonzero(wrong)[:1]:
                first_bad[int(row_of[k])] = flat[int(k)].as_py()

            def describe(i: int) -> str:
                value = first_bad.get(i)
                shown = f"{value!r}" if value is not None else "a value"
                if _beyond_int64(value, col.hex):
                    how = "hex=false encoding=hash" if col.hex else "encoding=hash"
                    return (f"{shown} does not fit in a signed 64-bit integer: ids must lie in [-2**63, 2**63). Hash such ids "
                            f"into the table with data.sparse[{col.name}].{how} (docs/data.md, 'Sparse column fields')")
                if col.hex:
                    return f"{shown} is not a hexadecimal string"
                if col.encoding == "id":
                    return (f"id {shown} is outside [0, {col.num_embeddings}) (encoding=id). Raise data.sparse[{col.name}].num_embeddings, "
                            f"or use encoding=mod or hash")
                return f"{shown} is not an integer (encoding={col.encoding}); use encoding=hash for strings"

            bad(col.name, row_bad, describe)
            ids = np.where(wrong, 0, ids)
        return ids, lengths

    def _ids(self, col: SparseColumn, flat: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
        """Encode a flat array of values to ids; also a mask of values that cannot be encoded."""
        is_text = pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type)
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
        out = (values < 0) | (values >= col.size)
        return values, out if wrong is None else (out | wrong)


# -- Arrow helpers ------------------------------------------------------------------------------------


def _shown(value: float) -> str:
    """A float for a message: ``nan``, ``inf``, ``-inf``, or the number (``2``, ``0.5``)."""
    return f"{value:g}"


def _beyond_int64(value: object, hex_digits: bool) -> bool:
    """Whether ``value`` (a raw sparse value from a file) is an integer outside int64's range."""
    if isinstance(value, str):
        try:
            value = int(value, 16 if hex_digits else 10)
        except ValueError:
            return False
    return isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63


def _column(table: pa.Table, name: str) -> pa.ChunkedArray:
    return table.column(name)


def _combined(arr: pa.ChunkedArray | pa.Array) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        return arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    return arr


def _numeric(arr: pa.ChunkedArray | pa.Array, name: str, where: Location, bad) -> pa.Array:
    """``arr`` as float64 (nulls kept); text files' fields are parsed, and unparsable ones are bad rows.

    A typed (Parquet) column of a non-numeric type is a schema mistake, reported for the whole column.
    """
    arr = _combined(arr)
    if pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type) or pa.types.is_null(arr.type):
        return arr.cast(pa.float64())
    if (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)) and where.line_offset is not None:
        try:
            return arr.cast(pa.float64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            texts = arr.to_pylist()
            parsed, wrong = [], np.zeros(len(texts), dtype=bool)
            for i, t in enumerate(texts):
                try:
                    parsed.append(None if t is None else float(t))
                except ValueError:
                    parsed.append(None)
                    wrong[i] = True
            bad(name, wrong, lambda i: f"{texts[i]!r} is not a number")
            return pa.array(parsed, pa.float64()).fill_null(0.0) if wrong.any() else pa.array(parsed, pa.float64())
    raise DataError(
        f"{where.path}, {where.part}: column {name!r} has type {arr.type}, but it is used as a number (label or dense). "
        f"Fix: move it to data.sparse (with encoding=hash for strings), or convert it to a numeric type"
    )


_HEX = np.full(256, -1, dtype=np.int64)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


def _string_buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n+1] relative to data, data bytes) of a string array without nulls."""
    if pa.types.is_large_string(arr.type):
        arr = arr.cast(pa.string())
    _, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1].astype(np.int64)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    return offsets, data


def parse_hex(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Hexadecimal strings → int64 values and a mask of strings that are not 1-15 hex digits."""
    n = len(arr)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    offsets, data = _string_buffers(arr)
    lengths = np.diff(offsets)
    width = int(lengths.max())
    if width == int(lengths.min()) and 0 < width <= 15:
        # Fixed width (Criteo: 8 digits): one table lookup and a shift-add per digit position.
        digits = _HEX[data[offsets[0] : offsets[-1]].reshape(n, width)]
        wrong = (digits < 0).any(axis=1)
        values = np.zeros(n, dtype=np.int64)
        for k in range(width):
            values = (values << 4) | np.maximum(digits[:, k], 0)
        return values, wrong
    values, wrong = np.zeros(n, np.int64), np.zeros(n, bool)
    for i, text in enumerate(arr.to_pylist()):
        try:
            v = int(text, 16)
            if not 0 < len(text) <= 15 or v < 0:
                raise ValueError(text)
            values[i] = v
        except ValueError:
            wrong[i] = True
    return values, wrong


def parse_int(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Decimal integer strings → int64 and a mask of strings that are not integers."""
    try:
        return np.asarray(arr.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64), np.zeros(len(arr), bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        values, wrong = np.zeros(len(arr), np.int64), np.zeros(len(arr), bool)
        for i, text in enumerate(arr.to_pylist()):
            try:
                values[i] = int(text)
            except (ValueError, OverflowError):  # not an integer, or one beyond int64
                wrong[i] = True
        return values, wrong


_FNV_OFFSET, _FNV_PRIME = np.uint64(0xCBF29CE484222325), np.uint64(0x100000001B3)


def fnv1a64(arr: pa.Array) -> np.ndarray:
    """Stable 64-bit FNV-1a hash of each string (identical across processes, runs and machines)."""
    offsets, data = _string_buffers(arr)
    lengths = np.diff(offsets)
    h = np.full(len(arr), _FNV_OFFSET, dtype=np.uint64)
    starts = offsets[:-1]
    for k in range(int(lengths.max()) if len(arr) else 0):
        live = lengths > k
        idx = np.flatnonzero(live)
        h[idx] = (h[idx] ^ data[starts[idx] + k].astype(np.uint64)) * _FNV_PRIME
    return h


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Stable 64-bit mix of integers (splitmix64's finalizer)."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))
