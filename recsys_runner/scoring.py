"""Scoring files with a checkpoint's model: the work of ``python -m recsys_runner.predict`` below its entry.

What the entry's docstring promises is done here: the output directory checked for an earlier run's parts
(:func:`check_output`) and the pass-through columns against the input's (:func:`check_columns`), both before
anything is built; then, over a built :class:`~recsys_runner.inference_build.Inference`, each rank's contiguous share
of the input's units (:func:`rank_units`) read in Arrow tables, encoded by the data's own encoders, scored in batches
in step with the other ranks, and written as atomic Parquet parts, one per input file (:func:`score_files`). What a
batch's rows get is a scorer's: a score per task (:func:`pointwise_scorer`), or a top-k of items for a model that ranks
them (:func:`recsys_runner.scoring_topk.top_k_scorer`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner import stores, uris
from recsys_runner.data.base import in_step, placeholder
from recsys_runner.data.encoding.encoded_rows import Rows
from recsys_runner.data.encoding.rows import Encoder, Location
from recsys_runner.data.encoding.stored import oov_counters, oov_line, oov_rates
from recsys_runner.data.files.criteo_config import CRITEO_COLUMNS, CriteoDataConfig
from recsys_runner.data.files.csv_source import CsvSource
from recsys_runner.data.files.sources import Unit
from recsys_runner.data.files.streaming import TabularData
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig, TabularDataConfig
from recsys_runner.data.locate import PARQUET_SUFFIXES, resolve_files
from recsys_runner.data.schema import Schema
from recsys_runner.data.schema_files import read_schema_file
from recsys_runner.data.sequences.mapping import RawIdColumns
from recsys_runner.errors import ConfigError, DataError, UserError
from recsys_runner.features import FeatureSpec
from recsys_runner.inference_build import Inference
from recsys_runner.progress import Progress
from recsys_runner.scoring_topk import TOP_ITEMS, Scorer, top_k_scorer
from recsys_runner.staging import unwritable
from recsys_runner.tasks import score_columns

log = logging.getLogger(__name__)

SOURCE_KEY, FIRST_ROW_KEY = b"recsys_runner.source", b"recsys_runner.first_row"
"""The Parquet metadata keys of each part naming its source file and the first row it holds of it."""
PART_GLOB = "part-*.parquet"
TEMP_PREFIX = ".tmp-"
"""A part being written is ``.tmp-part-<r>-<n>.parquet``, renamed to ``part-<r>-<n>.parquet`` once complete."""


@dataclass
class PredictResult:
    """What a predict run wrote: rows over all ranks, seconds, the output directory and this rank's part files; with a
    top-k scorer, the rows over all ranks whose list is shorter than ``k`` (their seen items left fewer than ``k``)."""

    rows: int
    seconds: float
    output: Path
    parts: list[Path]
    short_lists: int = 0

    @property
    def rows_per_s(self) -> float:
        return self.rows / max(self.seconds, 1e-9)


def earlier_parts(output: Path) -> tuple[list[Path], list[Path]]:
    """The part files an earlier run left in ``output``: ``(complete, incomplete)``, each sorted by name; incomplete
    are temp parts (a write that never finished) and ``part-*.parquet`` files whose Parquet footer cannot be read. In an
    object store a part is only seen once complete (an upload is whole or absent): every part there is complete."""
    if uris.is_remote(output):
        return [uris.as_path(p) for p in stores.glob(str(output / PART_GLOB), ConfigError)], []
    if not output.is_dir():
        return [], []
    complete, incomplete = [], []
    for path in sorted(output.glob(PART_GLOB)):
        try:
            pq.read_metadata(path)
        except (pa.ArrowException, OSError):
            incomplete.append(path)
        else:
            complete.append(path)
    incomplete += sorted(output.glob(TEMP_PREFIX + PART_GLOB))
    return complete, sorted(incomplete)


def check_output(output: Path, overwrite: bool) -> None:
    """Refuse an ``output`` holding part files of an earlier run, saying which are complete and which incomplete; with
    ``overwrite`` delete them instead (every rank may do so: nothing is written before all ranks have built). A local
    ``output`` that cannot be written (under a file, read-only, no permission) is refused too, now rather than with a raw
    ``OSError`` once the model is built and the first part is written."""
    if not uris.is_remote(output) and output.exists() and not output.is_dir():
        raise ConfigError(f"predict.output={output} is a file, not a directory. Fix: predict.output=<directory for the part files>")
    found = None if uris.is_remote(output) else unwritable(output)
    if found is not None:
        _, cause, fix = found
        raise ConfigError(f"predict.output={output} cannot be written: {cause}. Fix: {fix}, or another predict.output")
    complete, incomplete = earlier_parts(output)
    if not complete and not incomplete:
        return
    if overwrite:
        for path in [*complete, *incomplete]:
            stores.remove(str(path))
        log.info("predict.overwrite=true: deleted %d part file(s) of an earlier run in %s", len(complete) + len(incomplete), output)
        return
    said = [f"complete: {_names(complete)}"] if complete else []
    if incomplete:
        said.append(f"incomplete (an interrupted write: temp parts, or parts whose Parquet footer cannot be read): {_names(incomplete)}")
    raise ConfigError(f"predict.output={output} already holds part files of an earlier run ({'; '.join(said)}); the parts of two "
                      f"runs would mix. Fix: predict.overwrite=true to delete them first, or choose a new predict.output")


def _names(paths: list[Path], limit: int = 5) -> str:
    names = [p.name for p in paths]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def scored_files(data_path: str, input_path: str | None) -> tuple[str, str]:
    """The files to score and the key that names them: ``predict.input``, else ``data.path``."""
    return (input_path, "predict.input") if input_path else (data_path, "data.path")


def check_columns(data: TabularDataConfig, columns: list[str], input_path: str | None) -> None:
    """Refuse ``columns`` (``predict.columns``) naming a column some input file (``input_path``, else ``data.path``)
    lacks, before anything is built: each file's columns are read from its Parquet footer, its header line (or
    ``data.column_names``), or the Criteo layout."""
    if not columns:
        return
    path, key = scored_files(data.path, input_path)
    for file, names in _file_columns(data, path, key):
        missing = [c for c in columns if c not in names]
        if missing:
            raise ConfigError(f"predict.columns={list(columns)} names {missing} (not in {file}, one of the files "
                              f"{key}={path!r} names); its columns are {names}. Fix: predict.columns=<some of those>")


def _file_columns(data: TabularDataConfig, path: str, key: str) -> Iterator[tuple[str, list[str]]]:
    """``(file, its column names)`` for each file ``path`` names, read as ``data`` reads them (no rows read)."""
    if isinstance(data, ParquetDataConfig):
        for file in resolve_files(path, key, PARQUET_SUFFIXES):
            try:
                fs, where = stores.arrow_filesystem(file)
                yield file, pq.read_schema(where, filesystem=fs).names
            except (pa.ArrowException, OSError):
                continue  # not a readable Parquet file: reading it reports that, with the fix
        return
    files = resolve_files(path, key, None)
    if isinstance(data, CriteoDataConfig):
        for file in files:
            yield file, list(CRITEO_COLUMNS)
    elif isinstance(data, CsvDataConfig):
        c = replace(data, **read_schema_file(data.schema)[1]) if data.schema is not None else data  # as CsvData reads them
        for file in files:
            yield file, CsvSource([file], [], delimiter=c.delimiter, header=c.header, column_names=c.column_names,
                                  null_values=c.null_values, block_rows=c.block_rows, on_bad_rows=c.on_bad_rows).header_names()


def pointwise_scorer(inference: Inference) -> Scorer:
    """Each row's score per task (:func:`~recsys_runner.tasks.score_columns`: ``score``, or ``score_<task>``/``class_<task>``)."""
    def score(batch: Batch) -> dict[str, pa.Array]:
        _, (_, logits, _) = inference.model(batch)
        return {name: pa.array(values) for name, values in score_columns(inference.tasks, logits).items()}
    return score


def top_k_files(data: TabularDataConfig, input_path: str | None) -> list[str]:
    """The Parquet files predict reads (whose metadata may name an id mapping); none for other formats."""
    if not isinstance(data, ParquetDataConfig):
        return []
    return resolve_files(*scored_files(data.path, input_path), PARQUET_SUFFIXES)


def ranking_scorer(inference: Inference, input_path: str | None, *, k: int, exclude_seen: bool) -> Scorer:
    """:func:`~recsys_runner.scoring_topk.top_k_scorer` over ``inference``'s model and the files predicted."""
    config = inference.data.config if isinstance(inference.data, TabularData) else None
    files = top_k_files(config, input_path) if isinstance(config, TabularDataConfig) else []
    return top_k_scorer(inference.model, inference.tasks, inference.data, inference.env, files, k=k, exclude_seen=exclude_seen)


def scored_source(data: TabularData, files: str, key: str, columns: list[str]) -> Any:
    """A row source over ``files`` (the setting ``key``) that reads what predict scores from: the features (dense, sparse,
    histories' times) and the pass-through ``columns``, never the label columns, which files to score may lack."""
    source = data.open_files(files, key, "input file")
    features = [c for c in data.schema.columns if c not in data.schema.label_columns]
    source.columns = list(dict.fromkeys([*features, *columns]))
    return source


def score_files(inference: Inference, *, input_path: str | None, columns: list[str], output: Path,
                log_every_batches: int, scorer: Scorer | None = None) -> PredictResult:
    """Score this rank's share of ``input_path`` (``None``: ``data.path``) with ``inference``'s model (its EMA weights
    when it has them) and write its parts to ``output``, each row's output columns (``scorer``'s, else
    :func:`pointwise_scorer`'s) after its ``columns``; returns the totals over all ranks. Progress is logged every
    ``log_every_batches`` batches where no bar is drawn."""
    data, env, model = inference.data, inference.env, inference.model
    assert isinstance(data, TabularData)
    # the data option's own reader (format settings), over the input's columns
    files, key = scored_files(data.config.path, input_path)
    source = scored_source(data, files, key, columns)
    if input_path:
        data.check_trained(source, f"{key}={files!r}", optional=data.schema.label_columns)
    units = rank_units(source.units(), env.rank, env.world_size)
    if not uris.is_remote(output):  # in an object store a part is an object: no directory to make
        output.mkdir(parents=True, exist_ok=True)
    writer = _PartWriter(output, env.rank)
    raw = RawIdColumns(columns, say=env.is_main)
    batches = _batches(source, units, data.schema, data.features, data.batch_size, columns)
    idle = placeholder(data.features)
    rows, short, start = 0, 0, time.monotonic()
    k = getattr(scorer, "k", None)  # a top-k scorer's list length
    weights = inference.ema.swapped_in() if inference.ema is not None else contextlib.nullcontext()
    progress = Progress(sum(u.num_rows for u in units), enabled=env.is_main, unit="row", desc="predict", unit_scale=True)
    try:
        with weights, torch.no_grad(), progress:
            model.eval()
            score = scorer if scorer is not None else pointwise_scorer(inference)
            for n, item in enumerate(in_step(batches)):
                batch = item[1] if item is not None else idle
                scored = score(batch.to(env.device, non_blocking=True))
                if item is not None:
                    path, _, passthrough, first_row = item
                    writer.write(path, first_row, raw.of(path, passthrough), scored)
                    rows += passthrough.num_rows
                    if k is not None and TOP_ITEMS in scored:
                        short += int((np.asarray(scored[TOP_ITEMS].value_lengths()) < k).sum())
                    progress.update(passthrough.num_rows)
                if env.is_main and not progress.active and (n + 1) % log_every_batches == 0:
                    _progress(rows, env.world_size, time.monotonic() - start)
            model.train()
        writer.close()
    except BaseException:  # any stop (an error, Ctrl-C, the lifecycle's SIGTERM): no partial output is left behind
        writer.discard()
        raise
    seconds = time.monotonic() - start
    total = (rows, short)
    if env.world_size > 1:
        counts = torch.tensor(total, dtype=torch.int64, device=env.device if env.backend == "nccl" else torch.device("cpu"))
        dist.all_reduce(counts)
        total = (int(counts[0]), int(counts[1]))
    return PredictResult(rows=total[0], seconds=seconds, output=output, parts=writer.parts, short_lists=total[1])


def _progress(rows: int, world_size: int, seconds: float) -> None:
    """A progress line where no bar is drawn (rank 0's rows; the ranks move in step)."""
    log.info("predict: %d rows on rank 0 (~%d on %d ranks), %.0f rows/s", rows, rows * world_size, world_size,
             rows * world_size / max(seconds, 1e-9))


def rank_units(units: list[Unit], rank: int, world_size: int) -> list[Unit]:
    """``rank``'s contiguous share of ``units`` (in input order): unit ``i`` goes to the rank whose equal share of all
    rows holds its first row, so shares are disjoint, cover every unit and differ by about a unit's rows."""
    total = sum(u.num_rows for u in units)
    mine, first = [], 0
    for u in units:
        if total and first * world_size // total == rank:
            mine.append(u)
        first += u.num_rows
    return mine


def _batches(source: Any, units: list[Unit], schema: Schema, features: FeatureSpec, batch_size: int,
             columns: list[str]) -> Iterator[tuple[str, Batch, pa.Table, int]]:
    """``(file, batch, pass-through table, first file row)`` over ``units`` in order; a file's last batch may be short.

    The label columns are not read: they are filled with zeros for the encoder (the scores do not depend on them)."""
    encoder = Encoder(schema, "fail", DataError)
    names = features.kjt_keys  # the sparse features, then each history's event times
    try:
        yield from _encoded(source, units, schema, encoder, names, batch_size, columns)
    finally:  # the input's values unseen when the vocabularies were fitted, on this rank's share
        if (line := oov_line(oov_rates(oov_counters(encoder.oov)))) is not None:
            log.info("predict: %s", line)
        if (line := encoder.capped_line()) is not None:  # cut as in training, where data/truncated_lists counts them
            log.info("predict: %s", line)


def _encoded(source: Any, units: list[Unit], schema: Schema, encoder: Encoder, names: list[str], batch_size: int,
             columns: list[str]) -> Iterator[tuple[str, Batch, pa.Table, int]]:
    """:func:`_batches` with its encoder."""
    for path, file_units in groupby(units, key=lambda u: u.path):
        held: list[tuple[Rows, pa.Table, np.ndarray]] = []
        count = 0
        for unit in file_units:
            line_offset = source.line_offset(path) if isinstance(source, CsvSource) else None
            for table, file_rows in source.read(unit):
                rows = encoder.encode(_zero_labels(table, schema), Location(path, unit.part, file_rows, line_offset))
                held.append((rows, table.select(columns), file_rows))
                count += len(rows)
                while count >= batch_size:
                    block, passthrough, first = _take(held, batch_size)
                    count -= batch_size
                    yield path, _to_batch(block, names), passthrough, first
        if count:
            block, passthrough, first = _take(held, count)
            yield path, _to_batch(block, names), passthrough, first


def _take(held: list[tuple[Rows, pa.Table, np.ndarray]], n: int) -> tuple[Rows, pa.Table, int]:
    """The first ``n`` held rows (removed from ``held``), their pass-through columns and their first file row."""
    rows, tables, first = [], [], int(held[0][2][0])
    need = n
    while need:
        block, table, file_rows = held[0]
        k = min(need, len(block))
        rows.append(block.slice(0, k))
        tables.append(table.slice(0, k))
        if k == len(block):
            held.pop(0)
        else:
            held[0] = (block.slice(k, len(block)), table.slice(k), file_rows[k:])
        need -= k
    # a table without columns (predict.columns=[]) keeps its row count when sliced but loses it when concatenated
    passthrough = pa.concat_tables(tables) if tables[0].num_columns else pa.table({"_": pa.nulls(n)}).select([])
    return Rows.concat(rows), passthrough, first


def _zero_labels(table: pa.Table, schema: Schema) -> pa.Table:
    """``table`` with every label column set to 0.0 (added where the input has none)."""
    zeros = pa.array(np.zeros(table.num_rows))
    for name in schema.label_columns:
        table = table.append_column(name, zeros) if name not in table.column_names else \
            table.set_column(table.column_names.index(name), name, zeros)
    return table


def _to_batch(rows: Rows, names: list[str]) -> Batch:
    """``rows`` as a batch; its ``KeyedJaggedTensor`` carries the ids' weights when some feature is weighted."""
    values = np.concatenate([v for v, _ in rows.sparse]) if rows.sparse else np.zeros(0, np.int64)
    lengths = np.concatenate([ln for _, ln in rows.sparse]) if rows.sparse else np.zeros(0, np.int32)
    weights = rows.key_weights()
    kjt = KeyedJaggedTensor(keys=names, values=torch.from_numpy(values.astype(np.int64, copy=False)),
                            lengths=torch.from_numpy(lengths.astype(np.int32, copy=False)),
                            weights=None if weights is None else torch.from_numpy(weights))
    return Batch(dense_features=torch.from_numpy(np.ascontiguousarray(rows.dense)), sparse_features=kjt,
                 labels=torch.from_numpy(np.ascontiguousarray(rows.labels)).float())


class _PartWriter:
    """Writes ``part-<rank>-<n>.parquet``, one per input file, each batch's pass-through columns and scored columns;
    each part under its temp name (``.tmp-part-…``) until it is complete (:meth:`close`), every file of it deleted by
    :meth:`discard`."""

    def __init__(self, output: Path, rank: int) -> None:
        self.output, self.rank = output, rank
        self.parts: list[Path] = []
        """The complete parts, in the order written."""
        self._writer: pq.ParquetWriter | None = None
        self._path: str | None = None
        self._temp: Path | None = None
        self._next = 0

    def write(self, path: str, first_row: int, passthrough: pa.Table, scored: dict[str, pa.Array]) -> None:
        clash = [c for c in passthrough.column_names if c in scored]
        if clash:  # re-scoring an earlier predict's output, say: Arrow would write both, and refuse to read the parts back
            raise ConfigError(f"predict.columns copies {clash}, which predict writes itself (this model's output columns: "
                              f"{list(scored)}): a part would hold two columns of one name, which Arrow and pandas cannot read "
                              f"back as a dataset. Fix: drop {clash} from predict.columns, or rename them in the input")
        # built column by column: a table without columns (predict.columns=[]) has no rows to append scores to
        table = pa.Table.from_arrays([*passthrough.columns, *scored.values()], names=[*passthrough.column_names, *scored])
        if path != self._path:
            self.close()
            temp = "" if uris.is_remote(self.output) else TEMP_PREFIX  # an upload is seen only once complete: no temp name
            self._temp = self.output / f"{temp}part-{self.rank:05d}-{self._next:05d}.parquet"
            self._next += 1
            meta = {SOURCE_KEY: str(uris.as_path(path).absolute()).encode(), FIRST_ROW_KEY: str(first_row).encode()}
            fs, where = stores.arrow_filesystem(str(self._temp))
            self._writer = pq.ParquetWriter(where, table.schema.with_metadata(meta), filesystem=fs)
            self._path = path
        assert self._writer is not None
        self._writer.write_table(table)

    def close(self) -> None:
        """Finish the part being written (its footer) and give it its final name."""
        if self._writer is not None:
            assert self._temp is not None
            self._writer.close()
            self._writer = None
            part = self.output / self._temp.name.removeprefix(TEMP_PREFIX)
            if part != self._temp:
                os.replace(self._temp, part)
            self.parts.append(part)
            self._temp = None

    def discard(self) -> None:
        """Delete everything this writer wrote: the part being written and the parts it finished."""
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
            self._writer = None
        written = [*([self._temp] if self._temp is not None else []), *self.parts]
        for path in written:
            with contextlib.suppress(OSError, UserError):
                stores.remove(str(path))
        if written:
            log.warning("predict stopped: deleted the part files rank %d had written (%s), so that no partial output is left",
                        self.rank, ", ".join(p.name for p in written))
        self._temp, self.parts = None, []
