"""One HSTU layer's forward and backward on each attention kernel (issue 32): ``tiles`` (PyTorch ops), ``fbgemm``
(fbgemm's jagged products: Triton on CUDA, per-row loops on the CPU) and ``padded`` (the block padded to the batch's
longest row), on the same Zipf-length rows (cap 512, as ``bench/jagged.py``).

Two figures per kernel: tokens/s (median of ``repeats`` timed passes after a warm-up) and the largest difference of its
output and input gradient from the tiles' (the "same numbers" of the two jagged kernels, on the device that ran it).
A kernel whose output or gradient is not within :data:`RTOL` / :data:`ATOL` of the tiles' fails the run (exit status 1), so that
``bench.gpu``'s summary shows it: on a GPU this is the check of fbgemm's Triton kernels against the PyTorch path.

``python -m recsys_runner.bench.hstu_kernels [--quick] [--json F] [distributed.device=cuda]``; on a GPU it is one
entry of ``bench.gpu``'s list. On the CPU fbgemm's path is its reference loop (a Python loop over the rows), so its
figure there says what not to run on a CPU, not how fast the kernel is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsys_runner.models.hstu import HSTUBlock
from recsys_runner.models.jagged import tile

KERNELS = ("tiles", "fbgemm", "padded")
RTOL, ATOL = 1e-4, 1e-5
"""How close to the tiles' output and input gradient another kernel must come (fp32, TF32 off: float rounding only)."""


@dataclass(frozen=True)
class Settings:
    """The layer and the batch."""

    tokens: int = 8192
    max_len: int = 512
    skew: float = 1.2
    dim: int = 64
    heads: int = 2
    block: int = 32
    repeats: int = 10

    @classmethod
    def quick(cls) -> Settings:
        return cls(tokens=256, max_len=32, dim=16, block=8, repeats=2)


def zipf_lengths(s: Settings, seed: int = 0) -> list[int]:
    """Row lengths drawn from a Zipf law (exponent ``skew``) capped at ``max_len``, until the rows hold ``tokens``."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < s.tokens:
        lengths.append(int(min(rng.zipf(s.skew), s.max_len)))
    return lengths


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_pass(kernel: str, layer: HSTUBlock, x: torch.Tensor, lengths: list[int], times: tuple[torch.Tensor, torch.Tensor],
               block: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """One forward + backward of ``layer`` on the flat tokens ``x``: ``(output [T, D], the input's gradient)``."""
    device = x.device
    n = torch.tensor(lengths, device=device)
    mask = torch.arange(max(lengths), device=device).unsqueeze(0) < n.unsqueeze(1)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.detach().requires_grad_()
        if kernel == "padded":
            padded = flat.new_zeros((*mask.shape, flat.shape[1])).masked_scatter(mask.unsqueeze(2), flat)
            padded_times = tuple(t.new_zeros(mask.shape).masked_scatter(mask, t) for t in times)
            out = layer(padded, mask, (padded_times[0], padded_times[1]))[mask]
        else:
            layer.kernel = kernel
            out = layer.forward_jagged(flat, tile(n, block), times)
        (out ** 2).sum().backward()
        assert flat.grad is not None
        return out.detach(), flat.grad

    return run


def bench(s: Settings, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    lengths = zipf_lengths(s)
    tokens = sum(lengths)
    layer = HSTUBlock(s.dim, s.heads, s.max_len + 1, 0.0, 128, device=device)
    x = torch.randn(tokens, s.dim, device=device)
    times = (torch.randint(1, 10**4, (tokens,), device=device).cumsum(0), torch.randint(1, 10**4, (tokens,), device=device).cumsum(0))
    out: dict[str, Any] = {"settings": asdict(s), "device": str(device), "rows": len(lengths), "tokens": tokens,
                           "padded_slots": len(lengths) * max(lengths), "kernels": {}}
    reference: tuple[torch.Tensor, torch.Tensor] | None = None
    for kernel in KERNELS:
        run = layer_pass(kernel, layer, x, lengths, times, s.block)
        result = run()  # warm-up (Triton compiles here), and the numbers compared
        _sync(device)
        seconds = []
        for _ in range(s.repeats):
            t0 = time.perf_counter()
            run()
            _sync(device)
            seconds.append(time.perf_counter() - t0)
        figures: dict[str, float] = {"tokens_per_s": tokens / statistics.median(seconds), "ms": 1000 * statistics.median(seconds)}
        if reference is None:
            reference = result
        else:
            figures["max_abs_diff_out"] = float((result[0] - reference[0]).abs().max())
            figures["max_abs_diff_grad"] = float((result[1] - reference[1]).abs().max())
            figures["matches_tiles"] = all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(result, reference, strict=True))
        out["kernels"][kernel] = figures
        layer.zero_grad()
    layer.kernel = "tiles"
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"HSTU layer fwd+bwd on {result['device']}: {result['rows']} rows, {result['tokens']:,} tokens "
             f"({result['padded_slots']:,} padded slots)"]
    for kernel, f in result["kernels"].items():
        diff = (f" | vs tiles: out {f['max_abs_diff_out']:.1e}, grad {f['max_abs_diff_grad']:.1e}"
                f"{'' if f['matches_tiles'] else ' NOT within tolerance'}") if "max_abs_diff_out" in f else ""
        lines.append(f"  {kernel:7s} {f['tokens_per_s']:>12,.0f} tokens/s  {f['ms']:9.2f} ms{diff}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs, not how fast")
    parser.add_argument("--json", type=Path, default=Path("bench_results/hstu_kernels.json"), help="where to write the results")
    parser.add_argument("overrides", nargs="*", help="distributed.device=cpu|cuda (default: cpu)")
    args = parser.parse_args(argv)
    device = "cpu"
    for override in args.overrides:
        key, _, value = override.partition("=")
        if key != "distributed.device":
            parser.error(f"{override}: only distributed.device=cpu|cuda is read here")
        device = value
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("distributed.device=cuda, but no CUDA device is visible. Fix: distributed.device=cpu")
    result = bench(Settings.quick() if args.quick else Settings(), torch.device(device))
    print(table(result), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0 if all(f.get("matches_tiles", True) for f in result["kernels"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
