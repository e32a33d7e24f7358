"""``checkpoint.*``: :class:`CheckpointConfig`, the schema of ``conf/checkpoint/*.yaml``, and :class:`TrainState`,
where training stands (what ``meta.json`` records)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from recsys_runner.configurable import Configurable
from recsys_runner.errors import require
from recsys_runner.runtime import Launch

if TYPE_CHECKING:
    from recsys_runner.checkpoint.policy import Checkpointer

RESUME_WORDS = ("auto", "latest", "never")
"""``checkpoint.resume`` values that are not a path."""


@dataclass(kw_only=True)
class CheckpointConfig(Configurable):
    """Schema of ``conf/checkpoint/*.yaml``; builds :class:`~recsys_runner.checkpoint.policy.Checkpointer`."""

    _target_: str = "recsys_runner.checkpoint.policy.Checkpointer"
    dir: str | None = None
    """Where checkpoints go; ``null`` is ``<Hydra run dir>/checkpoints`` under the CLI, new for every
    launch (an interrupted run prints the command that resumes it: its overrides plus
    ``checkpoint.dir=<that dir>``). Set it to a stable path to make "the same command" resume.
    One live run at a time may use a directory. Without Hydra and without a dir, nothing is saved. An object-store URI
    (``s3://bucket/runs/x``) keeps them there (docs/storage.md)."""
    every_steps: int | None = None
    """Save every this many steps (TorchEasyRec's save_checkpoints_steps)."""
    every_epochs: int | None = None
    """Save at the end of every this many epochs (save_checkpoints_epochs)."""
    at_end: bool = True
    """Save when training ends (also after an early stop)."""
    keep_last: int | None = 3
    """Keep this many newest step checkpoints; ``null`` keeps all. The best one is kept apart."""
    resume: str = "auto"
    """``auto``: continue from the newest checkpoint in ``dir`` if any; ``latest``: the same, but it is
    an error if there is none; ``never``: start fresh; or a path to one checkpoint directory."""
    init_from: str | None = None
    """Fine-tune: start a new run from this checkpoint's weights (a checkpoint dir, a checkpoints root whose newest is
    used, or the MLflow run id of the training that wrote them: its ``checkpoint_dir`` tag's root, looked up in
    ``tracking.uri``'s store). Ignored when resuming."""
    name_map: dict[str, str] = field(default_factory=dict)
    """For ``init_from``: ``{name in this model: name in the checkpoint}``; each key is replaced by its
    value as a substring of parameter names (TorchEasyRec's fine_tune_ckpt_param_map). On the command line add
    entries with ``+checkpoint.name_map.t_cat_0=t_cat_1``."""
    load_optimizer: bool = True
    """For ``init_from``: also restore optimizer state (false: fresh optimizer, like
    TorchEasyRec's ignore_restore_optimizer)."""
    best_metric: str | None = None
    """Keep the best checkpoint by this eval metric (e.g. ``eval/auc``), saved when an eval improves it."""
    best_mode: str | None = None
    """``null``: the metric's own direction (``eval/auc`` higher is better, ``eval/logloss`` lower;
    :func:`recsys_runner.metrics.registry.higher_is_better`), set by ``validate()``. ``max``/``min`` only for a metric
    without one (calibration); one contradicting the metric's direction is refused."""

    def __post_init__(self) -> None:
        require(self.every_steps is None or self.every_steps > 0, f"checkpoint.every_steps must be positive or null, got {self.every_steps}")
        require(self.every_epochs is None or self.every_epochs > 0, f"checkpoint.every_epochs must be positive or null, got {self.every_epochs}")
        require(self.keep_last is None or self.keep_last > 0, f"checkpoint.keep_last must be positive or null, got {self.keep_last}")
        require(self.best_mode in (None, "max", "min"), f"checkpoint.best_mode={self.best_mode!r} must be max, min or null")
        require(self.best_metric is None or self.best_metric.startswith("eval/"),
                f"checkpoint.best_metric={self.best_metric!r} must be an eval metric, e.g. eval/auc")
        require(self.resume in RESUME_WORDS or "/" in self.resume or os.sep in self.resume,
                f"checkpoint.resume={self.resume!r} must be one of {RESUME_WORDS} or a path to a checkpoint directory")

    def build(
        self, *, rank: int, world_size: int, device: torch.device, nan_guard: bool, launch: Launch = Launch(),
        run_checkpoints: Callable[[str], Path | None] | None = None,
    ) -> Checkpointer:
        """The :class:`~recsys_runner.checkpoint.policy.Checkpointer` for this process (``rank`` of ``world_size``,
        state on ``device``; ``nan_guard`` is ``train.nan_guard``; ``launch`` gives the default directory and the
        overrides saved with each checkpoint; ``run_checkpoints`` finds the checkpoints of an ``init_from`` run id)."""
        built: Checkpointer = self.component_class()(self, rank=rank, world_size=world_size, device=device, nan_guard=nan_guard,
                                                     launch=launch, run_checkpoints=run_checkpoints)
        return built


@dataclass
class TrainState:
    """Where training stands; saved in ``meta.json``."""

    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """The current epoch."""
    epoch_step: int = 0
    """Optimizer steps done within the current epoch (the data position). After an epoch's last step the position is the
    next epoch's start (``epoch + 1``, 0), so a checkpoint there resumes at it on any number of ranks
    (:func:`recsys_runner.train.loop._epoch_end`)."""
    run_id: str | None = None
    """The MLflow run this training logs to (so a resumed run continues it)."""
    best: float | None = None
    """Best ``checkpoint.best_metric`` so far."""
    resumed_from: str | None = None
    """The checkpoint this process resumed from (not saved)."""
    set_aside: tuple[str, ...] = ()
    """Damaged newer checkpoints moved aside before resuming from ``resumed_from`` (not saved)."""
    resume_changes: tuple[str, ...] = ()
    """The settings this launch changed from the one that wrote ``resumed_from`` (``key: before -> now``), warned and
    tagged on the MLflow run (:func:`recsys_runner.checkpoint.resume_changes.check_changes`; not saved)."""
    metrics: dict[str, float] | None = None
    """The eval metrics of ``step`` as the resumed checkpoint recorded them (``meta.json``'s ``metrics``, written from what
    the loop passes with each checkpoint: an eval of that step that completed and was logged), ``None`` when it recorded
    none: the resumed loop does not evaluate that step again (:mod:`recsys_runner.train.loop`)."""
