"""Graceful interruption: SIGTERM, SIGINT and SIGUSR1 finish the current step, then stop.

:class:`StopSignals` installs handlers that only set a flag (a plain Python bool, free to read
each step); the runner then writes a checkpoint and raises :class:`Interrupted`, the entry point
closes the MLflow run as ``KILLED``, prints the command that resumes from that checkpoint into the
same MLflow run (:meth:`recsys_runner.runtime.Launch.resume_command`) and exits with ``128 + signal``. With several
ranks the flag is combined with an all-reduce every ``train.stop_check_every_steps`` steps, and after every eval, so
every rank stops after the same step.
A second SIGINT while stopping raises ``KeyboardInterrupt`` as usual. A rank of several whose main thread stays blocked in native
code after a SIGTERM (a collective on a rank that is gone without its connection failing), where no Python handler can
run, is ended from a watching thread (:mod:`~recsys_runner.train.stuck`, ``distributed.stuck_after_signal_s``) with
the account the command registered (:func:`end_now`).

**Preemption (SIGUSR2)**: submitit asks SLURM for SIGUSR2 before a time limit (``--signal=USR2@<grace>``,
``hydra.launcher.signal_delay_s``) and its test helper ``job._interrupt()`` sends SIGTERM then SIGUSR2
for a preemption. Inside a submitit job SIGUSR2 is handled like the others — finish the step, write the
checkpoint — and wins over a SIGTERM received with it; the :class:`Interrupted` then carries
``preempted=True`` and a ``handover``: submitit's own SIGUSR2 handler, kept from before we installed ours.
The entry point closes the MLflow run (``KILLED``, tag ``preempted=true``) and calls ``handover()``, which
makes submitit resubmit the same Hydra job (same sweep dir, so the same ``checkpoints/``) and requeue
it; the requeued job resumes from the checkpoint into the same MLflow run. Outside submitit (no
previous handler) SIGUSR2 just stops like SIGTERM.

**Outside the training loop** (every command's whole run: evaluate, predict, export, and training while it builds):
:class:`RaiseOnSignal`, installed by :func:`recsys_runner.lifecycle.exit_codes`, turns SIGTERM, SIGINT and SIGUSR1
into an :class:`Interrupted` raised where the main thread is, so every ``finally`` runs (temp files are removed),
:func:`~recsys_runner.lifecycle.tracked_run` ends the MLflow run ``KILLED`` and the entry point says what was kept and
how to redo it. It takes a signal only while the signal has its default action: a handler someone else installed
(submitit's) is left alone. Once an :class:`Interrupted` is on its way out, further signals are only noted (a second
SIGINT still raises ``KeyboardInterrupt``), and :func:`deferred` holds a signal back while the run's end is written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from recsys_runner import store_settings
from recsys_runner.errors import Stopped
from recsys_runner.train.stuck import NativeWaitWatch

PREEMPT = signal.SIGUSR2
"""submitit's preemption/time-limit signal (its default ``SUBMITIT_PREEMPT_SIGNAL=USR2``)."""
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, PREEMPT)
RAISED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""What :class:`RaiseOnSignal` turns into :class:`Interrupted` (not SIGUSR2: submitit owns it outside training)."""
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
"""What :func:`signal.signal` installs and returns: a function, ``SIG_DFL`` / ``SIG_IGN``, or ``None`` (not set from Python)."""


class Interrupted(Stopped):
    """A command stopped on a signal: training after a step (or ``train.stop_after_steps``) with the checkpoint it
    wrote, any command elsewhere (``step`` is ``None``: nothing was kept)."""

    def __init__(self, signum: int | None, step: int | None, checkpoint: str | None, *, when: str | None = None,
                 finished: bool = False, agreed: bool = False) -> None:
        self.signum, self.step, self.checkpoint, self.when, self.finished = signum, step, checkpoint, when, finished
        """``when``: what was under way (``during the final eval``, ``during evaluate``); ``finished``: the signal came
        as the run ended, after its work was done and recorded."""
        self.agreed = agreed
        """Every rank stopped here together: the signal came from :meth:`StopSignals.agreed` (all-reduced) or the slice's
        end, so each rank raises this same stop, step and checkpoint, and rank 0's account of it says it for all
        (:func:`recsys_runner.lifecycle.exit_codes`). ``False``: a rank's own stop, which only it can tell."""
        self.preempted = False
        """SIGUSR2 reached this process: the job is being preempted or hits its time limit."""
        self.handover: Callable[[], None] | None = None
        """The handler that owned SIGUSR2 before training (submitit's checkpoint-and-requeue), bound to
        the signal; the entry point calls it once the MLflow run is closed. ``None`` outside submitit."""
        self.run_id: str | None = None
        """The MLflow run that ended ``KILLED`` (set by :func:`recsys_runner.lifecycle.tracked_run`)."""
        cause = signal.Signals(signum).name if signum is not None else "train.stop_after_steps"
        during = f" {when}" if when else ""
        if step is None:
            super().__init__(f"stopped by {cause}{during}")
        else:
            where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint"
            super().__init__(f"stopped by {cause}{during} after step {step}; {where}")

    @property
    def exit_code(self) -> int:
        """``128 + signal`` like a killed process; 0 for a planned ``train.stop_after_steps`` slice."""
        return 128 + self.signum if self.signum is not None else 0


class StoreWaitInterrupted(Stopped):
    """A stop signal came while the main thread waited on an object store (:func:`recsys_runner.store_settings.waiting`: a
    checkpoint write, a unit read ahead): raised there at once rather than after the step, which a stalled store can
    hold for minutes. The loop turns it into :class:`Interrupted` naming the last complete checkpoint (a checkpoint cut
    off half-written is never listed: its ``meta.json`` comes last)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum} while waiting on the object store")
        self.signum = signum


class StopSignals:
    """Context manager: while active, the handled signals request a stop instead of killing."""

    def __init__(self, world_size: int = 1, device: torch.device | None = None, check_every_steps: int = 1, *,
                 on_stuck: Callable[[int, float], None] | None = None, stuck_after_s: float | None = None) -> None:
        """``on_stuck(signum, waited_s)``, with several ranks: called from a watching thread when the main thread stays
        in native code ``stuck_after_s`` seconds after a SIGTERM (:mod:`~recsys_runner.train.stuck`); it is to end the
        process."""
        self.signum: int | None = None
        self.received: set[int] = set()
        self._check_every = check_every_steps
        self._previous: dict[int, Handler] = {}
        self._world_size, self._device = world_size, device or torch.device("cpu")
        self._raised = False
        # SIGTERM only: the signal a launcher follows with SIGKILL (torchrun and SLURM, 30 s later), and the one torchrun
        # sends the survivors of a lost rank; a preemption's SIGUSR2 comes with a long grace, a stop may take it
        self._watch = NativeWaitWatch(on_stuck, (signal.SIGTERM,), stuck_after_s) \
            if world_size > 1 and on_stuck is not None and stuck_after_s is not None else None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in HANDLED:
                self._previous[s] = signal.signal(s, self._handle)
            if self._watch is not None:  # after the handlers: the interpreter reports only signals it handles
                self._watch.__enter__()
        return self

    def __exit__(self, _type: type[BaseException] | None, exc: BaseException | None, _tb: TracebackType | None) -> None:
        if self._watch is not None:
            self._watch.__exit__(None, None, None)
        if isinstance(exc, Interrupted) or self.signum is not None:
            stopping()  # before the outer handlers are back: a signal now must not replace this stop
        previous_usr2 = self._previous.get(PREEMPT)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        if isinstance(exc, Interrupted) and self.preempted:
            exc.preempted = True
            if callable(previous_usr2):
                exc.handover = lambda: previous_usr2(PREEMPT, None)

    @property
    def preempted(self) -> bool:
        """SIGUSR2 reached this process (on this rank) while training."""
        return PREEMPT in self.received

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self._watch is not None and self._watch.answered(signum):
            return  # the watch's probe: the main thread is in Python
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received.add(signum)
        if self.signum != PREEMPT:  # a preemption wins over the SIGTERM that comes with it
            self.signum = signum
        if store_settings.waiting_now() and not self._raised:
            self._raised = True
            raise StoreWaitInterrupted(self.signum)

    def requested(self, step: int, *, evaluated: bool = False) -> int | None:
        """The signal that asked to stop (agreed by all ranks), or ``None``.

        Ranks agree only every ``check_every_steps`` steps: the all-reduce and its host sync would
        otherwise stall every step of a GPU pipeline. After a step that ``evaluated`` they agree at once: the eval synced
        the ranks already (one all-reduce more is nothing beside its gathers), and a signal that came during it, which
        several ranks cannot abandon, then stops the run right after it, with its metrics in the step's checkpoint,
        rather than up to ``check_every_steps`` steps later.
        """
        if self._world_size == 1:
            return self.signum
        if step % self._check_every and not evaluated:
            return None
        return self.agreed()

    def agreed(self) -> int | None:
        """The signal that asked to stop on any rank, now (an all-reduce with several ranks: every rank calls it)."""
        if self._world_size == 1:
            return self.signum
        flag = torch.tensor([self.signum or 0], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        return value or None


class RaiseOnSignal:
    """Context manager for a command's whole run: SIGTERM, SIGINT and SIGUSR1 raise :class:`Interrupted` (``step``
    ``None``, ``when`` as given) where the main thread is, once; see the module docstring.

    Training's :class:`StopSignals` takes the signals over for its loop and gives them back after."""

    def __init__(self, when: str, account: Callable[[BaseException], str] | None = None) -> None:
        self.when = when
        self.account = account
        """What the command says of an error that ends it (:func:`end_now`), as its own exit would say it."""
        self.signum: int | None = None
        """The signal that stopped the command (raised, or noted while :func:`deferred`)."""
        self.stopping = False
        """An :class:`Interrupted` is on its way out: further signals are only noted."""
        self.deferring = False
        self._previous: dict[int, Handler] = {}
        self._outer: RaiseOnSignal | None = None

    def __enter__(self) -> RaiseOnSignal:
        global _active
        if threading.current_thread() is threading.main_thread():
            for s in RAISED:
                if signal.getsignal(s) in (signal.SIG_DFL, signal.default_int_handler):
                    self._previous[s] = signal.signal(s, self._handle)
        self._outer, _active = _active, self
        return self

    def __exit__(self, _type: type[BaseException] | None, _exc: BaseException | None, _tb: TracebackType | None) -> None:
        global _active
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        _active = self._outer

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.stopping:
            if signum == signal.SIGINT and self.signum is not None:
                raise KeyboardInterrupt  # a second Ctrl-C: stop stopping cleanly
            self.signum = self.signum or signum
            return
        self.signum, self.stopping = signum, True
        if not self.deferring:
            raise Interrupted(signum, None, None, when=self.when)


_active: RaiseOnSignal | None = None
"""The innermost :class:`RaiseOnSignal` in force (the main thread's), if any."""


def stopping() -> None:
    """An :class:`Interrupted` is on its way out (training stopped): from now on a signal is only noted."""
    if _active is not None:
        _active.stopping = True


@contextlib.contextmanager
def deferred() -> Iterator[Callable[[], int | None]]:
    """Hold signals back while the block runs (writing a run's end status); yields a function that returns the
    signal that arrived meanwhile, when it is the first one (nothing was stopping yet), else ``None``."""
    guard = _active
    if guard is None:
        yield lambda: None
        return
    before, was_deferring = guard.stopping, guard.deferring
    guard.deferring = True
    try:
        yield lambda: guard.signum if not before and guard.stopping else None
    finally:
        guard.deferring = was_deferring


def end_now(error: BaseException, code: int) -> NoReturn:
    """End the process at once, from any thread, with status ``code``, after saying ``error`` on stderr as the command
    would (the account :class:`RaiseOnSignal` was given, else ``str(error)``) and flushing the logs and streams.

    For a main thread that cannot be reached (:mod:`~recsys_runner.train.stuck`): nothing unwinds, no ``finally`` or
    ``atexit`` runs; the checkpoints written are whole (a checkpoint is listed only once complete)."""
    guard = _active
    account = guard.account if guard is not None and guard.account is not None else str
    with contextlib.suppress(Exception):
        print(account(error), file=sys.stderr)
    for handler in logging.getLogger().handlers + logging.getLogger("recsys_runner").handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
