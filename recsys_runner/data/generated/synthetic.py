"""Deterministic, Criteo-shaped synthetic click data whose labels truly depend on the features.

A hidden "world" (per-id effects for each categorical feature, weights for the dense features and
one dense×sparse interaction: :mod:`recsys_runner.data.generated.synthetic_world`) is drawn once from ``seed``; each
row's click probability is the sigmoid of its score, and its label is a Bernoulli draw. A model that learns the world reaches an
AUC far above 0.5 (about 0.8 with the defaults); one that learns nothing stays at 0.5.

With ``tasks=[ctr, cvr, …]`` a batch carries one label per task (``labels [B, T]``), a conversion
funnel like Taobao's: the first task is the click drawn as above; each later task has a hidden world
of its own and is only ever positive on a clicked row (``label_t = click · Bernoulli(p_t)``); a
``regression`` task's label is an amount on every row, ``softplus(score_t)``. With ``user_item_clusters=K`` the id
of each item feature (``cat_1``) lies in the cluster ``id mod K`` of the user feature (``cat_0``): a
two-tower model can learn which items go with which users.

The data serves whichever model it is given (:meth:`~recsys_runner.data.generated.synthetic_config.SyntheticDataConfig.for_model`): the fields
left ``null`` follow the model's declared needs, so a multi-task model gets one label per task and
a two-tower model gets (user, item) pairs linked through its towers' features.

Every batch is generated from ``(seed, split, batch index)`` alone, so any rank can produce any
batch without reading the others, training is reproducible, and nothing is written to disk. With
``num_workers`` (``auto``: on CUDA) DataLoader worker processes generate a rank's batches off the
training thread, worker ``w`` of ``W`` the ``w``-th, ``(w+W)``-th … of them, which the DataLoader
interleaves back in order: the batches are exactly those of the in-process path, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchrec.datasets.utils import Batch

from recsys_runner.data.base import DataModule, batch_kjt
from recsys_runner.data.catalogue.items import ItemTable
from recsys_runner.data.catalogue.negatives import MinedNegatives, NegativeSampler
from recsys_runner.data.collision import spread_ids
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig, sparse_names
from recsys_runner.data.generated.synthetic_items import (
    HARD_COLUMN,
    generated_item_table,
    hard_negative_ids,
    item_lookups,
    pair_popularity,
)
from recsys_runner.data.generated.synthetic_labels import TaskLabels
from recsys_runner.data.generated.synthetic_world import World
from recsys_runner.data.packed import Packed, packed_stream, unpacked_stream
from recsys_runner.data.workers import worker_loader
from recsys_runner.errors import require
from recsys_runner.features import FeatureSpec, SparseFeature

_TRAIN, _EVAL = 0, 1


class SyntheticData(DataModule):
    """Criteo-shaped click data generated on the fly; see the module docstring.

    Example::

        data = make(SyntheticDataConfig, batch_size=4, num_dense=2, num_sparse=3, num_embeddings=10).build()
        batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        batch.dense_features.shape   # (4, 2)
        batch.sparse_features.keys() # ['cat_0', 'cat_1', 'cat_2']
    """

    def __init__(self, config: SyntheticDataConfig) -> None:
        c = self.config = config.resolved()  # built by DataConfig.build, already; constructed directly, decided here
        require(c.batch_tokens is None, c.no_histories())
        assert isinstance(c.num_workers, int)
        self._workers = c.num_workers
        self._pin = bool(c.pin_memory)
        slots = list(c.num_embeddings_per_feature or [c.num_embeddings] * c.num_sparse)
        mc, names = c.managed_collision, sparse_names(c.num_sparse)
        sizes = mc.check_features(names, slots) if mc is not None else slots  # ids drawn per column: a managed one's raw ids
        managed = {n: mc.spec() for n in mc.features} if mc is not None else {}
        self._raw = [(j, sizes[j], managed[n].input_hash_size) for j, n in enumerate(names) if n in managed]
        """``(column, distinct ids, input_hash_size)`` of each managed column: its ids are spread over that raw id space."""
        sparse = tuple(SparseFeature(n, k, managed_collision=managed.get(n)) for n, k in zip(names, slots, strict=True))
        self._hard = c.hard_negatives
        if self._hard:
            item = sparse[names.index((c.item_features or ["cat_1"])[0])]
            require(c.user_item_clusters is not None and item.managed_collision is None
                    and item.num_embeddings >= 2 * c.user_item_clusters,
                    f"data.hard_negatives={self._hard} lists other items of the user's cluster per (user, item) pair; the data "
                    f"has no pairs, a managed-collision item column, or fewer than 2 items per cluster. Fix: "
                    f"data=synthetic_retrieval (or model=dssm) with data.num_embeddings >= 2 · clusters, or data.hard_negatives=0")
            sparse = (*sparse, SparseFeature(HARD_COLUMN, item.num_embeddings, table=item.table_name))
        self.features = FeatureSpec(
            dense_names=tuple(f"int_{i}" for i in range(c.num_dense)),
            sparse=sparse,
            label=c.label_columns(),
            label_kinds=c.label_column_kinds(),
        )
        self.batch_size = c.batch_size
        self._num_train_batches = c.num_train_rows // c.batch_size
        self._num_eval_batches = c.num_eval_rows // c.batch_size
        self._sizes = torch.tensor(sizes, dtype=torch.float64)
        self._id_skew = c.id_skew
        self._seed = c.seed
        self._world = World.draw(c.seed, c.num_dense, sizes, c.label_noise)
        self._conversions = [World.draw(c.seed * 1000 + t, c.num_dense, sizes, c.label_noise, bias=c.conversion_bias)
                             for t in range(1, len(c.tasks or []))]
        """The later tasks' worlds: their own seeds, a higher base rate (conversion given a click)."""
        self._task_labels: TaskLabels = c.task_labels()
        self._selection_bias = c.selection_bias
        self._clusters = c.user_item_clusters
        if c.user_item_clusters is not None:
            names = self.features.sparse_names
            self._user = names.index(c.user_feature or "cat_0")
            self._items = [names.index(n) for n in c.item_features or ["cat_1"]]
        self._catalogue, self._sampler = self._open_catalogue(c, sizes)

    def _open_catalogue(self, c: SyntheticDataConfig, sizes: list[int]) -> tuple[ItemTable | None, NegativeSampler | None]:
        """The generated item table of the (user, item) pairs (none without pairs) and, with ``data.negatives``, its sampler;
        the item columns after the first become functions of the item id (``self._lookups``) so that the catalogue is real."""
        self._lookups: list[torch.Tensor] = []
        table = None
        if self._clusters is not None:
            first, others = self._items[0], self._items[1:]
            lookups = item_lookups(sizes[first], [sizes[j] for j in others], self._clusters, c.seed)
            self._lookups = [torch.from_numpy(v) for v in lookups]
            names = [self.features.sparse_names[j] for j in self._items]
            popularity = pair_popularity(sizes[first], sizes[self._user], self._clusters, c.id_skew)
            table = generated_item_table(names, lookups, popularity, self._as_generated)
        # generated data has one hard-negative column, which data.hard_negatives turns on
        column = "" if c.negatives.hard_column == HARD_COLUMN else f" data.negatives.hard_column={HARD_COLUMN}"
        hard_fix = (f"data.negatives.hard_column={HARD_COLUMN}, the list column data.hard_negatives={c.hard_negatives} generates"
                    if c.hard_negatives else f"data.hard_negatives=8{column} (the generated data then lists 8 hard negative items per "
                    f"row in {HARD_COLUMN}), or data.negatives.hard_column=null")
        c.negatives.check(table, self.features, "the generated data has no (user, item) pairs. Fix: data=synthetic_retrieval, or a "
                                                "two-tower model (model=dssm), or data.user_item_clusters=<K>", hard_fix)
        if table is None or not c.negatives.enabled:
            return table, None
        sampler = NegativeSampler(c.negatives, table, self.features, c.seed)
        self.features = sampler.features(self.features)
        return table, sampler

    def _as_generated(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Column ``name``'s ids as batches carry them (a managed-collision column's spread over its raw id space)."""
        j = self.features.sparse_names.index(name)
        for column, *spread in self._raw:
            if column == j:
                return spread_ids(torch.from_numpy(ids), *spread).numpy()
        return ids

    def item_table(self) -> ItemTable | None:
        return self._catalogue

    def negative_miner(self) -> MinedNegatives | None:
        """The lists hard negatives are mined into at each full-corpus eval (``data.negatives.mined_ratio``), or ``None``."""
        return self._sampler.mined if self._sampler is not None else None

    def num_train_batches(self, world_size: int) -> int:
        return self._num_train_batches // world_size

    def train_batches(self, epoch: int, rank: int, world_size: int) -> Iterator[Batch]:
        # A seeded permutation per epoch shuffles batch order; ranks take strided, disjoint slices
        # and equally many batches (the remainder is dropped) so that no rank waits on another.
        order = torch.randperm(self._num_train_batches, generator=torch.Generator().manual_seed(self._seed * 7919 + epoch))
        mine = order[rank :: world_size][: self.num_train_batches(world_size)]
        return self._batches(_TRAIN, [int(i) for i in mine])

    def eval_batches(self, rank: int, world_size: int) -> Iterator[Batch]:
        # Every eval batch on some rank, whatever the world size (the evaluator keeps a rank with one fewer in step), so
        # that the eval metrics do not depend on the number of ranks.
        return self._batches(_EVAL, list(range(rank, self._num_eval_batches, world_size)))

    def _batches(self, split: int, indices: list[int]) -> Iterator[Batch]:
        """Batches ``indices`` of ``split``, in that order: generated here, or with workers by DataLoader worker processes."""
        if self._workers == 0:
            for index in indices:
                tensors = self._tensors(split, index)
                yield self._assemble(tuple(t.pin_memory() for t in tensors) if self._pin else tensors)
            return
        # Never more workers than batches: the DataLoader's round robin then hands worker w exactly the
        # batches i ≡ w (mod workers) that _Stream gives it, in order.
        loader = worker_loader(_Stream(self, split, indices), num_workers=min(self._workers, max(len(indices), 1)),
                               pin_memory=self._pin, method=self.config.worker_start)
        for tensors in unpacked_stream(loader):
            yield self._assemble(tensors)

    def batch(self, split: int, index: int) -> Batch:
        """Generate batch ``index`` of ``split`` (0 train, 1 eval); pure function of the seed."""
        return self._assemble(self._tensors(split, index))

    def _assemble(self, tensors: tuple[torch.Tensor, ...]) -> Batch:
        dense, values, lengths, labels = tensors
        kjt = batch_kjt(self.features.sparse_names, values, lengths)
        return Batch(dense_features=dense, sparse_features=kjt, labels=labels)

    def _tensors(self, split: int, index: int) -> tuple[torch.Tensor, ...]:
        """Batch ``index`` of ``split`` as ``(dense, values, lengths, labels)``, which cross a worker process boundary packed
        into one buffer (:mod:`recsys_runner.data.packed`)."""
        g = torch.Generator().manual_seed(hash((self._seed, split, index)) & 0x7FFF_FFFF_FFFF_FFFF)
        n, f = self.batch_size, len(self._sizes)
        u = torch.rand(n, f, generator=g, dtype=torch.float64)
        ids = (self._sizes * u.pow(self._id_skew)).long().clamp_max_(self._sizes.long() - 1)
        if self._clusters is not None:
            k = self._clusters
            first = self._items[0]
            moved = ids[:, first] - ids[:, first] % k + ids[:, self._user] % k
            ids[:, first] = torch.where(moved < int(self._sizes[first]), moved, (moved - k).clamp_min(0))
            for j, lookup in zip(self._items[1:], self._lookups, strict=True):
                ids[:, j] = lookup[ids[:, first]]  # the item's own value: one catalogue row per item id
        dense = torch.randn(n, self.features.num_dense, generator=g)
        score = self._world.score(dense, ids)
        if self._selection_bias:  # the click selects on what makes the row convert (the first conversion's own score)
            score = score + self._selection_bias * self._conversions[0].score(dense, ids)
        labels = torch.bernoulli(torch.sigmoid(score), generator=g)
        if self.features.multi_label:
            own = [world.score(dense, ids) for world in self._conversions]
            labels = torch.stack(self._task_labels.labels(labels, score, own, g), dim=1)
        if self._hard:  # drawn last, so the other columns are the same with and without the list
            first = self._items[0]
            hard = hard_negative_ids(ids[:, first], ids[:, self._user], self._hard, int(self._sizes[first]), self._clusters or 1,
                                     self._id_skew, g)
        for j, distinct, space in self._raw:
            ids[:, j] = spread_ids(ids[:, j], distinct, space)
        tensors = (dense, ids.t().reshape(-1), torch.ones(n * f, dtype=torch.int32), labels)
        if self._hard:
            tensors = (dense, torch.cat([tensors[1], hard.reshape(-1)]),
                       torch.cat([tensors[2], torch.full((n,), self._hard, dtype=torch.int32)]), labels)
        return self._sampler.extend(tensors, (index,)) if self._sampler is not None and split == _TRAIN else tensors


class _Stream(IterableDataset):
    """Batches ``indices`` of a split as tensors; in DataLoader worker ``w`` of ``W``, the share ``indices[w::W]``."""

    def __init__(self, data: SyntheticData, split: int, indices: list[int]) -> None:
        super().__init__()
        self.data, self.split, self.indices = data, split, indices

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...] | Packed]:
        info = get_worker_info()
        if info is None:
            return (self.data._tensors(self.split, i) for i in self.indices)
        # each batch crosses to the training process as one buffer (data/packed.py says why)
        return packed_stream(self.data._tensors(self.split, i) for i in self.indices[info.id :: info.num_workers])
