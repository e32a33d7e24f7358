"""The served model: raw rows in (a pandas DataFrame), the scores ``predict`` writes out — MLflow's pyfunc loader.

``export`` writes an MLflow model (:mod:`recsys_runner.serving.mlflow_model`) whose ``code/`` holds a copy of this module
(``recsys_served.py``), of the row encoder (``recsys_rows.py``: :mod:`~recsys_runner.data.encoding.rows`) and of the
vocabulary lookup (``recsys_vocabulary.py``), and whose ``data/`` holds the ``torch.export`` program, the checkpoint's
``encoders.json`` and ``serving.json`` (what the program takes and what its outputs mean). MLflow calls
:func:`_load_pyfunc` on ``data/``; :meth:`ServedModel.predict` then

1. checks that every input column the model was trained on is in the request (extra columns are ignored);
2. reads the CSV reader's missing-value tokens (``serving.json``'s ``null_values``, ``""`` by default) in a text column
   as missing, and casts each column to the Arrow type training read it as (``encoders.json``'s ``column_types``: every column of a CSV
   is text, so an id ``123`` sent as a number is keyed as the text ``"123"``, exactly as in training);
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

import importlib
import json
import os
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING or __package__:
    from . import rows as _rows
    from .vocabulary import Vocabulary
else:  # inside the MLflow model: the copies in its code/ directory, never an installed recsys_runner
    _rows = importlib.import_module("recsys_rows")
    Vocabulary = importlib.import_module("recsys_vocabulary").Vocabulary

SPEC_FILE = "serving.json"
ENCODERS_FILE = "encoders.json"
PROGRAM_FILE = "model.pt2"
SHIPPED = {"rows": "recsys_rows.py", "vocabulary": "recsys_vocabulary.py", "served": "recsys_served.py"}
"""This room's modules the MLflow model carries in ``code/``, by the names they are imported under there."""
LOADER_MODULE = "recsys_served"
LABEL = "__served_label__"
"""The zero label column the encoder is given (it encodes labels too; a request has none)."""


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
        self.types = {name: _rows.arrow_type(t) for name, t in (document.get("column_types") or {}).items() if name in self.columns}
        self.dense_columns = {d["name"] for d in document["dense"]}
        self.null_values = pa.array(list(self.spec.get("null_values") or []), pa.string())
        self.schema = _Schema(document, set(self.spec["features"]) if self.spec.get("tower") else None)
        names = [c.name for c in self.schema.sparse] + [g.timestamps for g in self.schema.sequences if g.timestamps]
        if names != self.spec["keys"] or [c.name for c in self.schema.dense] != self.spec["dense"]:
            raise ValueError(f"{directory}: {SPEC_FILE} and {ENCODERS_FILE} describe other features ({names} vs {self.spec['keys']})")
        self.error = _error_class()
        self.program = torch.export.load(os.path.join(directory, PROGRAM_FILE)).module()
        self._torch = torch

    def encode(self, frame: Any) -> tuple[Any, ...]:
        """The program's inputs ``(dense [B, N] float32, values [V] int64, lengths [F, B] int64)`` of a DataFrame of raw rows
        (and ``weights [V] float32`` for a model with weighted features).

        Raises:
            RequestError (MLflow's ``BAD_REQUEST`` when MLflow is installed): a column is missing or cannot be read.
        """
        torch = self._torch
        missing = [c for c in self.columns if c not in frame.columns]
        if missing:
            raise self.error(f"the request has no column {missing[0]!r}{f' (nor {missing[1:]})' if missing[1:] else ''}; "
                                 f"the model reads the columns {self.columns}. Fix: send every one of them (extra columns are ignored)")
        n = len(frame)
        columns = {name: self._cast(name, _arrow_column(frame[name])) for name in self.columns}
        table = pa.table({**columns, LABEL: pa.array(np.zeros(n, np.float32))})
        encoder = _Encoder(self.schema, "fail", self.error)
        rows = encoder.encode(table, _RequestRows("request", "rows", np.arange(n), 0))
        values = np.concatenate([v for v, _ in rows.sparse]) if rows.sparse else np.zeros(0, np.int64)
        lengths = np.stack([ln for _, ln in rows.sparse]) if rows.sparse else np.zeros((0, n), np.int64)
        inputs = (torch.from_numpy(np.ascontiguousarray(rows.dense, dtype=np.float32)),
                  torch.from_numpy(values.astype(np.int64, copy=False)), torch.from_numpy(lengths.astype(np.int64, copy=False)))
        if not self.spec.get("weighted"):
            return inputs
        weights = rows.key_weights()
        return (*inputs, torch.from_numpy(np.ones(len(values), np.float32) if weights is None else weights))

    def _cast(self, name: str, arr: pa.Array) -> pa.Array:
        """A request column as training read it: ids sent as numbers become the text a CSV held, numbers sent as text are
        parsed, list elements cast likewise; dense columns stay numbers (the encoder reads both)."""
        target = self.types.get(name)
        if _rows.is_text(arr.type):  # pandas' strings arrive as large_string
            if arr.type != pa.string():
                arr = arr.cast(pa.string())
            if len(self.null_values):  # the CSV reader's missing-value tokens ("" by default) are nulls
                tokens = pc.is_in(arr, value_set=self.null_values)
                if pc.any(tokens).as_py():
                    arr = pc.if_else(tokens, pa.scalar(None, pa.string()), arr)
        if target is None or pa.types.is_null(arr.type) or pa.types.is_null(target) or arr.type == target:
            return arr
        if name in self.dense_columns and pa.types.is_string(target):
            return arr if pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) else arr.cast(pa.string())
        if pa.types.is_string(target) and _rows.is_list(arr.type):  # a multi-hot text column sent as a list
            target = pa.list_(pa.string())
        if _rows.is_list(target) and not _rows.is_list(arr.type):
            raise self.error(f"column {name!r} holds {arr.type} values, but the model reads a list per row in it ({target}). "
                                 f"Fix: send a list (e.g. [3, 7, 9]) for each row")
        try:
            return _integral(arr).cast(target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise self.error(f"column {name!r} cannot be read as {target} ({str(e).splitlines()[0]}): the model was trained "
                                 f"on {target} values in it. Fix: send {target} values") from None

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> Any:
        """``predict``'s score columns for each row of ``model_input`` (a pandas DataFrame of raw rows)."""
        import pandas as pd

        torch = self._torch
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        with torch.inference_mode():  # no autograd bookkeeping at all (no_grad still keeps version counters): less per op
            out = self.program(*self.encode(frame))
        return pd.DataFrame(scores(out, self.spec["outputs"]))


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


def _arrow_column(series: Any) -> pa.Array:
    """A request column (a pandas Series) as one Arrow array, converted as ``pa.Table.from_pandas`` converts each column
    (``pa.array(..., from_pandas=True)``: NaN and None are nulls), without building a table and its pandas metadata first:
    per request that costs more than the conversion itself for a few rows. A column of a NumPy dtype is handed over as its
    array (what ``pa.array`` takes from the Series anyway); extension and categorical dtypes as the Series."""
    arr = pa.array(series.to_numpy() if isinstance(series.dtype, np.dtype) else series, from_pandas=True)
    return arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr


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
