"""``python -m recsys_runner.export load=<checkpoint | run id> [overrides]``: the model, for serving.

Writes ``<export.dir>/model.pt2`` — the trained model, unsharded, as a ``torch.export`` program that
loads with ``torch`` alone (no recsys_runner, Hydra, TorchRec or fbgemm_gpu) — beside
``feature_spec.json`` (the inputs it takes, in order, and the outputs it returns), ``example.pt`` (one
batch of inputs with the outputs the exporting process computed, for a server's smoke test) and
``manifest.json`` (:mod:`recsys_runner.tracking.lineage`); all four are logged to a new MLflow run tagged
``entry=export`` whose parent is the training run. A two-tower model (DSSM) also gets each tower as a program of
its own, ``user_tower.pt2`` and ``item_tower.pt2`` (:class:`TowerServing`): user vectors at request time, item
vectors once for the candidate index; ``feature_spec.json``'s ``towers`` says what each takes. Models trained on files also get
an MLflow model (``mlflow_model/``: raw rows in, ``predict``'s scores out, :mod:`recsys_runner.serving.mlflow_model`); for a
next-item model trained on ``data sequences`` output it answers a history of raw item ids with ``predict``'s top-k
(:mod:`recsys_runner.serving.topk`, ``export.top_k``).

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
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from recsys_runner import provenance, stores
from recsys_runner.collection import skip_the_exit_collection
from recsys_runner.config import RunConfig, flatten, register_entry_schema, to_yaml, validate
from recsys_runner.data.encoding.stored import read_stored
from recsys_runner.data.files.downsample import negative_rate, trained_rate
from recsys_runner.errors import CheckpointError, ConfigError, require
from recsys_runner.inference import LOAD_FIELD, carry_training_overrides, checkpoint_to_load, with_training_overrides
from recsys_runner.lifecycle import (
    RunStart,
    end_rank_process,
    exit_codes,
    link_tags,
    one_job,
    tracked_run,
)
from recsys_runner.noise import quiet_known_noise
from recsys_runner.overrides import check_command_line
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.runtime import Launch
from recsys_runner.serving import mlflow_model, quantize, topk
from recsys_runner.serving.files import (  # noqa: F401 - EXAMPLE_FILE, FEATURE_SPEC_FILE, MODEL_FILE: the names tests and docs use
    EXAMPLE_FILE,
    FEATURE_SPEC_FILE,
    MODEL_FILE,
    build_unsharded,
    served_rows,
    use_ema,
    write_export,
)
from recsys_runner.serving.quantized_rows import QUANTIZE
from recsys_runner.serving.target import check_target, export_dir
from recsys_runner.staging import StagedFolder
from recsys_runner.tracking import lineage
from recsys_runner.tracking.store import resolve_uri
from recsys_runner.tracking.tracker import MlflowTrackingConfig, Tracker

quiet_known_noise()  # the known library warnings, each with its reason (noise.py)

log = logging.getLogger("recsys_runner")

ARTIFACT_DIR = "export"
"""Where the files go inside the MLflow run's artifacts."""

WEIGHTS = ("auto", "raw", "ema")

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
    """Also write the MLflow model (``mlflow_model/``: raw rows in, ``predict``'s scores out; for a next-item model a history
    of raw item ids in, ``predict``'s top-k out; docs/export.md) and log it as the export run's model. Needs file data (its
    encoders are stored with the checkpoint; a next-item model's rows written by ``data sequences``, with their id mapping)."""
    compile: bool = False
    """Also compile the MLflow model's program ahead of time with AOTInductor (``data/model_aoti.pt2``), which the
    served model then runs instead of interpreting ``torch.export``'s graph: a 1-row request's program ~4 → ~1 ms on
    2 cores (docs/performance.md). Needs a C++ compiler where ``export`` runs and takes about a minute; when it cannot
    compile, a warning says why and the program is served as it is. The compiled file runs on the CPU kind it was
    compiled for (``x86_64`` here): export on the serving machine's kind."""
    register_as: str | None = None
    """Register a version of the MLflow model under this name in the MLflow model registry (the UI's Models page)."""
    quantize: str = "none"
    """Serve the embedding tables quantized row-wise: ``int8`` (a code a byte and an fp16 scale and bias per row: ~3.2x
    smaller at width 16, ~3.8x at 64), ``int4`` (two codes a byte), ``fp16``; ``none`` the float32 tables as trained. Every
    file export writes is then of the quantized model, and ``feature_spec.json``'s ``quantize`` (and the log) says what it
    costs: the tables' bytes before and after, and the scores' difference on the example batch (docs/export.md). The tables of
    TorchRec's ``EmbeddingBagCollection`` and ``EmbeddingCollection`` (histories); a model with other tables is refused."""
    top_k: int = 10
    """A next-item model's MLflow model answers each history with its best ``top_k`` items when a request does not say
    (its ``k`` parameter); ``predict.top_k``'s default. At most the items the model may recommend."""

    def __post_init__(self) -> None:
        require(self.top_k > 0, f"export.top_k must be positive, got {self.top_k}")
        require(self.weights in WEIGHTS, f"export.weights={self.weights!r} must be one of {list(WEIGHTS)}")
        require(self.quantize in QUANTIZE, f"export.quantize={self.quantize!r} must be one of {list(QUANTIZE)}. Fix: e.g. "
                f"export.quantize=int8 (row-wise int8 tables), or none")
        require(not self.compile or self.mlflow_model, "export.compile=true compiles the MLflow model's program: it needs "
                "export.mlflow_model=true")
        require(self.register_as is None or (self.mlflow_model and bool(self.register_as.strip())),
                f"export.register_as={self.register_as!r} registers the MLflow model: it needs export.mlflow_model=true and "
                f"a non-empty name")


def register() -> None:
    """Store ``export_schema``: the training schema plus ``load`` and ``export`` (``conf/export.yaml``)."""
    register_entry_schema("export", [
        LOAD_FIELD,
        ("export", ExportConfig, field(default_factory=ExportConfig)),
    ])


@one_job
def run(cfg: DictConfig, launch: Launch = Launch()) -> Path:
    """Export the checkpoint ``cfg.load`` names; returns the directory written (see the module docstring)."""
    checkpoint = checkpoint_to_load(cfg)  # first: a load= that names no checkpoint is the error to fix first
    options = _options(cfg)
    spec = validate(cfg)
    out = export_dir(options.dir, launch)
    check_target(out, options.overwrite)
    meta = json.loads(stores.read_bytes(str(checkpoint / "meta.json"), CheckpointError))
    provenance.note_other_code(f"checkpoint {checkpoint}", meta)
    torch.manual_seed(spec.seed)
    rate = trained_rate(checkpoint, negative_rate(spec.data))  # outputs corrected by the rate the checkpoint trained with
    stored = read_stored(checkpoint)
    built = build_unsharded(spec, stored)
    model = built.model
    if options.quantize != "none":  # before anything is written: a model whose tables the quantized path does not cover
        quantize.check_quantizable(model, list(built.batch.sparse_features.keys()), options.quantize)
    rows = served_rows(stored, checkpoint, built.raw, spec.data.missing_texts()) if options.mlflow_model else None
    top_k = topk.plan_top_k(model, built.features, built.data, options.top_k) if rows is not None else None  # export.top_k checked here
    ema = use_ema(spec, options.weights)
    manifest = lineage.collect(world_size=1, device=torch.device("cpu"))
    start = RunStart(
        run_name=f"export {type(model).__name__} step {meta.get('step')}", params=flatten(spec),
        tags=link_tags("export", checkpoint, meta.get("step"), meta.get("run_id")) | {"export.weights": "ema" if ema else "raw",
                                                                                     "export.quantize": options.quantize},
        texts={"config.yaml": to_yaml(spec)}, manifest=manifest)
    tracker = spec.tracking.build()
    with tracked_run(tracker, start, launch):
        with StagedFolder(out) as staged:  # an error or a stop anywhere in here leaves no partial export behind
            files = write_export(built, checkpoint=checkpoint, meta=meta, ema=ema, out=staged.path, served=rows, compiled=options.compile,
                                 top_k=top_k, negative_rate=rate, quantize=options.quantize)
            (staged.path / lineage.MANIFEST_FILE).write_text(manifest.to_json() + "\n")
            check_target(out, options.overwrite)  # still as checked before the build (nothing else wrote there since)
            staged.commit()
            log.info("wrote %s to %s", ", ".join([*files, lineage.MANIFEST_FILE]), out)
            trained_by = (str(meta["run_id"]), int(meta.get("step") or 0)) if meta.get("run_id") else None
            _log_artifacts(spec, tracker, staged.local, [*files, lineage.MANIFEST_FILE], options.register_as, trained_by)
    return out


def _options(cfg: DictConfig) -> ExportConfig:
    """The ``export`` section, validated."""
    options = OmegaConf.to_object(cfg.export)
    assert isinstance(options, ExportConfig)
    return options


def _log_artifacts(spec: RunConfig, tracker: Tracker, out: Path, files: list[str], register_as: str | None,
                   trained_by: tuple[str, int] | None = None) -> None:
    """The exported files as the run's artifacts (``export/``), and the MLflow model(s) as the run's logged model(s)
    (registered under ``register_as`` when set), when it logs to MLflow; each model is also an output of the training
    run ``trained_by`` (its id and the checkpoint's step, from the checkpoint's ``meta.json``), so the UI shows it there.

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
                                                (f"{register_as}-{logged_name}" if register_as else None), logged_name,
                                                trained_by)
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
    skip_the_exit_collection()  # the exit skips collecting what the command left (collection.py says why)
    carry_training_overrides()  # before @hydra.main composes: the training's overrides, then this command's
    check_command_line("export")  # a typo: one line with the closest valid name (overrides.py)
    main()
    end_rank_process()  # a rank of a multi-rank launch skips the native teardown (lifecycle.py says why)
