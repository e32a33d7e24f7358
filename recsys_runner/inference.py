"""What ``python -m recsys_runner.evaluate`` and ``python -m recsys_runner.predict`` share.

Both take ``load=<checkpoint>`` (and, where needed, the training run's overrides: a checkpoint written by the
CLI carries them, :func:`with_training_overrides`): a ``step_*`` checkpoint directory, a
checkpoints root (its best checkpoint if one was kept, else its newest) or the training run's MLflow id
(whose ``checkpoint_dir`` tag names the root; :func:`recsys_runner.tracking.lineage.resolve_checkpoint`). What they
score with is built by :func:`recsys_runner.inference_build.build_inference`: the training's sharded model, data and
evaluator, without its optimizers, schedules or pipeline, and the checkpoint's weights loaded strictly: no lock is
taken on the training's checkpoint directory and no checkpoint is written.

Each launch is a new MLflow run in ``tracking.experiment`` (the training's, given the same overrides),
tagged ``entry=evaluate|predict``, ``checkpoint=<dir>``, ``checkpoint_step`` and, when the checkpoint's
``meta.json`` names its training run, ``source_run_id`` and ``mlflow.parentRunId`` (the UI nests it under
the training run), plus the reproducibility manifest (:mod:`recsys_runner.tracking.lineage`).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recsys_runner import store_settings, stores, uris
from recsys_runner.checkpoint.resume_changes import renamed_override
from recsys_runner.config import flatten, register_configs, to_yaml, validate
from recsys_runner.config_keys import check_known_keys
from recsys_runner.data.base import SplitFiles
from recsys_runner.data.encoding.stored import ENCODERS_FILE
from recsys_runner.errors import CheckpointError, ConfigError, UserError
from recsys_runner.inference_build import Inference
from recsys_runner.lifecycle import RunStart, link_tags
from recsys_runner.paths import initialize_conf
from recsys_runner.runtime import Launch
from recsys_runner.store_settings import StorageConfig
from recsys_runner.tracking import datasets, lineage
from recsys_runner.tracking.datasets import DataRecord

log = logging.getLogger("recsys_runner")
T = TypeVar("T")

LOAD_KEY = "load"
"""The top-level key naming the checkpoint (``checkpoint`` is already the checkpoint config group)."""
LOAD_FIELD: tuple[str, Any, Any] = (LOAD_KEY, str | None, field(default=None))
"""``load`` as a field of an entry's root schema (:func:`recsys_runner.config.entry_schema`)."""


_NO_STORE = object()
"""``tracking.uri`` of a tracking option that has none (``tracking=none``): no MLflow store to look a run id up in."""


def checkpoint_to_load(cfg: DictConfig) -> Path:
    """The checkpoint directory ``load=`` names (see the module docstring); an MLflow run id is looked up in the
    store ``tracking.uri`` points at. Each rank resolves it on its own: it only reads files and run tags.

    The first thing evaluate, predict and export do, before the rest of the config is validated or any data is read:
    a ``load=`` that names no checkpoint is reported first (its training's overrides, which describe the data, could
    not be carried over either, so what the rest of the config says about the data is moot). Before it only keys the
    schema does not know are named (a misspelt ``+lod=…``, ``+export.dri=…``): that check reads nothing. Reads only
    ``load``, ``storage.*`` and ``tracking.uri``. Without ``load`` the config is validated first, then ``load`` is required.

    Raises:
        ConfigError: ``load`` is not set, ``storage.*`` is invalid, or (without ``load``) any config mistake.
        CheckpointError: nothing loadable there (:func:`recsys_runner.tracking.lineage.resolve_checkpoint`).
    """
    check_known_keys(cfg)  # a typo (+export.dri=…, +lod=…) is named first: it reads nothing, and may be why load looks wrong
    spec = cfg.get(LOAD_KEY)
    if not spec:
        validate(cfg)
        raise ConfigError("load is required: the checkpoint to use, e.g. load=outputs/<date>/<time>/checkpoints (its best, "
                          "else newest checkpoint), load=<…>/checkpoints/step_00001000, or load=<MLflow run id of the training run>")
    store_settings.configure(_storage(cfg))
    uri = OmegaConf.select(cfg, "tracking.uri", default=_NO_STORE)  # a tracking option without a uri (none) has no runs
    lookup = lineage.run_tags(uri) if uri is not _NO_STORE else None
    return lineage.resolve_checkpoint(str(spec), lookup_run=lookup)


def _storage(cfg: DictConfig) -> StorageConfig:
    """``cfg.storage`` as a validated :class:`~recsys_runner.store_settings.StorageConfig` (its ``__post_init__`` run)."""
    try:
        storage = OmegaConf.to_object(cfg.storage) if cfg.get("storage") is not None else StorageConfig()
    except OmegaConfBaseException as e:  # OmegaConf wraps the ConfigError raised in __post_init__
        if isinstance(e.__cause__, UserError):
            raise e.__cause__ from None
        raise ConfigError(f"storage: {str(e).splitlines()[0]}") from None
    assert isinstance(storage, StorageConfig)
    return storage


NEVER_CARRIED = ("hydra", "checkpoint.resume", "checkpoint.init_from", LOAD_KEY)
"""Training overrides :func:`with_training_overrides` leaves out: Hydra's own (run dir, launcher, sweeper) and how
the training started (resume, fine-tune); they say nothing about the model or the data."""

ENTRY_MODULES = ("recsys_runner.evaluate", "recsys_runner.predict", "recsys_runner.export")
"""The commands that take ``load=`` and so the training's overrides (:func:`carry_into_argv`)."""


@dataclass(frozen=True)
class Carried:
    """What :func:`carry_into_argv` did before Hydra composed the command's config."""

    checkpoint: Path
    """The checkpoint whose ``meta.json`` the overrides came from."""
    overrides: tuple[str, ...]
    """The training's overrides put before the command's own."""
    argv: tuple[str, ...]
    """The command line as typed (restored once Hydra has read it, so the manifest records what was typed)."""
    dropped: tuple[str, ...] = ()
    """The training's overrides left out: under a group this command chose another option of."""


_carried: Carried | None = None


@dataclass(frozen=True)
class TrainingOverrides:
    """What :func:`training_overrides` found for a command that loads a checkpoint."""

    checkpoint: Path
    """The checkpoint whose ``meta.json`` holds the training launch's overrides."""
    carried: list[str]
    """The training's overrides that go before the command's own."""
    own: list[str]
    """The command's overrides, ``+key=value`` made ``++key=value``."""
    dropped: list[str]
    """The training's overrides left out because the command chose another option of their group (``tracking=none``
    drops ``tracking.uri=…``)."""


def training_overrides(here: Sequence[str]) -> TrainingOverrides | None:
    """For a command whose overrides ``here`` include ``load=<checkpoint>``: the checkpoint, the overrides of the
    training launch that wrote it (its ``meta.json``) that ``here`` does not give a value for, and ``here`` with
    ``+key=value`` made ``++key=value`` (an option the training chose may hold the key the command adds: ``+`` would
    fail where the key exists, ``++`` adds or sets it). ``None`` without ``load`` or saved overrides (a checkpoint
    written outside the CLI), or when ``load`` names no checkpoint (the command then reports it first,
    :func:`checkpoint_to_load`).

    A choice the command makes wins with what lies under it: where ``here`` sets a key (``tracking=none``) to another
    value than the training did, the training's overrides under it (``tracking.uri=…``, ``tracking/…=…``) are left
    out, since they belong to the training's option (and the command's may not have those keys). Where both chose the
    same option (``data=parquet``), the training's settings of it are carried as usual.

    A run id is looked up in the store the command's own ``tracking=``/``tracking.*`` overrides name.
    """
    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(list(here))
    except Exception:  # noqa: BLE001 - Hydra reports a malformed override itself, with its own message
        return None
    spec = next((o.value() for o in parsed if o.key_or_group == LOAD_KEY and o.package is None and not o.is_sweep_override()), None)
    if not isinstance(spec, str) or not spec:
        return None
    try:
        tracking = [text for text, o in zip(here, parsed, strict=True) if o.key_or_group.startswith("tracking")]
        checkpoint = lineage.locate_checkpoint(spec, lookup_run=_run_lookup(tracking)).path  # the command warns of a fallback
        saved = json.loads(stores.read_bytes(str(checkpoint / "meta.json"), CheckpointError)).get("overrides") or []
        saved = [renamed_override(text) for text in saved]  # a key renamed since the training: under its new name
        saved_parsed = parser.parse_overrides(saved)
    except Exception:  # noqa: BLE001 - nothing to carry; the command's own resolution says what is wrong
        return None
    given = {o.key_or_group for o in parsed}
    trained = {o.key_or_group: o.value() for o in saved_parsed}
    rechosen = [section for o in parsed if o.package is None and (o.key_or_group not in trained or trained[o.key_or_group] != o.value())
                for section in (f"{o.key_or_group.replace('/', '.')}.", f"{o.key_or_group}/")]
    kept = [(text, o) for text, o in zip(saved, saved_parsed, strict=True)
            if o.key_or_group not in given and not o.key_or_group.startswith(NEVER_CARRIED)]
    carried = [text for text, o in kept if not o.key_or_group.startswith(tuple(rechosen))]
    dropped = [text for text, o in kept if o.key_or_group.startswith(tuple(rechosen))]
    if not carried:
        return None
    own = [f"+{text}" if o.is_add() and o.package is None and "/" not in o.key_or_group else text for text, o in zip(here, parsed, strict=True)]
    return TrainingOverrides(checkpoint, carried, own, dropped)


def _run_lookup(tracking: list[str]) -> lineage.RunTags | None:
    """A run-tags lookup in the MLflow store the command's tracking overrides (else the config's default) name; ``None``
    with ``tracking=none``. Composes the training config with those overrides alone (the others may need the
    training's options to compose)."""
    register_configs()
    if GlobalHydra.instance().is_initialized():  # inside @hydra.main
        cfg = compose(config_name="config", overrides=tracking)
    else:
        with initialize_conf():
            cfg = compose(config_name="config", overrides=tracking)
    if OmegaConf.select(cfg, "tracking.uri", default="<none>") == "<none>":
        return None
    return lineage.run_tags(OmegaConf.select(cfg, "tracking.uri"))


def carry_into_argv(argv: list[str]) -> Carried | None:
    """Put the training's overrides into ``argv`` (in place) before the command's own when it loads a checkpoint written
    by the CLI (:func:`training_overrides`), so that Hydra composes the training's config plus this command's changes:
    ``python -m recsys_runner.evaluate load=<run> data.eval_path=<file>`` then composes where the training used file
    data, whereas the command line alone would set ``data.eval_path`` on the default (generated) data, which has no such
    key. Runs when an entry module is run as ``python -m`` (:func:`carry_training_overrides`, before ``@hydra.main``
    composes); :func:`with_training_overrides` restores the typed command line and says what was carried.
    """
    from hydra._internal.utils import get_args_parser

    try:
        args, _ = get_args_parser().parse_known_args(argv[1:])
    except (Exception, SystemExit):  # noqa: BLE001 - Hydra's own parse reports bad arguments
        return None
    here = list(args.overrides or [])
    found = training_overrides(here) if here else None
    if found is None:
        return None
    typed = tuple(argv)
    first = argv.index(here[0], 1)  # the overrides are one run of arguments (Hydra's positional list)
    argv[first:first + len(here)] = [*found.carried, *found.own]
    return Carried(found.checkpoint, tuple(found.carried), typed, tuple(found.dropped))


def carry_training_overrides() -> None:
    """:func:`carry_into_argv` for ``python -m recsys_runner.evaluate|predict|export``, called by each of them before its
    ``@hydra.main`` composes the command line; nothing when the process runs anything else."""
    global _carried
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name in ENTRY_MODULES and _carried is None:
        _carried = carry_into_argv(sys.argv)


def with_training_overrides(cfg: DictConfig, launch: Launch) -> DictConfig:
    """``cfg`` composed with the overrides of the training launch that wrote the checkpoint ``load`` names (saved in
    its ``meta.json``) before this command's own: ``python -m recsys_runner.evaluate load=<run id>`` then evaluates the
    model as trained (``model=dlrm model.embedding_dim=8 data=parquet …``) without repeating them, any override given
    here wins over the training's of the same key, and keys of the training's options can be set
    (``data.eval_path=<file>`` where the training read files). ``cfg`` unchanged outside the CLI, without ``load``, or
    for a checkpoint written outside the CLI (no saved overrides): the command's overrides must then describe the model.

    Under ``python -m`` the overrides were put before the command's before Hydra composed, so Hydra composed
    them (:func:`carry_into_argv`); this then only says so. Otherwise (``main`` called from Python) ``cfg`` is
    recomposed here.
    """
    global _carried
    if _carried is not None:
        done, _carried = _carried, None
        sys.argv[:] = list(done.argv)  # the manifest's command: as typed
        _log_carried(done.checkpoint, done.overrides, done.dropped)
        return cfg
    if not launch.from_cli or not cfg.get(LOAD_KEY):
        return cfg
    found = training_overrides(launch.overrides)
    if found is None:
        return cfg
    _log_carried(found.checkpoint, found.carried, found.dropped)
    return compose(config_name=launch.config_name, overrides=[*found.carried, *found.own])


def _log_carried(checkpoint: Path, carried: Sequence[str], dropped: Sequence[str]) -> None:
    log.info("using the overrides of the training launch that wrote %s: %s (those given here win)", checkpoint, " ".join(carried))
    if dropped:
        log.info("left out of them, as this command chose another option of their group: %s", " ".join(dropped))


def inference_start(built: Inference, *, entry: str, checkpoint: Path, load: str,
                    extra_params: dict[str, Any] | None = None, scored: SplitFiles | None = None) -> RunStart:
    """The MLflow run of an evaluate or predict launch (rank 0; other ranks hold a null tracker): tags linking it to
    the training run and the checkpoint, the resolved config as params and ``config.yaml``
    (:func:`recsys_runner.lifecycle.tracked_run` adds the overrides and the manifest). The checkpoint named is the one
    whose weights were loaded: ``checkpoint``, or the newer one loaded instead when a run writing there rotated it away
    (:meth:`recsys_runner.checkpoint.policy.Checkpointer.load_weights`). ``scored``: the files a predict scores, a
    dataset input of its own (context ``prediction``)."""
    if built.state.resumed_from:
        checkpoint = uris.as_path(built.state.resumed_from)
    records = data_inputs(built, checkpoint, scored) if built.env.is_main else []
    return RunStart(
        run_name=f"{entry} {checkpoint.parent.name}/{checkpoint.name}",
        tags=link_tags(entry, checkpoint, built.state.step, built.state.run_id),
        params=flatten(built.run) | {LOAD_KEY: load} | (extra_params or {}), texts={"config.yaml": to_yaml(built.run)},
        world_size=built.env.world_size, device=built.env.device if built.env.is_main else None, datasets=records)


def data_inputs(built: Inference, checkpoint: Path, scored: SplitFiles | None = None) -> list[DataRecord]:
    """The data an evaluate or predict launch reads (:mod:`recsys_runner.tracking.datasets`), its columns typed by the
    encoders the checkpoint stores, and predict's ``scored`` files; a warning where the training and eval data differ
    from the data the checkpoint was trained on."""
    try:
        encoders: bytes | None = stores.read_bytes(uris.join(str(checkpoint), ENCODERS_FILE), CheckpointError)
    except FileNotFoundError:
        encoders = None
    records = datasets.describe(built.run.served_data, built.data, max_digest_mb=built.run.tracking.dataset_digest_max_mb,
                                encoders=encoders, scored=scored)
    trained = datasets.read_stored(checkpoint)
    datasets.note_changes(trained, records, checkpoint)
    if scored is None:  # an evaluate: its eval rows are the split's (a predict scores its own files)
        datasets.note_split_changes(trained, records, checkpoint)
    return records
