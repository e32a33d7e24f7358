"""HSTU's jagged attention on fbgemm's jagged kernels (``model.attention_kernel``): Triton on CUDA, reference loops on
the CPU, and the choice between them and the PyTorch tiles.

The tiles (:func:`recsys_runner.models.jagged.pointwise_attention`, ``attention_kernel: tiles``) are written in
PyTorch ops. fbgemm-gpu's default wheel ships jagged matrix products that never pad (``fbgemm_gpu.sll``): on CUDA they are
Triton kernels, on the CPU per-row loops with the same autograd. The HSTU target of fbgemm (its ``hstu`` attention) is
a separate build that the TorchRec wheels do not bring (fbgemm-gpu 1.6.0's CUDA wheel, the GPU stack here, has no
``hstu`` files, and the same ``sll`` code as 1.8.0), so this path is built from the two products the default wheel
has, both with gradients:

- ``sll_jagged_jagged_bmm_jagged_out``: each row's ``Q Kᵀ``, its ``n × n`` scores stored flat row after row
  (``Σ n²`` values, no padding to the batch's longest row);
- the bias, the causal and candidate masks and ``SiLU`` applied to those flat scores with PyTorch's elementwise ops;
- ``sll_array_jagged_bmm_jagged_out``: each row's weights times its ``V``.

The heads ride as extra rows (head-major: head 0's rows, then head 1's), so a layer is two kernel launches whatever
``H``. The CUDA kernels put the rows on one grid axis, which CUDA caps at 65,535 blocks: more rows than that (``H × B``)
go in chunks. Their scores cover a row's whole ``n × n`` square, where the tiled path skips the tiles above the
diagonal.

``attention_kernel: auto`` (the default) runs fbgemm's kernels on CUDA and the tiles elsewhere (on the CPU fbgemm's are
loops, ~3x slower). On CUDA a probe (:func:`fbgemm_unusable`) first runs both kernels forward and backward on a small
batch: a Triton that fails to compile there, or numbers that differ, cost one log line and the run goes on the tiles.
``tests/test_hstu_kernels.py`` checks both kernels give the same values and gradients, and runs fbgemm's Triton kernels
themselves against the tiles in Triton's interpreter on the CPU (``tests/triton_interpreted.py``).

Shape legend: ``T`` tokens (``Σ n_r``), ``B`` rows, ``S`` score entries (``Σ n_r²``), ``H`` heads, ``d`` a head's width.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from recsys_runner.errors import require
from recsys_runner.models.jagged import Tiles, pointwise_attention, relative_bias, tile

__all__ = ["KERNELS", "MAX_GRID_ROWS", "attention", "check_kernel", "fbgemm_pointwise_attention", "fbgemm_unusable",
           "load_fbgemm_jagged", "products"]

log = logging.getLogger(__name__)

KERNELS = ("auto", "tiles", "fbgemm")
"""``model.attention_kernel`` options: ``auto`` (fbgemm's kernels on CUDA once they pass a probe there, the tiles
elsewhere), the PyTorch tiles (:mod:`recsys_runner.models.jagged`), or fbgemm's jagged products."""

MAX_GRID_ROWS = 65_535
"""The most rows one CUDA kernel launch takes: fbgemm's Triton kernels put the rows on a grid axis CUDA caps there."""


def check_kernel(kernel: str, jagged: bool, padded_hint: str) -> None:
    """``model.attention_kernel`` is one of :data:`KERNELS`, and ``fbgemm`` only where the layers run jagged (the
    padded path has no kernel to choose); ``padded_hint`` names the setting that made them padded."""
    require(kernel in KERNELS, f"model.attention_kernel={kernel!r} must be one of {list(KERNELS)}")
    require(kernel != "fbgemm" or jagged, f"model.attention_kernel=fbgemm runs the jagged attention, but {padded_hint} puts "
            f"the layers on padded rows. Fix: drop model.attention_kernel, or run the jagged path")


def load_fbgemm_jagged() -> None:
    """Register fbgemm's jagged products (``torch.ops.fbgemm.sll_*``; importing ``fbgemm_gpu`` alone does not), with their
    Triton kernels when CUDA is visible."""
    import fbgemm_gpu.sll  # noqa: F401  (registers the ops)


Product = Callable[..., torch.Tensor]


def products() -> tuple[Product, Product]:
    """fbgemm's two jagged products, ``(Q Kᵀ per row → flat squares, flat squares @ V per row)``: the registered ops, which
    dispatch on the tensors' device (Triton on CUDA, loops on the CPU). tests/triton_interpreted.py puts fbgemm's Triton
    functions here instead, to run them on the CPU in Triton's interpreter."""
    load_fbgemm_jagged()
    return torch.ops.fbgemm.sll_jagged_jagged_bmm_jagged_out, torch.ops.fbgemm.sll_array_jagged_bmm_jagged_out


@functools.cache
def _note_cpu_loops() -> None:
    log.warning("model.attention_kernel=fbgemm on the CPU runs fbgemm's reference loops over the rows (about 3x slower than "
                "the tiles on a 2-core CPU, docs/performance.md): it is the CUDA choice. Fix: model.attention_kernel=tiles")


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


def _squares(lengths: torch.Tensor, total: int) -> _Squares:
    """``total``: the entries of all the squares (``Σ n_r²``)."""
    sizes = lengths * lengths
    row = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), sizes, output_size=total)
    local = torch.arange(total, device=lengths.device) - _offsets(sizes)[row]
    n = lengths[row]
    i, j = torch.div(local, n, rounding_mode="floor"), local % n
    start = _offsets(lengths)[row]
    return _Squares(query=start + i, key=start + j, i=i, j=j)


def _per_launch(lengths: torch.Tensor, host: np.ndarray, max_rows: int,
                call: Callable[[tuple[torch.Tensor, ...], slice, slice], torch.Tensor]) -> torch.Tensor:
    """``call`` once per launch of at most ``max_rows`` rows, its outputs concatenated. It gets the launch's row lengths
    and offsets and its score squares' sizes and offsets, then the slices of the flat tokens and of the flat scores that
    are the launch's (cut where the same ``lengths``, ``host`` on the host, say)."""
    token_at = np.concatenate([[0], np.cumsum(host)]).tolist()
    entry_at = np.concatenate([[0], np.cumsum(host * host)]).tolist()
    out = []
    for first in range(0, lengths.shape[0], max_rows):
        last = min(first + max_rows, lengths.shape[0])
        n = lengths[first:last]
        out.append(call((n, _offsets(n), n * n, _offsets(n * n)), slice(token_at[first], token_at[last]),
                        slice(entry_at[first], entry_at[last])))
    return torch.cat(out)


@torch.fx.wrap
def fbgemm_pointwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, position: torch.Tensor,
                               time: torch.Tensor | None, scale: float, times: tuple[torch.Tensor, torch.Tensor] | None = None,
                               candidates: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                               max_rows: int = MAX_GRID_ROWS, host_lengths: np.ndarray | None = None) -> torch.Tensor:
    """HSTU's attention on jagged rows of ``lengths [B]``: ``q, k, v [T, H, d] → [T, H, d]``, on fbgemm's kernels.

    The same function as :func:`~recsys_runner.models.jagged.pointwise_attention` (its docstring has the formula, the
    candidates' mask and the bias's ``times`` and ``positions``), computed without tiles: the scores of each row's whole
    square, then the mask. ``max_rows``: rows (``H × B``) per kernel launch. ``host_lengths``: the same ``lengths`` on the
    host (:attr:`~recsys_runner.models.jagged.Tiles.host`), which size the squares and the launches; ``None``: they are
    read from the device (one read). A leaf of TorchRec's pipeline trace: its shapes are data.
    """
    tokens, heads, width = q.shape
    if tokens == 0:
        return torch.zeros_like(q)
    scores_product, mixing_product = products()
    lengths = lengths.long()
    host = lengths.cpu().numpy() if host_lengths is None else host_lengths.astype(np.int64)
    at = _squares(lengths, int((host * host).sum()))
    allowed = at.j <= at.i
    if candidates is not None:
        allowed = allowed & (~candidates[at.key] | (at.i == at.j))
    distance = at.i - at.j if positions is None else positions[at.query] - positions[at.key]
    gaps = None if times is None else times[0][at.query] - times[1][at.key]
    bias = relative_bias(position, time, distance.clamp_min(0), gaps).to(q.dtype)  # [S]
    qh, kh, vh = (t.permute(1, 0, 2).reshape(heads * tokens, width) for t in (q, k, v))  # head 0's rows, head 1's, ...
    rows, longest, host_rows = lengths.repeat(heads), int(host.max()), np.tile(host, heads)
    tf32 = bool(q.is_cuda and torch.backends.cuda.matmul.allow_tf32)

    def scores_of(launch: tuple[torch.Tensor, ...], own: slice, _: slice) -> torch.Tensor:  # each row's Q Kᵀ, flat
        n, starts, squares, square_starts = launch
        return scores_product(qh[own], kh[own], n, starts, n, starts, squares, square_starts, longest, tf32)

    scores = _per_launch(rows, host_rows, max_rows, scores_of).view(heads, -1)  # [H, S]
    weights = (F.silu(scores + bias) * scale * allowed.to(q.dtype)).reshape(-1)

    def mixed_of(launch: tuple[torch.Tensor, ...], own: slice, entries: slice) -> torch.Tensor:  # each row's weights @ V
        n, starts, squares, square_starts = launch
        return mixing_product(weights[entries], vh[own], squares, square_starts, n, starts, n, starts, longest, tf32)

    mixed = _per_launch(rows, host_rows, max_rows, mixed_of)  # [H · T, d]
    return mixed.view(heads, tokens, width).permute(1, 0, 2)


def auto_picks_fbgemm(device: torch.device) -> bool:
    """Whether ``attention_kernel: auto`` tries fbgemm's kernels on ``device``: on CUDA, where they are Triton kernels (on
    the CPU they are reference loops, slower than the tiles)."""
    return device.type == "cuda"


@functools.cache
def fbgemm_unusable(device: torch.device) -> str | None:
    """Why fbgemm's kernels cannot serve ``auto`` on ``device`` (``None``: they can), found once per device by a probe:
    one small batch of rows (an empty one, one past a Triton block) forward and backward on both kernels, in fp32 with
    autocast off and autograd on (whatever mode the first forward runs in), compared within rtol 1e-4 / atol 1e-5. It
    compiles the Triton kernels where they would first compile anyway, and a failure or a mismatch there (a Triton that
    does not match the GPU, a kernel bug) costs one log line and the tiles, not the run. Out-of-memory is not caught: it
    is the run's, not the kernel's."""
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
            g = torch.Generator().manual_seed(0)
            lengths = torch.tensor([3, 0, 37], device=device)
            q, k, v = (torch.randn(40, 2, 8, generator=g).to(device).requires_grad_() for _ in range(3))
            position = torch.randn(64, generator=g).to(device)
            tiled = pointwise_attention(q, k, v, tile(lengths, 16), position, None, 0.1)
            fused = fbgemm_pointwise_attention(q, k, v, lengths, position, None, 0.1)
            got = [fused.detach(), *torch.autograd.grad((fused ** 2).sum(), (q, k, v))]
            expected = [tiled.detach(), *torch.autograd.grad((tiled ** 2).sum(), (q, k, v))]
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # any failure of the optional kernel: the tiles take over (the docstring says why)
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
    worst = max(float((a - b).abs().max()) for a, b in zip(got, expected, strict=True))
    if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, expected, strict=True)):
        return f"its numbers differ from the tiles' by up to {worst:.1e}"
    return None


@functools.cache
def _note_fallback(device: torch.device, why: str) -> None:
    log.warning("model.attention_kernel=auto: fbgemm's jagged kernels cannot run on %s (%s); the HSTU attention runs on the "
                "PyTorch tiles instead. Set model.attention_kernel=tiles to skip this probe", device, why)


@torch.fx.wrap
def attention(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: Tiles, position: torch.Tensor,
              time: torch.Tensor | None, scale: float, times: tuple[torch.Tensor, torch.Tensor] | None = None,
              candidates: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """HSTU's attention on jagged rows, ``q, k, v [T, H, d] → [T, H, d]``, on the kernel ``kernel`` names
    (:data:`KERNELS`): :func:`fbgemm_pointwise_attention` or :func:`~recsys_runner.models.jagged.pointwise_attention`,
    the same function. ``auto`` takes fbgemm's where :func:`auto_picks_fbgemm` and :func:`fbgemm_unusable` allow. A leaf
    of TorchRec's pipeline trace: the choice reads the tensors' device."""
    use_fbgemm = kernel == "fbgemm"
    if kernel == "auto" and auto_picks_fbgemm(q.device):
        why = fbgemm_unusable(q.device)
        if why is not None:
            _note_fallback(q.device, why)
        use_fbgemm = why is None
    if use_fbgemm:
        if not q.is_cuda:
            _note_cpu_loops()  # asked for by name: auto never picks the loops
        return fbgemm_pointwise_attention(q, k, v, tiles.lengths, position, time, scale, times, candidates, positions,
                                          host_lengths=tiles.host)
    return pointwise_attention(q, k, v, tiles, position, time, scale, times, candidates, positions)
