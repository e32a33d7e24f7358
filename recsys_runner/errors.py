"""User-facing errors: one class per kind of cause a user can fix, all under :class:`UserError`.

The CLI prints any :class:`UserError` as ``<label>: <message>`` (``Config error: …``, ``Data error: …``,
``Checkpoint error: …``, ``Tracking error: …``) without a traceback (unless ``HYDRA_FULL_ERROR=1``) and
exits with status 2. The message names what is wrong (the key, the file, the directory, the URI) and how
to fix it. Raise the class that matches the cause: a setting that is invalid on its face is a
:class:`ConfigError`; a setting that is fine but meets data, a checkpoint directory or a tracking store
that cannot be used is a :class:`DataError`, :class:`CheckpointError` or :class:`TrackingError`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import ClassVar, NoReturn


class UserError(ValueError):
    """A mistake the user can fix; the base of every error the CLI reports without a traceback."""

    label: ClassVar[str] = "Error"
    """How the CLI introduces the message, e.g. ``Config error``."""


class ConfigError(UserError):
    """A setting (or a combination of settings) is invalid.

    Raised before any process group, data loading or training starts (by the config schemas, or by a
    check that needs the composed model, data or device).
    """

    label = "Config error"


class DataError(UserError):
    """The data cannot be read as configured: a missing file or column, a corrupt file, a bad row.

    The message names the file, the row (or row group) and the column, and says what to do.
    """

    label = "Data error"


class CheckpointError(UserError):
    """The checkpoint directory or a checkpoint cannot be used: it is locked by another live run, damaged,
    missing, or does not fit this model. The message names the directory or checkpoint and the fix."""

    label = "Checkpoint error"


class TrackingError(UserError):
    """The tracking store cannot be used at the start of a run: unreachable, unwritable or broken.

    The message names the URI, where it came from, the cause and the fixes."""

    label = "Tracking error"


class LaunchError(UserError):
    """The processes of a multi-process run cannot form their group where they were launched: the rendezvous port is
    taken. The message names the address and port, where the port came from, and how to choose another."""

    label = "Launch error"


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds.

    Used from config dataclasses' ``__post_init__`` so validation reads as a list of rules.
    """
    if not condition:
        raise ConfigError(message)


def require_seed(key: str, seed: int) -> None:
    """:func:`require` that ``seed`` (the setting ``key``) fits numpy's and torch's generators, unsigned 32-bit: outside it
    numpy raises from deep inside the data pipeline or the build, after the job has started."""
    require(0 <= seed < 2**32, f"{key}={seed} must lie in [0, 2**32): numpy's and torch's generators take an unsigned 32-bit "
            f"seed. Fix: e.g. {key}=0")


class Failed(SystemExit):  # noqa: N818 - an exit, as SystemExit is
    """The exit of a command that failed on its own after saying why on stderr (:func:`fail`): ``SystemExit`` with its
    status (no traceback, the process exits with it), and the ``message`` it printed, for code that runs the command as
    one job of many and names a failed one by it: a submitit job hands it to the sweep's launcher as its error
    (``hydra_plugins/recsys_runner_detached``: no 15 s wait for a result that never comes, no parsing of its stderr)."""

    code: int

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


def fail(message: str, code: int) -> NoReturn:
    """Print ``message`` on stderr and exit with status ``code`` (:class:`Failed`): a command's end on its own failure."""
    print(message, file=sys.stderr)
    raise Failed(code, message)


@contextlib.contextmanager
def reported() -> Iterator[None]:
    """Every command line's handling of a :class:`UserError` (module docstring): its one-line message on stderr
    and exit status 2 (:func:`fail`); with ``HYDRA_FULL_ERROR=1`` the traceback instead."""
    try:
        yield
    except UserError as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        fail(f"{e.label}: {e}", 2)


class CheckpointWriteFailed(CheckpointError):
    """A checkpoint could not be written during training (its store refused or stopped answering). The checkpoints
    before it are untouched (a checkpoint is listed only once complete); ``last_good`` names the newest, from which
    the command's exit (:func:`recsys_runner.lifecycle.exit_codes`) prints the command that resumes."""

    def __init__(self, message: str, last_good: str | None) -> None:
        super().__init__(message)
        self.last_good = last_good


class Stopped(BaseException):  # noqa: N818 - a stop, not an error
    """A command stopped on a signal (the lifecycle's :class:`~recsys_runner.train.signals.Interrupted` is one). Like
    ``KeyboardInterrupt`` it is not an ``Exception``: the handler raises it wherever the main thread is, and code that
    catches every ``Exception`` to carry on — logging's ``emit`` (which prints "--- Logging error ---" and goes on), a
    library's retry, a tracking-outage handler — would swallow it, and the command would run to its end with the signal
    lost (a SIGINT during evaluate's logging did exactly that)."""
