"""What a real sweep's job processes do differently in a test, installed by a ``sitecustomize`` on ``PYTHONPATH`` (as
tests/store_gone.py's store is): only in a submitit job (``SUBMITIT_EXECUTOR`` set), only in the job whose overrides
hold the given one, nothing in recsys_runner changed for it.

- :func:`crash_at_the_first_step`: the job (or one rank of it) crashes, an error of no kind the command knows (a bug), as
  its first training batch is read: after its MLflow run has started, before any checkpoint.
- :func:`preempted_in_the_sanity_eval`: the job's first launch gets SIGUSR2, submitit's preemption signal, as its sanity
  eval reads its first batch (before any step or checkpoint), as SLURM sends it ahead of a time limit; its requeued
  launch runs undisturbed.
- :func:`slow_requeue`: rank 0's hand-over to submitit takes its time before ``scontrol requeue``, as a slow tracking
  store or a busy SLURM controller makes it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

CRASH = "job_hooks: a bug in the job's first training step"
"""The crashed job's error message (a ``RuntimeError``)."""


def install(hooks: Path, call: str) -> str:
    """Write ``hooks/sitecustomize.py`` running ``call`` (Python, e.g. ``crash_at_the_first_step('optim.lr=0.05')``) in
    each submitit job process; returns the ``PYTHONPATH`` that installs it (the hook, then the checkout)."""
    from tests.conftest import REPO

    hooks.mkdir(parents=True, exist_ok=True)
    (hooks / "sitecustomize.py").write_text(
        '"""Test hook (tests/job_hooks.py), in a sweep\'s submitit job processes only."""\n'
        "import os\n\n"
        'if os.environ.get("SUBMITIT_EXECUTOR"):\n'
        f"    from tests import job_hooks\n\n    job_hooks.{call}\n")
    return f"{hooks}{os.pathsep}{REPO}"


def _this_job(override: str) -> bool:
    """The running job's overrides (Hydra's, as the job composed them) hold ``override``."""
    from hydra.core.hydra_config import HydraConfig

    return override in list(HydraConfig.get().overrides.task)


def crash_at_the_first_step(override: str, rank: int | None = None) -> None:
    """The job with ``override`` raises ``RuntimeError(CRASH)`` as its first training batch is read: on every task, or
    on its task of torch rank ``rank`` only."""
    from recsys_runner.train import loop

    real = loop.checked_batches

    def checked(batches: Iterable[Any], *args: Any) -> Iterator[Any]:
        if _this_job(override) and (rank is None or os.environ.get("RANK") == str(rank)):
            raise RuntimeError(CRASH)
        yield from real(batches, *args)

    loop.checked_batches = checked  # type: ignore[assignment]


def preempted_in_the_sanity_eval(override: str, marker: str) -> None:
    """The job with ``override`` sends itself SIGUSR2 as its sanity eval reads its first batch, once: the launch that
    makes ``marker`` (a file; its requeued launch finds it there)."""
    from recsys_runner.train import evaluation

    real = evaluation.checked_batches

    def checked(batches: Iterable[Any], *args: Any) -> Iterator[Any]:
        for batch in real(batches, *args):
            if _this_job(override) and not Path(marker).exists():
                Path(marker).write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGUSR2)
            yield batch

    evaluation.checked_batches = checked  # type: ignore[assignment]


def slow_requeue(seconds: float) -> None:
    """On rank 0, submitit's preemption handler (which requeues the job; it runs only in a preempted launch) starts
    ``seconds`` late."""
    from submitit.core.job_environment import SignalHandler

    real = SignalHandler.checkpoint_and_try_requeue

    def late(self: SignalHandler, signum: int, frame: Any = None) -> None:
        if os.environ.get("RANK") == "0":
            time.sleep(seconds)
        real(self, signum, frame)

    SignalHandler.checkpoint_and_try_requeue = late  # type: ignore[method-assign]
