"""Which rows of an epoch's files are whose: the hash eval split of shared files (:func:`split_key`, :func:`eval_mask`),
a split's units with the rows of each that belong to it (:class:`Split`), and each (rank, worker) shard's contiguous
share of them (:func:`shard_ranges`).

Apart from the streaming data module (:mod:`recsys_runner.data.files.streaming`) because these are pure functions of row
counts, file names and row numbers: every rank computes the same split and its own share without talking to the others,
and the runs' dataset records (:mod:`recsys_runner.tracking.datasets`) name a split by the same keys.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from recsys_runner.data.encoding.keys import splitmix64
from recsys_runner.data.files.compression import plain_name
from recsys_runner.data.files.sources import Unit


def split_key(path: str) -> str:
    """What the hash eval split keys a file's rows by, with their row numbers: its name without a compression's suffix, so
    that a file holds out the same rows compressed or not. Not its folder (moving the files keeps the split); its format
    suffix stays (``a.csv`` and its conversion ``a.parquet`` hold out different rows), as it always has, so that no
    existing run's split moves: the runs record these keys instead, and an evaluate or resume on files keyed otherwise
    warns (:func:`~recsys_runner.tracking.datasets.note_split_changes`)."""
    return plain_name(path)


def eval_mask(path: str, file_rows: np.ndarray, fraction: float) -> np.ndarray:
    """Rows held out for eval: a hash of (:func:`split_key`, row number) below ``fraction`` (stable everywhere)."""
    file_id = np.uint64(zlib.crc32(split_key(path).encode()))
    h = splitmix64(file_rows.astype(np.uint64) ^ (file_id << np.uint64(32)))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) < fraction


@dataclass
class Split:
    """The units of one split and how many of each unit's rows belong to it."""

    source: Any
    units: list[Unit]
    counts: list[int]
    holdout: tuple[float, bool] | None = None
    """``(fraction, want_eval)`` for a hash split of shared files; ``None``: every row."""

    def select(self, unit: Unit, file_rows: np.ndarray) -> np.ndarray | None:
        if self.holdout is None:
            return None
        fraction, want_eval = self.holdout
        mask = eval_mask(unit.path, file_rows, fraction)
        return np.flatnonzero(mask if want_eval else ~mask)


def shard_ranges(counts: list[int], order: list[int], shard: int, num_shards: int, equal: bool) -> list[tuple[int, int, int]]:
    """``(unit, start, stop)`` row ranges of ``shard``: a contiguous share of the rows in ``order``.

    ``equal``: every shard gets ``total // num_shards`` rows (the rest is left out); otherwise shards
    differ by at most one row and together cover every row.
    """
    total = sum(counts[u] for u in order)
    if equal:
        per = total // num_shards
        lo, hi = shard * per, (shard + 1) * per
    else:
        lo, hi = shard * total // num_shards, (shard + 1) * total // num_shards
    out, offset = [], 0
    for u in order:
        n = counts[u]
        a, b = max(lo - offset, 0), min(hi - offset, n)
        if a < b:
            out.append((u, a, b))
        offset += n
        if offset >= hi:
            break
    return out
