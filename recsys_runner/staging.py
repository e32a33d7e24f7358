"""An output folder replaced as a whole: what it holds, and a new output staged aside and moved into place only when complete.

``export`` (``export.dir``) and ``python -m recsys_runner.data sequences`` (its output folder) write several files that
belong together. A reader must find the whole new output or the whole earlier one, never a file half written or the
files of two runs, whatever stops the writer (an error, SIGTERM, kill -9). So the output is built in a staging folder
and moved into place when complete:

* on the local disk the staging folder is a hidden sibling, ``.<name>.staging-<pid>`` (same file system: the move is a
  rename); the earlier output is first renamed aside, then deleted;
* an object store has no rename: the output is staged in a local temporary folder and uploaded when complete, each
  upload replacing its object whole (a store shows an object only once its upload completes); objects of the earlier
  output that the new one does not have are deleted after.

Both rooms get the output's place already resolved (:func:`recsys_runner.uris.as_path`: a local path or a
:class:`~recsys_runner.uris.UriPath`) and never ask which it is: that is decided here. May import ``stores``,
``uris`` and ``errors``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

from recsys_runner import stores, uris
from recsys_runner.errors import ConfigError, UserError


def held_names(folder: Path, what: str, cls: type[UserError] = ConfigError) -> list[str]:
    """The names directly in ``folder`` (for a prefix in an object store: of the objects and sub-prefixes under it),
    sorted; none for a folder that does not exist.

    Raises:
        cls: ``folder`` is a local file (``what`` names the setting, e.g. ``export.dir=…``).
    """
    if uris.is_remote(folder):
        return sorted({p.removeprefix(str(folder).rstrip("/") + "/").split("/", 1)[0] for p in stores.find(str(folder), cls)})
    if folder.exists() and not folder.is_dir():
        raise cls(f"{what} is a file, not a folder. Fix: name a new (or empty) folder")
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def is_local_file(folder: Path, name: str) -> bool:
    """Whether ``folder/name`` is a plain file; every object of a store is one."""
    return uris.is_remote(folder) or (folder / name).is_file()


class StagedFolder:
    """The output being written to ``out`` (module docstring): write its files under :attr:`path`, then :meth:`commit`;
    leaving the ``with`` block deletes the staging folder, so an error or a signal before :meth:`commit` leaves ``out``
    as it was."""

    def __init__(self, out: Path, cls: type[UserError] = ConfigError) -> None:
        self.out, self.cls = out, cls
        self.committed = False
        self._remote = uris.is_remote(out)
        self._staging: Path | None = None

    @property
    def path(self) -> Path:
        """The staging folder: where the output's files are written until :meth:`commit`."""
        assert self._staging is not None, "StagedFolder.path outside its with block"
        return self._staging

    @property
    def local(self) -> Path:
        """Where the complete output is on the local disk: ``out`` once committed there, else the staging folder (an
        object store's output is uploaded from it, and it stays until the ``with`` block ends)."""
        return self.out if self.committed and not self._remote else self.path

    def __enter__(self) -> StagedFolder:
        if self._remote:
            self._staging = Path(tempfile.mkdtemp(prefix="recsys-staging-")) / self.out.name
        else:
            self.out = self.out.absolute()
            self._staging = self.out.parent / f".{self.out.name}.staging-{os.getpid()}"
            shutil.rmtree(self._staging, ignore_errors=True)  # left by an earlier process of this id, killed (-9) here
        self._staging.mkdir(parents=True)
        return self

    def commit(self) -> None:
        """Move the complete output into place, replacing an earlier one as a whole (module docstring)."""
        if self._remote:
            written = set(stores.upload(self.path, str(self.out), self.cls))
            for stale in sorted(set(stores.find(str(self.out), self.cls)) - written):
                stores.remove(stale, self.cls)
            self.committed = True
            return
        old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)  # left by an earlier process of this id that was killed here
        if self.out.exists():  # an earlier output, or an empty folder
            os.replace(self.out, old)
        try:
            os.replace(self.path, self.out)
        except BaseException:
            if old.exists() and not self.out.exists():
                os.replace(old, self.out)
            raise
        self.committed = True
        shutil.rmtree(old, ignore_errors=True)

    def __exit__(self, _type: type[BaseException] | None, _exc: BaseException | None, _tb: TracebackType | None) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging.parent if self._remote else self._staging, ignore_errors=True)
            self._staging = None
