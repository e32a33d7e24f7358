"""The item catalogue of generated (user, item) pairs (``data=synthetic_retrieval``, or ``data=synthetic`` for a two-tower model).

The pairs draw an item id ``i`` of the first item column skewed towards small ids (``floor(n · u**id_skew)``), moved into
the user's cluster ``user mod K``; every other item column is a fixed function of ``i`` (:func:`item_lookups`: a
category, say, that keeps the cluster ``i mod K``), so an item is one row of a real catalogue, the same wherever it
occurs, and the pairs stay learnable. The catalogue is every id of the first item column, its popularity the exact
chance that a generated row carries that item (:func:`pair_popularity`): Zipf-like, ``p(rank) ∝ rank ** (1/id_skew − 1)``
within a cluster, heavier-headed as ``id_skew`` grows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from recsys_runner.data.catalogue.items import ItemTable

__all__ = ["HARD_COLUMN", "generated_item_table", "hard_negative_ids", "item_lookups", "pair_popularity"]

HARD_COLUMN = "hard_items"
"""The list column of per-row hard negative item ids that ``data.hard_negatives`` adds."""


def _base_probabilities(size: int, id_skew: float) -> np.ndarray:
    """``P(floor(size · u**id_skew) = b)`` for ``b < size``, ``u`` uniform: the generator's skewed id draw."""
    edges = (np.arange(size + 1, dtype=np.float64) / size) ** (1.0 / id_skew)
    return np.diff(edges)


def pair_popularity(item_size: int, user_size: int, clusters: int, id_skew: float) -> np.ndarray:
    """Each item id's chance in one generated row: its base id's block (``b − b mod K``) drawn with the skew, the user's
    cluster ``c`` with the user column's skew, the item ``block + c`` (moved down by ``K`` past the table's end)."""
    k = clusters
    base = _base_probabilities(item_size, id_skew)
    user = _base_probabilities(user_size, id_skew)
    cluster = np.bincount(np.arange(user_size) % k, weights=user, minlength=k)[:k]
    blocks = np.arange(0, item_size, k)
    block_mass = np.add.reduceat(base, blocks)
    moved = (blocks[:, None] + np.arange(k)[None, :]).reshape(-1)
    moved = np.where(moved < item_size, moved, np.maximum(moved - k, 0))
    return np.bincount(moved, weights=(block_mass[:, None] * cluster[None, :]).reshape(-1), minlength=item_size)


def item_lookups(item_size: int, sizes: list[int], clusters: int, seed: int) -> list[np.ndarray]:
    """Per other item column (of table size ``sizes[j]``): the value of each item id ``i``, a seeded function of the item's
    block ``i // K`` that keeps its cluster ``i mod K`` (a category shared by the items of a few blocks)."""
    i = np.arange(item_size, dtype=np.int64)
    lookups = []
    for j, size in enumerate(sizes):
        if size < clusters:  # too small to keep clusters: the column is still a function of the item
            lookups.append(i % size)
            continue
        rng = np.random.default_rng([seed & 0xFFFF_FFFF, 0x17E5, j])
        groups = rng.integers(0, size // clusters, -(-item_size // clusters))
        value = groups[i // clusters] * clusters + i % clusters
        lookups.append(np.where(value < size, value, np.maximum(value - clusters, 0)))
    return lookups


def generated_item_table(names: list[str], lookups: list[np.ndarray], popularity: np.ndarray,
                         as_generated: Callable[[str, np.ndarray], np.ndarray] | None = None) -> ItemTable:
    """The catalogue: item ``i`` has id ``i`` in column ``names[0]`` and ``lookups[j][i]`` in ``names[j + 1]``, each column's
    ids passed through ``as_generated(name, ids)`` (what the generator does to a column last, e.g. spreading a
    managed-collision column's ids over its raw id space), so that the table holds the ids the batches carry."""
    ids = np.arange(popularity.shape[0], dtype=np.int64)
    features = {}
    for name, values in zip(names, [ids, *lookups], strict=True):
        features[name] = (as_generated(name, values) if as_generated else values, np.ones(ids.shape[0], np.int32))
    return ItemTable(names[0], features[names[0]][0], features, (), np.zeros((ids.shape[0], 0), np.float32), popularity)


def hard_negative_ids(positives: torch.Tensor, users: torch.Tensor, count: int, item_size: int, clusters: int, id_skew: float,
                      g: torch.Generator) -> torch.Tensor:
    """``[B, count]`` hard negatives per row: items drawn as the row's positive was (a skewed base id moved into the user's
    cluster ``users mod clusters``), so each is one the user's cluster plausibly shows, popular ones more often; a draw
    equal to the row's positive moves to the cluster's next item (or its first). ``item_size >= 2 · clusters`` keeps that
    item another one."""
    base = (item_size * torch.rand(positives.shape[0], count, generator=g, dtype=torch.float64).pow(id_skew)).long()
    base = base.clamp_max(item_size - 1)
    moved = base - base % clusters + (users % clusters).view(-1, 1)
    moved = torch.where(moved < item_size, moved, (moved - clusters).clamp_min(0))
    after = torch.where(moved + clusters < item_size, moved + clusters, moved % clusters)
    return torch.where(moved == positives.view(-1, 1), after, moved)
