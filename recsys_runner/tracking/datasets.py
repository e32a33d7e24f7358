"""What data a run read, as MLflow dataset inputs: the UI's Dataset column, and a digest that says whether two runs
read the same data.

Each run (training, evaluate, predict) records its training and eval data as :class:`DataRecord`\\ s: a name
(``<data option>/<split>``, e.g. ``csv/train``), where the data is (the path or URI as configured; a generator and its
seed for generated data, ``synthetic://SyntheticData?seed=0``), a digest, the row count when known, the columns with
their types (histories as arrays) and the context (``training``, ``evaluation``).

**The digest** is what tells two runs' data apart, so it must change when the files do and stay when they do not:
the files' contents (sha256, streamed) when they total at most ``tracking.dataset_digest_max_mb``; above that a digest
of their names, sizes and modification times, because reading terabytes just to name them would cost more than the
run (the profile's ``digest_of`` says which). Generated data's digest is its generator's config (minus how it is
batched), which fixes every row. A held-out eval split adds its fraction.

**Tied to the stored encoders.** The training's records go into every checkpoint as ``data_inputs.json``, beside
``encoders.json`` (:mod:`recsys_runner.data.encoding.stored`): the encoders were fitted on exactly that data. An
evaluate or predict on the checkpoint logs a warning when its data of the same name has another digest
(:func:`note_changes`): new rows read the encoders' OOV rows, and metrics are then not comparable with the training's;
so does a resume, whose place in the epoch no longer fits the files.

Logging them never fails a run: a store outage only warns (:meth:`~recsys_runner.tracking.tracker.MlflowTracker.log_inputs`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from recsys_runner import stores, uris
from recsys_runner.data.base import DataConfig, DataModule, SplitFiles
from recsys_runner.data.encoding.stored import from_json, stored_types
from recsys_runner.errors import CheckpointError
from recsys_runner.features import FeatureSpec

log = logging.getLogger(__name__)

DATA_INPUTS_FILE = "data_inputs.json"
"""The training data's records in each checkpoint, beside ``encoders.json``."""
DIGEST_LENGTH = 8
"""Characters of a digest: as long as MLflow's own datasets' (``mlflow.data.digest_utils``), which the UI shows."""
CONTEXTS = {"train": "training", "eval": "evaluation", "items": "catalogue"}
"""Split → the ``mlflow.data.context`` tag the UI shows beside the dataset (``items``: a two-tower model's item catalogue,
``data.items.path``)."""
SCORED = ("predict", "prediction")
"""The name suffix and context of the files a predict scores (``predict.input``, else ``data.path``)."""
CONTENTS, LISTING, GENERATOR = "contents", "file names, sizes and modification times", "generator config"
"""What a digest was computed from (the profile's ``digest_of``)."""
_BATCHING = {f.name for f in dataclasses.fields(DataConfig)}
"""Fields every data config has, which say how rows are batched and loaded, not which rows: left out of a generated
data's digest."""
_CHUNK = 1 << 20


@dataclass(frozen=True)
class DataRecord:
    """One dataset input of a run, in the form MLflow stores (:meth:`as_mlflow`) and ``data_inputs.json`` keeps."""

    name: str
    digest: str
    source_type: str
    """``local``, the object store's scheme (``s3``, ``gs``) or ``synthetic``."""
    source: str
    """The path or URI as configured (``data.path``), or ``synthetic://<generator>?seed=<n>``."""
    context: str
    profile: dict[str, Any]
    """``num_rows`` (when known), ``digest_of`` (:data:`CONTENTS`, :data:`LISTING`, :data:`GENERATOR`), ``files`` and ``bytes``
    for files, ``holdout`` for a hash-split eval share."""
    columns: list[dict[str, Any]]
    """MLflow's column specs: ``{"name": …, "type": "double" | "long" | "string" | "boolean"}``, or
    ``{"name": …, "type": "array", "items": {"type": …}}`` for a list column (a history)."""

    def as_mlflow(self) -> Any:
        """The ``DatasetInput`` for ``MlflowClient.log_inputs``: source as MLflow's JSON (``{"uri": …}``), the schema as
        ``{"mlflow_colspec": […]}`` (what MLflow's own datasets write and its UI reads), the context as an input tag."""
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        dataset = Dataset(name=self.name, digest=self.digest, source_type=self.source_type, source=json.dumps({"uri": self.source}),
                          schema=json.dumps({"mlflow_colspec": self.columns}), profile=json.dumps(self.profile))
        return DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, self.context)])


def describe(config: DataConfig, data: DataModule, *, max_digest_mb: float, encoders: bytes | None = None,
             scored: SplitFiles | None = None) -> list[DataRecord]:
    """The training and eval data of a run whose data config is ``config`` (the one the model is served:
    ``run.served_data``) and data module ``data``, and a predict's ``scored`` files (:data:`SCORED`); ``encoders`` (the
    ``encoders.json`` document) gives file columns their types as the training reader read them. Reads the files for
    their digest when they total at most ``max_digest_mb`` (see the module docstring)."""
    kind = _kind(config)
    splits = data.split_files()
    columns = _file_columns(encoders, data.features)
    if splits:
        records = [_files_record(f"{kind}/{split}", files, CONTEXTS[split], _split_columns(split, columns, data), max_digest_mb)
                   for split, files in splits.items()]
    else:
        records = [_generated_record(config, kind, split, data.features) for split in ("train", "eval")]
    if scored is not None:
        records.append(_files_record(f"{kind}/{SCORED[0]}", scored, SCORED[1], columns, max_digest_mb))
    return records


def _split_columns(split: str, columns: list[dict[str, Any]], data: DataModule) -> list[dict[str, Any]]:
    """The columns of a split's files: the catalogue's (``items``) are the item table's id, features and dense columns."""
    table = data.item_table() if split == "items" else None
    if table is None:
        return columns
    names = {table.id_feature, *table.features, *table.dense_names}
    return [c for c in columns if c["name"] in names]


def to_json(records: Sequence[DataRecord]) -> bytes:
    """``data_inputs.json``: the records as a JSON list."""
    return json.dumps([dataclasses.asdict(r) for r in records], indent=1).encode()


def read_stored(checkpoint: str | os.PathLike[str]) -> list[DataRecord] | None:
    """The training's records a checkpoint stores; ``None`` for one written before they were, or unreadable (this is
    only compared, never relied on)."""
    try:
        raw = json.loads(stores.read_bytes(uris.join(os.fspath(checkpoint), DATA_INPUTS_FILE), CheckpointError))
        return [DataRecord(**r) for r in raw]
    except (FileNotFoundError, CheckpointError, ValueError, TypeError) as e:
        if not isinstance(e, FileNotFoundError):
            log.warning("%s in %s is unreadable (%s); the data is not compared with the training's", DATA_INPUTS_FILE, checkpoint, e)
        return None


SCORED_ON_CHANGED = ("The encoders stored with the checkpoint were fitted on that data (ids new since read OOV rows), and "
                     "these metrics are not comparable with the training's")
"""What changed files mean for an evaluate or predict of a checkpoint (:func:`note_changes`)."""
ITEMS_ON_CHANGED = ("The catalogue is ranked (and sampled negatives drawn from it) as it is now: items added since were never "
                    "trained as such (new ids read the stored encoders' OOV rows), and full-corpus metrics over another catalogue "
                    "are not comparable with the training's. Fix: use the catalogue the checkpoint was trained with, or train "
                    "on this one")
"""What a changed catalogue (``data.items.path``: a part added to its folder, one rewritten) means, whatever the command
(:func:`note_changes`)."""
RESUMED_ON_CHANGED = ("The resumed run trains on them as they are now: its place in the epoch counts batches of the files as "
                      "they were, so rows may be trained twice or never, and ids new since read the stored encoders' OOV rows. "
                      "Fix: resume on the files the run started with; to train on these, start a new run "
                      "(checkpoint.resume=never) or fine-tune the checkpoint (checkpoint.init_from=<it>)")
"""What changed files mean for a resume (:func:`note_changes`): the epoch position it restores no longer fits them."""


def note_changes(trained: Sequence[DataRecord] | None, now: Sequence[DataRecord], checkpoint: object,
                 consequence: str = SCORED_ON_CHANGED) -> list[str]:
    """Warn, once per dataset, where data of the same name and source as the checkpoint's training data has another
    digest now (files added, removed, appended to or rewritten since the training), saying ``consequence`` (for the
    item catalogue, :data:`ITEMS_ON_CHANGED`); data from another source (that day's eval file) is only noted. Returns the
    names whose digest differs."""
    if not trained:
        return []
    before = {r.name: r for r in trained}
    changed = []
    for record in now:
        old = before.get(record.name)
        if old is None or old.digest == record.digest:
            continue
        changed.append(record.name)
        if old.source != record.source:  # other data on purpose (that day's eval file): worth a line, not a warning
            log.info("data %s (%s) is %s (digest %s); checkpoint %s was trained with %s (digest %s)", record.name, record.context,
                     record.source, record.digest, checkpoint, old.source, old.digest)
            continue
        log.warning("data %s (%s) has digest %s, but checkpoint %s was trained on digest %s: the same files, changed since. %s",
                    record.name, record.context, record.digest, checkpoint, old.digest,
                    ITEMS_ON_CHANGED if record.context == CONTEXTS["items"] else consequence)
    return changed


SHRUNK_FRACTION = 0.25
"""A fine-tune's training data holding less than this share of the rows (else bytes) its checkpoint trained on is
said (:func:`note_shrunk`): a day that arrived truncated or partial trains a model on a sliver without a word."""


def note_shrunk(trained: Sequence[DataRecord] | None, now: Sequence[DataRecord], checkpoint: object) -> str | None:
    """Warn when the training data of a fine-tune (``now``, from ``checkpoint.init_from``'s ``checkpoint``) is under
    :data:`SHRUNK_FRACTION` of the training data the checkpoint's run recorded (``trained``), by rows where both counted
    them, else by bytes; returns the training record's name then, else ``None``."""
    before = {r.name: r for r in trained or () if r.context == CONTEXTS["train"]}
    for record in now:
        old = before.get(record.name)
        if old is None or record.context != CONTEXTS["train"]:
            continue
        unit = "rows" if "num_rows" in old.profile and "num_rows" in record.profile else "bytes"
        was, is_ = old.profile.get("num_rows" if unit == "rows" else "bytes"), record.profile.get("num_rows" if unit == "rows" else "bytes")
        if not isinstance(was, int) or not isinstance(is_, int) or not was or is_ >= SHRUNK_FRACTION * was:
            continue
        log.warning("data %s (training) is %s: %d %s in %d files, %.1f%% of the %d %s checkpoint %s was trained on (%s, %d "
                    "files). A day that arrived truncated or partial? The fine-tune trains on what is there. Fix: wait for the "
                    "whole day, or compare the files with the day before", record.name, record.source, is_, unit,
                    record.profile.get("files", 0), 100 * is_ / was, was, unit, checkpoint, old.source, old.profile.get("files", 0))
        return record.name
    return None


SCORED_ON_RESPLIT = ("Its eval rows now include rows the checkpoint trained on (and leave out rows it never saw), so its "
                     "metrics overstate the model")
"""What a hash eval split keyed otherwise means for an evaluate (:func:`note_split_changes`)."""
RESUMED_ON_RESPLIT = ("The resumed run trains on rows its earlier steps held out for eval, and evaluates on rows it trained on")
"""What a hash eval split keyed otherwise means for a resume (:func:`note_split_changes`)."""


def note_split_changes(trained: Sequence[DataRecord] | None, now: Sequence[DataRecord], checkpoint: object,
                       consequence: str = SCORED_ON_RESPLIT) -> list[tuple[str, str]]:
    """Warn where the hash eval split (``data.eval_fraction``) keys rows by other file names than the checkpoint's training
    did for files of the same stem (``a.parquet`` now, ``a.csv`` then: ``convert``'s output, or a file renamed to another
    format), saying ``consequence``. Returns those ``(name now, name then)`` pairs.

    Why: the split hashes (file name, row number), so the same rows under another name are held out otherwise, and the
    dataset names differ (``parquet/eval``, ``csv/eval``), so :func:`note_changes` does not compare them. Keying by the stem
    instead would have moved every existing run's split; recording the keys (``split_keys`` of the eval record) moves none.
    """
    def keys(records: Sequence[DataRecord] | None) -> set[str]:
        return {k for r in records or () if r.context == CONTEXTS["eval"] for k in r.profile.get("split_keys", ())}

    then, current = keys(trained), keys(now)
    stems: dict[str, str] = {}
    for key in sorted(then):
        stems.setdefault(_stem(key), key)
    moved = sorted((key, stems[_stem(key)]) for key in current - then if _stem(key) in stems)
    if moved:
        shown = ", ".join(f"{a} (trained as {b})" for a, b in moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
        log.warning("the eval split holds out other rows than checkpoint %s's training did: data.eval_fraction holds out rows by "
                    "a hash of (file name, row number), and the files are named otherwise now: %s. %s. Fix: evaluate on the "
                    "files it was trained on, or hold out eval rows in files of their own (data.eval_path) before training; "
                    "docs/data.md, 'Eval split'", checkpoint, shown, consequence)
    return moved


def _stem(key: str) -> str:
    """A split key without its format suffix: ``a.csv`` and ``a.parquet`` are both ``a``."""
    return key.rsplit(".", 1)[0] if "." in key.lstrip(".") else key


def _kind(config: DataConfig) -> str:
    """The data option's name, from its config class: ``CsvDataConfig`` → ``csv``, ``SyntheticSequencesConfig`` →
    ``synthetic_sequences``."""
    name = type(config).__name__.removesuffix("Config").removesuffix("Data")
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


def _files_record(name: str, split: SplitFiles, context: str, columns: list[dict[str, Any]], max_digest_mb: float) -> DataRecord:
    stats = [_stat(f) for f in split.files]
    total = sum(size for size, _ in stats)
    digest = hashlib.sha256()
    if total <= max_digest_mb * 1e6:
        for path in split.files:
            digest.update(f"{os.path.basename(path)}\0".encode())
            for chunk in _chunks(path):
                digest.update(chunk)
        digest_of = CONTENTS
    else:
        for path, (size, mtime) in zip(split.files, stats, strict=True):
            digest.update(f"{path}\0{size}\0{mtime}\n".encode())
        digest_of = LISTING
    profile: dict[str, Any] = {"digest_of": digest_of, "files": len(split.files), "bytes": total}
    if split.holdout is not None:
        digest.update(f"holdout={split.holdout}".encode())
        profile["holdout"] = split.holdout
    if split.split_keys:  # not in the digest: the file names already are
        profile["split_keys"] = list(split.split_keys)
    if split.num_rows is not None:
        profile["num_rows"] = split.num_rows
    scheme = urlsplit(split.path).scheme if uris.is_uri(split.path) else ""
    return DataRecord(name=name, digest=digest.hexdigest()[:DIGEST_LENGTH], source_type=scheme or "local",
                      source=split.path if scheme else os.path.abspath(split.path),
                      context=context, profile=profile, columns=columns)


def _generated_record(config: DataConfig, kind: str, split: str, features: FeatureSpec) -> DataRecord:
    generator = config.component_class().__name__
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in _BATCHING}
    text = json.dumps({"generator": generator, "split": split, **settings}, sort_keys=True, default=str)
    seed = getattr(config, "seed", None)
    profile: dict[str, Any] = {"digest_of": GENERATOR, "generator": generator, "seed": seed}
    rows = getattr(config, f"num_{split}_rows", None)
    if isinstance(rows, int):
        profile["num_rows"] = rows
    return DataRecord(name=f"{kind}/{split}", digest=hashlib.sha256(text.encode()).hexdigest()[:DIGEST_LENGTH],
                      source_type="synthetic", source=f"synthetic://{generator}?seed={seed}", context=CONTEXTS[split],
                      profile=profile, columns=_feature_columns(features))


def _stat(path: str) -> tuple[int, float]:
    """(size, modification time) of a local file or an object (its ``LastModified``; 0 when the store gives none)."""
    if not uris.is_uri(path):
        st = os.stat(path)
        return st.st_size, st.st_mtime
    fs, rest = stores.fsspec_filesystem(path)
    info = fs.info(rest)
    when = info.get("mtime") or info.get("LastModified") or info.get("last_modified") or info.get("updated") or 0
    return int(info.get("size") or 0), when.timestamp() if hasattr(when, "timestamp") else float(when or 0)


def _chunks(path: str) -> Iterable[bytes]:
    with stores.open_input(path) as f:
        while chunk := f.read(_CHUNK):
            yield chunk



_ARROW_TO_MLFLOW = {"string": "string", "int64": "long", "float64": "double", "bool": "boolean"}


def _file_columns(encoders: bytes | None, features: FeatureSpec) -> list[dict[str, Any]]:
    """The files' columns as the training reader read them (``encoders.json``'s schema and ``column_types``); without
    the document, the features the data produces."""
    if encoders is None:
        return _feature_columns(features)
    schema, kinds = from_json(encoders, "the data's encoders document")
    types = stored_types(encoders)
    histories = {f for g in schema.sequences for f in g.features} | set(schema.timestamp_columns)
    out = []
    for name in schema.columns:
        kind = types.get(name) or ("list<int64>" if name in histories or kinds.get(name) == "list" else
                                   "string" if kinds.get(name) == "text" else "float64")
        out.append({"name": name, **_colspec_type(kind)})
    return out


def _colspec_type(arrow: str) -> dict[str, Any]:
    if arrow.startswith("list<") and arrow.endswith(">"):
        return {"type": "array", "items": _colspec_type(arrow[5:-1])}
    return {"type": _ARROW_TO_MLFLOW.get(arrow, "string")}


def _feature_columns(features: FeatureSpec) -> list[dict[str, Any]]:
    """Generated data's columns: each label and dense feature a float, each sparse feature an id (a history an array of
    ids)."""
    histories = {f for g in features.sequences for f in g.features}
    labels = [{"name": n, "type": "double"} for n in features.label_names]
    dense = [{"name": n, "type": "double"} for n in features.dense_names]
    sparse = [{"name": n, **({"type": "array", "items": {"type": "long"}} if n in histories else {"type": "long"})}
              for n in features.sparse_names]
    return [*labels, *dense, *sparse]

