"""The top-k MLflow model export writes for a next-item model: a user's history of raw item ids in, its best items out.

For ``model=sasrec`` (and ``model.block=hstu``) trained on ``python -m recsys_runner.data sequences`` output (rows whose
Parquet metadata names the id mapping: :func:`~recsys_runner.data.sequences.mapping.mapping_folder`), ``export`` writes
``mlflow_model/`` as an MLflow pyfunc model whose ``loader_module`` is the standalone
:mod:`recsys_runner.serving.served_topk` (copied into its ``code/`` as ``recsys_topk_<hash>.py``, beside the copies the
pointwise model carries, all named by the hash of the set: :func:`~recsys_runner.serving.mlflow_model.copy_shipped`). What it holds and does: that module's docstring. Its answers are ``predict``'s top-k
(:mod:`recsys_runner.scoring_topk`): the same query (the model's state after the history, traced by ``torch.export``:
:class:`~recsys_runner.serving.program.HistoryServing`), the same item vectors (the mapping's items only, never an OOV
row), ranked exactly, the history's items left out by default, the ids named through the same mapping.

Before it is kept, the written model is loaded back through MLflow and its answers on the first rows of the training
files (their ids turned back into raw ids) compared with ``predict``'s own top-k scorer on the same rows: an export whose
served top-k differs is refused (:func:`check_served_top_k`).
"""

from __future__ import annotations

import json
import logging
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.datasets.utils import Batch

from recsys_runner import provenance, stores, uris
from recsys_runner.data.base import DataModule
from recsys_runner.data.encoding import served_program
from recsys_runner.data.encoding.stored import StoredEncoders
from recsys_runner.data.files.streaming import TabularData
from recsys_runner.data.files.tabular_config import ParquetDataConfig
from recsys_runner.data.locate import PARQUET_SUFFIXES, resolve_files
from recsys_runner.data.sequences.mapping import EarlierVocab, load_mapping, mapping_folder
from recsys_runner.distributed.env import DistEnv
from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec
from recsys_runner.metrics import top_k as top_k_module
from recsys_runner.models.jagged import padded_reference
from recsys_runner.scoring_topk import TOP_ITEMS, TOP_SCORES, NextItemModel, item_names, top_k_scorer
from recsys_runner.serving import mlflow_model, served_topk
from recsys_runner.serving.program import HistoryServing, check_same, compile_program, export_program
from recsys_runner.tasks import SINGLE_TASK, Task
from recsys_runner.train.corpus import inner_with

log = logging.getLogger("recsys_runner")

SCORE_RTOL = 1e-5
"""Relative part of the allowed difference between the served top scores and predict's (beside
:data:`~recsys_runner.serving.mlflow_model.SCORE_ATOL`): scores reach ``1 / temperature``."""


def next_item_model(model: nn.Module, tasks: tuple[Task, ...]) -> NextItemModel | None:
    """The next-item model inside ``model`` (one ``next_item`` task, ``encode`` and ``item_table``), or ``None``."""
    if [t.kind for t in tasks] != ["next_item"]:
        return None
    return cast("NextItemModel | None", inner_with(model, "item_table", "encode"))


@dataclass(frozen=True)
class TopKPlan:
    """What a next-item model's top-k model is made of beside the model (:func:`plan_top_k`)."""

    k: int
    """``export.top_k``: the ``k`` a request gets when it does not say."""
    files: list[str]
    """The training's Parquet files (their metadata names the mapping)."""
    folder: str
    """The id mapping's folder (``data sequences``' output)."""
    table: str
    """The table the items are recommended from (the item feature's)."""
    size: int
    """Items that may be recommended: ids ``0 … size-1``, the mapping's values (never an OOV row)."""
    oov_buckets: int
    columns: list[dict[str, Any]]
    """Per feature of the history group (the query program's ``values`` rows, in key order): its column, its table,
    whether the table's raw ids are integers, its vocab file in :attr:`folder`."""
    mapping: dict[str, np.ndarray]
    """Each table's raw values in id order (:func:`~recsys_runner.data.sequences.mapping.load_mapping`)."""


def plan_top_k(model: nn.Module, features: FeatureSpec, data: DataModule, k: int) -> TopKPlan | None:
    """The top-k model of a next-item model trained on ``data sequences`` output, checked before anything is traced or
    written; ``None`` for another model, or (logged: why) for one whose rows name no id mapping.

    Raises:
        ConfigError: ``k`` (``export.top_k``) exceeds the items that may be recommended; the mapping does not fit the
            model's tables.
    """
    inner = next_item_model(model, tuple(getattr(model, "tasks", SINGLE_TASK)))
    if inner is None:
        return None
    files = training_files(data)
    folder = mapping_folder(files[0]) if files else None
    if folder is None:
        log.info("no MLflow model for %s: its rows name no id mapping (they were not written by python -m recsys_runner.data "
                 "sequences), so a request's raw item ids cannot be mapped to its ids; serve model.pt2 (feature_spec.json)",
                 type(model).__name__)
        return None
    sparse = {f.name: f for f in features.sparse}
    table = sparse[inner.item_feature].table_name
    names = item_names(files, table, inner.num_items, say=False)
    if k > names.size:
        raise ConfigError(f"export.top_k={k}, but the item table ({table}) holds {names.size} items that may be recommended. "
                          f"Fix: export.top_k<={names.size}")
    vocab = EarlierVocab.load(folder)
    columns: list[dict[str, Any]] = []
    for f in features.sparse:  # the history group's features in key order: the query program's values rows
        if f.name not in inner.group.features:
            continue
        entry = vocab.tables.get(f.table_name)
        if entry is None:
            log.info("no MLflow model for %s: the id mapping in %s has no table %r (of the history column %r)", type(model).__name__,
                     folder, f.table_name, f.name)
            return None
        if entry["size"] + vocab.oov_buckets > f.num_embeddings:
            raise ConfigError(f"the id mapping in {folder} holds {entry['size']} {f.table_name} ids and {vocab.oov_buckets} OOV row(s), "
                              f"more than the model's table of {f.num_embeddings} rows: the rows were encoded for another model. "
                              f"Fix: export the model trained on these rows")
        columns.append({"column": f.name, "table": f.table_name, "integers": bool(entry["integers"]), "file": entry["file"]})
    return TopKPlan(k, files, folder, table, names.size, vocab.oov_buckets, columns, load_mapping(folder))


def write_top_k_model(plan: TopKPlan, model: nn.Module, keys: list[str], batch: Batch, data: DataModule, encoders: StoredEncoders,
                      raw: pa.Table, out: Path, compiled: bool = False) -> list[str]:
    """Write the top-k MLflow model of a next-item model (:func:`plan_top_k`) to ``out / mlflow_model`` and check it
    (module docstring); returns ``["mlflow_model"]``. ``compiled``: its query program compiled by AOTInductor too.

    Raises:
        ConfigError: the query program or the served top-k differs from the eager model's (a bug).
    """
    tasks = tuple(getattr(model, "tasks", SINGLE_TASK))
    inner = next_item_model(model, tasks)
    assert inner is not None, "write_top_k_model is called for a next-item model"
    group, columns, k = inner.group, plan.columns, plan.k
    query = HistoryServing(model, keys)
    program = export_program(query, batch)
    inputs = query.inputs(batch)
    with torch.no_grad():
        with padded_reference(model):
            eager = query(*inputs)
        check_same(eager, program.module()(*inputs), f"{type(model).__name__} (its query)")
        index = inner.item_table(batch.sparse_features)[: plan.size].float()
        index = F.normalize(index, dim=1) if inner.normalize else index
    reads_times = _reads_times(query, inputs)
    request_columns = [c["column"] for c in columns] + ([group.timestamps] if reads_times and group.timestamps else [])
    spec: dict[str, Any] = {
        "format": 1, provenance.KEY: provenance.written_by(), "model": type(model).__name__, "kind": "next_item top-k", "k": k, "exclude_seen": True,
        "history": {"columns": columns, "item_column": inner.item_feature, "times": group.timestamps,
                    "reads_times": reads_times, "timed_program": query.timed, "max_len": group.max_len,
                    "truncate": group.truncate, "oov_buckets": plan.oov_buckets},
        "items": {"table": plan.table, "count": plan.size, "mapping": str(plan.folder)},
        "outputs": [served_topk.TOP_ITEMS, served_topk.TOP_SCORES, served_topk.UNKNOWN_IDS],
    }
    target = out / mlflow_model.MODEL_DIR
    with tempfile.TemporaryDirectory(prefix="mlflow-top-k-") as tmp:
        stage = Path(tmp)
        directory, code = stage / "data", stage / "code"
        (directory / served_topk.VOCAB_DIR).mkdir(parents=True)
        code.mkdir()
        torch.export.save(program, str(directory / served_program.PROGRAM_FILE))
        if compiled:
            compile_program(program, str(directory / served_program.COMPILED_FILE))
        np.save(directory / served_topk.VECTORS_FILE, index.numpy().astype(np.float32))
        for c in columns:
            text = stores.read_bytes(uris.join(plan.folder, c["file"]), ConfigError)
            (directory / served_topk.VOCAB_DIR / f"{c['table']}.txt").write_bytes(text)
        (directory / served_topk.SPEC_FILE).write_text(json.dumps(spec, indent=1) + "\n")
        names = mlflow_model.copy_shipped(code, {served_topk.LOADER_MODULE: str(served_topk.__file__),
                                                 served_topk.TOP_K_MODULE: str(top_k_module.__file__)})
        example, _ = raw_histories(raw.slice(0, mlflow_model.EXAMPLE_ROWS), columns, plan.mapping, request_columns)
        import mlflow.pyfunc

        mlflow.pyfunc.save_model(
            path=str(target), loader_module=names[served_topk.LOADER_MODULE], data_path=str(directory),
            code_paths=sorted(str(p) for p in code.iterdir()),
            signature=signature(request_columns, k), input_example=example, pip_requirements=mlflow_model.requirements())
    check_served_top_k(target, model, tasks, data, plan, raw, encoders, request_columns)
    return [mlflow_model.MODEL_DIR]


def training_files(data: DataModule) -> list[str]:
    """The Parquet files of ``data.path`` (whose metadata names the id mapping); none for other data."""
    config = data.config if isinstance(data, TabularData) else None
    if not isinstance(config, ParquetDataConfig):
        return []
    return resolve_files(config.path, "data.path", PARQUET_SUFFIXES)


def _reads_times(query: HistoryServing, inputs: tuple[torch.Tensor, ...]) -> bool:
    """Whether the model's query depends on the history's event times (HSTU's time bias does; SASRec's blocks ignore
    them): the query of the example batch with its times, against the same with every time set to 0 and doubled."""
    if not query.timed:
        return False
    values, lengths, times = inputs
    with torch.no_grad():
        real = query(values, lengths, times)
        return any(not torch.equal(real, query(values, lengths, other)) for other in (torch.zeros_like(times), times * 2 + 1))


def raw_histories(rows: pa.Table, columns: list[dict[str, Any]], mapping: dict[str, np.ndarray],
                  request_columns: list[str]) -> tuple[Any, np.ndarray]:
    """``rows`` of ``data sequences`` output as a top-k request (a DataFrame): each history column's ids as the raw ids of
    its table (the mapping's values), the times as they are; and which rows it holds (a row with an OOV id, whose raw
    value is not known, is left out)."""
    import pandas as pd

    histories = {c["column"]: rows.column(c["column"]).to_pylist() for c in columns}
    good = np.array([all(0 <= i < len(mapping[c["table"]]) for c in columns for i in histories[c["column"]][r] or [])
                     for r in range(rows.num_rows)], bool)
    out: dict[str, list[Any]] = {}
    for name in request_columns:
        cells = histories[name] if name in histories else rows.column(name).to_pylist()
        table = next((c["table"] for c in columns if c["column"] == name), None)
        out[name] = [(mapping[table][np.asarray(cell or [], np.int64)].tolist() if table is not None else list(cell or []))
                     for cell, ok in zip(cells, good, strict=True) if ok]
    return pd.DataFrame(out), good


def signature(request_columns: list[str], k: int) -> Any:
    """The input signature: each history column and the times of type ``any``, not ``required``; the parameters ``k``
    (default ``k``) and ``exclude_seen`` (default true).

    Not MLflow's arrays: its check of an array column names no column (``Incompatible input types for column .``) and
    refuses what the model reads as training read it — ids sent as text or as whole floats, a missing cell (a user
    without history) in a required array — or names plainly: a missing id in a list, a cell that is not a list. So the
    model checks each cell itself, naming the row and the column (``TopKModel._lists``), and a request without a column
    (``TopKModel.check_columns``); the input example shows the lists a request sends."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import AnyType, ColSpec, DataType, ParamSchema, ParamSpec, Schema

    inputs = Schema([ColSpec(AnyType(), name, required=False) for name in request_columns])
    params = ParamSchema([ParamSpec("k", DataType.long, k), ParamSpec("exclude_seen", DataType.boolean, True)])
    return ModelSignature(inputs=inputs, params=params)


@contextmanager
def _quiet(name: str) -> Any:
    """``name``'s logger silenced (predict's scorer says where predict's ids come from: not news inside an export)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_served_top_k(target: Path, model: nn.Module, tasks: tuple[Task, ...], data: DataModule, plan: TopKPlan, raw: pa.Table,
                       encoders: StoredEncoders, request_columns: list[str]) -> None:
    """Load the written model through MLflow and compare its answers on ``raw``'s rows (as raw ids) with predict's top-k
    scorer's on the same rows encoded by the training encoder: the same items, the scores within
    :data:`~recsys_runner.serving.mlflow_model.SCORE_ATOL` + :data:`SCORE_RTOL` (items of equal scores may swap).

    Raises:
        ConfigError: they differ (a bug).
    """
    import mlflow.pyfunc

    rows = raw.slice(0, mlflow_model.CHECK_ROWS)
    request, keep = raw_histories(rows, plan.columns, plan.mapping, request_columns)
    rows = rows.filter(pa.array(keep))
    if rows.num_rows == 0:
        return
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    with _quiet("recsys_runner.scoring_topk"), torch.no_grad():
        reference = top_k_scorer(model, tasks, data, env, plan.files, k=plan.k, exclude_seen=True)(mlflow_model.encoded_batch(encoders, rows))
    got = mlflow.pyfunc.load_model(str(target)).predict(request)
    want_items, want_scores = reference[TOP_ITEMS].to_pylist(), reference[TOP_SCORES].to_pylist()
    for r, (items, scores) in enumerate(zip(got[served_topk.TOP_ITEMS], got[served_topk.TOP_SCORES], strict=True)):
        if not _same_top(list(items), list(scores), want_items[r], want_scores[r]):
            raise ConfigError(f"the MLflow model's top-k of the training files' row {r} ({list(items)}, scores {list(scores)}) differs "
                              f"from predict's ({want_items[r]}, {want_scores[r]}): it would not serve what predict ranks. This is "
                              f"a bug; please report it with the model and data config")
    log.info("MLflow model %s: its top %d items of %d rows of the training files (as raw ids) equal predict's", target.name, plan.k,
             rows.num_rows)


def _same_top(items: list[Any], scores: list[float], want_items: list[Any], want_scores: list[float]) -> bool:
    """The same list (best first), the scores within tolerance; where the items differ, the place's score ties (within
    tolerance) with a neighbouring place's, or it is the last place (a tie with the best item left out): their order is
    float rounding's, not another ranking."""
    if len(items) != len(want_items) or not np.allclose(scores, want_scores, rtol=SCORE_RTOL, atol=mlflow_model.SCORE_ATOL):
        return False
    tolerance = mlflow_model.SCORE_ATOL + SCORE_RTOL * np.abs(np.asarray(want_scores, np.float64))
    last = len(items) - 1
    return all(a == b or p == last or any(0 <= q <= last and abs(want_scores[q] - want_scores[p]) <= tolerance[p] for q in (p - 1, p + 1))
               for p, (a, b) in enumerate(zip(items, want_items, strict=True)))
