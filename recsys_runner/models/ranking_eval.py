"""The published ranking-eval protocols of a next-item (or two-tower) model's scores: seen items excluded, or the true
item ranked against sampled negatives.

* **exclude-seen** (:func:`without_seen`): every item a row's user already interacted with scores ``-inf``, except the
  row's true item, so the metrics rank it among the items the user has not had (the HSTU paper's and
  generative-recommenders' protocol). Row-local: the same on any number of ranks.
* **sampled negatives** (:func:`sampled_negatives`): each row's true item against ``n`` items drawn uniformly, without
  replacement, from the catalogue less the row's seen items (history and target) — the SASRec paper's 100-negative
  protocol (uniform; a popularity-sampled set is another protocol). The draw is a counter-based hash of the row's
  content (its true item and its history, in order) and a fixed seed, not of a random generator's state: the same row
  gets the same negatives in every run, in every batch and on any number of ranks, so every model is compared on the
  same candidates. A two-tower query (``train/corpus.py``) draws catalogue rows the same way, its content being its
  target and the *set* of items it has seen (:func:`distinct_seen`).

Shape legend: ``B`` rows, ``N`` items, ``L`` longest seen list of the batch, ``n`` sampled negatives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["EVAL_NEGATIVES_SEED", "distinct_seen", "sampled_negatives", "seen_ids", "without_seen"]

EVAL_NEGATIVES_SEED = 20180820
"""The seed of :func:`sampled_negatives` (fixed, so that every model and every run draws the same negatives)."""

_MASK64 = (1 << 64) - 1


def _i64(value: int) -> int:
    """The 64-bit two's-complement value of ``value`` as a signed int (torch's int64 arithmetic wraps the same way)."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


_GOLDEN, _M1, _M2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 ``x`` (wrapping): a bijection whose outputs look uniform."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def seen_ids(history: torch.Tensor, lengths: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` each row's seen item ids ``history [B, L]`` (padded, ``lengths [B]`` real) with the padding replaced by
    the row's target (``targets [B]``): a list :func:`without_seen` and :func:`sampled_negatives` read directly."""
    real = torch.arange(history.shape[1], device=history.device).unsqueeze(0) < lengths.unsqueeze(1)
    return torch.where(real, history.long(), targets.long().unsqueeze(1))


def distinct_seen(seen: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` each row's distinct ``seen [B, L]`` ids (``-1``: padding) other than its target ``targets [B]``,
    ascending, then padded with the target: the layout :func:`sampled_negatives` reads, holding the row's seen *set*. A
    two-tower query's seen items come from several features (its history features and ``data.items.seen``), so its draw
    must not depend on which feature lists an item, in what order or how often; ``(distinct_seen(...) != targets[:, None])
    .sum(1)`` counts them."""
    target = targets.long().view(-1, 1)
    drop = (seen < 0) | (seen == target)
    last = torch.iinfo(torch.long).max
    ordered = torch.where(drop, last, seen.long()).sort(dim=1).values
    repeat = torch.zeros_like(drop)
    repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    ordered = torch.where(repeat, last, ordered).sort(dim=1).values
    return torch.where(ordered == last, target, ordered)


def without_seen(scores: torch.Tensor, seen: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``scores [B, N]`` with each row's ``seen [B, L]`` item ids at ``-inf``, except its target ``targets [B]`` (kept
    as scored, also when it is among the seen items: a repeat). ``seen`` may repeat ids and hold the target; an id
    past ``N - 1`` (an OOV row, which is no candidate: ``scores`` has no column for it) masks nothing, and a target
    past it keeps nothing (it is a miss)."""
    n = scores.shape[1]
    target = targets.long().view(-1, 1)
    # an id with no column is replaced by the row's target, or by a spare last column when the target has none either
    spare = torch.where(target < n, target, n)
    masked = F.pad(scores, (0, 1))  # the one copy: masked in place
    kept = masked.gather(1, spare)
    masked.scatter_(1, torch.where(seen.long() < n, seen.long(), spare), float("-inf"))
    return masked.scatter_(1, spare, kept)[:, :n]


def _row_keys(seen: torch.Tensor, targets: torch.Tensor, seed: int) -> torch.Tensor:
    """``[B]`` int64: a hash of each row's target and seen ids in order (the row's content, not its place). Entries equal
    to the target are left out: they are :func:`seen_ids`' padding (whose width is the batch's longest history)."""
    positions = torch.arange(seen.shape[1], device=seen.device, dtype=torch.long).unsqueeze(0)
    per_event = torch.where(seen == targets.view(-1, 1), 0, _mix(seen.long() * _M1 + positions * _M2))
    return _mix(_mix(targets.long() + seed) + per_event.sum(dim=1))


def sampled_negatives(seen: torch.Tensor, targets: torch.Tensor, num_items: int, n: int,
                      seed: int = EVAL_NEGATIVES_SEED) -> torch.Tensor:
    """``[B, n]`` item ids: for each row, ``n`` distinct items of ``0 … num_items-1`` drawn uniformly among those that are
    neither its target (``targets [B]``) nor in its ``seen [B, L]`` list (:func:`seen_ids`).

    Candidates are ``hash(row key, counter) mod num_items`` for counters ``0, 1, …`` (the row key: :func:`_row_keys`),
    the first ``n`` that are unseen and new are kept: a deterministic function of the row's content and ``seed``.

    Raises:
        ValueError: some row has fewer than ``n`` unseen items (a caller's config check should refuse this first).
    """
    b = targets.shape[0]
    device = targets.device
    if b == 0 or n == 0:
        return torch.zeros((b, n), dtype=torch.long, device=device)
    excluded = torch.cat([seen.long(), targets.long().view(-1, 1)], dim=1)
    keys = _row_keys(seen, targets, seed).unsqueeze(1)
    chosen = torch.full((b, 0), -1, dtype=torch.long, device=device)
    draw = 2 * n + 16
    counter = 0
    for _ in range(64):
        counters = torch.arange(counter, counter + draw, device=device, dtype=torch.long).unsqueeze(0)
        counter += draw
        hashed = _mix(keys ^ _mix(counters))
        candidates = torch.remainder(_shr(hashed, 11), num_items)  # 53 bits mod N: bias below N / 2^53
        pool = torch.cat([chosen, candidates], dim=1)
        bad = (pool.unsqueeze(2) == excluded.unsqueeze(1)).any(dim=2) | (pool < 0)
        # a repeat of an earlier candidate of the row: a stable sort puts the first occurrence first among equals
        ordered, order = pool.sort(dim=1, stable=True)
        repeat = torch.zeros_like(bad)
        repeat.scatter_(1, order[:, 1:], ordered[:, 1:] == ordered[:, :-1])
        good = ~bad & ~repeat
        taken = good & (good.long().cumsum(dim=1) <= n)
        width = int(taken.sum(dim=1).min())
        # keep each row's first ``width`` good candidates in their draw order (a row's earlier picks stay first)
        rank = torch.where(taken, good.long().cumsum(dim=1) - 1, torch.full_like(pool, pool.shape[1]))
        kept = torch.full((b, pool.shape[1] + 1), -1, dtype=torch.long, device=device)
        kept.scatter_(1, rank, torch.where(taken, pool, torch.full_like(pool, -1)))
        if width >= n:
            return kept[:, :n]
        chosen = kept[:, : int(taken.sum(dim=1).max())]
    raise ValueError(f"fewer than {n} items of {num_items} are unseen by some eval row: it cannot be ranked against {n} "
                     f"sampled negatives. Fix: a smaller model.eval_negatives")
