"""Local folders a run writes into (TensorBoard event files, MLflow's local artifacts, profiler traces), checked when it is built.

Their writers open them late: TensorBoard's ``SummaryWriter`` at the first metric, MLflow at the first artifact, the
profiler after its steps. A file in a folder's place or a folder this user cannot write would then fail after training
started, with a raw ``FileExistsError``/``PermissionError``, or be buffered as a tracking outage. :func:`check_folder`
probes each before the data and the model are built and raises one :class:`~recsys_runner.errors.TrackingError` line
that names the setting, the folder, the cause and the fix.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from recsys_runner.errors import TrackingError

__all__ = ["check_folder", "unwritable"]


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


def check_folder(folder: Path, *, setting: str, writes: str, fixes: Sequence[str]) -> None:
    """Raise :class:`TrackingError` unless files can be written into ``folder``:
    ``<setting> writes <writes> into <folder>, which cannot be written: <cause>. Fix: <the cause's fix>, <fixes>``.

    Args:
        folder: the folder (it may not exist yet).
        setting: the setting that makes the run write there, as the user writes it (``tracking.tensorboard=true``).
        writes: what is written there (``its event files``).
        fixes: the other ways out, after the cause's own (another folder, the setting off).
    """
    found = unwritable(folder)
    if found is None:
        return
    _, cause, fix = found
    ways = [fix, *fixes]
    said = ", ".join(ways[:-1]) + f", or {ways[-1]}" if len(ways) > 1 else fix
    raise TrackingError(f"{setting} writes {writes} into {folder.absolute()}, which cannot be written: {cause}. Fix: {said}")
