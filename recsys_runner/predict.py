"""``python -m recsys_runner.predict <overrides> load=<checkpoint> predict.output=<dir>``: score files, write Parquet.

Same overrides as the training run plus ``load`` (a checkpoint directory, a checkpoints root or the training
run's MLflow id, :mod:`recsys_runner.inference`). The files ``predict.input`` names (default ``data.path``;
same format and columns as the data option, the label columns may be absent) are scored with the
checkpoint's weights (the EMA's with ``train.ema.eval_with_ema``, the weights evaluate measures) and
written to ``predict.output`` as Parquet: one column per task (``score`` for a single-output model,
``score_<task>`` for a multi-task one; a probability for a binary task, the raw output for a regression
task; a multi-class task writes ``class_<task>``, its most probable class (int64), and ``score_<task>``, that class's
probability) after the pass-through columns ``predict.columns`` (e.g. ``[request_id]``), copied unchanged.

**Ranking models.** A next-item or two-tower model (``model=sasrec``, ``model.block=hstu``, ``model=dssm``) writes
instead each row's best ``predict.top_k`` items: ``top_items`` (raw ids through the ``data sequences`` id mapping the
input names, else the table's ids) and ``top_scores``, the row's history items left out with ``predict.exclude_seen``
(default true); exact chunked retrieval, or FAISS with ``model.index=faiss`` (:mod:`recsys_runner.scoring_topk`).

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

This module wires the command; the checks and the scoring are :mod:`recsys_runner.scoring`'s, over the model
:func:`recsys_runner.inference_build.build_inference` builds (no optimizer, schedule or train pipeline).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import hydra
from omegaconf import DictConfig, OmegaConf

from recsys_runner import store_settings, uris
from recsys_runner.collection import skip_the_exit_collection
from recsys_runner.config import register_entry_schema, validate
from recsys_runner.data.base import SplitFiles
from recsys_runner.data.files.streaming import TabularData
from recsys_runner.data.files.tabular_config import TabularDataConfig
from recsys_runner.errors import ConfigError, require
from recsys_runner.inference import (
    LOAD_FIELD,
    carry_training_overrides,
    checkpoint_to_load,
    inference_start,
    with_training_overrides,
)
from recsys_runner.inference_build import Inference, build_inference
from recsys_runner.lifecycle import end_rank_process, exit_codes, one_job, tracked_run
from recsys_runner.noise import quiet_known_noise
from recsys_runner.overrides import check_command_line
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.runtime import Launch
from recsys_runner.scoring import (
    PredictResult,
    check_columns,
    check_output,
    ranking_scorer,
    score_files,
    scored_files,
    scored_source,
)
from recsys_runner.scoring_topk import ranks_items

quiet_known_noise()  # the known library warnings, each with its reason (noise.py)
log = logging.getLogger("recsys_runner")


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
    top_k: int = 10
    """A next-item or two-tower model: how many items each row's ``top_items``/``top_scores`` hold (at most the
    catalogue's items; a pointwise model ignores it)."""
    exclude_seen: bool = True
    """A next-item or two-tower model: never recommend an item the row's history holds (two-tower: its history features
    and ``data.items.seen``); ``false``: rank every item. A pointwise model ignores it."""

    def __post_init__(self) -> None:
        require(self.top_k > 0, f"predict.top_k must be positive, got {self.top_k}")
        require(self.log_every_batches > 0, f"predict.log_every_batches must be positive, got {self.log_every_batches}")
        require(len(set(self.columns)) == len(self.columns), f"predict.columns={self.columns} names a column twice")


register_entry_schema("predict", [LOAD_FIELD, ("predict", PredictConfig, field(default_factory=PredictConfig))])
"""The root schema of ``conf/predict.yaml``: the run's keys plus ``load`` and ``predict.*``."""


@one_job
def run(cfg: DictConfig, launch: Launch = Launch()) -> PredictResult:
    """Score ``predict.input`` with the checkpoint ``cfg.load`` and write the parts (see the module docstring)."""
    checkpoint = checkpoint_to_load(cfg)  # first: a load= that names no checkpoint is the error to fix first
    spec = validate(cfg)
    store_settings.configure(spec.storage)
    settings = settings_of(cfg)
    if not isinstance(spec.data, TabularDataConfig):
        raise ConfigError(f"predict scores files, but data is {type(spec.data).__name__}, which generates its rows (the "
                          f"training's data, unless given here) and has no files to score. Fix: data=parquet|csv|criteo "
                          f"data.path=<files with the columns the model was trained on> (predict.input=<other files> to score "
                          f"others); for a model trained on data=synthetic, Criteo-shaped Parquet of its data.num_embeddings, "
                          f"as docs/lifecycle.md generates")
    require(bool(settings.output), "predict.output is required: the directory for the Parquet part files, e.g. predict.output=scores/")
    output = uris.as_path(str(settings.output))
    check_output(output, settings.overwrite)
    check_columns(spec.data, settings.columns, settings.input)
    built = build_inference(spec, launch=launch, weights=checkpoint, evaluate=False)  # scores predict.input, no eval split
    params = {f"predict.{name}": getattr(settings, name) for name in ("input", "output", "columns", "top_k", "exclude_seen")}
    start = inference_start(built, entry="predict", checkpoint=checkpoint, load=str(cfg.load), extra_params=params,
                            scored=_scored(built, spec.data.path, settings.input))
    with tracked_run(built.tracker, start, launch, close=built.close):
        scorer = ranking_scorer(built, settings.input, k=settings.top_k, exclude_seen=settings.exclude_seen) \
            if ranks_items(built.tasks) else None
        result = score_files(built, input_path=settings.input, columns=settings.columns, output=output,
                             log_every_batches=settings.log_every_batches, scorer=scorer)
        built.tracker.set_tag("predict.output", str(output.absolute()))
        built.tracker.log_metrics({"predict/rows": result.rows, "predict/rows_per_s": result.rows_per_s,
                               "predict/seconds": result.seconds}, built.state.step)
        if scorer is not None:
            built.tracker.log_metrics({"predict/short_lists": result.short_lists}, built.state.step)
        if built.env.is_main:
            log.info("predict: wrote %d rows to %s in %.1f s (%.0f rows/s)", result.rows, output, result.seconds, result.rows_per_s)
            if result.short_lists:
                log.warning("predict: %d of %d rows have fewer than predict.top_k=%d items in top_items: their seen items "
                            "(predict.exclude_seen) left fewer unseen ones in the catalogue (logged as predict/short_lists)",
                            result.short_lists, result.rows, settings.top_k)
        return result


def _scored(built: Inference, data_path: str, input_path: str | None) -> SplitFiles | None:
    """The files this predict scores, as a dataset input of its run (rank 0, which logs it; the rows are counted as they
    are scored, in ``predict/rows``)."""
    if not built.env.is_main:
        return None
    assert isinstance(built.data, TabularData)  # predict refuses other data before building
    path, key = scored_files(data_path, input_path)
    source = scored_source(built.data, path, key, [])  # the files to score may lack the label columns
    return SplitFiles(path, tuple(f for f in source.files if source.has_rows(f)), num_rows=None)  # empty parts are skipped


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


@hydra.main(config_path=CONFIG_PATH, config_name="predict", version_base="1.3")
def main(cfg: DictConfig) -> None:
    launch = Launch.from_hydra()  # Hydra's runtime, read here once and handed down
    with exit_codes(launch):
        run(with_training_overrides(cfg, launch), launch)


if __name__ == "__main__":
    skip_the_exit_collection()  # the exit skips collecting what the command left (collection.py says why)
    carry_training_overrides()  # before @hydra.main composes: the training's overrides, then this command's
    check_command_line("predict")  # a typo: one line with the closest valid name (overrides.py)
    main()
    end_rank_process()  # a rank of a multi-rank launch skips the native teardown (lifecycle.py says why)
