"""The worker-side dataset of tests/test_data_workers.py's garbage test, in a module of its own: a forkserver worker
unpickles it by importing the module that defines it, and this one imports torch alone (preloaded by the server), not a
test module's imports (the whole runner, MLflow: tens of seconds per worker on a loaded 2-core machine)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import torch


class Collecting(torch.utils.data.IterableDataset):
    """A worker-side dataset that runs the collector in the worker, as any allocating worker eventually does; its one
    batch is the worker's PID."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        gc.collect()
        yield torch.tensor([os.getpid()])
