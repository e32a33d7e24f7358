"""Graceful interruption: SIGTERM, SIGINT and SIGUSR1 finish the current step, then stop.

:class:`StopSignals` installs handlers that only set a flag (a plain Python bool, free to read
each step); the runner then writes a checkpoint and raises :class:`Interrupted`, the entry point
closes the MLflow run as ``KILLED`` and exits with ``128 + signal``. Relaunching the same command
resumes from that checkpoint (``checkpoint.resume=auto``) into the same MLflow run. With several
ranks the flag is combined with an all-reduce every ``train.stop_check_every_steps`` steps, so every
rank stops after the same step.
A second SIGINT while stopping raises ``KeyboardInterrupt`` as usual.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType

import torch
import torch.distributed as dist

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Interrupted(Exception):
    """Training stopped on a signal (or after ``train.stop_after_steps``) after writing a checkpoint."""

    def __init__(self, signum: int | None, step: int, checkpoint: str | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (no checkpoint.dir)"
        cause = signal.Signals(signum).name if signum is not None else "train.stop_after_steps"
        super().__init__(f"stopped by {cause} after step {step}; {where}. Relaunch the same command to resume from there.")

    @property
    def exit_code(self) -> int:
        """``128 + signal`` like a killed process; 0 for a planned ``train.stop_after_steps`` slice."""
        return 128 + self.signum if self.signum is not None else 0


class StopSignals:
    """Context manager: while active, the handled signals request a stop instead of killing."""

    def __init__(self, world_size: int = 1, device: torch.device | None = None, check_every_steps: int = 1) -> None:
        self.signum: int | None = None
        self._check_every = check_every_steps
        self._previous: dict[int, object] = {}
        self._world_size, self._device = world_size, device or torch.device("cpu")

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in HANDLED:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def requested(self, step: int) -> int | None:
        """The signal that asked to stop (agreed by all ranks), or ``None``.

        Ranks agree only every ``check_every_steps`` steps: the all-reduce and its host sync would
        otherwise stall every step of a GPU pipeline.
        """
        if self._world_size == 1:
            return self.signum
        if step % self._check_every:
            return None
        flag = torch.tensor([self.signum or 0], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        return value or None
