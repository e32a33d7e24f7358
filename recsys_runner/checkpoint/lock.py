"""One writer per directory: an OS file lock that names its holder (:class:`DirectoryLock`), and in an object store a
conditional create with a renewed lease (:class:`ObjectStoreLock`; :func:`lock_for` picks).

Two launches that share ``checkpoint.dir`` would interleave checkpoint writes and continue the same
MLflow run from two processes. :class:`DirectoryLock` refuses the second one at start. It holds
``fcntl.flock`` on ``<dir>/.lock`` for the life of the run: the kernel releases a flock when its
process dies however it dies (``kill -9``, OOM, a node reboot on a shared file system that supports
locks), so a lock left by a killed run never blocks its resume — there is no stale-PID guessing.
The file's text (host, PID, start time, command) only serves the error message.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from recsys_runner import store_settings, stores, uris
from recsys_runner.errors import CheckpointError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
RELEASE_WAIT_S = 3.0
"""How long :meth:`ObjectStoreLock.release` waits for the store to delete the lock before leaving it to be taken over."""


class DirectoryInUse(RuntimeError):
    """Another live process holds the directory's lock."""

    def __init__(self, directory: Path, holder: dict[str, Any]) -> None:
        self.directory, self.holder = directory, holder
        who = ", ".join(f"{k} {holder[k]}" for k in ("host", "pid") if k in holder) or "an unknown process"
        since = f" since {holder['started']}" if "started" in holder else ""
        command = f" ({holder['command']})" if holder.get("command") else ""
        super().__init__(f"{directory} is in use by another live run: {who}{since}{command}")

_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
"""What ``flock`` raises on a file system without locks (NFS mounted ``nolock``, some FUSE and Lustre mounts)."""


class DirectoryLock:
    """An exclusive, non-blocking lock on ``directory`` (created when missing); see the module docstring."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> None:
        """Take the lock or raise :class:`DirectoryInUse` naming the holder; idempotent."""
        if self._file is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the life of the lock
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.seek(0)
            holder = _parse(f.read())
            f.close()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DirectoryInUse(self.directory, holder) from None
            if e.errno in _NO_LOCKS:
                raise CheckpointError(
                    f"checkpoint.dir={self.directory}: its file system refuses file locks ({os.strerror(e.errno)}), as an NFS "
                    f"mount with nolock or a FUSE or Lustre mount without flock does. A run holds {LOCK_NAME} there so that "
                    f"two runs never write one directory. Fix: set checkpoint.dir=<a directory on a local disk, or on a "
                    f"shared file system mounted with locks (NFS with lockd, Lustre with -o flock)>") from None
            raise
        f.seek(0)
        previous = _parse(f.read())
        if previous:
            log.info("%s: the previous holder (host %s, PID %s) is gone; taking over", self.path, previous.get("host"), previous.get("pid"))
        f.truncate(0)
        f.write(json.dumps(holder_record()))
        f.flush()
        self._file = f

    def release(self) -> None:
        """Release the lock (the file stays; its text is only read while someone holds it); idempotent."""
        if self._file is None:
            return
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        finally:
            self._file.close()
            self._file = None

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


def holder_record() -> dict[str, Any]:
    """Who holds a lock: host, PID, start time and command line."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv)[:500]}


def _parse(text: str) -> dict[str, Any]:
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


class ObjectStoreLock:
    """One writer per ``checkpoint.dir`` in an object store: ``<dir>/.lock`` created only if absent (``PutObject`` with
    ``If-None-Match: *``, the store's compare-and-set), renewed by a background thread every third of
    ``storage.lock_ttl_s``. No kernel drops it when its holder dies, so a lock counts as abandoned when it was not renewed
    for ``lock_ttl_s``, or at once when it names this host and a PID that is gone (a ``kill -9`` and its resume); a
    lock of another host is watched until its lease runs out (refused as soon as it is renewed); an abandoned lock is
    deleted only if unchanged (``If-Match`` on its ETag), then created again, so of two runs taking
    it over one wins."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = str(directory).rstrip("/")
        self.uri = f"{self.directory}/{LOCK_NAME}"
        self.fs, self.key = stores.fsspec_filesystem(self.uri)
        self.ttl = store_settings.settings().lock_ttl_s
        self._stop: threading.Event | None = None

    @property
    def held(self) -> bool:
        return self._stop is not None

    def acquire(self) -> None:
        """Take the lock or raise :class:`DirectoryInUse` naming the holder; idempotent. The run's first call to the
        store: a missing bucket or a store that cannot be reached is a :class:`CheckpointError` here, before anything
        is built, within the bound of ``storage.*``."""
        if self._stop is not None:
            return
        with self._store_errors("taking the run's lock"):
            self._acquire()
        self._stop = threading.Event()
        threading.Thread(target=self._renew, args=(self._stop,), name="checkpoint-lock", daemon=True).start()

    @contextlib.contextmanager
    def _store_errors(self, doing: str) -> Iterator[None]:
        try:
            yield
        except DirectoryInUse:
            raise
        except stores.STORE_ERRORS as e:
            if isinstance(e, FileNotFoundError) or "NoSuchBucket" in str(e):
                bucket = self.directory.split("://", 1)[-1].split("/", 1)[0]
                raise CheckpointError(f"checkpoint.dir={self.directory!r}: its bucket {bucket!r} does not exist (at "
                                      f"{store_settings.endpoint_url() or 'AWS'}; {type(e).__name__}: {e}). Fix: create it, or correct "
                                      f"checkpoint.dir (and storage.endpoint_url / AWS_ENDPOINT_URL)") from None
            raise stores.store_error(self.directory, e, key="checkpoint.dir", cls=CheckpointError, doing=doing) from None

    def _acquire(self) -> None:
        if not self._create():
            holder, etag = self._holder()
            if holder is not None and not _abandoned(holder, self.ttl) and not self._expires_unrenewed(holder, etag):
                raise DirectoryInUse(uris.as_path(self.directory), holder)
            if holder is not None:
                log.info("%s: the previous holder (host %s, PID %s) is gone; taking over", self.uri, holder.get("host"), holder.get("pid"))
                with contextlib.suppress(*stores.STORE_ERRORS):  # someone else took it over first: the create below fails
                    self.fs.call_s3("delete_object", Bucket=self.key.split("/", 1)[0], Key=self.key.split("/", 1)[1], IfMatch=etag)
            if not self._create():
                raise DirectoryInUse(uris.as_path(self.directory), self._holder()[0] or {})

    def _record(self) -> bytes:
        return json.dumps({**holder_record(), "renewed": time.time()}).encode()

    def _expires_unrenewed(self, holder: dict[str, Any], etag: str | None) -> bool:
        """For a holder on another host (whose PID cannot be checked): wait until its lease runs out, and say whether it
        did so without a renewal (the holder is gone: a preempted job requeued on another node) or was renewed (alive)."""
        if holder.get("host") == socket.gethostname():
            return False
        deadline = float(holder.get("renewed", 0)) + self.ttl
        log.info("%s is held by host %s, PID %s: waiting up to %.0f s to see whether it is renewed", self.uri, holder.get("host"),
                 holder.get("pid"), max(deadline - time.time(), 0))
        while time.time() < deadline:
            time.sleep(min(1.0, max(deadline - time.time(), 0.01)))
            if self._holder()[1] != etag:
                return False
        return True

    def _create(self) -> bool:
        """Create the lock object if there is none; whether this call created it."""
        try:
            self.fs.pipe_file(self.key, self._record(), mode="create")
        except FileExistsError:
            return False
        except OSError as e:
            if "PreconditionFailed" in str(e) or "412" in str(e):
                return False
            raise
        return True

    def _holder(self) -> tuple[dict[str, Any] | None, str | None]:
        try:
            info = self.fs.info(self.key)
            return _parse(self.fs.cat_file(self.key).decode()), info.get("ETag")
        except FileNotFoundError:
            return None, None

    def _renew(self, stop: threading.Event) -> None:
        while not stop.wait(self.ttl / 3):
            try:
                self.fs.pipe_file(self.key, self._record())
            except stores.STORE_ERRORS as e:  # the store is away for a moment: the next renewal tries again
                log.warning("%s: the lock could not be renewed (%s)", self.uri, e)

    def release(self) -> None:
        """Stop renewing and delete the lock object; idempotent. Waits for the delete at most :data:`RELEASE_WAIT_S`
        (a store that answers deletes in milliseconds): a run that ends, or is stopped by a signal, because the store
        stopped answering must not wait the whole retry bound once more. A lock left behind is taken over by the
        resume (the class docstring)."""
        if self._stop is None:
            return
        self._stop.set()
        self._stop = None
        done = threading.Event()

        def delete() -> None:
            with contextlib.suppress(*stores.STORE_ERRORS):
                self.fs.rm_file(self.key)
            done.set()

        threading.Thread(target=delete, name="checkpoint-unlock", daemon=True).start()
        if not done.wait(RELEASE_WAIT_S):
            log.warning("%s: the lock could not be deleted (the store does not answer); the run that resumes here takes it "
                        "over (on this host at once, elsewhere after storage.lock_ttl_s=%g s)", self.uri, self.ttl)

    def __enter__(self) -> ObjectStoreLock:
        self.acquire()
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


def _abandoned(holder: dict[str, Any], ttl: float) -> bool:
    """Whether a lock's holder is gone: not renewed for ``ttl`` seconds, or a dead PID on this host."""
    if time.time() - float(holder.get("renewed", 0)) > ttl:
        return True
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    return False


def lock_for(directory: Path) -> DirectoryLock | ObjectStoreLock:
    """The one-writer lock of a checkpoint directory: a file lock on disk, a conditional create in an object store."""
    return ObjectStoreLock(directory) if uris.is_remote(directory) else DirectoryLock(directory)
