"""The checkpoint policy: :class:`Checkpointer` decides when to save, what to keep, and guards what is saved; where
checkpoints live is a :class:`~recsys_runner.checkpoint.storage.CheckpointStorage` (DCP on a file system, or DCP's fsspec
storage in an object store: :mod:`~recsys_runner.checkpoint.object_storage`).

**When**: the loop only reports what happened — :meth:`Checkpointer.loss_logged` (a log step's mean loss),
:meth:`~Checkpointer.after_step`, :meth:`~Checkpointer.on_interrupt`, :meth:`~Checkpointer.on_end`,
:meth:`~Checkpointer.maybe_save_best` (an eval) — and the checkpointer saves every ``every_steps`` steps, every
``every_epochs`` epochs, at the end (``at_end``) and on an interruption.

**What is kept**: the newest ``keep_last`` step checkpoints; the best one by ``best_metric`` lives apart
(``best-step_<n>``). Resuming an older checkpoint moves the later ones aside (``abandoned-step_<n>``): they
continued it otherwise, and must not pass for this run's.

**Guarded** (``train.nan_guard``, :mod:`~recsys_runner.checkpoint.guard`): a non-finite loss or weights are never
saved; on such a stop the checkpoints no finite loss came after are set aside (``diverged-step_<n>``), so the last
good one the error names is one a resume can continue from.

**One writer**: a run holds ``<checkpoint.dir>/.lock`` (:class:`~recsys_runner.checkpoint.lock.DirectoryLock`) from
restore to close, so a second live launch on the same directory is refused at start, naming the holder; a lock left
by a killed process is free again (the kernel drops it with the process; in an object store, a conditional create
whose abandoned lock is taken over: :class:`~recsys_runner.checkpoint.lock.ObjectStoreLock`).

**Where a CLI run's checkpoints are**: ``checkpoint.dir`` defaults to ``<Hydra run dir>/checkpoints``, a new
directory per launch, so relaunching the bare command starts a new run; an interrupted run prints the exact command
that resumes it (:meth:`recsys_runner.runtime.Launch.resume_command`, the original overrides plus
``checkpoint.dir=<absolute dir>``). What a run starts from: :mod:`~recsys_runner.checkpoint.resume`.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchrec.optim.keyed import CombinedOptimizer

from recsys_runner import provenance, uris
from recsys_runner.checkpoint import resume, resume_changes
from recsys_runner.checkpoint.carried_rows import CarriedRows
from recsys_runner.checkpoint.config import RESUME_WORDS, CheckpointConfig, TrainState
from recsys_runner.checkpoint.guard import check_finite, finite_state, task_causes
from recsys_runner.checkpoint.lock import DirectoryInUse, lock_for
from recsys_runner.checkpoint.object_storage import storage_for
from recsys_runner.checkpoint.storage import (
    FORMAT,
    FORMAT_KEY,
    RUN_DIR_FOLDER,
    CheckpointStorage,
    checkpoint_name,
    step_of,
)
from recsys_runner.checkpoint.weights import TrainingParts
from recsys_runner.distributed.env import decided_on_rank0
from recsys_runner.distributed.peers import peer_gone
from recsys_runner.errors import CheckpointError, CheckpointWriteFailed, ConfigError
from recsys_runner.metrics.registry import improved
from recsys_runner.runtime import Launch

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves and restores the run's state; see the module docstring."""

    def __init__(
        self, config: CheckpointConfig, *, rank: int = 0, world_size: int = 1, device: torch.device | None = None,
        nan_guard: bool = True, launch: Launch = Launch(), storage: CheckpointStorage | None = None,
        run_checkpoints: Callable[[str], Path | None] | None = None,
    ) -> None:
        self.config = config
        self.run_checkpoints = run_checkpoints
        """The checkpoints root of the MLflow run ``init_from`` names, ``None`` for a path: the builder's lookup
        (:func:`recsys_runner.tracking.lineage.run_checkpoints`; this layer reads no tracking store); ``None``: paths only."""
        resolved = config.dir or launch.under_output_dir(RUN_DIR_FOLDER)
        if config.dir is None and resolved is not None and world_size > 1:
            # each rank names its Hydra run directory from its own clock: ranks started a second apart would write one
            # checkpoint into two directories, which a resume then finds damaged. Rank 0's is every rank's.
            resolved = decided_on_rank0(lambda: resolved, rank, world_size)
        self.dir = uris.as_path(resolved) if resolved else None
        """``checkpoint.dir``, or its CLI default: rank 0's run directory's ``checkpoints`` (``None``: nothing is saved)."""
        self.rank, self.world_size = rank, world_size
        self.device, self.nan_guard = device or torch.device("cpu"), nan_guard
        self.storage: CheckpointStorage = storage or storage_for(self.dir, rank, world_size)
        """Where the checkpoints are written and read."""
        self.last_saved: str | None = None
        self._writing: Path | None = None
        """The step checkpoint being written (:meth:`resumable`), until its write and closing barriers end."""
        self.overrides = list(launch.overrides) if launch.from_cli else None
        """The launch's command-line overrides, saved in each ``meta.json``: evaluate, predict and export rebuild the
        training's config from them (:func:`recsys_runner.inference.with_training_overrides`). ``None`` outside a CLI."""
        self.launched = resume_changes.Launched(self.overrides, launch.settings if launch.from_cli else None, launch.cwd)
        """What this launch trains with, saved in each ``meta.json`` (``overrides``, ``config``, ``cwd``) for a resume to
        compare with (:func:`~recsys_runner.checkpoint.resume_changes.check_changes`)."""
        self.verified_step = 0
        """Step checkpoints before this step are known good: a finite loss was computed from later weights."""
        self._lock = lock_for(self.dir) if self.dir is not None and rank == 0 else None
        self._parts: TrainingParts | None = None
        self.files: dict[str, bytes] = {}
        """Readable files written into every checkpoint beside its tensors (the data's fitted encoders)."""
        self.carry: CarriedRows | None = None
        """For ``init_from`` with the vocabularies fitted anew (``data.vocabulary=refit``): the tables whose trained rows
        are carried over by id (:class:`~recsys_runner.checkpoint.carried_rows.CarriedRows`), set by the builder."""
        self.resume_changes: tuple[str, ...] = ()
        """The settings changed since the launch that wrote the checkpoint resumed (``key: before -> now``), warned."""
        self.data_shards: int | None = None
        """The data's shards per rank (:meth:`~recsys_runner.data.base.DataModule.shards_per_rank`), set by the builder: saved
        in ``meta.json`` beside the world size, compared by a resume in the middle of an epoch."""
        self._chosen: tuple[Path | None, tuple[str, ...], Path | None] | None = None
        """What :meth:`restore` reads, once chosen (:meth:`restore_source`): the checkpoint resumed from, the damaged
        ones set aside on the way, the ``init_from`` one."""
        if self.dir is None and (config.every_steps or config.every_epochs or config.best_metric or config.resume == "latest"):
            raise ConfigError(
                "checkpoint.every_steps/every_epochs/best_metric/resume=latest need a directory: set checkpoint.dir=<path> "
                "(the CLI defaults it to <Hydra run dir>/checkpoints)"
            )

    # -- what is saved ---------------------------------------------------------------------------
    def attach(self, *, model: torch.nn.Module, optimizer: CombinedOptimizer, tensors: Mapping[str, Any], objects: Mapping[str, Any]) -> None:
        """Register the stateful parts: ``model`` and ``optimizer`` (keyed optimizers), extra tensor
        holders (``tensors``: name → object with ``state_dict``/``load_state_dict`` of tensors, e.g.
        EMA) and small picklable-state objects (``objects``: schedules, scaler, early stopping)."""
        self._parts = TrainingParts(model, optimizer, dict(tensors), dict(objects))

    @property
    def parts(self) -> TrainingParts:
        """What :meth:`attach` registered."""
        assert self._parts is not None, "Checkpointer.attach() first"
        return self._parts

    def _tensor_state(self, with_optimizer: bool = True) -> dict[str, Any]:
        return self.parts.tensor_state(with_optimizer)

    # -- when ------------------------------------------------------------------------------------
    def due(self, step: int, epoch_ended: int | None = None) -> bool:
        """Whether a periodic checkpoint is due after ``step``, which ended epoch ``epoch_ended`` if not ``None``."""
        if self.dir is None:
            return False
        by_epoch = epoch_ended is not None and self.config.every_epochs is not None and self.config.every_epochs > 0 \
            and (epoch_ended + 1) % self.config.every_epochs == 0
        return by_epoch or bool(self.config.every_steps and step % self.config.every_steps == 0)

    def kept_through_a_crash(self) -> list[str]:
        """When this run writes checkpoints that a crash (an OOM kill, ``kill -9``, a lost node) leaves to resume from:
        ``every N steps``, ``every N epochs``, ``on a better <metric>``; empty when it keeps none.

        Why: the start-up line says how to resume. The end's checkpoint and a signal's are written by a run still in
        control; promising a resume "if this run dies" is wrong for a run that writes none of the periodic kind.
        """
        c = self.config
        during = [f"every {n} {unit}" for n, unit in ((c.every_steps, "steps"), (c.every_epochs, "epochs")) if n]
        return during + ([f"on a better {c.best_metric}"] if c.best_metric is not None else [])

    # -- saving ----------------------------------------------------------------------------------
    def save(self, state: TrainState, metrics: Mapping[str, float] | None = None, best: bool = False) -> str | None:
        """Write a checkpoint of ``state`` atomically; returns its path (``None`` without a dir). A store that fails
        meanwhile raises :class:`~recsys_runner.errors.CheckpointWriteFailed` naming the last complete checkpoint."""
        try:
            return self._save(state, metrics, best)
        except CheckpointWriteFailed:
            raise
        except CheckpointError as e:
            raise CheckpointWriteFailed(str(e), self.last_saved) from None

    def _save(self, state: TrainState, metrics: Mapping[str, float] | None, best: bool) -> str | None:
        if self.dir is None:
            return None
        final = self.dir / checkpoint_name(state.step, best)
        if self.storage.is_complete(final):
            return str(final)
        meta = {k: v for k, v in asdict(state).items() if k not in ("resumed_from", "resume_changes")}
        meta["metrics"] = dict(metrics or {})
        meta[FORMAT_KEY] = FORMAT
        meta[provenance.KEY] = provenance.written_by()
        meta["world_size"] = self.world_size
        if self.data_shards is not None:
            meta[resume_changes.DATA_SHARDS_KEY] = self.data_shards
        if self.overrides is not None:
            meta["overrides"] = self.overrides
        if self.launched.config is not None:
            meta["config"], meta["cwd"] = self.launched.config, self.launched.cwd
        ranked = {"objects": self.parts.object_states(), "rng": resume.rng_state()}
        self._writing = None if best else final
        try:
            self.storage.write(final, self._tensor_state(), ranked, meta, self.files)
            if not best:  # whole from here: a rotation that fails next must name it as the one to resume from
                self.last_saved = str(final)
            if self.rank == 0:
                self._prune(best)
            self._barrier()
        except RuntimeError as e:
            # a peer that dies after rank 0 wrote meta.json (the write's last file) fails only the closing barriers:
            # the checkpoint is whole, and the survivor's resume command must name it, not say that none was written
            if peer_gone(e) is not None:
                self.last_saved = self.resumable()
            raise
        finally:
            self._writing = None
        if self.rank == 0:  # one line per checkpoint, not one per rank
            log.info("checkpoint saved: %s", final)
        return str(final)

    def resumable(self) -> str | None:
        """The checkpoint a resume continues from now: the last one saved, or the step checkpoint being written once it is
        whole (its ``meta.json`` is written before the closing barriers, which a lost peer fails or leaves waiting)."""
        if self._writing is not None and self.storage.is_complete(self._writing):
            return str(self._writing)
        return self.last_saved

    # -- the checkpoint policy the loop drives: when, guarded, best ------------------------------
    def loss_logged(self, step: int, mean_loss: float) -> None:
        """NaN guard at a log step. ``mean_loss`` is the mean since the last log, so finite means every step's loss
        was, and the checkpoints before ``step`` hold good weights; non-finite raises
        :class:`~recsys_runner.checkpoint.guard.NonFiniteLossError`."""
        if self.nan_guard:
            self._refuse_nonfinite(mean_loss, step)
            self.verified_step = max(self.verified_step, step)

    def after_step(self, state: TrainState, loss: torch.Tensor, metrics: Mapping[str, float] | None, epoch_ended: int | None) -> None:
        """Save the periodic checkpoint if one is due after this step (see :meth:`due`)."""
        if self.due(state.step, epoch_ended):
            self.save_guarded(state, loss, metrics)

    def on_interrupt(self, state: TrainState, loss: torch.Tensor, metrics: Mapping[str, float] | None) -> str | None:
        """The checkpoint an interruption (a signal, ``train.stop_after_steps``) resumes from; its path or ``None``."""
        return self.save_guarded(state, loss, metrics)

    def on_end(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        """The checkpoint at the end of training (also after an early stop), when ``at_end``."""
        if self.config.at_end:
            self.save_guarded(state, None, metrics)

    def save_guarded(self, state: TrainState, loss: torch.Tensor | None, metrics: Mapping[str, float] | None) -> str | None:
        """:meth:`save`, unless the NaN guard finds the last loss or the weights non-finite: then raise
        :class:`~recsys_runner.checkpoint.guard.NonFiniteLossError` and keep the good checkpoints. The loss of step n is
        computed before step n's update, so a finite loss does not prove finite weights; the weights are checked too
        (one pass, on every rank)."""
        if self.nan_guard and loss is not None:
            self._refuse_nonfinite(float(loss), state.step)
        if self.nan_guard and self.dir is not None and not finite_state(self.parts.model, self.world_size, self.device):
            self._refuse_nonfinite(math.nan, state.step, what="the model's weights are not finite")
        return self.save(state, metrics)

    def _refuse_nonfinite(self, value: float, step: int, what: str | None = None) -> None:
        """Raise :class:`~recsys_runner.checkpoint.guard.NonFiniteLossError` for a non-finite ``value``, after setting
        aside the checkpoints no finite loss has followed, so the one it names (and a resume picks) is truly good; the
        message names a multi-task model's tasks whose losses went non-finite (read only now, off the normal path)."""
        if not math.isfinite(value):
            check_finite(value, step, self.drop_unverified(), what, task_causes(self.parts.model))

    def drop_unverified(self) -> str | None:
        """After a non-finite loss: move the step checkpoints no finite loss has followed aside (``diverged-step_<n>``)
        and return the newest remaining one, the last good checkpoint, which a resume then picks."""
        if self.dir is None:
            return None
        kept = []
        for path in self.storage.checkpoints(self.dir):
            if step_of(path) < self.verified_step:
                kept.append(path)
            elif self.rank == 0:
                log.warning("no finite train loss came after checkpoint %s, so its weights may be diverged: moved aside to %s",
                            path, self.storage.set_aside(path, "diverged"))
        self.last_saved = str(kept[-1]) if kept else None
        return self.last_saved

    def maybe_save_best(self, state: TrainState, metrics: Mapping[str, float]) -> str | None:
        """Save a ``best-*`` checkpoint when ``metrics[best_metric]`` improves on ``state.best``."""
        if self.config.best_metric is None or self.dir is None:
            return None
        value = metrics[self.config.best_metric]  # a key eval logs: config_metrics.check_eval_keys made sure before the first step
        if not improved(value, state.best, higher_is_better=self.config.best_mode == "max"):
            return None
        state.best = value
        return self.save(state, metrics, best=True)

    def _prune(self, best: bool) -> None:
        assert self.dir is not None
        keep = 1 if best else self.config.keep_last
        if keep is None:
            return
        for old in self.storage.checkpoints(self.dir, best=best)[:-keep]:
            self.storage.remove(old)

    # -- restoring -------------------------------------------------------------------------------
    def lock(self) -> None:
        """Become ``dir``'s one writer, or raise :class:`CheckpointError` naming the live holder (host, PID).

        Called at the start of the run, before anything is built or logged; released by :meth:`close`."""
        decided_on_rank0(self._take_lock, self.rank, self.world_size)

    def restore_source(self) -> Path | None:
        """The checkpoint :meth:`restore` will read — the one resumed from, else ``init_from``'s, else ``None`` — chosen
        once (on rank 0: damaged ones are set aside on the way), so that what is read from it before the model exists
        (the data's encoders) and the weights come from the same checkpoint."""
        if self._chosen is None:
            path, set_aside, changes = decided_on_rank0(self._choose, self.rank, self.world_size)
            init = self._init_source() if path is None and self.config.init_from is not None else None
            self._chosen = (path, set_aside, init)
            self.resume_changes = changes
        return self._chosen[0] or self._chosen[2]

    def _choose(self) -> tuple[Path | None, tuple[str, ...], tuple[str, ...]]:
        """(rank 0) The checkpoint to resume, the damaged ones set aside, and the changed settings resumed with
        (:func:`~recsys_runner.checkpoint.resume_changes.check_changes`: refused before anything is built; warned about once loaded)."""
        path, set_aside = resume.choose(self.config, self.storage, self.dir)
        if path is None:
            return None, set_aside, ()
        changes = resume_changes.check_changes(resume_changes.Launched.saved(self.storage.read_meta(path)), self.launched, path)
        return path, set_aside, tuple(c.line() for c in changes)

    def _init_source(self) -> Path:
        """``init_from``'s checkpoint, a run id looked up on rank 0 first: only for a run that does not resume, which so
        never asks the store again (nor fails where it is down, or the source's checkpoints are gone since)."""
        spec, find = self.config.init_from, self.run_checkpoints
        assert spec is not None
        root = decided_on_rank0(lambda: find(spec), self.rank, self.world_size) if find is not None else None
        return resume.init_source(self.config, self.storage, root)

    def init_tags(self) -> dict[str, str]:
        """The MLflow tags of a fine-tune's lineage (``init_from``: the checkpoint started from, its step and the run that
        wrote it), so that day N's run names day N-1's; ``{}`` when resuming or starting fresh."""
        self.restore_source()
        assert self._chosen is not None
        path, _, init = self._chosen
        if path is not None or init is None:
            return {}
        meta = self.storage.read_meta(init)
        tags = {"init_from": str(init if uris.is_remote(init) else init.absolute()), "init_from_step": str(meta.get("step"))}
        return tags | ({"init_from_run_id": str(meta["run_id"])} if meta.get("run_id") else {})

    def resuming(self) -> bool:
        """Whether :meth:`restore` resumes a run (rather than fine-tuning from ``init_from`` or starting fresh)."""
        self.restore_source()
        assert self._chosen is not None
        return self._chosen[0] is not None

    def restore(self) -> TrainState:
        """Resume, fine-tune or start fresh, per ``resume``/``init_from``; returns where to start
        (:mod:`~recsys_runner.checkpoint.resume`)."""
        self.restore_source()
        assert self._chosen is not None
        path, set_aside, init = self._chosen
        if path is not None:
            state = resume.load_run(self.storage, path, self.parts, self.config, strict=True, rank=self.rank, world_size=self.world_size)
            state.set_aside = set_aside
            state.resume_changes = self.resume_changes
            if self.rank == 0:
                resume_changes.note_changes(path, self.resume_changes)
            meta = self.storage.read_meta(path)
            for said in (resume_changes.rows_per_step_change(meta, path, self.world_size),
                         resume_changes.epoch_cut_change(meta, state, self.world_size, self.data_shards)):
                if said is not None:
                    if self.rank == 0:
                        log.warning("resuming %s %s", path, said[1])
                    state.resume_changes = (*state.resume_changes, said[0])
            if self.config.resume not in RESUME_WORDS:  # auto/latest took the newest whole one: only the best can be later
                decided_on_rank0(functools.partial(self._abandon_after, path, state.step), self.rank, self.world_size)
            self.last_saved = str(path)
            self.verified_step = state.step + 1  # the checkpoint resumed from is trusted
            return state
        if init is not None:
            resume.load_run(self.storage, init, self.parts, self.config, strict=False, rank=self.rank, world_size=self.world_size,
                            carry=self.carry)
        if self.config.resume == "never" and self.dir is not None:  # after init_from, which may name one of them
            decided_on_rank0(self._abandon_earlier_run, self.rank, self.world_size)
        return TrainState()

    def _abandon_earlier_run(self) -> None:
        """(rank 0, ``checkpoint.resume=never``) Move aside (``abandoned-<name>``) every checkpoint already in ``dir``, with a
        warning: this run starts fresh, and an earlier run's checkpoints left there pass for its own. A save at a step one
        of them holds keeps that one (the run's end checkpoint at step 20 was the earlier run's step_00000020, its own
        weights never written, and the MLflow run pointed at it), ``resume=auto`` would continue the earlier run from its
        newest, and ``load=<dir>`` would score its best."""
        assert self.dir is not None
        earlier = [p for best in (False, True) for p in self.storage.checkpoints(self.dir, best=best, complete=False)]
        moved = self._set_aside_as_abandoned(earlier, f"checkpoint.resume=never: starting a new run in {self.dir}")
        if moved:
            log.warning("checkpoint.resume=never starts a new run in %s, which holds checkpoints of an earlier run: moved them "
                        "aside to %s (delete them when not needed), as this run's own would otherwise not replace them at the "
                        "same steps, a relaunch with checkpoint.resume=auto would continue the earlier run and load= would read "
                        "its checkpoints. To keep runs apart, give each its own checkpoint.dir", self.dir, ", ".join(moved))

    def _set_aside_as_abandoned(self, paths: list[Path], doing: str) -> list[str]:
        """Move ``paths`` (checkpoints of ``dir``) aside as ``abandoned-<name>``; returns where they went. What a cut-off write
        or removal left in an object store under such a name (no ``meta.json``: ``storage.unfinished``) is no checkpoint,
        so it is deleted with a log line naming ``doing``, not copied aside."""
        assert self.dir is not None
        unfinished = [p for p in self.storage.unfinished(self.dir) if p in paths]
        for p in unfinished:
            self.storage.remove(p)
        if unfinished:
            log.warning("%s: deleted %s, left by a checkpoint write or removal cut off part-way (no meta.json), so not a "
                        "checkpoint", doing, ", ".join(str(p) for p in unfinished))
        return [str(self.storage.set_aside(p, "abandoned")) for p in paths if p not in unfinished]

    def _abandon_after(self, resumed: Path, step: int) -> None:
        """(rank 0, once the checkpoint ``checkpoint.resume=<path>`` names loaded) Move aside (``abandoned-<name>``) the
        checkpoints of ``dir`` after ``step``, with a warning: resuming an older checkpoint abandons the run that wrote
        them (``resume=auto`` takes the newest whole one, so only a best one written after it, by the same run, is later:
        kept, as a preempted run that resumes over and over would pile up full copies of it aside). Kept, they would pass for this run's: a save at a step whose checkpoint exists keeps the one there, a newer
        best outranks this run's best in the rotation, and ``resume=auto`` would continue the abandoned run. What a cut-off
        write or removal left in an object store under a later name (no ``meta.json``: ``storage.unfinished``) is no
        checkpoint, so it is deleted with a log line, not copied aside."""
        assert self.dir is not None
        later = [p for best in (False, True) for p in self.storage.checkpoints(self.dir, best=best, complete=False)
                 if step_of(p) > step and p != resumed]
        moved = self._set_aside_as_abandoned(later, f"resuming {resumed} (step {step})")
        if moved:
            log.warning("resuming %s (step %d) abandons the later checkpoints of %s, which continued it otherwise: moved aside "
                        "to %s (delete them when not needed)", resumed, step, self.dir, ", ".join(moved))

    def load_weights(self, path: Path) -> TrainState:
        """Load the model's and the EMA's weights of checkpoint ``path`` (evaluate, predict): nothing else is read,
        nothing is locked or written, the optimizer keeps its fresh state. Strict, and past a checkpoint a run still
        writing there rotated away: :func:`~recsys_runner.checkpoint.resume.load_weights` says how."""
        return resume.load_weights(self.storage, path, self.parts, rank=self.rank, world_size=self.world_size)

    def close(self) -> None:
        """Release ``dir`` for the next run (also released by the OS if this process dies)."""
        if self._lock is not None:
            self._lock.release()

    def _take_lock(self) -> None:
        if self._lock is None:
            return
        try:
            self._lock.acquire()
        except DirectoryInUse as e:
            raise CheckpointError(f"checkpoint.dir: {e}. Two runs writing one directory would overwrite each other's checkpoints "
                                  "and log into one MLflow run. Fix: wait for that run to end (or stop it), or give this run its "
                                  "own checkpoint.dir") from None

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()
