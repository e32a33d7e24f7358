"""A block of encoded rows (:class:`Rows`): NumPy arrays of labels, dense features and each sparse key's values and lengths
(and weights), and what batching does with a block — join blocks, cut a slice, gather rows (a shuffle, the bad rows
dropped), the weights of every value as the batch's ``KeyedJaggedTensor`` holds them.

Apart from the row encoder (:mod:`~recsys_runner.data.encoding.rows`), which makes blocks, because what reads them —
the shard streams' shuffle buffers and batches, predict, the served model — works on blocks without encoding anything.

**Standalone on purpose**, like :mod:`~recsys_runner.data.encoding.rows`: NumPy only, and copied into the MLflow model's
``code/`` (:data:`~recsys_runner.data.encoding.served.SHIPPED`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Rows:
    """A block of encoded rows: ``labels [n]`` (or ``[n, T]``, several labels), ``dense [n, N]`` and per key of the batch's
    ``KeyedJaggedTensor`` (each sparse feature, then each history's event times) its (values, lengths); with a weighted
    feature, ``weights``: per key the float32 weight of each of its values (``None`` for the keys without weights)."""

    labels: np.ndarray
    dense: np.ndarray
    sparse: list[tuple[np.ndarray, np.ndarray]]
    weights: list[np.ndarray | None] | None = None
    """``None``: no key is weighted (the batch's ``KeyedJaggedTensor`` carries no weights)."""
    _offsets: list[np.ndarray | None] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        if len(parts) == 1:
            return parts[0]
        weights = None
        if parts[0].weights is not None:
            weights = [None if w is None else np.concatenate([_weights_of(p, j) for p in parts])
                       for j, w in enumerate(parts[0].weights)]
        return Rows(
            np.concatenate([p.labels for p in parts]),
            np.concatenate([p.dense for p in parts]),
            [(np.concatenate([p.sparse[j][0] for p in parts]), np.concatenate([p.sparse[j][1] for p in parts]))
             for j in range(len(parts[0].sparse))],
            weights,
        )

    def offsets(self) -> list[np.ndarray | None]:
        """Per feature: start offsets ``[n+1]`` of each row's values; ``None`` when every row has one value."""
        if self._offsets is None:
            self._offsets = [
                None if values.shape[0] == lengths.shape[0] and bool((lengths == 1).all())
                else np.concatenate([[0], np.cumsum(lengths)])
                for values, lengths in self.sparse
            ]
        return self._offsets

    def slice(self, start: int, stop: int) -> Rows:
        sparse, weights = [], []
        for j, ((values, lengths), offsets) in enumerate(zip(self.sparse, self.offsets(), strict=True)):
            lo, hi = (start, stop) if offsets is None else (int(offsets[start]), int(offsets[stop]))
            sparse.append((values[lo:hi], lengths[start:stop]))
            w = self.weights[j] if self.weights is not None else None
            weights.append(None if w is None else w[lo:hi])
        return Rows(self.labels[start:stop], self.dense[start:stop], sparse, weights if self.weights is not None else None)

    def take(self, index: np.ndarray) -> Rows:
        sparse, weights = [], []
        for j, ((values, lengths), offsets) in enumerate(zip(self.sparse, self.offsets(), strict=True)):
            new_lengths = lengths[index]
            if offsets is None:
                gather = index
            elif int(lengths.max(initial=0)) <= 1:  # single-valued with some missing: each present row's one value
                gather = (np.cumsum(lengths) - 1)[index][new_lengths.astype(bool)]
            else:
                starts = offsets[:-1][index]
                new_starts = np.concatenate([[0], np.cumsum(new_lengths)])[:-1]
                gather = np.arange(int(new_lengths.sum())) + np.repeat(starts - new_starts, new_lengths)
            sparse.append((values[gather], new_lengths))
            w = self.weights[j] if self.weights is not None else None
            weights.append(None if w is None else w[gather])
        return Rows(self.labels[index], self.dense[index], sparse, weights if self.weights is not None else None)

    def key_weights(self) -> np.ndarray | None:
        """The weights of every value, key after key as in the batch's ``KeyedJaggedTensor`` (1.0 for the values of a key
        without weights), or ``None`` when no key is weighted."""
        if self.weights is None:
            return None
        return np.concatenate([np.ones(len(values), np.float32) if w is None else w.astype(np.float32, copy=False)
                               for (values, _), w in zip(self.sparse, self.weights, strict=True)] or [np.zeros(0, np.float32)])


def _weights_of(rows: Rows, key: int) -> np.ndarray:
    """The weights of key ``key`` of ``rows`` (ones where that block carries none)."""
    w = rows.weights[key] if rows.weights is not None else None
    return np.ones(len(rows.sparse[key][0]), np.float32) if w is None else w
