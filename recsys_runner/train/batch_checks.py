"""The tasks' checks of each batch's label values, made on the host as the loop and the evaluator read the batches.

A task refuses label values it cannot train on (a class index outside ``C``, a negative sample weight, ESMM's conversion
without a click: :func:`recsys_runner.tasks.check_batch_labels`). Made inside the model's forward, each check read a
device value back to the host (``bool(bad.any())``) and so made every training step wait for the device, on a GPU the
one thing a pipelined step must not do. Made here, on the batch the data module yielded (CPU tensors, before the
pipeline or the evaluator copies them to the device), it costs a few vector ops on the host and no sync; the error, its
message and the batch it names are the same. The check runs when the batch is fetched, and a pipeline fetches the next
batch before it trains the current one, so a bad batch stops the run up to one step earlier than inside the forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from torchrec.datasets.utils import Batch

from recsys_runner.tasks import Task, check_batch_labels

__all__ = ["checked_batches"]


def checked_batches(batches: Iterable[Batch], tasks: Sequence[Task], batch: str) -> Iterable[Batch]:
    """``batches``, each one's labels checked by ``tasks`` as it is read (:func:`~recsys_runner.tasks.check_batch_labels`);
    ``batches`` itself when no task checks anything (no generator in the way). ``batch``: which batches they are
    (``training batch`` / ``eval batch``), for the message.

    Raises:
        DataError: the first bad value, when its batch is read (module docstring).
    """
    checking = tuple(t for t in tasks if t.checks_labels)
    if not checking:
        return batches
    return _checked(batches, checking, batch)


def _checked(batches: Iterable[Batch], tasks: tuple[Task, ...], batch: str) -> Iterator[Batch]:
    for one in batches:
        check_batch_labels(tasks, one.labels, batch)
        yield one
