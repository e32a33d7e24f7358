"""What ``python -m recsys_runner.evaluate`` and ``python -m recsys_runner.predict`` share.

Both take ``load=<checkpoint>`` (and, where needed, the training run's overrides: a checkpoint written by the
CLI carries them, :func:`with_training_overrides`): a ``step_*`` checkpoint directory, a
checkpoints root (its best checkpoint if one was kept, else its newest) or the training run's MLflow id
(whose ``checkpoint_dir`` tag names the root; :func:`recsys_runner.tracking.lineage.resolve_checkpoint`). The run is
built exactly as training builds it (:func:`recsys_runner.build.build`, so the sharded model, the data and
the evaluator are the training's own), with the checkpoint's weights loaded strictly instead of resuming:
no lock is taken on the training's checkpoint directory and no checkpoint is written.

Each launch is a new MLflow run in ``tracking.experiment`` (the training's, given the same overrides),
tagged ``entry=evaluate|predict``, ``checkpoint=<dir>``, ``checkpoint_step`` and, when the checkpoint's
``meta.json`` names its training run, ``source_run_id`` and ``mlflow.parentRunId`` (the UI nests it under
the training run), plus the reproducibility manifest (:mod:`recsys_runner.tracking.lineage`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import field
from pathlib import Path
from typing import Any, TypeVar

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig

from recsys_runner.build import Components
from recsys_runner.config import RunConfig, flatten, to_yaml, validate
from recsys_runner.errors import ConfigError
from recsys_runner.lifecycle import RunStart, link_tags
from recsys_runner.runtime import Launch
from recsys_runner.tracking import lineage
from recsys_runner.tracking.store import resolve_uri
from recsys_runner.tracking.tracker import MlflowTrackingConfig

log = logging.getLogger("recsys_runner")
T = TypeVar("T")

LOAD_KEY = "load"
"""The top-level key naming the checkpoint (``checkpoint`` is already the checkpoint config group)."""
LOAD_FIELD: tuple[str, Any, Any] = (LOAD_KEY, str | None, field(default=None))
"""``load`` as a field of an entry's root schema (:func:`recsys_runner.config.entry_schema`)."""


def checkpoint_to_load(cfg: DictConfig, run: RunConfig) -> Path:
    """The checkpoint directory ``load=`` names (see the module docstring); an MLflow run id is looked up in the
    store ``tracking.uri`` points at. Each rank resolves it on its own: it only reads files and run tags.

    Raises:
        ConfigError: ``load`` is not set.
        CheckpointError: nothing loadable there (:func:`recsys_runner.tracking.lineage.resolve_checkpoint`).
    """
    spec = cfg.get(LOAD_KEY)
    if not spec:
        raise ConfigError("load is required: the checkpoint to use, e.g. load=outputs/<date>/<time>/checkpoints (its best, "
                          "else newest checkpoint), load=<…>/checkpoints/step_00001000, or load=<MLflow run id of the training run>")
    lookup = lineage.run_tags(resolve_uri(run.tracking.uri)) if isinstance(run.tracking, MlflowTrackingConfig) else None
    return lineage.resolve_checkpoint(str(spec), lookup_run=lookup)


NEVER_CARRIED = ("hydra", "checkpoint.resume", "checkpoint.init_from")
"""Training overrides :func:`with_training_overrides` leaves out: Hydra's own (run dir, launcher, sweeper) and how
the training started (resume, fine-tune); they say nothing about the model or the data."""


def with_training_overrides(cfg: DictConfig, launch: Launch) -> DictConfig:
    """``cfg`` recomposed with the overrides of the training launch that wrote the checkpoint ``load`` names (saved in
    its ``meta.json``) before this command's own: ``python -m recsys_runner.evaluate load=<run id>`` then evaluates the
    model as trained (``model=dlrm model.embedding_dim=8 data=parquet …``) without repeating them, and any override
    given here wins over the training's of the same key. ``cfg`` unchanged outside the CLI, without ``load``, or for a
    checkpoint written outside the CLI (no saved overrides): the command's overrides must then describe the model.

    Raises:
        ConfigError / CheckpointError: as :func:`checkpoint_to_load`.
    """
    if not launch.from_cli or not cfg.get(LOAD_KEY):
        return cfg
    checkpoint = checkpoint_to_load(cfg, validate(cfg))
    saved = json.loads((checkpoint / "meta.json").read_text()).get("overrides") or []
    here = list(launch.overrides)
    parser = OverridesParser.create()
    given = {o.key_or_group for o in parser.parse_overrides(here)}
    carried = [text for text, o in zip(saved, parser.parse_overrides(saved), strict=True)
               if o.key_or_group not in given and not o.key_or_group.startswith(NEVER_CARRIED)]
    if not carried:
        return cfg
    log.info("using the overrides of the training launch that wrote %s: %s (those given here win)", checkpoint, " ".join(carried))
    return compose(config_name=launch.config_name, overrides=[*carried, *here])


def inference_start(c: Components, *, entry: str, checkpoint: Path, load: str,
                    extra_params: dict[str, Any] | None = None) -> RunStart:
    """The MLflow run of an evaluate or predict launch (rank 0; other ranks hold a null tracker): tags linking it to
    the training run and the checkpoint, the resolved config as params and ``config.yaml``
    (:func:`recsys_runner.lifecycle.tracked_run` adds the overrides and the manifest)."""
    return RunStart(
        run_name=f"{entry} {checkpoint.parent.name}/{checkpoint.name}",
        tags=link_tags(entry, checkpoint, c.loop.state.step, c.loop.state.run_id),
        params=flatten(c.run) | {LOAD_KEY: load} | (extra_params or {}), texts={"config.yaml": to_yaml(c.run)},
        world_size=c.env.world_size, device=c.env.device if c.env.is_main else None)
