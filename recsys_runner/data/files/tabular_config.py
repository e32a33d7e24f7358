"""The configs of the file-backed data options (``data=parquet``, ``data=csv``; ``data=criteo`` and ``data=criteo_npy`` build on
them in :mod:`recsys_runner.data.files.criteo_config`).

Each config's ``_target_`` names its reader in :mod:`recsys_runner.data.files.tabular`; docs/data.md has the full reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from recsys_runner.data.base import DataConfig
from recsys_runner.data.catalogue.item_files import ItemsConfig
from recsys_runner.data.catalogue.negatives import NegativesConfig
from recsys_runner.data.encoding.fit import InferConfig
from recsys_runner.data.encoding.rows import BAD_ROW_MODES
from recsys_runner.data.funnel import check_funnel
from recsys_runner.data.schema import (
    DenseColumn,
    SparseColumn,
    check_labels,
)
from recsys_runner.data.schema_sequences import check_group, sequence_groups
from recsys_runner.data.sequences.splits import check_rows_for_model
from recsys_runner.data.sequences.tokens import check_budget
from recsys_runner.errors import require, require_seed
from recsys_runner.features import DataNeeds, SequenceGroup

DEFAULT_EVAL_FRACTION = 0.1
"""``data.eval_fraction`` when it and ``data.eval_path`` are both null."""
DELIMITER_ESCAPES = {"\\t": "\t", "tab": "\t", "comma": ",", "semicolon": ";", "pipe": "|", "space": " "}
"""``data.delimiter`` spellings that stand for a character hard to pass through a shell and Hydra (a tab; a comma,
which Hydra's override grammar reads as a list separator: ``data.delimiter=comma``, or Hydra's own escapes
``'data.delimiter=\\,'`` and ``"data.delimiter=','"``)."""
VOCABULARY_MODES = ("keep", "refit", "extend")
"""``data.vocabulary``: what a run that starts from a checkpoint encodes its files by (:class:`TabularDataConfig`)."""


@dataclass(kw_only=True)
class TabularDataConfig(DataConfig):
    """Fields shared by every file-backed data option."""

    path: str = ""
    """Training data: a file, a directory (its data files) or a glob such as ``/data/day_*.parquet``; each also in an
    object store, e.g. ``s3://bucket/train/`` or ``'s3://bucket/day_*.parquet'`` (docs/storage.md)."""
    eval_path: str | None = None
    """Eval data in the same format; ``null`` holds out ``eval_fraction`` of the training rows instead."""
    eval_fraction: float | None = None
    """Share of training rows held out for eval by a hash of (file name, row number) when ``eval_path``
    is null (default 0.1); these rows are never trained on."""
    shuffle: bool = True
    """Shuffle training data: unit (row group / block) order per epoch, plus the shuffle buffer."""
    shuffle_buffer_rows: int = 65_536
    """Rows held and permuted together before batching (bounded memory); 0 shuffles unit order only."""
    drop_remainder: bool = True
    """Drop each shard's last partial training batch (and the last ``rows mod shards`` rows), so every
    rank has the same number of full batches. ``false`` keeps them (ranks then agree step by step)."""
    seed: int = 0
    """Seed of the unit order and the shuffle buffer (combined with the epoch), and of which negatives ``negative_rate`` keeps."""
    negative_rate: float | None = None
    """Negative downsampling: train on every positive and this fraction ``r`` (``0 < r <= 1``) of the negatives, chosen by a
    hash of (``seed``, file, row number), so the same rows with any number of ranks or workers and after a resume. The
    model's outputs are then corrected by ``logit + log(r)`` (``q = p / (p + (1 - p) / r)``) wherever they are scored:
    eval metrics, evaluate, predict, export; the rate is stored with each checkpoint. Eval rows are never downsampled. An
    epoch's length is then known only by reading: set ``train.num_steps``. Single-task binary labels only. ``null``: every
    row (docs/data.md, *Negative downsampling*)."""
    on_bad_rows: str = "fail"
    """``fail``: stop at the first bad row with its file, row and column. ``skip``: skip bad rows,
    count them (``data/bad_rows_skipped``) and log the count."""
    read_rows: int = 65_536
    """Rows per Arrow record batch read from a Parquet row group (memory bound per read)."""
    infer: InferConfig = field(default_factory=InferConfig)
    """How what the config leaves open (no column list, a sparse column without ``num_embeddings``, no label) is
    inferred from a sample of the files; the run logs the result as a schema file (docs/data.md, *Inferred schema*)."""
    items: ItemsConfig = field(default_factory=ItemsConfig)
    """The item catalogue of a two-tower model: ``{path: items.parquet, id: item_id, features: [cate_id], popularity: null}``,
    each column encoded as the training data's same-named column (docs/retrieval.md); ``path: null``: none."""
    negatives: NegativesConfig = field(default_factory=NegativesConfig)
    """Sampled catalogue items appended to every training batch (``num_negatives``, ``distribution``, ``alpha``,
    ``hard_column``, ``hard_ratio``; docs/retrieval.md); needs ``data.items``. ``num_negatives: 0``: in-batch only."""
    vocabulary: str = "keep"
    """What a run that starts from a checkpoint encodes its files by. ``keep``: the encoders stored in the checkpoint
    (vocabularies, table sizes, boundaries, statistics), so every id keeps the row it trained. ``refit``: with
    ``checkpoint.init_from``, everything is fitted anew on these files, as a new run would, and each ``encoding: vocab``
    table's trained rows are carried over by id (an id in both vocabularies keeps its trained row at its new position,
    a new id starts fresh; docs/lifecycle.md, *Fine-tuning on new data*). ``extend``: with ``checkpoint.init_from``, the
    stored encoders, each vocabulary grown by the ids of these files it lacks (every trained id keeps its row, a new id
    gets a fresh one, the table grows; the daily fine-tune). Refit and extend are refused with an explicit
    ``checkpoint.resume``: a resumed run continues its own id → row mapping."""

    next_item: bool = False
    """The rows train and evaluate a next-item model (``model=sasrec``): set by the model's needs (:meth:`for_model`), not by
    hand. Each history's candidate column (``item_id`` beside ``hist_item_id``) is then the item that came next, which the
    model trains toward and is judged against, so a row whose candidate is missing (null) is a bad row (``on_bad_rows``),
    never an empty bag read as item ``0``. Predict's top-k rows, which need no candidate, are read apart and may leave it null."""

    funnel: list[str] | None = None
    """Binary label tasks (of ``data.labels``) that form a funnel, in order, e.g. ``[ctr, cvr]``: each later label is
    positive only on rows where the one before it is (a conversion is counted only after a click). A row that breaks
    it (``cvr`` 1 where ``ctr`` is 0: a mis-joined label) is a bad row as it is read, naming the file, the row and both
    columns: it stops the run (``on_bad_rows: fail``) or is skipped and counted (``skip``). ``model=esmm`` sets it to
    ``[model.click_label, model.conversion_label]`` (unless ``model.conversion_without_click=and``), whose pCTCVR =
    pCTR x pCVR cannot fit such a row; set it for any multi-task model whose labels are a funnel. ``null``: unchecked."""

    def takes_encoders(self) -> bool:
        """Files are encoded by fitted encoders, which a checkpoint stores (:mod:`recsys_runner.data.encoding.stored`)."""
        return True

    def for_model(self, needs: DataNeeds) -> TabularDataConfig:
        """The files as they are, told whether their rows are a next-item model's (:attr:`next_item`) and the funnel its
        labels form (:attr:`funnel`, when not set here). A funnel naming a task ``data.labels`` lacks is left to the
        model, which names the labels it needs and the fix."""
        changes: dict[str, Any] = {}
        if self.next_item != needs.next_item:
            changes["next_item"] = needs.next_item
        labels = mapping_option(getattr(self, "labels", None), "data.labels")
        if self.negative_rate is not None:
            check_downsampled_model(self.negative_rate, needs)
        if self.funnel is None and needs.funnel and (labels is None or set(needs.funnel) <= set(labels)):
            changes["funnel"] = list(needs.funnel)
        return replace(self, **changes) if changes else self

    @property
    def drops_negatives(self) -> bool:
        """Whether training leaves negatives out (``negative_rate`` below 1): ``data.negative_rate=1``, a sweep's baseline,
        trains every row, so its epochs keep their known length."""
        return self.negative_rate is not None and self.negative_rate < 1

    def __post_init__(self) -> None:
        require(bool(self.path), "data.path is required: a file, a directory or a glob, e.g. data.path=/data/train/")
        super().__post_init__()
        require_seed("data.seed", self.seed)
        require(self.shuffle_buffer_rows >= 0, f"data.shuffle_buffer_rows must be >= 0, got {self.shuffle_buffer_rows}")
        require(self.on_bad_rows in BAD_ROW_MODES, f"data.on_bad_rows={self.on_bad_rows!r} must be one of {BAD_ROW_MODES}")
        require(self.vocabulary in VOCABULARY_MODES,
                f"data.vocabulary={self.vocabulary!r} must be one of {VOCABULARY_MODES}: keep (the checkpoint's encoders) or "
                f"refit (fitted anew on these files, trained rows carried over by id; with checkpoint.init_from) or extend (the "
                f"checkpoint's encoders, each vocabulary grown by these files' new ids; with checkpoint.init_from)")
        require(self.read_rows > 0, f"data.read_rows must be positive, got {self.read_rows}")
        require(self.negative_rate is None or 0 < self.negative_rate <= 1,
                f"data.negative_rate={self.negative_rate} must lie in (0, 1]: the fraction of training negatives kept (every "
                f"positive is). Fix: e.g. data.negative_rate=0.1, or data.negative_rate=null to train on every row")
        require(
            self.eval_path is None or self.eval_fraction is None,
            f"data.eval_path and data.eval_fraction={self.eval_fraction} are both set; eval rows come from one of them. "
            f"Fix: data.eval_fraction=null (use eval_path) or data.eval_path=null (hash split)",
        )
        require(self.eval_fraction is None or 0 < self.eval_fraction < 1,
                f"data.eval_fraction must lie strictly between 0 and 1, got {self.eval_fraction}")
        require(not self.negatives.enabled or self.items.path is not None,
                f"data.negatives.num_negatives={self.negatives.num_negatives} samples catalogue items, but data.items.path is null. "
                f"Fix: data.items.path=<items file> data.items.id=<item id column>, or data.negatives.num_negatives=0")
        require(self.items.header is not False or bool(self.items.column_names or getattr(self, "column_names", None)),
                "data.items.header=false reads every line of the items file as an item, but nothing names its columns. Fix: "
                "data.items.column_names=[...] (the names of all its columns, in file order)")


@dataclass(kw_only=True)
class SchemaFields(TabularDataConfig):
    """The fields of a file format that does not fix its columns: its feature schema."""

    schema: str | None = None
    """A schema file (YAML: ``label`` or ``labels``, ``label_threshold``, ``dense``, ``sparse``, and for text the
    reader options ``delimiter``, ``header``, ``column_names``, ``null_values``), e.g. the one a run logs when it
    infers the schema, saved and edited. Its columns replace ``label(s)``/``dense``/``sparse`` (set one or the
    other) and its reader options those of the config."""
    label: str | None = None
    """The binary (0/1) label column; ``null`` (and no ``labels``): the first column named ``label``, ``click``,
    ``clicked``, ``is_click``, ``target`` or ``y`` (any case), else an error naming the columns."""
    label_threshold: float | None = None
    """Make a numeric ``label`` binary: ``1`` where the value is ``>=`` this, else ``0`` (ratings → clicks: ``4``)."""
    labels: Any = None
    """Several labels for a multi-task model: task name → column, e.g. ``{ctr: click, cvr: conversion}``;
    batches carry ``labels [B, T]`` in this order and the model's tasks bind by name. Set ``label`` or
    this (``null``: one label). A mapping (``dict[str, str]``), typed ``Any`` so that
    ``data.labels={ctr: click, cvr: conversion}`` works as a plain override."""
    label_kinds: Any = None
    """Per task of ``labels``: ``binary`` (the default; every value 0 or 1), ``regression`` (any finite
    float, e.g. ``{watch_time: regression}``) or ``multiclass`` (a class index, an integer >= 0), matching the model's
    ``task_kinds``."""
    dense: list[DenseColumn] = field(default_factory=list)
    """Float input columns, e.g. ``[{name: price, transform: log1p}]``."""
    sparse: list[SparseColumn] = field(default_factory=list)
    """Categorical input columns, e.g. ``[{name: item_id, num_embeddings: 100000, encoding: hash}]`` (without
    ``num_embeddings``: sized from the data). With ``dense`` also empty: Parquet files' stored schema (written by
    ``python -m recsys_runner.data convert``), else a schema inferred from the files (``data.infer``)."""
    sequences: Any = None
    """Histories: group name → ``{features: [hist_item_id, hist_category], max_len: 50, truncate: recent, timestamps:
    hist_ts}`` (``truncate``: keep the most ``recent`` or the ``oldest`` ``max_len`` events; ``timestamps``: an optional
    list column of int64 event times, carried in the batch, never embedded). Each feature is a ``data.sparse`` list
    column (in CSV with a ``separator``), oldest event first, of equal length per row within a group; one sharing a
    table with a candidate (``table: item`` on both) shares its id space. A mapping, typed ``Any`` so that it works as a
    plain override. ``null``: no histories (or those of the schema file / stored schema). docs/data.md, *Histories in files*."""

    def __post_init__(self) -> None:
        super().__post_init__()
        labels = mapping_option(self.labels, "data.labels")
        kinds = mapping_option(self.label_kinds, "data.label_kinds")
        if self.label is not None or labels is not None or kinds:  # neither: detected from the files' columns
            check_labels(self.label, labels, kinds)
        check_funnel(self.funnel, labels, kinds)
        require(self.negative_rate is None or ((labels is None or len(labels) == 1) and set((kinds or {}).values()) <= {"binary"}),
                f"data.negative_rate={self.negative_rate} downsamples the negatives of one binary label, but data.labels={labels} "
                f"(data.label_kinds={kinds}): {NEGATIVE_RATE_SCOPE}")
        require(self.label_threshold is None or (labels is None and math.isfinite(self.label_threshold)),
                f"data.label_threshold={self.label_threshold} makes one data.label binary (a finite number); it does not apply to data.labels")
        require(self.schema is None or not (self.dense or self.sparse or self.label is not None or labels is not None
                                            or self.sequences is not None),
                f"data.schema={self.schema!r} and data.label(s)/dense/sparse are both set (or data.sequences); the schema file lists "
                f"the columns. Fix: edit the file, or drop data.schema")
        for group in self.sequence_groups():
            check_group(group, list(self.sparse), [*(d.name for d in self.dense)], id_space=False)
            if self.batch_tokens is not None:
                check_budget(self.batch_tokens, group.max_len)

    def sequence_groups(self) -> list[SequenceGroup]:
        """``data.sequences`` as sequence groups (empty when unset)."""
        return sequence_groups(_plain(self.sequences))

    def supports_batch_tokens(self) -> bool:
        """``data.sequences`` is set, or the columns come from a schema file or the files (checked when the data is built)."""
        return self.sequences is not None or self.schema is not None or not (self.sparse or self.dense)


@dataclass(kw_only=True)
class ParquetDataConfig(SchemaFields):
    """Schema of ``conf/data/parquet.yaml``: Parquet files; list columns are multi-hot features."""

    _target_: str = "recsys_runner.data.files.tabular.ParquetData"

    def for_model(self, needs: DataNeeds) -> ParquetDataConfig:
        """The files as they are (told whether their rows are a next-item model's), refused for a model that scores one
        candidate per row when ``sequences --rows per-user`` wrote them (:func:`~recsys_runner.data.sequences.splits.check_rows_for_model`): checked before anything is built."""
        check_rows_for_model({"data.path": self.path, "data.eval_path": self.eval_path}, needs.next_item)
        config = super().for_model(needs)
        assert isinstance(config, ParquetDataConfig)
        return config


@dataclass(kw_only=True)
class CsvDataConfig(SchemaFields):
    """Schema of ``conf/data/csv.yaml``: delimited text (CSV, TSV), one record per line, plain or compressed (gzip, bz2,
    zstd: each such file read as one stream)."""

    _target_: str = "recsys_runner.data.files.tabular.CsvData"
    delimiter: str | None = ","
    """Field delimiter: ``","`` for CSV, ``"\\t"`` for TSV; ``null``: detected from the first file's first lines (tab,
    comma, semicolon or pipe; logged). On the command line ``data.delimiter=tab`` or ``data.delimiter='\\t'`` (Hydra
    passes the two characters backslash and ``t``, which mean a tab here); a comma as ``data.delimiter=comma``, or
    Hydra's escaped ``'data.delimiter=\\,'`` or quoted ``"data.delimiter=','"`` (a bare ``data.delimiter=,`` is not a
    valid override: Hydra reads the comma as a list separator); ``semicolon``, ``pipe``, ``space`` likewise."""
    header: bool | None = True
    """The first line names the columns; ``false``: give ``column_names``; ``null``: detected (a first line with a
    field that is not a number where the next line has one is a header; logged)."""
    column_names: list[str] | None = None
    """Names of all columns, in file order: for files without a header line, or, with one, names that replace the
    header's (so one config reads ``u.data`` and ``ratings.csv`` alike)."""
    eval_header: bool | None = None
    """Whether the first line of each ``eval_path`` file names the columns, for eval files laid out otherwise than the
    training files (Avazu's ``dev.csv`` has no header where ``train.csv`` has one): ``false`` reads every line as data,
    its columns named by ``column_names``, else by the training files' header, in file order; ``true`` takes the first
    line as a header (``column_names``, when set, replaces its names). ``null``: as ``header``; an eval file whose first
    line says otherwise (data under a header setting, or a header line where the training files have none) is then
    refused at start-up, naming this option."""
    null_values: list[str] = field(default_factory=lambda: [""])
    """Field texts that mean "missing" (e.g. ``["", "NA", "\\\\N"]``)."""
    block_rows: int = 65_536
    """Lines per unit of work (files are indexed once by one newline scan)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.delimiter is not None:
            self.delimiter = text_delimiter(self.delimiter, "data.delimiter=", "'data.delimiter=\\,'", " data.delimiter=null to detect it,")
        require(self.header is not False or bool(self.column_names),
                "data.header=false needs data.column_names: the names of all columns in file order")
        require(self.eval_header is None or self.eval_path is not None,
                f"data.eval_header={str(self.eval_header).lower()} says how data.eval_path's files are laid out, but data.eval_path "
                f"is null (eval rows are held out of data.path, read as it is). Fix: set data.eval_path, or data.eval_header=null")
        require(self.block_rows > 0, f"data.block_rows must be positive, got {self.block_rows}")
        check_text_lists(self.sequence_groups(), list(self.sparse), "data.sparse")

    def missing_texts(self) -> list[str]:
        return list(self.null_values)


NEGATIVE_RATE_SCOPE = ("the correction logit + log(r) is exact for one binary (click) label, where a negative is a row "
                       "labelled 0; several labels, regression and multiclass labels, and retrieval or next-item models (whose "
                       "rows are positives, with negatives sampled instead) have no such negatives. Fix: data.negative_rate=null")
"""Why ``data.negative_rate`` applies to single-task binary classification only (:func:`check_downsampled_model`)."""


def check_downsampled_model(rate: float, needs: DataNeeds) -> None:
    """``data.negative_rate`` needs a model of one binary task over pointwise rows (:data:`NEGATIVE_RATE_SCOPE`).

    Raises:
        ConfigError: the model has several tasks, a non-binary task, or is a retrieval or next-item model.
    """
    what = ("a next-item model" if needs.next_item else "a two-tower (retrieval) model" if needs.user_features
            else f"a model of {len(needs.labels)} tasks {list(needs.labels)}" if len(needs.labels) > 1
            else f"a model whose task is {needs.label_kinds[0]}" if any(k != "binary" for k in needs.label_kinds) else None)
    require(what is None, f"data.negative_rate={rate} downsamples the negatives of one binary label, but this is {what}: "
            f"{NEGATIVE_RATE_SCOPE}")


MULTI_CHARACTER_FIX = ("A separator of several characters, such as MovieLens ml-1m's '::', is one character once rewritten: "
                       "sed 's/::/\\t/g' ratings.dat > ratings.tsv, then a tab (its movies.dat and users.dat are Latin-1 text: "
                       "iconv -f latin1 -t utf-8 movies.dat | sed 's/::/\\t/g' > movies.tsv)")
"""How to read a file whose fields are separated by several characters: the readers (Arrow's CSV parser) take one."""


def text_delimiter(value: str, flag: str, comma: str, detect: str = "") -> str:
    """The delimiter ``value`` names (a character, or a name in :data:`DELIMITER_ESCAPES`), for the setting ``flag``
    (``data.delimiter=`` or ``--delimiter ``; ``comma``: how a comma is written there; ``detect``: the detecting choice, if any).

    Raises:
        ConfigError: ``value`` is not one character, naming the spellings that are and the path for a separator of
            several characters (:data:`MULTI_CHARACTER_FIX`), instead of the parser's own error from deep inside.
    """
    delimiter = DELIMITER_ESCAPES.get(value, value)
    require(len(delimiter) == 1,
            f"{flag.strip().rstrip('=')} must be one character, got {value!r}. Fix: {flag}comma (or {comma}) for CSV, {flag}tab for TSV,"
            f"{detect} or the character. " + (MULTI_CHARACTER_FIX if len(delimiter) > 1 else ""))
    return delimiter


def check_text_lists(groups: list[SequenceGroup], sparse: list[SparseColumn], key: str) -> None:
    """In delimited text a history is one field with a ``separator`` between its events: a history column without one is a
    :class:`ConfigError` naming ``key`` (``data.sparse`` or the schema file) and the fix."""
    separators = {c.name: c.separator for c in sparse}
    for group in groups:
        also = f" (and the same separator in its timestamps column {group.timestamps!r})" if group.timestamps else ""
        for f in group.features:
            require(f not in separators or separators[f] is not None,
                    f"{key}[{f}] is a history (data.sequences.{group.name}) but has no separator: in CSV/TSV a history is one "
                    f"field with its events separated, oldest first, e.g. 12|40|7. Fix: {key}[{f}].separator='|'{also}")


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value


def mapping_option(value: Any, key: str) -> dict[str, str] | None:
    """A ``{name: text}`` option as a dict (``None`` stays ``None``), or a ConfigError naming ``key``."""
    value = _plain(value)
    require(value is None or (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())),
            f"{key}={value!r} must be a mapping of task names to strings, e.g. {key}='{{ctr: click, cvr: conversion}}', or null")
    return None if value is None else {str(k): v for k, v in value.items()}
