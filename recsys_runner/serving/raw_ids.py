"""A two-tower model trained on ``data sequences`` rows served on the log's raw ids: its towers' encoders read through the id mapping.

``python -m recsys_runner.data sequences`` writes rows whose id columns hold the table ids of an id mapping (its
``vocab.json``, line ``i`` of ``vocab/<table>.txt``: id ``i``'s raw value), and the model is trained on them with
``encoding: id``: served as trained, a tower would read a raw user id ``4072`` as table row 4072 (another user). So
export gives each tower's MLflow model an ``encoders.json`` in which every column the mapping covers is an ``encoding:
vocab`` column whose vocabulary is the mapping's table (:func:`raw_id_document`), read as the log's type (integers or
text): a raw id reads the row ``data sequences --vocab`` gives it in a new log — its own, or the OOV row ``size + key mod
oov_buckets`` — through the very lookup the top-k model uses (:func:`~recsys_runner.serving.served_topk.mapping_vocabulary`), and the served tower counts those unknown ids per row
(``unknown_ids``, as the top-k model does). The training files' rows, whose ids are table ids, are turned back into raw
ids (:func:`raw_rows`) for the MLflow model's input example and for the check that the served tower equals the eager one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from recsys_runner.data.base import DataModule
from recsys_runner.data.sequences.mapping import EarlierVocab, load_mapping, mapping_folder
from recsys_runner.errors import ConfigError
from recsys_runner.serving.served_topk import mapping_vocabulary
from recsys_runner.serving.topk import training_files


@dataclass(frozen=True)
class IdMapping:
    """The id mapping the training rows were written with, as a served tower reads it."""

    folder: str
    oov_buckets: int
    tables: dict[str, str]
    """Each rows column the mapping covers (ids and history columns) → its table."""
    values: dict[str, np.ndarray]
    """Each table's raw values in id order (:func:`~recsys_runner.data.sequences.mapping.load_mapping`)."""

    def raw_values(self, column: str, ids: np.ndarray) -> list[Any]:
        """The raw values of ``column``'s table ``ids`` (each inside the mapping)."""
        return self.values[self.tables[column]][np.asarray(ids, np.int64)].tolist()


def id_mapping(files: list[str]) -> IdMapping | None:
    """The id mapping of the training rows ``files`` (Parquet files whose metadata names it), or ``None`` for rows
    written without one (other data keeps serving the ids as training read them)."""
    folder = mapping_folder(files[0]) if files else None
    if folder is None:
        return None
    vocab = EarlierVocab.load(folder)
    tables = {column: table for table, entry in vocab.tables.items() for column in entry.get("columns", [])}
    return IdMapping(folder, int(vocab.oov_buckets), tables, load_mapping(folder))


def training_mapping(data: DataModule) -> IdMapping | None:
    """:func:`id_mapping` of ``data``'s training files (none for data other than Parquet files)."""
    return id_mapping(training_files(data))


def raw_id_document(document: bytes, mapping: IdMapping, features: set[str]) -> tuple[bytes, list[str]]:
    """``encoders.json`` (``document``) with each of ``features`` the mapping covers read as the log's raw ids through
    it (module docstring), and the features so read.

    Raises:
        ConfigError: a column was not trained with ``encoding: id``, or the mapping holds more ids and OOV rows than the
            model's table (the rows were encoded for another model).
    """
    doc = json.loads(document)
    types = doc.setdefault("column_types", {})
    mapped = []
    for entry in doc["sparse"]:
        name = entry["name"]
        if name not in features or name not in mapping.tables:
            continue
        table, values = mapping.tables[name], mapping.values[mapping.tables[name]]
        if entry["encoding"] != "id":
            raise ConfigError(f"the model read {name!r} of the data sequences rows in {mapping.folder} with encoding={entry['encoding']}, "
                              f"but the column holds the id mapping's table ids, which its towers can serve as raw ids only when read "
                              f"as they are. Fix: train with data.sparse[{name}].encoding=id (the rows' own setting)")
        if len(values) + mapping.oov_buckets > int(entry["num_embeddings"]):
            raise ConfigError(f"the id mapping in {mapping.folder} holds {len(values)} {table} ids and {mapping.oov_buckets} OOV row(s), "
                              f"more than the model's table of {entry['num_embeddings']} rows for {name!r}: the rows were encoded for "
                              f"another model. Fix: export the model trained on these rows")
        integers = values.dtype == np.int64
        vocabulary = mapping_vocabulary(values, mapping.oov_buckets)  # the top-k model's lookup of the same mapping
        doc["vocabularies"][name] = {"capacity": vocabulary.capacity, "oov_buckets": vocabulary.oov_buckets,
                                     "keys": [int(k) for k in vocabulary.keys], "rows": [int(r) for r in vocabulary.rows]}
        entry.update(encoding="vocab", oov_buckets=mapping.oov_buckets)
        kind = "int64" if integers else "string"
        types[name] = f"list<{kind}>" if str(types.get(name, "")).startswith("list<") else kind
        mapped.append(name)
    return json.dumps(doc).encode(), mapped


def raw_rows(rows: pa.Table, mapping: IdMapping, columns: list[str]) -> tuple[pa.Table, pa.Table]:
    """The rows of ``rows`` (table ids, as the training files hold them) whose ``columns`` ids are all inside the mapping
    (a row with an OOV id has no raw id to send), as they are and with those ids turned into the log's raw ids."""
    mapped = [c for c in columns if c in mapping.tables and c in rows.column_names]
    keep = np.ones(rows.num_rows, bool)
    for name in mapped:
        size = len(mapping.values[mapping.tables[name]])
        cells = rows[name].to_pylist()
        keep &= np.array([all(0 <= i < size for i in (cell if isinstance(cell, list) else [cell]) if i is not None) for cell in cells], bool)
    kept = rows.filter(pa.array(keep))
    raw = kept
    for name in mapped:
        cells = kept[name].to_pylist()
        as_raw = [None if cell is None else (mapping.raw_values(name, np.asarray(cell, np.int64)) if isinstance(cell, list) else
                                             mapping.raw_values(name, np.asarray([cell], np.int64))[0]) for cell in cells]
        raw = raw.set_column(raw.column_names.index(name), name, pa.array(as_raw))
    return kept, raw
