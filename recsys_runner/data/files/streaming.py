"""How an epoch of files becomes batches: :class:`TabularData`, the base of the file data options (:mod:`recsys_runner.data.files.tabular`).

How an epoch is read (see docs/data.md for the full semantics):

1. Files are cut into units with known row counts (Parquet row groups; blocks of CSV lines; a compressed text file
   whole, read as one stream).
2. With ``shuffle``, the unit order is permuted from ``(seed, epoch)``.
3. The rows of that ordered sequence are split into ``world_size × max(num_workers, 1)`` contiguous
   ranges, one per (rank, worker) shard: disjoint, together every row exactly once, and of equal
   length (the last ``total mod shards`` rows are left out when ``drop_remainder``), so every rank
   gets the same number of batches without talking to the others. Where that cannot be known in
   advance (``on_bad_rows: skip``, ``negative_rate``, or ``drop_remainder: false`` with ranks one batch apart), the
   ranks agree step by step (:func:`recsys_runner.data.base.synchronized`) and stop together. Eval shards keep every
   row, whatever their batch counts: the evaluator steps a rank that is done with a stand-in batch
   (:func:`recsys_runner.data.base.in_step`). The split and the shards are :mod:`recsys_runner.data.files.splits`'.
4. Each shard streams its units, encodes and checks the rows (:class:`~recsys_runner.data.encoding.rows.Encoder`), passes them through
   a seeded shuffle buffer of ``shuffle_buffer_rows`` and cuts batches of ``batch_size`` (training batches with
   ``batch_tokens``: as many rows as fit that many history tokens, :mod:`recsys_runner.data.sequences.histories`; the batch
   count is then known only by reading, and the ranks agree step by step): in its DataLoader worker, by
   :mod:`recsys_runner.data.files.shard_stream`; this module turns what the workers send into batches and counts.

Eval rows come from ``eval_path``, or are a deterministic hash split of the training files: a row is
held out when a hash of (file name, row number) falls below ``eval_fraction``.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import logging
import math
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
from torchrec.datasets.utils import Batch

from recsys_runner.data.base import DataModule, SplitFiles, batch_kjt, synchronized
from recsys_runner.data.catalogue.item_files import Catalogue, item_columns
from recsys_runner.data.encoding.stored import StoredEncoders, check_inputs, column_kinds, column_types, oov_counters, to_json
from recsys_runner.data.files.item_parts import items_text, read_item_parts
from recsys_runner.data.files.parquet_source import ParquetSource
from recsys_runner.data.files.shard_stream import ShardReader, ShardStream
from recsys_runner.data.files.splits import Split, eval_mask, shard_ranges, split_key
from recsys_runner.data.files.tabular_config import DEFAULT_EVAL_FRACTION, TabularDataConfig
from recsys_runner.data.funnel import check_funnel
from recsys_runner.data.locate import resolve_files
from recsys_runner.data.packed import unpacked_stream
from recsys_runner.data.schema import Schema
from recsys_runner.data.sequences.histories import expected_rows
from recsys_runner.data.sequences.mapping import mapping_folder
from recsys_runner.data.sequences.tokens import check_budget
from recsys_runner.data.workers import worker_loader
from recsys_runner.errors import ConfigError, DataError, require

log = logging.getLogger(__name__)


class TabularData(Catalogue, DataModule, abc.ABC):
    """Batches from files; see the module docstring. Subclasses choose the source and the schema.

    Example::

        data = make(ParquetDataConfig, path="/data/train", sparse=[{"name": "item", "num_embeddings": 1000}]).build()
        batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
    """

    sampled_columns: tuple[str, ...] = ()
    """The columns of the files (a sample's) when built with a checkpoint's encoders, else none: a fine-tune names those
    its stored schema does not read (:func:`recsys_runner.data_build.say_unread_columns`)."""

    def __init__(self, config: TabularDataConfig, schema: Schema, encoders: StoredEncoders | None = None) -> None:
        config = config.resolved()  # built by DataConfig.build, already; constructed directly, decided here
        assert isinstance(config.num_workers, int)
        self.config = config
        self.schema = schema
        self.trained = encoders
        """The checkpoint's encoders this data was built with (evaluate, predict, a resume), else ``None`` (fitted now)."""
        self.features = schema.features()
        check_funnel(config.funnel, dict(zip(schema.label_tasks, schema.label_columns, strict=True)), schema.label_kinds)
        self.batch_size = config.batch_size
        self._bad_rows = 0
        self._truncated_rows = 0
        self._capped: dict[str, list[int]] = {c.name: [0, 0] for c in schema.sparse if c.max_values is not None}
        """Per column with ``max_values``, since construction: rows whose list was cut, and the longest list seen."""
        self._oov: dict[str, list[int]] = {c.name: [0, 0] for c in schema.sparse if c.encoding == "vocab"}
        """Per ``encoding: vocab`` column, since construction: values that read an OOV row, and values."""
        self._dropped_rows = 0
        self._downsampled = 0
        """Training negatives left out by ``data.negative_rate`` since construction (``data/negatives_downsampled``)."""
        self._said: set[str] = set()
        """The once-only warnings already given (``truncated_histories``, ``truncated_lists/<column>``). Kept apart from
        the counters they once read, which :meth:`counters_kept` puts back after the sanity eval: a warning its rows
        gave is not given again when the training or the eval meets the same thing."""
        self._eval_passes: dict[int, tuple[int, int]] = {}
        """rank → (rows of the rank's share, bad rows skipped) of its last full pass over the eval data (:meth:`explain_empty_eval`)."""
        self._passes: dict[tuple[int, int], tuple[int, int]] = {}
        """(epoch, rank) → (rows of the rank's share, bad rows skipped) of the last pass over that epoch's training data."""
        self._workers = config.num_workers
        """DataLoader workers per rank; each (rank, worker) reads its own shard, so the batch order depends on it."""
        self._pin = bool(config.pin_memory)
        train_source = self.open_files(config.path, "data.path")
        self._held_out: str | None = None
        """The eval rows in words where the option splits its files itself (:meth:`_own_split`), for messages."""
        if (own := self._own_split(train_source)) is not None:
            self._train, self._eval, self._held_out = own
            train_source = self._train.source
        elif config.eval_path is not None:
            train_files, train_units = list(train_source.files), train_source.units()  # the files before units() drops empty ones
            eval_files = resolve_files(config.eval_path, "data.eval_path", self._suffixes())
            eval_source = self._eval_source(eval_files, train_source)
            eval_units = eval_source.units(say_skipped=eval_files != train_files)  # the same folder's skip is said once
            if isinstance(eval_source, ParquetSource) and isinstance(train_source, ParquetSource):
                eval_source.check_types(train_source)
            self.check_trained(eval_source, f"data.eval_path={config.eval_path!r}")
            self._train = Split(train_source, train_units, [u.num_rows for u in train_units])
            self._eval = Split(eval_source, eval_units, [u.num_rows for u in eval_units])
        else:
            train_units = train_source.units()
            fraction = config.eval_fraction or DEFAULT_EVAL_FRACTION
            held = [int(eval_mask(u.path, np.arange(u.first_row, u.first_row + u.num_rows), fraction).sum()) for u in train_units]
            self._train = Split(train_source, train_units, [u.num_rows - h for u, h in zip(train_units, held, strict=True)], (fraction, False))
            self._eval = Split(train_source, train_units, held, (fraction, True))
        if sum(self._eval.counts) == 0:
            fix = "a last day with rows, or data.last_day=train" if self._held_out else "a larger data.eval_fraction, or data.eval_path=<eval files>"
            raise DataError(f"{self._eval_files()} has no rows (of {sum(self._train.counts)} training rows): the eval would have none. "
                            f"Fix: {fix}")
        if config.batch_tokens is not None:
            if not schema.sequences:
                raise ConfigError(f"data.batch_tokens={config.batch_tokens} sizes batches by history tokens, but the schema of "
                                  f"data.path={config.path!r} has no histories. Fix: data.batch_tokens=null, or data.sequences")
            for group in schema.sequences:
                check_budget(config.batch_tokens, group.max_len)
            self.batch_size = expected_rows(train_source.sample(1000), schema, config.batch_tokens)
        check_catalogue_inputs(config, schema)
        parts = None if config.items.path is None else \
            read_item_parts(config.items.path, item_columns(config.items, schema), items_text(config))
        self._item_files = None if parts is None else SplitFiles(parts.path, parts.files, parts.table.num_rows)
        """The catalogue's files (``data.items.path``), for the run's dataset inputs (:meth:`split_files`)."""
        mapping = mapping_folder(train_source.files[0]) if parts is not None and isinstance(train_source, ParquetSource) else None
        self.open_catalogue(train_source, parts, mapping)  # data.items and data.negatives (item_files.py), checked before the first step

    def open_files(self, path: str, key: str, what: str | None = None) -> Any:
        """A row source over the files at ``path`` with this data option's own reader and format settings (the
        training data's, or another input such as ``predict.input``); ``key`` names the setting in errors. ``what``
        (``input file``): the files are read with the training files' columns, so one lacking a column the first
        training file holds is named as their mistake, with ``key`` as the fix (:func:`~.sources.lacks_training_column`),
        not as the config's column names (which are the training files').

        Raises:
            DataError: ``path`` matches no file of this format.
        """
        source = self._source(resolve_files(path, key, self._suffixes()))
        if what is not None:
            source.follow_training(self._train.source.files[0], self._train.source, key, what)
        return source

    def check_trained(self, source: Any, where: str, optional: Collection[str] = ()) -> None:
        """Refuse files other than ``data.path`` (``data.eval_path``, ``predict.input``: ``where``) that the checkpoint's
        stored encoders would read otherwise than the training files (:func:`~recsys_runner.data.encoding.stored.check_inputs`;
        ``data.path`` is checked when the schema is read from them); ``optional``: columns they may lack (labels, in files to
        score). Nothing to check for encoders fitted now.

        Raises:
            DataError: a column the model was trained on is missing, or holds another kind or type of values.
        """
        if self.trained is not None:  # nor the stored labels the config renamed (tabular.checkpoint_schema)
            renamed = [c for c in self.trained.schema.label_columns if c not in self.schema.label_columns]
            check_inputs(self.trained, source.sample(KIND_SAMPLE_ROWS), where, [*optional, *renamed])

    # -- subclass hooks ------------------------------------------------------------------------------
    def _suffixes(self) -> tuple[str, ...] | None:
        return None

    @abc.abstractmethod
    def _source(self, files: list[str]) -> Any:
        """The row source over ``files``: ParquetData / CsvData / CriteoData each choose theirs."""

    def _own_split(self, train_source: Any) -> tuple[Split, Split, str] | None:
        """The training and eval splits where the option splits its files itself (``data=criteo_npy data.last_day=holdout``),
        with the eval rows in words; ``None``: ``eval_path``, else the hash split of ``eval_fraction``."""
        return None

    def _eval_source(self, files: list[str], train: Any) -> Any:
        """The row source over the ``eval_path`` files (``train``: the training files' source, indexed): read as those."""
        return self._source(files)

    # -- DataModule ------------------------------------------------------------------------------------
    def train_batches(self, epoch: int, rank: int, world_size: int) -> Iterator[Batch]:
        return self._batches(self._train, epoch, rank, world_size, train=True)

    def eval_batches(self, rank: int, world_size: int) -> Iterator[Batch]:
        return self._batches(self._eval, 0, rank, world_size, train=False)

    def num_train_batches(self, world_size: int) -> int | None:
        if self.config.on_bad_rows == "skip" or self.config.batch_tokens is not None or self.config.drops_negatives:
            return None  # skipped rows, rows per token batch and negatives kept are only known after reading
        return min(self._rank_batch_counts(self._train, world_size, train=True))

    def shards_per_rank(self) -> int:
        """One shard per DataLoader worker (:func:`shard_ranges`): another ``data.num_workers`` orders an epoch otherwise."""
        return max(self._workers, 1)

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

    def check_eval_rows(self) -> None:
        """With ``on_bad_rows: skip``, read the eval rows in file order up to the first good one (a unit's read, as a rule):
        eval data whose every row is bad would log every eval metric NaN after the training.

        Raises:
            DataError: every eval row is a bad row, naming the eval files, their rows and the fix.
        """
        if self.config.on_bad_rows != "skip":
            return  # the first bad row stops the run; a split without rows was refused when it was opened
        if not ShardReader(self.config, self.schema, self.batch_size, self.required_candidates()).has_a_row(self._eval):
            rows = sum(self._eval.counts)
            raise DataError(f"the eval data has no row to evaluate (its metrics would all be NaN): {self._eval_files()} holds "
                            f"{rows} eval rows, and all {rows} are bad rows, which data.on_bad_rows=skip skips. {BAD_EVAL_FIX}")

    def explain_empty_eval(self, rank: int) -> str:
        """The eval files (``data.eval_path``'s, or the rows held out of ``data.path``), their rows, the share ``rank`` read and
        skipped as bad rows in its last eval pass, and the fix."""
        read, skipped = self._eval_passes.get(rank, (0, 0))
        said = f"{self._eval_files()} holds {sum(self._eval.counts)} eval rows; rank {rank} read {read} and skipped {skipped} as bad rows"
        if skipped:
            return f"{said} (data.on_bad_rows=skip). {BAD_EVAL_FIX}"
        return f"{said}. Fix: point data.eval_path at files with rows (or a larger data.eval_fraction)"

    def _eval_files(self) -> str:
        """The eval rows' setting and files (at most three named), for messages."""
        config, files = self.config, list(self._eval.source.files)
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        if self._held_out is not None:
            return self._held_out
        if config.eval_path is not None:
            return f"data.eval_path={config.eval_path!r} ({shown})"
        return f"the share of data.path={config.path!r} ({shown}) held out by data.eval_fraction={config.eval_fraction or DEFAULT_EVAL_FRACTION}"

    def metrics(self) -> dict[str, float]:
        """Counters since construction: bad rows skipped, rows left unread so that ranks end together, histories truncated,
        multi-hot lists cut to their ``max_values``, training negatives left out by ``data.negative_rate``."""
        return {"data/bad_rows_skipped": float(self._bad_rows), "data/rows_dropped_uneven_ranks": float(self._dropped_rows),
                **({"data/negatives_downsampled": float(self._downsampled)} if self.config.negative_rate is not None else {}),
                "data/truncated_histories": float(self._truncated_rows),
                **({"data/truncated_lists": float(sum(n for n, _ in self._capped.values()))} if self._capped else {})} | oov_counters(self._oov)

    @contextlib.contextmanager
    def counters_kept(self) -> Iterator[None]:
        """Within the block, reads leave :meth:`metrics`'s counters and the eval pass's account (:meth:`explain_empty_eval`)
        as they were (:meth:`DataModule.counters_kept`)."""
        saved = copy.deepcopy((self._bad_rows, self._truncated_rows, self._capped, self._oov, self._dropped_rows, self._eval_passes,
                               self._downsampled))
        try:
            yield
        finally:
            (self._bad_rows, self._truncated_rows, self._capped, self._oov, self._dropped_rows, self._eval_passes,
             self._downsampled) = saved

    def encoders_document(self) -> bytes:
        """The schema these files are encoded by (vocabularies included) and the kind of each of their columns, stored
        with every checkpoint (:mod:`recsys_runner.data.encoding.stored`)."""
        sample = self.open_files(self.config.path, "data.path").sample(KIND_SAMPLE_ROWS)
        return to_json(self.schema, column_kinds(self.schema, sample), column_types(self.schema, sample))

    def split_files(self) -> dict[str, SplitFiles]:
        """The training and eval files with each split's rows (a hash split's eval rows are a share of the training files),
        and the item catalogue's files (``items``, with ``data.items.path``): its digest too tells a checkpoint's
        catalogue from a changed one."""
        config = self.config
        train = SplitFiles(config.path, tuple(self._train.source.files), sum(self._train.counts))
        items = {} if self._item_files is None else {"items": self._item_files}
        if config.eval_path is not None or self._held_out is not None:
            return {"train": train, "eval": SplitFiles(config.eval_path or config.path, tuple(self._eval.source.files), sum(self._eval.counts)), **items}
        return {"train": train, "eval": SplitFiles(config.path, train.files, sum(self._eval.counts),
                                                   holdout=config.eval_fraction or DEFAULT_EVAL_FRACTION,
                                                   split_keys=tuple(split_key(f) for f in train.files)), **items}

    def raw_rows(self, rows: int) -> pa.Table:
        return self.open_files(self.config.path, "data.path").sample(rows)

    # -- internals -------------------------------------------------------------------------------------
    def _shard_rows(self, split: Split, world_size: int, train: bool) -> list[int]:
        """Rows of each (rank, worker) shard, rank-major."""
        shards = world_size * max(self._workers, 1)
        drop = train and self.config.drop_remainder
        order = list(range(len(split.units)))  # shard sizes do not depend on the order
        return [sum(b - a for _, a, b in shard_ranges(split.counts, order, s, shards, drop)) for s in range(shards)]

    def _rank_batch_counts(self, split: Split, world_size: int, train: bool) -> list[int]:
        workers = max(self._workers, 1)
        drop = train and self.config.drop_remainder
        per_shard = self._shard_rows(split, world_size, train)
        per_batch = [n // self.batch_size if drop else math.ceil(n / self.batch_size) for n in per_shard]
        return [sum(per_batch[r * workers : (r + 1) * workers]) for r in range(world_size)]

    def required_candidates(self) -> dict[str, str]:
        """The columns every training and eval row must have a value in, each with why (the
        :class:`~recsys_runner.data.encoding.rows.Encoder`'s ``required``): with ``next_item``, the candidate of each
        history's first feature (its item), the item that came next. None otherwise."""
        if not self.config.next_item:
            return {}
        candidates = {g.features[0]: self.features.candidate_of(g.features[0]) for g in self.schema.sequences}
        return {candidate: (f"a next-item model trains toward and is judged against each row's {candidate!r}, the item that came "
                            f"after its history {history!r} (predict's top-k alone may leave it null)")
                for history, candidate in candidates.items() if candidate is not None}

    def _batches(self, split: Split, epoch: int, rank: int, world_size: int, train: bool) -> Iterator[Batch]:
        reader = ShardReader(self.config, self.schema, self.batch_size, self.required_candidates())
        stream = ShardStream(reader, self._negative_sampler, split, epoch, rank, world_size, train)
        if self._workers > 0:
            items: Any = unpacked_stream(worker_loader(stream, num_workers=self._workers, pin_memory=self._pin,
                                                       method=self.config.worker_start))
        else:
            items = stream
        workers = max(self._workers, 1)
        rows = sum(self._shard_rows(split, world_size, train)[rank * workers : (rank + 1) * workers])
        batches = self._to_batches(items, epoch, rank, train, rows)
        if not train:  # every eval row once: the evaluator keeps ranks with fewer batches in step (data.base.in_step)
            return batches
        uneven = (self.config.on_bad_rows == "skip" or self.config.batch_tokens is not None or self.config.drops_negatives
                  or len(set(self._rank_batch_counts(split, world_size, train))) > 1)
        if world_size > 1 and uneven:
            return synchronized(batches, on_dropped=self._count_dropped)
        return batches

    def _count_capped(self, capped: dict[str, tuple[int, int]], train: bool) -> None:
        """Add a batch's lists cut to ``max_values``; warn once per column (:meth:`_first`), at its first cut, with the
        longest list so far and the files it came from (:meth:`_read_from`)."""
        for name, (cut, longest) in capped.items():
            counts = self._capped[name]
            if cut and self._first(f"truncated_lists/{name}"):
                cap = next(c.max_values for c in self.schema.sparse if c.name == name)
                log.warning("%s: lists of data.sparse[%s] longer than max_values=%d were cut to their first %d values (the longest "
                            "so far: %d); the count of such rows is logged as data/truncated_lists", self._read_from(train), name,
                            cap, cap, longest)
            counts[0] += cut
            counts[1] = max(counts[1], longest)

    def _read_from(self, train: bool) -> str:
        """The files a batch was read from, as a warning names them: the eval files when the eval reads its own
        (``data.eval_path``), else ``data.path`` (the training files, or the rows the eval holds out of them)."""
        if not train and self.config.eval_path is not None:
            return f"data.eval_path={self.config.eval_path}"
        return str(self.config.path)

    def _first(self, warning: str) -> bool:
        """Whether ``warning`` is given now for the first time (it is then noted as given)."""
        first = warning not in self._said
        self._said.add(warning)
        return first

    def _count_dropped(self, batch: Batch) -> None:
        self._dropped_rows += int(batch.labels.shape[0])

    def _to_batches(self, items: Any, epoch: int, rank: int, train: bool, rows: int) -> Iterator[Batch]:
        names = self.features.kjt_keys
        skipped_before = self._bad_rows
        if train:
            self._passes[epoch, rank] = (rows, 0)
        for item in items:
            if item[0] == "error":
                raise DataError(item[1])
            dense, values, lengths, labels, skipped, truncated, oov, capped, weights, downsampled = item
            self._downsampled += downsampled
            self._count_capped(capped, train)
            self._bad_rows += skipped
            for name, (unseen, total) in oov.items():
                self._oov[name][0] += unseen
                self._oov[name][1] += total
            if truncated and self._first("truncated_histories"):
                log.warning("%s: histories longer than max_len were truncated (data.sequences %s); the count of such rows is "
                            "logged as data/truncated_histories", self._read_from(train),
                            ", ".join(f"{g.name}: max_len={g.max_len}, truncate={g.truncate}" for g in self.schema.sequences))
            self._truncated_rows += truncated
            if train and skipped:
                self._passes[epoch, rank] = (rows, self._bad_rows - skipped_before)
            if labels is None:
                continue  # a marker carrying only a skipped-rows count
            if self._pin and self._workers == 0:
                dense, values, lengths, labels = dense.pin_memory(), values.pin_memory(), lengths.pin_memory(), labels.pin_memory()
                weights = weights.pin_memory() if weights is not None else None
            kjt = batch_kjt(names, values, lengths, weights)
            yield Batch(dense_features=dense, sparse_features=kjt, labels=labels)
        if not train:
            self._eval_passes[rank] = (rows, self._bad_rows - skipped_before)
        if self._bad_rows > skipped_before:
            what = f"epoch {epoch}" if train else "eval"
            log.warning("rank %d skipped %d bad rows in %s (data.on_bad_rows=skip)", rank, self._bad_rows - skipped_before, what)


BAD_EVAL_FIX = ("Fix: correct or remove the bad rows (with data.on_bad_rows=fail the run stops at the first one and names its file, "
                "row and column), or point data.eval_path at files with good rows")
"""The fix for eval data whose every row is a bad row (:meth:`TabularData.check_eval_rows`, :meth:`TabularData.explain_empty_eval`)."""

KIND_SAMPLE_ROWS = 1000
"""Rows read to tell each column's kind (text, number, list) when encoders are stored or checked."""


def check_catalogue_inputs(config: TabularDataConfig, schema: Schema) -> None:
    """An item table (``data.items``) reads plain columns: no weighted feature (its catalogue rows and sampled negatives
    carry no weights), and no cross among the item features (the item file need not hold the crossed columns).

    Raises:
        ConfigError: naming the features and the fix.
    """
    items = config.items
    if items.path is None:
        return
    weighted = [c.name for c in schema.sparse if c.is_weighted]
    require(not weighted, f"data.sparse {weighted} are weighted, but data.items.path={items.path!r} builds an item table whose rows "
            f"(and sampled negatives) carry no weights. Fix: drop weighted / weights from those entries, or data.items.path=null")
    crossed = [c.name for c in schema.sparse if c.cross is not None and c.name in {items.id, *items.features}]
    require(not crossed, f"data.items lists the crosses {crossed}, whose crossed columns the item file need not hold. Fix: list "
            f"plain columns in data.items.id / data.items.features")

