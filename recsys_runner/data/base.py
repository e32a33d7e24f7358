"""The contract between data modules and the runner, and what every data module shares."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch

from recsys_runner.errors import DataError
from recsys_runner.features import FeatureSpec

__all__ = ["DataError", "DataModule", "synchronized"]  # DataError lives in errors.py with its siblings; importable from here too

log = logging.getLogger(__name__)
T = TypeVar("T")


class DataModule(Protocol):
    """Yields a rank's share of the training and evaluation data as TorchRec batches.

    Every rank must receive the same number of batches: a sharded forward pass is a collective,
    so a rank that runs out early would leave the others waiting forever. A data module either
    guarantees equal counts or wraps its iterators in :func:`synchronized`.

    A data module subclasses this protocol explicitly, so that it inherits the defaults of
    :meth:`metrics` (no counters) and :meth:`explain_empty_epoch` (a generic hint) unless it has
    something better to say.
    """

    features: FeatureSpec
    batch_size: int

    def train_batches(self, epoch: int, rank: int, world_size: int) -> Iterable[Batch]:
        """This rank's training batches for ``epoch`` (order may depend on the epoch)."""
        ...

    def eval_batches(self, rank: int, world_size: int) -> Iterable[Batch]:
        """This rank's evaluation batches; identical on every call."""
        ...

    def num_train_batches(self, world_size: int) -> int | None:
        """Batches per rank per epoch, or ``None`` when it is not known before reading."""
        ...

    def metrics(self) -> dict[str, float]:
        """Counters since the module was built (e.g. ``data/bad_rows_skipped``), logged with the training
        metrics (summed over ranks); none by default."""
        return {}

    def explain_empty_epoch(self, epoch: int, rank: int) -> str:
        """Why the last pass over ``train_batches(epoch, rank, …)`` ended before one full training step (rows
        read, rows skipped) and what to do, for the :class:`DataError` the runner raises then."""
        return "Fix: check the data, or lower data.batch_size / train.grad_accum_steps"


def synchronized(batches: Iterable[T], on_dropped: Callable[[T], None] | None = None) -> Iterator[T]:
    """Yield from ``batches`` until *any* rank runs out, so that all ranks stop at the same step.

    Before each batch the ranks all-reduce (MIN) a "have one" flag over the default process group;
    when one rank is out, every rank stops. A rank that still had batches drains them into
    ``on_dropped`` (for counting: nothing is dropped silently). Costs one tiny collective per
    batch, so data modules use it only where equal counts are not guaranteed.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield from batches
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    it = iter(batches)
    while True:
        item = next(it, None)
        flag = torch.tensor([0 if item is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag.item()) == 0:
            break
        assert item is not None
        yield item
    if item is not None and on_dropped is not None:
        on_dropped(item)
        for rest in it:
            on_dropped(rest)
