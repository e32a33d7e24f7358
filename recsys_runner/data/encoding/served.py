"""The served model: raw rows in (a pandas DataFrame), the scores ``predict`` writes out — MLflow's pyfunc loader.

``export`` writes an MLflow model (:mod:`recsys_runner.serving.mlflow_model`) whose ``code/`` holds a copy of this module
(``recsys_served_<hash>.py``) and of what it imports: the program's loader (``recsys_served_program_<hash>.py``:
:mod:`~recsys_runner.data.encoding.served_program`), a request's columns read as training read them
(``recsys_served_request_<hash>.py``: :mod:`~recsys_runner.data.encoding.served_request`), small requests encoded together
(``recsys_served_small_<hash>.py``: :mod:`~recsys_runner.data.encoding.served_small`), the row encoder (``recsys_rows_<hash>.py``:
:mod:`~recsys_runner.data.encoding.rows`, with its blocks of rows ``recsys_encoded_rows``, label and dense columns
``recsys_number_columns``, the sparse columns' ids ``recsys_sparse_ids``, weights ``recsys_sparse_weights``, histories
``recsys_histories``, values ``recsys_values`` and keys ``recsys_keys``) and the vocabulary lookup (``recsys_vocabulary``): :data:`SHIPPED`, each name ending in the hash of
the whole set (:data:`SHIPPED` says why), and whose ``data/`` holds the
``torch.export`` program (and, when ``export`` compiled it, its AOTInductor package), the checkpoint's ``encoders.json``
and ``serving.json`` (what the program takes and what its outputs mean). MLflow calls
:func:`_load_pyfunc` on ``data/``; :meth:`ServedModel.predict` then

1. checks that every input column the model was trained on is in the request (extra columns are ignored); a request
   of no rows is answered with no rows (the program's batch is at least one row);
2. reads the CSV reader's missing-value tokens (``serving.json``'s ``null_values``, ``""`` by default) in a text column
   as missing, and casts each column to the Arrow type training read it as (``encoders.json``'s ``column_types``: every column of a CSV
   is text, so an id ``123`` sent as a number is keyed as the text ``"123"``, exactly as in training; in a column
   training read as numbers, :data:`~.served_request.ABSENT_TEXTS` are missing too and an integer written ``"772.0"`` is 772);
3. encodes the rows with the stored encoders — vocabularies, hashes, buckets, fills and normalization, histories cut to
   their ``max_len`` — through the very encoder training used, so an id unseen in training reads the OOV row it would
   have read there;
4. runs the program and turns its outputs into ``predict``'s columns: ``score`` (``score_<task>`` for several tasks) as a
   probability for a binary task, the value for a regression, and for a multi-class task the most probable class
   (``class_<task>``) with its probability; a tower of a two-tower model returns ``vector`` (one list per row), and,
   trained on ``data sequences`` rows (its ids read through their id mapping: :mod:`recsys_runner.serving.raw_ids`),
   ``unknown_ids``: per row, the raw ids the mapping does not hold (each read an OOV row).

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

if TYPE_CHECKING or __package__:
    from . import served_program as _program
    from . import values as _values
    from .served_request import RequestColumns, RequestEncoder, RequestRows
    from .served_small import SmallRequests
    from .vocabulary import Vocabulary
else:  # inside the MLflow model: the copies in its code/ directory, never an installed recsys_runner
    _CODE = __name__.removeprefix("recsys_served")  # "_<hash>": this copy's code set (SHIPPED says why)
    _program = importlib.import_module(f"recsys_served_program{_CODE}")
    _values = importlib.import_module(f"recsys_values{_CODE}")
    _request = importlib.import_module(f"recsys_served_request{_CODE}")
    RequestColumns, RequestEncoder, RequestRows = _request.RequestColumns, _request.RequestEncoder, _request.RequestRows
    SmallRequests = importlib.import_module(f"recsys_served_small{_CODE}").SmallRequests
    Vocabulary = importlib.import_module(f"recsys_vocabulary{_CODE}").Vocabulary

SPEC_FILE = "serving.json"
ENCODERS_FILE = "encoders.json"
SHIPPED = {"keys": "recsys_keys", "values": "recsys_values", "histories": "recsys_histories", "encoded_rows": "recsys_encoded_rows",
           "number_columns": "recsys_number_columns", "sparse_ids": "recsys_sparse_ids", "sparse_weights": "recsys_sparse_weights",
           "rows": "recsys_rows", "vocabulary": "recsys_vocabulary", "served_program": "recsys_served_program", "served_request": "recsys_served_request",
           "served_small": "recsys_served_small", "served": "recsys_served"}
"""This room's modules the MLflow model carries in ``code/``, by the stem of the names they are imported under there: each
is written as ``<stem>_<hash>.py``, ``<hash>`` a digest of the whole set of files the model carries
(:func:`~recsys_runner.serving.mlflow_model.copy_shipped`), and imports the others as ``<stem>_<hash>`` too: the suffix
of its own ``__name__`` (``_CODE`` in each module), so one source file is the package's module and every model's copy.

Why names that carry the code's hash: MLflow puts a model's ``code/`` first on ``sys.path`` and imports its loader by
name, and Python imports a name once per process. Under fixed names (models exported before 2026-12-02: ``recsys_served``,
``recsys_values``, …), the second of two models exported by different recsys_runner versions ran the first one's code on
its own data (a notebook comparing two days' models, one server hosting both). Under content-addressed names, models of
other code never share a module name, so each runs its own; models of the same code share the modules, which are the same.
"""
LOADER_MODULE = "recsys_served"
"""The stem of the loader's name (the MLflow model's ``loader_module`` is ``recsys_served_<hash>``)."""
UNKNOWN_IDS = "unknown_ids"
"""The column a tower served on raw ids adds: per row, the ids its id mapping does not hold (``spec["raw_ids"]``)."""
LABEL = "__served_label__"
"""The zero label column the encoder is given (it encodes labels too; a request has none)."""


class _Schema:
    """The stored schema as the row encoder reads it (by attribute), with a zero label in place of the training labels.

    ``keep``: a tower's features (``None``: every feature). A history group keeps the features the tower reads, so each is
    still cut to the group's ``max_len`` as training cut it, and its event times only when the tower reads them: a tower
    program takes the features it lists and no others (a two-tower model on ``data sequences`` rows lists the histories,
    not their ``hist_ts``), so times the tower does not read would be a key the program has no input for.
    """

    def __init__(self, document: dict[str, Any], keep: set[str] | None = None) -> None:
        def wanted(name: str) -> bool:
            return keep is None or name in keep

        self.dense = [SimpleNamespace(**d) for d in document["dense"] if wanted(d["name"])]
        self.sparse = [_sparse_column(s) for s in document["sparse"] if wanted(s["name"])]
        names = {c.name for c in self.sparse}
        self.sequences = [SimpleNamespace(name=name, features=kept, max_len=int(g["max_len"]), truncate=g.get("truncate") or "recent",
                                          timestamps=g.get("timestamps") if g.get("timestamps") and wanted(g["timestamps"]) else None)
                          for name, g in (document.get("sequences") or {}).items()
                          if (kept := tuple(f for f in g["features"] if f in names))]
        self.vocabularies = {name: Vocabulary(np.asarray(v["keys"], dtype=np.uint64), np.asarray(v["rows"], dtype=np.int64),
                                              int(v["capacity"]), int(v["oov_buckets"]))
                             for name, v in document["vocabularies"].items() if name in names}
        self.labels, self.label_threshold = None, None
        self.label_columns = self.label_tasks = [LABEL]

    @staticmethod
    def label_kind(task: str) -> str:
        return "regression"


def _single_valued(document: dict[str, Any]) -> set[str]:
    """The raw columns ``encoders.json`` reads one value per row in: its dense columns, and its id columns with no
    separator (a column training read as a list type is told apart by :class:`.served_request.RequestColumns`)."""
    return {d["name"] for d in document["dense"]} | {s["name"] for s in document["sparse"]
                                                     if s.get("separator") is None and not s.get("cross")}


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
        columns: list[str] = list(self.spec["input_columns"])
        self.error = _program.error_class()
        self.request = RequestColumns(
            columns, {name: _values.arrow_type(t) for name, t in (document.get("column_types") or {}).items() if name in columns},
            {d["name"] for d in document["dense"]}, _single_valued(document), list(self.spec.get("null_values") or []), self.error)
        """How a request's columns become the columns training read (steps 1 and 2 of :meth:`predict`)."""
        self.schema = _Schema(document, set(self.spec["features"]) if self.spec.get("tower") else None)
        names = [c.name for c in self.schema.sparse] + [g.timestamps for g in self.schema.sequences if g.timestamps]
        if names != self.spec["keys"] or [c.name for c in self.schema.dense] != self.spec["dense"]:
            raise ValueError(f"{directory}: {SPEC_FILE} and {ENCODERS_FILE} describe other features ({names} vs {self.spec['keys']})")
        small = self.request.all_text and not self.schema.sequences and not self.spec.get("weighted")
        self.small = SmallRequests(self.schema, self.error) if small else None
        """Small text requests' encoder (not for a model with histories or weighted features), else ``None``."""
        self.raw_ids: list[str] = list(self.spec.get("raw_ids") or [])
        """The features read through an id mapping (a tower of a model trained on ``data sequences`` rows:
        :mod:`recsys_runner.serving.raw_ids`), whose unknown ids each row's ``unknown_ids`` counts; none for other models."""
        self.program = _program.load_program(directory)
        self._torch = torch
        self.threads = _program.serving_threads(torch)
        """Torch's intra-op threads once loaded (one inside ``mlflow models serve``: :func:`.served_program.serving_threads`)."""

    def encode(self, frame: Any) -> tuple[Any, ...]:
        """The program's inputs ``(dense [B, N] float32, values [V] int64, lengths [F, B] int64)`` of a DataFrame of raw rows
        (and ``weights [V] float32`` for a model with weighted features).

        Raises:
            RequestError (MLflow's ``BAD_REQUEST`` when MLflow is installed): a column is missing or cannot be read.
        """
        torch = self._torch
        columns, stacked = self.request.read(frame)
        n = len(frame)
        table = pa.table({**columns, LABEL: pa.array(np.zeros(n, np.float32))})
        rows = self.small.rows(table, columns) if self.small is not None and stacked else None
        if rows is None:
            rows = RequestEncoder(self.schema, "fail", self.error).encode(table, RequestRows("request", "rows", np.arange(n), 0))
        values = np.concatenate([v for v, _ in rows.sparse]) if rows.sparse else np.zeros(0, np.int64)
        lengths = np.stack([ln for _, ln in rows.sparse]) if rows.sparse else np.zeros((0, n), np.int64)
        inputs = (torch.from_numpy(np.ascontiguousarray(rows.dense, dtype=np.float32)),
                  torch.from_numpy(values.astype(np.int64, copy=False)), torch.from_numpy(lengths.astype(np.int64, copy=False)))
        if not self.spec.get("weighted"):
            return inputs
        weights = rows.key_weights()
        return (*inputs, torch.from_numpy(np.ones(len(values), np.float32) if weights is None else weights))

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> Any:
        """``predict``'s score columns for each row of ``model_input`` (a pandas DataFrame of raw rows)."""
        import pandas as pd

        torch = self._torch
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(_rows_of(model_input))
        if len(frame) == 0:  # the program's batch is at least one row: no rows, no scores (still only with every column)
            self.request.check(frame)
            empty = empty_scores(self.spec["outputs"]) | ({UNKNOWN_IDS: np.zeros(0, np.int64)} if self.raw_ids else {})
            return pd.DataFrame(empty, index=frame.index)
        inputs = self.encode(frame)
        with torch.inference_mode():  # no autograd bookkeeping at all (no_grad still keeps version counters): less per op
            out = self.program(*inputs)
        columns = scores(out, self.spec["outputs"])
        if self.raw_ids:
            columns[UNKNOWN_IDS] = self.unknown_ids(inputs[1].numpy(), inputs[2].numpy())
        # the request's index, so that ``frame.assign(score=model.predict(frame)["score"])`` lines up row by row whatever the
        # index (a sorted, sampled or filtered frame): pandas aligns on it, and a fresh 0..n-1 would misplace every row
        return pd.DataFrame(columns, index=frame.index)

    def unknown_ids(self, values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Per row, the ids of :attr:`raw_ids`' features the id mapping does not hold — each read an OOV row, at or past
        its vocabulary's ``capacity`` — as the top-k model counts them (a history's after it is cut to ``max_len``)."""
        features, rows = lengths.shape
        first_oov = np.full(features, np.iinfo(np.int64).max, np.int64)  # the keys past the sparse columns: event times
        for i, column in enumerate(self.schema.sparse):
            if column.name in self.raw_ids:
                first_oov[i] = self.schema.vocabularies[column.name].capacity
        feature = np.repeat(np.arange(features), lengths.sum(axis=1))
        row = np.repeat(np.tile(np.arange(rows), features), lengths.reshape(-1))
        return np.bincount(row[values >= first_oov[feature]], minlength=rows).astype(np.int64)


def _rows_of(model_input: Any) -> Any:
    """What ``pd.DataFrame`` makes a request of that is not a DataFrame (MLflow hands one over for a column signature; a
    caller of :class:`ServedModel` may not): a dict of one value per column is one row, as MLflow reads it, not pandas'
    ``If using all scalar values, you must pass an index``."""
    if isinstance(model_input, dict) and all(v is None or np.isscalar(v) for v in model_input.values()):
        return [model_input]
    return model_input


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


def _load_pyfunc(data_path: str) -> ServedModel:
    """MLflow's pyfunc ``loader_module`` entry: the model in ``data_path`` (the MLflow model's ``data/``), refused when this
    process imported a module of its ``code/``'s names from another model's files that differ (one of the two was edited
    after export: :func:`.served_program.check_own_code`)."""
    _program.check_own_code(data_path)
    return ServedModel(data_path)
