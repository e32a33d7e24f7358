"""Checkpoints: save, keep, select and restore the whole training state.

A checkpoint is a directory ``<checkpoint.dir>/step_<step>`` (or ``best-step_<step>``) holding

* the tensors, written with ``torch.distributed.checkpoint`` (DCP) by every rank: the
  DistributedModelParallel state (each rank writes its own embedding shards), the fused sparse
  and dense optimizer state, the EMA weights — keys ``model/<fqn>``, ``optim/<key>/<state>``, ``ema/<fqn>``;
* ``rank<r>.pt`` per rank: lr schedules, loss scaler, early-stopping state and the RNG states;
* ``meta.json``, written last by rank 0: step, epoch, position in the epoch, the MLflow run id,
  the best metric so far.

**Atomic**: everything is written into ``.tmp-<name>`` and renamed to ``<name>`` only when
complete; a directory without ``meta.json`` and DCP's ``.metadata`` is never considered, so a
crash mid-write leaves the previous checkpoints as they were. The newest ``keep_last`` step
checkpoints are kept; the best one by ``best_metric`` lives apart (``best-step_<n>``).

**Policy**: the loop only reports what happened — :meth:`Checkpointer.loss_logged` (a log step's mean
loss), :meth:`~Checkpointer.after_step`, :meth:`~Checkpointer.on_interrupt`, :meth:`~Checkpointer.on_end`,
:meth:`~Checkpointer.maybe_save_best` (an eval) — and the checkpointer decides when to save, refuses to
save a non-finite loss or weights (``train.nan_guard``), and on such a stop sets aside the checkpoints
no finite loss came after (``diverged-step_<n>``), so the last good one it names is one a resume can
continue from.

**One writer**: a run holds ``<checkpoint.dir>/.lock`` (:class:`~recsys_runner.checkpoint.lock.DirectoryLock`)
from restore to close, so a second live launch on the same directory is refused at start, naming the
holder; a lock left by a killed process is free again (the kernel drops it with the process).

Restoring at build time (:meth:`Checkpointer.restore`): ``resume=auto`` continues from the newest
checkpoint in ``checkpoint.dir`` if there is one (``latest`` requires one; a path picks one); the
data position is the step count, so a resumed run sees exactly the batches it would have seen.
A damaged newest checkpoint (a file missing or shorter than DCP's index says) is moved aside to
``damaged-step_<n>`` with a warning naming it and the reason, and the newest whole one is used;
a checkpoint whose files are whole but fail to load is never guessed past: the error names it and
the ``checkpoint.resume=<path>`` that picks another. ``init_from=<path>`` instead starts a new run
from another run's weights (fine-tuning), renaming parameters with ``name_map`` and optionally
skipping the optimizer state.

**Where a CLI run's checkpoints are**: ``checkpoint.dir`` defaults to ``<Hydra run dir>/checkpoints``,
a new directory per launch, so relaunching the bare command starts a new run; an interrupted run
prints the exact command that resumes it (:func:`resume_command`, the original overrides plus
``checkpoint.dir=<absolute dir>``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shlex
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hydra.core.hydra_config import HydraConfig
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

from recsys_runner.checkpoint.lock import DirectoryInUse, DirectoryLock
from recsys_runner.configurable import Configurable
from recsys_runner.distributed.env import decided_on_rank0
from recsys_runner.errors import CheckpointError, ConfigError, require
from recsys_runner.train.stopping import check_finite, finite_state, improved

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^(best-)?step_(\d+)$")
_RESUME_WORDS = ("auto", "latest", "never")


@dataclass(kw_only=True)
class CheckpointConfig(Configurable):
    """Schema of ``conf/checkpoint/*.yaml``; builds :class:`Checkpointer`."""

    _target_: str = "recsys_runner.checkpoint.Checkpointer"
    dir: str | None = None
    """Where checkpoints go; ``null`` is ``<Hydra run dir>/checkpoints`` under the CLI, new for every
    launch (an interrupted run prints the command that resumes it: its overrides plus
    ``checkpoint.dir=<that dir>``). Set it to a stable path to make "the same command" resume.
    One live run at a time may use a directory. Without Hydra and without a dir, nothing is saved."""
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
    """Fine-tune: start a new run from this checkpoint's weights (a checkpoint dir, or a checkpoints
    root whose newest is used). Ignored when resuming."""
    name_map: dict[str, str] = field(default_factory=dict)
    """For ``init_from``: ``{name in this model: name in the checkpoint}``; each key is replaced by its
    value as a substring of parameter names (TorchEasyRec's fine_tune_ckpt_param_map). On the command line add
    entries with ``+checkpoint.name_map.t_cat_0=t_cat_1``."""
    load_optimizer: bool = True
    """For ``init_from``: also restore optimizer state (false: fresh optimizer, like
    TorchEasyRec's ignore_restore_optimizer)."""
    best_metric: str | None = None
    """Keep the best checkpoint by this eval metric (e.g. ``eval/auc``), saved when an eval improves it."""
    best_mode: str = "max"
    """``max`` if higher ``best_metric`` is better, ``min`` if lower is."""

    def __post_init__(self) -> None:
        require(self.every_steps is None or self.every_steps > 0, f"checkpoint.every_steps must be positive or null, got {self.every_steps}")
        require(self.every_epochs is None or self.every_epochs > 0, f"checkpoint.every_epochs must be positive or null, got {self.every_epochs}")
        require(self.keep_last is None or self.keep_last > 0, f"checkpoint.keep_last must be positive or null, got {self.keep_last}")
        require(self.best_mode in ("max", "min"), f"checkpoint.best_mode={self.best_mode!r} must be max or min")
        require(self.best_metric is None or self.best_metric.startswith("eval/"),
                f"checkpoint.best_metric={self.best_metric!r} must be an eval metric, e.g. eval/auc")
        require(self.resume in _RESUME_WORDS or "/" in self.resume or os.sep in self.resume,
                f"checkpoint.resume={self.resume!r} must be one of {_RESUME_WORDS} or a path to a checkpoint directory")

    def build(
        self, *, rank: int, world_size: int, device: torch.device, nan_guard: bool,
    ) -> Checkpointer:
        """The :class:`Checkpointer` for this process (``rank`` of ``world_size``, state on ``device``; ``nan_guard``
        is ``train.nan_guard``)."""
        built: Checkpointer = self.component_class()(self, rank=rank, world_size=world_size, device=device, nan_guard=nan_guard)
        return built


@dataclass
class TrainState:
    """Where training stands; saved in ``meta.json``."""

    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """The current epoch."""
    epoch_step: int = 0
    """Optimizer steps done within the current epoch (the data position)."""
    run_id: str | None = None
    """The MLflow run this training logs to (so a resumed run continues it)."""
    best: float | None = None
    """Best ``checkpoint.best_metric`` so far."""
    resumed_from: str | None = None
    """The checkpoint this process resumed from (not saved)."""
    set_aside: tuple[str, ...] = ()
    """Damaged newer checkpoints moved aside before resuming from ``resumed_from`` (not saved)."""


def default_dir() -> str | None:
    """``<Hydra run dir>/checkpoints`` when running under Hydra's CLI, else ``None``."""
    if HydraConfig.initialized():
        return str(Path(HydraConfig.get().runtime.output_dir) / "checkpoints")
    return None


def resume_command(checkpoint_dir: str | Path) -> str | None:
    """The shell command that resumes this CLI run from ``checkpoint_dir``; ``None`` outside Hydra's CLI.

    It is the launch's own overrides (config dir and name included) with ``checkpoint.dir`` set to the
    absolute directory and any ``checkpoint.resume``/``checkpoint.dir`` override dropped, so the
    relaunch continues from the newest checkpoint there, into the same MLflow run. A torchrun launch
    is repeated as torchrun with the same number of processes per node.
    """
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    keep = [o for o in hc.overrides.task if not re.match(r"^[+~]*checkpoint\.(dir|resume)=", o)]
    args = [*keep, f"checkpoint.dir={Path(checkpoint_dir).absolute()}"]
    for source in hc.runtime.config_sources:
        if source.provider == "command-line" and source.schema == "file":
            args = ["--config-dir", source.path, *args]
    if hc.job.config_name not in (None, "config"):
        args = ["--config-name", str(hc.job.config_name), *args]
    nproc = os.environ.get("LOCAL_WORLD_SIZE")
    if os.environ.get("TORCHELASTIC_RUN_ID") and nproc and os.environ.get("GROUP_WORLD_SIZE", "1") == "1":
        launcher = ["torchrun", f"--nproc_per_node={nproc}", "-m", "recsys_runner"]
    else:
        launcher = ["python", "-m", "recsys_runner"]
    return shlex.join([*launcher, *args])


def list_checkpoints(root: str | Path, best: bool = False) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (``best-*`` ones if ``best``)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and bool(m.group(1)) == best and is_complete(p):
            found.append((int(m.group(2)), p))
    return [p for _, p in sorted(found)]


def is_complete(path: Path) -> bool:
    """A checkpoint directory whose write finished (meta.json is written last)."""
    return (path / "meta.json").is_file() and (path / ".metadata").is_file()


def damage(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed from, or ``None`` when every file it needs is whole.

    Checks what can be checked without loading: ``meta.json`` and DCP's ``.metadata`` exist and parse,
    every data file the index points into exists and is long enough, each saving rank's ``rank<r>.pt``
    exists. A checkpoint written by :meth:`Checkpointer.save` and renamed into place passes; one that
    fails was damaged afterwards (a disk fault, a partial copy, a deleted file).
    """
    for name in ("meta.json", ".metadata"):
        if not (path / name).is_file():
            return f"{name} is missing"
    try:
        meta = json.loads((path / "meta.json").read_text())
        index = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # any parse failure of either file means damage
        return f"meta.json or .metadata cannot be read ({type(e).__name__}: {str(e)[:200]})"
    sizes: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        rel = info.relative_path
        if rel not in sizes:
            file = path / rel
            sizes[rel] = file.stat().st_size if file.is_file() else -1
        if sizes[rel] < 0:
            return f"{rel} is missing"
        if info.offset + info.length > sizes[rel]:
            return f"{rel} is truncated ({sizes[rel]} bytes; the index needs {info.offset + info.length})"
    for r in range(int(meta.get("world_size", 1))):
        if not (path / f"rank{r}.pt").is_file():
            return f"rank{r}.pt is missing"
    return None


def check_weights_match(path: Path, wanted: Mapping[str, Any]) -> None:
    """Refuse checkpoint ``path`` unless it holds every tensor of ``wanted`` (DCP keys, e.g. ``model/<fqn>``) with the
    same shape, and no ``model/`` tensor beyond them: weights of another model config are refused by name, not
    half-loaded (evaluate, predict, export; resuming and ``init_from`` have their own rules).

    Raises:
        CheckpointError: naming the first differences and the overrides to give.
    """
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing = [k for k in wanted if k not in saved]
    extra = [k for k in saved if k.startswith("model/") and k not in wanted]
    sizes = {k: list(m.size) for k, m in saved.items() if isinstance(m, TensorStorageMetadata)}
    shapes = [f"has {k} of shape {sizes[k]} where this model's is {_shape(wanted[k])}" for k in wanted
              if k in sizes and sizes[k] != _shape(wanted[k])]
    if missing or extra or shapes:
        parts = ([f"lacks {missing[:3]} ({len(missing)} in all)"] if missing else []) + \
                ([f"has {extra[:3]} this model does not ({len(extra)} in all)"] if extra else []) + shapes[:3]
        raise CheckpointError(f"checkpoint {path} does not match this model config: it {'; '.join(parts)}. Fix: give the "
                              f"same model=/model.*/data overrides as the training run (its resolved config is config.yaml "
                              f"in its MLflow run, its overrides the run's hydra.overrides tag, and .hydra/ beside its checkpoints)")


class Checkpointer:
    """Saves and restores the run's state; see the module docstring."""

    def __init__(
        self, config: CheckpointConfig, *, rank: int = 0, world_size: int = 1, device: torch.device | None = None,
        nan_guard: bool = True,
    ) -> None:
        self.config = config
        resolved = config.dir or default_dir()
        self.dir = Path(resolved) if resolved else None
        """``checkpoint.dir``, or its CLI default (``None``: nothing is saved)."""
        self.rank, self.world_size = rank, world_size
        self.device, self.nan_guard = device or torch.device("cpu"), nan_guard
        self.last_saved: str | None = None
        self.overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None
        """The launch's command-line overrides, saved in each ``meta.json``: evaluate, predict and export rebuild the
        training's config from them (:func:`recsys_runner.inference.with_training_overrides`). ``None`` outside a CLI."""
        self.verified_step = 0
        """Step checkpoints before this step are known good: a finite loss was computed from later weights."""
        self._lock = DirectoryLock(self.dir) if self.dir is not None and rank == 0 else None
        self._tensors: dict[str, Any] = {}
        self._objects: dict[str, Any] = {}
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
        self._model, self._optimizer = model, optimizer
        self._tensors, self._objects = dict(tensors), dict(objects)

    def _tensor_state(self, with_optimizer: bool = True) -> dict[str, Any]:
        flat: dict[str, Any] = {f"model/{k}": v for k, v in self._model.state_dict().items()}
        if with_optimizer:
            for key, states in self._optimizer.state_dict()["state"].items():
                for name, value in states.items():
                    flat[f"optim/{key}/{name}"] = value
        for holder_name, holder in self._tensors.items():
            for k, v in holder.state_dict().items():
                flat[f"{holder_name}/{k}"] = v
        return flat

    # -- when ------------------------------------------------------------------------------------
    def due(self, step: int, epoch_ended: int | None = None) -> bool:
        """Whether a periodic checkpoint is due after ``step``, which ended epoch ``epoch_ended`` if not ``None``."""
        if self.dir is None:
            return False
        by_epoch = epoch_ended is not None and self.config.every_epochs is not None and self.config.every_epochs > 0 \
            and (epoch_ended + 1) % self.config.every_epochs == 0
        return by_epoch or bool(self.config.every_steps and step % self.config.every_steps == 0)

    # -- saving ----------------------------------------------------------------------------------
    def save(self, state: TrainState, metrics: Mapping[str, float] | None = None, best: bool = False) -> str | None:
        """Write a checkpoint of ``state`` atomically; returns its path (``None`` without a dir)."""
        if self.dir is None:
            return None
        name = f"{'best-' if best else ''}step_{state.step:08d}"
        final, tmp = self.dir / name, self.dir / f".tmp-{name}"
        if is_complete(final):
            return str(final)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        dcp.save(self._tensor_state(), checkpoint_id=str(tmp))
        torch.save({"objects": {k: o.state_dict() for k, o in self._objects.items()}, "rng": _rng_state()}, tmp / f"rank{self.rank}.pt")
        self._barrier()
        if self.rank == 0:
            meta = {k: v for k, v in asdict(state).items() if k != "resumed_from"}
            meta["metrics"] = dict(metrics or {})
            meta["world_size"] = self.world_size
            if self.overrides is not None:
                meta["overrides"] = self.overrides
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            self._prune(best)
        self._barrier()
        if not best:
            self.last_saved = str(final)
        if self.rank == 0:  # one line per checkpoint, not one per rank
            log.info("checkpoint saved: %s", final)
        return str(final)

    # -- the checkpoint policy the loop drives: when, guarded, best ------------------------------
    def loss_logged(self, step: int, mean_loss: float) -> None:
        """NaN guard at a log step. ``mean_loss`` is the mean since the last log, so finite means every step's loss
        was, and the checkpoints before ``step`` hold good weights; non-finite raises :class:`NonFiniteLossError`."""
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
        :class:`NonFiniteLossError` and keep the good checkpoints. The loss of step n is computed before step n's
        update, so a finite loss does not prove finite weights; the weights are checked too (one pass, on every rank)."""
        if self.nan_guard and loss is not None:
            self._refuse_nonfinite(float(loss), state.step)
        if self.nan_guard and self.dir is not None and not finite_state(self._model, self.world_size, self.device):
            self._refuse_nonfinite(math.nan, state.step, what="the model's weights are not finite")
        return self.save(state, metrics)

    def _refuse_nonfinite(self, value: float, step: int, what: str | None = None) -> None:
        """Raise :class:`NonFiniteLossError` for a non-finite ``value``, after setting aside the checkpoints no finite
        loss has followed, so the one it names (and a resume picks) is truly good."""
        if not math.isfinite(value):
            check_finite(value, step, self.drop_unverified(), what)

    def drop_unverified(self) -> str | None:
        """After a non-finite loss: move the step checkpoints no finite loss has followed aside (``diverged-step_<n>``)
        and return the newest remaining one, the last good checkpoint, which a resume then picks."""
        if self.dir is None:
            return None
        kept = []
        for path in list_checkpoints(self.dir):
            if _step(path) < self.verified_step:
                kept.append(path)
            elif self.rank == 0:
                log.warning("no finite train loss came after checkpoint %s, so its weights may be diverged: moved aside to %s",
                            path, _set_aside(path, "diverged"))
        self.last_saved = str(kept[-1]) if kept else None
        return self.last_saved

    def maybe_save_best(self, state: TrainState, metrics: Mapping[str, float]) -> str | None:
        """Save a ``best-*`` checkpoint when ``metrics[best_metric]`` improves on ``state.best``."""
        if self.config.best_metric is None or self.dir is None:
            return None
        value = metrics[self.config.best_metric]  # a key eval logs: config.check_eval_keys made sure before the first step
        if not improved(value, state.best, self.config.best_mode):
            return None
        state.best = value
        return self.save(state, metrics, best=True)

    def _prune(self, best: bool) -> None:
        assert self.dir is not None
        keep = 1 if best else self.config.keep_last
        if keep is None:
            return
        for old in list_checkpoints(self.dir, best=best)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    # -- restoring -------------------------------------------------------------------------------
    def lock(self) -> None:
        """Become ``dir``'s one writer, or raise :class:`CheckpointError` naming the live holder (host, PID).

        Called at the start of the run, before anything is built or logged; released by :meth:`close`."""
        decided_on_rank0(self._take_lock, self.rank, self.world_size)

    def restore(self) -> TrainState:
        """Resume, fine-tune or start fresh, per ``resume``/``init_from``; returns where to start."""
        path, set_aside = decided_on_rank0(self._resume_path, self.rank, self.world_size)
        if path is not None:
            state = self._load(path, strict=True)
            state.set_aside = set_aside
            self.verified_step = state.step + 1  # the checkpoint resumed from is trusted
            return state
        if self.config.init_from is not None:
            source = Path(self.config.init_from)
            if not is_complete(source):
                found = list_checkpoints(source)
                if not found:
                    raise CheckpointError(f"checkpoint.init_from={self.config.init_from}: no complete checkpoint there "
                                          "(a step_* directory with meta.json and .metadata, or a directory holding them)")
                source = found[-1]
            self._load(source, strict=False)
        return TrainState()

    def load_weights(self, path: Path) -> TrainState:
        """Load the model's and the EMA's weights of checkpoint ``path`` (evaluate, predict): nothing else is read,
        nothing is locked or written, the optimizer keeps its fresh state. Strict, unlike ``init_from``: every tensor
        of this model must be in the checkpoint with the same shape and the checkpoint may hold no other model
        tensor, so weights of another model config are refused by name, not half-loaded. Returns the checkpoint's
        step and MLflow run id (``meta.json``).

        Raises:
            CheckpointError: damaged, or written by another model config (naming the first differences).
        """
        reason = damage(path)
        if reason is not None:
            raise CheckpointError(f"checkpoint {path} is damaged ({reason}). Fix: point load= at another checkpoint")
        meta = json.loads((path / "meta.json").read_text())
        ours = self._tensor_state(with_optimizer=False)
        check_weights_match(path, ours)
        dcp.load(ours, checkpoint_id=str(path))
        for holder_name, holder in self._tensors.items():
            prefix = f"{holder_name}/"
            holder.load_state_dict({k[len(prefix):]: v for k, v in ours.items() if k.startswith(prefix)})
        log.info("loaded weights of %s (step %d)", path, meta["step"])
        return TrainState(step=meta["step"], epoch=meta["epoch"], run_id=meta.get("run_id"), resumed_from=str(path))

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

    def _resume_path(self) -> tuple[Path | None, tuple[str, ...]]:
        """The checkpoint to resume from and the damaged newer ones moved aside on the way (run on rank 0)."""
        if self.config.resume == "never":
            return None, ()
        if self.config.resume not in _RESUME_WORDS:
            path = Path(self.config.resume)
            if not path.exists():
                raise CheckpointError(f"checkpoint.resume={self.config.resume}: no such checkpoint directory")
            reason = damage(path)
            if reason is not None:
                others = [str(p) for p in list_checkpoints(path.parent) if p != path and damage(p) is None]
                hint = f"checkpoint.resume={others[-1]}" if others else "checkpoint.resume=<another checkpoint directory>"
                raise CheckpointError(f"checkpoint.resume={self.config.resume}: this checkpoint is damaged ({reason}). Fix: {hint}")
            return path, ()
        set_aside: list[str] = []
        for path in reversed(_step_dirs(self.dir)):
            reason = damage(path)
            if reason is None:
                if set_aside:
                    log.warning("resuming from %s, the newest whole checkpoint, instead of the damaged %s; steps after %s "
                                "are trained (and logged) again", path, ", ".join(set_aside), path.name)
                return path, tuple(set_aside)
            aside = _set_aside(path)
            log.warning("checkpoint %s is damaged (%s): moved aside to %s, falling back to the previous one", path, reason, aside)
            set_aside.append(str(path))
        if set_aside:
            raise CheckpointError(f"every checkpoint in {self.dir} is damaged (moved aside: {', '.join(set_aside)}). Fix: start over "
                                  "with checkpoint.resume=never, or point checkpoint.resume at a checkpoint kept elsewhere")
        if self.config.resume == "latest":
            raise CheckpointError(f"checkpoint.resume=latest but {self.dir} holds no complete checkpoint; "
                                  "use checkpoint.resume=auto to start fresh when there is none")
        return None, ()

    def _load(self, path: Path, strict: bool) -> TrainState:
        reason = damage(path)
        if reason is not None:  # resume paths were checked on rank 0 already; this guards init_from
            raise CheckpointError(f"checkpoint {path} is damaged ({reason}). Fix: point checkpoint.init_from at another checkpoint")
        meta = json.loads((path / "meta.json").read_text())
        available = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        with_optimizer = strict or self.config.load_optimizer
        if with_optimizer:
            for _, opt in self._optimizer.optimizers:
                if isinstance(opt, KeyedOptimizerWrapper) and not opt.state:
                    opt.init_state()  # creates lazy state (e.g. Adam moments) so it can be loaded into
        ours = self._tensor_state(with_optimizer)
        if strict:
            wanted = {k: k for k in ours}
            missing = [k for k in ours if k not in available]
            if missing:
                raise CheckpointError(f"checkpoint {path} does not match this model/optimizer: it lacks {missing[:5]} "
                                      f"({len(missing)} in all); resume needs the same config (fine-tune with checkpoint.init_from)")
        else:
            wanted = {k: self._rename(k) for k in ours}
            skipped = [k for k, src in wanted.items() if src not in available]
            if len(skipped) == len(wanted) or not any(k.startswith("model/") and k not in skipped for k in wanted):
                raise CheckpointError(f"checkpoint.init_from={path} shares no parameter name with this model; map names with "
                                      f"checkpoint.name_map (e.g. this model has {sorted(ours)[:3]}, it has {sorted(available)[:3]})")
            if skipped:
                log.warning("init_from %s: %d tensors not in the checkpoint keep their fresh values, e.g. %s", path, len(skipped), skipped[:5])
            wanted = {k: src for k, src in wanted.items() if src in available}
        to_load: dict[str, Any] = {}
        copies: list[tuple[str, str]] = []  # (ours, source) for a source mapped to several of ours
        for k, src in wanted.items():
            if src in to_load:
                if self.world_size > 1:
                    raise ConfigError(f"checkpoint.name_map maps {src} to several parameters; that works on one rank only")
                copies.append((k, src))
            else:
                to_load[src] = ours[k]
        try:
            dcp.load(to_load, checkpoint_id=str(path))
            for k, src in copies:
                _local(ours[k]).copy_(_local(to_load[src]))
            ranked = torch.load(self._ranked_file(path, meta), weights_only=False) if strict else None
        except Exception as e:  # DCP wraps reader errors in its own CheckpointException
            older = [str(p) for p in list_checkpoints(path.parent) if p.name < path.name]
            choose = f"checkpoint.resume={older[-1]} (the previous one)" if strict and older else "checkpoint.resume/init_from=<another one>"
            raise CheckpointError(f"checkpoint {path} could not be loaded ({type(e).__name__}: {str(e)[:300]}); its files are whole, "
                                  f"so it is corrupt inside or from a different model. Nothing was resumed. Fix: choose one with {choose}, "
                                  "or start over with checkpoint.resume=never") from None
        if with_optimizer:
            self._load_optimizer(to_load, wanted)
        for holder_name, holder in self._tensors.items():
            prefix = f"{holder_name}/"
            holder.load_state_dict({k[len(prefix):]: to_load[wanted[k]] for k in wanted if k.startswith(prefix)})
        if not strict:
            log.info("initialized from %s (%d tensors)", path, len(wanted))
            return TrainState()
        assert ranked is not None
        for k, o in self._objects.items():
            if k in ranked["objects"]:
                o.load_state_dict(ranked["objects"][k])
        _set_rng_state(ranked["rng"])
        log.info("resuming from %s at step %d", path, meta["step"])
        self.last_saved = str(path)
        return TrainState(step=meta["step"], epoch=meta["epoch"], epoch_step=meta["epoch_step"], run_id=meta.get("run_id"),
                          best=meta.get("best"), resumed_from=str(path))

    def _ranked_file(self, path: Path, meta: Mapping[str, Any]) -> Path:
        """This rank's ``rank<r>.pt``; resuming on more ranks than saved it, a new rank takes rank 0's (schedules,
        scaler and early stopping are the same on every rank; its RNG state then matches rank 0's)."""
        own = path / f"rank{self.rank}.pt"
        saved_ranks = int(meta.get("world_size", 1))
        if own.exists() or self.rank < saved_ranks:
            return own
        log.info("checkpoint %s was written by %d rank(s); rank %d resumes with rank 0's schedules and RNG state", path, saved_ranks, self.rank)
        return path / "rank0.pt"

    def _load_optimizer(self, loaded: Mapping[str, Any], wanted: Mapping[str, str]) -> None:
        nested: dict[str, dict[str, Any]] = {}
        current = self._optimizer.state_dict()["state"]
        for key, states in current.items():
            nested[key] = {}
            for name, value in states.items():
                flat = f"optim/{key}/{name}"
                nested[key][name] = loaded[wanted[flat]] if flat in wanted else value
        self._optimizer.load_state_dict({"state": nested})

    def _rename(self, key: str) -> str:
        for ours, theirs in self.config.name_map.items():
            if ours in key:
                return key.replace(ours, theirs)
        return key

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def _step_dirs(root: Path | None) -> list[Path]:
    """Every ``step_<n>`` directory under ``root``, whole or not, oldest first."""
    if root is None or not root.is_dir():
        return []
    found = [(int(m.group(2)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and not m.group(1) and p.is_dir()]
    return [p for _, p in sorted(found)]


def _step(path: Path) -> int:
    m = _STEP_DIR.match(path.name)
    assert m is not None, path
    return int(m.group(2))


def _set_aside(path: Path, why: str = "damaged") -> Path:
    """Rename a checkpoint to ``<why>-<name>[-k]``: kept for inspection, never resumed from or pruned."""
    target = path.with_name(f"{why}-{path.name}")
    k = 1
    while target.exists():
        target, k = path.with_name(f"{why}-{path.name}-{k}"), k + 1
    os.replace(path, target)
    return target


def _shape(t: Any) -> list[int]:
    """The global shape of a tensor or ShardedTensor (whose ``size()`` warns that ShardedTensor is deprecated)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return list(t.size())


def _local(t: Any) -> torch.Tensor:
    """The local shard of a ShardedTensor (this rank's rows), or the tensor itself."""
    return t.local_tensor() if hasattr(t, "local_tensor") else t


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
