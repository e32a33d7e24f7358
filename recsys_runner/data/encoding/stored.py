"""The data's fitted encoders, stored with the model: how every raw column became the model's input, as one JSON document.

Why: what turns a raw value into a row — an inferred vocabulary above all, but also a table size chosen from a sample,
the hash/mod/hex settings, a dense column's fill and transform — is a function of the files it was fitted on. Fitted
again on files that grew (a day of data appended), the same id lands on another row, and a checkpoint scores as if
untrained without a word. So the encoders are fitted once, when a training run starts, written into every checkpoint
(``encoders.json``, beside ``meta.json``) and logged to the MLflow run; ``evaluate``, ``predict``, a resume,
``checkpoint.init_from`` and ``export`` read them from the checkpoint and never fit them again (:func:`recsys_runner.build.
build`). Files that contradict them — a column gone, text where numbers were — are refused naming the column
(:func:`check_columns`); a value never seen when the vocabulary was fitted reads an OOV row, as it did in training.

The document: ``format``; the schema (``label``/``labels``/``label_kinds``/``label_threshold``, ``dense``, ``sparse``,
``sequences``, as ``convert`` stores it; a column's ``cross``, ``weighted``/``weights`` and ``vocab_file`` among its fields);
``vocabularies`` (per ``encoding: vocab`` column its sorted 64-bit keys, their rows, ``capacity`` and ``oov_buckets``:
:class:`~recsys_runner.data.encoding.vocabulary.Vocabulary`; fitted, or read from a ``vocab_file``, which is then never
read again); ``column_kinds`` (each
input column's kind in the files it was fitted on: ``text``, ``number``, ``list``); ``column_types`` (each input
column's Arrow type as the training reader read it — ``string`` for every CSV column, the Parquet type otherwise — which
the served model casts a request's columns to, so that ``"123"`` and ``123`` key an id as training did; absent in
documents written before it, then ``{}``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_runner import stores, uris
from recsys_runner.data.encoding.values import type_name
from recsys_runner.data.encoding.vocabulary import Vocabulary
from recsys_runner.data.schema import DenseColumn, Schema, SparseColumn
from recsys_runner.data.schema_sequences import sequence_groups, sequences_mapping
from recsys_runner.errors import CheckpointError, DataError

log = logging.getLogger(__name__)

ENCODERS_FILE = "encoders.json"
"""The file name of the document in a checkpoint directory and among the MLflow run's artifacts."""
FORMAT = 1


@dataclass(frozen=True)
class StoredEncoders:
    """Encoders read back from a checkpoint: the fitted schema (vocabularies included), the column kinds of the files
    they were fitted on, and the checkpoint (for messages)."""

    schema: Schema
    kinds: dict[str, str]
    source: str
    types: dict[str, str] = field(default_factory=dict)
    """Each input column's Arrow type name as training read it (:func:`~recsys_runner.data.encoding.values.type_name`)."""


def read_stored(checkpoint: str | os.PathLike[str]) -> StoredEncoders | None:
    """The encoders stored in ``checkpoint`` (a directory or a store prefix), or ``None`` for a checkpoint written before
    encoders were stored (the caller warns: they are then fitted on the data again, as before)."""
    where = uris.join(os.fspath(checkpoint), ENCODERS_FILE)
    try:
        content = stores.read_bytes(where, CheckpointError)
    except FileNotFoundError:
        return None
    schema, kinds = from_json(content, where)
    return StoredEncoders(schema, kinds, os.fspath(checkpoint), stored_types(content))


GENERATED_DATA = "recsys_runner.data.generated."
"""The module prefix of every generated data option's ``_target_`` (``data=synthetic``, ``synthetic_sequences``, …)."""


def trained_on_generated_data(checkpoint: str | os.PathLike[str]) -> str | None:
    """The data option ``checkpoint`` was trained on when it generates its rows (``synthetic``: its ids are drawn as table
    rows, nothing is fitted, so no encoders are stored), read from the launch's composed config in its ``meta.json``;
    ``None`` for file data, or a checkpoint without that record. Tells a checkpoint that never had encoders from one
    written before they were stored, so the warnings about their absence say the right one."""
    try:
        meta = json.loads(stores.read_bytes(uris.join(os.fspath(checkpoint), "meta.json"), CheckpointError))
    except (FileNotFoundError, ValueError):
        return None
    config = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(config, dict) or not str(config.get("data._target_") or "").startswith(GENERATED_DATA):
        return None
    return str(config.get("data") or "synthetic")


def column_kind(column: pa.ChunkedArray | pa.Array) -> str:
    """``list``, ``number`` (numbers, or text that parses as numbers in every sampled row: a CSV reads every column as
    text), ``text``, or ``null`` (no value in the sample: compatible with every kind)."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        return "list"
    values = arr.drop_null()
    text = pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
    if text:
        values = pc.filter(values, pc.not_equal(values, ""))
    if len(values) == 0:
        return "null"
    if not text:
        return "number" if pa.types.is_integer(values.type) or pa.types.is_floating(values.type) or pa.types.is_boolean(values.type) else "text"
    try:
        values.cast(pa.float64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return "text"
    return "number"


def column_kinds(schema: Schema, sample: pa.Table) -> dict[str, str]:
    """The kind of each of ``schema``'s input columns in a ``sample`` of the files (columns it lacks left out)."""
    return {name: column_kind(sample.column(name)) for name in schema.columns if name in sample.column_names}


def column_types(schema: Schema, sample: pa.Table) -> dict[str, str]:
    """The Arrow type name of each of ``schema``'s input columns as the training reader read them (``sample``)."""
    return {name: type_name(sample.schema.field(name).type) for name in schema.columns if name in sample.column_names}


def stored_types(content: bytes) -> dict[str, str]:
    """The ``column_types`` of a document (``{}`` for one written before they were stored)."""
    return dict(json.loads(content).get("column_types") or {})


def to_json(schema: Schema, kinds: dict[str, str], types: dict[str, str] | None = None) -> bytes:
    """The document of ``schema`` (with its vocabularies), the files' column ``kinds`` and their Arrow ``types``."""
    vocabularies = {name: {"capacity": v.capacity, "oov_buckets": v.oov_buckets, "keys": [int(k) for k in v.keys],
                           "rows": [int(r) for r in v.rows]} for name, v in schema.vocabularies.items()}
    document = {"format": FORMAT, "label": schema.label, "labels": schema.labels, "label_kinds": schema.label_kinds,
                "label_threshold": schema.label_threshold, "dense": [asdict(d) for d in schema.dense],
                "sparse": [asdict(s) for s in schema.sparse], "sequences": sequences_mapping(schema.sequences),
                "vocabularies": vocabularies, "column_kinds": kinds, "column_types": types or {}}
    return json.dumps(document, indent=1).encode()


def from_json(content: bytes, where: str) -> tuple[Schema, dict[str, str]]:
    """The schema (vocabularies included) and column kinds a document holds.

    Raises:
        CheckpointError: the document is not one this version reads, naming ``where``.
    """
    try:
        raw: dict[str, Any] = json.loads(content)
        written = raw.get("format")
        if type(written) is int and written > FORMAT:
            raise CheckpointError(f"{where}: encoders of format {written}, written by a newer recsys_runner (this version reads "
                                  f"format {FORMAT}), so its columns would be encoded otherwise than in training. Fix: run this "
                                  f"command with the recsys_runner version that trained it or a later one (the training run's "
                                  f"manifest.git_commit tag names its commit)")
        if written != FORMAT:
            raise CheckpointError(f"{where}: encoders of format {written!r}, this version reads format {FORMAT}. Fix: "
                                  f"evaluate it with the recsys_runner version that trained it")
        schema = Schema(label=raw["label"], labels=raw["labels"], label_kinds=raw["label_kinds"], label_threshold=raw["label_threshold"],
                        dense=[DenseColumn(**d) for d in raw["dense"]], sparse=[SparseColumn(**s) for s in raw["sparse"]],
                        sequences=sequence_groups(raw["sequences"] or None, f"{where}: sequences"))
        for name, v in raw["vocabularies"].items():
            schema.vocabularies[name] = Vocabulary(np.asarray(v["keys"], dtype=np.uint64), np.asarray(v["rows"], dtype=np.int64),
                                                   int(v["capacity"]), int(v["oov_buckets"]))
        return schema, dict(raw["column_kinds"])
    except CheckpointError:  # a format it does not read: said as such, not as an unreadable document
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where} is not a readable encoders document ({type(e).__name__}: {e}). Fix: point load= / "
                              f"checkpoint.resume at a checkpoint this version wrote, or delete the file to rebuild the encoders "
                              f"from the data (a warning says so)") from None


def check_columns(kinds: dict[str, str], sample: pa.Table, where: str, source: str) -> None:
    """Refuse files that contradict the stored encoders: an input column missing, or of another kind.

    Args:
        kinds: the column kinds stored with the encoders.
        sample: a sample of the files read now.
        where: the files (``data.path=…``), for the message.
        source: the checkpoint the encoders come from, for the message.

    Raises:
        DataError: naming the column and what changed.
    """
    missing = [name for name in kinds if name not in sample.column_names]
    if missing:
        raise DataError(f"{where} has no column {missing[0]!r}{f' (nor {missing[1:]})' if missing[1:] else ''}, which the model "
                        f"was trained on (its encoders are stored in {source}). Fix: point the data at files with the training "
                        f"columns, or train a new model on these files")
    for name, stored in kinds.items():
        now = column_kind(sample.column(name))
        if "null" not in (now, stored) and now != stored:
            raise DataError(f"column {name!r} of {where} holds {now} values, but the model was trained on {stored} values in it "
                            f"(encoders stored in {source}): the stored encoding would not map them to the trained rows. Fix: "
                            f"write the column as {stored}, as in the training files")


def check_inputs(encoders: StoredEncoders, sample: pa.Table, where: str, optional: Collection[str] = ()) -> None:
    """Refuse files the stored encoders would read otherwise than the training files: :func:`check_columns`, and a column
    whose ids are keyed by their type (``encoding: vocab`` or ``hash``, a cross's columns) holding text where training
    read integers, or the reverse. ``"7"`` and ``7`` are two values there, so every id would read another row than in
    training (an OOV row of a vocabulary) without an error: scores of an untrained model.

    Args:
        encoders: the checkpoint's encoders (with the Arrow ``types`` of the columns as training read them; a document
            written before they were stored has none, and only the kinds are checked).
        sample: a sample of the files read now.
        where: the files (``data.path=…``, ``predict.input=…``), for the message.
        optional: columns the files may lack (the labels, in files to score).

    Raises:
        DataError: naming the column, both types and the fix.
    """
    check_columns({k: v for k, v in encoders.kinds.items() if k not in optional}, sample, where, encoders.source)
    keyed = {name: col for col in encoders.schema.sparse if not col.hex
             for name in (col.cross or ([col.name] if col.encoding in ("vocab", "hash") else []))}
    for name, col in keyed.items():
        stored = encoders.types.get(name)
        if stored is None or name not in sample.column_names:
            continue
        now = type_name(sample.schema.field(name).type)
        if "null" in (now, stored) or ("string" in now) == ("string" in stored):
            continue
        how = f"data.sparse[{col.name}]" + (" crosses it" if col.cross else f" (encoding={col.encoding}) keys")
        raise DataError(f"column {name!r} of {where} holds {now} values, but the model was trained on {stored} values in it "
                        f"(encoders stored in {encoders.source}): {how} text and integers apart (\"7\" and 7 are two values), so "
                        f"every id would read another row than in training. Fix: give the column the training files' type, "
                        f"{stored} (every column of a CSV file is text: score a model trained on Parquet with Parquet files)")


OOV_PREFIX, LOOKUP_PREFIX = "data/oov_values/", "data/vocab_values/"
"""The counters (summable over ranks) a file data module keeps per ``encoding: vocab`` column: values that read an OOV
row, and values; :func:`oov_rates` turns each pair into ``data/oov_rate/<column>``."""
RATE_PREFIX = "data/oov_rate/"
"""Each ``encoding: vocab`` column's metric: the share of its values that read an OOV row (:func:`oov_rates`)."""


def oov_counters(counts: dict[str, list[int]]) -> dict[str, float]:
    """``counts`` (column → [OOV values, values]) as the counters a data module's ``metrics()`` returns."""
    out: dict[str, float] = {}
    for name, (oov, total) in counts.items():
        out[f"{OOV_PREFIX}{name}"], out[f"{LOOKUP_PREFIX}{name}"] = float(oov), float(total)
    return out


UNFITTED_RATE, UNFITTED_MIN_VALUES = 0.2, 10_000
"""A vocabulary that misses at least this share of at least this many training values was fitted on rows unlike the
rest (:func:`unfitted_vocabularies`): a fit keeps a vocabulary only where the sample's values seen once are at most
``data.infer.max_unseen_fraction`` (5%) of its values, so a fair sample leaves a few percent unseen, never a fifth."""


def unfitted_vocabularies(counters: dict[str, float]) -> dict[str, tuple[float, int]]:
    """The columns whose vocabulary misses a share of their values that no fair sample would (:data:`UNFITTED_RATE` of at
    least :data:`UNFITTED_MIN_VALUES`), each with that share and the values counted: a sample of a file sorted by time that is
    its first rows (a single compressed text file's; Avazu's ``train.csv``: one hour of ten days) holds the first hours alone,
    so ``hour`` is then OOV for every later row, and one in runs spread over it can still miss values between them."""
    out: dict[str, tuple[float, int]] = {}
    for key, total in counters.items():
        name = key.removeprefix(LOOKUP_PREFIX)
        if key.startswith(LOOKUP_PREFIX) and total >= UNFITTED_MIN_VALUES:
            share = counters.get(f"{OOV_PREFIX}{name}", 0.0) / total
            if share >= UNFITTED_RATE:
                out[name] = (share, int(total))
    return out


def oov_rates(counters: dict[str, float]) -> dict[str, float]:
    """``counters`` (summed over ranks) with each column's pair of OOV counters replaced by ``data/oov_rate/<column>``:
    the share of its values since the data was built that no row of the stored vocabulary holds."""
    out = {k: v for k, v in counters.items() if not k.startswith((OOV_PREFIX, LOOKUP_PREFIX))}
    for key, total in counters.items():
        if key.startswith(LOOKUP_PREFIX) and total:
            name = key.removeprefix(LOOKUP_PREFIX)
            out[f"{RATE_PREFIX}{name}"] = counters.get(f"{OOV_PREFIX}{name}", 0.0) / total
    return out


def oov_line(rates: dict[str, float]) -> str | None:
    """One log line of the ``data/oov_rate/<column>`` values, or ``None`` without any."""
    shown = [f"{k.removeprefix(RATE_PREFIX)} {v:.2%}" for k, v in rates.items() if k.startswith(RATE_PREFIX)]
    return f"values unseen when the vocabularies were fitted (read OOV rows): {', '.join(shown)}" if shown else None
