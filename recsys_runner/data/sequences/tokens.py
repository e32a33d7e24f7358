"""Token-budget batches (``data.batch_tokens``): rows grouped so that their history tokens fit a budget.

With long-tailed histories a fixed ``batch_size`` either wastes memory on short rows or blows up on long
ones; a step's cost is the number of history events it embeds and attends over. A row costs
:func:`row_tokens` (its history length plus one for the row itself, so that rows with empty histories
still count), and :func:`token_slices` cuts a run of rows, in order, into consecutive batches whose
costs sum to at most the budget. One step is then one such batch (a varying number of rows); losses are
row means within the batch, and ``train/samples_per_s`` counts the rows really trained.

A model that pads each batch to its longest history (DIN, BST) allocates ``rows × longest`` slots, not the batch's
tokens; for rows grouped by length, :func:`padded_slices` cuts so that this padded size fits the budget instead.
"""

from __future__ import annotations

import numpy as np

from recsys_runner.errors import ConfigError

__all__ = ["row_tokens", "token_slices", "padded_slices", "check_budget"]


def row_tokens(lengths: np.ndarray) -> np.ndarray:
    """Each row's cost in tokens: its history length + 1 (the row's own candidate/event)."""
    return np.asarray(lengths, dtype=np.int64) + 1


def check_budget(batch_tokens: int, max_len: int, key: str = "data.batch_tokens") -> None:
    """Raise :class:`ConfigError` unless one row of the longest history (``max_len`` events) fits ``batch_tokens``."""
    if batch_tokens < max_len + 1:
        raise ConfigError(
            f"{key}={batch_tokens} is smaller than one row of the longest history: max_len={max_len} events + 1 = "
            f"{max_len + 1} tokens. Fix: {key}={max(4 * (max_len + 1), 1024)} (a few long rows per batch), or a smaller max_len"
        )


def token_slices(costs: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Cut rows with per-row ``costs`` (in order) into consecutive ``[start, stop)`` slices of total cost ``<= budget``.

    Greedy in row order (no reordering: the reader's shuffle decides which rows go together); the last slice may
    be under-full. Raises :class:`ValueError` when one row alone exceeds the budget (callers check it first with
    :func:`check_budget`, which can name the config key).
    """
    costs = np.asarray(costs, dtype=np.int64)
    if costs.size and int(costs.max()) > budget:
        raise ValueError(f"a row costs {int(costs.max())} tokens, more than the budget {budget}")
    # one search per slice, not a Python step per row: a slice ends before the first row whose running total passes it
    total = np.concatenate([[0], np.cumsum(costs)])
    slices: list[tuple[int, int]] = []
    start = 0
    while start < len(costs):
        stop = int(np.searchsorted(total, total[start] + budget, side="right")) - 1
        slices.append((start, stop))
        start = stop
    return slices


def padded_slices(costs: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Cut rows with per-row ``costs`` (in order) into consecutive ``[start, stop)`` slices whose *padded* cost, rows ×
    the slice's largest cost, is at most ``budget``: what a batch padded to its longest row allocates.

    Meant for rows sorted by length (then padding is small and the cut wastes little); a slice's tokens are never more
    than its padded cost, so each slice also fits :func:`token_slices`' budget. Raises :class:`ValueError` when one
    row alone exceeds the budget.
    """
    costs = np.asarray(costs, dtype=np.int64)
    if costs.size and int(costs.max()) > budget:
        raise ValueError(f"a row costs {int(costs.max())} tokens, more than the budget {budget}")
    # rows × the running largest cost only grows along a slice, so the rows that fit are a prefix: found over a window
    # of rows at a time (twice the last slice's rows, doubled until the slice ends in it), not a Python step per row
    slices: list[tuple[int, int]] = []
    start, width, n = 0, 64, len(costs)
    while start < n:
        while True:
            window = costs[start : start + width]
            fits = np.arange(1, len(window) + 1) * np.maximum.accumulate(window) <= budget
            rows = len(window) if fits.all() else int(np.argmin(fits))
            if rows < len(window) or start + len(window) >= n:
                break
            width *= 2
        slices.append((start, start + rows))
        start += rows
        width = max(64, 2 * rows)
    return slices
