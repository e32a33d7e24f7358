"""The id mapping of ``python -m recsys_runner.data sequences``: raw ids numbered by sorted value, written as vocab files, read back.

Each table's ids number its distinct raw values in sorted order (integers by number, text by its UTF-8 bytes), so a
shuffled copy of a log gets the same ids. The command writes them beside the rows as the vocab files that
``data.sparse[...].vocab_file`` reads (:func:`~recsys_runner.data.encoding.vocab_file.read_vocab_file`): ``vocab/<table>.txt``,
one raw value per line, line ``i`` (from 0) holding the value of id ``i``; tables ``user_id``, ``item`` (``item_id`` and
``hist_item_id``) and one per side column (``category``: ``category`` and ``hist_category``). ``vocab.json`` says which
file belongs to which table and columns, how many values each holds and how many OOV rows follow them
(:data:`VOCAB_FILE`). Every table has ``capacity + oov_buckets`` rows; no row of the first output reads the OOV rows.

``--vocab <earlier output>`` (:class:`EarlierVocab`) encodes a new log with an earlier output's mapping, through the
same :class:`~recsys_runner.data.encoding.vocabulary.Vocabulary` a stored encoder uses: a known raw value keeps its
id, an unseen one reads row ``capacity + key mod oov_buckets`` (``key``: the encoder's 64-bit key of the value), so the
tables keep the earlier output's sizes and a model trained on it reads the new rows.

:func:`load_mapping` and :func:`raw_ids` map ids back to raw values (predict's top-k). May import ``stores``,
``uris``, ``errors`` and ``data.encoding``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recsys_runner import stores, uris
from recsys_runner.data.encoding.keys import is_text, value_keys
from recsys_runner.data.encoding.vocab_file import read_vocab_file
from recsys_runner.data.encoding.vocabulary import Vocabulary
from recsys_runner.data.locate import PARQUET_SUFFIXES
from recsys_runner.errors import ConfigError, DataError

log = logging.getLogger(__name__)

VOCAB_FILE = "vocab.json"
"""``{"format": 1, "oov_buckets": n, "tables": {table: {"file": "vocab/<table>.txt", "columns": [...], "size": capacity,
"integers": bool, "log_column": <the log's column>}}}``: the mapping's index, beside the rows; ``"ids_as_text": true``
when the log's id columns were read as text (``--ids-as-text``; absent: as Arrow infers them), which a ``--vocab`` run
follows."""
VOCAB_DIR = "vocab"
VOCAB_METADATA_KEY = b"recsys_runner.vocab"
"""Parquet key-value metadata of the rows: the folder holding :data:`VOCAB_FILE`, relative to the file's folder (``.``)."""
FORMAT = 1
OOV_ID = None
"""What :func:`raw_ids` gives for an id without a raw value (an OOV row)."""


def sorted_codes(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """Each value's rank among the column's distinct values (sorted: integers by number, text by bytes), and those
    distinct values in that order. ``arr`` has no nulls."""
    values = pc.unique(arr)
    values = values.take(pc.sort_indices(values))
    return np.asarray(pc.index_in(arr, value_set=values).to_numpy(zero_copy_only=False), dtype=np.int64), values


def is_integers(arr: pa.Array) -> bool:
    """Whether a column's raw values are integers (keyed by number, written in decimal), else text."""
    return pa.types.is_integer(arr.type)


def check_writable(values: pa.Array, table: str, where: str) -> None:
    """Every value of a table fits one line of its vocab file.

    Raises:
        DataError: a text id that is empty or holds a line break (naming it and the fix).
    """
    if is_integers(values):
        return
    texts = values.cast(pa.string())
    bad = pc.or_(pc.equal(pc.utf8_length(texts), 0), pc.match_substring_regex(texts, r"[\r\n]"))
    if pc.any(bad).as_py():
        value = texts.filter(bad)[0].as_py()
        raise DataError(f"{where}: the {table} id {value!r} cannot be written to its vocab file (one id per line: no empty id, no line "
                        f"break in one). Fix: clean the log's {table} column")


def vocab_text(values: pa.Array) -> bytes:
    """A vocab file: one raw value per line (integers in decimal)."""
    return ("\n".join(str(v) for v in values.to_pylist()) + "\n").encode("utf-8")


def as_vocab_text(arr: pa.Array) -> pa.Array:
    """Values that are neither integers nor text (a float, date or boolean id column) as the lines :func:`vocab_text`
    writes for them (Python's ``str``, once per distinct value): what a ``--vocab`` run keys them by. Why: the vocab
    file of such a table is read back as text, and the values themselves have no key (a ``--vocab`` run on a log of
    float ids stopped on an assertion)."""
    distinct = pc.unique(arr)
    texts = pa.array([str(v) for v in distinct.to_pylist()], pa.string())
    return texts.take(pc.index_in(arr, value_set=distinct))


@dataclass(frozen=True)
class Table:
    """One id space of the output: its log column, its output columns and its raw values in id order."""

    name: str
    log_column: str
    columns: tuple[str, ...]
    values: pa.Array
    """Raw values; line ``i`` of the vocab file, id ``i``."""


def write_vocab(folder: Path, tables: list[Table], oov_buckets: int, ids_as_text: bool = False) -> None:
    """``folder/vocab/<table>.txt`` and ``folder/vocab.json`` (module docstring); ``ids_as_text`` is recorded only when
    set, so an output of ids read as inferred is the file it was before the setting existed."""
    (folder / VOCAB_DIR).mkdir(parents=True, exist_ok=True)
    index = {}
    for t in tables:
        (folder / VOCAB_DIR / f"{t.name}.txt").write_bytes(vocab_text(t.values))
        index[t.name] = {"file": f"{VOCAB_DIR}/{t.name}.txt", "columns": list(t.columns), "size": len(t.values),
                         "integers": is_integers(t.values), "log_column": t.log_column}
    document: dict = {"format": FORMAT, "oov_buckets": oov_buckets, "tables": index}
    if ids_as_text:
        document["ids_as_text"] = True
    (folder / VOCAB_FILE).write_text(json.dumps(document, indent=1) + "\n")


def _index(folder: str, what: str, rows_file: str | None = None) -> dict:
    """The checked :data:`VOCAB_FILE` of an earlier output ``folder``; ``rows_file``: a rows file whose metadata named
    the folder (:func:`mapping_folder`), for the message when it is not there.

    Raises:
        ConfigError: no such file, not JSON, or not the form this command writes (naming the folder, ``what`` names the
            flag, and the fix).
    """
    path = uris.join(folder, VOCAB_FILE)
    fix = "Fix: point it at an earlier output folder of python -m recsys_runner.data sequences (it holds vocab.json and vocab/)"
    try:
        index = json.loads(stores.read_bytes(path, ConfigError).decode("utf-8"))
    except FileNotFoundError:
        if rows_file is not None:  # the rows were moved (or copied) away from their mapping
            raise ConfigError(f"{rows_file} was written by python -m recsys_runner.data sequences with its id mapping beside it, but "
                              f"its folder {folder} has no {VOCAB_FILE}: the mapping says which ids are items (the candidates a "
                              f"ranking returns and its eval ranks) and their raw values. Fix: keep the rows files in the output "
                              f"folder with {VOCAB_FILE} and {VOCAB_DIR}/ (copy those along when moving them)") from None
        raise ConfigError(f"{what}={folder} is not an earlier output of sequences: it has no {VOCAB_FILE}. {fix}") from None
    except NotADirectoryError:  # a local file named where the folder belongs (the log, or one of the output's rows files)
        raise ConfigError(f"{what}={folder} is a file, not an earlier output folder of sequences. {fix}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{what}={folder}: {VOCAB_FILE} is not JSON ({e}). {fix}") from None
    tables = index.get("tables") if isinstance(index, dict) else None
    oov = index.get("oov_buckets") if isinstance(index, dict) else None
    good = (isinstance(index, dict) and index.get("format") == FORMAT and isinstance(oov, int) and oov >= 1 and isinstance(tables, dict)
            and all(isinstance(t, dict) and isinstance(t.get("file"), str) and isinstance(t.get("size"), int)
                    and isinstance(t.get("columns"), list) and isinstance(t.get("integers"), bool) for t in tables.values()))
    if not good:
        raise ConfigError(f"{what}={folder}: {VOCAB_FILE} is not in the form sequences writes (format {FORMAT}: oov_buckets and per "
                          f"table its file, columns, size and integers). {fix}")
    return index


@dataclass(frozen=True)
class EarlierVocab:
    """An earlier output's mapping (``--vocab``), each table's :class:`Vocabulary` as a stored encoder holds it."""

    folder: str
    oov_buckets: int
    tables: dict[str, dict]
    ids_as_text: bool = False
    """Whether the earlier log's id columns were read as text (``--ids-as-text``): the new log is read alike."""

    @staticmethod
    def load(folder: str) -> EarlierVocab:
        """The mapping of the earlier output ``folder``.

        Raises:
            ConfigError: ``folder`` is not an earlier output (no or a malformed :data:`VOCAB_FILE`).
        """
        index = _index(folder, "--vocab")
        if not isinstance(index.get("ids_as_text", False), bool):
            raise ConfigError(f"--vocab={folder}: {VOCAB_FILE}'s ids_as_text is {index['ids_as_text']!r}, not true or false. Fix: point it at "
                              f"an earlier output folder of python -m recsys_runner.data sequences")
        return EarlierVocab(folder, index["oov_buckets"], index["tables"], index.get("ids_as_text", False))

    def size(self, table: str) -> int:
        """Rows of ``table``'s embedding table: the earlier capacity and the OOV rows."""
        return int(self.tables[table]["size"]) + self.oov_buckets

    def copy_to(self, folder: Path) -> None:
        """The earlier mapping (its :data:`VOCAB_FILE` and vocab files) into ``folder``: the one this output's ids follow."""
        (folder / VOCAB_DIR).mkdir(parents=True, exist_ok=True)
        for entry in self.tables.values():
            (folder / entry["file"]).write_bytes(stores.read_bytes(uris.join(self.folder, entry["file"]), ConfigError))
        (folder / VOCAB_FILE).write_bytes(stores.read_bytes(uris.join(self.folder, VOCAB_FILE), ConfigError))

    def encode(self, table: str, arr: pa.Array, where: str) -> tuple[np.ndarray, int]:
        """The ids of a column's raw values in the earlier mapping of ``table``, and how many distinct values it has
        not seen (each read an OOV row, as the vocab encoder reads it).

        Raises:
            ConfigError: the earlier output has no such table, or keyed it otherwise (integers vs text).
            DataError: a text value that is no valid id (see :func:`value_keys`).
        """
        entry = self.tables.get(table)
        if entry is None:
            raise ConfigError(f"--vocab {self.folder} has no table {table!r} (it has {sorted(self.tables)}): the new log has a column "
                              f"the earlier output did not. Fix: the same --side columns as the earlier run")
        integers = is_integers(arr)
        if integers != entry["integers"]:
            kinds = ("integers", "text")
            fix = ("give the column the earlier log's type" if not integers or self.ids_as_text else
                   "give the column the earlier log's type (its ids are text; a text log whose ids all look like integers: --ids-as-text)")
            raise ConfigError(f"{where}: the {table} ids are {kinds[not integers]}, but --vocab {self.folder} holds {kinds[not entry['integers']]} "
                              f"for them, which key values differently. Fix: {fix}")
        vocabulary: Vocabulary = read_vocab_file(uris.join(self.folder, entry["file"]), f"--vocab {self.folder} [{table}]",
                                                 self.oov_buckets, integers=integers)
        if not integers and not is_text(arr.type):  # floats, dates, booleans: keyed as the text their vocab file holds
            arr = as_vocab_text(arr)
        keys, wrong = value_keys(arr, False)
        assert wrong is None, "integers or text: every value keys"
        ids = vocabulary.lookup(keys)
        unseen = ids >= vocabulary.capacity
        return ids, int(len(np.unique(keys[unseen]))) if unseen.any() else 0


def load_mapping(folder: str) -> dict[str, np.ndarray]:
    """Per table (``user_id``, ``item``, each side), its raw values in id order: ``mapping[table][i]`` is id ``i``'s raw
    value (int64 for integer ids, else object strings). ``folder``: an output folder of ``sequences``.

    Raises:
        ConfigError: ``folder`` holds no such output.
    """
    index = _index(folder, "the mapping folder")
    out = {}
    for table, entry in index["tables"].items():
        lines = stores.read_bytes(uris.join(folder, entry["file"]), ConfigError).decode("utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        out[table] = np.array([int(v) for v in lines], np.int64) if entry["integers"] else np.array(lines, object)
    return out


def column_tables(folder: str) -> dict[str, str]:
    """Each output column of ``folder``'s rows that holds a table's ids (``vocab.json``'s ``columns``) → that table:
    what lets a command that passes a column through (predict's ``predict.columns``) write its raw values instead."""
    index = _index(folder, "the mapping folder")
    return {column: table for table, entry in index["tables"].items() for column in entry["columns"]}


def mapping_folder(rows_file: str) -> str | None:
    """The output folder whose mapping encodes the Parquet file ``rows_file`` (its :data:`VOCAB_METADATA_KEY`), or
    ``None`` for rows written without one."""
    fs, in_fs = stores.arrow_filesystem(rows_file)
    meta = pq.read_schema(in_fs, filesystem=fs).metadata or {}
    if VOCAB_METADATA_KEY not in meta:
        return None
    relative = meta[VOCAB_METADATA_KEY].decode()
    parent = rows_file.rstrip("/").rsplit("/", 1)[0] if "/" in rows_file else "."
    return parent if relative in (".", "") else uris.join(parent, relative)


@dataclass(frozen=True)
class CandidateItems:
    """The items a model's ranking may return, and so the ones its ranking eval ranks: ids ``0 … count-1`` of a table
    (:func:`candidate_items`)."""

    folder: str | None
    """The id mapping (a ``sequences`` output folder) the files name, or ``None``."""
    count: int
    """The mapping's values of the table (never its OOV rows), else the whole table."""


def candidate_items(files: list[str] | tuple[str, ...], table: str, num_rows: int) -> CandidateItems:
    """The candidate items of ``table`` (``num_rows`` rows) for rows read from the Parquet ``files``: the one definition
    that ``predict``'s top-k, the served top-k model and the next-item eval share, so that the eval measures the
    candidates production serves. Ids past the mapping's values are its OOV rows (ids of no item: an unknown raw id, a
    hash bucket), which are never recommended, so they are no candidates; files without a mapping give the whole table.

    Raises:
        ConfigError: the files name different mappings, or the mapping has no such table or more values than rows.
    """
    folders = {mapping_folder(f) for f in files}
    if len(folders) > 1:
        raise ConfigError(f"the input files name {len(folders)} id mappings ({sorted(str(f) for f in folders)}): their ids "
                          f"mean different items. Fix: files written by one run of data sequences, or with its --vocab")
    folder = next(iter(folders), None)
    if folder is None:
        return CandidateItems(None, num_rows)
    tables = _index(folder, "the mapping folder", next(f for f in files if mapping_folder(f) == folder))["tables"]
    if table not in tables:
        raise ConfigError(f"the id mapping in {folder} has no table {table!r} (it has {sorted(tables)}), the table the model "
                          f"ranks items from. Fix: rows written by data sequences for this model's data")
    count = int(tables[table]["size"])
    if count > num_rows:
        raise ConfigError(f"the id mapping in {folder} holds {count} {table} ids, but the model's table has {num_rows} rows: "
                          f"the rows were encoded for another model. Fix: rows encoded with the training's mapping")
    return CandidateItems(folder, count)


def raw_ids(mapping: dict[str, np.ndarray], table: str, ids: np.ndarray) -> list:
    """The raw values of ``ids`` of ``table`` (from :func:`load_mapping`); ``None`` (:data:`OOV_ID`) for an OOV row, whose
    raw value is not known."""
    return raw_values(mapping[table], ids)


def raw_values(values: np.ndarray, ids: np.ndarray) -> list:
    """``values[ids]`` (a table's raw values in id order, one table of :func:`load_mapping`) as a list; ``None``
    (:data:`OOV_ID`) for an id outside them (an OOV row, or a negative id), whose raw value is not known."""
    ids = np.asarray(ids, np.int64)
    inside = (ids >= 0) & (ids < len(values))
    out = values[np.where(inside, ids, 0)].tolist() if len(values) else [OOV_ID] * len(ids)
    return [v if ok else OOV_ID for v, ok in zip(out, inside.tolist(), strict=True)]


OOV_ID_VALUE = -1
"""What a null id reads as: outside every mapping, so written as null."""


class RawIdColumns:
    """Pass-through columns (``predict.columns``) that hold ids of a ``data sequences`` id mapping, written as the log's
    raw values: the ``user_id`` of per-user rows is the log's user, as the ``top_items`` are its items. Each input file
    names its own mapping (:func:`~recsys_runner.data.sequences.mapping.mapping_folder`); an OOV id (a value unseen
    by the mapping) is written as null. Files without a mapping (CSV, other Parquet) pass their columns as they are."""

    def __init__(self, columns: list[str], *, say: bool) -> None:
        self.columns, self.say = columns, say
        self._by_file: dict[str, dict[str, np.ndarray]] = {}
        self._said: set[str] = set()  # the mapping folders logged

    def of(self, path: str, table: pa.Table) -> pa.Table:
        """``table`` (a batch's pass-through columns from ``path``) with its id columns as raw values."""
        values = self._by_file.get(path)
        if values is None:
            values = self._by_file[path] = self._load(path)
        for name, raw in values.items():
            table = table.set_column(table.schema.get_field_index(name), name, _raw_column(table[name], raw))
        return table

    def _load(self, path: str) -> dict[str, np.ndarray]:
        folder = mapping_folder(path) if self.columns and path.endswith(PARQUET_SUFFIXES) else None
        if folder is None:
            return {}
        tables = column_tables(folder)
        named = {c: tables[c] for c in self.columns if c in tables}
        if not named:
            return {}
        mapping = load_mapping(folder)
        if self.say and folder not in self._said:
            log.info("predict: %s written as the raw ids of the mapping in %s (an id unseen by it as null)",
                     ", ".join(f"{c} ({t})" for c, t in named.items()), folder)
            self._said.add(folder)
        return {c: mapping[t] for c, t in named.items()}


def _raw_column(column: pa.ChunkedArray, values: np.ndarray) -> pa.Array:
    """``column``'s ids (integers, or lists of them: a history) as the raw values of ``values`` (a mapping's table)."""
    array = column.combine_chunks()
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        flat = array.flatten().fill_null(OOV_ID_VALUE).to_numpy(zero_copy_only=False)
        return type(array).from_arrays(array.offsets, pa.array(raw_values(values, flat)), mask=array.is_null())
    return pa.array(raw_values(values, array.fill_null(OOV_ID_VALUE).to_numpy(zero_copy_only=False)))
