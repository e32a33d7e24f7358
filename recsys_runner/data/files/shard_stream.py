"""One (rank, worker) shard of an epoch read into batches — what runs in a DataLoader worker: the shard's units read
ahead, their rows encoded and checked (:class:`~recsys_runner.data.encoding.rows.Encoder`), passed through a seeded
shuffle buffer and cut into batches of ``batch_size`` rows (or of ``batch_tokens`` history tokens), each handed on as
tensors with the counts since the batch before (bad rows skipped, histories truncated, OOV values, lists cut, negatives
left out by ``data.negative_rate``: :mod:`~recsys_runner.data.files.downsample`).

Apart from the data module (:class:`~recsys_runner.data.files.streaming.TabularData`), which decides the splits and
turns these tuples into batches in the training process and keeps the counters: a worker process gets only this
reader, the split and its shard, and sends plain tuples back, each batch's tensors packed into one buffer
(:mod:`recsys_runner.data.packed`; a :class:`DataError` as an ``("error", message)`` item, which the data module raises again).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset, get_worker_info

from recsys_runner.data.catalogue.negatives import NegativeSampler
from recsys_runner.data.encoding.encoded_rows import Rows
from recsys_runner.data.encoding.rows import Encoder, Location
from recsys_runner.data.files.csv_source import CsvSource
from recsys_runner.data.files.downsample import kept_rows
from recsys_runner.data.files.npy_source import NpySource
from recsys_runner.data.files.prefetch import read_ahead
from recsys_runner.data.files.splits import Split, shard_ranges
from recsys_runner.data.files.tabular_config import TabularDataConfig
from recsys_runner.data.funnel import FUNNEL_WHY
from recsys_runner.data.packed import Packed, packed_stream
from recsys_runner.data.schema import Schema
from recsys_runner.data.sequences.histories import history_costs, token_cuts
from recsys_runner.errors import DataError


@dataclass(frozen=True)
class ShardReader:
    """Reads one shard of a split into batches as tensors (module docstring), by the data config, the schema and the
    rows of a batch."""

    config: TabularDataConfig
    schema: Schema
    batch_size: int
    required: dict[str, str] = field(default_factory=dict)
    """Columns every row must have a value in, with why (:meth:`~recsys_runner.data.files.streaming.TabularData.required_candidates`)."""

    def batches(self, split: Split, epoch: int, shard: int, num_shards: int, train: bool) -> Iterator[tuple]:
        """Encoded batches of one shard, as tensors: (dense, values, lengths, labels, bad rows skipped, histories truncated,
        each vocabulary's OOV values and values, each ``max_values`` column's rows cut and longest list, the weights of the
        values when a feature is weighted, negatives left out by ``data.negative_rate``: training rows only)."""
        cfg = self.config
        shuffle = train and cfg.shuffle
        order = list(range(len(split.units)))
        if shuffle:
            order = np.random.default_rng([cfg.seed, epoch]).permutation(len(order)).tolist()
        ranges = shard_ranges(split.counts, order, shard, num_shards, equal=train and cfg.drop_remainder)
        encoder = self.encoder(cfg.on_bad_rows)
        rng = np.random.default_rng([cfg.seed, epoch, shard]) if shuffle and cfg.shuffle_buffer_rows > 0 else None
        hold = max(cfg.shuffle_buffer_rows, self.batch_size) if rng is not None else self.batch_size
        keep_last = not (train and cfg.drop_remainder)
        budget = cfg.batch_tokens if train else None
        batch_order = np.random.default_rng([cfg.seed, epoch, shard, 1])  # grouped token batches: the order they go in
        source_bad = getattr(split.source, "num_bad_rows", 0)
        reported = [0, 0]
        reported_oov = {name: [0, 0] for name in encoder.oov}
        reported_cuts = dict.fromkeys(encoder.capped, 0)
        sampling = _Sampling(cfg.seed, cfg.negative_rate) if train and cfg.negative_rate is not None and cfg.drops_negatives else None

        def counts() -> tuple[int, int, dict[str, tuple[int, int]], dict[str, tuple[int, int]], int]:
            """Bad rows skipped, histories truncated, each vocabulary's (OOV values, values), each capped list's (rows cut,
            longest list so far) and the negatives downsampled away since the last call."""
            totals = [encoder.num_bad_rows + getattr(split.source, "num_bad_rows", 0) - source_bad, encoder.num_truncated_rows]
            deltas = (totals[0] - reported[0], totals[1] - reported[1])
            reported[:] = totals
            oov = {name: (now[0] - reported_oov[name][0], now[1] - reported_oov[name][1]) for name, now in encoder.oov.items()}
            reported_oov.update({name: list(now) for name, now in encoder.oov.items()})
            cuts = {name: (cut - reported_cuts[name], longest) for name, (cut, longest) in encoder.capped.items()}
            reported_cuts.update({name: cut for name, (cut, _) in encoder.capped.items()})
            return *deltas, oov, cuts, sampling.take_dropped() if sampling is not None else 0

        buffer: list[Rows] = []
        held = 0

        def cut(final: bool) -> Iterator[tuple]:
            """Batches of the buffered rows (shuffled if configured); the rows left over stay in ``buffer``."""
            nonlocal buffer, held
            block = Rows.concat(buffer)
            if rng is not None:
                block = block.take(rng.permutation(len(block)))
            if budget is not None:
                block, slices, used = self._token_batches(block, budget, final=final and keep_last, order=batch_order)
            else:
                used = len(block) // self.batch_size * self.batch_size
                slices = [(i, i + self.batch_size) for i in range(0, used, self.batch_size)]
                if final and keep_last and used < len(block):
                    slices, used = [*slices, (used, len(block))], len(block)
            for a, b in slices:
                yield self._tensors(block.slice(a, b), *counts())
            buffer, held = [block.slice(used, len(block))], len(block) - used

        for rows in self._read_ranges(split, ranges, encoder, sampling):
            buffer.append(rows)
            held += len(rows)
            if held >= hold:
                yield from cut(final=False)
        if held:
            yield from cut(final=True)
        last = counts()
        if last[0] or last[1] or any(total for _, total in last[2].values()) or any(cut for cut, _ in last[3].values()) or last[4]:
            yield (None, None, None, None, *last[:4], None, last[4])

    def encoder(self, on_bad_rows: str) -> Encoder:
        """The row encoder of this shard's blocks: the schema's columns, the required candidates and ``data.funnel``."""
        return Encoder(self.schema, on_bad_rows, DataError, self.required, tuple(self.config.funnel or ()), FUNNEL_WHY)

    def has_a_row(self, split: Split) -> bool:
        """Whether ``split`` holds a row that is not bad, read in file order up to the first one (every row when none is)."""
        ranges = shard_ranges(split.counts, list(range(len(split.units))), 0, 1, equal=False)
        return any(len(rows) for rows in self._read_ranges(split, ranges, self.encoder("skip")))

    def _token_batches(self, block: Rows, budget: int, final: bool, order: np.random.Generator) -> tuple[Rows, list[tuple[int, int]], int]:
        """``block`` (sorted by history length with ``group_by_length``), its ``batch_tokens`` batches and the rows they use.

        Grouped, the batches are cut by padded size (rows × longest) and yielded in a seeded random order, so that a run
        does not see the short rows of a block first; the longest rows left over wait for the next block."""
        costs = history_costs(self.schema, block.sparse)
        if not self.config.group_by_length:
            return block, *token_cuts(costs, budget, final=final)
        by_length = np.argsort(costs, kind="stable")
        block, costs = block.take(by_length), costs[by_length]
        slices, used = token_cuts(costs, budget, final=final, padded=True)
        return block, [slices[i] for i in order.permutation(len(slices))], used

    def _read_ranges(self, split: Split, ranges: list[tuple[int, int, int]], encoder: Encoder,
                     sampling: _Sampling | None = None) -> Iterator[Rows]:
        """The encoded rows of ``ranges``, block by block; with ``sampling``, only the rows it keeps."""
        ahead = read_ahead(split.source, [split.units[u] for u, _, _ in ranges])
        for (u, start, stop), tables in zip(ranges, ahead, strict=True):
            unit = split.units[u]
            seen = 0
            line_offset = split.source.line_offset(unit.path) if isinstance(split.source, CsvSource) else None
            column_files = split.source.column_files(unit.path) if isinstance(split.source, NpySource) else None
            for table, file_rows in tables:
                chosen = split.select(unit, file_rows)
                k = table.num_rows if chosen is None else len(chosen)
                lo, hi = max(start - seen, 0), min(stop - seen, k)
                seen += k
                if lo < hi:
                    if chosen is None:
                        part, rows_of = table.slice(lo, hi - lo), file_rows[lo:hi]
                    else:
                        part, rows_of = table.take(pa.array(chosen[lo:hi])), file_rows[chosen[lo:hi]]
                    rows, kept = encoder.encode_kept(part, Location(unit.path, unit.part, rows_of, line_offset, column_files))
                    yield rows if sampling is None else sampling.keep(rows, unit.path, rows_of if kept is None else rows_of[kept])
                if seen >= stop:
                    break

    def _tensors(self, rows: Rows, skipped: int, truncated: int, oov: dict[str, tuple[int, int]],
                 capped: dict[str, tuple[int, int]], downsampled: int) -> tuple:
        values = np.concatenate([v for v, _ in rows.sparse]) if rows.sparse else np.zeros(0, np.int64)
        lengths = np.concatenate([ln for _, ln in rows.sparse]) if rows.sparse else np.zeros(0, np.int32)
        weights = rows.key_weights()  # a weighted feature's weights, 1.0 for every other key's values (FeatureSpec.weighted)
        return (
            torch.from_numpy(np.ascontiguousarray(rows.dense)),
            torch.from_numpy(values.astype(np.int64, copy=False)),
            torch.from_numpy(lengths.astype(np.int32, copy=False)),
            torch.from_numpy(np.ascontiguousarray(rows.labels)),
            skipped,
            truncated,
            oov,
            capped,
            None if weights is None else torch.from_numpy(weights),
            downsampled,
        )


@dataclass
class _Sampling:
    """A shard's negative downsampling (``data.negative_rate``): which rows of each block it keeps, and how many it left out."""

    seed: int
    rate: float
    dropped: int = 0

    def keep(self, rows: Rows, path: str, file_rows: np.ndarray) -> Rows:
        """``rows`` (of file ``path``, at ``file_rows``) without the negatives :func:`~.downsample.kept_rows` leaves out."""
        mask = kept_rows(path, file_rows, rows.labels, self.seed, self.rate)
        self.dropped += int(len(rows) - mask.sum())
        return rows if bool(mask.all()) else rows.take(np.flatnonzero(mask))

    def take_dropped(self) -> int:
        """The rows left out since the last call."""
        dropped, self.dropped = self.dropped, 0
        return dropped


class ShardStream(IterableDataset):
    """One rank's share of a split for one epoch; with DataLoader workers, each worker a sub-share.

    Outside ``data.worker_start=fork`` it is pickled to each worker, so it holds plain state only: the reader (configs,
    schema), the split (file names, units, row counts), the negative sampler (``None``: none; its tables and shared
    mined lists) and numbers; the files are opened in the worker, as it reads them."""

    def __init__(self, reader: ShardReader, sampler: NegativeSampler | None, split: Split, epoch: int, rank: int, world_size: int,
                 train: bool) -> None:
        super().__init__()
        self.reader, self.sampler = reader, sampler
        self.split, self.epoch, self.rank, self.world_size, self.train = split, epoch, rank, world_size, train

    def __iter__(self) -> Iterator[tuple | Packed]:
        info = get_worker_info()
        workers = info.num_workers if info is not None else 1
        shard = self.rank * workers + (info.id if info is not None else 0)
        try:
            stream = self.reader.batches(self.split, self.epoch, shard, self.world_size * workers, self.train)
            batches = self.sampler.extend_stream(stream, self.epoch, shard) if self.sampler is not None and self.train else stream
            # In a worker, each batch crosses to the training process as one buffer (data/packed.py says why)
            yield from batches if info is None else packed_stream(batches)
        except DataError as e:
            if info is None:
                raise
            # Across a worker process boundary DataLoader would wrap the message in a traceback.
            yield ("error", str(e))
