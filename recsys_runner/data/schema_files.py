"""The schema kept in files: a YAML schema file (``data.schema=<file>``, ``convert --schema``) and a Parquet file's metadata.

A schema file is what a run prints when it infers a schema (:func:`schema_yaml`) and what ``data.schema`` and
``convert --schema`` read back (:func:`read_schema_file`), with the text-reader options beside the columns; ``convert``
stores the schema as JSON in the Parquet files it writes (:func:`schema_json`, :func:`stored_schema`). The schema
itself, and its checks, are :mod:`recsys_runner.data.schema`'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields, is_dataclass
from typing import Any

import pyarrow.parquet as pq
import yaml

from recsys_runner import stores
from recsys_runner.data.schema import DenseColumn, Schema, SparseColumn
from recsys_runner.data.schema_sequences import sequence_groups, sequences_mapping
from recsys_runner.errors import ConfigError, require

SCHEMA_KEYS = ("label", "labels", "label_kinds", "label_threshold", "dense", "sparse", "sequences")
"""The keys of a schema file (``data.schema=<file>``, ``convert --schema``) that describe the columns."""
READER_KEYS = ("delimiter", "header", "column_names", "null_values")
"""The keys of a schema file that say how to read delimited text (CSV/TSV options of ``data=csv``)."""


def schema_from_mapping(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The :class:`Schema` fields and the text-reader options (:data:`READER_KEYS` present) a schema file's mapping holds.

    The form is the one the runner prints when it infers a schema, and the one ``convert --schema`` reads:
    ``label`` (or ``labels`` / ``label_kinds``), ``label_threshold``, ``dense``, ``sparse`` as in ``data.*``,
    and optionally ``delimiter``, ``header``, ``column_names``, ``null_values``. The fields are keyword
    arguments of :class:`Schema` (columns built and checked); a sparse column without ``num_embeddings`` is
    sized from the data by the data module, so ``Schema(**fields)`` alone refuses it.

    Raises:
        ConfigError: an unknown key or an invalid column, naming ``where``.
    """
    require(isinstance(raw, dict), f"{where} must hold a mapping with {', '.join(SCHEMA_KEYS)}, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(SCHEMA_KEYS) - set(READER_KEYS))
    require(not unknown, f"{where} has unknown key(s) {unknown}; a schema file has {', '.join(SCHEMA_KEYS + READER_KEYS)}")
    try:
        dense = [DenseColumn(**d) for d in raw.get("dense") or []]
        sparse = [SparseColumn(**c) for c in raw.get("sparse") or []]
    except TypeError as e:  # an unknown field in a column entry
        raise ConfigError(f"{where}: {e}. Column fields: dense {[f.name for f in fields(DenseColumn)]}, "
                          f"sparse {[f.name for f in fields(SparseColumn)]}") from None
    parts = {"label": raw.get("label"), "labels": raw.get("labels"), "label_kinds": raw.get("label_kinds"),
             "label_threshold": raw.get("label_threshold"), "dense": dense, "sparse": sparse,
             "sequences": sequence_groups(raw.get("sequences"), f"{where}: sequences")}
    return parts, {k: raw[k] for k in READER_KEYS if k in raw}


def read_schema_file(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`schema_from_mapping` of the YAML file ``path`` (``data.schema=<path>``)."""
    try:
        raw = yaml.safe_load(stores.read_bytes(path, ConfigError)) or {}
    except OSError as e:
        raise ConfigError(f"data.schema={path!r} cannot be read ({e.strerror or e}). Fix: point data.schema at a schema YAML file "
                          f"(the one a run prints when it infers the schema)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"data.schema={path!r} is not valid YAML ({str(e).splitlines()[0]})") from None
    return schema_from_mapping(raw, f"data.schema={path!r}")


def schema_yaml(schema: Schema, reader: dict[str, Any] | None = None, notes: list[str] | None = None) -> str:
    """``schema`` (and the text-reader options) as a schema file: what :func:`read_schema_file` reads back.

    Fields at their defaults are left out of each column; ``notes`` become comment lines at the top.
    """
    out: dict[str, Any] = {}
    if schema.labels is not None:
        out["labels"] = dict(schema.labels)
        if schema.label_kinds:
            out["label_kinds"] = dict(schema.label_kinds)
    else:
        out["label"] = schema.label
    if schema.label_threshold is not None:
        out["label_threshold"] = schema.label_threshold
    out["dense"] = [_non_default(c) for c in schema.dense]
    out["sparse"] = [_non_default(c) for c in schema.sparse]
    if schema.sequences:
        out["sequences"] = sequences_mapping(schema.sequences)
    out.update(reader or {})
    text = yaml.safe_dump(out, sort_keys=False, default_flow_style=None, width=200)
    return "".join(f"# {n}\n" for n in notes or []) + text


def _non_default(column: DenseColumn | SparseColumn) -> dict[str, Any]:
    """A column's fields that differ from their defaults (``name`` always; a sparse column's size and encoding always)."""
    keep = {"name", "num_embeddings", "encoding"}
    out = {}
    for f in fields(column):
        value = getattr(column, f.name)
        if f.name in keep or value != f.default:
            # a nested config (managed_collision) as the mapping a schema file holds: YAML cannot write the dataclass
            out[f.name] = asdict(value) if is_dataclass(value) and not isinstance(value, type) else value
    return out


SCHEMA_METADATA_KEY = b"recsys_runner.schema"
"""Parquet key-value metadata written by ``python -m recsys_runner.data convert``: the schema as JSON."""


def stored_schema(path: str) -> Schema | None:
    """The schema ``convert`` stored in a Parquet file's metadata, if any."""
    fs, where = stores.arrow_filesystem(path)
    meta = pq.read_schema(where, filesystem=fs).metadata or {}
    if SCHEMA_METADATA_KEY not in meta:
        return None
    raw = json.loads(meta[SCHEMA_METADATA_KEY])
    return Schema(label=raw.get("label"), labels=raw.get("labels"), label_kinds=raw.get("label_kinds"), label_threshold=raw.get("label_threshold"),
                  dense=[DenseColumn(**d) for d in raw["dense"]], sparse=[SparseColumn(**s) for s in raw["sparse"]],
                  sequences=sequence_groups(raw.get("sequences"), f"{path}: the stored schema's sequences"))


def schema_json(schema: Schema) -> bytes:
    """The schema as stored in Parquet metadata: ``label`` or ``labels`` (task → column, in order) and
    ``label_kinds``, ``dense``, ``sparse``, ``sequences``."""
    return json.dumps({"label": schema.label, "labels": schema.labels, "label_kinds": schema.label_kinds, "label_threshold": schema.label_threshold,
                       "dense": [asdict(d) for d in schema.dense], "sparse": [asdict(s) for s in schema.sparse],
                       "sequences": sequences_mapping(schema.sequences)}).encode()
