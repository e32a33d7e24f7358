"""``TRITON_INTERPRET=1 python -m tests.triton_interpreted``: fbgemm's Triton kernels for HSTU's jagged attention, run
on the CPU by Triton's interpreter, against the PyTorch tiles (tests/test_hstu_kernels.py starts it).

``model.attention_kernel=fbgemm`` calls fbgemm's registered ops, which on CUDA are the Triton kernels of
``fbgemm_gpu.sll.triton`` and on the CPU reference loops. Triton's interpreter runs those same Triton kernels (the
source a GPU compiles) on CPU tensors, so here :func:`recsys_runner.models.jagged_kernels.products` hands out fbgemm's
Triton autograd functions instead of the ops, and one HSTU layer's output and gradients are compared with the tiles'
for each input the layer takes, and with the rows split over several launches. Triton comes from ``.venv-triton``
(``.ci/install-triton``), kept out of the project's environment. Prints one JSON object: each case's largest
differences and whether it is within tolerance; exits 1 when one is not.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from recsys_runner.models import jagged_kernels
from recsys_runner.models.hstu import HSTUBlock
from recsys_runner.models.jagged import tile

LENGTHS = [5, 0, 1, 17, 8, 40]
CASES = {"positions-only": set(), "times": {"times"}, "candidates": {"times", "candidates"},
         "shared-positions": {"times", "candidates", "positions"}}


def triton_products() -> tuple[jagged_kernels.Product, jagged_kernels.Product]:
    """fbgemm's Triton autograd functions (forward and backward kernels), called directly: the ops register them for
    CUDA only."""
    from fbgemm_gpu.sll.triton.triton_jagged_bmm_jagged_out import array_jagged_bmm_jagged_out, jagged_jagged_bmm_jagged_out

    return jagged_jagged_bmm_jagged_out, array_jagged_bmm_jagged_out


def layer_run(layer: HSTUBlock, options: set[str], g: torch.Generator) -> list[torch.Tensor]:
    tokens = sum(LENGTHS)
    x = torch.randn(tokens, 8, generator=g).requires_grad_()
    times = (torch.randint(1, 10**5, (tokens,), generator=g).cumsum(0), torch.randint(1, 10**5, (tokens,), generator=g).cumsum(0))
    candidates, positions = torch.rand(tokens, generator=g) < 0.3, torch.randint(0, 12, (tokens,), generator=g)
    out = layer.forward_jagged(x, tile(torch.tensor(LENGTHS), 4), times if "times" in options else None,
                               candidates if "candidates" in options else None, positions if "positions" in options else None)
    (out ** 2).sum().backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in layer.parameters()]
    layer.zero_grad()
    assert x.grad is not None
    return [out.detach(), x.grad, *grads]


def compare(expected: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, object]:
    return {"max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(got, expected, strict=True)),
            "within": all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, expected, strict=True))}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1: Triton's interpreter is what runs its kernels on the CPU", file=sys.stderr)
        return 2
    jagged_kernels.products = triton_products  # the Triton kernels in place of the ops' CPU loops
    results: dict[str, object] = {}
    for name, options in CASES.items():
        torch.manual_seed(0)
        tiles = HSTUBlock(8, num_heads=2, max_len=48, dropout=0.0, time_buckets=16 if "times" in options else 0)
        triton = HSTUBlock(8, num_heads=2, max_len=48, dropout=0.0, time_buckets=16 if "times" in options else 0, kernel="fbgemm")
        triton.load_state_dict(tiles.state_dict())
        expected, got = (layer_run(layer, options, torch.Generator().manual_seed(1)) for layer in (tiles, triton))
        results[name] = compare(expected, got)
    g = torch.Generator().manual_seed(2)
    lengths = torch.tensor(LENGTHS)
    q, k, v = (torch.randn(int(lengths.sum()), 2, 4, generator=g, requires_grad=True) for _ in range(3))
    runs = []
    for max_rows in (1_000, 5):  # 12 rows (2 heads × 6): one launch, then three
        out = jagged_kernels.fbgemm_pointwise_attention(q, k, v, lengths, torch.randn(48, generator=torch.Generator().manual_seed(3)),
                                                        None, 0.1, max_rows=max_rows)
        runs.append([out.detach(), *torch.autograd.grad((out ** 2).sum(), (q, k, v))])
    results["launches"] = compare(runs[0], runs[1])
    print(json.dumps(results))
    return 0 if all(r["within"] for r in results.values() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
