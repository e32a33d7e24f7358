"""What a run starts from: the checkpoint to resume (``checkpoint.resume``), the one to fine-tune from
(``checkpoint.init_from`` with ``name_map``), and loading either — weights, optimizer, per-rank objects, RNG states.

``resume=auto`` continues from the newest checkpoint in ``checkpoint.dir`` if there is one (``latest`` requires one;
a path picks one); the data position is the step count, so a resumed run sees exactly the batches it would have seen.
A damaged newest checkpoint (a file missing or shorter than DCP's index says) is moved aside to ``damaged-step_<n>``
with a warning naming it and the reason, and the newest whole one is used (what a write or removal cut off part-way
left in an object store is no checkpoint: skipped with a warning, deleted by the next write, never moved aside); a checkpoint whose files are whole but fail
to load is never guessed past: the error names it and the ``checkpoint.resume=<path>`` that picks another.
``init_from=<path>`` (or the MLflow run id of the run that wrote it, looked up by the builder) instead starts a new run
from another run's weights (fine-tuning), renaming parameters with
``name_map`` and optionally skipping the optimizer state.
Evaluate and predict load a checkpoint's weights alone (:func:`load_weights`): strictly, and past one that a run
still writing there rotated away meanwhile.

What may change on a resume, and what it says of each change: :mod:`~recsys_runner.checkpoint.resume_changes`.
"""

from __future__ import annotations

import difflib
import functools
import logging
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsys_runner import provenance, uris
from recsys_runner.checkpoint.carried_rows import CarriedRows
from recsys_runner.checkpoint.config import RESUME_WORDS, CheckpointConfig, TrainState
from recsys_runner.checkpoint.storage import RUN_DIR_FOLDER, STEP_DIR, CheckpointStorage, TensorIndex, step_of
from recsys_runner.checkpoint.weights import TrainingParts, load_into
from recsys_runner.distributed.env import decided_on_rank0
from recsys_runner.errors import CheckpointError, ConfigError, UserError

log = logging.getLogger(__name__)

def choose(config: CheckpointConfig, storage: CheckpointStorage, root: Path | None) -> tuple[Path | None, tuple[str, ...]]:
    """The checkpoint to resume from and the damaged newer ones moved aside on the way (run on rank 0)."""
    if config.resume == "never":
        return None, ()
    if config.resume not in RESUME_WORDS:
        path = uris.as_path(config.resume)
        if not storage.exists(path):
            raise CheckpointError(f"checkpoint.resume={config.resume}: no such checkpoint directory")
        reason = storage.damage(path)
        if reason is not None:
            others = [str(p) for p in storage.checkpoints(path.parent) if p != path and storage.damage(p) is None]
            hint = f"checkpoint.resume={others[-1]}" if others else "checkpoint.resume=<another checkpoint directory>"
            raise CheckpointError(f"checkpoint.resume={config.resume}: this checkpoint is damaged ({reason}). Fix: {hint}")
        return path, ()
    set_aside: list[str] = []
    unfinished = storage.unfinished(root) if root is not None else []
    if unfinished:
        log.warning("skipping %s: left by a checkpoint write or removal cut off part-way (no meta.json), so not a checkpoint; "
                    "the next checkpoint write deletes it", ", ".join(str(p) for p in unfinished))
    for path in reversed(storage.checkpoints(root, complete=False) if root is not None else []):
        if path in unfinished:
            continue
        reason = storage.damage(path)
        if reason is None:
            if set_aside:
                log.warning("resuming from %s, the newest whole checkpoint, instead of the damaged %s; steps after %s "
                            "are trained (and logged) again", path, ", ".join(set_aside), path.name)
            return path, tuple(set_aside)
        aside = storage.set_aside(path, "damaged")
        log.warning("checkpoint %s is damaged (%s): moved aside to %s, falling back to the previous one", path, reason, aside)
        set_aside.append(str(path))
    if set_aside:
        raise CheckpointError(f"every checkpoint in {root} is damaged (moved aside: {', '.join(set_aside)}). Fix: start over "
                              "with checkpoint.resume=never, or point checkpoint.resume at a checkpoint kept elsewhere")
    if config.resume == "latest":
        raise CheckpointError(f"checkpoint.resume=latest but {root} holds no complete checkpoint; "
                              "use checkpoint.resume=auto to start fresh when there is none")
    return None, ()


def init_source(config: CheckpointConfig, storage: CheckpointStorage, run_root: Path | None = None) -> Path:
    """``init_from``'s checkpoint: the one named, or the newest under the directory named; ``run_root``: the checkpoints
    root of the MLflow run ``init_from`` names, as the builder looked it up (this layer reads no tracking store)."""
    assert config.init_from is not None
    source = run_root or uris.as_path(config.init_from)
    named = config.init_from if run_root is None else f"{config.init_from} (the MLflow run's checkpoints, {run_root})"
    if storage.is_complete(source):
        return source
    found = storage.checkpoints(source)
    if not found:
        raise CheckpointError(f"checkpoint.init_from={named}: {_no_init_checkpoint(source, storage)}")
    best = storage.checkpoints(source, best=True)
    if best and step_of(best[-1]) != step_of(found[-1]):  # load= of this root evaluates and exports the best one
        log.warning("checkpoint.init_from=%s starts from its newest checkpoint, %s, but evaluate, predict and export given "
                    "this root (load=) use its best, %s: the model you compared or served is not the one this run continues. "
                    "Name the one you mean: checkpoint.init_from=%s", named, found[-1].name, best[-1].name, best[-1])
    return found[-1]


def _no_init_checkpoint(source: Path, storage: CheckpointStorage) -> str:
    """Why ``init_from`` names no checkpoint, and the fix where one is at hand: yesterday's run directory (its
    checkpoints are in ``<run dir>/checkpoints``)."""
    inside = source / RUN_DIR_FOLDER
    if found := storage.checkpoints(inside):
        return (f"no checkpoint there, but its {RUN_DIR_FOLDER}/ folder holds some: it is a training run's directory. "
                f"Fix: checkpoint.init_from={inside} (its newest, {found[-1].name})")
    if not storage.exists(source):
        return "no such directory. Fix: point it at a step_* checkpoint, a checkpoints root or the training run's MLflow run id"
    return ("no complete checkpoint there (a step_* directory with meta.json and .metadata, or a directory holding them). "
            "Fix: point it at one")


def load_run(storage: CheckpointStorage, path: Path, parts: TrainingParts, config: CheckpointConfig, *, strict: bool,
             rank: int, world_size: int, carry: CarriedRows | None = None) -> TrainState:
    """Resume (``strict``: everything, optimizer, per-rank objects and RNG states included) or fine-tune from ``path``
    (its weights, renamed by ``name_map``; the optimizer's if ``load_optimizer``; the rows of the tables of ``carry``
    carried over by id, :class:`~recsys_runner.checkpoint.carried_rows.CarriedRows`); returns where training stands.

    Raises:
        CheckpointError: damaged, not this model, or its whole files fail to load (naming the one to choose instead).
    """
    reason = storage.damage(path)
    if reason is not None:  # resume paths were checked on rank 0 already; this guards init_from
        raise CheckpointError(f"checkpoint {path} is damaged ({reason}). Fix: point checkpoint.init_from at another checkpoint")
    meta = storage.read_meta(path)
    with_optimizer = strict or config.load_optimizer
    if with_optimizer:
        parts.init_optimizer_state(storage.tensor_index(path))
    ours = parts.tensor_state(with_optimizer)
    if not strict:
        _check_name_map(config.name_map, ours)

    def renamed(index: TensorIndex) -> dict[str, str]:
        return {k: k if strict else _rename(k, config.name_map) for k in ours}

    try:
        loaded = load_into(storage, path, ours, rule="resume" if strict else "fine_tune", sources=renamed, world_size=world_size,
                           carry=None if strict else carry)
        ranked = _ranked(storage, path, meta, rank) if strict else None
    except UserError:
        raise
    except Exception as e:  # DCP wraps reader errors in its own CheckpointException
        older = [str(p) for p in storage.checkpoints(path.parent) if p.name < path.name]
        pick = f"checkpoint.resume={older[-1]} (the previous one)" if strict and older else "checkpoint.resume/init_from=<another one>"
        raise CheckpointError(f"checkpoint {path} could not be loaded ({type(e).__name__}: {str(e)[:300]}); its files are whole, "
                              f"so it is corrupt inside or from a different model. Nothing was resumed. Fix: choose one with {pick}, "
                              "or start over with checkpoint.resume=never") from None
    parts.take(loaded, with_optimizer)
    if rank == 0:
        provenance.note_other_code(f"checkpoint {path}", meta)
    if ranked is None:
        log.info("initialized from %s (%d tensors)", path, len(loaded))
        if carry is not None and rank == 0:
            for table in sorted({t for k in loaded if k.startswith("model/") and (t := carry.table_of(k)) is not None}):
                log.info("%s", carry.tables[table].line(table))
        return TrainState()
    parts.load_objects(ranked["objects"])
    set_rng_state(ranked["rng"])
    log.info("resuming from %s at step %d", path, meta["step"])
    return TrainState(step=meta["step"], epoch=meta["epoch"], epoch_step=meta["epoch_step"], run_id=meta.get("run_id"),
                      best=meta.get("best"), resumed_from=str(path), metrics=meta.get("metrics") or None)


def _ranked(storage: CheckpointStorage, path: Path, meta: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """This rank's objects; resuming on more ranks than saved them, a new rank takes rank 0's (schedules, scaler and
    early stopping are the same on every rank; its RNG state then matches rank 0's)."""
    ranked = storage.read_ranked(path, rank)
    saved_ranks = int(meta.get("world_size", 1))
    if ranked is None and rank >= saved_ranks:
        log.info("checkpoint %s was written by %d rank(s); rank %d resumes with rank 0's schedules and RNG state", path, saved_ranks, rank)
        ranked = storage.read_ranked(path, 0)
    if ranked is None:
        raise FileNotFoundError(f"rank{rank}.pt is missing")
    return ranked


def _check_name_map(name_map: Mapping[str, str], ours: Mapping[str, Any]) -> None:
    """Each ``checkpoint.name_map`` key must be part of a name of this model's tensors: one that is not renames nothing,
    and the run would fine-tune as if the entry were not there, without a word (the tensors it was meant for load under
    their own names, or keep their fresh values).

    Raises:
        ConfigError: naming the entry and the closest parts of this model's names."""
    for mine, theirs in name_map.items():
        if any(mine in k for k in ours):
            continue
        parts = sorted({p for k in ours if k.startswith("model/") for p in k.removeprefix("model/").split(".")})
        close = difflib.get_close_matches(mine, parts, n=3, cutoff=0.5) or parts[:8]
        raise ConfigError(f"checkpoint.name_map.{mine}={theirs}: no tensor of this model has '{mine}' in its name, so the "
                          f"entry would rename nothing. Fix: use a part of this model's names as the key (e.g. "
                          f"{', '.join(close)}), or remove the entry")


def _rename(key: str, name_map: Mapping[str, str]) -> str:
    """``key`` with the first of ``name_map``'s keys it contains replaced by its value (``init_from``)."""
    for ours, theirs in name_map.items():
        if ours in key:
            return key.replace(ours, theirs)
    return key


_ROTATION_RETRIES = 5
"""How many times :func:`load_weights` moves on to a newer checkpoint when the one it loads is rotated away."""


def load_weights(storage: CheckpointStorage, path: Path, parts: TrainingParts, *, rank: int, world_size: int) -> TrainState:
    """Load the model's and the EMA's weights (``parts``) of checkpoint ``path`` (evaluate, predict): nothing else is read,
    nothing is locked or written, the optimizer keeps its fresh state. Strict, unlike ``init_from``: every tensor
    of this model must be in the checkpoint with the same shape and the checkpoint may hold no other model
    tensor, so weights of another model config are refused by name, not half-loaded. Returns the checkpoint's
    step and MLflow run id (``meta.json``).

    A checkpoint that a run still writing there rotated away since it was chosen (``keep_last`` removes the oldest
    step checkpoints after writing a newer one, a new best replaces the old best) is skipped with a warning for the
    newest complete one of its kind there (a best one for a best one), decided on rank 0; ``resumed_from`` of the returned
    state names the one loaded.

    Raises:
        CheckpointError: damaged (and no newer checkpoint replaced it), or written by another model config (naming
            the first differences).
    """
    for _ in range(_ROTATION_RETRIES):
        path = decided_on_rank0(functools.partial(_still_there, storage, path), rank, world_size)
        meta = storage.read_meta(path)
        ours = parts.tensor_state(with_optimizer=False)
        try:
            loaded = load_into(storage, path, ours, rule="exact", world_size=world_size)
        except CheckpointError:
            raise
        except Exception:  # DCP's reader fails when the files go while it reads: rotated away meanwhile?
            if storage.is_complete(path) and storage.damage(path) is None:
                raise
            continue
        parts.take(loaded, with_optimizer=False)
        log.info("loaded weights of %s (step %d)", path, meta["step"])
        if rank == 0:
            provenance.note_other_code(f"checkpoint {path}", meta)
        return TrainState(step=meta["step"], epoch=meta["epoch"], run_id=meta.get("run_id"), resumed_from=str(path))
    raise CheckpointError(f"the checkpoints in {path.parent} were rotated away {_ROTATION_RETRIES} times while loading "
                          f"one; a run is writing there faster than this can read. Fix: load=<a checkpoint kept elsewhere>")


def _still_there(storage: CheckpointStorage, path: Path) -> Path:
    """``path`` if it can be loaded; else, when a newer checkpoint of its kind replaced it (it was rotated away by
    the run writing there), the newest complete one of that kind, with a warning."""
    reason = storage.damage(path)
    if reason is None:
        return path
    kind = STEP_DIR.match(path.name)
    found = storage.checkpoints(path.parent, best=bool(kind.group(1))) if kind else []
    newer = found[-1] if found else None
    if newer is None or step_of(newer) <= step_of(path) or storage.damage(newer) is not None:
        older = next((p for p in reversed(found) if step_of(p) < step_of(path) and storage.damage(p) is None), None)
        instead = f" (load={older}, the newest whole one before it, has older weights)" if older is not None else ""
        raise CheckpointError(f"checkpoint {path} is damaged ({reason}). Fix: point load= at another checkpoint{instead}, "
                              f"or copy this one again whole")
    log.warning("checkpoint %s is gone (%s): the run writing %s rotated it away (checkpoint.keep_last) after saving "
                "newer ones; loading %s, the newest complete one there, instead", path, reason, path.parent, newer)
    return newer


def rng_state() -> dict[str, Any]:
    """Python's, NumPy's, torch's (and CUDA's, once initialized) random states, saved per rank."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` saved."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
