"""Where ``python -m recsys_runner.data sequences`` writes: a used folder is refused unless ``--overwrite``; files are staged, then moved in whole.

``--overwrite`` replaces an earlier output as a whole (:class:`recsys_runner.staging.StagedFolder`: a local folder is built
as a hidden sibling and renamed into place; in an object store the files are uploaded when all are complete), so the
folder holds the whole new output or what it held before, never a file half written or the files of two runs. Leaving
the ``with`` block of :class:`StagedOutput` on an error or a signal deletes the staging folder. May import ``stores``,
``uris``, ``staging`` and ``errors``.
"""

from __future__ import annotations

from pathlib import Path

from recsys_runner import uris
from recsys_runner.errors import ConfigError
from recsys_runner.staging import StagedFolder, check_writable, held_names, is_local_file

OUTPUT_FILES = ("train.parquet", "eval.parquet", "valid.parquet", "test.parquet", "vocab.json")
"""The files ``sequences`` may write into its output folder (``train``/``eval`` or ``train``/``valid``/``test``, and
the mapping's index): what ``--overwrite`` may replace, with :data:`OUTPUT_FOLDERS`."""
OUTPUT_FOLDERS = ("vocab",)
"""The folders it writes (the mapping's vocab files)."""


def check_output(output: Path, overwrite: bool) -> list[str]:
    """The names an earlier output left in ``output`` (none for a new or empty folder), checked before the log is read.

    Raises:
        ConfigError: ``output`` is a file, or holds anything without ``overwrite``, or holds anything but an earlier
            output's files (naming the folder, what it holds and the fix).
    """
    held = held_names(output, f"the output {output}")
    check_writable(output, f"the output folder {output}", "another output folder")
    if not held:
        return []
    foreign = [n for n in held if not (n in OUTPUT_FILES and is_local_file(output, n))
               and not (n in OUTPUT_FOLDERS and (uris.is_remote(output) or (output / n).is_dir()))]
    shown = held[:8] + ([f"… {len(held) - 8} more"] if len(held) > 8 else [])
    if foreign:
        raise ConfigError(f"the output folder {output} is not empty: it holds {shown}, and {foreign[:8]} are not files sequences writes "
                          f"({', '.join((*OUTPUT_FILES, *(f + '/' for f in OUTPUT_FOLDERS)))}), so not even --overwrite replaces them. Fix: a new output folder, or move those away")
    if not overwrite:
        raise ConfigError(f"the output folder {output} already holds an earlier output ({shown}). Fix: --overwrite to replace it as a "
                          f"whole, or a new output folder")
    return held


class StagedOutput(StagedFolder):
    """The output being written (module docstring): :meth:`file` names a file in the staging folder, :meth:`commit`
    moves them all into place; leaving the ``with`` block deletes the staging folder, so an error or a signal before
    :meth:`commit` leaves ``output`` as it was. The output is checked (:func:`check_output`) when this is made."""

    def __init__(self, output: str, overwrite: bool) -> None:
        out = uris.as_path(output)
        self.earlier = check_output(out, overwrite)
        """The files of an earlier output that :meth:`commit` replaces."""
        super().__init__(out)

    def file(self, name: str) -> str:
        """Where to write the output file ``name`` (one of :data:`OUTPUT_FILES`) until :meth:`commit`."""
        assert name in OUTPUT_FILES, name
        return str(self.path / name)
