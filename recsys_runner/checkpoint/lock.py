"""One writer per directory: an OS file lock that names its holder.

Two launches that share ``checkpoint.dir`` would interleave checkpoint writes and continue the same
MLflow run from two processes. :class:`DirectoryLock` refuses the second one at start. It holds
``fcntl.flock`` on ``<dir>/.lock`` for the life of the run: the kernel releases a flock when its
process dies however it dies (``kill -9``, OOM, a node reboot on a shared file system that supports
locks), so a lock left by a killed run never blocks its resume — there is no stale-PID guessing.
The file's text (host, PID, start time, command) only serves the error message.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


class DirectoryInUse(RuntimeError):
    """Another live process holds the directory's lock."""

    def __init__(self, directory: Path, holder: dict[str, Any]) -> None:
        self.directory, self.holder = directory, holder
        who = ", ".join(f"{k} {holder[k]}" for k in ("host", "pid") if k in holder) or "an unknown process"
        since = f" since {holder['started']}" if "started" in holder else ""
        command = f" ({holder['command']})" if holder.get("command") else ""
        super().__init__(f"{directory} is in use by another live run: {who}{since}{command}")


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
