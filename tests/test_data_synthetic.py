"""The synthetic data (``data=synthetic``): Criteo's shape, deterministic per seed, disjoint equal rank shares, reshuffled
epochs, and labels that depend on the features."""

from __future__ import annotations

import torch
from torchmetrics.functional.classification import binary_auroc

from recsys_runner.configurable import make
from recsys_runner.data.generated.synthetic import SyntheticData
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig


def small_data(**kw) -> SyntheticData:
    args = dict(batch_size=64, num_dense=13, num_sparse=26, num_embeddings=500, num_embeddings_per_feature=None,
                num_train_rows=64 * 20, num_eval_rows=64 * 8, id_skew=3.0, seed=0, label_noise=1.0)
    return SyntheticData(make(SyntheticDataConfig, **(args | kw)))


class TestSyntheticData:
    def test_criteo_shape(self) -> None:
        data = small_data()
        batch = next(iter(data.train_batches(0, 0, 1)))
        assert batch.dense_features.shape == (64, 13)
        assert batch.sparse_features.keys() == [f"cat_{i}" for i in range(26)]
        assert batch.sparse_features.lengths().eq(1).all()
        assert batch.labels.shape == (64,) and set(batch.labels.unique().tolist()) <= {0.0, 1.0}
        assert int(batch.sparse_features.values().max()) < 500

    def test_deterministic(self) -> None:
        a, b = small_data(), small_data()
        for x, y in zip(a.train_batches(1, 0, 1), b.train_batches(1, 0, 1), strict=True):
            assert torch.equal(x.dense_features, y.dense_features) and torch.equal(x.labels, y.labels)
            assert torch.equal(x.sparse_features.values(), y.sparse_features.values())
        other = next(iter(small_data(seed=1).train_batches(1, 0, 1)))
        assert not torch.equal(other.dense_features, next(iter(a.train_batches(1, 0, 1))).dense_features)

    def test_ranks_get_disjoint_equal_shares_that_cover_the_epoch(self) -> None:
        data = small_data()
        def fingerprints(rank: int, world: int) -> list[float]:
            return [float(b.dense_features[0, 0]) for b in data.train_batches(0, rank, world)]
        whole = fingerprints(0, 1)
        r0, r1 = fingerprints(0, 2), fingerprints(1, 2)
        assert len(r0) == len(r1) == 10
        assert not set(r0) & set(r1)
        assert sorted(r0 + r1) == sorted(whole)

    def test_epochs_are_reshuffled(self) -> None:
        data = small_data()
        e0 = [float(b.dense_features[0, 0]) for b in data.train_batches(0, 0, 1)]
        e1 = [float(b.dense_features[0, 0]) for b in data.train_batches(1, 0, 1)]
        assert e0 != e1 and sorted(e0) == sorted(e1)

    def test_labels_depend_on_features(self) -> None:
        data = small_data(batch_size=4096, num_train_rows=4096, num_eval_rows=4096)
        batch = next(iter(data.eval_batches(0, 1)))
        ids = torch.stack([batch.sparse_features[k].values() for k in data.features.sparse_names], dim=1)
        oracle = binary_auroc(torch.sigmoid(data._world.score(batch.dense_features, ids)), batch.labels.long())
        assert oracle > 0.75
        shuffled = binary_auroc(torch.sigmoid(data._world.score(batch.dense_features, ids))[torch.randperm(4096)], batch.labels.long())
        assert abs(float(shuffled) - 0.5) < 0.05
