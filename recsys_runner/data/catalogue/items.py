"""The item catalogue of a retrieval model: every item once, with the item tower's features, encoded as training rows are.

Two-tower training samples negatives from it and full-corpus evaluation scores every query against all of it, so
both read one :class:`ItemTable`: row ``i`` is one item, its features encoded exactly as the training data encodes
the same columns (the same table ids), its popularity the weight a popularity sampler and the logQ correction use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["ItemTable"]


@dataclass(frozen=True)
class ItemTable:
    """``N`` items: ``ids [N]`` (the item id feature's encoded ids, distinct), per item sparse feature
    ``(values, lengths [N])`` row-aligned with ``ids``, ``dense [N, n]`` item dense columns (``dense_names``), and
    ``popularity [N]`` (float64 weights >= 0: how often each item occurs in the training data, or 1 for none known),
    and ``seen_feature``: the data's list column of each row's earlier item ids (``data.items.seen``), or ``None``.
    """

    id_feature: str
    ids: np.ndarray
    features: dict[str, tuple[np.ndarray, np.ndarray]]
    dense_names: tuple[str, ...]
    dense: np.ndarray
    popularity: np.ndarray
    seen_feature: str | None = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @cached_property
    def _sorted(self) -> tuple[np.ndarray, np.ndarray]:
        """``ids`` sorted, and the row of each sorted id: built once, for :meth:`index_of`."""
        order = np.argsort(self.ids, kind="stable")
        return self.ids[order], order

    def index_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The table row of each encoded item id of ``ids`` and whether it is in the table at all (``(rows, found)``; a row
        where ``found`` is false is meaningless). Hard negatives and the eval check map batch ids to items with it."""
        ids = np.asarray(ids, dtype=np.int64)
        keys, order = self._sorted
        if keys.size == 0:
            return np.zeros(ids.shape, np.int64), np.zeros(ids.shape, bool)
        at = np.minimum(np.searchsorted(keys, ids), keys.size - 1)
        return order[at].astype(np.int64), keys[at] == ids

    def take(self, index: np.ndarray) -> ItemTable:
        """The table of items ``index`` only, in that order (e.g. one row per distinct id)."""
        index = np.asarray(index, dtype=np.int64)
        features = {name: _gather(values, lengths, index) for name, (values, lengths) in self.features.items()}
        return ItemTable(self.id_feature, self.ids[index], features, self.dense_names, self.dense[index], self.popularity[index],
                         self.seen_feature)

    def rows(self, index: np.ndarray, keys: list[str], dense_names: tuple[str, ...]) -> tuple[torch.Tensor, KeyedJaggedTensor]:
        """Items ``index`` as batch rows ``(dense [k, len(dense_names)], KJT with ``keys``)``: each item feature's ids, the
        item's dense columns in their places; every other key empty and every other dense column 0 (the user side of a
        catalogue row is absent)."""
        index = np.asarray(index, dtype=np.int64)
        k = index.shape[0]
        values, lengths = [], []
        for key in keys:
            if key not in self.features:
                values.append(np.zeros(0, np.int64))
                lengths.append(np.zeros(k, np.int32))
                continue
            v, chosen = _gather(*self.features[key], index)
            values.append(v.astype(np.int64, copy=False))
            lengths.append(chosen.astype(np.int32, copy=False))
        dense = np.zeros((k, len(dense_names)), np.float32)
        for j, name in enumerate(dense_names):
            if name in self.dense_names:
                dense[:, j] = self.dense[index, self.dense_names.index(name)]
        kjt = KeyedJaggedTensor(keys=keys, values=torch.from_numpy(np.concatenate(values)),
                                lengths=torch.from_numpy(np.concatenate(lengths)))
        return torch.from_numpy(dense), kjt


def _gather(values: np.ndarray, lengths: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ``(values, lengths)`` of rows ``index`` of a jagged column (one vectorized gather, any row lengths)."""
    starts = np.concatenate([[0], np.cumsum(lengths)])[:-1]
    chosen = lengths[index]
    gather = np.repeat(starts[index], chosen) + (np.arange(int(chosen.sum())) - np.repeat(np.cumsum(chosen) - chosen, chosen))
    return values[gather], chosen
