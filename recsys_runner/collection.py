"""Python's garbage collector around a job and around a round of forked DataLoader workers: what a job left in reference
cycles is collected when the job ends (:func:`job_collected`), looking at the job's own objects only; a forked worker's
collector never finalizes the training process's objects (:func:`frozen`, data/workers.py); and a command's exit does
not collect what the process holds then (:func:`skip_the_exit_collection`).

Both use :func:`gc.freeze`, which moves every object the collector tracks into a permanent generation that no collection
looks at, in O(1), until :func:`gc.unfreeze` moves them all back; freezes do not nest (one unfreeze undoes them all), so
the two take turns here: a round of workers that starts inside a job unfreezes the job's freeze with its own, and the
job's end then collects everything, as it would without a freeze. A process that froze objects of its own keeps them
frozen: neither unfreezes what it did not freeze. The exit's freeze is never undone: it comes once the work is done.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator

_job_froze = False
"""Whether the objects the process held before the job now running are frozen by :func:`job_collected` (a flag, not
:func:`gc.get_freeze_count`, which shrinks as frozen objects die)."""

_garbage_of_a_failed_job = False
"""A job raised: its objects, held by the exception's traceback while it propagated, became garbage only once the
caller let go of it, after the job's collection: the next job collects them first (they would be frozen with the rest)."""


@contextlib.contextmanager
def job_collected() -> Iterator[None]:
    """Inside: one job (train, evaluate, predict, export); on its way out, however it exits, a collection of what it left
    in reference cycles (its process group, with gloo's threads, sockets and pipes; its model's memory).

    The objects the process held before the job are frozen for its length, so that the collection at its end looks only
    at the job's (~0.05 s, not the ~0.5 s of a full pass over a test process's heap) and the collector's automatic passes
    during the job skip them too; then they are unfrozen, as the job found them. A job that follows one that raised
    collects everything first (:data:`_garbage_of_a_failed_job`).
    """
    global _job_froze, _garbage_of_a_failed_job
    ours = gc.get_freeze_count() == 0 and not _job_froze
    if ours:
        if _garbage_of_a_failed_job:
            gc.collect()
            _garbage_of_a_failed_job = False
        gc.freeze()
        _job_froze = True
    try:
        yield
    except BaseException:
        _garbage_of_a_failed_job = True
        raise
    finally:
        gc.collect()  # with the job's freeze undone by a round of workers (frozen), this is a full pass
        if ours and _job_froze:
            gc.unfreeze()
            _job_froze = False


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Inside: every object of the process frozen, so that a process forked now (a DataLoader worker) never collects
    them; after: unfrozen, unless the process had frozen objects of its own before (a job's freeze,
    :func:`job_collected`, is undone with it: the job's objects must not stay frozen for the rest of the job).

    Freezing moves the collector's generations aside in O(1) and copies nothing; it also spares a forked worker the copy
    on write that collecting the parent's objects would make (Python's advice for fork without exec)."""
    global _job_froze
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if frozen_before == 0 or _job_froze:
            gc.unfreeze()
            _job_froze = False


def skip_the_exit_collection() -> None:
    """Let the interpreter's exit skip its collection of the objects that exist once the command is done.

    With torch, torchrec and MLflow loaded (~490,000 objects) the garbage collections of the interpreter's teardown took
    most of a process's end: 13.5 s of a loaded 2-core machine between the last line and the exit, where one full
    collection takes 1.8 s; with the objects frozen (``gc.freeze`` as the last ``atexit`` handler) 1.8 s. Every command
    and every sweep job pays it, a SLURM job holding its CPUs meanwhile. Nothing is left undone that the exit did: the
    ``atexit`` handlers (MLflow's, logging's flush, temporary files' cleanup) still run, the standard streams are still
    flushed; only cyclic garbage older than the exit is not collected before the process ends (its memory goes with it).
    Registered once, however often called."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
