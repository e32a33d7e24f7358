"""Deterministic, Criteo-shaped synthetic click data whose labels truly depend on the features.

A hidden "world" (per-id effects for each categorical feature, weights for the dense features and
one dense×sparse interaction) is drawn once from ``seed``; each row's click probability is the
sigmoid of its score, and its label is a Bernoulli draw. A model that learns the world reaches an
AUC far above 0.5 (about 0.8 with the defaults); one that learns nothing stays at 0.5.

With ``tasks=[ctr, cvr, …]`` a batch carries one label per task (``labels [B, T]``), a conversion
funnel like Taobao's: the first task is the click drawn as above; each later task has a hidden world
of its own and is only ever positive on a clicked row (``label_t = click · Bernoulli(p_t)``). With
``user_item_clusters=K`` the id of ``cat_1`` (the "item") lies in the cluster ``id mod K`` of
``cat_0`` (the "user"): a two-tower model can learn which items go with which users.

Every batch is generated from ``(seed, split, batch index)`` alone, so any rank can produce any
batch without reading the others, training is reproducible, and nothing is written to disk.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import require
from recsys_runner.features import FeatureSpec, SparseFeature

_TRAIN, _EVAL = 0, 1


@dataclass(kw_only=True)
class SyntheticDataConfig:
    """Schema of ``conf/data/synthetic.yaml``."""

    _target_: str = "recsys_runner.data.synthetic.SyntheticData"
    batch_size: int = 512
    """Rows per batch *per rank* (the global batch is ``batch_size × world_size``)."""
    num_dense: int = 13
    """Dense (float) columns, ``int_0 …``; Criteo has 13."""
    num_sparse: int = 26
    """Single-id categorical columns, ``cat_0 …``; Criteo has 26."""
    num_embeddings: int = 10_000
    """Id-space size of every categorical column (the embedding table's row count)."""
    num_embeddings_per_feature: list[int] | None = None
    """Per-column id-space sizes; overrides ``num_embeddings`` when set (length ``num_sparse``)."""
    num_train_rows: int = 1_048_576
    """Rows in one training epoch (all ranks together)."""
    num_eval_rows: int = 65_536
    """Rows in the evaluation split (all ranks together)."""
    id_skew: float = 3.0
    """Popularity skew of ids: ``id = floor(n · u**id_skew)``; 1.0 is uniform, larger is heavier-headed."""
    seed: int = 0
    """Seed of the hidden world and of every batch; equal seeds give identical data."""
    label_noise: float = 1.0
    """Scale of the click score; smaller means noisier labels and a lower attainable AUC."""
    tasks: list[str] | None = None
    """Task names, one label each (``labels [B, T]``): the first is the click, each later one a
    conversion observed only on clicked rows, e.g. ``[ctr, cvr]``. ``null``: one click label ``[B]``."""
    user_item_clusters: int | None = None
    """``K``: draw ``cat_1``'s id in ``cat_0``'s cluster (``id mod K``), so user/item pairs are learnable
    for retrieval (DSSM). ``null``: independent columns."""

    def __post_init__(self) -> None:
        if self.tasks is not None:
            require(len(self.tasks) > 0 and len(set(self.tasks)) == len(self.tasks),
                    f"data.tasks={self.tasks} must list distinct task names, e.g. data.tasks=[ctr,cvr], or be null")
        if self.user_item_clusters is not None:
            require(self.user_item_clusters > 0, f"data.user_item_clusters must be positive or null, got {self.user_item_clusters}")
            require(self.num_sparse >= 2, "data.user_item_clusters needs data.num_sparse >= 2 (cat_0 is the user, cat_1 the item)")
        require(self.batch_size > 0, f"data.batch_size must be positive, got {self.batch_size}. Fix: data.batch_size=512")
        require(self.num_dense >= 0, f"data.num_dense must be >= 0, got {self.num_dense}")
        require(self.num_sparse > 0, f"data.num_sparse must be positive, got {self.num_sparse}: the models need at least one embedding table")
        require(self.num_embeddings > 0, f"data.num_embeddings must be positive, got {self.num_embeddings}")
        if self.num_embeddings_per_feature is not None:
            require(
                len(self.num_embeddings_per_feature) == self.num_sparse,
                f"data.num_embeddings_per_feature has {len(self.num_embeddings_per_feature)} entries "
                f"but data.num_sparse={self.num_sparse}; give one size per categorical column",
            )
            require(all(n > 0 for n in self.num_embeddings_per_feature), "data.num_embeddings_per_feature entries must be positive")
        require(
            self.num_train_rows >= self.batch_size,
            f"data.num_train_rows={self.num_train_rows} is smaller than one batch (data.batch_size={self.batch_size})",
        )
        require(
            self.num_eval_rows >= self.batch_size,
            f"data.num_eval_rows={self.num_eval_rows} is smaller than one batch (data.batch_size={self.batch_size})",
        )
        require(self.id_skew > 0, f"data.id_skew must be positive, got {self.id_skew}")


class SyntheticData:
    """Criteo-shaped click data generated on the fly; see the module docstring.

    Example::

        data = SyntheticData(batch_size=4, num_dense=2, num_sparse=3, num_embeddings=10)
        batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        batch.dense_features.shape   # (4, 2)
        batch.sparse_features.keys() # ['cat_0', 'cat_1', 'cat_2']
    """

    def __init__(
        self,
        *,
        batch_size: int = 512,
        num_dense: int = 13,
        num_sparse: int = 26,
        num_embeddings: int = 10_000,
        num_embeddings_per_feature: list[int] | None = None,
        num_train_rows: int = 1_048_576,
        num_eval_rows: int = 65_536,
        id_skew: float = 3.0,
        seed: int = 0,
        label_noise: float = 1.0,
        tasks: list[str] | None = None,
        user_item_clusters: int | None = None,
    ) -> None:
        sizes = list(num_embeddings_per_feature or [num_embeddings] * num_sparse)
        self.features = FeatureSpec(
            dense_names=tuple(f"int_{i}" for i in range(num_dense)),
            sparse=tuple(SparseFeature(f"cat_{i}", n) for i, n in enumerate(sizes)),
            label=tuple(tasks) if tasks is not None else "label",
        )
        self.batch_size = batch_size
        self._num_train_batches = num_train_rows // batch_size
        self._num_eval_batches = num_eval_rows // batch_size
        self._sizes = torch.tensor(sizes, dtype=torch.float64)
        self._id_skew = id_skew
        self._seed = seed
        self._world = _World.draw(seed, num_dense, sizes, label_noise)
        # Later tasks' worlds: their own seeds, a higher base rate (conversion given a click).
        self._task_worlds = [
            _World.draw(seed * 1000 + t, num_dense, sizes, label_noise, bias=0.0) for t in range(1, len(tasks or []))
        ]
        self._clusters = user_item_clusters

    def num_train_batches(self, world_size: int) -> int:
        return self._num_train_batches // world_size

    def train_batches(self, epoch: int, rank: int, world_size: int) -> Iterator[Batch]:
        # A seeded permutation per epoch shuffles batch order; ranks take strided, disjoint slices
        # and equally many batches (the remainder is dropped) so that no rank waits on another.
        order = torch.randperm(self._num_train_batches, generator=torch.Generator().manual_seed(self._seed * 7919 + epoch))
        mine = order[rank :: world_size][: self.num_train_batches(world_size)]
        return (self.batch(_TRAIN, int(i)) for i in mine)

    def eval_batches(self, rank: int, world_size: int) -> Iterator[Batch]:
        per_rank = self._num_eval_batches // world_size
        return (self.batch(_EVAL, i) for i in range(rank, per_rank * world_size, world_size))

    def batch(self, split: int, index: int) -> Batch:
        """Generate batch ``index`` of ``split`` (0 train, 1 eval); pure function of the seed."""
        g = torch.Generator().manual_seed(hash((self._seed, split, index)) & 0x7FFF_FFFF_FFFF_FFFF)
        n, f = self.batch_size, len(self._sizes)
        u = torch.rand(n, f, generator=g, dtype=torch.float64)
        ids = (self._sizes * u.pow(self._id_skew)).long().clamp_max_(self._sizes.long() - 1)
        if self._clusters is not None:
            k, items = self._clusters, ids[:, 1]
            moved = items - items % k + ids[:, 0] % k
            ids[:, 1] = torch.where(moved < int(self._sizes[1]), moved, (moved - k).clamp_min(0))
        dense = torch.randn(n, self.features.num_dense, generator=g)
        prob = torch.sigmoid(self._world.score(dense, ids))
        labels = torch.bernoulli(prob, generator=g)
        if self.features.multi_label:
            funnel = [labels * torch.bernoulli(torch.sigmoid(w.score(dense, ids)), generator=g) for w in self._task_worlds]
            labels = torch.stack([labels, *funnel], dim=1)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.features.sparse_names,
            values=ids.t().reshape(-1),
            lengths=torch.ones(n * f, dtype=torch.int32),
        )
        return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


@dataclass(frozen=True)
class _World:
    """The hidden ground truth that labels are drawn from."""

    id_effects: list[torch.Tensor]
    dense_weights: torch.Tensor
    bias: float
    scale: float

    @staticmethod
    def draw(seed: int, num_dense: int, sizes: list[int], scale: float, bias: float = -1.1) -> _World:
        g = torch.Generator().manual_seed(seed)
        # Each categorical column carries a little signal; together they carry about as much as
        # the dense columns, so both halves of a model have something to learn.
        per_feature = 1.2 / max(len(sizes), 1) ** 0.5
        effects = [torch.randn(n, generator=g) * per_feature for n in sizes]
        dense_w = torch.randn(num_dense, generator=g) * (1.0 / max(num_dense, 1) ** 0.5)
        return _World(effects, dense_w, bias=bias, scale=scale)

    def score(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        sparse = sum(e[ids[:, j]] for j, e in enumerate(self.id_effects))
        linear = dense @ self.dense_weights if dense.shape[1] else torch.zeros(dense.shape[0])
        # A dense×sparse interaction that a purely additive model cannot capture.
        cross = dense[:, 0] * self.id_effects[0][ids[:, 0]] if dense.shape[1] else 0.0
        return self.scale * (self.bias + linear + sparse + cross)
