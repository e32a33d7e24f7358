"""Streaming item-frequency estimation for the logQ correction of a sampled softmax (Yi et al. 2019).

"Sampling-bias-corrected neural modeling for large corpus item recommendations", RecSys 2019,
https://dl.acm.org/doi/10.1145/3298689.3346996.

An in-batch softmax takes its negatives from the batch, so an item is a negative about as often as it is clicked:
popular items are pushed down far more than their share, and the learned scores drift towards ``s(q, c) + log p_c``.
Subtracting ``log p_c`` (``p_c`` the probability that ``c`` is among a step's candidates) from each candidate's logit
undoes that. The paper estimates ``p_c`` from the stream itself: per (hashed) item the step it was last seen and a
moving average of the gaps between sightings; ``p_c ≈ 1 / gap``. Both arrays are module buffers, so a checkpoint holds
them and a resumed run continues the estimate.

Shape legend: ``C`` candidates of one step, ``H`` hash buckets.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["FrequencyEstimator", "TableFrequency"]


class FrequencyEstimator(nn.Module):
    """``log p_c`` of a step's candidate ids ``[C]``: ``-log(gap)`` of each id's bucket, after counting the step.

    In training mode each call is one step: the ids (all ranks' ids, gathered, when a process group has several
    ranks) update their buckets: ``gap ← (1 - alpha) · gap + alpha · (step - last_seen)``, ``last_seen ← step``; a
    bucket seen for the first time starts at ``gap = step`` (the whole stream so far). Gathering makes every rank's
    estimate the same (the buffers stay identical, so DDP's buffer broadcast and a checkpoint's single copy are
    exact); it estimates the probability of appearing in the *global* batch, ``world_size`` times a rank's own for
    rare items, a constant shift of every logit of a row that the softmax ignores. In eval mode the ids are only
    read.

    Args:
        buckets: ``H``, ids map to ``id mod H`` (encoded ids below ``H`` get a bucket each, no collision).
        alpha: the moving average's rate (the paper's ``α``): higher follows a drifting popularity faster, noisier.
        device: where the buffers live.
    """

    step: torch.Tensor
    last_seen: torch.Tensor
    gap: torch.Tensor

    def __init__(self, buckets: int, alpha: float, device: torch.device | None = None) -> None:
        super().__init__()
        self.buckets, self.alpha = buckets, alpha
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer("last_seen", torch.zeros(buckets, dtype=torch.int64, device=device))
        self.register_buffer("gap", torch.zeros(buckets, dtype=torch.float32, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            bucket = torch.remainder(ids.long(), self.buckets)
            if self.training:
                self.observe(bucket)
            return -torch.log(self.gap[bucket].clamp_min(1.0))

    def observe(self, bucket: torch.Tensor) -> None:
        """Count one step whose candidates fall in ``bucket [C]`` (repeats within the step count once)."""
        seen = _gathered(bucket).unique()
        self.step += 1
        last = self.last_seen[seen]
        fresh = last == 0
        gap = (self.step - last).float()
        self.gap[seen] = torch.where(fresh, gap, (1 - self.alpha) * self.gap[seen] + self.alpha * gap)
        self.last_seen[seen] = self.step


class TableFrequency(nn.Module):
    """``log q_c`` of a step's in-batch candidate ids ``[C]`` from the item catalogue's counts instead of the stream:
    ``q_c = 1 − (1 − p_c) ** R``, the chance that item ``c`` is among a step's ``R = C · world_size`` rows when each row
    carries it with probability ``p_c`` (its share of the table's popularity): the quantity the streaming estimate
    tracks, known from the first step and not drifting with ``alpha``.

    Args:
        buckets: ``H``, ids map to ``id mod H`` (colliding items add their shares).
        device: where the buffer lives.
    """

    probability: torch.Tensor

    def __init__(self, buckets: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.buckets = buckets
        self.register_buffer("probability", torch.zeros(buckets, dtype=torch.float32, device=device))

    def load(self, ids: torch.Tensor, popularity: torch.Tensor) -> None:
        """Set ``p`` from the catalogue: item ids ``[N]`` and their popularity ``[N]`` (counts or weights >= 0). A bucket no
        item falls in (an id the catalogue lacks) gets the rarest item's share."""
        weights = popularity.double().clamp_min(0)
        total = float(weights.sum())
        if total <= 0:  # no counts known: every item alike
            weights, total = torch.ones_like(weights), float(weights.numel())
        share = torch.zeros(self.buckets, dtype=torch.float64).index_add_(0, torch.remainder(ids.long(), self.buckets), weights / total)
        known = share > 0
        share[~known] = share[known].min() if bool(known.any()) else 1.0 / self.buckets
        self.probability.copy_(share.to(self.probability))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            p = self.probability[torch.remainder(ids.long(), self.buckets)].double().clamp(1e-30, 1 - 1e-12)
            return torch.log(-torch.expm1(ids.numel() * world * torch.log1p(-p))).float()


def _gathered(ids: torch.Tensor) -> torch.Tensor:
    """All ranks' ``ids`` concatenated (ranks' counts may differ: the last batch), or ``ids`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ids
    world = dist.get_world_size()
    count = torch.tensor([ids.numel()], dtype=torch.int64, device=ids.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    most = int(max(int(c) for c in counts))
    padded = torch.full((most,), -1, dtype=ids.dtype, device=ids.device)
    padded[: ids.numel()] = ids
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(c)] for p, c in zip(parts, counts, strict=True)])
