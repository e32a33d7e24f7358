"""How the training loop ends on a fault instead of at a step's end: a signal while it waits on an object store, a
second Ctrl-C while it stops, another rank lost, or this rank still blocked in native code after a SIGTERM.

Each ends the run with the last complete checkpoint named, so the line printed holds the command that resumes it;
none writes one (a checkpoint cut off half-written is never listed). The loop (:func:`recsys_runner.train.loop.train`)
enters them around its steps, inside its signal handlers (:class:`~recsys_runner.train.signals.StopSignals`), so a
preemption still hands over to submitit. They are apart from the loop because they are not its steps: what a fault
ends with is decided here, once.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator

from recsys_runner.checkpoint.config import TrainState
from recsys_runner.checkpoint.policy import Checkpointer
from recsys_runner.distributed.peers import EXIT_RANK_LOST, RankLost, blocked_on_peer, peer_gone
from recsys_runner.tracking.tracker import Tracker
from recsys_runner.train.signals import Interrupted, StoreWaitInterrupted, end_now, stopping


@contextlib.contextmanager
def store_wait(checkpointer: Checkpointer, state: TrainState) -> Iterator[None]:
    """A signal that came while the loop waited on an object store stopped it there, not after the step
    (:class:`~recsys_runner.train.signals.StoreWaitInterrupted`): the run is interrupted with its last complete
    checkpoint (inside :class:`~recsys_runner.train.signals.StopSignals`, so a preemption still hands over to submitit)."""
    try:
        yield
    except StoreWaitInterrupted as e:
        raise Interrupted(e.signum, state.step, checkpointer.last_saved, when="while waiting on the object store") from None


@contextlib.contextmanager
def stopped_again(checkpointer: Checkpointer, state: TrainState) -> Iterator[None]:
    """A second Ctrl-C while the loop stops (writing the checkpoint of the first, or during the final eval) raises
    ``KeyboardInterrupt`` where the main thread is (:class:`~recsys_runner.train.signals.StopSignals`): the run ends at
    once as an :class:`~recsys_runner.train.signals.Interrupted` naming the last complete checkpoint, so it is still
    ``KILLED`` with the command that resumes. A checkpoint cut off half-written is never listed, so resuming never meets it."""
    try:
        yield
    except KeyboardInterrupt:
        kept = checkpointer.last_saved or state.resumed_from
        raise Interrupted(signal.SIGINT, state.step, kept, when="a second time") from None


@contextlib.contextmanager
def rank_lost(checkpointer: Checkpointer, world_size: int, state: TrainState) -> Iterator[None]:
    """A collective that failed because another rank is gone ends the run as :class:`RankLost` with the last complete
    checkpoint (:mod:`recsys_runner.distributed.peers`). Raised inside the loop's signal handlers, which only note
    the SIGTERM torchrun sends the survivors next; :func:`~recsys_runner.train.signals.stopping` keeps it noted after them."""
    try:
        yield
    except RuntimeError as e:
        if world_size == 1 or peer_gone(e) is None:
            raise
        stopping()
        raise RankLost(e, step=state.step, checkpoint=checkpointer.last_saved) from e


def when_stuck(checkpointer: Checkpointer, tracker: Tracker, state: TrainState) -> Callable[[int, float], None]:
    """What ends a rank whose main thread is still blocked in native code ``distributed.stuck_after_signal_s`` after a
    SIGTERM (:mod:`~recsys_runner.train.stuck`; called from its watching thread): the lost rank's line and exit 75,
    as :func:`rank_lost` ends one whose collective failed, with the last complete checkpoint; rank 0 ends the MLflow run
    ``FAILED`` first. The SIGTERM torchrun sends the survivors of a lost rank reaches a main thread blocked in a
    collective that never fails (the lost rank's connection not closed) only this way; torchrun kills it 30 s later."""

    def end(signum: int, waited_s: float) -> None:
        lost = RankLost(blocked_on_peer(signal.Signals(signum).name, waited_s), step=state.step,
                        checkpoint=checkpointer.resumable())
        with contextlib.suppress(Exception):
            tracker.finish("FAILED")
        end_now(lost, EXIT_RANK_LOST)

    return end
