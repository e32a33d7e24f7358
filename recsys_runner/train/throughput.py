"""The train-progress meter: running loss, samples/s (real rows), tokens/s and ETA between two log points.

A step does not always hold ``data.batch_size`` rows: with ``data.batch_tokens`` a batch holds as many rows as fit
a token budget, and a file's last batch may be short. So the meter counts what was really trained: :meth:`Throughput.counted`
wraps the epoch's batch iterator and notes each batch's rows (``labels.shape[0]``) and, for data with histories, its
tokens (the history lengths + one per row, :func:`recsys_runner.data.sequences.tokens.row_tokens`) as the pipeline fetches it;
:meth:`Throughput.update` takes one step's worth of those notes in fetch order, which is the order pipelines train
them in (prefetching only moves the fetch earlier). With several ranks the window's rows and tokens are summed over
ranks at the log point (one small all-reduce), so ``train/samples_per_s`` is the global rate.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torchrec.datasets.utils import Batch

from recsys_runner.features import FeatureSpec


class Throughput:
    """Running train loss, samples/s, tokens/s and ETA between two log points.

    The loss (and a device batch's token count) is accumulated as a tensor and read (one device sync) only when logged.

    Args:
        total_steps: steps of the whole run (for the ETA).
        global_batch_size: rows per step (all ranks) assumed for a step whose batches were not fed through
            :meth:`counted` (``None``: such a step counts no rows); the loop feeds every batch through it.
        features: the data's schema; with sequence groups, ``train/tokens_per_s`` is logged too.
        micro_batches: batches per optimizer step (``train.grad_accum_steps``).
        world_size: ranks whose rows are summed at each flush (all must flush at the same steps).
        device: where the all-reduce of the counts runs (the run's device).
    """

    def __init__(self, total_steps: int, global_batch_size: int | None = None, *, features: FeatureSpec | None = None,
                 micro_batches: int = 1, world_size: int = 1, device: torch.device | None = None) -> None:
        self.total_steps = total_steps
        self.global_batch_size = global_batch_size
        self.micro_batches, self.world_size, self.device = micro_batches, world_size, device
        self._history_keys = _history_key_indices(features) if features is not None else []
        self._sampled = features.sampled_items if features is not None else 0
        """Catalogue rows appended to each training batch as negatives (``FeatureSpec.sampled_items``): not samples."""
        self.has_tokens = bool(self._history_keys)
        self._fetched: collections.deque[tuple[int, Tensor | int]] = collections.deque()
        self._loss_sum: Tensor | None = None
        self._steps = 0
        self._rows = 0
        self._assumed_rows = 0
        self._tokens: Tensor | int = 0
        self._since = time.perf_counter()

    def counted(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """``batches`` (one epoch's), each noted as it is fetched; forgets notes of batches an earlier epoch left
        untrained (a pipeline's prefetched batches, a partial accumulation)."""
        self._fetched.clear()
        return self._noting(batches)

    def _noting(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        for batch in batches:
            self._fetched.append(self._size(batch))
            yield batch

    def _size(self, batch: Batch) -> tuple[int, Tensor | int]:
        """``(rows, tokens)`` of ``batch``; tokens is a tensor on the batch's device (no sync), 0 without histories. Sampled
        negative rows are not counted: samples/s is the real rows trained."""
        rows = int(batch.labels.shape[0])
        if not self._history_keys:
            return rows - self._sampled, 0
        lengths = batch.sparse_features.lengths()
        history = sum(lengths[k * rows:(k + 1) * rows].sum() for k in self._history_keys)
        return rows, history + rows

    def update(self, loss: Tensor) -> None:
        """One optimizer step: its loss, and the rows and tokens of its ``micro_batches`` batches."""
        if self._loss_sum is None:
            self._loss_sum = loss.detach().clone().float()
        else:
            self._loss_sum.add_(loss.detach())
        self._steps += 1
        if not self._fetched and self.global_batch_size is not None:  # fed without counted(): the assumed size
            self._assumed_rows += self.global_batch_size
            return
        for _ in range(min(self.micro_batches, len(self._fetched))):
            rows, tokens = self._fetched.popleft()
            self._rows += rows
            self._tokens = self._tokens + tokens

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Exclude the enclosed time (evaluation) from the samples/s window."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._since += time.perf_counter() - start

    def flush(self, step: int) -> dict[str, float]:
        """Metrics since the last flush; resets the window."""
        now = time.perf_counter()
        elapsed = max(now - self._since, 1e-9)
        steps = max(self._steps, 1)
        rows, tokens = self._global_counts()
        out = {
            "train/loss": float(self._loss_sum) / steps if self._loss_sum is not None else float("nan"),
            "train/samples_per_s": (rows + self._assumed_rows) / elapsed,
            "train/eta_s": (self.total_steps - step) * elapsed / steps,
        }
        if self.has_tokens:
            out["train/tokens_per_s"] = tokens / elapsed
        self._loss_sum, self._steps, self._rows, self._assumed_rows, self._tokens, self._since = None, 0, 0, 0, 0, now
        return out

    def _global_counts(self) -> tuple[float, float]:
        """The window's rows and tokens, summed over ranks when there are several."""
        tokens = float(self._tokens)
        if self.world_size == 1 or not dist.is_initialized():
            return float(self._rows), tokens
        counts = torch.tensor([float(self._rows), tokens], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        rows_all, tokens_all = counts.tolist()
        return rows_all, tokens_all


def _history_key_indices(features: FeatureSpec) -> list[int]:
    """Where each sequence group's first feature sits among the batch's KJT keys (its lengths are the history's)."""
    keys = features.kjt_keys
    return [keys.index(group.features[0]) for group in features.sequences]
