"""HSTU's attention block (Zhai et al., 2024, "Actions Speak Louder than Words: Trillion-Parameter Sequential
Transducers for Generative Recommendations", https://arxiv.org/abs/2402.17152), the ``block: hstu`` of ``model=sasrec``.

One layer, as in the paper (eqs. 1-3) and meta-recsys/generative-recommenders' reference code::

    U, V, Q, K = Split(SiLU(f1(LayerNorm(X))))
    A = SiLU(Q Kᵀ + rab) / n          (causal; no softmax: pointwise attention)
    Y = X + f2(Dropout(LayerNorm(A V) ⊙ U))

``rab`` is a learned relative bias: one weight per distance ``i - j`` between the query and key positions, plus
(when the data has event times) one weight per log-scale bucket of the time gap ``|q_i - k_j|`` in seconds,
``floor(ln(gap) / 0.301)`` (the reference code's bucketization), clamped to ``time_buckets``. As in the reference
(``RelativeBucketedTimeAndPositionBasedBias``: "ts(next-item) - ts(current-item)"), a key's time ``k_j`` is its own
event's time and a query's time ``q_i`` is the time of the event position ``i`` predicts (the next one; for the last
position, the candidate's), so the bias says how long before the predicted event each earlier event happened
(:func:`query_and_key_times` makes both from a history's event times). ``n`` is the longest
block the model takes (the history's ``max_len`` + 1), a constant, so a row's attention does not depend on how
long the other rows of its batch are. There is no feed-forward sublayer: the gate ``U`` takes its place.

Shape legend: ``B`` batch, ``L`` positions of the block, ``D`` model width, ``H`` heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recsys_runner.models.jagged import TIME_BUCKET_WIDTH, Tiles, relative_bias, time_buckets
from recsys_runner.models.jagged_kernels import KERNELS, attention

torch.fx.wrap("attention")  # a leaf of TorchRec's pipeline trace here too (models/jagged_kernels.py says why)

__all__ = ["HSTUBlock", "RelativeBias", "TIME_BUCKET_WIDTH", "query_and_key_times", "time_buckets"]


class RelativeBias(nn.Module):
    """HSTU's ``rab``: ``(length L, times (query [B, L], key [B, L]) | None) → bias [B or 1, L, L]``.

    ``bias[b, i, j] = w_pos[min(i - j, max_len - 1)] + w_time[bucket(|q[b, i] - k[b, j]|)]`` for ``j <= i`` (keys after
    the query are masked by the block anyway, and get distance 0's weight); without times (or ``time_buckets=0``) the
    position term alone. :meth:`terms` is the formula for any pairs (the jagged tiles' too).

    Args:
        max_len: the longest block (distances ``0 … max_len - 1``).
        time_buckets: number of time-gap buckets; ``0``: no time bias (data without event times).

    Example::

        >>> from recsys_runner.models.hstu import RelativeBias
        >>> RelativeBias(max_len=11, time_buckets=0)(10, None).shape   # positions alone: one bias for every row
        torch.Size([1, 10, 10])
    """

    def __init__(self, max_len: int, time_buckets: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.max_len = max_len
        self.position = nn.Parameter(torch.empty(max_len, device=device).normal_(0, 0.02))
        self.time = nn.Parameter(torch.empty(time_buckets + 1, device=device).normal_(0, 0.02)) if time_buckets else None

    def forward(self, length: int, times: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        index = torch.arange(length, device=self.position.device)
        distance = (index.unsqueeze(1) - index.unsqueeze(0)).clamp_min(0)
        if self.time is None or times is None:
            return self.terms(distance, None).unsqueeze(0)
        query, key = times
        return self.terms(distance.unsqueeze(0), query.unsqueeze(2) - key.unsqueeze(1))

    def terms(self, distance: torch.Tensor, gaps: torch.Tensor | None) -> torch.Tensor:
        """The bias of query-key pairs ``distance [..., L, L]`` apart (query position − key position, ``≥ 0``) with time
        gaps ``gaps`` (same shape, query time − key time; ``None``: no time term): :func:`~recsys_runner.models.jagged.relative_bias`,
        the jagged tiles' formula too."""
        return relative_bias(self.position, self.time, distance, gaps)


class HSTUBlock(nn.Module):
    """One HSTU layer: ``(x [B, L, D], mask [B, L], times (query [B, L], key [B, L]) | None) → [B, L, D]``; see the
    module docstring.

    ``mask`` is True on real positions (left-aligned); position ``i`` attends to the real positions ``j <= i``.
    ``times``: each position's query time (the time of the event it predicts) and key time (its own event's), int64
    seconds; ``None``: the relative position bias alone.

    Args:
        dim: ``D``, divisible by ``num_heads``.
        num_heads: ``H``; each head has ``D / H`` dims of ``Q``, ``K``, ``V`` and ``U``.
        max_len: the longest block, the attention's constant normalizer ``n`` and the relative bias's range.
        dropout: dropout before the output projection.
        time_buckets: time-gap buckets of the relative bias (``0``: none).
        kernel: what :meth:`forward_jagged` runs on: ``tiles`` (PyTorch ops), ``fbgemm`` (fbgemm's jagged products,
            Triton on CUDA) or ``auto`` (fbgemm's on CUDA, the tiles elsewhere; :mod:`recsys_runner.models.jagged_kernels`).

    Example::

        >>> import torch
        >>> from recsys_runner.models.hstu import HSTUBlock
        >>> block = HSTUBlock(dim=16, num_heads=2, max_len=11, dropout=0.0, time_buckets=0)
        >>> mask = torch.arange(10) < torch.tensor([[10], [4], [1], [7]])   # [B, L]: each row's real positions, left-aligned
        >>> block(torch.randn(4, 10, 16), mask).shape   # x [B, L, D] → [B, L, D]
        torch.Size([4, 10, 16])
    """

    def __init__(self, dim: int, num_heads: int, max_len: int, dropout: float, time_buckets: int,
                 device: torch.device | None = None, kernel: str = "auto") -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r} must be one of {list(KERNELS)}")
        self.num_heads, self.max_len, self.kernel = num_heads, max_len, kernel
        self.norm_in = nn.LayerNorm(dim, device=device)
        self.uvqk = nn.Linear(dim, 4 * dim, device=device)
        self.norm_attention = nn.LayerNorm(dim, device=device)
        self.out = nn.Linear(dim, dim, device=device)
        self.dropout = nn.Dropout(dropout)
        self.bias = RelativeBias(max_len, time_buckets, device=device)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, times: tuple[torch.Tensor, torch.Tensor] | None = None,
                candidates: torch.Tensor | None = None) -> torch.Tensor:
        b, length, dim = x.shape
        u, v, q, k = F.silu(self.uvqk(self.norm_in(x))).split(dim, dim=2)
        heads = (b, length, self.num_heads, dim // self.num_heads)
        q, k, v = (t.reshape(heads).transpose(1, 2) for t in (q, k, v))  # [B, H, L, D/H]
        logits = q @ k.transpose(2, 3) + self.bias(length, times).unsqueeze(1).to(q.dtype)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        allowed = causal.unsqueeze(0) & mask.unsqueeze(1)  # [B, L, L]: real keys at or before the query
        if candidates is not None:  # a candidate key is seen by itself alone
            allowed = allowed & (~candidates.unsqueeze(1) | torch.eye(length, dtype=torch.bool, device=x.device))
        attention = F.silu(logits) / self.max_len * allowed.unsqueeze(1).to(logits.dtype)
        mixed = (attention @ v).transpose(1, 2).reshape(b, length, dim)
        return x + self.out(self.dropout(self.norm_attention(mixed) * u))

    def forward_jagged(self, x: torch.Tensor, tiles: Tiles, times: tuple[torch.Tensor, torch.Tensor] | None = None,
                       candidates: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The same layer on jagged rows: ``x [T, D]`` (every row's tokens, flat), tiled by ``tiles``; ``times``: each
        token's query and key time (``[T]`` each); ``candidates [T]``: tokens that only the history and themselves may
        see; ``positions [T]``: the relative bias's positions, when not the tokens' places in their row. Equal to
        :meth:`forward` on the padded block at the real positions (tests/test_hstu_rank.py)."""
        dim = x.shape[1]
        u, v, q, k = F.silu(self.uvqk(self.norm_in(x))).split(dim, dim=1)
        heads = (x.shape[0], self.num_heads, dim // self.num_heads)
        mixed = attention(self.kernel, q.reshape(heads), k.reshape(heads), v.reshape(heads), tiles, self.bias.position,
                          self.bias.time, 1.0 / self.max_len, times, candidates, positions)
        return x + self.out(self.dropout(self.norm_attention(mixed.reshape(x.shape)) * u))


def query_and_key_times(timestamps: torch.Tensor, lengths: torch.Tensor,
                        next_times: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's ``(query [B, L + 1], key [B, L + 1])`` time for HSTU's time bias, from the history's event
    times ``timestamps [B, L]`` (0 on padding) and ``lengths [B]``.

    As generative-recommenders' ``RelativeBucketedTimeAndPositionBasedBias`` ("ts(next-item) - ts(current-item)", its
    data appending the target's time to the history's): a key's time is its own event's, a query's the time of the
    event it predicts. Position ``t`` (after events ``1 … t``) predicts event ``t + 1``, so its query time is event
    ``t + 1``'s; the last position (``t = lengths``) predicts the candidate, whose time is ``next_times`` when given,
    else the newest event's (0 for an empty history). The start token (position 0) has no event: its key time is
    position 0's query time (gap 0).
    """
    rows = torch.arange(timestamps.shape[0], device=timestamps.device)
    newest = timestamps[rows, (lengths - 1).clamp_min(0)] * (lengths > 0).to(timestamps.dtype)
    last = newest if next_times is None else next_times.to(timestamps.dtype)
    query = F.pad(timestamps, (0, 1)).scatter(1, lengths.long().view(-1, 1), last.view(-1, 1))
    return query, torch.cat([query[:, :1], timestamps], dim=1)
