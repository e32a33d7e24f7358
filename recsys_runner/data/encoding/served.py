"""The served model: raw rows in (a pandas DataFrame), the scores ``predict`` writes out — MLflow's pyfunc loader.

``export`` writes an MLflow model (:mod:`recsys_runner.serving.mlflow_model`) whose ``code/`` holds a copy of this module
(``recsys_served.py``), of the row encoder (``recsys_rows.py``: :mod:`~recsys_runner.data.encoding.rows`, with its
histories ``recsys_histories.py``, values ``recsys_values.py`` and keys ``recsys_keys.py``) and of the vocabulary lookup
(``recsys_vocabulary.py``): :data:`SHIPPED`, and whose ``data/`` holds the ``torch.export`` program (and, when ``export`` compiled it, its AOTInductor package), the
checkpoint's ``encoders.json`` and ``serving.json`` (what the program takes and what its outputs mean). MLflow calls
:func:`_load_pyfunc` on ``data/``; :meth:`ServedModel.predict` then

1. checks that every input column the model was trained on is in the request (extra columns are ignored); a request
   of no rows is answered with no rows (the program's batch is at least one row);
2. reads the CSV reader's missing-value tokens (``serving.json``'s ``null_values``, ``""`` by default) in a text column
   as missing, and casts each column to the Arrow type training read it as (``encoders.json``'s ``column_types``: every column of a CSV
   is text, so an id ``123`` sent as a number is keyed as the text ``"123"``, exactly as in training; in a column
   training read as numbers, :data:`ABSENT_TEXTS` are missing too and an integer written ``"772.0"`` is 772);
3. encodes the rows with the stored encoders — vocabularies, hashes, buckets, fills and normalization, histories cut to
   their ``max_len`` — through the very encoder training used, so an id unseen in training reads the OOV row it would
   have read there;
4. runs the program and turns its outputs into ``predict``'s columns: ``score`` (``score_<task>`` for several tasks) as a
   probability for a binary task, the value for a regression, and for a multi-class task the most probable class
   (``class_<task>``) with its probability; a tower of a two-tower model returns ``vector`` (one list per row).

Why a copy and not an import: the server needs torch, NumPy, pandas, PyArrow and MLflow only — no recsys_runner,
TorchRec or fbgemm — and the model keeps working whatever version of recsys_runner is (or is not) installed beside it.
A request that cannot be encoded (a missing column, text where a number belongs) raises MLflow's ``BAD_REQUEST``
error naming the column, which ``mlflow models serve`` answers with HTTP 400.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import warnings
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING or __package__:
    from . import keys as _keys
    from . import rows as _rows
    from . import values as _values
    from .vocabulary import Vocabulary
else:  # inside the MLflow model: the copies in its code/ directory, never an installed recsys_runner
    _keys = importlib.import_module("recsys_keys")
    _rows = importlib.import_module("recsys_rows")
    _values = importlib.import_module("recsys_values")
    Vocabulary = importlib.import_module("recsys_vocabulary").Vocabulary

SPEC_FILE = "serving.json"
ENCODERS_FILE = "encoders.json"
PROGRAM_FILE = "model.pt2"
COMPILED_FILE = "model_aoti.pt2"
"""The program compiled ahead of time by AOTInductor, when ``export`` was asked for it (:func:`load_program`)."""
SHIPPED = {"keys": "recsys_keys.py", "values": "recsys_values.py", "histories": "recsys_histories.py", "rows": "recsys_rows.py",
           "vocabulary": "recsys_vocabulary.py", "served": "recsys_served.py"}
"""This room's modules the MLflow model carries in ``code/``, by the names they are imported under there."""
LOADER_MODULE = "recsys_served"
SERVER_MODEL_PATH_VARIABLE = "__pyfunc_model_path__"
"""Set in the environment of ``mlflow models serve``'s processes (``mlflow.pyfunc.scoring_server._SERVER_MODEL_PATH``):
the model is being served (:func:`serving_threads`)."""
STACKED_ROWS = 4096
"""Requests of up to this many rows are converted to Arrow in one piece (:meth:`ServedModel._text_columns`)."""
LABEL = "__served_label__"
"""The zero label column the encoder is given (it encodes labels too; a request has none)."""
ABSENT_TEXTS = ("", "None", "nan")
"""Texts read as a missing value in a column training read as numbers (a Parquet model's ids, prices): no id reads as
them, and they are what a request holds for one — ``""`` in a CSV body or JSON text, ``"None"`` and ``"nan"`` what
MLflow's ``inputs`` form makes of a JSON ``null`` and ``NaN`` in a ``string`` column of the signature (and pandas'
``astype(str)`` of a missing number): as a NaN of a typed request column, which pandas holds for a missing value, they
take the column's fill (:meth:`ServedModel._cast`)."""


class RequestError(ValueError):
    """A request the model cannot score; raised as MLflow's ``BAD_REQUEST`` (HTTP 400) when MLflow is there."""


def _error_class() -> type[Exception]:
    """MLflow's ``BAD_REQUEST`` exception (HTTP 400 from ``mlflow models serve``), or :class:`RequestError` without MLflow."""
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import BAD_REQUEST
    except ImportError:  # used without MLflow (a plain Python server): a ValueError
        return RequestError

    class BadRequest(MlflowException):
        def __init__(self, message: str) -> None:
            super().__init__(message, error_code=BAD_REQUEST)

    return BadRequest


class _RequestRows(_rows.Location):
    """Rows of a request, for the encoder's messages: ``request row <i>`` (0-based)."""

    def describe(self, i: int) -> str:
        return f"request row {int(self.file_rows[i])}"


class _Encoder(_rows.Encoder):
    fix = "Fix the request"


class _Schema:
    """The stored schema as the row encoder reads it (by attribute), with a zero label in place of the training labels."""

    def __init__(self, document: dict[str, Any], keep: set[str] | None = None) -> None:
        def wanted(name: str) -> bool:
            return keep is None or name in keep

        self.dense = [SimpleNamespace(**d) for d in document["dense"] if wanted(d["name"])]
        self.sparse = [_sparse_column(s) for s in document["sparse"] if wanted(s["name"])]
        names = {c.name for c in self.sparse}
        self.sequences = [SimpleNamespace(name=name, features=tuple(g["features"]), max_len=int(g["max_len"]),
                                          truncate=g.get("truncate") or "recent", timestamps=g.get("timestamps"))
                          for name, g in (document.get("sequences") or {}).items() if set(g["features"]) <= names]
        self.vocabularies = {name: Vocabulary(np.asarray(v["keys"], dtype=np.uint64), np.asarray(v["rows"], dtype=np.int64),
                                              int(v["capacity"]), int(v["oov_buckets"]))
                             for name, v in document["vocabularies"].items() if name in names}
        self.labels, self.label_threshold = None, None
        self.label_columns = self.label_tasks = [LABEL]

    @staticmethod
    def label_kind(task: str) -> str:
        return "regression"


def _sparse_column(entry: dict[str, Any]) -> SimpleNamespace:
    col = SimpleNamespace(**entry)
    col.size = entry["num_embeddings"]
    if entry.get("managed_collision") is not None:
        col.managed_collision = SimpleNamespace(**entry["managed_collision"])
    return col


class ServedModel:
    """The loaded model: :meth:`predict` scores a DataFrame of raw rows (module docstring)."""

    def __init__(self, directory: str) -> None:
        import torch

        with open(os.path.join(directory, SPEC_FILE)) as f:
            self.spec: dict[str, Any] = json.load(f)
        with open(os.path.join(directory, ENCODERS_FILE)) as f:
            document = json.load(f)
        self.columns: list[str] = list(self.spec["input_columns"])
        self.types = {name: _values.arrow_type(t) for name, t in (document.get("column_types") or {}).items() if name in self.columns}
        self.dense_columns = {d["name"] for d in document["dense"]}
        self.null_values = pa.array(list(self.spec.get("null_values") or []), pa.string())
        self.absent_texts = pa.array(sorted({*self.null_values.to_pylist(), *ABSENT_TEXTS}), pa.string())
        """The texts read as missing in a column training read as numbers (:data:`ABSENT_TEXTS`, with the null tokens)."""
        self.schema = _Schema(document, set(self.spec["features"]) if self.spec.get("tower") else None)
        names = [c.name for c in self.schema.sparse] + [g.timestamps for g in self.schema.sequences if g.timestamps]
        if names != self.spec["keys"] or [c.name for c in self.schema.dense] != self.spec["dense"]:
            raise ValueError(f"{directory}: {SPEC_FILE} and {ENCODERS_FILE} describe other features ({names} vs {self.spec['keys']})")
        self._all_text = all(pa.types.is_string(self.types.get(name, pa.string())) for name in self.columns)
        """Every input column is read as text (:meth:`_text_columns`)."""
        self.error = _error_class()
        self._small = self._all_text and not self.schema.sequences and not self.spec.get("weighted")
        """Small text requests take :meth:`_small_rows` (not a model with histories or weighted features)."""
        self._keyed = _keyed_columns(self.schema) if self._small else {}
        """Per ``hex``: the vocabulary columns keyed together in a small request (:meth:`_small_rows`)."""
        keyed = {name for _, names, _ in self._keyed.values() for name in names}
        self._other_columns = _Encoder(_only_sparse(self.schema, [c for c in self.schema.sparse if c.name not in keyed]), "fail", self.error)
        """The row encoder of a small request's other sparse columns (:meth:`_small_rows`)."""
        self.program = load_program(directory)
        self._torch = torch
        self.threads = serving_threads(torch)
        """Torch's intra-op threads once loaded (one inside ``mlflow models serve``: :func:`serving_threads`)."""

    def encode(self, frame: Any) -> tuple[Any, ...]:
        """The program's inputs ``(dense [B, N] float32, values [V] int64, lengths [F, B] int64)`` of a DataFrame of raw rows
        (and ``weights [V] float32`` for a model with weighted features).

        Raises:
            RequestError (MLflow's ``BAD_REQUEST`` when MLflow is installed): a column is missing or cannot be read.
        """
        torch = self._torch
        self.check_columns(frame)
        n = len(frame)
        columns = self._text_columns(frame) if n <= STACKED_ROWS else None
        stacked = columns is not None
        if columns is None:
            columns = {name: self._cast(name, self._arrow_column(name, frame[name])) for name in self.columns}
        table = pa.table({**columns, LABEL: pa.array(np.zeros(n, np.float32))})
        rows = self._small_rows(table, columns) if self._small and stacked else None
        if rows is None:
            rows = _Encoder(self.schema, "fail", self.error).encode(table, _RequestRows("request", "rows", np.arange(n), 0))
        values = np.concatenate([v for v, _ in rows.sparse]) if rows.sparse else np.zeros(0, np.int64)
        lengths = np.stack([ln for _, ln in rows.sparse]) if rows.sparse else np.zeros((0, n), np.int64)
        inputs = (torch.from_numpy(np.ascontiguousarray(rows.dense, dtype=np.float32)),
                  torch.from_numpy(values.astype(np.int64, copy=False)), torch.from_numpy(lengths.astype(np.int64, copy=False)))
        if not self.spec.get("weighted"):
            return inputs
        weights = rows.key_weights()
        return (*inputs, torch.from_numpy(np.ones(len(values), np.float32) if weights is None else weights))

    def check_columns(self, frame: Any) -> None:
        """Raises RequestError (MLflow's ``BAD_REQUEST``) naming the input columns ``frame`` lacks."""
        missing = [c for c in self.columns if c not in frame.columns]
        if missing:
            raise self.error(f"the request has no column {missing[0]!r}{f' (nor {missing[1:]})' if missing[1:] else ''}; "
                                 f"the model reads the columns {self.columns}. Fix: send every one of them (extra columns are ignored)")

    def _arrow_column(self, name: str, series: Any) -> pa.Array:
        """Request column ``name`` as one Arrow array (:func:`_arrow_column`).

        Raises:
            RequestError (MLflow's ``BAD_REQUEST``): its values are of kinds no one Arrow type holds (text beside
                numbers, a list beside a single value), named with the column.
        """
        try:
            return _arrow_column(series)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise self.error(f"column {name!r} cannot be read ({str(e).splitlines()[0]}): its rows hold values of different kinds "
                             f"(text beside numbers, or a list beside a single value). Fix: send one kind of value in it, as the "
                             f"signature says ({'a list per row' if _values.is_list(self.types.get(name, pa.string())) else 'one value per row'})") from None

    def _text_columns(self, frame: Any) -> dict[str, pa.Array] | None:
        """The request's columns as :meth:`_cast` makes them, converted to Arrow all at once: when every input column
        holds Python objects (what MLflow's CSV parser and the signature's ``string`` columns give), all of them are text
        or missing, and the model reads every one as text (a CSV-trained model). ``None`` otherwise (each column then goes
        its own way). Per column, a small request's conversion costs more than its values: one conversion and one
        null-token pass over every value instead of one per column (~3 ms less for a 39-column row)."""
        if not self._all_text:
            return None
        block = frame[self.columns] if list(frame.columns) != self.columns else frame
        if any(dtype.kind != "O" for dtype in block.dtypes):  # NumPy objects, or pandas strings
            return None
        n = len(block)
        try:
            values = pa.array(block.to_numpy(dtype=object).ravel(order="F"), from_pandas=True)  # column after column
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # text beside numbers: each column converted and cast alone
            return None
        if pa.types.is_null(values.type):
            values = values.cast(pa.string())
        elif not pa.types.is_string(values.type):  # a number or a list somewhere: each column converted and cast alone
            return None
        if len(self.null_values) and values.null_count < len(values):
            tokens = pc.is_in(values, value_set=self.null_values)
            if pc.any(tokens).as_py():
                values = pc.if_else(tokens, pa.scalar(None, pa.string()), values)
        return {name: values.slice(j * n, n) for j, name in enumerate(self.columns)}

    def _small_rows(self, table: pa.Table, columns: dict[str, pa.Array]) -> Any:
        """The encoded rows of a small text request (:meth:`_text_columns`), the same as the row encoder's, for a fraction
        of its per-column cost at a few rows: the single-valued vocabulary columns (:attr:`_keyed`) keyed together (their
        present values in one array, keyed in one pass by ``value_keys`` as the row encoder keys each such column, each
        column then looked up in its vocabulary), the dense columns read together (:meth:`_dense_rows`), any other column
        by the row encoder. ``None`` when a value cannot be read (the row encoder then names it)."""
        n = table.num_rows
        dense = self._dense_rows(columns, n)
        if dense is None:
            return None
        sparse: list[Any] = [None] * len(self.schema.sparse)
        for hex_digits, (positions, names, vocabularies) in self._keyed.items():
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
            others = iter(self._other_columns.encode(table, _RequestRows("request", "rows", np.arange(n), 0)).sparse)
            sparse = [next(others) if bag is None else bag for bag in sparse]
        return _rows.Rows(np.zeros(n, np.float32), dense, sparse)

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

    def _cast(self, name: str, arr: pa.Array) -> pa.Array:
        """A request column as training read it: ids sent as numbers become the text a CSV held, numbers sent as text are
        parsed, list elements cast likewise; dense columns stay numbers (the encoder reads both)."""
        target = self.types.get(name)
        if _keys.is_text(arr.type):  # pandas' strings arrive as large_string
            if arr.type != pa.string():
                arr = arr.cast(pa.string())
            numbers = target is not None and (pa.types.is_integer(target) or pa.types.is_floating(target) or pa.types.is_boolean(target))
            absent = self.absent_texts if numbers else self.null_values
            if len(absent):  # the CSV reader's missing-value tokens ("" by default) are nulls; in a number column, ABSENT_TEXTS too
                tokens = pc.is_in(arr, value_set=absent)
                if pc.any(tokens).as_py():
                    arr = pc.if_else(tokens, pa.scalar(None, pa.string()), arr)
            if target is not None and pa.types.is_integer(target):
                arr = _whole_texts(arr)
        if target is None or pa.types.is_null(arr.type) or pa.types.is_null(target) or arr.type == target:
            return arr
        if name in self.dense_columns and pa.types.is_string(target):
            return arr if pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) else arr.cast(pa.string())
        if pa.types.is_string(target) and _values.is_list(arr.type):  # a multi-hot text column sent as a list
            target = pa.list_(pa.string())
        if _values.is_list(target) and not _values.is_list(arr.type):
            raise self.error(f"column {name!r} holds {arr.type} values, but the model reads a list per row in it ({target}). "
                                 f"Fix: send a list (e.g. [3, 7, 9]) for each row")
        if pa.types.is_floating(arr.type) and not pa.types.is_floating(target):  # ids sent as numbers, made floats
            self._exact_ids(name, arr)
            arr = _integral(arr)
        try:
            return arr.cast(target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise self.error(f"column {name!r} cannot be read as {target} ({str(e).splitlines()[0]}): the model was trained "
                                 f"on {target} values in it. Fix: send {target} values") from None

    def _exact_ids(self, name: str, arr: pa.Array) -> None:
        """Raises RequestError (MLflow's ``BAD_REQUEST``) when ids of column ``name`` arrive as floats beyond
        :data:`EXACT_FLOAT` — where a float no longer holds every integer, so the id may already have lost its last digits
        (pandas parses a JSON request's integer column with a ``null`` in it as floats): keyed, it would silently read
        another id's row."""
        beyond = pc.greater(pc.abs(arr), EXACT_FLOAT)
        if pc.any(beyond).as_py():
            value = arr.filter(beyond)[0].as_py()
            raise self.error(f"column {name!r} holds the id {value:.0f} as a floating-point number, which holds integers exactly only up "
                             f"to 2**53: its last digits may be lost already (a JSON request's integers in a column that also holds a "
                             f"null are parsed as floats). Fix: send the ids as text (JSON strings), as the signature says")

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> Any:
        """``predict``'s score columns for each row of ``model_input`` (a pandas DataFrame of raw rows)."""
        import pandas as pd

        torch = self._torch
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        if len(frame) == 0:  # the program's batch is at least one row: no rows, no scores (still only with every column)
            self.check_columns(frame)
            return pd.DataFrame(empty_scores(self.spec["outputs"]))
        with torch.inference_mode():  # no autograd bookkeeping at all (no_grad still keeps version counters): less per op
            out = self.program(*self.encode(frame))
        return pd.DataFrame(scores(out, self.spec["outputs"]))


def _keyed_columns(schema: _Schema) -> dict[bool, tuple[list[int], list[str], _Vocabularies]]:
    """The sparse columns :meth:`ServedModel._small_rows` keys together: one value per row (no separator, weights nor
    cross) looked up in a vocabulary. Per ``hex``: their positions among the sparse columns, their names and their
    vocabularies."""
    groups: dict[bool, list[tuple[int, Any]]] = {}
    for j, col in enumerate(schema.sparse):
        vocabulary = schema.vocabularies.get(col.name)
        if (col.encoding == "vocab" and vocabulary is not None and vocabulary.oov_buckets > 0 and col.separator is None
                and not getattr(col, "weighted", False) and getattr(col, "weights", None) is None and not getattr(col, "cross", None)):
            groups.setdefault(bool(col.hex), []).append((j, col))
    return {hex_digits: ([j for j, _ in group], [col.name for _, col in group],
                         _Vocabularies([schema.vocabularies[col.name] for _, col in group]))
            for hex_digits, group in groups.items()}


def _only_sparse(schema: _Schema, sparse: list[Any]) -> _Schema:
    """``schema`` with only ``sparse`` as its columns (no dense ones)."""
    view = copy.copy(schema)
    view.sparse, view.dense = sparse, []
    return view


class _Vocabularies:
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


def load_program(directory: str) -> Any:
    """The program a request runs: the AOTInductor package (:data:`COMPILED_FILE`) when there is one and it loads here —
    compiled C++ kernels, ~0.8 instead of ~4 ms at one row — else the ``torch.export`` program (:func:`runnable`). A
    package that does not load (another torch, another CPU) is named in a warning and the program runs instead."""
    import torch

    compiled = os.path.join(directory, COMPILED_FILE)
    if os.path.exists(compiled):
        try:
            from torch._inductor import aoti_load_package

            return aoti_load_package(compiled)
        except Exception as e:  # noqa: BLE001 - whatever keeps it from loading, the program is there to run instead
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            warnings.warn(f"{compiled} does not load here ({type(e).__name__}: {why}); running {PROGRAM_FILE} instead", stacklevel=2)
    return runnable(torch.export.load(os.path.join(directory, PROGRAM_FILE)))


RUNTIME_CHECKS = ("_assert_scalar", "_assert_tensor_metadata")
"""ATen ops of a ``torch.export`` program that only check what its inputs are (sizes that agree, dtypes, devices):
:func:`runnable` leaves them out."""


def runnable(program: Any) -> Any:
    """``program`` (a ``torch.export.ExportedProgram``) as the module a request runs: ``program.module()`` without the
    graph's runtime checks (:data:`RUNTIME_CHECKS`) and the arithmetic on sizes that only they read.

    Those checks, with what only they read, are over half of the graph's nodes and a quarter of its time at a few rows
    (~1.3 ms of 5 at one row). They guard against inputs the row encoder never builds (ids as many as the lengths' sum,
    the dtypes traced); the scores are the same (``check_served`` compares them when the model is written).
    """
    import torch

    module = program.module()
    checks = {getattr(torch.ops.aten, name).default for name in RUNTIME_CHECKS if hasattr(torch.ops.aten, name)}
    graph = module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in checks:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    module.recompile()
    return module


def serving_threads(torch: Any) -> int:
    """Inside ``mlflow models serve``, one torch intra-op thread per server process (unless ``OMP_NUM_THREADS`` says
    otherwise); the intra-op threads it leaves, returned.

    A server runs each request in a thread of its own, and as many processes as ``--workers``: that is where its
    parallelism comes from. Torch's default, an intra-op thread per core in every process, only fights those threads and
    the client's for the cores: a 1-row request gains nothing from a parallel region, and OpenMP's helper threads keep
    spinning after one; on 2 cores one thread was faster for 1,000-row requests too (docs/performance.md, 'Serving').
    Loaded anywhere else (``mlflow.pyfunc.load_model`` in a script, a batch job), the process's setting is left alone.
    """
    if os.environ.get(SERVER_MODEL_PATH_VARIABLE) and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    return int(torch.get_num_threads())


def scores(out: Any, outputs: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The program's output as ``predict``'s columns (module docstring, step 4)."""
    import torch

    columns: dict[str, Any] = {}
    for spec in outputs:
        value = (out if spec["task"] is None else out[spec["task"]]).float()
        column, kind = spec["column"], spec["kind"]
        if kind == "vector":
            columns[column] = list(value.numpy())
        elif kind == "binary":
            columns[column] = torch.sigmoid(value.reshape(value.shape[0])).numpy()
        elif kind == "multiclass":
            prob, label = torch.softmax(value, dim=-1).max(dim=1)
            columns[f"class_{column.removeprefix('score_')}"] = label.numpy().astype(np.int64)
            columns[column] = prob.numpy()
        else:
            columns[column] = value.reshape(value.shape[0]).numpy()
    return columns


def empty_scores(outputs: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """:func:`scores`' columns, with their dtypes, for a request of no rows."""
    columns: dict[str, Any] = {}
    for spec in outputs:
        column, kind = spec["column"], spec["kind"]
        if kind == "vector":
            columns[column] = np.empty(0, object)
            continue
        if kind == "multiclass":
            columns[f"class_{column.removeprefix('score_')}"] = np.zeros(0, np.int64)
        columns[column] = np.zeros(0, np.float32)
    return columns


def _arrow_column(series: Any) -> pa.Array:
    """A request column (a pandas Series) as one Arrow array, converted as ``pa.Table.from_pandas`` converts each column
    (``pa.array(..., from_pandas=True)``: NaN and None are nulls), without building a table and its pandas metadata first:
    per request that costs more than the conversion itself for a few rows. A column of a NumPy dtype is handed over as its
    array (what ``pa.array`` takes from the Series anyway); extension and categorical dtypes as the Series."""
    try:
        arr = pa.array(series.to_numpy() if isinstance(series.dtype, np.dtype) else series, from_pandas=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        if series.dtype != object:
            raise
        # MLflow's `inputs` form hands each list cell over as a NumPy array, an empty one as float64 beside text arrays,
        # which Arrow does not convert together: as Python lists they are one list type
        arr = pa.array([cell.tolist() if isinstance(cell, np.ndarray) else cell for cell in series], from_pandas=True)
    return arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr


EXACT_FLOAT = 2**53
"""Integers above this are not all held by a float64 (:meth:`ServedModel._exact_ids`)."""
WHOLE_TEXT = r"^[+-]?[0-9]+\.0*$"
"""A whole number written with a decimal point (``"772.0"``): :func:`_whole_texts`."""


def _whole_texts(arr: pa.Array) -> pa.Array:
    """Text ids of an integer column with the decimal point pandas writes for an integer column with gaps (``"772.0"``,
    in ``to_csv`` and ``astype(str)``) as the integer's text (``"772"``), exactly — a JSON ``772.0`` is read as 772 too
    (:func:`_integral`); any other text is left for the cast to name."""
    whole = pc.match_substring_regex(arr, WHOLE_TEXT)
    if not pc.any(whole).as_py():
        return arr
    return pc.if_else(whole, pc.replace_substring_regex(arr, r"\.0*$", ""), arr)


def _integral(arr: pa.Array) -> pa.Array:
    """Floats that are all whole numbers as int64 (pandas turns an id column with a missing value into floats)."""
    if pa.types.is_floating(arr.type):
        values = arr.drop_null().to_numpy(zero_copy_only=False)
        if np.all(np.isfinite(values)) and np.all(values == np.round(values)):
            return arr.cast(pa.int64())
    return arr


def _load_pyfunc(data_path: str) -> ServedModel:
    """MLflow's pyfunc ``loader_module`` entry: the model in ``data_path`` (the MLflow model's ``data/``)."""
    return ServedModel(data_path)
