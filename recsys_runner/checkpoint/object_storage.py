"""Checkpoints in an object store (``checkpoint.dir=s3://bucket/prefix``): :class:`DcpObjectStorage`, the
:class:`~recsys_runner.checkpoint.storage.CheckpointStorage` of DCP's fsspec writer and reader, and
:func:`storage_for`, which picks the storage of a checkpoint address.

The layout is the file system's (``<dir>/step_<n>/`` with DCP's ``.metadata`` and data files, ``rank<r>.pt``,
``meta.json``). An object store has no rename, so **atomic** means: ``meta.json`` is written last, by rank 0, after
every rank's objects are in (``PutObject`` makes each object whole or absent), and deleted first when a checkpoint is
removed (rotation; renaming aside is copy-then-delete); a prefix without ``meta.json`` is never listed as a checkpoint.
So a write or a removal that fails or is killed part-way leaves the other checkpoints as they were and a prefix that is
recognizably unfinished (:meth:`DcpObjectStorage.unfinished`): a resume skips it with a warning, and the next write
deletes it, as the next write on disk sweeps ``.tmp-``/``.trash-``. Every store failure is a
:class:`~recsys_runner.errors.CheckpointError` naming the URI (:func:`recsys_runner.stores.store_error`).
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from recsys_runner import store_settings, stores, uris
from recsys_runner.checkpoint.storage import (
    INDEX_FILE,
    META_FILE,
    STEP_DIR,
    CheckpointStorage,
    DcpFileStorage,
    TensorIndex,
    check_format,
    saved_dtypes,
    single_process,
    stops_unwrapped,
)
from recsys_runner.errors import CheckpointError

T = TypeVar("T")


def storage_for(path: Path | None, rank: int = 0, world_size: int = 1) -> CheckpointStorage:
    """The storage of checkpoints at ``path``: :class:`DcpObjectStorage` for a URI, else DCP on the file system."""
    if path is not None and uris.is_remote(path):
        return DcpObjectStorage(rank, world_size)
    return DcpFileStorage(rank, world_size)


class DcpObjectStorage:
    """:class:`CheckpointStorage` in an object store; the module docstring."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank, self.world_size = rank, world_size

    def _fs(self, path: Path) -> tuple[Any, str]:
        return stores.fsspec_filesystem(str(path))

    def _call(self, path: Path, action: Callable[[], T], doing: str = "reading the checkpoint") -> T:
        """``action()``, with a store failure raised as a :class:`CheckpointError` naming ``path`` and what was being
        done. A botocore error (an unreachable endpoint) is always the store's; an ``OSError`` or a ``ValueError`` only
        when it says so (else it is a bug or a damaged object, raised as it is)."""
        try:
            with store_settings.waiting(), stops_unwrapped(self.rank):  # a stop inside DCP's save or load comes out as itself
                return action()
        except FileNotFoundError:
            raise
        except stores.STORE_ERRORS as e:
            if isinstance(e, (OSError, ValueError)) and not stores.is_store_failure(e) and not isinstance(e, PermissionError):
                raise
            raise stores.store_error(str(path), e, cls=CheckpointError, doing=doing) from None

    def write(self, path: Path, tensors: dict[str, Any], ranked: Mapping[str, Any], meta: Mapping[str, Any],
              files: Mapping[str, bytes] | None = None) -> None:
        fs, key = self._fs(path)
        writing = "writing the checkpoint"
        if self.rank == 0:
            if self._call(path, lambda: _exists(fs, key), writing):
                self._call(path, lambda: fs.rm(key, recursive=True), writing)  # a partial write of this step, set aside by nobody
            for left in self.unfinished(path.parent):  # what cut-off writes and removals left: the one writer's to delete
                self.remove(left)
        self._barrier()
        writer = FsspecWriter(str(path), sync_files=False, **store_settings.fsspec_options())
        _one_policy(writer)
        with single_process(self.world_size) as alone:
            self._call(path, lambda: dcp.save(tensors, storage_writer=writer, no_dist=alone), writing)
        buffer = io.BytesIO()
        torch.save(dict(ranked), buffer)
        self._call(path, lambda: fs.pipe_file(f"{key}/rank{self.rank}.pt", buffer.getvalue()), writing)
        self._barrier()
        if self.rank == 0:
            for name, content in (files or {}).items():
                self._call(path, functools.partial(fs.pipe_file, f"{key}/{name}", content), writing)
        if self.rank == 0:  # last: the checkpoint is complete once this object exists
            self._call(path, lambda: fs.pipe_file(f"{key}/{META_FILE}", json.dumps(dict(meta), indent=1).encode()), writing)
        self._barrier()

    def exists(self, path: Path) -> bool:
        fs, key = self._fs(path)
        return bool(self._call(path, lambda: _exists(fs, key)))

    def is_complete(self, path: Path) -> bool:
        fs, key = self._fs(path)
        return self._call(path, lambda: stores.is_object(fs, f"{key}/{META_FILE}") and stores.is_object(fs, f"{key}/{INDEX_FILE}"),
                          "checking whether the checkpoint is complete")

    def _listing(self, root: Path) -> dict[str, dict[str, int]]:
        """``name → {file: size}`` of every prefix directly under ``root``, from one listing."""
        fs, key = self._fs(root)
        prefix = key.rstrip("/") + "/"
        found: dict[str, dict[str, int]] = {}
        try:
            entries = self._call(root, lambda: fs.find(prefix, detail=True))
        except FileNotFoundError:
            return {}
        for name, info in entries.items():
            parts = name[len(prefix):].split("/", 1) if name.startswith(prefix) else []
            if len(parts) == 2:
                found.setdefault(parts[0], {})[parts[1]] = int(info.get("size") or 0)
        return found

    def checkpoints(self, root: Path, *, best: bool = False, complete: bool = True) -> list[Path]:
        found = []
        for name, files in self._listing(root).items():
            m = STEP_DIR.match(name)
            if m and bool(m.group(1)) == best and (not complete or (META_FILE in files and INDEX_FILE in files)):
                found.append((int(m.group(2)), root / name))
        return [p for _, p in sorted(found)]

    def damage(self, path: Path) -> str | None:
        files = self._listing(path.parent).get(path.name, {})
        for name in (META_FILE, INDEX_FILE):
            if name not in files:
                return f"{name} is missing"
        try:
            meta = self.read_meta(path)
            index = _reader(path).read_metadata()
        except CheckpointError:
            raise
        except Exception as e:  # any parse failure of either object means damage
            return f"meta.json or .metadata cannot be read ({type(e).__name__}: {str(e)[:200]})"
        for info in (index.storage_data or {}).values():
            size = files.get(info.relative_path, -1)
            if size < 0:
                return f"{info.relative_path} is missing"
            if info.offset + info.length > size:
                return f"{info.relative_path} is truncated ({size} bytes; the index needs {info.offset + info.length})"
        for r in range(int(meta.get("world_size", 1))):
            if f"rank{r}.pt" not in files:
                return f"rank{r}.pt is missing"
        return None

    def read_meta(self, path: Path) -> dict[str, Any]:
        fs, key = self._fs(path)
        meta: dict[str, Any] = json.loads(self._call(path, lambda: fs.cat_file(f"{key}/{META_FILE}")))
        check_format(meta, path)
        return meta

    def tensor_index(self, path: Path) -> TensorIndex:
        saved = self._call(path, _reader(path).read_metadata).state_dict_metadata
        return {k: list(m.size) if isinstance(m, TensorStorageMetadata) else None for k, m in saved.items()}

    def tensor_dtypes(self, path: Path) -> dict[str, torch.dtype]:
        return saved_dtypes(self._call(path, _reader(path).read_metadata))

    def load_tensors(self, path: Path, state: dict[str, Any]) -> None:
        reader = _reader(path)
        with single_process(self.world_size) as alone:
            self._call(path, lambda: dcp.load(state, storage_reader=reader, no_dist=alone))

    def read_ranked(self, path: Path, rank: int) -> dict[str, Any] | None:
        fs, key = self._fs(path)
        try:
            data = self._call(path, lambda: fs.cat_file(f"{key}/rank{rank}.pt"))
        except FileNotFoundError:
            return None
        ranked: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=False)
        return ranked

    def set_aside(self, path: Path, why: str) -> Path:
        names = self._listing(path.parent)
        target, k = path.with_name(f"{why}-{path.name}"), 1
        while target.name in names:
            target, k = path.with_name(f"{why}-{path.name}-{k}"), k + 1
        fs, key = self._fs(path)
        _, target_key = self._fs(target)
        self._call(path, lambda: fs.copy(key.rstrip("/") + "/", target_key.rstrip("/") + "/", recursive=True), "setting the checkpoint aside")
        self.remove(path)
        return target

    def remove(self, path: Path) -> None:
        # meta.json first, alone: a removal cut off after it (a kill, a store failure, a key s3fs's bulk delete failed
        # silently) leaves a prefix that is recognizably no checkpoint (unfinished), never one that still looks complete
        fs, key = self._fs(path)
        removing = "removing the checkpoint"
        try:
            self._call(path, lambda: fs.rm_file(f"{key}/{META_FILE}"), removing)
            self._call(path, lambda: fs.rm(key, recursive=True), removing)
        except FileNotFoundError:
            pass

    def write_note(self, root: Path, name: str, text: str) -> None:
        fs, key = self._fs(root)
        self._call(root, lambda: fs.pipe_file(f"{key.rstrip('/')}/{name}", text.encode()), f"writing {name}")

    def read_note(self, root: Path, name: str) -> str | None:
        fs, key = self._fs(root)
        try:
            data = self._call(root, lambda: fs.cat_file(f"{key.rstrip('/')}/{name}"), f"reading {name}")
        except FileNotFoundError:
            return None
        return bytes(data).decode()

    def unfinished(self, root: Path) -> list[Path]:
        found = [(int(m.group(2)), bool(m.group(1)), root / name) for name, files in self._listing(root).items()
                 if (m := STEP_DIR.match(name)) and META_FILE not in files]
        return [p for *_, p in sorted(found)]

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def _reader(path: Path) -> FsspecReader:
    reader = FsspecReader(str(path), **store_settings.fsspec_options())
    _one_policy(reader)
    return reader


def _one_policy(dcp_io: FsspecReader | FsspecWriter) -> None:
    """DCP's reader and writer make their own s3fs instance: give it the package's one retry policy
    (:func:`recsys_runner.store_settings.one_retry_policy`), so a stalled store fails a checkpoint write in the configured bound."""
    inner = getattr(dcp_io.fs, "fs", None)  # torch's FileSystem wrapper holds the fsspec instance it made
    if inner is not None:
        store_settings.one_retry_policy(inner)


def _exists(fs: Any, key: str) -> bool:
    """Whether ``key`` exists, a store failure raised (``fs.exists`` answers ``False`` to one, and every later call
    would wait for the stalled store again)."""
    try:
        fs.info(key)
    except FileNotFoundError:
        return False
    return True
