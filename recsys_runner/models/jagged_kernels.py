"""HSTU's jagged attention on fbgemm's jagged kernels (``model.attention_kernel: fbgemm``): Triton on CUDA, reference
loops on the CPU.

The default kernel (:func:`recsys_runner.models.jagged.pointwise_attention`, ``attention_kernel: tiles``) is written in
PyTorch ops. fbgemm-gpu's default wheel ships jagged matrix products that never pad (``fbgemm_gpu.sll``): on CUDA they are
Triton kernels, on the CPU per-row loops with the same autograd. The HSTU target of fbgemm (its ``hstu`` attention) is
a separate build that the TorchRec wheels do not bring, so this path is built from the two products the default wheel
has, both with gradients:

- ``sll_jagged_jagged_bmm_jagged_out``: each row's ``Q Kᵀ``, its ``n × n`` scores stored flat row after row
  (``Σ n²`` values, no padding to the batch's longest row);
- the bias, the causal and candidate masks and ``SiLU`` applied to those flat scores with PyTorch's elementwise ops;
- ``sll_array_jagged_bmm_jagged_out``: each row's weights times its ``V``.

The heads ride as extra rows (head-major: head 0's rows, then head 1's), so a layer is two kernel launches whatever
``H``. The CUDA kernels put the rows on one grid axis, which CUDA caps at 65,535 blocks: more rows than that (``H × B``)
go in chunks. Their scores cover a row's whole ``n × n`` square, where the tiled path skips the tiles above the
diagonal. ``tests/test_hstu_kernels.py`` checks both kernels give the same values and gradients.

Shape legend: ``T`` tokens (``Σ n_r``), ``B`` rows, ``S`` score entries (``Σ n_r²``), ``H`` heads, ``d`` a head's width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from recsys_runner.errors import require
from recsys_runner.models.jagged import relative_bias

__all__ = ["KERNELS", "MAX_GRID_ROWS", "check_kernel", "fbgemm_pointwise_attention", "load_fbgemm_jagged"]

KERNELS = ("tiles", "fbgemm")
"""``model.attention_kernel`` options: the PyTorch tiles (:mod:`recsys_runner.models.jagged`) or fbgemm's jagged products."""

MAX_GRID_ROWS = 65_535
"""The most rows one CUDA kernel launch takes: fbgemm's Triton kernels put the rows on a grid axis CUDA caps there."""


def check_kernel(kernel: str, jagged: bool, padded_hint: str) -> None:
    """``model.attention_kernel`` is one of :data:`KERNELS`, and ``fbgemm`` only where the layers run jagged (the
    padded path has no kernel to choose); ``padded_hint`` names the setting that made them padded."""
    require(kernel in KERNELS, f"model.attention_kernel={kernel!r} must be one of {list(KERNELS)}")
    require(kernel == "tiles" or jagged, f"model.attention_kernel=fbgemm runs the jagged attention, but {padded_hint} puts "
            f"the layers on padded rows. Fix: drop model.attention_kernel, or run the jagged path")


def load_fbgemm_jagged() -> None:
    """Register fbgemm's jagged products (``torch.ops.fbgemm.sll_*``; importing ``fbgemm_gpu`` alone does not), with their
    Triton kernels when CUDA is visible."""
    import fbgemm_gpu.sll  # noqa: F401  (registers the ops)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[B + 1]``: where each row starts among the flat values, and the total."""
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


@dataclass(frozen=True)
class _Squares:
    """Each score entry's place, for one head: entry ``e`` of ``[S]`` is row ``r``'s (query ``i``, key ``j``), and its
    query and key tokens are ``query [S]`` and ``key [S]`` among the flat ``[T]``."""

    query: torch.Tensor
    key: torch.Tensor
    i: torch.Tensor
    j: torch.Tensor


def _squares(lengths: torch.Tensor) -> _Squares:
    sizes = lengths * lengths
    total = int(sizes.sum())
    row = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), sizes, output_size=total)
    local = torch.arange(total, device=lengths.device) - _offsets(sizes)[row]
    n = lengths[row]
    i, j = torch.div(local, n, rounding_mode="floor"), local % n
    start = _offsets(lengths)[row]
    return _Squares(query=start + i, key=start + j, i=i, j=j)


def _launches(lengths: torch.Tensor, max_rows: int) -> list[tuple[torch.Tensor, int, int, int, int]]:
    """One kernel launch per ``max_rows`` rows: ``(lengths [b], first token, last token, first entry, last entry)``."""
    token_at, entry_at = _offsets(lengths).tolist(), _offsets(lengths * lengths).tolist()
    return [(lengths[first:last], token_at[first], token_at[last], entry_at[first], entry_at[last])
            for first, last in ((f, min(f + max_rows, lengths.shape[0])) for f in range(0, lengths.shape[0], max_rows))]


def _args(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A launch's row lengths and offsets, and its score squares' sizes and offsets."""
    sizes = lengths * lengths
    return lengths, _offsets(lengths), sizes, _offsets(sizes)


def _scores(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, longest: int, max_rows: int) -> torch.Tensor:
    """Each row's ``Q Kᵀ`` (``q, k [T, d]``), flat: ``[Σ n²]``."""
    tf32 = bool(q.is_cuda and torch.backends.cuda.matmul.allow_tf32)
    out = []
    for n, t0, t1, _, _ in _launches(lengths, max_rows):
        n, at, n2, at2 = _args(n)
        out.append(torch.ops.fbgemm.sll_jagged_jagged_bmm_jagged_out(q[t0:t1], k[t0:t1], n, at, n, at, n2, at2, longest, tf32))
    return torch.cat(out)


def _mix(weights: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, longest: int, max_rows: int) -> torch.Tensor:
    """Each row's ``weights [n, n] @ V [n, d]``: ``[T, d]``."""
    tf32 = bool(v.is_cuda and torch.backends.cuda.matmul.allow_tf32)
    out = []
    for n, t0, t1, e0, e1 in _launches(lengths, max_rows):
        n, at, n2, at2 = _args(n)
        out.append(torch.ops.fbgemm.sll_array_jagged_bmm_jagged_out(weights[e0:e1], v[t0:t1], n2, at2, n, at, n, at, longest, tf32))
    return torch.cat(out)


@torch.fx.wrap
def fbgemm_pointwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, position: torch.Tensor,
                               time: torch.Tensor | None, scale: float, times: tuple[torch.Tensor, torch.Tensor] | None = None,
                               candidates: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                               max_rows: int = MAX_GRID_ROWS) -> torch.Tensor:
    """HSTU's attention on jagged rows of ``lengths [B]``: ``q, k, v [T, H, d] → [T, H, d]``, on fbgemm's kernels.

    The same function as :func:`~recsys_runner.models.jagged.pointwise_attention` (its docstring has the formula, the
    candidates' mask and the bias's ``times`` and ``positions``), computed without tiles: the scores of each row's whole
    square, then the mask. ``max_rows``: rows (``H × B``) per kernel launch. A leaf of TorchRec's pipeline trace: its
    shapes are data.
    """
    tokens, heads, width = q.shape
    if tokens == 0:
        return torch.zeros_like(q)
    load_fbgemm_jagged()
    lengths = lengths.long()
    at = _squares(lengths)
    allowed = at.j <= at.i
    if candidates is not None:
        allowed = allowed & (~candidates[at.key] | (at.i == at.j))
    distance = at.i - at.j if positions is None else positions[at.query] - positions[at.key]
    gaps = None if times is None else times[0][at.query] - times[1][at.key]
    bias = relative_bias(position, time, distance.clamp_min(0), gaps).to(q.dtype)  # [S]
    qh, kh, vh = (t.permute(1, 0, 2).reshape(heads * tokens, width) for t in (q, k, v))  # head 0's rows, head 1's, ...
    rows, longest = lengths.repeat(heads), int(lengths.max())
    scores = _scores(qh, kh, rows, longest, max_rows).view(heads, -1)  # [H, S]
    weights = F.silu(scores + bias) * scale * allowed.to(q.dtype)
    mixed = _mix(weights.reshape(-1), vh, rows, longest, max_rows)  # [H · T, d]
    return mixed.view(heads, tokens, width).permute(1, 0, 2)
