"""The file data options ``data=parquet``, ``data=csv``, ``data=criteo`` and ``data=criteo_npy``: each one's row source and where its schema comes from.

A data option reads its schema from the model's stored encoders (a checkpoint), a ``data.schema`` file, the config's
columns, the schema ``convert`` stored in Parquet files, or infers what they leave open from a sample of the files
(:mod:`recsys_runner.data.encoding.fit`, logged as a schema file); how its files then become batches is
:class:`~recsys_runner.data.files.streaming.TabularData`'s (the configs: :mod:`recsys_runner.data.files.tabular_config`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import pyarrow as pa

from recsys_runner.data.encoding.fit import Inferred, complete_schema
from recsys_runner.data.encoding.keys import is_text
from recsys_runner.data.encoding.number_columns import is_number_type, not_numbers
from recsys_runner.data.encoding.sparse_ids import float_ids
from recsys_runner.data.encoding.stored import StoredEncoders, check_inputs
from recsys_runner.data.encoding.values import is_list
from recsys_runner.data.files.criteo_config import (
    CRITEO_COLUMNS,
    CRITEO_NUM_SPARSE,
    CriteoDataConfig,
    CriteoNpyDataConfig,
    criteo_columns,
)
from recsys_runner.data.files.csv_source import CsvSource
from recsys_runner.data.files.npy_source import NpySource
from recsys_runner.data.files.parquet_source import PARQUET_REPEATS_FIX, ParquetSource, plain_schema
from recsys_runner.data.files.sources import check_unique_names
from recsys_runner.data.files.splits import Split
from recsys_runner.data.files.streaming import KIND_SAMPLE_ROWS, TabularData
from recsys_runner.data.files.tabular_config import (
    CsvDataConfig,
    ParquetDataConfig,
    SchemaFields,
    check_text_lists,
    mapping_option,
)
from recsys_runner.data.locate import PARQUET_SUFFIXES, resolve_files
from recsys_runner.data.schema import DenseColumn, Schema, SparseColumn
from recsys_runner.data.schema_files import read_schema_file, schema_yaml, stored_schema
from recsys_runner.data.sequences.histories import check_list_columns
from recsys_runner.errors import ConfigError, DataError

log = logging.getLogger(__name__)


def checkpoint_schema(encoders: StoredEncoders, config: SchemaFields) -> Schema:
    """The stored encoders' schema with the labels the config names (``data.label`` or ``data.labels``, with
    ``label_kinds`` and ``label_threshold``) in place of the stored ones. Labels are not encoders: nothing about them was
    fitted, and the model's tasks bind to them by name, so an ``evaluate`` of files whose label columns are named
    otherwise, or a fine-tune on another label, reads the columns it is told to. The stored labels were used instead,
    silently: ``data.labels={ctr: buy, cvr: click}`` given to evaluate scored each task against its training column.
    A config that names no label (the training's was detected from the files) keeps the stored ones."""
    stored = encoders.schema
    differ = sizes_not_used(stored, {c.name: c.num_embeddings for c in config.sparse})
    warn_sizes_not_used([f"data.sparse[{c}].num_embeddings={n} (stored: {m})" for c, (n, m) in differ.items()], encoders.source)
    given: dict[str, Any] = {"label": config.label, "labels": mapping_option(config.labels, "data.labels"),
                             "label_kinds": mapping_option(config.label_kinds, "data.label_kinds"),
                             "label_threshold": config.label_threshold}
    if (given["label"] is None and given["labels"] is None) or all(v == getattr(stored, k) for k, v in given.items()):
        return stored
    log.info("data labels: %s, as the config names them (the checkpoint was trained on %s)",
             given["labels"] or given["label"], stored.labels or stored.label)
    return replace(stored, **given)


def sizes_not_used(stored: Schema, given: dict[str, int | None]) -> dict[str, tuple[int, int]]:
    """The columns the config sizes (``given``: column → ``num_embeddings``, ``None`` where it leaves it to the data)
    other than the stored encoders do: column → (configured, stored). A vocabulary table larger than configured is left
    out: a ``data.vocabulary=extend`` fine-tune grows it past the size its first run was configured with."""
    return {c.name: (n, c.num_embeddings) for c in stored.sparse if (n := given.get(c.name)) is not None and c.num_embeddings is not None
            and n != c.num_embeddings and not (c.encoding == "vocab" and c.num_embeddings > n)}


def warn_sizes_not_used(differ: list[str], source: str) -> None:
    """Warn that the config's table sizes ``differ`` (``key=value (stored: n)`` each) are not used: the stored encoders
    win, so a fine-tune that raised ``data.num_embeddings`` because the OOV rate grew trained on the checkpoint's sizes
    without a word."""
    if differ:
        shown = "; ".join(differ[:5]) + (f"; and {len(differ) - 5} more" if len(differ) > 5 else "")
        log.warning("%s: not used, the encoders stored in %s size the tables (a checkpoint's ids keep their rows). To size "
                    "them anew on these files, fine-tune with data.vocabulary=refit", shown, source)


def from_checkpoint(encoders: StoredEncoders, schema: Schema, sample: pa.Table, where: str) -> Schema:
    """``schema`` (the stored encoders', :func:`checkpoint_schema`), after checking that the files (``sample``: rows of
    them) do not contradict the encoders; the stored label columns that ``schema`` no longer reads may be absent.

    Raises:
        DataError: a column the model was trained on is missing, or holds another kind of values (:func:`check_inputs`).
    """
    check_inputs(encoders, sample, where, optional=[c for c in encoders.schema.label_columns if c not in schema.label_columns])
    log.info("data encoders: loaded from %s (fitted when it was trained; not fitted again on %s)", encoders.source, where)
    return schema


def check_column_types(schema: Schema, arrow: pa.Schema, path: str) -> None:
    """The columns of ``schema`` have types it can read in the Parquet file ``path`` (``arrow``: its footer's schema):
    each label and dense column numbers (:func:`~recsys_runner.data.encoding.number_columns.is_number_type`), each sparse
    column read as ids integers or text (or lists of them): not floats, and not a struct, a list of lists, bytes, a
    timestamp or a decimal, whose values the encoder named as ids out of range (``id {'a': 1} is outside [0, 10)``). Checked when the data is built, before the model: the encoder refuses the same columns, but only
    at the first read, after the model has been built and sharded. The other files of ``data.path`` and ``data.eval_path``
    hold each column as the same kind of values (:func:`~recsys_runner.data.files.parquet_source.type_clash`).

    Raises:
        DataError: naming the file, the column, its type and the fix, which differs for a label
            (:func:`~recsys_runner.data.encoding.number_columns.not_numbers`, :func:`~recsys_runner.data.encoding.sparse_ids.float_ids`).
    """
    for name, label in [*((c, True) for c in schema.label_columns), *((c.name, False) for c in schema.dense)]:
        if name in arrow.names and not is_number_type(t := arrow.field(name).type):
            raise DataError(f"{path}: {not_numbers(name, t, label)}")
    for col in schema.sparse:
        if col.name not in arrow.names or col.encoding == "bucketize" or col.weighted or col.cross is not None:
            continue
        t = arrow.field(col.name).type
        if pa.types.is_floating(flat := t.value_type if is_list(t) else t):
            raise DataError(f"{path}: {float_ids(col, flat)}")
        if not (pa.types.is_integer(flat) or is_text(flat) or pa.types.is_boolean(flat) or pa.types.is_null(flat)):
            raise DataError(f"{path}: column {col.name!r} holds {t} values, but data.sparse[{col.name}] reads ids: integers or text, or "
                            f"a list of them per row (multi-hot). Fix: write the column as int64 or string (a list column as "
                            f"list<int64> or list<string>), or leave it out of data.sparse")
    check_shared_kinds(schema, arrow, path)


def check_shared_kinds(schema: Schema, arrow: pa.Schema, path: str) -> None:
    """Columns on one table (a history and its candidate) hold ids of one kind: the integer 1 and the text ``"1"`` have
    different keys, so they would read two rows of the table, and a history would never match its candidate.

    Raises:
        DataError: naming both columns, their kinds and the table, and the fix.
    """
    kinds: dict[str, tuple[str, str]] = {}
    for col in schema.sparse:
        if col.name not in arrow.names or col.encoding == "bucketize" or col.weighted or col.cross is not None:
            continue
        t = arrow.field(col.name).type
        flat = t.value_type if is_list(t) else t
        kind = "text" if is_text(flat) else "integer" if pa.types.is_integer(flat) else None
        if kind is None:
            continue
        first, first_kind = kinds.setdefault(col.table_name, (col.name, kind))
        if first_kind != kind:
            raise DataError(f"{path}: data.sparse[{first}] holds {first_kind} ids and data.sparse[{col.name}] {kind} ids, but both read "
                            f"table {col.table_name!r}: the id 1 and the id '1' would be two rows of it (a history would never match "
                            f"its candidate). Fix: write both columns with one type (e.g. the integer ids as strings)")


def config_schema(config: Any, sample: Any, where: str, column_names: Any = None,
                  refuse_repeats: Callable[[Collection[str]], None] | None = None) -> tuple[Inferred, dict[str, Any]]:
    """The schema a config (or its ``data.schema`` file) describes, with what it leaves open inferred from
    ``sample()`` (:func:`~recsys_runner.data.encoding.fit.complete_schema`), and the text-reader options the schema
    file sets (``{}`` without one).

    ``refuse_repeats(columns)`` refuses a repeated column name among ``columns`` in the first file, called with the columns
    the config names before the sample is read (which leaves repeated names out: :func:`~recsys_runner.data.files.sources.without_repeats`,
    so a named one would read as missing) and with the schema's after."""
    reader: dict[str, Any] = {}
    if config.schema is not None:
        parts, reader = read_schema_file(config.schema)
    else:
        parts = {"label": config.label, "labels": mapping_option(config.labels, "data.labels"), "label_threshold": config.label_threshold,
                 "label_kinds": mapping_option(config.label_kinds, "data.label_kinds"), "dense": list(config.dense), "sparse": list(config.sparse),
                 "sequences": config.sequence_groups()}
    if refuse_repeats is not None:
        refuse_repeats([*([parts["label"]] if parts["label"] else []), *(parts["labels"] or {}).values(), *(c.name for c in parts["dense"]),
                        *(n for c in parts["sparse"] for n in c.input_columns)])
    done = complete_schema(**parts, sample=sample, config=config.infer, where=where, column_names=column_names)
    if refuse_repeats is not None:
        refuse_repeats(done.schema.columns)
    return done, reader


def grown_encoders(grow: Callable[[Schema], StoredEncoders], fit: Callable[[], Schema]) -> StoredEncoders:
    """The encoders ``grow`` makes of the schema ``fit()`` fits on the files (``data.vocabulary=extend``: the checkpoint's,
    each vocabulary grown by the fit's; :meth:`~recsys_runner.data.base.DataConfig.build`). That schema is not the run's,
    so the fit's info lines (its inferred schema above all, which would read as the run's) are left unsaid; its
    warnings still show."""
    quiet = logging.getLogger("recsys_runner.data")
    level = quiet.level
    quiet.setLevel(max(logging.WARNING, quiet.getEffectiveLevel()))
    try:
        schema = fit()
    finally:
        quiet.setLevel(level)
    return grow(schema)


def log_inferred(done: Inferred, where: str, reader: dict[str, Any] | None = None) -> None:
    """Log an inferred schema (rank 0) as a schema file the user can save and pass as ``data.schema=<file>``."""
    if not done.inferred or int(os.environ.get("RANK", "0")) != 0:
        return
    text = schema_yaml(done.schema, reader, done.notes)
    log.info("data schema of %s, inferred (%s). To keep or edit it, save the lines below as a file and train with "
             "data.schema=<file>:\n%s", where, done.summary(), text)


class ParquetData(TabularData):
    """``data=parquet``: Parquet files (see :class:`ParquetDataConfig`).

    The schema: ``data.schema`` or the config's columns; without either, the one ``convert`` stored in the
    files; without that, one inferred from the files (:mod:`recsys_runner.data.encoding.fit`, logged).
    """

    def __init__(self, config: ParquetDataConfig, encoders: StoredEncoders | None = None, fit_on_head: bool = False,
                 grow: Callable[[Schema], StoredEncoders] | None = None) -> None:
        files = resolve_files(config.path, "data.path", PARQUET_SUFFIXES)
        probe = ParquetSource(files, [], config.read_rows)
        # the first file with rows speaks for the columns' types: an empty part (skipped when read) may hold a column of
        # text or lists as nulls only, as pandas writes an empty partition
        head = next((f for f in files if probe.has_rows(f)), files[0])
        first = plain_schema(probe._open(head).schema_arrow)  # a dictionary column as its values (parquet_source.decoded)

        def refuse_repeats(columns: Collection[str]) -> None:
            check_unique_names(head, first.names, "its schema", PARQUET_REPEATS_FIX, columns)

        def fitted() -> Schema:
            """The schema a run without encoders reads: the one ``convert`` stored in the files, else the config's
            completed on a sample of them."""
            stored = None if (config.schema or config.sparse or config.dense) else stored_schema(head)
            if stored is not None:
                check_stored_replaces(config, stored, head)
                return stored
            done, _ = config_schema(config, lambda: ParquetSource(files, [], config.read_rows).sample(config.infer.sample_rows, spread=not fit_on_head),
                                    f"data.path={config.path!r}", lambda: first.names, refuse_repeats)
            log_inferred(done, f"data.path={config.path!r}")
            return done.schema

        if grow is not None:
            encoders = grown_encoders(grow, fitted)
        if encoders is not None:
            schema = checkpoint_schema(encoders, config)
            refuse_repeats(schema.columns)
            sample = ParquetSource(files, [], config.read_rows).sample(KIND_SAMPLE_ROWS)
            schema = from_checkpoint(encoders, schema, sample, f"data.path={config.path!r}")
            self.sampled_columns = tuple(sample.column_names)
        else:
            schema = fitted()
        check_list_columns(schema, first, head)
        check_column_types(schema, first, head)
        super().__init__(config, schema, encoders)

    def _suffixes(self) -> tuple[str, ...] | None:
        return PARQUET_SUFFIXES

    def _source(self, files: list[str]) -> ParquetSource:
        return ParquetSource(files, self.schema.columns, self.config.read_rows)

    def _eval_source(self, files: list[str], train: ParquetSource) -> ParquetSource:
        """The eval files, whose columns are checked against the first training file's (a column they lack but it holds
        is named as the eval file's mistake)."""
        return ParquetSource(files, self.schema.columns, self.config.read_rows, reference=train.files[0])


def check_stored_replaces(config: ParquetDataConfig, stored: Schema, head: str) -> None:
    """Refuse label and history settings that the files' stored schema replaces: the stored one is read whole, so a
    ``data.label`` (or ``labels``, ``label_kinds``, ``label_threshold``, ``sequences``) that differs from it would be
    silently ignored, and a run would train on another label than the one asked for. The same value is fine."""
    given: dict[str, Any] = {"label": config.label, "labels": mapping_option(config.labels, "data.labels"),
                             "label_kinds": mapping_option(config.label_kinds, "data.label_kinds"),
                             "label_threshold": config.label_threshold}
    differ = [f"data.{key}={value!r}" for key, value in given.items() if value is not None and value != getattr(stored, key)]
    if config.sequences is not None and config.sequence_groups() != stored.sequences:
        differ.append("data.sequences")
    if differ:
        names = stored.label if stored.label is not None else stored.labels
        raise ConfigError(f"{', '.join(differ)} would be ignored: {head} carries the schema `python -m recsys_runner.data convert` "
                          f"stored (label(s) {names!r}), which the files are read by when data.dense, data.sparse and "
                          f"data.schema are unset. Fix: drop {', '.join(d.split('=')[0] for d in differ)}, or list the columns "
                          f"(data.dense/data.sparse, or data.schema=<file>) to read the files by the config instead")


class CsvData(TabularData):
    """``data=csv``: delimited text files (see :class:`CsvDataConfig`); the schema from ``data.schema``, the config's
    columns, or inferred from the files (:mod:`recsys_runner.data.encoding.fit`, logged)."""

    def __init__(self, config: CsvDataConfig, encoders: StoredEncoders | None = None, fit_on_head: bool = False,
                 grow: Callable[[Schema], StoredEncoders] | None = None) -> None:
        where = f"data.path={config.path!r}"
        if config.schema is not None and (reader := read_schema_file(config.schema)[1]):
            config = replace(config, **reader)  # the schema file says how its files are read
        if config.delimiter is None or config.header is None:
            delimiter, header = self._sampler(config).detected()
            log.info("%s: detected delimiter %r, header %s (data.delimiter / data.header null)", where, delimiter, header)
            config = replace(config, delimiter=delimiter, header=header)
        self.csv = config
        """:attr:`config`, typed as this option's (its reader settings; set first: the base class opens the files)."""

        def refuse_repeats(columns: Collection[str]) -> None:
            self._sampler(config).header_names(columns)

        def fitted() -> Schema:
            """The config's schema completed on a sample of the files (a run without encoders reads it)."""
            done, _ = config_schema(config, lambda: self._sampler(config).sample(config.infer.sample_rows, spread=not fit_on_head), where,
                                    lambda: self._sampler(config).header_names(), refuse_repeats)
            log_inferred(done, where, {"delimiter": config.delimiter, "header": config.header, "null_values": list(config.null_values),
                                       **({"column_names": list(config.column_names)} if config.column_names else {})})
            return done.schema

        if grow is not None:
            encoders = grown_encoders(grow, fitted)
        if encoders is not None:
            schema = checkpoint_schema(encoders, config)
            refuse_repeats(schema.columns)
            sample = self._sampler(config).sample(KIND_SAMPLE_ROWS)
            schema = from_checkpoint(encoders, schema, sample, where)
            self.sampled_columns = tuple(sample.column_names)
        else:
            schema = fitted()
        check_text_lists(schema.sequences, schema.sparse, f"data.schema={config.schema!r}: sparse" if config.schema else "data.sparse")
        super().__init__(config, schema, encoders)

    @staticmethod
    def _sampler(c: CsvDataConfig) -> CsvSource:
        return CsvSource(resolve_files(c.path, "data.path", None), [], delimiter=c.delimiter, header=c.header,
                         column_names=c.column_names, null_values=c.null_values, block_rows=c.block_rows, on_bad_rows=c.on_bad_rows)

    def _source(self, files: list[str]) -> CsvSource:
        c = self.csv
        return CsvSource(files, self.schema.columns, delimiter=c.delimiter, header=c.header, column_names=c.column_names,
                         null_values=c.null_values, block_rows=c.block_rows, on_bad_rows=c.on_bad_rows)

    def _eval_source(self, files: list[str], train: CsvSource) -> CsvSource:
        """The eval files, read with ``data.eval_header`` (``null``: the training files' header, checked against each
        file's first lines); without a header their columns are ``data.column_names``, else the training header's."""
        c = self.csv
        header = c.header if c.eval_header is None else c.eval_header
        names = c.column_names if c.column_names or header else train.names(train.files[0])
        return CsvSource(files, self.schema.columns, delimiter=c.delimiter, header=header, column_names=names,
                         null_values=c.null_values, block_rows=c.block_rows, on_bad_rows=c.on_bad_rows,
                         header_key="data.eval_header", follows_training=c.eval_header is None, path_key="data.eval_path",
                         reference=(train.files[0], train.names(train.files[0])))


CRITEO_LAYOUT = ("data=criteo reads Criteo's layout: tab-separated, no header line, 40 fields (the label, 13 counts, 26 hex "
                 "categoricals). Fix: write the file so (tail -n +2 drops a header line; tr ',' '\\t' turns commas into tabs), or read "
                 "it as data=csv (data.delimiter, data.header, data.column_names)")
"""What ``data=criteo``, which has no delimiter or header keys, says of a file laid out otherwise (:class:`CsvHeaders`'s
``fixed_layout``)."""


class CriteoData(TabularData):
    """``data=criteo``: raw Criteo TSV files (see :class:`CriteoDataConfig`); with ``data.num_embeddings=null`` each
    table is sized from a sample of the files (logged)."""

    def __init__(self, config: CriteoDataConfig, encoders: StoredEncoders | None = None, fit_on_head: bool = False,
                 grow: Callable[[Schema], StoredEncoders] | None = None) -> None:
        self.criteo = config
        """:attr:`config`, typed as this option's (its reader settings; set first: the base class opens the files)."""
        if grow is not None:
            encoders = grown_encoders(grow, lambda: self._fitted(config, fit_on_head))
        if encoders is not None:  # Criteo's columns are fixed: only the stored sizes and vocabularies matter
            log.info("data encoders: loaded from %s (fitted when it was trained; not fitted again)", encoders.source)
            per_feature = config.num_embeddings_per_feature
            given: list[int | None] = [*per_feature] if per_feature else [config.num_embeddings] * CRITEO_NUM_SPARSE
            names = [c.name for c in encoders.schema.sparse]
            differ = sizes_not_used(encoders.schema, dict(zip(names, given, strict=False)))
            warn_sizes_not_used([f"data.num_embeddings_per_feature[{names.index(c)}]={n} (stored: {m})" for c, (n, m) in differ.items()]
                                if per_feature else [f"data.num_embeddings={config.num_embeddings} (stored: "
                                                     f"{sorted({m for _, m in differ.values()})})"] if differ else [], encoders.source)
            super().__init__(config, encoders.schema, encoders)
            return
        super().__init__(config, self._fitted(config, fit_on_head))

    def _fitted(self, config: CriteoDataConfig, fit_on_head: bool) -> Schema:
        """Criteo's columns, with what the config leaves open (table sizes, encodings) fitted on a sample of the files."""
        sizes: list[int | None] = [*config.num_embeddings_per_feature] if config.num_embeddings_per_feature else [config.num_embeddings] * CRITEO_NUM_SPARSE
        dense, sparse = self._columns(sizes)
        where = f"data.path={config.path!r}"
        done = complete_schema(label="label", labels=None, label_kinds=None, label_threshold=None, dense=dense, sparse=sparse,
                               sample=lambda: self.open_files(config.path, "data.path").sample(config.infer.sample_rows, spread=not fit_on_head),
                               config=config.infer, where=where)
        log_inferred(done, where)
        return done.schema

    def _columns(self, sizes: list[int | None]) -> tuple[list[DenseColumn], list[SparseColumn]]:
        """Criteo's columns with these table sizes: hex ids in text."""
        return criteo_columns(sizes, self.criteo.categorical_encoding, self.criteo.dense_transform)

    def _source(self, files: list[str]) -> Any:
        c = self.criteo
        return CsvSource(files, self.schema.columns if hasattr(self, "schema") else [], delimiter="\t", header=False,
                         column_names=CRITEO_COLUMNS, null_values=c.missing_texts(), block_rows=c.block_rows, on_bad_rows=c.on_bad_rows,
                         fixed_layout=CRITEO_LAYOUT)


class CriteoNpyData(CriteoData):
    """``data=criteo_npy``: TorchRec's preprocessed Criteo days (see :class:`CriteoNpyDataConfig`,
    :mod:`recsys_runner.data.files.npy_source`): Criteo's columns, the ids integers, the dense values read as they are."""

    def _columns(self, sizes: list[int | None]) -> tuple[list[DenseColumn], list[SparseColumn]]:
        return criteo_columns(sizes, self.criteo.categorical_encoding, self.criteo.dense_transform, hex_ids=False)

    def _suffixes(self) -> tuple[str, ...] | None:
        return (".npy",)

    def _source(self, files: list[str]) -> NpySource:
        return NpySource(files, self.schema.columns if hasattr(self, "schema") else [], self.criteo.block_rows)

    def _own_split(self, train_source: NpySource) -> tuple[Split, Split, str] | None:
        """``data.last_day=holdout``: TorchRec's split (:meth:`NpySource.last_day_apart`): the days before the last to train
        on, and the last day's half ``data.last_day_half`` (``val`` unless evaluate made it ``test``) to evaluate on."""
        config = self.criteo
        assert isinstance(config, CriteoNpyDataConfig)
        if config.last_day != "holdout":
            return None
        half = config.last_day_half or "val"
        train, held, units = train_source.last_day_apart(half, "data.path")
        train_units = train.units()
        last = held.days[0]
        rows = f"rows {units[0].first_row}-{units[-1].first_row + units[-1].num_rows - 1}" if units else "no rows"
        said = f"the {half} half of day {last.day} of data.path={config.path!r} ({last.dense}: {rows} of {last.rows}), held out by data.last_day=holdout"
        return (Split(train, train_units, [u.num_rows for u in train_units]), Split(held, units, [u.num_rows for u in units]), said)
