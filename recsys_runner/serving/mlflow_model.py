"""The MLflow model export writes: raw rows in, predict's scores out, loadable without recsys_runner.

``export`` writes ``<export.dir>/mlflow_model/`` beside ``model.pt2`` — an MLflow model of the pyfunc flavor whose
``loader_module`` is the standalone :mod:`recsys_runner.data.encoding.served` (copied into the model's ``code/`` with the
row encoder and the vocabulary lookup it needs, under names that carry the hash of those files: :func:`copy_shipped`) and
whose ``data/`` holds the ``torch.export`` program, the checkpoint's ``encoders.json`` and ``serving.json``. So
``mlflow.pyfunc.load_model(dir).predict(df)`` on raw rows, or ``mlflow models serve -m dir --env-manager local`` on
``POST /invocations``, returns exactly the columns ``predict`` writes, with torch, NumPy, pandas, PyArrow and MLflow alone. A two-tower model gets one per tower instead
(``mlflow_user_tower/``, ``mlflow_item_tower/``), each returning the tower's vectors.

The model is written with an input signature of the raw columns — every single-valued column as ``string``, which the
served model casts to the type training read (:func:`signature` says why), a list column as an array — and an input
example: the first rows of the training files. Before it is kept, the written
model is loaded back through MLflow and its scores on the example compared with the eager model's on the same rows
encoded by the training encoder (:func:`check_served`): an export whose served scores differ is refused.

``export.register_as=<name>`` also logs the model to the export's MLflow run (as its logged model) and registers a
version of it in the model registry under ``name`` (:func:`log_and_register`).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import torch
from torchrec.datasets.utils import Batch

from recsys_runner.data.encoding import served, served_program
from recsys_runner.data.encoding.rows import Encoder, Location
from recsys_runner.data.encoding.stored import StoredEncoders
from recsys_runner.data.encoding.values import is_list
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.serving.program import ServingModule, TowerServing, compile_program
from recsys_runner.tasks import SINGLE_TASK, Task, calibrated, score_columns

log = logging.getLogger(__name__)

MODEL_DIR = "mlflow_model"
TOWER_DIR = "mlflow_{}_tower"
EXAMPLE_ROWS = 5
"""Rows of the training files in the input example (and in the check of the served scores: :data:`CHECK_ROWS`)."""
CHECK_ROWS = 256
SCORE_ATOL = 1e-5
"""Largest difference allowed between the served model's scores and the eager model's on the same raw rows."""
SCORED_KINDS = ("binary", "regression", "huber", "multiclass")
"""Task kinds whose rows the served model scores (a retrieval task is served as its towers; next-item as ``model.pt2``)."""


def servable(tasks: tuple[Task, ...], two_tower: bool) -> str | None:
    """Why the model gets no MLflow model (``None``: it gets one, or one per tower)."""
    if two_tower:
        return None
    other = [t.kind for t in tasks if t.kind not in SCORED_KINDS]
    if other:
        return (f"its task kind {other[0]!r} scores each row against every item, not one score per row; serve model.pt2 "
                f"(feature_spec.json) for it")
    return None


def outputs(tasks: tuple[Task, ...]) -> list[dict[str, Any]]:
    """``serving.json``'s outputs: per task its column (as ``predict`` names it), its name in the program's output dict
    (``None`` for a single task, whose program returns one tensor: :class:`~recsys_runner.serving.program.ServingModule`)
    and its kind."""
    return [{"column": "score" if t.name is None else f"score_{t.name}", "task": t.name if len(tasks) > 1 else None, "kind": t.kind}
            for t in tasks]


def signature(types: dict[str, str], columns: list[str]) -> Any:
    """The input signature: every single-valued raw column as ``string``, a list column as ``any``, not ``required``.

    Why text: the served model casts each column to the type training read (``encoders.json``'s ``column_types``) and
    names the column when a value does not fit; MLflow's own types cannot hold a missing id (pandas turns an int column
    with a gap into floats, which a ``long`` column refuses) nor parse a CSV request's bad number without losing the
    column's name. A JSON request's numbers are converted to text by the server; a pandas caller passes ``dtype=str``.

    Why not MLflow's arrays for a list column: their check names no column (``Incompatible input types for column .``,
    ``Expected data to be list or numpy array, got str``) and refuses what the served model reads as training read it —
    numbers in a list of text ids, a missing element, a missing cell (training reads a missing list as an empty one). The
    served model casts each list to the type training read and names the column when it cannot, and refuses a request
    without the column, naming it (``ServedModel.encode``)."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import AnyType, ColSpec, DataType, Schema

    def spec(name: str) -> ColSpec:
        if types.get(name, "string").startswith("list<"):
            return ColSpec(AnyType(), name, required=False)
        return ColSpec(DataType.string, name)

    return ModelSignature(inputs=Schema([spec(c) for c in columns]))


def as_request(rows: pa.Table) -> Any:
    """``rows`` (raw, as training read them) as a request's DataFrame: single-valued columns as text (missing values
    ``None``; an int column's ids written as integers, not as the floats pandas would make of a column with gaps)."""
    columns = {name: col if is_list(col.type) else col.cast(pa.string()) for name, col in zip(rows.column_names, rows.columns, strict=True)}
    return pa.table(columns).to_pandas()


def input_columns(encoders: StoredEncoders, keep: set[str] | None = None) -> list[str]:
    """The raw columns a request must have: every input column of the training files, labels left out (``keep``: only
    these features' columns, for a tower)."""
    schema = encoders.schema
    labels = set(schema.label_columns)
    columns = [c for c in schema.columns if c not in labels]
    return [c for c in columns if keep is None or c in keep]


def write_model(out: Path, module: ServingModule | TowerServing, program: Path, document: bytes,
                encoders: StoredEncoders, spec: dict[str, Any], raw: pa.Table, compiled: bool = False, request: pa.Table | None = None) -> None:
    """Write the MLflow model to ``out`` and check it (:func:`check_served`) on ``raw`` (rows of the training files).
    ``program``: the program file export wrote (``model.pt2``, a tower's), copied as it is (what ``torch.export.save``
    of it loaded would write, byte for byte, without a second copy of its tables in memory).
    ``compiled``: also compile the program with AOTInductor (:func:`~recsys_runner.serving.program.compile_program`:
    minutes of CPU, ~4 ms less per request), which the served model then runs; the check runs it too. ``request``: the
    same rows as a request sends them when that differs from ``raw`` (a tower served on the log's raw ids,
    :mod:`recsys_runner.serving.raw_ids`): the input example, and what the check sends.

    Raises:
        ConfigError: the served model's scores differ from the eager model's on those rows.
    """
    import mlflow.pyfunc

    with tempfile.TemporaryDirectory(prefix="mlflow-model-") as tmp:
        stage = Path(tmp)
        data, code = stage / "data", stage / "code"
        data.mkdir()
        code.mkdir()
        shutil.copyfile(program, data / served_program.PROGRAM_FILE)
        if compiled:
            compile_program(torch.export.load(str(program)), str(data / served_program.COMPILED_FILE))
        (data / served.ENCODERS_FILE).write_bytes(document)
        (data / served.SPEC_FILE).write_text(json.dumps(spec, indent=1) + "\n")
        names = copy_shipped(code)
        columns = spec["input_columns"]
        example = as_request((raw if request is None else request).select(columns).slice(0, EXAMPLE_ROWS))
        mlflow.pyfunc.save_model(
            path=str(out), loader_module=names[served.LOADER_MODULE], data_path=str(data),
            code_paths=[str(code / f"{n}.py") for n in names.values()], signature=signature(encoders.types, columns),
            input_example=example, pip_requirements=requirements())
    check_served(out, module, encoders, spec, raw, request)


CODE_HASH_DIGITS = 12
"""Hex digits of the hash in the shipped modules' names (48 bits: two different code sets get the same with a chance of 2**-48)."""


def copy_shipped(code: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Write the modules the MLflow model carries into ``code`` — :data:`~recsys_runner.data.encoding.served.SHIPPED` and
    ``extra`` (stem → source file: the top-k model's own) — each as ``<stem>_<hash>.py``, ``<hash>`` the
    :func:`code_hash` of all of them; returns each stem's module name there (the loader's is the model's
    ``loader_module``).

    Why the hash of the whole set, and in every name: a module imports the others under its own suffix, so one model's
    modules are all of one set, and a process that loads two models of other code (two recsys_runner versions, or a
    pointwise and a top-k model) imports each one's modules under names of their own (``SHIPPED`` says why that is
    needed)."""
    sources = {stem: str(importlib.import_module(f"{served.__package__}.{name}").__file__) for name, stem in served.SHIPPED.items()}
    texts = {stem: Path(path).read_bytes() for stem, path in (sources | (extra or {})).items()}
    suffix = code_hash(texts)
    names = {stem: f"{stem}_{suffix}" for stem in texts}
    for stem, text in texts.items():
        (code / f"{names[stem]}.py").write_bytes(text)
    return names


def code_hash(texts: dict[str, bytes]) -> str:
    """The first :data:`CODE_HASH_DIGITS` hex digits of the SHA-256 of the modules ``texts`` (stem → file contents), taken
    in the order of their stems, each stem and length before its text (so no two sets read as one stream)."""
    digest = hashlib.sha256()
    for stem in sorted(texts):
        digest.update(f"{stem}\0{len(texts[stem])}\0".encode())
        digest.update(texts[stem])
    return digest.hexdigest()[:CODE_HASH_DIGITS]


def requirements() -> list[str]:
    """What the served model needs: torch (the program's format), NumPy, pandas, PyArrow and MLflow — no recsys_runner."""
    import mlflow
    import pandas

    return [f"torch=={torch.__version__.split('+')[0]}", f"numpy=={np.__version__}", f"pandas=={pandas.__version__}",
            f"pyarrow=={pa.__version__}", f"mlflow=={mlflow.__version__}"]


def check_served(out: Path, module: ServingModule | TowerServing, encoders: StoredEncoders, spec: dict[str, Any], raw: pa.Table,
                 request: pa.Table | None = None) -> None:
    """Load the written model through MLflow and compare its output on ``raw``'s rows (as ``request`` holds them, when
    given: the same rows in the request's ids) with the eager model's on the same rows encoded by the training encoder.

    Raises:
        ConfigError: they differ by more than :data:`SCORE_ATOL`, naming the column.
    """
    import mlflow.pyfunc

    rows = raw.slice(0, CHECK_ROWS)  # every column: the training encoder reads them all (a tower's model only its own)
    sent = rows if request is None else request.slice(0, CHECK_ROWS)
    got = mlflow.pyfunc.load_model(str(out)).predict(as_request(sent.select(spec["input_columns"])))
    want = expected(module, encoders, rows)
    for column, values in want.items():
        served_values = np.stack(got[column].to_numpy()) if spec["outputs"][0]["kind"] == "vector" else got[column].to_numpy()
        diff = float(np.abs(np.asarray(served_values, np.float64) - np.asarray(values, np.float64)).max(initial=0.0))
        if diff > SCORE_ATOL:
            raise ConfigError(f"the MLflow model's {column!r} differs from the eager model's by {diff:.3g} on the training files' "
                              f"first rows (allowed {SCORE_ATOL}): it would not serve what predict scores. This is a bug; please "
                              f"report it with the model and data config")
    log.info("MLflow model %s: its scores on %d raw rows of the training files equal the model's", out.name, rows.num_rows)


def expected(module: ServingModule | TowerServing, encoders: StoredEncoders, rows: pa.Table) -> dict[str, np.ndarray]:
    """The columns ``predict`` writes for ``rows`` (raw): encoded by the training encoder, scored by the eager model."""
    batch = encoded_batch(encoders, rows)
    with torch.no_grad():
        if isinstance(module, TowerServing):
            return {"vector": module(*module.inputs(batch)).float().numpy()}
        out = calibrated(module.model(batch.dense_features, batch.sparse_features), module.logit_shift)
    tasks = cast(tuple[Task, ...], tuple(getattr(module.model, "tasks", SINGLE_TASK)))
    if isinstance(out, dict):
        logits = torch.cat([out[t.name].float().reshape(rows.num_rows, -1) for t in tasks], dim=1)
    else:
        logits = out.float().reshape(rows.num_rows, -1)
    return score_columns(tasks, logits)


def encoded_batch(encoders: StoredEncoders, rows: pa.Table) -> Batch:
    """``rows`` (raw, as the training files hold them) as the batch training would read: encoded by the training encoder,
    labels zeroed (a score does not depend on them; predict zeroes them likewise)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    schema = encoders.schema
    table = rows.drop_columns([c for c in schema.label_columns if c in rows.column_names])
    for name in schema.label_columns:
        table = table.append_column(name, pa.array(np.zeros(rows.num_rows, np.float32)))
    encoded = Encoder(schema, "fail", DataError).encode(table, Location("the training files", "rows", np.arange(rows.num_rows), 0))
    keys = [c.name for c in schema.sparse] + schema.timestamp_columns
    values = [torch.as_tensor(v.astype(np.int64)) for v, _ in encoded.sparse]
    lengths = [torch.as_tensor(ln.astype(np.int64)) for _, ln in encoded.sparse]
    weights = encoded.key_weights()
    kjt = KeyedJaggedTensor(keys=keys, values=torch.cat(values) if values else torch.zeros(0, dtype=torch.int64),
                            lengths=torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.int64),
                            weights=None if weights is None else torch.as_tensor(weights))
    return Batch(dense_features=torch.as_tensor(encoded.dense), sparse_features=kjt, labels=torch.as_tensor(encoded.labels))


def log_and_register(model_dir: Path, tracking_uri: str, run_id: str, register_as: str | None, name: str = "model",
                     trained_by: tuple[str, int] | None = None) -> str | None:
    """Log the written model as the export run's model (an MLflow 3 logged model) and, with ``register_as``, register a
    version of it; returns the registered version (``None`` without ``register_as``). ``trained_by``: the training run
    and the checkpoint's step, whose run then lists the model as its output (:func:`link_to_training`)."""
    import mlflow
    import mlflow.pyfunc
    from mlflow.models import Model

    meta = Model.load(str(model_dir))
    data = model_dir / "data" / "data"
    loader = meta.flavors["python_function"]["loader_module"]  # the pointwise model's, or the top-k model's (serving/topk.py)
    model_id = None if trained_by is None else trained_model(tracking_uri, name, trained_by[0])
    # MLflow's fluent API logs a model at the process's URI; its set_tracking_uri also sets $MLFLOW_TRACKING_URI, which
    # tracking.uri's default reads: both go back as they were, or every later job of the process logs to this store
    env_before = os.environ.get("MLFLOW_TRACKING_URI")
    before = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    mlflow.set_tracking_uri(tracking_uri)
    try:
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pyfunc.log_model(
                name=name, loader_module=loader, data_path=str(data),
                code_paths=sorted(str(p) for p in (model_dir / "code").iterdir() if p.suffix == ".py"), signature=meta.signature,
                input_example=meta.load_input_example(str(model_dir)), pip_requirements=requirements(),
                registered_model_name=register_as, model_id=model_id)
    finally:
        mlflow.set_tracking_uri(cast(str, before))  # None unsets it again (MLflow's code does; its annotation says str)
        if env_before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = env_before
    if trained_by is not None and model_id is not None:  # the training run is in this store: list the model as its output too
        link_to_training(tracking_uri, info.model_id, *trained_by)
    return None if register_as is None else str(info.registered_model_version)


def trained_model(tracking_uri: str, name: str, run_id: str) -> str | None:
    """A new logged model whose source is the training run ``run_id`` (in that run's experiment, with its params), for the
    export to log its files into; ``None`` (after a warning) when the store lacks the run, and the export run is its source.

    Why the training run: the UI's Models column lists a run's logged models by their source run (MLflow 3.17's runs
    table searches the experiment's logged models and groups them by ``source_run_id``), and the weights are that run's
    work; the export run still lists the model as its output."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        run = client.get_run(run_id)
        return str(client.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id, model_type="recsys_runner",
                                              params={k: str(v) for k, v in run.data.params.items()}).model_id)
    except Exception as e:  # noqa: BLE001 - the model is still logged, with the export run as its source
        log.warning("the MLflow model is logged with the export run as its source: the training run %s could not be read (%s: %s)",
                    run_id, type(e).__name__, e)
        return None


def link_to_training(tracking_uri: str, model_id: str, run_id: str, step: int) -> None:
    """Make logged model ``model_id`` an output of the training run ``run_id`` at ``step``, so the UI's Models column
    shows it on the run that trained it, not only on the export run. A store without that run (the training logged
    elsewhere, or was deleted) or an outage only warns: the export is complete without the link."""
    from mlflow.entities import LoggedModelOutput
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=tracking_uri).log_outputs(run_id, [LoggedModelOutput(model_id, step)])
    except Exception as e:  # noqa: BLE001 - the model is logged and registered; only the training run's link is missing
        log.warning("could not link the MLflow model %s to its training run %s: %s: %s", model_id, run_id, type(e).__name__, e)
