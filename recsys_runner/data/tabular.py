"""Streaming data modules over files: ``parquet``, ``csv`` and ``criteo``.

How an epoch is read (see docs/data.md for the full semantics):

1. Files are cut into units with known row counts (Parquet row groups; blocks of CSV lines).
2. With ``shuffle``, the unit order is permuted from ``(seed, epoch)``.
3. The rows of that ordered sequence are split into ``world_size × max(num_workers, 1)`` contiguous
   ranges, one per (rank, worker) shard: disjoint, together every row exactly once, and of equal
   length (the last ``total mod shards`` rows are left out when ``drop_remainder``), so every rank
   gets the same number of batches without talking to the others. Where that cannot be known in
   advance (``on_bad_rows: skip``, or ``drop_remainder: false`` with ranks one batch apart), the
   ranks agree step by step (:func:`recsys_runner.data.base.synchronized`) and stop together.
4. Each shard streams its units, encodes and checks the rows (:class:`Encoder`), passes them through
   a seeded shuffle buffer of ``shuffle_buffer_rows`` and cuts batches of ``batch_size``.

Eval rows come from ``eval_path``, or are a deterministic hash split of the training files: a row is
held out when a hash of (file name, row number) falls below ``eval_fraction``.
"""

from __future__ import annotations

import abc
import json
import logging
import math
import os
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.data.base import DataConfig, DataModule, synchronized
from recsys_runner.data.infer import InferConfig, Inferred, complete_schema
from recsys_runner.data.schema import (
    BAD_ROW_MODES,
    DENSE_TRANSFORMS,
    DenseColumn,
    Encoder,
    Location,
    Rows,
    Schema,
    SparseColumn,
    check_labels,
    read_schema_file,
    schema_yaml,
    splitmix64,
)
from recsys_runner.data.sources import PARQUET_SUFFIXES, CsvSource, ParquetSource, Unit, resolve_files
from recsys_runner.errors import DataError, require

log = logging.getLogger(__name__)

SCHEMA_METADATA_KEY = b"recsys_runner.schema"
"""Parquet key-value metadata written by ``python -m recsys_runner.data convert``: the schema as JSON."""

DEFAULT_EVAL_FRACTION = 0.1
DELIMITER_ESCAPES = {"\\t": "\t", "tab": "\t", "comma": ",", "semicolon": ";", "pipe": "|"}
"""``data.delimiter`` spellings that stand for a character hard to pass through a shell and Hydra (a tab; a comma,
which Hydra's override grammar reads as a list separator: ``data.delimiter=comma``)."""
CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE = 13, 26
CRITEO_COLUMNS = ["label", *(f"int_{i}" for i in range(CRITEO_NUM_DENSE)), *(f"cat_{i}" for i in range(CRITEO_NUM_SPARSE))]


# -- config schemas ---------------------------------------------------------------------------------


@dataclass(kw_only=True)
class TabularDataConfig(DataConfig):
    """Fields shared by every file-backed data option."""

    path: str = ""
    """Training data: a file, a directory (its data files) or a glob such as ``/data/day_*.parquet``."""
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
    """Seed of the unit order and the shuffle buffer (combined with the epoch)."""
    on_bad_rows: str = "fail"
    """``fail``: stop at the first bad row with its file, row and column. ``skip``: skip bad rows,
    count them (``data/bad_rows_skipped``) and log the count."""
    read_rows: int = 65_536
    """Rows per Arrow record batch read from a Parquet row group (memory bound per read)."""
    infer: InferConfig = field(default_factory=InferConfig)
    """How what the config leaves open (no column list, a sparse column without ``num_embeddings``, no label) is
    inferred from a sample of the files; the run logs the result as a schema file (docs/data.md, *Inferred schema*)."""

    def __post_init__(self) -> None:
        require(bool(self.path), "data.path is required: a file, a directory or a glob, e.g. data.path=/data/train/")
        super().__post_init__()
        require(self.shuffle_buffer_rows >= 0, f"data.shuffle_buffer_rows must be >= 0, got {self.shuffle_buffer_rows}")
        require(self.on_bad_rows in BAD_ROW_MODES, f"data.on_bad_rows={self.on_bad_rows!r} must be one of {BAD_ROW_MODES}")
        require(self.read_rows > 0, f"data.read_rows must be positive, got {self.read_rows}")
        require(
            self.eval_path is None or self.eval_fraction is None,
            f"data.eval_path and data.eval_fraction={self.eval_fraction} are both set; eval rows come from one of them. "
            f"Fix: data.eval_fraction=null (use eval_path) or data.eval_path=null (hash split)",
        )
        require(self.eval_fraction is None or 0 < self.eval_fraction < 1,
                f"data.eval_fraction must lie strictly between 0 and 1, got {self.eval_fraction}")


@dataclass(kw_only=True)
class SchemaFields:
    """The feature schema of a file format that does not fix its columns."""

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
    """Per task of ``labels``: ``binary`` (the default; every value 0 or 1) or ``regression`` (any finite
    float, e.g. ``{watch_time: regression}``), matching the model's ``task_kinds``."""
    dense: list[DenseColumn] = field(default_factory=list)
    """Float input columns, e.g. ``[{name: price, transform: log1p}]``."""
    sparse: list[SparseColumn] = field(default_factory=list)
    """Categorical input columns, e.g. ``[{name: item_id, num_embeddings: 100000, encoding: hash}]`` (without
    ``num_embeddings``: sized from the data). With ``dense`` also empty: Parquet files' stored schema (written by
    ``python -m recsys_runner.data convert``), else a schema inferred from the files (``data.infer``)."""

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]  # TabularDataConfig's, next in the MRO of every data option
        labels = _mapping(self.labels, "data.labels")
        kinds = _mapping(self.label_kinds, "data.label_kinds")
        if self.label is not None or labels is not None or kinds:  # neither: detected from the files' columns
            check_labels(self.label, labels, kinds)
        require(self.label_threshold is None or (labels is None and math.isfinite(self.label_threshold)),
                f"data.label_threshold={self.label_threshold} makes one data.label binary (a finite number); it does not apply to data.labels")
        require(self.schema is None or not (self.dense or self.sparse or self.label is not None or labels is not None),
                f"data.schema={self.schema!r} and data.label(s)/dense/sparse are both set; the schema file lists the columns. "
                f"Fix: edit the file, or drop data.schema")


@dataclass(kw_only=True)
class ParquetDataConfig(SchemaFields, TabularDataConfig):
    """Schema of ``conf/data/parquet.yaml``: Parquet files; list columns are multi-hot features."""

    _target_: str = "recsys_runner.data.tabular.ParquetData"


@dataclass(kw_only=True)
class CsvDataConfig(SchemaFields, TabularDataConfig):
    """Schema of ``conf/data/csv.yaml``: delimited text (CSV, TSV), one record per line, uncompressed."""

    _target_: str = "recsys_runner.data.tabular.CsvData"
    delimiter: str = ","
    """Field delimiter: ``","`` for CSV, ``"\\t"`` for TSV. On the command line ``data.delimiter='\\t'`` (Hydra passes
    the two characters backslash and ``t``, which mean a tab here) or ``data.delimiter=tab``; ``data.delimiter=comma``
    (a bare ``,`` is not a valid override), ``semicolon``, ``pipe``."""
    header: bool = True
    """The first line names the columns; ``false``: give ``column_names``."""
    column_names: list[str] | None = None
    """Names of all columns, in file order, for files without a header line."""
    null_values: list[str] = field(default_factory=lambda: [""])
    """Field texts that mean "missing" (e.g. ``["", "NA", "\\\\N"]``)."""
    block_rows: int = 65_536
    """Lines per unit of work (files are indexed once by one newline scan)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.delimiter = DELIMITER_ESCAPES.get(self.delimiter, self.delimiter)
        require(len(self.delimiter) == 1, f"data.delimiter must be one character, got {self.delimiter!r}. Fix: data.delimiter=',' "
                f"for CSV, data.delimiter='\\t' for TSV")
        require(self.header or bool(self.column_names), "data.header=false needs data.column_names: the names of all columns in file order")
        require(self.block_rows > 0, f"data.block_rows must be positive, got {self.block_rows}")


@dataclass(kw_only=True)
class CriteoDataConfig(TabularDataConfig):
    """Schema of ``conf/data/criteo.yaml``: the raw Kaggle/Terabyte Criteo layout.

    Tab-separated, no header: label, 13 integer counts (``int_0…``, may be empty or negative), 26
    categoricals (``cat_0…``) as 8 hex digits (may be empty). Preprocessing: dense missing → 0,
    negatives clamped to 0, ``log1p``; categoricals hex → integer, then modulo (or hashed into)
    the table size; a missing categorical is an empty bag (a zero vector).
    """

    _target_: str = "recsys_runner.data.tabular.CriteoData"
    num_embeddings: int | None = 100_000
    """Table size of every categorical column; ``null``: each column's sized from a sample of the files (its distinct
    values × ``data.infer.bucket_margin``, rounded up; logged), for data whose size you do not know."""
    num_embeddings_per_feature: list[int] | None = None
    """Per-column table sizes (26 entries); overrides ``num_embeddings``."""
    categorical_encoding: str = "mod"
    """``mod``: hex value modulo the table size (TorchRec's Criteo preprocessing); ``hash``: hash the hex string."""
    dense_transform: str = "log1p"
    """``log1p`` (clamp negatives to 0, then log(1+x)) or ``none``."""
    block_rows: int = 65_536
    """Lines per unit of work."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.num_embeddings is None or self.num_embeddings > 0, f"data.num_embeddings must be positive or null, got {self.num_embeddings}")
        if self.num_embeddings_per_feature is not None:
            require(len(self.num_embeddings_per_feature) == CRITEO_NUM_SPARSE,
                    f"data.num_embeddings_per_feature has {len(self.num_embeddings_per_feature)} entries; Criteo has {CRITEO_NUM_SPARSE} categoricals")
            require(all(n > 0 for n in self.num_embeddings_per_feature), "data.num_embeddings_per_feature entries must be positive")
        require(self.categorical_encoding in ("mod", "hash"), f"data.categorical_encoding={self.categorical_encoding!r} must be mod or hash")
        require(self.dense_transform in DENSE_TRANSFORMS, f"data.dense_transform={self.dense_transform!r} must be one of {DENSE_TRANSFORMS}")
        require(self.block_rows > 0, f"data.block_rows must be positive, got {self.block_rows}")


def criteo_columns(num_embeddings: list[int | None], categorical_encoding: str = "mod",
                   dense_transform: str = "log1p") -> tuple[list[DenseColumn], list[SparseColumn]]:
    """The Criteo dense and sparse columns with the usual preprocessing (a ``None`` size: sized from the data)."""
    hexed = categorical_encoding == "mod"
    return ([DenseColumn(name=f"int_{i}", transform=dense_transform) for i in range(CRITEO_NUM_DENSE)],
            [SparseColumn(name=f"cat_{i}", num_embeddings=n, encoding=categorical_encoding, hex=hexed) for i, n in enumerate(num_embeddings)])


def criteo_schema(num_embeddings: list[int], categorical_encoding: str = "mod", dense_transform: str = "log1p") -> Schema:
    """The Criteo columns with the usual preprocessing (see :class:`CriteoDataConfig`)."""
    dense, sparse = criteo_columns(list(num_embeddings), categorical_encoding, dense_transform)
    return Schema(label="label", dense=dense, sparse=sparse)


# -- the data module --------------------------------------------------------------------------------


def eval_mask(path: str, file_rows: np.ndarray, fraction: float) -> np.ndarray:
    """Rows held out for eval: a hash of (file name, row number) below ``fraction`` (stable everywhere)."""
    file_id = np.uint64(zlib.crc32(os.path.basename(path).encode()))
    h = splitmix64(file_rows.astype(np.uint64) ^ (file_id << np.uint64(32)))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) < fraction


@dataclass
class _Split:
    """The units of one split and how many of each unit's rows belong to it."""

    source: Any
    units: list[Unit]
    counts: list[int]
    holdout: tuple[float, bool] | None = None
    """``(fraction, want_eval)`` for a hash split of shared files; ``None``: every row."""

    def select(self, unit: Unit, file_rows: np.ndarray) -> np.ndarray | None:
        if self.holdout is None:
            return None
        fraction, want_eval = self.holdout
        mask = eval_mask(unit.path, file_rows, fraction)
        return np.flatnonzero(mask if want_eval else ~mask)


def shard_ranges(counts: list[int], order: list[int], shard: int, num_shards: int, equal: bool) -> list[tuple[int, int, int]]:
    """``(unit, start, stop)`` row ranges of ``shard``: a contiguous share of the rows in ``order``.

    ``equal``: every shard gets ``total // num_shards`` rows (the rest is left out); otherwise shards
    differ by at most one row and together cover every row.
    """
    total = sum(counts[u] for u in order)
    if equal:
        per = total // num_shards
        lo, hi = shard * per, (shard + 1) * per
    else:
        lo, hi = shard * total // num_shards, (shard + 1) * total // num_shards
    out, offset = [], 0
    for u in order:
        n = counts[u]
        a, b = max(lo - offset, 0), min(hi - offset, n)
        if a < b:
            out.append((u, a, b))
        offset += n
        if offset >= hi:
            break
    return out


class _ShardStream(IterableDataset):
    """One rank's share of a split for one epoch; with DataLoader workers, each worker a sub-share."""

    def __init__(self, data: TabularData, split: _Split, epoch: int, rank: int, world_size: int, train: bool) -> None:
        super().__init__()
        self.data, self.split, self.epoch, self.rank, self.world_size, self.train = data, split, epoch, rank, world_size, train

    def __iter__(self) -> Iterator[tuple]:
        info = get_worker_info()
        workers = info.num_workers if info is not None else 1
        shard = self.rank * workers + (info.id if info is not None else 0)
        try:
            yield from self.data._stream(self.split, self.epoch, shard, self.world_size * workers, self.train)
        except DataError as e:
            if info is None:
                raise
            # Across a worker process boundary DataLoader would wrap the message in a traceback.
            yield ("error", str(e))


class TabularData(DataModule, abc.ABC):
    """Batches from files; see the module docstring. Subclasses choose the source and the schema.

    Example::

        data = make(ParquetDataConfig, path="/data/train", sparse=[{"name": "item", "num_embeddings": 1000}]).build()
        batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
    """

    def __init__(self, config: TabularDataConfig, schema: Schema) -> None:
        config = config.resolved()  # built by DataConfig.build, already; constructed directly, decided here
        assert isinstance(config.num_workers, int)
        self.config = config
        self.schema = schema
        self.features = schema.features()
        self.batch_size = config.batch_size
        self._bad_rows = 0
        self._dropped_rows = 0
        self._passes: dict[tuple[int, int], tuple[int, int]] = {}
        """(epoch, rank) → (rows of the rank's share, bad rows skipped) of the last pass over that epoch's training data."""
        self._workers = config.num_workers
        """DataLoader workers per rank; each (rank, worker) reads its own shard, so the batch order depends on it."""
        self._pin = bool(config.pin_memory)
        train_source = self.open_files(config.path, "data.path")
        train_units = train_source.units()
        if config.eval_path is not None:
            eval_source = self.open_files(config.eval_path, "data.eval_path")
            eval_units = eval_source.units()
            self._train = _Split(train_source, train_units, [u.num_rows for u in train_units])
            self._eval = _Split(eval_source, eval_units, [u.num_rows for u in eval_units])
        else:
            fraction = config.eval_fraction or DEFAULT_EVAL_FRACTION
            held = [int(eval_mask(u.path, np.arange(u.first_row, u.first_row + u.num_rows), fraction).sum()) for u in train_units]
            self._train = _Split(train_source, train_units, [u.num_rows - h for u, h in zip(train_units, held, strict=True)], (fraction, False))
            self._eval = _Split(train_source, train_units, held, (fraction, True))
        if sum(self._eval.counts) == 0:
            raise DataError(f"the eval split of {config.eval_path or config.path} has no rows. Fix: a larger data.eval_fraction, or data.eval_path")

    def open_files(self, path: str, key: str) -> Any:
        """A row source over the files at ``path`` with this data option's own reader and format settings (the
        training data's, or another input such as ``predict.input``); ``key`` names the setting in errors.

        Raises:
            DataError: ``path`` matches no file of this format.
        """
        return self._source(resolve_files(path, key, self._suffixes()))

    # -- subclass hooks ------------------------------------------------------------------------------
    def _suffixes(self) -> tuple[str, ...] | None:
        return None

    @abc.abstractmethod
    def _source(self, files: list[str]) -> Any:
        """The row source over ``files``: ParquetData / CsvData / CriteoData each choose theirs."""

    # -- DataModule ------------------------------------------------------------------------------------
    def train_batches(self, epoch: int, rank: int, world_size: int) -> Iterator[Batch]:
        return self._batches(self._train, epoch, rank, world_size, train=True)

    def eval_batches(self, rank: int, world_size: int) -> Iterator[Batch]:
        return self._batches(self._eval, 0, rank, world_size, train=False)

    def num_train_batches(self, world_size: int) -> int | None:
        if self.config.on_bad_rows == "skip":
            return None  # skipped rows are only known after reading
        return min(self._rank_batch_counts(self._train, world_size, train=True))

    def explain_empty_epoch(self, epoch: int, rank: int) -> str:
        """Why ``epoch`` gave ``rank`` no full training step: its rows read and skipped, and what to do.

        For the runner's :class:`DataError` when a pass over ``train_batches(epoch, rank, …)`` ended before one step.
        """
        read, skipped = self._passes.get((epoch, rank), (0, 0))
        where = f"data.path={self.config.path!r}"
        if skipped:
            return (f"its share of {where} was {read} training rows, and {skipped} of them were bad rows skipped "
                    f"(data.on_bad_rows=skip), leaving {read - skipped}. Fix: correct or remove the bad rows (with "
                    f"data.on_bad_rows=fail the run stops at the first one and names its file, line and column), or add "
                    f"data, or lower data.batch_size")
        return (f"its share of {where} was {read} training rows (each rank and data.num_workers worker reads its own share; "
                f"eval rows are held out). Fix: more data, or a smaller data.batch_size / train.grad_accum_steps")

    def metrics(self) -> dict[str, float]:
        """Counters since construction: bad rows skipped, rows left unread so that ranks end together."""
        return {"data/bad_rows_skipped": float(self._bad_rows), "data/rows_dropped_uneven_ranks": float(self._dropped_rows)}

    # -- internals -------------------------------------------------------------------------------------
    def _shard_rows(self, split: _Split, world_size: int, train: bool) -> list[int]:
        """Rows of each (rank, worker) shard, rank-major."""
        shards = world_size * max(self._workers, 1)
        drop = train and self.config.drop_remainder
        order = list(range(len(split.units)))  # shard sizes do not depend on the order
        return [sum(b - a for _, a, b in shard_ranges(split.counts, order, s, shards, drop)) for s in range(shards)]

    def _rank_batch_counts(self, split: _Split, world_size: int, train: bool) -> list[int]:
        workers = max(self._workers, 1)
        drop = train and self.config.drop_remainder
        per_shard = self._shard_rows(split, world_size, train)
        per_batch = [n // self.batch_size if drop else math.ceil(n / self.batch_size) for n in per_shard]
        return [sum(per_batch[r * workers : (r + 1) * workers]) for r in range(world_size)]

    def _batches(self, split: _Split, epoch: int, rank: int, world_size: int, train: bool) -> Iterator[Batch]:
        stream = _ShardStream(self, split, epoch, rank, world_size, train)
        if self._workers > 0:
            items: Any = DataLoader(stream, batch_size=None, num_workers=self._workers, pin_memory=self._pin,
                                    multiprocessing_context="fork" if os.name == "posix" else None)
        else:
            items = stream
        workers = max(self._workers, 1)
        rows = sum(self._shard_rows(split, world_size, train)[rank * workers : (rank + 1) * workers])
        batches = self._to_batches(items, epoch, rank, train, rows)
        uneven = self.config.on_bad_rows == "skip" or len(set(self._rank_batch_counts(split, world_size, train))) > 1
        if world_size > 1 and uneven:
            return synchronized(batches, on_dropped=self._count_dropped)
        return batches

    def _count_dropped(self, batch: Batch) -> None:
        self._dropped_rows += int(batch.labels.shape[0])

    def _to_batches(self, items: Any, epoch: int, rank: int, train: bool, rows: int) -> Iterator[Batch]:
        names = self.features.sparse_names
        skipped_before = self._bad_rows
        if train:
            self._passes[epoch, rank] = (rows, 0)
        for item in items:
            if item[0] == "error":
                raise DataError(item[1])
            dense, values, lengths, labels, skipped = item
            self._bad_rows += skipped
            if train and skipped:
                self._passes[epoch, rank] = (rows, self._bad_rows - skipped_before)
            if labels is None:
                continue  # a marker carrying only a skipped-rows count
            if self._pin and self._workers == 0:
                dense, values, lengths, labels = dense.pin_memory(), values.pin_memory(), lengths.pin_memory(), labels.pin_memory()
            kjt = KeyedJaggedTensor(keys=names, values=values, lengths=lengths)
            yield Batch(dense_features=dense, sparse_features=kjt, labels=labels)
        if self._bad_rows > skipped_before:
            what = f"epoch {epoch}" if train else "eval"
            log.warning("rank %d skipped %d bad rows in %s (data.on_bad_rows=skip)", rank, self._bad_rows - skipped_before, what)

    def _stream(self, split: _Split, epoch: int, shard: int, num_shards: int, train: bool) -> Iterator[tuple]:
        """Encoded batches of one shard, as tensors: (dense, values, lengths, labels, bad rows skipped)."""
        cfg = self.config
        shuffle = train and cfg.shuffle
        order = list(range(len(split.units)))
        if shuffle:
            order = np.random.default_rng([cfg.seed, epoch]).permutation(len(order)).tolist()
        ranges = shard_ranges(split.counts, order, shard, num_shards, equal=train and cfg.drop_remainder)
        encoder = Encoder(self.schema, cfg.on_bad_rows)
        rng = np.random.default_rng([cfg.seed, epoch, shard]) if shuffle and cfg.shuffle_buffer_rows > 0 else None
        hold = max(cfg.shuffle_buffer_rows, self.batch_size) if rng is not None else self.batch_size
        keep_last = not (train and cfg.drop_remainder)
        source_bad = getattr(split.source, "num_bad_rows", 0)
        reported = 0

        def skipped() -> int:
            nonlocal reported
            total = encoder.num_bad_rows + getattr(split.source, "num_bad_rows", 0) - source_bad
            delta, reported = total - reported, total
            return delta

        buffer: list[Rows] = []
        held = 0

        def shuffled_block() -> tuple[Rows, int]:
            """The buffered rows as one block (shuffled if configured) and how many fill whole batches."""
            block = Rows.concat(buffer)
            if rng is not None:
                block = block.take(rng.permutation(len(block)))
            return block, len(block) // self.batch_size * self.batch_size

        for rows in self._read_ranges(split, ranges, encoder):
            buffer.append(rows)
            held += len(rows)
            if held < hold:
                continue
            block, full = shuffled_block()
            for i in range(0, full, self.batch_size):
                yield self._tensors(block.slice(i, i + self.batch_size), skipped())
            buffer, held = [block.slice(full, len(block))], len(block) - full
        if held:
            block, full = shuffled_block()
            for i in range(0, full, self.batch_size):
                yield self._tensors(block.slice(i, i + self.batch_size), skipped())
            if keep_last and full < len(block):
                yield self._tensors(block.slice(full, len(block)), skipped())
        last = skipped()
        if last:
            yield (None, None, None, None, last)

    def _read_ranges(self, split: _Split, ranges: list[tuple[int, int, int]], encoder: Encoder) -> Iterator[Rows]:
        for u, start, stop in ranges:
            unit = split.units[u]
            seen = 0
            line_offset = split.source.line_offset(unit.path) if isinstance(split.source, CsvSource) else None
            for table, file_rows in split.source.read(unit):
                chosen = split.select(unit, file_rows)
                k = table.num_rows if chosen is None else len(chosen)
                lo, hi = max(start - seen, 0), min(stop - seen, k)
                seen += k
                if lo < hi:
                    if chosen is None:
                        part, rows_of = table.slice(lo, hi - lo), file_rows[lo:hi]
                    else:
                        part, rows_of = table.take(pa.array(chosen[lo:hi])), file_rows[chosen[lo:hi]]
                    yield encoder.encode(part, Location(unit.path, unit.part, rows_of, line_offset))
                if seen >= stop:
                    break

    def _tensors(self, rows: Rows, skipped: int) -> tuple:
        values = np.concatenate([v for v, _ in rows.sparse]) if rows.sparse else np.zeros(0, np.int64)
        lengths = np.concatenate([ln for _, ln in rows.sparse]) if rows.sparse else np.zeros(0, np.int32)
        return (
            torch.from_numpy(np.ascontiguousarray(rows.dense)),
            torch.from_numpy(values.astype(np.int64, copy=False)),
            torch.from_numpy(lengths.astype(np.int32, copy=False)),
            torch.from_numpy(np.ascontiguousarray(rows.labels)),
            skipped,
        )


# -- the options ------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value


def config_schema(config: Any, sample: Any, where: str, column_names: Any = None) -> tuple[Inferred, dict[str, Any]]:
    """The schema a config (or its ``data.schema`` file) describes, with what it leaves open inferred from
    ``sample()`` (:func:`~recsys_runner.data.infer.complete_schema`), and the text-reader options the schema
    file sets (``{}`` without one)."""
    reader: dict[str, Any] = {}
    if config.schema is not None:
        parts, reader = read_schema_file(config.schema)
    else:
        parts = {"label": config.label, "labels": _mapping(config.labels, "data.labels"), "label_threshold": config.label_threshold,
                 "label_kinds": _mapping(config.label_kinds, "data.label_kinds"), "dense": list(config.dense), "sparse": list(config.sparse)}
    return complete_schema(**parts, sample=sample, config=config.infer, where=where, column_names=column_names), reader


def log_inferred(done: Inferred, where: str, reader: dict[str, Any] | None = None) -> None:
    """Log an inferred schema (rank 0) as a schema file the user can save and pass as ``data.schema=<file>``."""
    if not done.inferred or int(os.environ.get("RANK", "0")) != 0:
        return
    text = schema_yaml(done.schema, reader, done.notes)
    log.info("data schema of %s, inferred (%s). To keep or edit it, save the lines below as a file and train with "
             "data.schema=<file>:\n%s", where, "; ".join(done.inferred), text)


def _mapping(value: Any, key: str) -> dict[str, str] | None:
    """A ``{name: text}`` option as a dict (``None`` stays ``None``), or a ConfigError naming ``key``."""
    value = _plain(value)
    require(value is None or (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())),
            f"{key}={value!r} must be a mapping of task names to strings, e.g. {key}='{{ctr: click, cvr: conversion}}', or null")
    return None if value is None else {str(k): v for k, v in value.items()}


def stored_schema(path: str) -> Schema | None:
    """The schema ``convert`` stored in a Parquet file's metadata, if any."""
    meta = pq.read_schema(path).metadata or {}
    if SCHEMA_METADATA_KEY not in meta:
        return None
    raw = json.loads(meta[SCHEMA_METADATA_KEY])
    return Schema(label=raw.get("label"), labels=raw.get("labels"), label_kinds=raw.get("label_kinds"), label_threshold=raw.get("label_threshold"),
                  dense=[DenseColumn(**d) for d in raw["dense"]], sparse=[SparseColumn(**s) for s in raw["sparse"]])


def schema_json(schema: Schema) -> bytes:
    """The schema as stored in Parquet metadata: ``label`` or ``labels`` (task → column, in order) and
    ``label_kinds``, ``dense``, ``sparse``."""
    return json.dumps({"label": schema.label, "labels": schema.labels, "label_kinds": schema.label_kinds, "label_threshold": schema.label_threshold,
                       "dense": [asdict(d) for d in schema.dense], "sparse": [asdict(s) for s in schema.sparse]}).encode()


class ParquetData(TabularData):
    """``data=parquet``: Parquet files (see :class:`ParquetDataConfig`).

    The schema: ``data.schema`` or the config's columns; without either, the one ``convert`` stored in the
    files; without that, one inferred from the files (:mod:`recsys_runner.data.infer`, logged).
    """

    def __init__(self, config: ParquetDataConfig) -> None:
        files = resolve_files(config.path, "data.path", PARQUET_SUFFIXES)
        ParquetSource([files[0]], [], config.read_rows)._open(files[0])
        stored = None if (config.schema or config.sparse or config.dense) else stored_schema(files[0])
        if stored is not None:
            schema = stored
        else:
            done, _ = config_schema(config, lambda: ParquetSource(files, [], config.read_rows).sample(config.infer.sample_rows),
                                    f"data.path={config.path!r}", lambda: pq.read_schema(files[0]).names)
            log_inferred(done, f"data.path={config.path!r}")
            schema = done.schema
        super().__init__(config, schema)

    def _suffixes(self) -> tuple[str, ...] | None:
        return PARQUET_SUFFIXES

    def _source(self, files: list[str]) -> ParquetSource:
        return ParquetSource(files, self.schema.columns, self.config.read_rows)


class CsvData(TabularData):
    """``data=csv``: delimited text files (see :class:`CsvDataConfig`); the schema from ``data.schema``, the config's
    columns, or inferred from the files (:mod:`recsys_runner.data.infer`, logged)."""

    def __init__(self, config: CsvDataConfig) -> None:
        where = f"data.path={config.path!r}"
        done, reader = config_schema(config, lambda: self._sampler(config).sample(config.infer.sample_rows), where,
                                     lambda: self._sampler(config).header_names())
        if reader:  # the schema file says how its files are read
            config = replace(config, **reader)
        self.csv = config
        """:attr:`config`, typed as this option's (its reader settings; set first: the base class opens the files)."""
        log_inferred(done, where, {"delimiter": config.delimiter, "header": config.header, "null_values": list(config.null_values),
                                   **({} if config.header else {"column_names": list(config.column_names or [])})})
        super().__init__(config, done.schema)

    @staticmethod
    def _sampler(c: CsvDataConfig) -> CsvSource:
        return CsvSource(resolve_files(c.path, "data.path", None), [], delimiter=c.delimiter, header=c.header,
                         column_names=c.column_names, null_values=c.null_values, block_rows=c.block_rows, on_bad_rows=c.on_bad_rows)

    def _source(self, files: list[str]) -> CsvSource:
        c = self.csv
        return CsvSource(files, self.schema.columns, delimiter=c.delimiter, header=c.header, column_names=c.column_names,
                         null_values=c.null_values, block_rows=c.block_rows, on_bad_rows=c.on_bad_rows)


class CriteoData(TabularData):
    """``data=criteo``: raw Criteo TSV files (see :class:`CriteoDataConfig`); with ``data.num_embeddings=null`` each
    table is sized from a sample of the files (logged)."""

    def __init__(self, config: CriteoDataConfig) -> None:
        self.criteo = config
        """:attr:`config`, typed as this option's (its reader settings; set first: the base class opens the files)."""
        sizes: list[int | None] = [*config.num_embeddings_per_feature] if config.num_embeddings_per_feature else [config.num_embeddings] * CRITEO_NUM_SPARSE
        dense, sparse = criteo_columns(sizes, config.categorical_encoding, config.dense_transform)
        where = f"data.path={config.path!r}"
        done = complete_schema(label="label", labels=None, label_kinds=None, label_threshold=None, dense=dense, sparse=sparse,
                               sample=lambda: self.open_files(config.path, "data.path").sample(config.infer.sample_rows),
                               config=config.infer, where=where)
        log_inferred(done, where)
        super().__init__(config, done.schema)

    def _source(self, files: list[str]) -> CsvSource:
        c = self.criteo
        return CsvSource(files, self.schema.columns if hasattr(self, "schema") else [], delimiter="\t", header=False,
                         column_names=CRITEO_COLUMNS, null_values=[""], block_rows=c.block_rows, on_bad_rows=c.on_bad_rows)
