"""A rank lost mid-run: a collective's error told apart as another rank gone, and the survivor's one line about it.

When one rank of a multi-rank run dies (``kill -9``, an OOM kill, a node gone), the others learn it from their next
collective, which raises a ``RuntimeError`` (``DistBackendError``) with the transport's words, e.g. gloo's
``Read error [10.0.0.2]:9371: Connection reset by peer``. :func:`peer_gone` recognises those words
(:data:`PEER_GONE`); the training loop turns such an error into :class:`RankLost`, carrying the last complete
checkpoint, and :func:`recsys_runner.lifecycle.exit_codes` prints its line and the command that resumes, then exits
:data:`EXIT_RANK_LOST`. Which rank stopped is told from the launcher's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``GROUP_RANK``, ``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``): with two ranks it is
the other one; with more, a survivor cannot know which, and says so.
"""

from __future__ import annotations

import os
import re

PEER_GONE: dict[str, str] = {
    "Connection reset by peer": "stopped",  # gloo: the peer's process died under a read (kill -9, OOM kill)
    "Connection closed by peer": "stopped",  # gloo: the peer closed its end (it exited)
    "Broken pipe": "stopped",  # gloo: a write to a peer that is gone
    "Failed to recv, got 0 bytes": "stopped",  # the rendezvous store: its host is gone
    "remote process exited": "stopped",  # NCCL's ncclRemoteError
    "Timed out waiting": "stopped answering",  # gloo: no answer within distributed.timeout_s (a hung peer, a lost host)
    "Socket Timeout": "stopped answering",  # the rendezvous store
    "still blocked": "stopped answering",  # a collective that never failed, ended after a stop signal (blocked_on_peer)
}
"""Words of a collective's error that mean another rank is gone (or stopped answering), with how to say it."""

EXIT_RANK_LOST = 75
"""The exit status of a rank whose peer was lost: ``EX_TEMPFAIL`` of ``sysexits.h``, a failure that a retry (the
resume command, or torchrun's ``--max-restarts``) gets past; apart from 1 (a crash, a non-finite loss), 2 (a user
error) and 128 + signal (stopped by a signal)."""


RANK_LOST_LABEL = "Rank lost"
"""How a survivor's line begins (``Rank lost: rank 1 of 2 stopped: …``, :func:`recsys_runner.lifecycle.exit_codes`): an
echo of another rank's end, which a multi-task job's account of its failure looks past to the rank that ended first
(:func:`recsys_runner.tracking.sweep_jobs.job_failure`)."""


def peer_gone(error: BaseException) -> str | None:
    """How a peer was lost (``stopped``, ``stopped answering``) if ``error`` is a collective's failure because another
    rank is gone, else ``None``."""
    if not isinstance(error, RuntimeError):  # torch.distributed's DistBackendError and DistNetworkError are ones
        return None
    text = str(error)
    return next((how for words, how in PEER_GONE.items() if words in text), None)


def cause_of(error: BaseException) -> str:
    """The transport's own words, without its source location and advice:
    ``Read error [127.0.0.1]:9371: Connection reset by peer``."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    first = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", first)
    return first.split(". ", 1)[0].rstrip(".")


def blocked_on_peer(signal_name: str, waited_s: float) -> RuntimeError:
    """The error of a rank whose main thread was still blocked in one native call (a collective waiting on a rank gone
    without its connection failing) ``waited_s`` after ``signal_name`` came (:mod:`recsys_runner.train.stuck`): as a
    collective's own error, a peer that stopped answering."""
    return RuntimeError(f"still blocked {waited_s:.0f} s after {signal_name}, waiting on it")


class RankLost(Exception):
    """A collective failed on this rank because another rank stopped (or stopped answering): the run cannot go on.

    ``step`` is the last step this rank finished (``None`` outside the training loop), ``checkpoint`` the last complete
    checkpoint, from which the run resumes (``None``: none was written). ``str()`` is the one line the survivor prints.
    """

    def __init__(self, error: BaseException, *, step: int | None = None, checkpoint: str | None = None) -> None:
        self.how = peer_gone(error) or "stopped"
        self.cause, self.step, self.checkpoint = cause_of(error), step, checkpoint
        super().__init__(self._line())

    def _line(self) -> str:
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
        if rank is None or world is None:
            who, here = "another rank", "this rank"
        elif world == 2:
            who, here = f"rank {1 - rank} of 2", f"rank {rank}"
        else:
            who, here = f"rank(s) other than this one (rank {rank} of {world})", "this rank"
        where = _place()
        at = f" after step {self.step}" if self.step is not None else ""
        line = f"{who} {self.how}: a collective on {here}{where} failed{at} with '{self.cause}'"
        return line + _restarts()


def _place() -> str:
    """`` (local rank 1 on node 0)`` from torchrun's environment, or nothing."""
    local, node = _env_int("LOCAL_RANK"), _env_int("GROUP_RANK")
    if local is None:
        return ""
    return f" (local rank {local} on node {node})" if node is not None else f" (local rank {local})"


def _restarts() -> str:
    """What torchrun does next: ``; torchrun restarts the group (restart 1 of 3)`` while restarts are left
    (``--max-restarts``), else nothing."""
    count, most = _env_int("TORCHELASTIC_RESTART_COUNT"), _env_int("TORCHELASTIC_MAX_RESTARTS")
    if count is None or most is None or count >= most:
        return ""
    return f"; torchrun restarts the group (restart {count + 1} of {most})"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.lstrip("-").isdigit() else None
