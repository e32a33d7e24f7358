"""Where checkpoints live: :class:`CheckpointStorage`, what the checkpoint policy needs of a place to keep them, and
:class:`DcpFileStorage`, its one implementation: ``torch.distributed.checkpoint`` (DCP) on a file system.

A checkpoint is a directory ``<checkpoint.dir>/step_<step>`` (or ``best-step_<step>``) holding

* the tensors, written with DCP by every rank (each rank its own shards), keys ``model/<fqn>``,
  ``optim/<key>/<state>``, ``ema/<fqn>``, indexed by DCP's ``.metadata``;
* ``rank<r>.pt`` per rank: small picklable state (lr schedules, loss scaler, early stopping, RNG states);
* ``meta.json``, written last by rank 0: where training stands (:class:`~recsys_runner.checkpoint.config.TrainState`).

**Atomic**: everything is written into ``.tmp-<name>`` and renamed to ``<name>`` only when complete (a rotated one is
renamed to ``.trash-<name>`` before it is deleted; each write sweeps what killed writes and deletes left); a directory
without ``meta.json`` and ``.metadata`` is never listed as a checkpoint, so a crash mid-write leaves the previous
checkpoints as they were. A write the file system refuses (a full disk, a read-only mount) removes its partial
directory (it holds the space) and raises :class:`~recsys_runner.errors.CheckpointError` naming the checkpoint and the
fix (:func:`write_failure`). A checkpoint damaged afterwards (a file missing, or shorter than the index says) is found
without loading it (:func:`damage`) and can be renamed aside (``damaged-step_<n>``) for inspection.

Checkpoints are addressed by path (``<root>/<name>``); the policy only joins and splits names, never touches files.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from recsys_runner.errors import CheckpointError, Stopped

STEP_DIR = re.compile(r"^(best-)?step_(\d+)$")
RUN_DIR_FOLDER = "checkpoints"
"""The folder of a training run's directory (Hydra's) its checkpoints go to when ``checkpoint.dir`` is null."""
META_FILE = "meta.json"
FORMAT = 1
"""The checkpoint layout this version writes and reads (tensor keys, ``rank<r>.pt``'s objects, ``meta.json``'s keys),
recorded as ``meta.json``'s ``format`` (:data:`FORMAT_KEY`). A checkpoint without one was written before formats were
recorded (recsys_runner up to 2026-12-01), in the layout of format 1, and is read as such. Raise it with a change that
an older version would misread; a reader meeting a format above its own refuses it (:func:`check_format`) instead of
loading what it would misread."""
FORMAT_KEY = "format"
INDEX_FILE = ".metadata"
"""DCP's index of the tensors: which file and where in it each one's bytes are."""

TMP_PREFIX, TRASH_PREFIX = ".tmp-", ".trash-"
"""A checkpoint being written (renamed to its name once whole), and one being deleted (renamed before): never listed."""

TensorIndex = dict[str, list[int] | None]
"""A checkpoint's tensors: DCP key → global shape (``None`` for a non-tensor entry)."""


SINGLE_PROCESS = r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to (save|load) in a single process"
"""DCP's warning for a call without a process group, which torch 2.13 gives even when the caller says so (``no_dist=True``)."""


@contextlib.contextmanager
def single_process(world_size: int) -> Iterator[bool]:
    """Whether a DCP save or load runs without a process group (one process that set none up: export's unsharded model, a
    script or test reading a checkpoint), to pass as DCP's ``no_dist``; within it DCP's warning that it assumes so
    (:data:`SINGLE_PROCESS`) is not shown, since the caller meant exactly that. With several ranks and no group the
    warning still shows: each rank would write or read the whole checkpoint alone, which is a bug to see."""
    alone = world_size == 1 and not (dist.is_available() and dist.is_initialized())
    if not alone:
        yield False
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS, category=UserWarning)
        yield True


@contextlib.contextmanager
def stops_unwrapped(rank: int) -> Iterator[None]:
    """Let a stop raised inside a DCP save or load come out as itself. DCP catches ``BaseException`` on every rank and
    raises its own :class:`CheckpointException` (a ``BaseException`` as well) in its place, so a second Ctrl-C while
    the checkpoint of a stop is written (``KeyboardInterrupt``), or a signal raised where the main thread waits
    (:class:`~recsys_runner.errors.Stopped`), would reach the command as a checkpoint failure: a traceback, the MLflow
    run ``FAILED`` instead of ``KILLED``, and no line saying how to resume. Other failures are raised as DCP raised
    them."""
    try:
        yield
    except CheckpointException as e:
        own = e.failures.get(rank)
        if own is not None and isinstance(own[0], KeyboardInterrupt | Stopped):
            raise own[0] from None
        raise


def checkpoint_name(step: int, best: bool = False) -> str:
    """The name of the checkpoint of ``step``: ``step_<8 digits>``, ``best-step_<8 digits>`` for the best one."""
    return f"{'best-' if best else ''}step_{step:08d}"


def step_of(path: Path) -> int:
    """The step a checkpoint named by :func:`checkpoint_name` was taken at."""
    m = STEP_DIR.match(path.name)
    assert m is not None, path
    return int(m.group(2))


class CheckpointStorage(Protocol):
    """Where checkpoints live. Every method but :meth:`write` runs on the rank that calls it, alone."""

    def write(self, path: Path, tensors: dict[str, Any], ranked: Mapping[str, Any], meta: Mapping[str, Any],
              files: Mapping[str, bytes] | None = None) -> None:
        """Collective (every rank calls it): write ``tensors`` (each rank its shards), this rank's ``ranked`` objects,
        rank 0's readable ``files`` (name → bytes, e.g. the data's fitted encoders) and, last, rank 0's ``meta``,
        atomically: ``path`` is complete when this returns, or absent after a crash."""

    def exists(self, path: Path) -> bool:
        """Whether anything is at ``path``, whole or not."""

    def is_complete(self, path: Path) -> bool:
        """Whether a write to ``path`` finished (its meta and tensor index are there)."""

    def checkpoints(self, root: Path, *, best: bool = False, complete: bool = True) -> list[Path]:
        """The step checkpoints under ``root`` (``best-*`` ones if ``best``), oldest first; whole or not unless
        ``complete``."""

    def damage(self, path: Path) -> str | None:
        """Why ``path`` cannot be loaded, judged without loading it, or ``None`` when every part it needs is whole."""

    def read_meta(self, path: Path) -> dict[str, Any]:
        """The checkpoint's ``meta``."""

    def tensor_index(self, path: Path) -> TensorIndex:
        """The checkpoint's tensors, by key, with their shapes."""

    def tensor_dtypes(self, path: Path) -> dict[str, torch.dtype]:
        """The checkpoint's tensors, by key, with the dtype each was saved in."""

    def load_tensors(self, path: Path, state: dict[str, Any]) -> None:
        """Load the checkpoint's tensors named by ``state``'s keys into its values (in place; each rank its shards,
        resharded from however they were saved); a non-tensor value is replaced in ``state``."""

    def read_ranked(self, path: Path, rank: int) -> dict[str, Any] | None:
        """The objects rank ``rank`` saved, or ``None`` when that rank saved none there."""

    def set_aside(self, path: Path, why: str) -> Path:
        """Rename the checkpoint to ``<why>-<name>[-k]``: kept for inspection, never listed, resumed from or pruned."""

    def remove(self, path: Path) -> None:
        """Delete the checkpoint, first out of the listing: cut off part-way (a kill, a store failure), it leaves no
        checkpoint lookalike, only what :meth:`unfinished` finds."""

    def write_note(self, root: Path, name: str, text: str) -> None:
        """Write the small file ``<root>/<name>`` (beside the checkpoints, never one: e.g. the MLflow run a launch opened),
        whole or not at all, replacing what was there."""

    def read_note(self, root: Path, name: str) -> str | None:
        """The text :meth:`write_note` left at ``<root>/<name>``, or ``None`` when there is none."""

    def unfinished(self, root: Path) -> list[Path]:
        """What writes and removals cut off part-way left under ``root`` under a checkpoint's name (step or best), oldest
        first: never a checkpoint, skipped by a resume (with a warning) and deleted by the next write. Empty on a file
        system, whose writes and removals work under other names (``.tmp-``/``.trash-``) that the next write sweeps; a
        step directory there lacking a file was damaged afterwards (:meth:`damage`), and is kept aside for inspection."""


class DcpFileStorage:
    """:class:`CheckpointStorage` on a file system with ``torch.distributed.checkpoint``; the module docstring."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank, self.world_size = rank, world_size

    def write(self, path: Path, tensors: dict[str, Any], ranked: Mapping[str, Any], meta: Mapping[str, Any],
              files: Mapping[str, bytes] | None = None) -> None:
        tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
        try:
            if self.rank == 0:
                _sweep(path.parent)
                tmp.mkdir(parents=True)
            self._barrier()
            with stops_unwrapped(self.rank), single_process(self.world_size) as alone:
                dcp.save(tensors, checkpoint_id=str(tmp), no_dist=alone)
            buffer = io.BytesIO()  # torch.save to a file reports a full disk as a RuntimeError of its zip writer
            torch.save(dict(ranked), buffer)
            (tmp / f"rank{self.rank}.pt").write_bytes(buffer.getvalue())
            self._barrier()
            if self.rank == 0:
                for name, content in (files or {}).items():
                    (tmp / name).write_bytes(content)
                (tmp / META_FILE).write_text(json.dumps(dict(meta), indent=1))
                shutil.rmtree(path, ignore_errors=True)
                os.replace(tmp, path)
        except (OSError, CheckpointException) as e:
            cause = _os_error(e)
            if cause is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk's partial write would keep the space it took
            raise CheckpointError(write_failure(path, cause, _newest_whole(path.parent))) from None
        self._barrier()

    def exists(self, path: Path) -> bool:
        return path.exists()

    def is_complete(self, path: Path) -> bool:
        return is_complete(path)

    def checkpoints(self, root: Path, *, best: bool = False, complete: bool = True) -> list[Path]:
        return list_checkpoints(root, best, complete=complete)

    def damage(self, path: Path) -> str | None:
        return damage(path)

    def read_meta(self, path: Path) -> dict[str, Any]:
        meta: dict[str, Any] = json.loads((path / META_FILE).read_text())
        check_format(meta, path)
        return meta

    def tensor_index(self, path: Path) -> TensorIndex:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {k: list(m.size) if isinstance(m, TensorStorageMetadata) else None for k, m in saved.items()}

    def tensor_dtypes(self, path: Path) -> dict[str, torch.dtype]:
        return saved_dtypes(dcp.FileSystemReader(str(path)).read_metadata())

    def load_tensors(self, path: Path, state: dict[str, Any]) -> None:
        with stops_unwrapped(self.rank), single_process(self.world_size) as alone:
            dcp.load(state, checkpoint_id=str(path), no_dist=alone)

    def read_ranked(self, path: Path, rank: int) -> dict[str, Any] | None:
        file = path / f"rank{rank}.pt"
        if not file.exists():
            return None
        ranked: dict[str, Any] = torch.load(file, weights_only=False)
        return ranked

    def set_aside(self, path: Path, why: str) -> Path:
        target = path.with_name(f"{why}-{path.name}")
        k = 1
        while target.exists():
            target, k = path.with_name(f"{why}-{path.name}-{k}"), k + 1
        os.replace(path, target)
        return target

    def remove(self, path: Path) -> None:
        # out of the listing first, in one rename: a kill part-way through deleting leaves no half-deleted checkpoint
        # (one that still looks complete, or one without meta.json that no rotation would ever delete); the next
        # write sweeps what is left of it
        trash = path.with_name(f"{TRASH_PREFIX}{path.name}")
        shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def write_note(self, root: Path, name: str, text: str) -> None:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{TMP_PREFIX}{name}"
        tmp.write_text(text)
        os.replace(tmp, root / name)

    def read_note(self, root: Path, name: str) -> str | None:
        try:
            return (root / name).read_text()
        except FileNotFoundError:
            return None

    def unfinished(self, root: Path) -> list[Path]:
        return []

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def saved_dtypes(metadata: Metadata) -> dict[str, torch.dtype]:
    """Each tensor's dtype as DCP's index (``.metadata``) recorded it, by key."""
    return {k: m.properties.dtype for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}


def list_checkpoints(root: str | Path, best: bool = False, *, complete: bool = True) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (``best-*`` ones if ``best``; whole or not unless ``complete``)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and bool(m.group(1)) == best and (is_complete(p) if complete else p.is_dir()):
            found.append((int(m.group(2)), p))
    return [p for _, p in sorted(found)]


def is_complete(path: Path) -> bool:
    """A checkpoint directory whose write finished (meta.json is written last)."""
    return (path / META_FILE).is_file() and (path / INDEX_FILE).is_file()


def damage(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed from, or ``None`` when every file it needs is whole.

    Checks what can be checked without loading: ``meta.json`` and DCP's ``.metadata`` exist and parse,
    every data file the index points into exists and is long enough, each saving rank's ``rank<r>.pt``
    exists. A checkpoint written by :meth:`DcpFileStorage.write` passes; one that fails was damaged
    afterwards (a disk fault, a partial copy, a deleted file).
    """
    for name in (META_FILE, INDEX_FILE):
        if not (path / name).is_file():
            return f"{name} is missing"
    try:
        meta = json.loads((path / META_FILE).read_text())
        index = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # any parse failure of either file means damage
        return f"meta.json or .metadata cannot be read ({type(e).__name__}: {str(e)[:200]})"
    check_format(meta, path)  # a newer version's checkpoint is refused by name, never set aside as damaged
    odd = meta_fault(meta, path)
    if odd is not None:
        return odd
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
    for r in range(meta.get("world_size", 1)):
        if not (path / f"rank{r}.pt").is_file():
            return f"rank{r}.pt is missing"
    return None


def check_format(meta: Any, path: Path | str) -> None:
    """Refuse the checkpoint at ``path`` (its parsed ``meta.json`` is ``meta``) when a later version wrote it in a
    format this one does not know (:data:`FORMAT`): its files may be whole, but what this version would read from them
    is not what was saved, so it is neither loaded nor set aside as damaged. One without a format (written before
    formats were recorded) is format 1.

    Raises:
        CheckpointError: naming the two formats and the fix.
    """
    written = meta.get(FORMAT_KEY, 1) if isinstance(meta, dict) else 1
    if type(written) is not int or written < 1:
        raise CheckpointError(f"checkpoint {path}: meta.json's {FORMAT_KEY} is {written!r}, not a checkpoint format (a whole "
                              f"number from 1; edited by hand?). Fix: put back the meta.json the run wrote, or point at another "
                              f"checkpoint")
    if written > FORMAT:
        raise CheckpointError(f"checkpoint {path} was written by a newer recsys_runner (checkpoint format {written}; this "
                              f"version reads format {FORMAT} and older), so it would be read otherwise than it was saved. Fix: "
                              f"run this command with the recsys_runner version that wrote it or a later one (the training "
                              f"run's manifest.git_commit tag names its commit), or point at a checkpoint this version wrote")


POSITION_KEYS = ("step", "epoch", "epoch_step")
"""``meta.json``'s keys saying where training stands, written by every version: a resume reads all three."""


def meta_fault(meta: Any, path: Path) -> str | None:
    """What is wrong with a parsed ``meta.json`` (edited by hand, or not one this program wrote), or ``None``: the
    position keys are whole numbers (the step the one a ``step_<n>`` name says), ``world_size`` one above 0. Checked
    with the files, so a resume falls back from such a checkpoint as from a damaged one, instead of failing part-way."""
    if not isinstance(meta, dict):
        return f"meta.json holds a {type(meta).__name__}, not an object"
    for key in POSITION_KEYS:
        value = meta.get(key)
        if type(value) is not int or value < 0:
            return f"meta.json's {key} is {'missing' if key not in meta else repr(value)}, not a whole number (edited by hand?)"
    world_size = meta.get("world_size", 1)
    if type(world_size) is not int or world_size < 1:
        return f"meta.json's world_size is {world_size!r}, not a number of ranks (edited by hand?)"
    named = STEP_DIR.match(path.name)
    if named is not None and int(named.group(2)) != meta["step"]:
        return f"meta.json's step is {meta['step']}, but the directory's name says {int(named.group(2))} (edited or renamed by hand?)"
    return None


def _sweep(root: Path) -> None:
    """Delete what killed writes and rotations left in ``root`` (``.tmp-*``, ``.trash-*``): run by the one writer (it
    holds the directory's lock) before each write, so that a full disk is not filled further by dead partial copies."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


def _os_error(e: BaseException) -> OSError | None:
    """The file system's error behind ``e``: ``e`` itself, or the one a rank's DCP write failed with (DCP wraps it in a
    ``CheckpointException``, a ``BaseException`` that no ``except Exception`` handler sees)."""
    if isinstance(e, OSError):
        return e
    if isinstance(e, CheckpointException):
        return next((exc for exc, _ in e.failures.values() if isinstance(exc, OSError)), None)
    return None


_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _newest_whole(root: Path) -> Path | None:
    """The newest complete checkpoint in ``root``, step or best, or ``None`` when it holds none."""
    found = [*list_checkpoints(root), *list_checkpoints(root, best=True)]
    return max(found, key=step_of) if found else None


def write_failure(path: Path, cause: OSError, newest: Path | None) -> str:
    """What a checkpoint write the file system refused tells the user: the checkpoint, the system's reason, that the
    partial write is removed (never listed), what is left to resume from (``newest``, the newest whole checkpoint
    beside it; ``None`` when this was the first in its directory: then nothing is, and fewer kept checkpoints would
    free nothing), and the fix for that reason."""
    reason = os.strerror(cause.errno) if cause.errno else str(cause)
    if newest is not None:
        kept = f"the checkpoints before it in {path.parent} are whole (the newest: {newest.name})"
    else:
        kept = f"no checkpoint was written in {path.parent} before it, so there is none to resume from yet"
    if cause.errno in _SPACE:
        fewer = " (or lower checkpoint.keep_last so fewer checkpoints are kept)" if newest is not None else ""
        fix = f"free space on the disk holding {path.parent}{fewer}, or set checkpoint.dir=<a directory with room>"
    elif cause.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"make {path.parent} writable for this user, or set checkpoint.dir=<a writable directory>"
    else:
        fix = f"check the disk holding {path.parent}, or set checkpoint.dir=<another directory>"
    return (f"checkpoint {path} could not be written: {reason} ({cause.filename or path}); the partial write was removed and "
            f"{kept}. Fix: {fix}")
