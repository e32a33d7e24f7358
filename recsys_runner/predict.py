"""``python -m recsys_runner.predict <overrides> load=<checkpoint> predict.output=<dir>``: score files, write Parquet.

Same overrides as the training run plus ``load`` (a checkpoint directory, a checkpoints root or the training
run's MLflow id, :mod:`recsys_runner.inference`). The files ``predict.input`` names (default ``data.path``;
same format and columns as the data option, the label columns may be absent) are scored with the
checkpoint's weights (the EMA's with ``train.ema.eval_with_ema``, the weights evaluate measures) and
written to ``predict.output`` as Parquet: one column per task (``score`` for a single-output model,
``score_<task>`` for a multi-task one; a probability for a binary task, the raw output for a regression
task; a multi-class task writes ``class_<task>``, its most probable class (int64), and ``score_<task>``, that class's
probability) after the pass-through columns ``predict.columns`` (e.g. ``[request_id]``), copied unchanged.

**Streaming.** Files are read in their units, Parquet row groups or blocks of ``data.block_rows`` lines, in
Arrow tables of at most ``data.read_rows`` rows, scored in batches of ``data.batch_size`` rows; memory is
bounded by a unit's table, not by the input. A bad row stops the run naming its file and row (rows cannot be
skipped: every input row has its output row). The last partial batch of each file is scored too.

**Ranks and order.** With several ranks (``torchrun``), the units in input order (files sorted by name, units
in file order) are cut into ``world_size`` contiguous ranges of about equal rows, one per rank, so ranks read
disjoint row groups / line blocks (a file may be split between two ranks). Rank ``r`` writes
``part-<r>-<n>.parquet`` (5-digit numbers), one per input file it touches, rows in file order; so the parts in
name order are the input rows in input order, each exactly once. Each part's Parquet metadata names its source
file and first row (``recsys_runner.source``, ``recsys_runner.first_row``). A sharded model's forward is a
collective, so ranks step together: a rank that has run out scores a one-row placeholder batch (discarded)
until every rank is done.

**Atomic parts.** A part is written as ``.tmp-part-<r>-<n>.parquet`` (a dot name: directory readers and
``part-*`` globs skip it) and renamed to its final name once its footer is written, so a ``part-*.parquet`` is
always complete. A run that stops on any exception (a bad row, Ctrl-C, the SIGTERM the lifecycle turns into one)
deletes the files this rank wrote (its temp part and the parts it finished), leaving no partial output. An
output directory holding part files of an earlier run (complete, or incomplete: temp parts or parts without a
readable footer, e.g. from a killed process) is refused before anything is built, listing both kinds;
``predict.overwrite=true`` deletes them first.

**Columns.** ``predict.columns`` are checked against the input files' columns (Parquet footers, CSV header
lines or ``data.column_names``, the Criteo layout) before the model is built.

The run is logged to MLflow like evaluate (a child of the training run, with the manifest): ``predict/rows``,
``predict/rows_per_s``, ``predict/seconds`` and the ``predict.output`` tag.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import groupby
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner import stores
from recsys_runner.build import Components, build
from recsys_runner.config import register_entry_schema, validate
from recsys_runner.data.encoding.rows import Encoder, Location, Rows
from recsys_runner.data.encoding.stored import oov_counters, oov_line, oov_rates
from recsys_runner.data.schema import Schema, read_schema_file
from recsys_runner.data.sources import PARQUET_SUFFIXES, CsvSource, Unit, resolve_files
from recsys_runner.data.tabular import TabularData
from recsys_runner.data.tabular_config import (
    CRITEO_COLUMNS,
    CriteoDataConfig,
    CsvDataConfig,
    ParquetDataConfig,
    TabularDataConfig,
)
from recsys_runner.errors import ConfigError, DataError, UserError, require
from recsys_runner.features import FeatureSpec
from recsys_runner.inference import (
    LOAD_FIELD,
    carry_training_overrides,
    checkpoint_to_load,
    inference_start,
    with_training_overrides,
)
from recsys_runner.lifecycle import exit_codes, tracked_run
from recsys_runner.noise import quiet_known_noise
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.progress import Progress
from recsys_runner.runtime import Launch
from recsys_runner.tasks import Task, score_columns
from recsys_runner.train.pipeline import detached

quiet_known_noise()  # the known library warnings, each with its reason (noise.py)
log = logging.getLogger("recsys_runner")

SOURCE_KEY, FIRST_ROW_KEY = b"recsys_runner.source", b"recsys_runner.first_row"
PART_GLOB = "part-*.parquet"
TEMP_PREFIX = ".tmp-"
"""A part being written is ``.tmp-part-<r>-<n>.parquet``, renamed to ``part-<r>-<n>.parquet`` once complete."""


@dataclass(kw_only=True)
class PredictConfig:
    """The ``predict`` section of ``conf/predict.yaml``."""

    input: str | None = None
    """Files to score: a file, a directory or a glob, in the data option's format; ``null``: ``data.path``."""
    output: str | None = None
    """Directory for the ``part-<rank>-<n>.parquet`` files (created; must hold no part files yet, see ``overwrite``)."""
    columns: list[str] = field(default_factory=list)
    """Input columns copied to the output beside the scores, e.g. ``[request_id]`` (a label column too, to score offline)."""
    log_every_batches: int = 100
    """Log rows done and rows/s every this many batches (rank 0)."""
    overwrite: bool = False
    """Delete the part files (complete or not) an earlier run left in ``output`` before scoring; ``false`` refuses
    such a directory, so that the parts of two runs never mix."""

    def __post_init__(self) -> None:
        require(self.log_every_batches > 0, f"predict.log_every_batches must be positive, got {self.log_every_batches}")
        require(len(set(self.columns)) == len(self.columns), f"predict.columns={self.columns} names a column twice")


register_entry_schema("predict", [LOAD_FIELD, ("predict", PredictConfig, field(default_factory=PredictConfig))])
"""The root schema of ``conf/predict.yaml``: the run's keys plus ``load`` and ``predict.*``."""


@dataclass
class PredictResult:
    """What a predict run wrote: rows over all ranks, seconds, the output directory and this rank's part files."""

    rows: int
    seconds: float
    output: Path
    parts: list[Path]

    @property
    def rows_per_s(self) -> float:
        return self.rows / max(self.seconds, 1e-9)


def run(cfg: DictConfig, launch: Launch = Launch()) -> PredictResult:
    """Score ``predict.input`` with the checkpoint ``cfg.load`` and write the parts (see the module docstring)."""
    spec = validate(cfg)
    stores.configure(spec.storage)
    settings = settings_of(cfg)
    if not isinstance(spec.data, TabularDataConfig):
        raise ConfigError(f"predict scores files, but data is {type(spec.data).__name__}. Fix: data=parquet|csv|criteo with "
                          f"the training's data settings, and predict.input=<files to score>")
    require(bool(settings.output), "predict.output is required: the directory for the Parquet part files, e.g. predict.output=scores/")
    output = stores.as_path(str(settings.output))
    check_output(output, settings.overwrite)
    check_columns(spec.data, settings)
    checkpoint = checkpoint_to_load(cfg, spec)
    c = build(spec, launch=launch, weights=checkpoint)
    params = {f"predict.{name}": getattr(settings, name) for name in ("input", "output", "columns")}
    start = inference_start(c, entry="predict", checkpoint=checkpoint, load=str(cfg.load), extra_params=params)
    with tracked_run(c.loop.tracker, start, launch, close=c.close):
        _check_tasks(c.loop.evaluator.tasks)
        result = predict(c, settings, output)
        c.loop.tracker.set_tag("predict.output", str(output.absolute()))
        c.loop.tracker.log_metrics({"predict/rows": result.rows, "predict/rows_per_s": result.rows_per_s,
                                    "predict/seconds": result.seconds}, c.loop.state.step)
        if c.env.is_main:
            log.info("predict: wrote %d rows to %s in %.1f s (%.0f rows/s)", result.rows, output, result.seconds, result.rows_per_s)
        return result


def settings_of(cfg: DictConfig) -> PredictConfig:
    """``cfg.predict`` as a validated :class:`PredictConfig` (its ``__post_init__`` run)."""
    try:
        settings = OmegaConf.to_object(cfg.predict)
    except Exception as e:  # OmegaConf wraps the ConfigError raised in __post_init__
        cause = e.__cause__ if isinstance(e.__cause__, ConfigError) else None
        if cause is not None:
            raise cause from None
        raise
    assert isinstance(settings, PredictConfig)
    return settings


def earlier_parts(output: Path) -> tuple[list[Path], list[Path]]:
    """The part files an earlier run left in ``output``: ``(complete, incomplete)``, each sorted by name; incomplete
    are temp parts (a write that never finished) and ``part-*.parquet`` files whose Parquet footer cannot be read. In an
    object store a part is only seen once complete (an upload is whole or absent): every part there is complete."""
    if stores.is_uri(output):
        return [stores.as_path(p) for p in stores.glob(str(output / PART_GLOB), ConfigError)], []
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
    ``overwrite`` delete them instead (every rank may do so: nothing is written before all ranks have built)."""
    if not stores.is_uri(output) and output.exists() and not output.is_dir():
        raise ConfigError(f"predict.output={output} is a file, not a directory. Fix: predict.output=<directory for the part files>")
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


def check_columns(data: TabularDataConfig, settings: PredictConfig) -> None:
    """Refuse ``predict.columns`` naming a column some input file lacks, before anything is built: each file's columns
    are read from its Parquet footer, its header line (or ``data.column_names``), or the Criteo layout."""
    if not settings.columns:
        return
    key = "predict.input" if settings.input else "data.path"
    path = settings.input or data.path
    for file, names in _file_columns(data, path, key):
        missing = [c for c in settings.columns if c not in names]
        if missing:
            raise ConfigError(f"predict.columns={list(settings.columns)} names {missing} (not in {file}, one of the files "
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


def _check_tasks(tasks: tuple[Task, ...]) -> None:
    for task in tasks:
        require(bool({"pointwise", "multiclass"} & set(task.metric_inputs_kinds)),
                f"predict writes one score per row, but task {task.name!r} ({task.kind}) scores each row against candidates "
                f"(retrieval: the batch's items; next_item: every item of the table); export the model instead "
                f"(python -m recsys_runner.export: the towers, or the next-item scores) and rank its scores")


def predict(c: Components, settings: PredictConfig, output: Path) -> PredictResult:
    """Score this rank's share of the input and write its parts; returns the totals over all ranks."""
    data = c.loop.data
    assert isinstance(data, TabularData)
    env, evaluator = c.env, c.loop.evaluator
    # the data option's own reader (format settings), over the input's columns
    source = data.open_files(settings.input or data.config.path, "predict.input" if settings.input else "data.path")
    features = [c for c in data.schema.columns if c not in data.schema.label_columns]  # dense, sparse, histories' times
    source.columns = list(dict.fromkeys([*features, *settings.columns]))
    units = rank_units(source.units(), env.rank, env.world_size)
    if not stores.is_uri(output):  # in an object store a part is an object: no directory to make
        output.mkdir(parents=True, exist_ok=True)
    writer = _PartWriter(output, env.rank, settings.columns, evaluator.tasks)
    batches = _batches(source, units, data.schema, data.features, data.batch_size, settings.columns)
    idle = _placeholder(data.features)
    rows, start = 0, time.monotonic()
    weights = evaluator.ema.swapped_in() if evaluator.ema is not None else contextlib.nullcontext()
    progress = Progress(sum(u.num_rows for u in units), enabled=env.is_main, unit="row", desc="predict", unit_scale=True)
    try:
        with detached(evaluator.pipeline, evaluator.model) as model, weights, torch.no_grad(), progress:
            model.eval()
            for n, item in enumerate(_in_step(batches, env.world_size, env.device if env.backend == "nccl" else torch.device("cpu"))):
                batch = item[1] if item is not None else idle
                _, (_, logits, _) = model(batch.to(env.device, non_blocking=True))
                if item is not None:
                    path, _, passthrough, first_row = item
                    writer.write(path, first_row, passthrough, logits)
                    rows += int(logits.shape[0])
                    progress.update(int(logits.shape[0]))
                if env.is_main and not progress.active and (n + 1) % settings.log_every_batches == 0:
                    _progress(rows, env.world_size, time.monotonic() - start)
            model.train()
        writer.close()
    except BaseException:  # any stop (an error, Ctrl-C, the lifecycle's SIGTERM): no partial output is left behind
        writer.discard()
        raise
    seconds = time.monotonic() - start
    total = rows
    if env.world_size > 1:
        counts = torch.tensor([rows], dtype=torch.int64, device=env.device if env.backend == "nccl" else torch.device("cpu"))
        dist.all_reduce(counts)
        total = int(counts.item())
    return PredictResult(rows=total, seconds=seconds, output=output, parts=writer.parts)


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
    return Rows.concat(rows), pa.concat_tables(tables), first


def _zero_labels(table: pa.Table, schema: Schema) -> pa.Table:
    """``table`` with every label column set to 0.0 (added where the input has none)."""
    zeros = pa.array(np.zeros(table.num_rows))
    for name in schema.label_columns:
        table = table.append_column(name, zeros) if name not in table.column_names else \
            table.set_column(table.column_names.index(name), name, zeros)
    return table


def _to_batch(rows: Rows, names: list[str]) -> Batch:
    values = np.concatenate([v for v, _ in rows.sparse]) if rows.sparse else np.zeros(0, np.int64)
    lengths = np.concatenate([ln for _, ln in rows.sparse]) if rows.sparse else np.zeros(0, np.int32)
    kjt = KeyedJaggedTensor(keys=names, values=torch.from_numpy(values.astype(np.int64, copy=False)),
                            lengths=torch.from_numpy(lengths.astype(np.int32, copy=False)))
    return Batch(dense_features=torch.from_numpy(np.ascontiguousarray(rows.dense)), sparse_features=kjt,
                 labels=torch.from_numpy(np.ascontiguousarray(rows.labels)).float())


def _placeholder(features: FeatureSpec) -> Batch:
    """A one-row batch (zeros, id 0 in every feature) a rank without rows left scores so that the others can step."""
    labels = torch.zeros(1, len(features.label_names)) if features.multi_label else torch.zeros(1)
    keys = features.kjt_keys
    kjt = KeyedJaggedTensor(keys=keys, values=torch.zeros(len(keys), dtype=torch.int64), lengths=torch.ones(len(keys), dtype=torch.int32))
    return Batch(dense_features=torch.zeros(1, features.num_dense), sparse_features=kjt, labels=labels)


def _in_step(items: Iterator[Any], world_size: int, device: torch.device) -> Iterator[Any]:
    """``items``, then ``None`` while another rank still has items: every rank takes the same number of steps."""
    it = iter(items)
    while True:
        item = next(it, None)
        if world_size > 1:
            flag = torch.tensor([0 if item is None else 1], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if int(flag.item()) == 0:
                return
        elif item is None:
            return
        yield item


class _PartWriter:
    """Writes ``part-<rank>-<n>.parquet``, one per input file, each batch's pass-through columns and scores; each part
    under its temp name (``.tmp-part-…``) until it is complete (:meth:`close`), every file of it deleted by
    :meth:`discard`."""

    def __init__(self, output: Path, rank: int, columns: list[str], tasks: tuple[Task, ...]) -> None:
        self.output, self.rank, self.columns, self.tasks = output, rank, columns, tasks
        self.parts: list[Path] = []
        """The complete parts, in the order written."""
        self._writer: pq.ParquetWriter | None = None
        self._path: str | None = None
        self._temp: Path | None = None
        self._next = 0

    def write(self, path: str, first_row: int, passthrough: pa.Table, logits: torch.Tensor) -> None:
        scores = score_columns(self.tasks, logits)
        # built column by column: a table without columns (predict.columns=[]) has no rows to append scores to
        table = pa.Table.from_arrays([*passthrough.columns, *(pa.array(v) for v in scores.values())],
                                     names=[*passthrough.column_names, *scores])
        if path != self._path:
            self.close()
            temp = "" if stores.is_uri(self.output) else TEMP_PREFIX  # an upload is seen only once complete: no temp name
            self._temp = self.output / f"{temp}part-{self.rank:05d}-{self._next:05d}.parquet"
            self._next += 1
            meta = {SOURCE_KEY: str(stores.as_path(path).absolute()).encode(), FIRST_ROW_KEY: str(first_row).encode()}
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


@hydra.main(config_path=CONFIG_PATH, config_name="predict", version_base="1.3")
def main(cfg: DictConfig) -> None:
    launch = Launch.from_hydra()  # Hydra's runtime, read here once and handed down
    with exit_codes(launch):
        run(with_training_overrides(cfg, launch), launch)


if __name__ == "__main__":
    carry_training_overrides()  # before @hydra.main composes: the training's overrides, then this command's
    main()
