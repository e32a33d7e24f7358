"""``hydra/launcher=submitit_local``'s job controller: a task that fails ends its job's other tasks, as ``srun
--kill-on-bad-exit`` does under ``hydra/launcher=submitit_slurm`` (``SRUN_ARGS`` in ``hydra_plugins/recsys_runner_detached``).

submitit runs each local job as a controller process (``python -m submitit.local._local <folder>``) that starts the
job's tasks and waits until every one has exited, or the job's ``timeout_min`` is up. A two-task job whose rank 0 failed
before the process group formed (its rendezvous port taken, a config or data error, a crash) left rank 1 waiting on the
rendezvous: for ``distributed.timeout_s`` (30 minutes), and where another process held the port (rank 1's store client
connected to it, and waited for an answer that never came) until the job's ``timeout_min``, the sweep waiting with it.

:class:`TasksEndTogether` is submitit's controller that, once a task has failed (:func:`failed`), sends the job's other
tasks SIGTERM, then SIGKILL :data:`KILL_WAIT_S` later, and says so at the end of their error logs;
:func:`start_controller` starts it in place of submitit's. It runs as ``python -m recsys_runner.distributed.local_tasks
<folder>``, as submitit runs its own, and imports submitit only, not torch.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

from submitit.local import local
from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE, Controller, LocalJobEnvironment
from submitit.local.local import start_controller as submitit_start_controller

KILL_WAIT_S = 30.0
"""How long the other tasks of a job whose task failed get between SIGTERM and SIGKILL: torchrun's grace and SLURM's
default ``KillWait``, above ``distributed.stuck_after_signal_s`` (20 s), so that a rank blocked in a collective still
says that it lost its peer, ends its MLflow run and exits 75. A rank waiting on the rendezvous (torch's store client, in
native code) runs no signal handler: the SIGKILL ends it."""

_SUBMITIT_CONTROLLER = "submitit.local._local"
_CONTROLLER = "recsys_runner.distributed.local_tasks"


def failed(status: int | None) -> bool:
    """Whether a task's exit status (``Popen.returncode``; ``None``: still running) ends the job's other tasks: any but 0,
    submitit's requeue (144) and a stop on a signal the command took (``128 + n``: ``lifecycle.exit_codes``).

    A stop on a signal is no failure: a SIGTERM stops every rank, each writing its own end. (Under a preemption a rank
    other than 0 exits 0 while rank 0 still hands the job over to submitit, then exits 144 and the controller starts the
    tasks again: ``lifecycle.exit_codes``, as srun's ``--kill-on-bad-exit`` would end rank 0 on any other status.) A task killed by a signal (a negative status: SIGKILL, an OOM kill, a segfault) failed."""
    if status is None or status in (0, LOCAL_REQUEUE_RETURN_CODE):
        return False
    return not 128 < status < 128 + signal.NSIG


def _said(status: int) -> str:
    """``exited with status 2``, ``was killed by SIGKILL``."""
    if status >= 0:
        return f"exited with status {status}"
    try:
        return f"was killed by {signal.Signals(-status).name}"
    except ValueError:
        return f"was killed by signal {-status}"


class TasksEndTogether(Controller):
    """submitit's local job controller (it starts the tasks, forwards SIGTERM to them, sends them SIGUSR2
    ``signal_delay_s`` before the job's time is up, starts them again when rank 0 asks for a requeue) that ends the other
    tasks once one has failed (module docstring)."""

    def wait(self, freq: int = 24) -> Sequence[int | None]:
        """submitit's ``Controller.wait`` — every task's exit status once all have exited, or when the job's time is up —
        that sends the tasks still running SIGTERM once one has failed, then SIGKILL :data:`KILL_WAIT_S` later."""
        assert self.tasks, "Nothing to do!"
        timeout, almost_timeout = freq * self.timeout_s, freq * (self.timeout_s - self.signal_delay_s)
        ending_since: float | None = None
        killed = False
        for step in range(timeout):
            statuses = [task.poll() for task in self.tasks]
            if all(status is not None for status in statuses):
                return statuses
            if step == almost_timeout:
                self._forward_signal(LocalJobEnvironment._usr_sig())
            if ending_since is None:
                first = next(((k, status) for k, status in enumerate(statuses) if status is not None and failed(status)),
                             None)
                if first is not None:
                    self._end_others(*first)
                    ending_since = time.monotonic()
            elif not killed and time.monotonic() - ending_since >= KILL_WAIT_S:
                self._signal_running(signal.SIGKILL)
                killed = True
            time.sleep(1.0 / freq)
        return [task.poll() for task in self.tasks]

    def _end_others(self, first: int, status: int) -> None:
        """SIGTERM to every task still running, after a line in its error log naming the task that failed."""
        for k, task in enumerate(self.tasks):
            if task.poll() is None:
                print(f"Task {first} of this job {_said(status)}: ending task {k} too (SIGTERM, then SIGKILL after "
                      f"{KILL_WAIT_S:.0f} s), as srun --kill-on-bad-exit ends a SLURM job's tasks",
                      file=self.stderrs[k], flush=True)
        self._signal_running(signal.SIGTERM)

    def _signal_running(self, signum: int) -> None:
        for task in self.tasks:
            if task.poll() is None:
                task.send_signal(signum)


def start_controller(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
    """submitit's ``start_controller`` — the job's environment, the launcher's ``setup`` lines run before it — whose
    process runs :class:`TasksEndTogether` instead of submitit's controller: its command names this module. The
    launcher puts it in the place of submitit's own (``submitit.local.local.start_controller``), which it calls."""

    def popen(command: list[str] | str, **options: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(_ours(command), **options)

    with patch.object(local, "subprocess", SimpleNamespace(Popen=popen)):  # only submitit's module sees it, only here
        return submitit_start_controller(*args, **kwargs)


def _ours(command: list[str] | str) -> list[str] | str:
    """submitit's controller command (a list; after ``setup`` lines, a shell line ending in it) with this module's name."""
    if isinstance(command, list) and _SUBMITIT_CONTROLLER in command:
        return [_CONTROLLER if part == _SUBMITIT_CONTROLLER else part for part in command]
    if isinstance(command, str) and f" -m {_SUBMITIT_CONTROLLER} " in command:
        return command.replace(f" -m {_SUBMITIT_CONTROLLER} ", f" -m {_CONTROLLER} ")
    raise RuntimeError(f"submitit no longer starts its local controller with python -m {_SUBMITIT_CONTROLLER} "
                       f"({command!r}): {_CONTROLLER} cannot start its own in its place")


if __name__ == "__main__":
    assert len(sys.argv) == 2, f"Usage: python -m {_CONTROLLER} <submitit folder>"
    TasksEndTogether(Path(sys.argv[1])).run()
