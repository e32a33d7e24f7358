"""Local folders a run writes into (TensorBoard event files, MLflow's local artifacts, profiler traces), checked when it is built.

Their writers open them late: TensorBoard's ``SummaryWriter`` at the first metric, MLflow at the first artifact, the
profiler after its steps. A file in a folder's place or a folder this user cannot write would then fail after training
started, with a raw ``FileExistsError``/``PermissionError``, or be buffered as a tracking outage. :func:`check_folder`
probes each before the data and the model are built and raises one :class:`~recsys_runner.errors.TrackingError` line
that names the setting, the folder, the cause and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from recsys_runner.errors import TrackingError
from recsys_runner.staging import unwritable

__all__ = ["check_folder"]


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
