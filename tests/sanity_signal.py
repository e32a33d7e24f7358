"""``python -m tests.sanity_signal [overrides]``: ``python -m recsys_runner`` whose rank 1 sends itself SIGTERM as it reads
its first eval batch (the sanity eval's), once: a signal that reaches one rank of several during the sanity eval, for
``tests/test_sanity_eval.py``."""

import os
import signal
from collections.abc import Iterable, Iterator
from typing import Any

from torchrec.datasets.utils import Batch

import recsys_runner.__main__ as entry
from recsys_runner.train import evaluation

_checked = evaluation.checked_batches
_sent: list[int] = []


def signalled(batches: Iterable[Batch], *args: Any) -> Iterator[Batch]:
    """The evaluator's batches, SIGTERM to this process as the first is read."""
    for batch in _checked(batches, *args):
        if not _sent:
            _sent.append(os.getpid())
            os.kill(os.getpid(), signal.SIGTERM)
        yield batch


if __name__ == "__main__":
    if os.environ.get("RANK") == "1":  # here only: importing this module must not change the evaluator
        evaluation.checked_batches = signalled
    entry.main()
