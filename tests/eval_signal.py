"""``python -m tests.eval_signal [overrides]``: ``python -m recsys_runner`` whose rank 1 sends itself SIGTERM as it reads
the first batch of the run's first periodic eval (its second eval: the sanity eval comes first), once; every rank writes
the number of optimizer steps it trained to ``steps_rank<r>.txt`` in the working directory as training ends, however it
ends. A signal that reaches one rank of several during a periodic eval, for ``tests/test_eval_stops.py``."""

import os
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torchrec.datasets.utils import Batch

import recsys_runner.__main__ as entry
from recsys_runner.train import evaluation
from recsys_runner.train.loop import Loop

_checked, _train = evaluation.checked_batches, entry.train
_evals: list[int] = []


def signalled(batches: Iterable[Batch], *args: Any) -> Iterator[Batch]:
    """The evaluator's batches; SIGTERM to this process as the second eval's first is read."""
    _evals.append(1)
    for i, batch in enumerate(_checked(batches, *args)):
        if len(_evals) == 2 and i == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        yield batch


def train_counted(loop: Loop) -> dict[str, float]:
    """The runner's train, counting the steps this rank trains."""
    step, trained = loop.stepper.step, [0]

    def counted(batches: Iterator[Batch]) -> torch.Tensor | None:
        loss = step(batches)
        trained[0] += loss is not None
        return loss

    loop.stepper.step = counted  # type: ignore[method-assign]
    try:
        return _train(loop)
    finally:
        Path(f"steps_rank{loop.env.rank}.txt").write_text(str(trained[0]))


if __name__ == "__main__":
    if os.environ.get("RANK") == "1":  # here only: importing this module must not change the evaluator
        evaluation.checked_batches = signalled
    entry.train = train_counted
    entry.main()
