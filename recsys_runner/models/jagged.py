"""Attention over jagged rows (every row's tokens flat, with offsets): its cost follows ``Σ n_r²``, not ``B × L²``.

A batch of long-tailed histories padded to its longest row spends most of an attention's work on padding: 128 rows
with Zipf lengths up to 200 hold ~2,700 tokens, but padded they are 128 × 201 positions, and the ``[B, L, L]`` scores
hold 5 million entries for ~60 thousand real ones. Here each row is cut into tiles of ``block`` tokens, and a query
tile meets only the key tiles of its own row (at or before it when causal): the tiling of the jagged HSTU kernels
(generative-recommenders' Triton kernels, fbgemm's CUDA ones), written in PyTorch ops that run on the CPU. A row pads to
a multiple of ``block`` only, never to the batch's longest row, and the tiles' scores are the only ``[·, C, C]`` tensor.

:func:`tile` plans the tiling of one batch's lengths (:class:`Tiles`); :func:`to_tiles` / :func:`from_tiles` move
per-token tensors into and out of it; :func:`pointwise_attention` is HSTU's attention (SiLU, no softmax, the
relative bias :func:`relative_bias`) on it, :func:`softmax_attention` a transformer's (BST's), its softmax spanning all of a
row's key tiles.

Shape legend: ``T`` tokens (``Σ n_r``), ``B`` rows, ``C`` the tile size, ``NB`` tiles, ``P`` (query tile, key tile)
pairs, ``H`` heads, ``d`` a head's width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TIME_BUCKET_WIDTH", "BiasIndex", "Tiles", "bias_index", "from_tiles", "gathered_bias", "host_plus", "padded_reference",
           "pointwise_attention", "relative_bias", "row_starts", "softmax_attention", "take", "tile", "time_buckets", "to_tiles"]

_T = TypeVar("_T")


class _Counts(NamedTuple):
    tiles: int
    tokens: int
    pairs: int


class _Plan(NamedTuple):
    slots: torch.Tensor
    positions: torch.Tensor
    pair_query: torch.Tensor
    pair_key: torch.Tensor


@dataclass(frozen=True)
class Tiles:
    """How one batch's rows of ``lengths [B]`` are cut into tiles of ``block`` tokens, planned on first use: a kernel
    that reads the lengths alone (fbgemm's, :mod:`recsys_runner.models.jagged_kernels`) never pays for the plan, and
    the layers of one batch share it.

    ``slots [T]``: each token's slot in the tiled layout ``[NB · C]`` (row ``r``'s tiles follow row ``r - 1``'s);
    ``positions [NB, C]``: each slot's position within its row, ``-1`` past the row's end; ``pair_query [P]`` and
    ``pair_key [P]``: the tiles that meet (a query tile and each key tile of its row it attends to).
    """

    lengths: torch.Tensor
    block: int
    causal: bool
    host: np.ndarray | None = None
    """The same ``lengths`` on the host (the batch's builder counted them: ``host_lengths.row_lengths``), which size the
    plan without a device read; ``None``: the sizes are read from ``lengths`` (one device-to-host sync on a GPU)."""
    _shared: list[tuple[tuple[Any, ...], Any]] = field(default_factory=list, init=False, repr=False, compare=False)

    @functools.cached_property
    def counts(self) -> _Counts:
        """The plan's sizes: its tiles ``NB``, tokens ``T`` and (query tile, key tile) pairs ``P``: sums over the rows'
        tile counts ``t_r`` (``Σ t_r``, ``Σ n_r``, and ``Σ t_r (t_r + 1) / 2`` causal or ``Σ t_r²``), from :attr:`host`
        when known, else read from the device in one read."""
        if self.host is not None:
            n = self.host.astype(np.int64)
            t = (n + self.block - 1) // self.block
            pairs = t * (t + 1) // 2 if self.causal else t * t
            return _Counts(int(t.sum()), int(n.sum()), int(pairs.sum()))
        per_row = torch.div(self.lengths + self.block - 1, self.block, rounding_mode="floor")
        per_pair = torch.div(per_row * (per_row + 1), 2, rounding_mode="floor") if self.causal else per_row * per_row
        num_tiles, num_tokens, num_pairs = torch.stack([per_row.sum(), self.lengths.sum(), per_pair.sum()]).tolist()
        return _Counts(num_tiles, num_tokens, num_pairs)

    @functools.cached_property
    def _plan(self) -> _Plan:
        return _plan(self.lengths, self.block, self.causal, self.counts)

    @property
    def slots(self) -> torch.Tensor:
        return self._plan.slots

    @property
    def positions(self) -> torch.Tensor:
        return self._plan.positions

    @property
    def pair_query(self) -> torch.Tensor:
        return self._plan.pair_query

    @property
    def pair_key(self) -> torch.Tensor:
        return self._plan.pair_key

    def shared(self, inputs: tuple[Any, ...], make: Callable[[], _T]) -> _T:
        """``make()``, made once per ``inputs`` for the batch these tiles cut: what every layer of the batch would compute
        alike (:func:`pointwise_attention`'s bias indices and masks, from the same times, candidates and positions),
        made by the first layer and reused by the others. ``inputs`` match when each is the same tensor, or equal (not a
        tensor: numbers, dtypes, ``None``); they are kept, so a tensor's identity cannot pass to another while the tiles
        live."""
        for seen, made in self._shared:
            if len(seen) == len(inputs) and all(a is b or not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)
                                                and a == b for a, b in zip(seen, inputs, strict=True)):
                return made
        made = make()
        self._shared.append((inputs, made))
        return made


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` along ``x``'s first dim, for an ``index`` of any shape (``[*index.shape, *x.shape[1:]]``): by
    ``index_select``, whose backward is an ``index_add``. Advanced indexing's backward (``index_put`` with
    ``accumulate``) is 1.3-10x slower on the CPU, and the tiles gather by pair indices and the bias by distances and time
    buckets in every layer's forward (docs/performance.md, *HSTU-SASRec on per-user rows: where a step goes*)."""
    return x.index_select(0, index.reshape(-1)).view(index.shape + x.shape[1:])  # shapes added: TorchRec's trace follows


def row_starts(lengths: torch.Tensor) -> torch.Tensor:
    """``[B]``: where each row's first token sits among the flat tokens (the offsets without the last)."""
    return torch.cumsum(lengths, 0) - lengths


@torch.fx.wrap
def tile(lengths: torch.Tensor, block: int, causal: bool = True, host: np.ndarray | None = None) -> Tiles:
    """The tiling of rows of ``lengths [B]`` (tokens flat, row after row) into tiles of ``block`` tokens.

    ``causal``: a query tile meets its row's key tiles up to itself; otherwise every tile of its row. ``host``: the same
    lengths on the host, when the batch carries them (:attr:`Tiles.host`). A leaf of TorchRec's pipeline trace
    (``torch.fx.wrap``): the tile counts are data, which a symbolic trace cannot follow.
    """
    return Tiles(lengths=lengths.long(), block=block, causal=causal, host=None if torch.compiler.is_exporting() else host)


@torch.fx.wrap
def host_plus(host: np.ndarray | None, extra: int, events: bool = True) -> np.ndarray | None:
    """Host lengths ``host [B]`` with ``extra`` tokens more per row (a start token, a candidate), or those alone when not
    ``events``; ``None`` when not known. A leaf of TorchRec's pipeline trace, like :func:`tile`: ``host`` is no tensor."""
    return None if host is None else host.astype(np.int64) * int(events) + extra


def _plan(lengths: torch.Tensor, block: int, causal: bool, counts: _Counts) -> _Plan:
    device = lengths.device
    tiles = torch.div(lengths + block - 1, block, rounding_mode="floor")  # [B]
    first = row_starts(tiles)
    num_tiles = counts.tiles
    rows = torch.arange(lengths.shape[0], device=device)
    tile_row = torch.repeat_interleave(rows, tiles, output_size=num_tiles)
    tile_index = torch.arange(num_tiles, device=device) - first[tile_row]  # each tile's place in its row
    positions = tile_index.unsqueeze(1) * block + torch.arange(block, device=device).unsqueeze(0)
    positions = torch.where(positions < lengths[tile_row].unsqueeze(1), positions, -1)
    num_tokens = counts.tokens
    token_row = torch.repeat_interleave(rows, lengths, output_size=num_tokens)
    slots = first[token_row] * block + torch.arange(num_tokens, device=device) - row_starts(lengths)[token_row]
    keys = tile_index + 1 if causal else tiles[tile_row]  # key tiles per query tile
    num_pairs = counts.pairs
    pair_query = torch.repeat_interleave(torch.arange(num_tiles, device=device), keys, output_size=num_pairs)
    pair_key = first[tile_row[pair_query]] + torch.arange(num_pairs, device=device) - row_starts(keys)[pair_query]
    return _Plan(slots=slots, positions=positions, pair_query=pair_query, pair_key=pair_key)


def to_tiles(x: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    """``x [T, ...]`` laid out as ``[NB, C, ...]`` (zeros in the slots past a row's end)."""
    num_tiles, block = tiles.positions.shape
    out = x.new_zeros((num_tiles * block, *x.shape[1:]))
    return out.index_copy(0, tiles.slots, x).view(num_tiles, block, *x.shape[1:])


def from_tiles(x: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    """``x [NB, C, ...]`` back to its tokens ``[T, ...]``."""
    return take(x.reshape(-1, *x.shape[2:]), tiles.slots)


TIME_BUCKET_WIDTH = 0.301
"""Width of one time-gap bucket in ``ln(seconds)``: bucket ``floor(ln(gap) / 0.301)`` (the reference code's)."""


def time_buckets(gaps: torch.Tensor, last: int) -> torch.Tensor:
    """``floor(ln(max(|gap|, 1)) / 0.301)`` clamped to ``[0, last]``: the reference code's bucket of a gap in seconds
    (gaps under 3 s share bucket 0; 0.301 ≈ log-spaced by 1.35x)."""
    return (torch.log(gaps.abs().clamp_min(1).double()) / TIME_BUCKET_WIDTH).long().clamp(0, last)


class BiasIndex(NamedTuple):
    """Where HSTU's ``rab`` of some query-key pairs reads its learned weights: ``distance`` into ``position``, ``bucket``
    into ``time`` (``None``: no time term). :func:`bias_index` makes it, :func:`gathered_bias` reads it."""

    distance: torch.Tensor
    bucket: torch.Tensor | None


def bias_index(distance: torch.Tensor, gaps: torch.Tensor | None, positions: int, buckets: int | None) -> BiasIndex:
    """The weights' indices of query-key pairs ``distance`` apart (query position − key position, ``≥ 0``) with time gaps
    ``gaps`` (query time − key time; ``None``: no time term): ``min(distance, positions - 1)`` among ``positions``
    position weights and ``bucket(gap)`` among ``buckets + 1`` time weights (``buckets=None``: no time term)."""
    time = None if gaps is None or buckets is None else time_buckets(gaps, buckets)
    return BiasIndex(distance.clamp_max(positions - 1), time)


def gathered_bias(position: torch.Tensor, time: torch.Tensor | None, index: BiasIndex) -> torch.Tensor:
    """``position[index.distance] + time[index.bucket]``: the bias of the pairs :func:`bias_index` indexed."""
    bias = take(position, index.distance)
    return bias if time is None or index.bucket is None else bias + take(time, index.bucket)


def relative_bias(position: torch.Tensor, time: torch.Tensor | None, distance: torch.Tensor,
                  gaps: torch.Tensor | None) -> torch.Tensor:
    """HSTU's ``rab`` of query-key pairs ``distance`` apart (query position − key position, ``≥ 0``) with time gaps
    ``gaps`` (query time − key time; ``None``: no time term): ``position[min(distance, len - 1)] + time[bucket(gap)]``,
    from the learned weights ``position [max_len]`` and ``time [buckets + 1]`` (``None``: no time term)."""
    buckets = None if time is None else time.shape[0] - 1
    return gathered_bias(position, time, bias_index(distance, gaps, position.shape[0], buckets))


class _PointwisePairs(NamedTuple):
    bias: BiasIndex  # [P, C, C] each
    scaled_mask: torch.Tensor  # [P, 1, C, C]: the scale where the query may see the key, else 0


def _pointwise_pairs(tiles: Tiles, times: tuple[torch.Tensor, torch.Tensor] | None, candidates: torch.Tensor | None,
                     positions: torch.Tensor | None, num_positions: int, buckets: int | None, scale: float,
                     dtype: torch.dtype) -> _PointwisePairs:
    """What :func:`pointwise_attention` needs of the pairs besides the layer's weights: the bias's indices and the
    scaled mask, the same in every layer of one batch (the first layer makes them, :meth:`Tiles.shared`). Every
    ``[P, C, C]`` integer pass (distances, time gaps, their log buckets in double) is paid once per batch, not per layer."""
    pq, pk = tiles.pair_query, tiles.pair_key
    query_at, key_at = tiles.positions[pq], tiles.positions[pk]  # [P, C]
    distance = query_at.unsqueeze(2) - key_at.unsqueeze(1)  # [P, C, C]
    allowed = (distance >= 0) & (key_at >= 0).unsqueeze(1) & (query_at >= 0).unsqueeze(2)
    if candidates is not None:
        seen = ~to_tiles(candidates, tiles)[pk]  # [P, C]: keys every query may see
        allowed = allowed & (seen.unsqueeze(1) | (distance == 0))
    if positions is not None:
        placed = to_tiles(positions, tiles)
        distance = placed[pq].unsqueeze(2) - placed[pk].unsqueeze(1)
    gaps = None
    if times is not None:
        query_t, key_t = to_tiles(times[0], tiles)[pq], to_tiles(times[1], tiles)[pk]
        gaps = query_t.unsqueeze(2) - key_t.unsqueeze(1)
    # ``allowed * scale`` in one factor: SiLU(x) · scale · 1 and SiLU(x) · scale are the same float, as are the 0s.
    return _PointwisePairs(bias_index(distance.clamp_min(0), gaps, num_positions, buckets),
                           (allowed.unsqueeze(1).to(dtype) * scale))


@torch.fx.wrap
def pointwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: Tiles, position: torch.Tensor,
                        time: torch.Tensor | None, scale: float, times: tuple[torch.Tensor, torch.Tensor] | None = None,
                        candidates: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """HSTU's attention on jagged rows: ``q, k, v [T, H, d] → [T, H, d]``.

    Token ``i`` of a row mixes ``Σ_j SiLU(q_i · k_j + bias(i - j, gap_ij)) · scale · v_j`` over the tokens ``j`` of
    its row that the tiling lets it meet (``j ≤ i``), where a *candidate* token (``candidates [T]`` True)
    is seen by itself alone: each candidate sees the history and not the other candidates. ``times``: each token's
    query and key time (``[T]`` each; the gap is ``query_i − key_j``), ``None``: no time term. The bias is
    :func:`relative_bias` of ``position`` and ``time``, its distance ``i - j`` between the tokens' places in their row, or
    between their ``positions [T]`` when given (several candidates after one history all stand where the first does, so
    each sees the history at the distances it would alone). ``tiles`` must be causal (``tile(..., causal=True)``). A leaf
    of TorchRec's pipeline trace, like :func:`tile`: its tiles' shapes are data.
    """
    pq, pk = tiles.pair_query, tiles.pair_key
    heads = (0, 2, 1, 3)  # [NB, C, H, d] → [NB, H, C, d]
    qt, kt, vt = (to_tiles(t, tiles).permute(heads) for t in (q, k, v))
    buckets = None if time is None else time.shape[0] - 1
    pairs = tiles.shared((*(times or (None, None)), candidates, positions, position.shape[0], buckets, scale, q.dtype),
                         lambda: _pointwise_pairs(tiles, times, candidates, positions, position.shape[0], buckets, scale, q.dtype))
    logits = take(qt, pq) @ take(kt, pk).transpose(2, 3) + gathered_bias(position, time, pairs.bias).unsqueeze(1).to(q.dtype)  # [P, H, C, C]
    weights = F.silu(logits) * pairs.scaled_mask
    mixed = torch.zeros_like(qt).index_add(0, pq, weights @ take(vt, pk))  # [NB, H, C, d]
    return from_tiles(mixed.permute(heads), tiles)


@torch.fx.wrap
def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: Tiles, scale: float, dropout: float = 0.0,
                      training: bool = False) -> torch.Tensor:
    """A transformer's softmax attention on jagged rows: ``q, k, v [T, H, d] → [T, H, d]``.

    Token ``i`` of a row mixes ``Σ_j softmax_j(scale · q_i · k_j) · v_j`` over the tokens ``j`` of its row that the tiling
    lets it meet: all of them (``tile(..., causal=False)``), or ``j ≤ i`` (causal tiles). The softmax spans every key tile
    of the row, exactly: each (query tile, key tile) pair's scores are shifted by the query's largest score over all its
    pairs (a ``scatter_reduce`` max; the shift cancels, so it is taken without gradient), exponentiated, and the
    exponentials' sums and their products with the values are summed per query tile (``index_add``) before one division.
    ``dropout`` (while ``training``) drops normalized weights, as ``nn.MultiheadAttention`` does. A leaf of TorchRec's
    pipeline trace, like :func:`tile`: its tiles' shapes are data.
    """
    pq, pk = tiles.pair_query, tiles.pair_key
    heads = (0, 2, 1, 3)  # [NB, C, H, d] → [NB, H, C, d]
    qt, kt, vt = (to_tiles(t, tiles).permute(heads) for t in (q, k, v))
    query_at, key_at = tiles.positions[pq], tiles.positions[pk]  # [P, C]
    allowed = (key_at >= 0).unsqueeze(1)  # [P, 1, C]: real keys only
    if tiles.causal:
        allowed = allowed & (query_at.unsqueeze(2) >= key_at.unsqueeze(1))  # [P, C, C]
    logits = (take(qt, pq) @ take(kt, pk).transpose(2, 3) * scale).masked_fill(~allowed.unsqueeze(1), float("-inf"))  # [P, H, C, C]
    pair_top = logits.detach().amax(dim=3)  # [P, H, C]
    top = torch.full(qt.shape[:3], float("-inf"), dtype=logits.dtype, device=logits.device)
    top = top.scatter_reduce(0, pq.view(-1, 1, 1).expand_as(pair_top), pair_top, reduce="amax")  # [NB, H, C]
    top = torch.where(torch.isfinite(top), top, 0.0)  # a padding slot of a causal tile meets no key
    weights = torch.exp(logits - top[pq].unsqueeze(3))  # 0 where not allowed
    total = torch.zeros_like(top).index_add(0, pq, weights.sum(dim=3))  # [NB, H, C]: the softmax's denominators
    if training and dropout > 0:
        weights = F.dropout(weights, dropout)
    mixed = torch.zeros_like(qt).index_add(0, pq, weights @ take(vt, pk))  # [NB, H, C, d]
    mixed = mixed / total.clamp_min(torch.finfo(total.dtype).tiny).unsqueeze(3)
    return from_tiles(mixed.permute(heads), tiles)


JAGGED_SWITCHES = {"jagged": False, "tile_size": 0}
"""The attributes that put a module on its jagged path (``SequenceArch.jagged``, ``SASRec.tile_size``) and their padded
values."""


@contextmanager
def padded_reference(model: nn.Module) -> Iterator[None]:
    """``model`` with every jagged path on its padded one for the block: what an exported program runs (it always pads),
    so that the eager output an export is checked against is the same computation, not the same sums in another order
    (the two differ by float rounding, a few 1e-6 on a cosine score over a temperature)."""
    saved = [(m, name, getattr(m, name)) for m in model.modules() for name in JAGGED_SWITCHES if hasattr(m, name)]
    try:
        for m, name, _ in saved:
            setattr(m, name, JAGGED_SWITCHES[name])
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)
