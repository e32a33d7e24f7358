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

Whether a local output can be written at all (:func:`unwritable`, :func:`check_writable`) is asked here too, by every
command before its work: a file where a folder goes, a read-only disk or a missing permission is one line naming the
setting, not a raw ``OSError`` at the end.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

from recsys_runner import stores, uris
from recsys_runner.errors import ConfigError, UserError


def unwritable(folder: Path) -> tuple[Path, str, str] | None:
    """Why files cannot be written into ``folder`` (made, with its parents, if missing, as its writer would):
    ``(the path at fault, the cause, its fix)``, or ``None`` when it can.

    A missing folder is probed at its nearest existing parent; the probe is a file created and removed at once, so
    nothing stays (a permission test by mode bits would miss root, ACLs and read-only mounts)."""
    folder = folder.absolute()
    base = folder
    while not os.path.lexists(base) and base != base.parent:
        base = base.parent
    if not base.is_dir():
        what = "a link to nothing" if base.is_symlink() and not base.exists() else "a file"
        where = "in its place" if base == folder else f"in the place of its parent folder {base}"
        return base, f"{what} is {where}", f"move or remove {base}"
    try:
        fd, probe = tempfile.mkstemp(dir=base, prefix=".recsys_write_probe_")
    except PermissionError:
        return base, f"permission denied: this user (uid {os.getuid()}) cannot create files in {base}", \
            f"make {base} writable for this user (chmod u+w {base}, or chown it)"
    except OSError as e:
        cause = "the file system is read-only" if e.errno == errno.EROFS else f"{type(e).__name__}: {e.strerror or e}"
        return base, f"{cause} ({base})", f"write somewhere else than {base}"
    os.close(fd)
    os.unlink(probe)
    return None


def check_writable(out: Path, what: str, instead: str, cls: type[UserError] = ConfigError) -> None:
    """Refuse a local output folder ``out`` whose files could not be written, before any work: a :class:`StagedFolder` is
    built in a sibling and renamed into place, so the folder above ``out`` must take new entries (an ``out`` that exists
    is probed at its parent, a missing one at its nearest existing parent). Without this the command fails at its end, with
    a raw ``OSError``, after the work. ``what`` names the output in the message (``export.dir=<out>``), ``instead`` the
    other way out (``another export.dir``).

    Raises:
        cls: naming ``what``, the cause and the fix.
    """
    if uris.is_remote(out):
        return
    found = unwritable(out.parent if out.exists() else out)
    if found is not None:
        _, cause, fix = found
        raise cls(f"{what} cannot be written: {cause}. Fix: {fix}, or {instead}")


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
