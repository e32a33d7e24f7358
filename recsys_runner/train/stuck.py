"""A rank of several whose main thread stays blocked in native code after a stop signal: ended from a watching thread.

Why: a training rank takes SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 in Python handlers that only note the signal
(:class:`~recsys_runner.train.signals.StopSignals`), and Python runs a handler only when the main thread is back in
Python. A main thread blocked in a collective that waits on a rank that is gone without its connection failing (or in a
store wait, a join) never gets back: the SIGTERM torchrun sends the survivors once a rank is lost was noted by nobody, and
torchrun killed the survivor 30 s later (exit ``-9``, no line, the MLflow run left ``RUNNING``) instead of its ending with
the lost rank's line and exit 75. Seen once in a full test suite on a loaded 2-core machine: the survivor of a ``kill -9``
logged its checkpoint and then nothing.

:class:`NativeWaitWatch` learns of the signal from the interpreter's C-level handler (:func:`signal.set_wakeup_fd`, which
writes the signal's number to a pipe even while the main thread is in native code) and then asks the main thread, every
``poll_s``, to answer a probe: the same signal again, simulated (:func:`_thread.interrupt_main`), which the handler
answers (:meth:`NativeWaitWatch.answered`) and otherwise ignores. A main thread back in Python answers at once, whatever it
does (finishing its step, writing the checkpoint); when no probe has been answered for ``after_s``
(``distributed.stuck_after_signal_s``) it is blocked in native code, and the watch calls ``on_stuck``, which ends the
process (:func:`recsys_runner.train.fault_ends.when_stuck` says it as a lost rank). Where the main thread is in Python cannot tell
it: a thread that is busy in Python leaves the GIL at the same instruction every time. The main thread holding the GIL in
native code (a deadlock) stops the watch too: nothing in Python can end that.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Collection
from types import TracebackType

_QUIT = 0
"""The byte :meth:`NativeWaitWatch.__exit__` writes to end the watching thread (no signal has number 0)."""


class NativeWaitWatch:
    """Context manager (main thread only; elsewhere it does nothing): while active, one of ``signals`` followed by
    ``after_s`` seconds in which the main thread answers no probe calls ``on_stuck(signum, waited_s)`` from a watching
    thread. The handler of ``signals`` calls :meth:`answered` first. See the module docstring."""

    def __init__(self, on_stuck: Callable[[int, float], None], signals: Collection[int], after_s: float,
                 poll_s: float = 0.25) -> None:
        self.on_stuck, self.signals, self.after_s, self.poll_s = on_stuck, frozenset(signals), after_s, poll_s
        self._done = threading.Event()
        self._pipe: tuple[int, int] | None = None
        self._previous_fd = -1
        self._thread: threading.Thread | None = None
        self._probe: int | None = None
        """The signal of the probe the main thread has yet to answer."""
        self._answers = 0

    def __enter__(self) -> NativeWaitWatch:
        if threading.current_thread() is not threading.main_thread():
            return self
        read, write = os.pipe()
        os.set_blocking(write, False)  # set_wakeup_fd's demand: the C handler must never block on it
        self._pipe = (read, write)
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="stuck-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, _type: type[BaseException] | None, _exc: BaseException | None, _tb: TracebackType | None) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        self._done.set()
        with contextlib.suppress(OSError):
            os.write(self._pipe[1], bytes([_QUIT]))
        if self._thread is not None:
            self._thread.join(timeout=5)
        deadline = time.monotonic() + 1
        while self._probe is not None and time.monotonic() < deadline:  # answered here, not by the handler restored next
            time.sleep(0.001)
        for fd in self._pipe:
            os.close(fd)
        self._pipe = self._thread = None

    def _run(self) -> None:
        assert self._pipe is not None
        while not self._done.is_set():
            try:
                got = os.read(self._pipe[0], 64)
            except OSError:
                return
            if not got or _QUIT in got or self._done.is_set():
                return
            watched = [s for s in got if s in self.signals]
            if watched:
                self._watch(watched[-1])
                return  # once: the stop is under way, or the process has ended

    def answered(self, signum: int) -> bool:
        """(The signal handler, in the main thread, first.) Whether this call of the handler is the probe's, to be ignored;
        any call shows the main thread in Python. A real signal merged with a probe of the same signal is a repeat of one
        already noted."""
        self._answers += 1
        if self._probe == signum:
            self._probe = None
            return True
        return False

    def _watch(self, signum: int) -> None:
        """Until the watch ends: probe the main thread every ``poll_s``; ``on_stuck`` once no probe was answered for
        ``after_s``."""
        start = heard_at = time.monotonic()
        heard = self._answers
        while not self._done.wait(self.poll_s):
            now = time.monotonic()
            if self._answers != heard:
                heard, heard_at = self._answers, now
            elif now - heard_at >= self.after_s:
                self.on_stuck(signum, now - start)
                return
            if self._probe is None:
                self._probe = signum
                _thread.interrupt_main(signal.Signals(signum))
