"""One live progress bar on an interactive terminal; plain periodic log lines everywhere else.

:class:`Progress` is what every long-running command (training, ``data convert``, evaluation,
prediction) shows its progress through::

    with Progress(total=len(files), enabled=env.is_main, unit="file") as progress:
        for path in files:
            ...
            progress.write(f"{path} -> {target}")  # above the bar, or a plain line without one
            progress.update(1, rows=total_rows)

It draws a tqdm bar only where someone watches: ``mode="auto"`` (the default) draws when both
stdout (where Hydra's console log goes) and stderr (where the bar goes, as tqdm does) are
terminals, so SLURM logs, CI and pipes keep the plain log lines they always had. ``mode="bar"``
forces the bar (tests, a terminal that does not say it is one), ``mode="log"`` forbids it. Only
one process draws: pass ``enabled=False`` on every rank but rank 0.

While the bar is up, console log records are printed above it instead of through it, and records
the bar already shows (logged with ``extra=progress.shown_on_bar()``) skip the console; the
log file and MLflow still get everything.
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType
from typing import Any, TextIO

from tqdm import tqdm

MODES = ("auto", "bar", "log")

_SHOWN_ON_BAR = "recsys_runner_shown_on_bar"  # the LogRecord attribute set by ``shown_on_bar()``


def terminal_attached() -> bool:
    """Both stdout and stderr are interactive terminals (neither redirected to a file or a pipe)."""
    return all(stream is not None and stream.isatty() for stream in (sys.stdout, sys.stderr))


class _AboveTheBar(logging.Handler):
    """Stands in for a console handler while the bar is up: writes each record above the bar, with
    the console handler's level, format and filters, and leaves out what the bar already shows."""

    def __init__(self, console: logging.StreamHandler) -> None:
        super().__init__(console.level)
        self.setFormatter(console.formatter)
        self.filters = list(console.filters)
        self.stream: TextIO = console.stream

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, _SHOWN_ON_BAR, False):
            return
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


class Progress:
    """A progress bar over ``total`` units (``None``: unknown), or nothing where no one watches.

    Args:
        total: units to do (steps, files); ``None`` when unknown (the bar shows a count and a rate).
        enabled: ``False`` on ranks other than 0: nothing is drawn or written there.
        unit: what one unit is called in the bar (``step``, ``file``).
        desc: a short label before the bar.
        initial: units already done (a resumed run starts at its step).
        mode: ``auto`` (a bar on a terminal), ``bar`` (always), ``log`` (never); see the module doc.
        file: where the bar is drawn (default ``sys.stderr``, as tqdm does).
        unit_scale: show counts with k/M/G prefixes (for bytes or rows).

    ``update`` is cheap enough for every step (no work at all without a bar; with one, tqdm
    redraws at most 10 times a second); pass values already on the host, never a tensor.
    """

    def __init__(self, total: int | None, *, enabled: bool = True, unit: str = "it", desc: str | None = None,
                 initial: int = 0, mode: str = "auto", file: TextIO | None = None, unit_scale: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r} must be one of {MODES}")
        self.enabled = enabled
        self._postfix: dict[str, Any] = {}
        self._consoles: list[tuple[logging.StreamHandler, _AboveTheBar]] = []
        self._bar: tqdm | None = None
        if enabled and (mode == "bar" or (mode == "auto" and terminal_attached())):
            self._bar = tqdm(total=total, initial=initial, unit=unit, unit_scale=unit_scale, desc=desc, file=file or sys.stderr,
                             dynamic_ncols=True, leave=True)
            self._redirect_console_logging()

    @property
    def active(self) -> bool:
        """A bar is being drawn."""
        return self._bar is not None

    def update(self, n: int = 1, **postfix: Any) -> None:
        """``n`` more units done; ``postfix`` values (e.g. ``loss=0.52``) replace those shown after the bar."""
        if self._bar is None:
            return
        if postfix:
            self.set_postfix(**postfix)
        self._bar.update(n)

    def set_postfix(self, **postfix: Any) -> None:
        """Show or replace values after the bar (floats as 4 significant digits, ints in full); the others stay."""
        if self._bar is None:
            return
        self._postfix.update({k: f"{v:.4g}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)
                              for k, v in postfix.items()})
        self._bar.set_postfix(self._postfix, refresh=False)

    def write(self, line: str) -> None:
        """Print ``line`` above the bar, or as a plain line on stdout without one (nothing when disabled)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def shown_on_bar(self) -> dict[str, bool]:
        """``extra=`` for a log record whose content the bar shows: it then goes to the log file, not the console."""
        return {_SHOWN_ON_BAR: True} if self._bar is not None else {}

    def close(self) -> None:
        """Leave the bar's last state on screen and give console logging back (safe to call twice)."""
        for console, above in self._consoles:
            handlers = logging.root.handlers
            if above in handlers:
                handlers[handlers.index(above)] = console
        self._consoles = []
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _redirect_console_logging(self) -> None:
        """Swap the root logger's console handlers for ones that print above the bar (files stay as they are)."""
        handlers = logging.root.handlers
        for i, handler in enumerate(handlers):
            if _is_console(handler):
                assert isinstance(handler, logging.StreamHandler)
                above = _AboveTheBar(handler)
                handlers[i] = above
                self._consoles.append((handler, above))

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
