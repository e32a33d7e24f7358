"""Small requests encoded together, for the served model (:mod:`.served`): the rows the row encoder gives, for a fraction
of its per-column cost at a few rows (issue 29's serving latency, docs/performance.md, 'Serving').

A small text request's single-valued vocabulary columns are keyed in one pass and looked up together
(:class:`Vocabularies`), its dense columns parsed in one cast; every other sparse column still goes through the row
encoder, and a value that cannot be read sends the whole request there, so its error message is the row encoder's.
``tests/test_served_fast_paths.py`` compares each with the way it replaces, value for value.

**Standalone on purpose**, like :mod:`.served`: NumPy, PyArrow, :mod:`.keys`, :mod:`.values`, :mod:`.encoded_rows` and
:mod:`.served_request` only; the MLflow models ``export`` writes carry a copy of it (:data:`.served.SHIPPED`).
"""

from __future__ import annotations

import copy
import importlib
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

if TYPE_CHECKING or __package__:
    from . import keys as _keys
    from . import values as _values
    from .encoded_rows import Rows
    from .served_request import RequestEncoder, RequestRows
else:  # inside the MLflow model: the copies in its code/ directory, never an installed recsys_runner
    _CODE = __name__.removeprefix("recsys_served_small")  # "_<hash>": this copy's code set (served.SHIPPED says why)
    _keys = importlib.import_module(f"recsys_keys{_CODE}")
    Rows = importlib.import_module(f"recsys_encoded_rows{_CODE}").Rows
    _values = importlib.import_module(f"recsys_values{_CODE}")
    _request = importlib.import_module(f"recsys_served_request{_CODE}")
    RequestEncoder, RequestRows = _request.RequestEncoder, _request.RequestRows


class SmallRequests:
    """Encodes a small text request (:meth:`.served_request.RequestColumns.text_columns`) as the row encoder does (module
    docstring), by ``schema``: the stored schema as the row encoder reads it; ``error``: what a bad row raises."""

    def __init__(self, schema: Any, error: type[Exception]) -> None:
        self.schema = schema
        self.keyed = _keyed_columns(schema)
        """Per ``hex``: the vocabulary columns keyed together (:meth:`rows`)."""
        keyed = {name for _, names, _ in self.keyed.values() for name in names}
        self.other_columns = RequestEncoder(_only_sparse(schema, [c for c in schema.sparse if c.name not in keyed]), "fail", error)
        """The row encoder of the other sparse columns (:meth:`rows`)."""

    def rows(self, table: pa.Table, columns: dict[str, pa.Array]) -> Any:
        """The encoded rows of a small text request (:meth:`.served_request.RequestColumns.text_columns`), the same as the row encoder's, for a fraction
        of its per-column cost at a few rows: the single-valued vocabulary columns (:attr:`keyed`) keyed together (their
        present values in one array, keyed in one pass by ``value_keys`` as the row encoder keys each such column, each
        column then looked up in its vocabulary), the dense columns read together (:meth:`_dense_rows`), any other column
        by the row encoder. ``None`` when a value cannot be read (the row encoder then names it)."""
        n = table.num_rows
        dense = self._dense_rows(columns, n)
        if dense is None:
            return None
        sparse: list[Any] = [None] * len(self.schema.sparse)
        for hex_digits, (positions, names, vocabularies) in self.keyed.items():
            values = pa.concat_arrays([columns[name] for name in names])  # column after column
            valid = np.asarray(values.is_valid().to_numpy(zero_copy_only=False), dtype=bool).reshape(len(names), n)
            keys, wrong = _keys.value_keys(values.drop_null() if values.null_count else values, hex_digits)
            if wrong is not None and wrong.any():
                return None
            counts = valid.sum(axis=1)
            ids = np.split(vocabularies.lookup(keys, counts), np.cumsum(counts)[:-1])
            for j, column_ids, present in zip(positions, ids, valid, strict=True):
                sparse[j] = (column_ids, present.astype(np.int32))
        if any(bag is None for bag in sparse):
            others = iter(self.other_columns.encode(table, RequestRows("request", "rows", np.arange(n), 0)).sparse)
            sparse = [next(others) if bag is None else bag for bag in sparse]
        return Rows(np.zeros(n, np.float32), dense, sparse)

    def _dense_rows(self, columns: dict[str, pa.Array], n: int) -> np.ndarray | None:
        """The dense columns of a small text request as the row encoder reads them (parsed as float64, a missing value
        filled, then ``clip``, ``transform`` and ``normalize``), all parsed in one cast; ``None`` when a value is not a
        finite number (a bad row, which the row encoder names)."""
        dense = np.empty((n, len(self.schema.dense)), dtype=np.float32)
        if not self.schema.dense:
            return dense
        try:
            numbers = pa.concat_arrays([columns[col.name] for col in self.schema.dense]).cast(pa.float64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
        read = np.asarray(numbers.to_numpy(zero_copy_only=False), dtype=np.float64).reshape(len(self.schema.dense), n)
        valid = np.asarray(numbers.is_valid().to_numpy(zero_copy_only=False), dtype=bool).reshape(read.shape) if numbers.null_count else None
        for j, col in enumerate(self.schema.dense):
            values = read[j] if valid is None else np.where(valid[j], read[j], col.fill)
            if not np.isfinite(values).all():
                return None
            values = _values.dense_transformed(col, values)
            dense[:, j] = (values - col.mean) / col.std if col.normalize == "zscore" else values
        return dense


def _keyed_columns(schema: Any) -> dict[bool, tuple[list[int], list[str], Vocabularies]]:
    """The sparse columns :meth:`SmallRequests.rows` keys together: one value per row (no separator, weights nor
    cross) looked up in a vocabulary. Per ``hex``: their positions among the sparse columns, their names and their
    vocabularies."""
    groups: dict[bool, list[tuple[int, Any]]] = {}
    for j, col in enumerate(schema.sparse):
        vocabulary = schema.vocabularies.get(col.name)
        if (col.encoding == "vocab" and vocabulary is not None and vocabulary.oov_buckets > 0 and col.separator is None
                and not getattr(col, "weighted", False) and getattr(col, "weights", None) is None and not getattr(col, "cross", None)):
            groups.setdefault(bool(col.hex), []).append((j, col))
    return {hex_digits: ([j for j, _ in group], [col.name for _, col in group],
                         Vocabularies([schema.vocabularies[col.name] for _, col in group]))
            for hex_digits, group in groups.items()}


def _only_sparse(schema: Any, sparse: list[Any]) -> Any:
    """``schema`` with only ``sparse`` as its columns (no dense ones)."""
    view = copy.copy(schema)
    view.sparse, view.dense = sparse, []
    return view


class Vocabularies:
    """Several columns' vocabularies looked up at once: :meth:`Vocabulary.lookup`'s rows (a key's own row, else
    ``capacity + key mod oov_buckets``) for keys of every column together, one ``searchsorted`` of each column's few keys
    in its sorted keys and the rest in one pass. A small request's keys are a handful per column, where a lookup's own
    set-up costs far more than its keys."""

    def __init__(self, vocabularies: list[Any]) -> None:
        self.keys = [v.keys for v in vocabularies]
        sizes = np.array([len(k) for k in self.keys], np.int64)
        self.sizes, self.starts = sizes, np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.all_keys = np.concatenate(self.keys) if sizes.sum() else np.zeros(1, np.uint64)
        self.all_rows = np.concatenate([v.rows for v in vocabularies]) if sizes.sum() else np.zeros(1, np.int64)
        self.capacity = np.array([v.capacity for v in vocabularies], np.int64)
        self.oov_buckets = np.array([v.oov_buckets for v in vocabularies], np.uint64)

    def lookup(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The row of each of ``keys`` (uint64): the first ``counts[0]`` are the first column's, and so on."""
        parts = np.split(keys, np.cumsum(counts)[:-1])
        pos = np.concatenate([np.searchsorted(k, q) for k, q in zip(self.keys, parts, strict=True)]).astype(np.int64)
        column = np.repeat(np.arange(len(self.keys)), counts)
        at = np.minimum(self.starts[column] + pos, len(self.all_keys) - 1)
        hit = (pos < self.sizes[column]) & (self.all_keys[at] == keys)
        oov = self.capacity[column] + (keys % self.oov_buckets[column]).astype(np.int64)
        return np.where(hit, self.all_rows[at], oov)
