"""What ``export`` writes, and how: the model built unsharded on CPU with the checkpoint's weights, traced into
``torch.export`` programs (the whole model, a two-tower model's towers, its item index), each checked against the eager
model before it is written, ``feature_spec.json`` describing them, and the MLflow model(s) beside them
(:mod:`recsys_runner.serving.mlflow_model`). ``python -m recsys_runner.export`` (:mod:`recsys_runner.export`) drives it;
docs/export.md is the reference."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torchrec.datasets.utils import Batch

from recsys_runner import provenance, stores, uris
from recsys_runner.checkpoint.object_storage import storage_for
from recsys_runner.checkpoint.storage import TensorIndex
from recsys_runner.checkpoint.weights import load_into
from recsys_runner.config import RunConfig
from recsys_runner.data.base import DataModule
from recsys_runner.data.catalogue.items import ItemTable
from recsys_runner.data.encoding.stored import ENCODERS_FILE, StoredEncoders, trained_on_generated_data
from recsys_runner.errors import CheckpointError, ConfigError
from recsys_runner.features import FeatureSpec
from recsys_runner.models.collision import restore_collision_state
from recsys_runner.models.dssm import tower_scores
from recsys_runner.models.jagged import padded_reference
from recsys_runner.serving import mlflow_model, raw_ids, topk
from recsys_runner.serving import quantize as quantized
from recsys_runner.serving.program import (  # noqa: F401 - EXACT_ATOL, EXACT_RTOL: the tolerances the docs and tests name
    EXACT_ATOL,
    EXACT_RTOL,
    ServingModule,
    TowerServing,
    TwoTowerModel,
    check_same,
    export_program,
)
from recsys_runner.tasks import SINGLE_TASK, Task, logit_shift
from recsys_runner.train.candidates import catalogue_candidates, eval_mapped_files

log = logging.getLogger("recsys_runner")

MODEL_FILE = "model.pt2"

FEATURE_SPEC_FILE = "feature_spec.json"

EXAMPLE_FILE = "example.pt"

TOWER_FILE = "{}_tower.pt2"
"""A two-tower model's towers, each a program of its own (``user_tower.pt2``, ``item_tower.pt2``)."""

ITEMS_FILE = "items.pt"
"""A two-tower model's item index, when the data has an item catalogue: ``{"ids": [N] int64, "vectors": [N, O] float32}``
(the item tower over every catalogue item that may be recommended, :func:`~recsys_runner.train.candidates.catalogue_candidates`,
the ones the eval ranks: what a server loads into its nearest-neighbour index)."""

CHECKPOINT_MODEL_PREFIX = "model/model."
"""DCP keys of the model's weights: ``model/`` (:mod:`recsys_runner.checkpoint`) + the TrainWrapper's ``model.``."""

CHECKPOINT_EMA_PREFIX = "ema/model."



@dataclass(frozen=True)
class Unsharded:
    """What export works on (:func:`build_unsharded`)."""

    model: nn.Module
    """The model, every table materialized on CPU, in eval mode (its weights not yet loaded)."""
    features: FeatureSpec
    batch: Batch
    """An eval batch (else a training batch): the programs are traced and checked on it."""
    data: DataModule
    items: ItemTable | None
    """The data's item catalogue; ``None`` for data without one."""
    raw: Any
    """The first rows of the files, raw (a ``pyarrow.Table``); ``None`` for generated data."""


def build_unsharded(run: RunConfig, encoders: StoredEncoders | None = None) -> Unsharded:
    """The model the config describes on CPU, its data and what export needs of it (:class:`Unsharded`). ``encoders``: the
    checkpoint's, which encode the files (:mod:`recsys_runner.data.encoding.stored`); ``None`` for a checkpoint written
    before they were stored, whose encoders are fitted again as its training fitted them (on the files' first rows)."""
    cpu = torch.device("cpu")
    data = run.data.for_model(run.model.data_needs()).build(device=cpu, encoders=encoders, fit_on_head=encoders is None)
    # Tables in float32 whatever precision.embedding_data_type trained them in (an fp16 checkpoint's rows widen exactly):
    # fbgemm's kernels pool fp16 rows in float32 and return float32, where an fp16 nn.EmbeddingBag rounds each pooled sum
    # to fp16, so only float32 tables serve the scores training and evaluate computed.
    model = run.model.build(features=data.features, dense_device=cpu)
    for module in model.modules():  # tables start on meta (sharding would place them); the weights come from the checkpoint
        if any(t.is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]):
            module.to_empty(device=cpu, recurse=False)
    batch = next(iter(data.eval_batches(0, 1)), None)
    if batch is None:
        batch = next(iter(data.train_batches(0, 0, 1)))
    raw = data.raw_rows(mlflow_model.CHECK_ROWS) if encoders is not None else None
    table = data.item_table()  # the items the eval ranks and predict recommends, none past the id mapping: the server's too
    items = None if table is None else catalogue_candidates(table, data, eval_mapped_files(data)).table
    return Unsharded(model.eval().requires_grad_(False), data.features, batch.to(cpu), data, items, raw)


def load_weights(model: nn.Module, checkpoint: Path, ema: bool) -> None:
    """Load the checkpoint's ``model/`` weights (or, for the dense ones, its ``ema/`` weights) into ``model`` in place,
    through the one strict loader (:func:`recsys_runner.checkpoint.weights.load_into`).

    Raises:
        CheckpointError: the checkpoint does not hold this model's weights (another model or data config), or no EMA.
    """
    ours = {CHECKPOINT_MODEL_PREFIX + name: tensor for name, tensor in model.state_dict().items()}

    def sources(index: TensorIndex) -> dict[str, str]:
        """Each weight's ``ema/`` twin when ``ema`` and the checkpoint has one (dense weights; tables are never averaged)."""
        if ema and not any(k.startswith(CHECKPOINT_EMA_PREFIX) for k in index):
            raise CheckpointError(f"{checkpoint} holds no EMA weights (the run had no train.ema.decay). Fix: export.weights=raw")
        twin = {k: CHECKPOINT_EMA_PREFIX + k.removeprefix(CHECKPOINT_MODEL_PREFIX) for k in ours}
        return {k: twin[k] if ema and twin[k] in index else k for k in ours}

    # one process, no process group: the storage says so to DCP (storage.single_process), which then does not warn
    # float32 tables by design (build_unsharded): an fp16 checkpoint's widen exactly, and serve predict's scores
    load_into(storage_for(checkpoint), checkpoint, ours, rule="exact", sources=sources, announce_conversion=False)
    restore_collision_state(model)  # a mapping saved by several row-wise shards is their sorted blocks end to end
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise CheckpointError(f"{type(model).__name__} has tensors no checkpoint key fills: {leftover[:3]}")


def use_ema(run: RunConfig, weights: str) -> bool:
    """Whether to export the EMA dense weights (:class:`ExportConfig`'s ``weights``)."""
    return weights == "ema" or (weights == "auto" and run.train.ema.eval_with_ema)


def feature_spec(features: FeatureSpec, keys: list[str], tasks: tuple[Task, ...], inputs: tuple[torch.Tensor, ...],
                 output: Any) -> dict[str, Any]:
    """What ``feature_spec.json`` says: how to load and call the program, its inputs and outputs."""
    named = any(t.name is not None for t in tasks)
    outputs = [{"name": t.name, "kind": t.kind, "shape": list(output[t.name].shape[1:]) if named else list(output.shape[1:]),
                "meaning": _meaning(t)} for t in tasks]
    return {
        "format": "torch.export ExportedProgram (torch.export.save)",
        "load": f"torch.export.load('{MODEL_FILE}').module()  # needs only torch=={torch.__version__.split('+')[0]} (or a "
                f"later torch that reads this format); no torchrec, fbgemm_gpu, hydra or recsys_runner",
        "call": "module(dense, values, lengths, weights)" if features.weighted else "module(dense, values, lengths)",
        "needs_torchrec": False,
        "device": "cpu",
        "inputs": {
            "dense": {"dtype": str(inputs[0].dtype).removeprefix("torch."), "shape": ["B", features.num_dense],
                      "columns": list(features.dense_names)},
            "values": {"dtype": "int64", "shape": ["V"],
                       "meaning": "every id of the batch: feature 0's ids of rows 0..B-1, then feature 1's, ... (TorchRec KJT order); "
                                  "V = lengths.sum()"},
            "lengths": {"dtype": "int64", "shape": [len(keys), "B"],
                        "meaning": "lengths[f, b]: how many ids row b has for sparse feature f (0 allowed: an empty bag)"},
            **({"weights": {"dtype": "float32", "shape": ["V"],
                            "meaning": f"the weight of each id of values (the weighted features {features.weighted_names} pool "
                                       f"by them; 1.0 for every id of the others)"}} if features.weighted else {}),
        },
        "sparse_features": [_sparse_entry(features, k) for k in keys],
        "sequences": [{"group": g.name, "features": list(g.features), "max_len": g.max_len, "truncate": g.truncate,
                       "timestamps": g.timestamps, "order": "oldest event first; a row's lengths are equal across the group"}
                      for g in features.sequences],
        "batch_size": "dynamic: any B >= 1 (and any V)",
        "output_type": "dict[task name, Tensor]" if named else "Tensor",
        "outputs": outputs,
    }


def _sparse_entry(features: FeatureSpec, key: str) -> dict[str, Any]:
    """One entry of ``feature_spec.json``'s ``sparse_features``: a feature's table size and pooling (and its history
    group), or a history group's event times, which the program reads but never embeds."""
    by_name = {f.name: f for f in features.sparse}
    groups = {f: g.name for g in features.sequences for f in g.features}
    if key in by_name:
        f = by_name[key]
        entry: dict[str, Any] = {"name": key, "num_embeddings": f.num_embeddings, "pooling": f.pooling}
        if key in groups:
            entry["history"] = groups[key]
        return entry
    group = next((g.name for g in features.sequences if g.timestamps == key), None)
    return {"name": key, "timestamps_of": group, "meaning": "event times (int64) of the history, one per event, not embedded"}


def _meaning(task: Task) -> str:
    return {"binary": "logit; sigmoid(logit) is the probability",
            "regression": "the predicted value",
            "huber": "the predicted value",
            "multiclass": "logits [B, C] of the C classes; softmax(logits, dim=1) are the class probabilities",
            "retrieval": "scores[q, c] = <user vector of row q, item vector of row c> / temperature; rank items by it",
            "next_item": "scores[b, i]: row b's user state (after its history) against item i, for every item id of the "
                         "table; the top-k are the next-item recommendations"}.get(
        task.kind, task.kind)


@dataclass(frozen=True)
class ServedRows:
    """What the MLflow model is made of beside the programs: the checkpoint's encoders (parsed, and the document as
    stored) and the first rows of the training files, raw (its input example, and the rows its scores are checked on)."""

    encoders: StoredEncoders
    document: bytes
    raw: Any
    null_values: list[str]
    """The text reader's missing-value tokens (``data.missing_texts()``: ``data.null_values`` of CSV data, the empty field of
    Criteo's; none for Parquet)."""


def served_rows(stored: StoredEncoders | None, checkpoint: Path, raw: Any, null_values: list[str]) -> ServedRows | None:
    """The MLflow model's inputs (:class:`ServedRows`), or ``None`` (logged: why no MLflow model is written)."""
    if raw is None or (stored is None and trained_on_generated_data(checkpoint) is not None):
        log.info("no MLflow model: the model was trained on generated data, which has no raw columns to encode (model.pt2 "
                 "takes its ids as they are)")
        return None
    if stored is None:
        log.warning("no MLflow model: checkpoint %s stores no data encoders (it was written before they were), so what turns a "
                    "raw row into its ids is not known for sure. Fix: fine-tune it for a step with this version, then export", checkpoint)
        return None
    return ServedRows(stored, stores.read_bytes(uris.join(str(checkpoint), ENCODERS_FILE), CheckpointError), raw, null_values)


def write_export(built: Unsharded, *, checkpoint: Path, meta: dict[str, Any], ema: bool, out: Path, served: ServedRows | None = None,
                 compiled: bool = False, top_k: topk.TopKPlan | None = None, negative_rate: float | None = None,
                 quantize: str = "none") -> list[str]:
    """Load the checkpoint's weights into ``built.model``, trace it (and a two-tower model's towers), check each program
    against the eager model on ``built.batch`` and write the files to ``out`` (with ``built.items``, a two-tower model's
    item index :data:`ITEMS_FILE` too; with ``served``, the MLflow model(s): :func:`write_mlflow_models`, their programs
    compiled by AOTInductor with ``compiled``; a next-item model's is the top-k model ``top_k`` plans); returns their names.
    ``negative_rate``: the ``data.negative_rate`` the checkpoint was trained with, whose ``log`` the program adds to its logit
    (:class:`~recsys_runner.serving.program.ServingModule`), recorded in ``feature_spec.json``.
    With ``quantize`` (``export.quantize``, checked by :func:`~recsys_runner.serving.quantize.check_quantizable`) every file
    is of the model with its tables quantized, checked against that model, and ``feature_spec.json``'s ``quantize`` says
    what it costs against the float one (:func:`~recsys_runner.serving.quantize.cost`); ``built.model``'s float tables are
    then released (:func:`~recsys_runner.serving.quantize.release_float_tables`) once the float scores are computed and the
    quantized ones written, so the export holds the float tables and the quantized ones at once only while quantizing."""
    model, features, batch, items = built.model, built.features, built.batch, built.items
    load_weights(model, checkpoint, ema)
    keys = list(batch.sparse_features.keys())
    shift = logit_shift(negative_rate)
    float_model, before = model, None
    if quantize != "none":  # the float scores first, so that the float tables can go once quantized (docs/export.md, "Memory")
        reference = ServingModule(float_model, keys, features.weighted, shift)
        with torch.no_grad(), padded_reference(float_model):
            before = reference(*reference.inputs(batch))
        model = quantized.quantize_tables(float_model, keys, quantize)
        quantized.release_float_tables(float_model)
        built = replace(built, model=model)
    serving = ServingModule(model, keys, features.weighted, shift)
    program = export_program(serving, batch)
    inputs = serving.inputs(batch)
    with torch.no_grad(), padded_reference(model):
        eager = serving(*inputs)
        exported = program.module()(*inputs)
    check_same(eager, exported, type(model).__name__)
    out.mkdir(parents=True, exist_ok=True)  # run() passes a temporary directory, moved into place when complete
    tasks = tuple(getattr(model, "tasks", SINGLE_TASK))
    described = feature_spec(features, keys, tasks, inputs, eager) | {
        "weights": "ema" if ema else "raw", "checkpoint": str(checkpoint.absolute()), "step": meta.get("step"),
        "source_run_id": meta.get("run_id"), "model": type(model).__name__,
        "negative_rate": negative_rate,  # null: trained on every row
        **({"calibration": f"trained on every positive and {negative_rate:g} of the negatives (data.negative_rate): the output "
                           f"is the model's logit + log({negative_rate:g}), whose sigmoid is the probability on all rows"}
           if negative_rate is not None else {})}
    if quantize != "none":
        described["quantize"] = quantized.cost(quantize, float_model, model, before, eager, tasks, batch.labels)
    if hasattr(model, "tower_features"):  # a two-tower model: each tower on its own as well (checked, then written)
        if features.weighted:
            raise ConfigError(f"a two-tower model with weighted features ({features.weighted_names}) cannot be exported: its towers "
                              f"take no weights yet. Fix: train it without weighted features (data.sparse weighted / weights)")
        described["towers"] = export_towers(model, keys, features, batch, eager, out)
        if items is not None:
            described["towers"]["items"] = export_items(model, items, keys, features, out, raw_ids.training_mapping(built.data))
    torch.export.save(program, str(out / MODEL_FILE))
    (out / FEATURE_SPEC_FILE).write_text(json.dumps(described, indent=2) + "\n")
    torch.save({"inputs": inputs, "outputs": eager}, out / EXAMPLE_FILE)
    log.info("exported %s (%s weights) from %s", type(model).__name__, described["weights"], checkpoint)
    towers = [t["file"] for t in described.get("towers", {}).values() if isinstance(t, dict) and "file" in t]
    models = write_mlflow_models(built, serving, keys, served, out, compiled, top_k) if served is not None else []
    return [MODEL_FILE, FEATURE_SPEC_FILE, EXAMPLE_FILE, *towers, *models]


def write_mlflow_models(built: Unsharded, serving: ServingModule, keys: list[str], served: ServedRows, out: Path, compiled: bool = False,
                        top_k: topk.TopKPlan | None = None) -> list[str]:
    """The MLflow model (:mod:`recsys_runner.serving.mlflow_model`) — one per tower for a two-tower model; for a next-item
    model the top-k model of :mod:`recsys_runner.serving.topk` — beside the programs already written to ``out``; returns
    the directories written (none when the model cannot be served so: logged)."""
    model, features = built.model, built.features
    tasks = tuple(getattr(model, "tasks", SINGLE_TASK))
    if topk.next_item_model(model, tasks) is not None:  # without a plan: its rows name no id mapping (plan_top_k said so)
        return [] if top_k is None else topk.write_top_k_model(top_k, model, keys, built.batch, built.data, served.encoders, served.raw,
                                                                out, compiled)
    two_tower = hasattr(model, "tower_features")
    why = mlflow_model.servable(tasks, two_tower)
    if why is not None:
        log.info("no MLflow model for %s: %s", type(model).__name__, why)
        return []
    base = {"format": 1, provenance.KEY: provenance.written_by(), "model": type(model).__name__, "null_values": served.null_values}
    if not two_tower:
        spec = base | {"input_columns": mlflow_model.input_columns(served.encoders), "dense": list(features.dense_names), "keys": keys,
                       "features": None, "tower": None, "outputs": mlflow_model.outputs(tasks), "weighted": features.weighted}
        mlflow_model.write_model(out / mlflow_model.MODEL_DIR, serving, out / MODEL_FILE, served.document,
                                 served.encoders, spec, served.raw, compiled=compiled)
        return [mlflow_model.MODEL_DIR]
    written = []
    mapping = raw_ids.training_mapping(built.data)  # rows of `data sequences`: the towers take the log's raw ids
    for name, mine in cast(TwoTowerModel, model).tower_features.items():
        tower = TowerServing(model, name, keys, list(features.dense_names))
        spec = base | {"input_columns": mlflow_model.input_columns(served.encoders, set(mine)), "dense": tower.dense_columns,
                       "keys": tower.sparse_keys, "features": list(mine), "tower": name,
                       "outputs": [{"column": "vector", "task": None, "kind": "vector"}]}
        document, rows, request = served.document, served.raw, None
        if mapping is not None:
            document, mapped = raw_ids.raw_id_document(served.document, mapping, set(mine))
            rows, request = raw_ids.raw_rows(served.raw, mapping, mapped)
            spec["raw_ids"] = mapped
        directory = mlflow_model.TOWER_DIR.format(name)
        mlflow_model.write_model(out / directory, tower, out / TOWER_FILE.format(name), document,
                                 served.encoders, spec, rows, compiled=compiled, request=request)
        written.append(directory)
    return written


def export_towers(model: nn.Module, keys: list[str], features: FeatureSpec, batch: Batch, scores: torch.Tensor,
                  out: Path) -> dict[str, Any]:
    """A two-tower model's towers, each as its own program (``<name>_tower.pt2``): the user tower at request time,
    the item tower to build the candidate index. Checked before writing: ``user @ item.T / temperature`` of the two
    programs is the whole model's ``scores`` on the example batch. Returns their part of ``feature_spec.json``."""
    two_tower = cast(TwoTowerModel, model)
    towers, vectors, programs = {}, {}, {}
    for name in two_tower.tower_features:
        serving = TowerServing(model, name, keys, list(features.dense_names))
        programs[name] = export_program(serving, batch)
        with torch.no_grad():
            vectors[name] = programs[name].module()(*serving.inputs(batch))
        by_name = {f.name: f for f in features.sparse}
        towers[name] = {
            "file": TOWER_FILE.format(name), "call": "module(dense, values, lengths)",
            "inputs": {"dense": {"dtype": "float32", "shape": ["B", len(serving.dense_columns)], "columns": serving.dense_columns},
                       "values": {"dtype": "int64", "shape": ["V"], "meaning": "the ids of this tower's sparse features, in KJT order"},
                       "lengths": {"dtype": "int64", "shape": [len(serving.sparse_keys), "B"]}},
            "sparse_features": [{"name": k, "num_embeddings": by_name[k].num_embeddings} for k in serving.sparse_keys],
            "output": {"shape": ["B", *(int(d) for d in vectors[name].shape[1:])],
                       "meaning": f"the {name} vectors" + (" (K interests per user, [B, K, O])" if vectors[name].dim() == 3 else "")},
        }
    temperature = float(two_tower.temperature)
    check_same(scores, tower_scores(vectors["user"], vectors["item"]) / temperature, f"{type(model).__name__} (its towers apart)")
    for name, program in programs.items():
        torch.export.save(program, str(out / TOWER_FILE.format(name)))
    score = ("scores[q, c] = max over k of user_vectors[q, k] · item_vectors[c] / temperature (each user has K interest vectors; "
             "an item scores by the best): the same as model.pt2's" if vectors["user"].dim() == 3 else
             "scores[q, c] = user_vectors[q] · item_vectors[c] / temperature: the same as model.pt2's")
    return {"score": score, "temperature": temperature, **towers}


def export_items(model: nn.Module, items: ItemTable, keys: list[str], features: FeatureSpec, out: Path,
                 mapping: raw_ids.IdMapping | None = None) -> dict[str, Any]:
    """A two-tower model's item vectors of the whole catalogue, with their ids, as :data:`ITEMS_FILE`; returns its part
    of ``feature_spec.json``. Chunked as the full-corpus evaluation builds its index (``model.corpus_chunk_rows``).
    ``mapping``: the id mapping of ``data sequences`` rows, which names each item's raw id too (``raw_ids``: what the
    served towers take and a search answers with; the catalogue's items are the mapping's, never an OOV row)."""
    two_tower = cast(TwoTowerModel, model)
    chunk = int(getattr(model, "corpus_chunk_rows", 8192))
    parts = []
    with torch.no_grad():
        for start in range(0, len(items), chunk):
            dense, sparse = items.rows(np.arange(start, min(start + chunk, len(items))), keys, features.dense_names)
            parts.append(two_tower.tower("item", dense, sparse).float())
    vectors = torch.cat(parts) if parts else torch.zeros(0, 0)
    saved: dict[str, Any] = {"ids": torch.as_tensor(np.asarray(items.ids, dtype=np.int64)), "vectors": vectors}
    described: dict[str, Any] = {
        "file": ITEMS_FILE, "load": f"torch.load('{ITEMS_FILE}')", "id_feature": items.id_feature,
        "ids": {"dtype": "int64", "shape": [len(items)], "meaning": f"each item's {items.id_feature} id, as the data encodes it"},
        "vectors": {"dtype": "float32", "shape": [len(items), int(vectors.shape[1]) if parts else 0],
                    "meaning": "item_tower.pt2's vectors of those items, row for row: the candidate index"}}
    if mapping is not None and items.id_feature in mapping.tables:
        ids, size = np.asarray(items.ids, np.int64), len(mapping.values[mapping.tables[items.id_feature]])
        inside = mapping.raw_values(items.id_feature, np.where(ids < size, ids, 0))
        saved["raw_ids"] = [raw if i < size else None for raw, i in zip(inside, ids.tolist(), strict=True)]  # None: an OOV row
        described["raw_ids"] = {"type": "list", "shape": [len(items)],
                                "meaning": f"each item's raw id in the log, through the id mapping in {mapping.folder} (what "
                                           f"mlflow_item_tower/ takes and a search answers with)"}
    torch.save(saved, out / ITEMS_FILE)
    return described
