"""Where ``python -m recsys_runner.data sequences`` writes: a used folder is refused unless ``--overwrite``; files are staged, then moved in whole.

``--overwrite`` replaces an earlier output as a whole. A local output folder is built as a hidden sibling, ``.<name>.staging-<pid>``, and renamed into place (an earlier output
is first renamed aside, then deleted), so the folder holds the whole new output or what it held before, never a file
half written or the files of two runs. An object store has no rename: the files are written to a local temporary
folder and uploaded when all are complete, each upload replacing its object whole (a store shows an object only once
its upload completes). Leaving the ``with`` block of :class:`StagedOutput` on an error or a signal deletes the staging
folder. May import ``stores`` and ``errors``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

from recsys_runner import stores
from recsys_runner.errors import ConfigError

OUTPUT_FILES = ("train.parquet", "eval.parquet")
"""What ``sequences`` writes into its output folder: all of it, and what ``--overwrite`` may replace."""


def check_output(output: str, overwrite: bool) -> list[str]:
    """The names an earlier output left in ``output`` (none for a new or empty folder), checked before the log is read.

    Raises:
        ConfigError: ``output`` is a file, or holds anything without ``overwrite``, or holds anything but an earlier
            output's files (naming the folder, what it holds and the fix).
    """
    remote = stores.is_uri(output)
    out = stores.as_path(output)
    if not remote and out.exists() and not out.is_dir():
        raise ConfigError(f"the output {output} is a file, not a folder. Fix: name a new (or empty) folder for {' and '.join(OUTPUT_FILES)}")
    held = sorted(p.rsplit("/", 1)[-1] for p in stores.glob(f"{output.rstrip('/')}/*", ConfigError)) if remote else \
        sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return []
    foreign = [n for n in held if n not in OUTPUT_FILES or (not remote and not (out / n).is_file())]
    shown = held[:8] + ([f"… {len(held) - 8} more"] if len(held) > 8 else [])
    if foreign:
        raise ConfigError(f"the output folder {output} is not empty: it holds {shown}, and {foreign[:8]} are not files sequences writes "
                          f"({', '.join(OUTPUT_FILES)}), so not even --overwrite replaces them. Fix: a new output folder, or move those away")
    if not overwrite:
        raise ConfigError(f"the output folder {output} already holds an earlier output ({shown}). Fix: --overwrite to replace it as a "
                          f"whole, or a new output folder")
    return held


class StagedOutput:
    """The output being written (module docstring): :meth:`file` names a file in the staging folder, :meth:`commit`
    moves them all into place; leaving the ``with`` block deletes the staging folder, so an error or a signal before
    :meth:`commit` leaves ``output`` as it was. The output is checked (:func:`check_output`) when this is made."""

    def __init__(self, output: str, overwrite: bool) -> None:
        self.output = output
        self.earlier = check_output(output, overwrite)
        """The files of an earlier output that :meth:`commit` replaces."""
        self.committed = False
        self._remote = stores.is_uri(output)
        self._out = stores.as_path(output).absolute()
        self._staging: Path | None = None

    def __enter__(self) -> StagedOutput:
        if self._remote:
            self._staging = Path(tempfile.mkdtemp(prefix="recsys-sequences-"))
        else:
            self._staging = self._out.parent / f".{self._out.name}.staging-{os.getpid()}"
            shutil.rmtree(self._staging, ignore_errors=True)  # left by an earlier process of this id, killed (-9) here
            self._out.parent.mkdir(parents=True, exist_ok=True)
            self._staging.mkdir()
        return self

    def file(self, name: str) -> str:
        """Where to write the output file ``name`` (one of :data:`OUTPUT_FILES`) until :meth:`commit`."""
        assert self._staging is not None and name in OUTPUT_FILES, name
        return str(self._staging / name)

    def commit(self) -> None:
        """Move the complete output into place, replacing an earlier one as a whole (module docstring)."""
        assert self._staging is not None
        if self._remote:  # each upload replaces its object whole; the earlier output held only these names
            for name in OUTPUT_FILES:
                stores.upload(self._staging / name, stores.join(self.output, name), ConfigError)
            self.committed = True
            return
        old = self._out.parent / f".{self._out.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        if self._out.exists():  # an earlier output, or an empty folder
            os.replace(self._out, old)
        try:
            os.replace(self._staging, self._out)
        except BaseException:
            if old.exists() and not self._out.exists():
                os.replace(old, self._out)
            raise
        self.committed = True
        shutil.rmtree(old, ignore_errors=True)

    def __exit__(self, _type: type[BaseException] | None, _exc: BaseException | None, _tb: TracebackType | None) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
