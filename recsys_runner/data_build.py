"""The run's data module, encoded as its checkpoint says: by the encoders stored with the checkpoint a training resumes
or fine-tunes from (or evaluate/predict load), else by encoders fitted now; with ``data.vocabulary=refit`` fitted anew,
and each table's trained rows carried over by id (:data:`REFIT_FILE` records what was carried).

Shared by the training build (:func:`recsys_runner.build.build`) and the inference build
(:func:`recsys_runner.inference_build.build_inference`); one step of their fixed order, apart because what a checkpoint
stores of the data (vocabularies, statistics, row carry-over) is its own concern.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from recsys_runner import stores, uris
from recsys_runner.checkpoint.carried_rows import CarriedRows
from recsys_runner.checkpoint.policy import Checkpointer
from recsys_runner.config import RunConfig
from recsys_runner.data.base import DataConfig, DataModule
from recsys_runner.data.encoding.stored import (
    ENCODERS_FILE,
    StoredEncoders,
    from_json,
    read_stored,
    trained_on_generated_data,
)
from recsys_runner.data.encoding.vocabulary import RowCarry, Vocabulary, carry_rows, grown
from recsys_runner.data.files.downsample import SAMPLING_FILE, negative_rate
from recsys_runner.data.files.downsample import document as sampling_document
from recsys_runner.data.files.tabular_config import TabularDataConfig
from recsys_runner.data.schema import Schema
from recsys_runner.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)


def build_data(run: RunConfig, device: torch.device, source: Path | None, checkpointer: Checkpointer | None = None) -> DataModule:
    """The data module, its files encoded by the encoders stored in checkpoint ``source`` (the one a training resumes,
    or ``init_from``'s; the one evaluate/predict load) when there is one, else by encoders fitted now; with
    ``checkpointer`` (a training) those are written into each checkpoint it saves (:mod:`recsys_runner.data.encoding.stored`).
    With ``data.vocabulary=refit`` and ``init_from`` they are fitted now too, and the checkpointer is told which tables'
    trained rows to carry over by id (:func:`_refit`).

    A checkpoint written before encoders were stored gets a warning: its encoders are fitted on the data again, and
    files that changed since its training give its ids other rows; one trained on generated data (which has none) a
    warning that says so."""
    config = run.served_data
    mode = config.vocabulary if checkpointer is not None and isinstance(config, TabularDataConfig) else "keep"
    refit = mode != "keep"  # refit or extend: the vocabularies change, and trained rows are carried over by id
    if refit and run.checkpoint.resume not in ("auto", "never"):
        raise ConfigError(f"data.vocabulary={mode} changes the vocabularies for a run that starts from checkpoint.init_from, but "
                          f"checkpoint.resume={run.checkpoint.resume} continues a run, whose trained rows belong to the ids of the "
                          f"vocabulary stored with it (a resume keeps it, by design). Fix: drop data.vocabulary={mode} to resume, or "
                          f"fine-tune on the new files: checkpoint.init_from=<that checkpoint> checkpoint.resume=never data.vocabulary={mode}")
    if checkpointer is not None and source is not None and checkpointer.resuming():
        _keep_refit_record(checkpointer, source)
        if refit:  # e.g. the relaunch of a preempted refit fine-tune, whose resume command repeats its overrides
            log.warning("data.vocabulary=%s has no effect on a resumed run: resuming %s continues with the vocabulary stored "
                        "there (the one its run made when it started); %s applies when a run starts from checkpoint.init_from",
                        mode, source, mode)
            refit = False
    elif refit and source is None:
        log.info("data.vocabulary=%s without checkpoint.init_from: the encoders are fitted on the files, as for any new run", mode)
    if checkpointer is not None and (rate := negative_rate(config)) is not None:  # what evaluate/predict/export correct by,
        checkpointer.files[SAMPLING_FILE] = sampling_document(rate)  # whichever way the encoders come (refit/extend too)
    stored = read_stored(source) if source is not None else None
    if refit and source is not None:
        assert checkpointer is not None
        _require_stored(stored, source, mode)
        assert stored is not None
        if mode == "extend":
            return _extend(config, device, checkpointer, source, stored)
        return _refit(config, device, checkpointer, source, stored)
    if source is not None and stored is None and config.takes_encoders():
        if (generated := trained_on_generated_data(source)) is not None:
            log.warning("checkpoint %s was trained on generated data (data=%s), whose ids are table rows as drawn, so it "
                        "stores no data encoders: these files' encoders are fitted now. Only ids that are row numbers already "
                        "(encoding: id, as in the Criteo-shaped Parquet docs/lifecycle.md generates) read the rows they "
                        "trained", source, generated)
        else:
            log.warning("checkpoint %s stores no data encoders (it was written before they were): they are fitted on the "
                        "data again, as when it was trained. If the files changed since (rows appended, a new day), ids may "
                        "map to other rows than the ones it trained", source)
    # a checkpoint without stored encoders was fitted on the files' first rows: fitted again so, its ids keep their rows
    data: DataModule = config.build(device=device, encoders=stored, fit_on_head=source is not None and stored is None)
    if checkpointer is not None and stored is not None and not checkpointer.resuming():
        say_unread_columns(config, data, stored, "keep")
    if checkpointer is not None:
        checkpointer.data_shards = data.shards_per_rank()
    if checkpointer is not None and (document := data.encoders_document()) is not None:  # evaluate/predict save nothing
        checkpointer.files[ENCODERS_FILE] = document  # the training run also logs it to MLflow (recsys_runner.__main__)
    return data


def say_unread_columns(config: DataConfig, data: DataModule, stored: StoredEncoders, mode: str) -> None:
    """A fine-tune with the checkpoint's encoders (``data.vocabulary=keep|extend``) whose files hold columns its stored
    schema does not read (a feature the new day adds) warns once, naming them and the fix: the stored encoders name the
    columns, so they were silently not read. Only when the config leaves the columns to inference (no ``data.schema``,
    ``data.sparse`` or ``data.dense``: a refit would take them in) and not in ``data.infer.exclude``. A column the
    checkpoint read that the files lack is refused already (:func:`~recsys_runner.data.encoding.stored.check_columns`)."""
    sampled = getattr(data, "sampled_columns", ())
    if not isinstance(config, TabularDataConfig) or any(getattr(config, k, None) for k in ("schema", "sparse", "dense")):
        return
    read = set(stored.schema.columns) | set(config.infer.exclude)
    unread = [c for c in sampled if c not in read]
    if unread:
        names = ",".join(unread)
        log.warning("data.vocabulary=%s: data.path=%s has %d columns the encoders stored in %s do not read, so they are not "
                    "read: %s (a feature these files add). Fix: data.vocabulary=refit to infer the schema anew and take them in "
                    "(their tables start fresh, the other tables' rows are carried by id), or data.infer.exclude=[%s] to leave "
                    "them out without this warning", mode, getattr(config, "path", None), len(unread), stored.source,
                    ", ".join(unread[:8]) + (", …" if len(unread) > 8 else ""), names)


REFIT_FILE = "vocabulary_refit.json"
"""Written beside ``encoders.json`` into the checkpoints of a ``data.vocabulary=refit`` fine-tune (and so logged to its
MLflow run): the checkpoint it started from and, per table, the rows carried over, the new ids and the ids dropped."""


def _keep_refit_record(checkpointer: Checkpointer, resumed: Path) -> None:
    """A resumed ``data.vocabulary=refit`` fine-tune keeps writing its :data:`REFIT_FILE` into its checkpoints."""
    try:
        checkpointer.files[REFIT_FILE] = stores.read_bytes(uris.join(str(resumed), REFIT_FILE), CheckpointError)
    except FileNotFoundError:
        pass  # not a refit fine-tune


def _require_stored(stored: StoredEncoders | None, source: Path, mode: str) -> None:
    """Refit and extend carry trained rows by id, which only a checkpoint's stored encoders tell.

    Raises:
        CheckpointError: ``source`` stores no encoders.
    """
    if stored is None:
        generated = trained_on_generated_data(source)
        why = f"it was trained on generated data (data={generated})" if generated else "it was written before they were"
        raise CheckpointError(f"data.vocabulary={mode} carries trained rows over by id, but checkpoint {source} stores no data "
                              f"encoders ({why}), so which id trained which row is unknown. Fix: "
                              f"data.vocabulary=keep (its encoders are then fitted on the files, with a warning)")


def _refit(config: DataConfig, device: torch.device, checkpointer: Checkpointer, source: Path,
           stored: StoredEncoders) -> DataModule:
    """``data.vocabulary=refit`` with ``init_from`` ``source``: the data with every encoder fitted anew on its files (a
    new run's vocabularies, table sizes, boundaries and statistics), and the checkpointer's :class:`CarriedRows`: per
    table with a vocabulary now or in ``source``, the trained row each of its rows starts from (all fresh for a table
    with a vocabulary on one side only: its rows are positions of hashed values on the other)."""
    data: DataModule = config.build(device=device)
    document = data.encoders_document()
    assert document is not None, "file data stores its encoders"
    new = from_json(document, "the encoders fitted now")[0]
    old = stored.schema
    tables: dict[str, RowCarry] = {}
    for col in new.sparse:
        now, then = new.vocabularies.get(col.name), old.vocabularies.get(col.name)
        if col.table_name in tables or (now is None and then is None):
            continue
        if now is not None and then is not None:
            tables[col.table_name] = carry_rows(then, now)
        elif col.table_name not in {c.table_name for c in old.sparse}:  # a column these files add (day 3's new one)
            log.warning("data.vocabulary=refit: %s is a new table (column %s is not in %s), so its rows start fresh",
                        col.table_name, col.name, source)
        else:
            assert col.num_embeddings is not None  # sized when fitted
            tables[col.table_name] = RowCarry(np.full(col.num_embeddings, -1, dtype=np.int64), carried=0, new=now.size if now else 0,
                                              dropped=then.size if then else 0, oov_carried=False)
            log.warning("data.vocabulary=refit: %s has a vocabulary %s only (encoding=%s now), so its rows start fresh", col.table_name,
                        "now" if now else f"in {source}", col.encoding)
    if not tables:  # e.g. Parquet written by convert: its ids are encoded already, so there is no id -> row to refit
        log.warning("data.vocabulary=refit has nothing to carry over: no table has a vocabulary (encoding=vocab) in these files "
                    "or in %s, so every trained row loads at its position, as with data.vocabulary=keep", source)
    _carry(checkpointer, source, tables, new, document, "refit")
    return data


def _carry(checkpointer: Checkpointer, source: Path, tables: dict[str, RowCarry], schema: Schema, document: bytes,
           mode: str) -> None:
    """Tell the checkpointer which tables' rows to carry over by id, and what to store: the encoders ``document`` and
    the :data:`REFIT_FILE` record of ``mode``."""
    checkpointer.carry = CarriedRows(tables, frozenset(c.table_name for c in schema.sparse))
    checkpointer.files[ENCODERS_FILE] = document
    checkpointer.files[REFIT_FILE] = json.dumps({"init_from": str(source), "mode": mode, "tables": {
        t: {"carried": c.carried, "new": c.new, "dropped": c.dropped, "oov_carried": c.oov_carried} for t, c in tables.items()}},
        indent=1).encode()


def _extend(config: DataConfig, device: torch.device, checkpointer: Checkpointer, source: Path,
            stored: StoredEncoders) -> DataModule:
    """``data.vocabulary=extend`` with ``init_from`` ``source``: the data encoded by ``source``'s encoders (its table sizes,
    boundaries and statistics), each vocabulary grown by the ids of these files it lacks (:func:`_grown`; the ids a new
    run would fit on them), and the checkpointer's :class:`CarriedRows`: every trained id keeps its trained row, a new id
    starts from a fresh one.

    The data module is built once: it fits these files as a new run would and hands that fit to ``grow``, whose encoders
    it then reads them by (:meth:`~recsys_runner.data.base.DataConfig.build`). It was built twice, the first module only
    to fit (its files indexed, its encoders document written out and read back for their vocabularies)."""
    made: list[tuple[Schema, dict[str, RowCarry]]] = []

    def grow(fitted: Schema) -> StoredEncoders:
        log.info("data.vocabulary=extend: the encoders of %s, each vocabulary grown by the ids of data.path=%s it lacks",
                 source, getattr(config, "path", None))
        made.append(_grown(stored.schema, fitted.vocabularies))
        return replace(stored, schema=made[-1][0])

    data: DataModule = config.build(device=device, grow=grow)
    ((schema, tables),) = made
    say_unread_columns(config, data, stored, "extend")
    extended = data.encoders_document()
    assert extended is not None
    _carry(checkpointer, source, tables, schema, extended, "extend")
    return data


def _grown(old: Schema, now: dict[str, Vocabulary]) -> tuple[Schema, dict[str, RowCarry]]:
    """``old`` (the checkpoint's schema) with each vocabulary grown by ``now``'s (the fit of these files) ids it lacks
    (:func:`grown`) and its table sized to it, and how each grown table's trained rows carry over. A table whose column
    the fit gives no vocabulary (hashed: the sample does not cover it) keeps its vocabulary as stored, with a warning."""
    vocabularies = dict(old.vocabularies)
    sizes: dict[str, int] = {}
    tables: dict[str, RowCarry] = {}
    for col in old.sparse:
        then = old.vocabularies.get(col.name)
        if then is None or col.table_name in tables:
            continue
        names = [c.name for c in old.sparse if c.table_name == col.table_name]
        found = [now[n] for n in names if n in now]
        if not found:
            log.warning("data.vocabulary=extend: %s has no vocabulary in the fit of these files (its values outnumber what the "
                        "sample shows, or the column is gone), so its vocabulary stays as stored: new ids read its OOV rows",
                        col.table_name)
            continue
        vocabulary, _ = grown(then, found[0])
        for name in names:
            vocabularies[name] = vocabulary
        sizes[col.table_name] = vocabulary.capacity + vocabulary.oov_buckets
        # said once a table, when its rows are loaded (RowCarry.line), with the rows of its optimizer state
        tables[col.table_name] = replace(carry_rows(then, vocabulary), grown_from=then.capacity + then.oov_buckets)
    schema = replace(old, sparse=[replace(c, num_embeddings=sizes.get(c.table_name, c.num_embeddings)) for c in old.sparse],
                     vocabularies=vocabularies)
    return schema, tables
