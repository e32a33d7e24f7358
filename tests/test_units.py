"""Unit tests of the pure parts: schedules against their closed forms, synthetic data, metrics."""

from __future__ import annotations

import math

import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from recsys_runner.configurable import make
from recsys_runner.data.synthetic import SyntheticData, SyntheticDataConfig
from recsys_runner.errors import ConfigError
from recsys_runner.metrics import LogLoss, Throughput
from recsys_runner.optim.schedulers import (
    Constant,
    ConstantConfig,
    Cosine,
    CosineConfig,
    ExponentialDecay,
    ExponentialDecayConfig,
)


def small_data(**kw) -> SyntheticData:
    args = dict(batch_size=64, num_dense=13, num_sparse=26, num_embeddings=500, num_embeddings_per_feature=None,
                num_train_rows=64 * 20, num_eval_rows=64 * 8, id_skew=3.0, seed=0, label_noise=1.0)
    return SyntheticData(make(SyntheticDataConfig, **(args | kw)))


class TestSchedules:
    def test_constant_with_warmup(self) -> None:
        s = Constant(make(ConstantConfig, warmup_steps=10, warmup_start=0.1), total_steps=100)
        assert s(0) == pytest.approx(0.1)
        assert s(5) == pytest.approx(0.1 + 0.9 * 0.5)
        assert [s(t) for t in (10, 50, 99)] == [1.0, 1.0, 1.0]

    @pytest.mark.parametrize("staircase", [False, True])
    def test_exponential_decay_closed_form(self, staircase: bool) -> None:
        s = ExponentialDecay(make(ExponentialDecayConfig, decay_steps=100, decay_rate=0.5, staircase=staircase, min_factor=0.01,
                                  warmup_steps=20), total_steps=1000)
        for t in range(0, 1000, 7):
            if t < 20:
                expected = t / 20
            else:
                e = (t - 20) / 100
                expected = max(0.01, 0.5 ** (math.floor(e) if staircase else e))
            assert s(t) == pytest.approx(expected), t

    def test_cosine_closed_form(self) -> None:
        s = Cosine(make(CosineConfig, warmup_steps=10, min_factor=0.1), total_steps=110)
        assert s(0) == 0.0 and s(10) == pytest.approx(1.0)
        assert s(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
        assert s(110) == pytest.approx(0.1)

    def test_warmup_longer_than_training_is_an_error(self) -> None:
        with pytest.raises(ConfigError, match="scheduler.warmup_steps=200 exceeds the run's 100 training steps"):
            make(ConstantConfig, warmup_steps=200).build(total_steps=100)


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


def test_logloss_matches_definition() -> None:
    probs = torch.tensor([0.9, 0.2, 0.6, 0.4])
    labels = torch.tensor([1, 0, 0, 1])
    metric = LogLoss()
    metric.update(probs[:2], labels[:2])
    metric.update(probs[2:], labels[2:])
    expected = -(math.log(0.9) + math.log(0.8) + math.log(0.4) + math.log(0.4)) / 4
    assert float(metric.compute()) == pytest.approx(expected)


def test_throughput_window() -> None:
    meter = Throughput(total_steps=10, global_batch_size=100)
    for v in (1.0, 3.0):
        meter.update(torch.tensor(v))
    out = meter.flush(step=2)
    assert out["train/loss"] == pytest.approx(2.0) and out["train/samples_per_s"] > 0 and out["train/eta_s"] >= 0
