"""The contract between data modules and the runner."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from torchrec.datasets.utils import Batch

from recsys_runner.features import FeatureSpec


class DataModule(Protocol):
    """Yields a rank's share of the training and evaluation data as TorchRec batches.

    Every rank must receive the same number of batches per epoch: a sharded forward pass is a
    collective, so a rank that runs out early would leave the others waiting forever.
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
