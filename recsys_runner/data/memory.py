"""Batches held in memory: the data module for benchmarks and for feeding pre-made batches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torchrec.datasets.utils import Batch

from recsys_runner.data.base import DataModule
from recsys_runner.features import FeatureSpec


class InMemoryData(DataModule):
    """Serves the same list of batches to every rank and epoch (``train``) and for eval.

    Meant for measuring the training path without any data cost, so it does not shard: each rank
    sees all ``train`` batches.
    """

    def __init__(self, features: FeatureSpec, train: Sequence[Batch], eval: Sequence[Batch]) -> None:
        self.features = features
        self.batch_size = int(train[0].labels.shape[0])
        self._train, self._eval = list(train), list(eval)

    def train_batches(self, epoch: int, rank: int, world_size: int) -> Iterator[Batch]:
        return iter(self._train)

    def eval_batches(self, rank: int, world_size: int) -> Iterator[Batch]:
        return iter(self._eval)

    def num_train_batches(self, world_size: int) -> int:
        return len(self._train)
