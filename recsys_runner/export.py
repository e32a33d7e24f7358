"""``python -m recsys_runner.export load=<checkpoint | run id> [overrides]``: the model, for serving.

Writes ``<export.dir>/model.pt2`` — the trained model, unsharded, as a ``torch.export`` program that
loads with ``torch`` alone (no recsys_runner, Hydra, TorchRec or fbgemm_gpu) — beside
``feature_spec.json`` (the inputs it takes, in order, and the outputs it returns), ``example.pt`` (one
batch of inputs with the outputs the exporting process computed, for a server's smoke test) and
``manifest.json`` (:mod:`recsys_runner.tracking.lineage`); all four are logged to a new MLflow run tagged
``entry=export`` whose parent is the training run. A two-tower model (DSSM) also gets each tower as a program of
its own, ``user_tower.pt2`` and ``item_tower.pt2`` (:class:`TowerServing`): user vectors at request time, item
vectors once for the candidate index; ``feature_spec.json``'s ``towers`` says what each takes.

**Why torch.export, not TorchScript.** Under torch 2.13 / TorchRec 1.8 ``torch.export.export(...,
strict=False)`` traces an unsharded :class:`~torchrec.modules.embedding_modules.EmbeddingBagCollection`
into plain ATen ops (TorchRec takes torch-only paths while exporting, e.g. ``torch.cumsum`` instead of
fbgemm's ``asynchronous_complete_cumsum``), with the batch size and the number of ids left dynamic; it
works for all six built-in models, gives bit-identical scores, and TorchScript is in maintenance only.
``torch.jit.script`` fails on these models' Python (e.g. DeepFM's ``SparseArch.fields``), and
``torch.jit.trace`` would freeze the per-feature id counts of the traced batch into the graph. TorchRec's
own ``torchrec.ir`` serializer is not used: it keeps the EBC as a TorchRec module to be swapped back in,
so loading it needs TorchRec.

**Inputs are plain tensors**, not a KeyedJaggedTensor, so a server needs no TorchRec: the exported
forward is ``module(dense [B, N] float32, values [V] int64, lengths [F, B] int64)``, where ``lengths[f, b]``
is how many ids row ``b`` has for sparse feature ``f`` (features in ``feature_spec.json``'s order) and
``values`` holds every id, feature by feature and row by row within a feature (TorchRec's KJT layout).
It returns what the model returns: logits ``[B]`` (single task), ``{task: [B]}`` (multi-task; ``[B, C]`` for a multiclass task) or
scores ``[B, B]`` (two-tower retrieval); see ``feature_spec.json``'s ``outputs``.

**Atomic output.** The files are written into a temporary sibling of ``export.dir`` (``.<name>.tmp-<pid>``) and moved
into place only when all are written and checked, so ``export.dir`` holds one whole export or none; a failed or
interrupted export (any exception, including Ctrl-C and the SIGTERM the lifecycle turns into one) deletes the
temporary directory. A non-empty ``export.dir`` is refused before any model is built, unless
``export.overwrite=true``: then the earlier export is replaced as a whole (its files, e.g. a DSSM's tower programs,
do not linger beside the new model) once the new one is complete. Overwrite replaces only an earlier export: a
directory holding files no export writes is refused even then.

**Weights.** The checkpoint's ``model/<fqn>`` tensors are loaded with ``torch.distributed.checkpoint``
into a model built from the validated config with its tables on CPU (DCP reshards whatever plan the
run trained with into plain tensors). With ``train.ema.eval_with_ema=true`` the dense weights come
from ``ema/<fqn>`` instead, because those are the weights that were evaluated and that picked the
best checkpoint (``export.weights=raw`` or ``ema`` overrides; tables are never averaged). The forward
runs in float32 without the run's autocast."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchrec.datasets.utils import Batch

from recsys_runner import stores
from recsys_runner.checkpoint.object_storage import storage_for
from recsys_runner.checkpoint.storage import TensorIndex
from recsys_runner.checkpoint.weights import load_into
from recsys_runner.config import RunConfig, flatten, register_entry_schema, to_yaml, validate
from recsys_runner.data.encoding.stored import ENCODERS_FILE, StoredEncoders, read_stored
from recsys_runner.data.items import ItemTable
from recsys_runner.errors import CheckpointError, ConfigError, require
from recsys_runner.features import FeatureSpec
from recsys_runner.inference import LOAD_FIELD, carry_training_overrides, checkpoint_to_load, with_training_overrides
from recsys_runner.lifecycle import RunStart, exit_codes, link_tags, tracked_run
from recsys_runner.models.collision import restore_collision_state
from recsys_runner.noise import quiet_known_noise
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.runtime import Launch
from recsys_runner.serving import mlflow_model
from recsys_runner.serving.program import ServingModule, TowerServing, TwoTowerModel, export_program
from recsys_runner.tasks import SINGLE_TASK, Task
from recsys_runner.tracking import lineage
from recsys_runner.tracking.store import resolve_uri
from recsys_runner.tracking.tracker import MlflowTrackingConfig, Tracker

quiet_known_noise()  # the known library warnings, each with its reason (noise.py)

log = logging.getLogger("recsys_runner")

MODEL_FILE = "model.pt2"

FEATURE_SPEC_FILE = "feature_spec.json"

EXAMPLE_FILE = "example.pt"

TOWER_FILE = "{}_tower.pt2"
"""A two-tower model's towers, each a program of its own (``user_tower.pt2``, ``item_tower.pt2``)."""

ITEMS_FILE = "items.pt"
"""A two-tower model's item index, when the data has an item catalogue: ``{"ids": [N] int64, "vectors": [N, O] float32}``
(the item tower over every catalogue item: what a server loads into its nearest-neighbour index)."""

ARTIFACT_DIR = "export"
"""Where the files go inside the MLflow run's artifacts."""

CHECKPOINT_MODEL_PREFIX = "model/model."
"""DCP keys of the model's weights: ``model/`` (:mod:`recsys_runner.checkpoint`) + the TrainWrapper's ``model.``."""

CHECKPOINT_EMA_PREFIX = "ema/model."

WEIGHTS = ("auto", "raw", "ema")

EXACT_ATOL = 1e-6
"""Largest absolute difference allowed between the exported program and the eager model on the example batch, plus
:data:`EXACT_RTOL` of the output's size."""
EXACT_RTOL = 1e-6
"""The relative part of the allowed difference: a transformer's eager kernels (PyTorch's fused encoder fast path) and
the traced ATen ops sum in another order, differing by float32 rounding of logits of a few units."""


@dataclass(kw_only=True)
class ExportConfig:
    """The ``export`` section of ``conf/export.yaml``."""

    dir: str | None = None
    """Where ``model.pt2``, ``feature_spec.json``, ``example.pt`` and ``manifest.json`` go; ``null`` is
    ``<Hydra run dir>/export``."""
    weights: str = "auto"
    """``auto``: the EMA dense weights when the run evaluated with them (``train.ema.eval_with_ema``), else the
    trained ones; ``raw`` or ``ema`` to choose."""
    overwrite: bool = False
    """Replace the earlier export in a non-empty ``dir`` (as a whole, once the new one is complete); ``false`` refuses
    such a directory."""
    mlflow_model: bool = True
    """Also write the MLflow model (``mlflow_model/``: raw rows in, ``predict``'s scores out; docs/export.md) and log it
    as the export run's model. Needs file data (its encoders are stored with the checkpoint)."""
    register_as: str | None = None
    """Register a version of the MLflow model under this name in the MLflow model registry (the UI's Models page)."""

    def __post_init__(self) -> None:
        require(self.weights in WEIGHTS, f"export.weights={self.weights!r} must be one of {list(WEIGHTS)}")
        require(self.register_as is None or (self.mlflow_model and bool(self.register_as.strip())),
                f"export.register_as={self.register_as!r} registers the MLflow model: it needs export.mlflow_model=true and "
                f"a non-empty name")


def register() -> None:
    """Store ``export_schema``: the training schema plus ``load`` and ``export`` (``conf/export.yaml``)."""
    register_entry_schema("export", [
        LOAD_FIELD,
        ("export", ExportConfig, field(default_factory=ExportConfig)),
    ])


def build_unsharded(run: RunConfig, encoders: StoredEncoders | None = None) -> tuple[nn.Module, FeatureSpec, Batch, ItemTable | None, Any]:
    """The model the config describes, every table materialized on CPU, in eval mode; its features; an eval batch; the
    data's item catalogue (``None`` for data without one); the first rows of the files, raw (``None`` for generated
    data). ``encoders``: the checkpoint's, which encode the files (:mod:`recsys_runner.data.encoding.stored`)."""
    cpu = torch.device("cpu")
    data = run.data.for_model(run.model.data_needs()).build(device=cpu, encoders=encoders)
    model = run.model.build(features=data.features, dense_device=cpu)
    for module in model.modules():  # tables start on meta (sharding would place them); the weights come from the checkpoint
        if any(t.is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]):
            module.to_empty(device=cpu, recurse=False)
    batch = next(iter(data.eval_batches(0, 1)), None)
    if batch is None:
        batch = next(iter(data.train_batches(0, 0, 1)))
    raw = data.raw_rows(mlflow_model.CHECK_ROWS) if encoders is not None else None
    return model.eval().requires_grad_(False), data.features, batch.to(cpu), data.item_table(), raw


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

    with warnings.catch_warnings():  # "torch.distributed is … uninitialized, assuming … a single process": just so
        warnings.simplefilter("ignore", UserWarning)
        load_into(storage_for(checkpoint), checkpoint, ours, rule="exact", sources=sources)
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
        "call": "module(dense, values, lengths)",
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


def export_dir(configured: str | None, launch: Launch) -> Path:
    """``export.dir``, else ``<Hydra run dir>/export``."""
    if configured is not None:
        return stores.as_path(configured)
    default = launch.under_output_dir("export")
    if default is None:
        raise ConfigError("export.dir is not set and this is not a Hydra run. Fix: export.dir=<directory>")
    return default


def is_export_file(name: str) -> bool:
    """Whether ``name`` is a file (or MLflow model directory) an export writes (what ``export.overwrite=true`` may replace)."""
    return (name in (MODEL_FILE, FEATURE_SPEC_FILE, EXAMPLE_FILE, ITEMS_FILE, lineage.MANIFEST_FILE, mlflow_model.MODEL_DIR)
            or name.endswith(TOWER_FILE.format("")) or (name.startswith("mlflow_") and name.endswith("_tower")))


def check_target(out: Path, overwrite: bool) -> None:
    """Refuse an ``export.dir`` that is a file, or a non-empty directory unless ``overwrite`` (and then only one holding
    nothing but an earlier export's files); called before any model is built.

    Raises:
        ConfigError: naming the directory, what it holds and the fix.
    """
    remote = stores.is_uri(out)  # a prefix in an object store: what is under it
    if not remote and out.exists() and not out.is_dir():
        raise ConfigError(f"export.dir={out} is a file, not a directory. Fix: export.dir=<a new or empty directory>")
    held = sorted(p.rsplit("/", 1)[-1] for p in stores.glob(f"{out}/*", ConfigError)) if remote else \
        sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    shown = held[:8] + ([f"… {len(held) - 8} more"] if len(held) > 8 else [])
    if not overwrite:
        raise ConfigError(f"export.dir={out} is not empty (it holds {shown}): an earlier export's files would be overwritten or "
                          f"mixed with this one's. Fix: export.overwrite=true to replace them, or a new export.dir")
    foreign = [n for n in held if not (is_export_file(n) and (remote or (out / n).is_file() or n.startswith("mlflow_")))]
    if foreign:
        raise ConfigError(f"export.dir={out} holds {foreign[:8]}, which no export writes; export.overwrite=true replaces only an "
                          f"earlier export's files. Fix: a new export.dir, or move those away")


def replace_dir(staged: Path, out: Path) -> None:
    """Move the complete export ``staged`` to ``out``, replacing an earlier export there as a whole: the earlier one is
    first renamed aside, so ``out`` never holds the files of two exports. In an object store (no rename) the earlier
    export's objects are deleted and the new ones uploaded, each whole."""
    if stores.is_uri(out):
        stores.remove(str(out), ConfigError)
        stores.upload(staged, str(out), ConfigError)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)  # left by an earlier process of this id that was killed here
    if out.exists():
        os.replace(out, old)
    try:
        os.replace(staged, out)
    except BaseException:
        if old.exists() and not out.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def run(cfg: DictConfig, launch: Launch = Launch()) -> Path:
    """Export the checkpoint ``cfg.load`` names; returns the directory written (see the module docstring)."""
    options = _options(cfg)
    spec = validate(cfg)
    checkpoint = checkpoint_to_load(cfg, spec)
    out = export_dir(options.dir, launch)
    check_target(out, options.overwrite)
    meta = json.loads(stores.read_bytes(str(checkpoint / "meta.json"), CheckpointError))
    torch.manual_seed(spec.seed)
    stored = read_stored(checkpoint)
    model, features, batch, items, raw = build_unsharded(spec, stored)
    rows = served_rows(stored, checkpoint, raw, list(getattr(spec.data, "null_values", None) or [])) if options.mlflow_model else None
    ema = use_ema(spec, options.weights)
    manifest = lineage.collect(world_size=1, device=torch.device("cpu"))
    start = RunStart(
        run_name=f"export {type(model).__name__} step {meta.get('step')}", params=flatten(spec),
        tags=link_tags("export", checkpoint, meta.get("step"), meta.get("run_id")) | {"export.weights": "ema" if ema else "raw"},
        texts={"config.yaml": to_yaml(spec)}, manifest=manifest)
    tracker = spec.tracking.build()
    with tracked_run(tracker, start, launch):
        remote = stores.is_uri(out)  # staged on the local disk, then uploaded
        staged = (Path(tempfile.mkdtemp(prefix="export-")) if remote else out.parent) / f".{out.name}.tmp-{os.getpid()}"
        try:
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
            files = write_export(model, features, batch, checkpoint=checkpoint, meta=meta, ema=ema, out=staged, items=items, served=rows)
            (staged / lineage.MANIFEST_FILE).write_text(manifest.to_json() + "\n")
            check_target(out, options.overwrite)  # still as checked before the build (nothing else wrote there since)
            replace_dir(staged, out)
            log.info("wrote %s to %s", ", ".join([*files, lineage.MANIFEST_FILE]), out)
            _log_artifacts(spec, tracker, staged if remote else out, [*files, lineage.MANIFEST_FILE], options.register_as)
        finally:  # an error or a stop anywhere above leaves no partial export behind
            shutil.rmtree(staged.parent if remote else staged, ignore_errors=True)
    return out


@dataclass(frozen=True)
class ServedRows:
    """What the MLflow model is made of beside the programs: the checkpoint's encoders (parsed, and the document as
    stored) and the first rows of the training files, raw (its input example, and the rows its scores are checked on)."""

    encoders: StoredEncoders
    document: bytes
    raw: Any
    null_values: list[str]
    """The text reader's missing-value tokens (``data.null_values`` of CSV data; none for Parquet)."""


def served_rows(stored: StoredEncoders | None, checkpoint: Path, raw: Any, null_values: list[str]) -> ServedRows | None:
    """The MLflow model's inputs (:class:`ServedRows`), or ``None`` (logged: why no MLflow model is written)."""
    if raw is None:
        log.info("no MLflow model: the model was trained on generated data, which has no raw columns to encode (model.pt2 "
                 "takes its ids as they are)")
        return None
    if stored is None:
        log.warning("no MLflow model: checkpoint %s stores no data encoders (it was written before they were), so what turns a "
                    "raw row into its ids is not known for sure. Fix: fine-tune it for a step with this version, then export", checkpoint)
        return None
    return ServedRows(stored, stores.read_bytes(stores.join(str(checkpoint), ENCODERS_FILE), CheckpointError), raw, null_values)


def write_export(model: nn.Module, features: FeatureSpec, batch: Batch, *, checkpoint: Path, meta: dict[str, Any], ema: bool,
                 out: Path, items: ItemTable | None = None, served: ServedRows | None = None) -> list[str]:
    """Load the checkpoint's weights into ``model``, trace it (and a two-tower model's towers), check each program
    against the eager model on ``batch`` and write the files to ``out`` (with ``items``, a two-tower model's item
    index :data:`ITEMS_FILE` too; with ``served``, the MLflow model(s): :func:`write_mlflow_models`); returns their names."""
    load_weights(model, checkpoint, ema)
    keys = list(batch.sparse_features.keys())
    serving = ServingModule(model, keys)
    program = export_program(serving, batch)
    inputs = serving.inputs(batch)
    with torch.no_grad():
        eager = serving(*inputs)
        exported = program.module()(*inputs)
    _check_same(eager, exported, type(model).__name__)
    out.mkdir(parents=True, exist_ok=True)  # run() passes a temporary directory, moved into place when complete
    tasks = tuple(getattr(model, "tasks", SINGLE_TASK))
    described = feature_spec(features, keys, tasks, inputs, eager) | {
        "weights": "ema" if ema else "raw", "checkpoint": str(checkpoint.absolute()), "step": meta.get("step"),
        "source_run_id": meta.get("run_id"), "model": type(model).__name__}
    if hasattr(model, "tower_features"):  # a two-tower model: each tower on its own as well (checked, then written)
        described["towers"] = export_towers(model, keys, features, batch, eager, out)
        if items is not None:
            described["towers"]["items"] = export_items(model, items, keys, features, out)
    torch.export.save(program, str(out / MODEL_FILE))
    (out / FEATURE_SPEC_FILE).write_text(json.dumps(described, indent=2) + "\n")
    torch.save({"inputs": inputs, "outputs": eager}, out / EXAMPLE_FILE)
    log.info("exported %s (%s weights) from %s", type(model).__name__, described["weights"], checkpoint)
    towers = [t["file"] for t in described.get("towers", {}).values() if isinstance(t, dict) and "file" in t]
    models = write_mlflow_models(model, serving, keys, features, served, out) if served is not None else []
    return [MODEL_FILE, FEATURE_SPEC_FILE, EXAMPLE_FILE, *towers, *models]


def write_mlflow_models(model: nn.Module, serving: ServingModule, keys: list[str], features: FeatureSpec, served: ServedRows,
                        out: Path) -> list[str]:
    """The MLflow model (:mod:`recsys_runner.serving.mlflow_model`) — one per tower for a two-tower model — beside the
    programs already written to ``out``; returns the directories written (none when the model's task cannot be served
    row by row: logged)."""
    tasks = tuple(getattr(model, "tasks", SINGLE_TASK))
    two_tower = hasattr(model, "tower_features")
    why = mlflow_model.servable(tasks, two_tower)
    if why is not None:
        log.info("no MLflow model for %s: %s", type(model).__name__, why)
        return []
    base = {"format": 1, "model": type(model).__name__, "null_values": served.null_values}
    if not two_tower:
        spec = base | {"input_columns": mlflow_model.input_columns(served.encoders), "dense": list(features.dense_names), "keys": keys,
                       "features": None, "tower": None, "outputs": mlflow_model.outputs(tasks)}
        mlflow_model.write_model(out / mlflow_model.MODEL_DIR, serving, torch.export.load(str(out / MODEL_FILE)), served.document,
                                 served.encoders, spec, served.raw)
        return [mlflow_model.MODEL_DIR]
    written = []
    for name, mine in cast(TwoTowerModel, model).tower_features.items():
        tower = TowerServing(model, name, keys, list(features.dense_names))
        spec = base | {"input_columns": mlflow_model.input_columns(served.encoders, set(mine)), "dense": tower.dense_columns,
                       "keys": tower.sparse_keys, "features": list(mine), "tower": name,
                       "outputs": [{"column": "vector", "task": None, "kind": "vector"}]}
        directory = mlflow_model.TOWER_DIR.format(name)
        mlflow_model.write_model(out / directory, tower, torch.export.load(str(out / TOWER_FILE.format(name))), served.document,
                                 served.encoders, spec, served.raw)
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
            "output": {"shape": ["B", int(vectors[name].shape[1])], "meaning": f"the {name} vectors"},
        }
    temperature = float(two_tower.temperature)
    _check_same(scores, vectors["user"] @ vectors["item"].t() / temperature, f"{type(model).__name__} (its towers apart)")
    for name, program in programs.items():
        torch.export.save(program, str(out / TOWER_FILE.format(name)))
    return {"score": "scores[q, c] = user_vectors[q] · item_vectors[c] / temperature: the same as model.pt2's", "temperature": temperature,
            **towers}


def export_items(model: nn.Module, items: ItemTable, keys: list[str], features: FeatureSpec, out: Path) -> dict[str, Any]:
    """A two-tower model's item vectors of the whole catalogue, with their ids, as :data:`ITEMS_FILE`; returns its part
    of ``feature_spec.json``. Chunked as the full-corpus evaluation builds its index (``model.corpus_chunk_rows``)."""
    two_tower = cast(TwoTowerModel, model)
    chunk = int(getattr(model, "corpus_chunk_rows", 8192))
    parts = []
    with torch.no_grad():
        for start in range(0, len(items), chunk):
            dense, sparse = items.rows(np.arange(start, min(start + chunk, len(items))), keys, features.dense_names)
            parts.append(two_tower.tower("item", dense, sparse).float())
    vectors = torch.cat(parts) if parts else torch.zeros(0, 0)
    torch.save({"ids": torch.as_tensor(np.asarray(items.ids, dtype=np.int64)), "vectors": vectors}, out / ITEMS_FILE)
    return {"file": ITEMS_FILE, "load": f"torch.load('{ITEMS_FILE}')", "id_feature": items.id_feature,
            "ids": {"dtype": "int64", "shape": [len(items)], "meaning": f"each item's {items.id_feature} id, as the data encodes it"},
            "vectors": {"dtype": "float32", "shape": [len(items), int(vectors.shape[1]) if parts else 0],
                        "meaning": "item_tower.pt2's vectors of those items, row for row: the candidate index"}}


def _options(cfg: DictConfig) -> ExportConfig:
    """The ``export`` section, validated."""
    options = OmegaConf.to_object(cfg.export)
    assert isinstance(options, ExportConfig)
    return options


def _check_same(eager: Any, exported: Any, model: str) -> None:
    """Refuse to write a program whose output differs from the eager model's on the example batch."""
    pairs = [(eager[k], exported[k]) for k in eager] if isinstance(eager, dict) else [(eager, exported)]
    worst = max(float(((a - b).abs() - EXACT_RTOL * a.abs()).max()) for a, b in pairs)
    if worst > EXACT_ATOL:
        diff = max(float((a - b).abs().max()) for a, b in pairs)
        raise ConfigError(f"model {model}: the exported program's output differs from the model's by {diff:.3g} on the "
                          f"example batch (allowed {EXACT_ATOL} + {EXACT_RTOL} x |output|); it cannot be exported faithfully")


def _log_artifacts(spec: RunConfig, tracker: Tracker, out: Path, files: list[str], register_as: str | None) -> None:
    """The exported files as the run's artifacts (``export/``), and the MLflow model(s) as the run's logged model(s)
    (registered under ``register_as`` when set), when it logs to MLflow.

    Raises:
        ConfigError: ``register_as`` is set but no MLflow model was written, or the run does not log to MLflow.
    """
    models = [n for n in files if n.startswith("mlflow_")]
    logged = tracker.run_id is not None and isinstance(spec.tracking, MlflowTrackingConfig)
    if register_as is not None and not (models and logged):
        raise ConfigError(f"export.register_as={register_as!r}: " + ("no MLflow model was written (the log says why)" if not models else
                          "the export does not log to MLflow (tracking)") + ". Fix: drop export.register_as")
    if not logged:
        return
    from mlflow.tracking import MlflowClient

    assert tracker.run_id is not None and isinstance(spec.tracking, MlflowTrackingConfig)
    uri = resolve_uri(spec.tracking.uri)
    client = MlflowClient(tracking_uri=uri)
    for name in files:
        if name in models:
            client.log_artifacts(tracker.run_id, str(out / name), f"{ARTIFACT_DIR}/{name}")
        else:
            client.log_artifact(tracker.run_id, str(out / name), ARTIFACT_DIR)
    for name in models:
        logged_name = "model" if name == mlflow_model.MODEL_DIR else name.removeprefix("mlflow_")
        version = mlflow_model.log_and_register(out / name, uri, tracker.run_id, register_as if len(models) == 1 else
                                                (f"{register_as}-{logged_name}" if register_as else None), logged_name)
        if version is not None:
            log.info("registered the MLflow model %s as version %s of %r", name, version, register_as)


register()


@hydra.main(config_path=CONFIG_PATH, config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    launch = Launch.from_hydra()  # Hydra's runtime, read here once and handed down
    with exit_codes(launch):
        out = run(with_training_overrides(cfg, launch), launch)
    print(f"exported to {out}")


if __name__ == "__main__":
    carry_training_overrides()  # before @hydra.main composes: the training's overrides, then this command's
    main()
