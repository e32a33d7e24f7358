"""Token-budget cuts (``data.batch_tokens``, docs/sequences.md): the slices :func:`token_slices` and
:func:`padded_slices` cut are exactly the greedy row-by-row cuts, found one slice at a time (a search or a window of
rows per slice) instead of a Python step per row, which every block of rows of every epoch went through."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from recsys_runner.data.sequences.tokens import padded_slices, token_slices


def greedy_tokens(costs: list[int], budget: int) -> list[tuple[int, int]]:
    """The row-by-row reference: a row joins the slice while the slice's total stays within the budget."""
    slices, start, total = [], 0, 0
    for i, cost in enumerate(costs):
        if total + cost > budget:
            slices.append((start, i))
            start, total = i, 0
        total += cost
    return slices + ([(start, len(costs))] if start < len(costs) else [])


def greedy_padded(costs: list[int], budget: int) -> list[tuple[int, int]]:
    """The row-by-row reference: a row joins while rows × the slice's largest cost stays within the budget."""
    slices, start, widest = [], 0, 0
    for i, cost in enumerate(costs):
        if (i - start + 1) * max(widest, cost) > budget:
            slices.append((start, i))
            start, widest = i, 0
        widest = max(widest, cost)
    return slices + ([(start, len(costs))] if start < len(costs) else [])


@pytest.mark.parametrize("seed", range(6))
def test_cuts_equal_the_greedy_row_by_row_cuts(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(8):
        n = int(rng.integers(0, 2000))
        budget = int(rng.choice([1, 7, 64, 201, 4096, 16384]))
        costs = np.minimum(rng.zipf(1.3, n), budget).astype(np.int64) if seed % 2 else rng.integers(0, budget + 1, n)
        for order in (costs, np.sort(costs), np.sort(costs)[::-1]):
            assert token_slices(order, budget) == greedy_tokens(order.tolist(), budget)
            assert padded_slices(order, budget) == greedy_padded(order.tolist(), budget)


def test_a_row_over_the_budget_is_refused() -> None:
    for cut in (token_slices, padded_slices):
        with pytest.raises(ValueError, match="a row costs 9 tokens, more than the budget 8"):
            cut(np.array([1, 9, 2]), 8)
        assert cut(np.zeros(0, np.int64), 8) == []


def _lines_run(cut, costs: np.ndarray, budget: int) -> int:
    """Python lines ``cut`` runs on ``costs`` (its own frame only): counted by a trace function, not timed."""
    count = 0

    def trace(frame, event, arg):  # noqa: ANN001, ANN202 (sys.settrace's signature)
        nonlocal count
        if frame.f_code is cut.__code__:
            if event == "line":
                count += 1
            return trace
        return None

    sys.settrace(trace)
    try:
        cut(costs, budget)
    finally:
        sys.settrace(None)
    return count


def test_the_cuts_take_python_steps_per_slice_not_per_row() -> None:
    """20,000 rows of about 20 tokens into 4,096-token slices (~100 slices): a few lines per slice, where the row-by-row
    loop ran 4 lines per row (80,000)."""
    costs = np.random.default_rng(0).integers(1, 40, 20_000)
    for cut in (token_slices, padded_slices):
        slices = len(cut(costs, 4096))
        assert _lines_run(cut, costs, 4096) < 20 * slices < 20_000, cut.__name__
