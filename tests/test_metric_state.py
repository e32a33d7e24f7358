"""The metric base (recsys_runner/metrics/state.py): states combined over two gloo ranks holding different numbers of rows,
none included; keyword filtering of a collection's update; compute's cache and reset; ``state_dict`` keys that load
a torchmetrics-written state; ``.to(device)``; and the runner's entry points importing no torchmetrics."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from recsys_runner.metrics.classification import AUC, GroupedAUC, LogLoss
from recsys_runner.metrics.corpus import CoverageAtK
from recsys_runner.metrics.decay import DecayAUC, DecayingMetric
from recsys_runner.metrics.registry import MetricsConfig, build_eval_metrics
from recsys_runner.metrics.state import Metric, MetricCollection
from tests.conftest import free_port

WORLD = 2
TIMEOUT = timedelta(seconds=60)
"""A collective one rank skips fails the test after this, rather than hanging it."""


class Extremes(Metric):
    """A ``min``, a ``max`` and an integer ``sum`` state, and a 2-D float32 ``cat`` state: a test double for the base."""

    smallest: Tensor
    largest: Tensor
    total: Tensor
    pairs: list[Tensor]

    def __init__(self) -> None:
        super().__init__()
        self.add_state("smallest", torch.tensor(float("inf"), dtype=torch.float64), "min")
        self.add_state("largest", torch.tensor(float("-inf"), dtype=torch.float64), "max")
        self.add_state("total", torch.tensor(0, dtype=torch.long), "sum")
        self.add_state("pairs", [], "cat")

    def update(self, values: Tensor) -> None:
        self.smallest = torch.minimum(self.smallest, values.min().double())
        self.largest = torch.maximum(self.largest, values.max().double())
        self.total += values.numel()
        self.pairs.append(torch.stack([values, 2 * values], dim=1))

    def compute(self) -> dict[str, Any]:
        pairs = self.pairs if isinstance(self.pairs, Tensor) else torch.cat(self.pairs)
        return {"smallest": float(self.smallest), "largest": float(self.largest), "total": int(self.total),
                "pairs": pairs.tolist(), "dtype": str(pairs.dtype)}


def rows(rank: int, part: int, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rank ``rank``'s ``part``-th batch of ``n`` rows: predictions with ties, 0/1 labels, group ids."""
    g = torch.Generator().manual_seed(1000 * rank + part)
    preds = (torch.rand(n, generator=g) * 10).round() / 10
    return preds, (torch.rand(n, generator=g) < preds).float(), torch.randint(0, 4, (n,), generator=g)


ROUNDS = ({0: [7, 5], 1: []}, {0: [3], 1: [11, 2]})
"""Each rank's batch sizes before the first compute (rank 1: none, so its list states are still empty) and between
the first and the second (uneven again, rank 1 now with rows)."""

SCALARS = ("auc", "gauc", "logloss", "coverage", "multiclass")


def feed_and_compute(ranks: list[int]) -> list[dict[str, Any]]:
    """The values after each round of :data:`ROUNDS` with the batches of ``ranks`` fed to this process's metrics
    (one rank's under a process group, or all of them: the union)."""
    auc, gauc, logloss, coverage, multiclass = AUC(), GroupedAUC(), LogLoss(), CoverageAtK(2), AUC()
    extremes, untouched = Extremes(), AUC()
    out = []
    for round_, sizes in enumerate(ROUNDS):
        for rank in ranks:
            for part, n in enumerate(sizes[rank]):
                preds, labels, groups = rows(rank, 10 * round_ + part, n)
                auc.update(preds, labels)
                gauc.update(preds, labels, groups=groups)
                logloss.update(preds, labels)
                coverage.update(torch.stack([preds, 1 - preds, preds / 2], dim=1))
                multiclass.update(torch.softmax(torch.stack([preds, 1 - preds, preds ** 2], dim=1), dim=1), groups % 3)
                extremes.update(preds)
        values = {name: float(m.compute()) for name, m in zip(SCALARS, (auc, gauc, logloss, coverage, multiclass), strict=True)}
        out.append(values | {"extremes": extremes.compute(), "untouched": float(untouched.compute())})
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=TIMEOUT)
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(feed_and_compute([rank])))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_with_uneven_and_no_rows_equal_one_process_over_the_union(tmp_path: Path) -> None:
    """Rank 1 holds no rows at the first compute (its list states are empty) and joins every gather; after a compute
    each rank is back to its own rows, so the second compute (more rows on both, uneven) counts each row once."""
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    union = feed_and_compute([0, 1])
    for rank in range(WORLD):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for have, want in zip(got, union, strict=True):
            assert have["extremes"] == want["extremes"], rank  # min, max, integer sum, rows in rank order: exact
            assert {k: have[k] for k in SCALARS} == pytest.approx({k: want[k] for k in SCALARS}, rel=1e-12), rank
            assert math.isnan(have["untouched"])  # no rows on any rank: NaN, and no hang
    assert union[0]["extremes"]["dtype"] == "torch.float32" and len(union[1]["extremes"]["pairs"]) == 28
    # the states were combined: the union's values are not rank 0's alone
    alone = feed_and_compute([0])
    assert alone[1]["auc"] != pytest.approx(union[1]["auc"]) and alone[1]["extremes"]["total"] == 15


class Average(Metric):
    """A ``mean`` state: the last batch's mean."""

    value: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("value", torch.tensor(0.0, dtype=torch.float64), "mean")

    def update(self, values: Tensor) -> None:
        self.value = values.double().mean()

    def compute(self) -> Tensor:
        return self.value


def _mean_worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=TIMEOUT)
    try:
        metric = Average()
        metric.update(torch.full((1 + 3 * rank,), 1.0 + 3 * rank))  # rank 0: one row of 1; rank 1: four rows of 4
        Path(out_dir, f"mean{rank}.json").write_text(json.dumps([float(metric.compute()), float(metric.value)]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_mean_state_averages_the_ranks_values(tmp_path: Path) -> None:
    """``mean`` is the average of the ranks' values (torchmetrics' ``stack(...).mean(0)``), not a mean over the union's
    rows; after compute each rank holds its own value again."""
    mp.spawn(_mean_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    assert [json.loads((tmp_path / f"mean{r}.json").read_text()) for r in range(WORLD)] == [[2.5, 1.0], [2.5, 4.0]]


class Everything(Metric):
    """A metric whose ``update`` takes ``**kwargs``: torchmetrics' rule passes it every keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[set[str]] = []

    def update(self, preds: Tensor, labels: Tensor, **kwargs: Any) -> None:
        self.seen.append(set(kwargs))

    def compute(self) -> Tensor:
        return torch.tensor(float(len(self.seen)))


class Weighted(Metric):
    """A metric whose ``update`` takes one keyword-only argument."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[Tensor | None] = []

    def update(self, preds: Tensor, labels: Tensor, *, weights: Tensor | None = None) -> None:
        self.weights.append(weights)

    def compute(self) -> Tensor:
        return torch.tensor(0.0)


def test_collection_passes_each_metric_only_the_keywords_its_update_takes() -> None:
    spec = MetricsConfig(eval=["auc", "gauc", "logloss"], grouping_key="user")
    built = build_eval_metrics(spec, torch.device("cpu"))
    collection = MetricCollection({**dict(built.items()), "all": Everything(), "weighted": Weighted()})
    preds, labels, groups = rows(0, 0, 12)
    collection.update(preds, labels, groups=groups, weights=torch.ones(12))  # auc, logloss would raise on groups=
    everything, weighted = collection["all"], collection["weighted"]
    assert isinstance(everything, Everything) and isinstance(weighted, Weighted)
    assert everything.seen == [{"groups", "weights"}] and weighted.weights[0] is not None
    assert list(collection) == ["auc", "gauc", "logloss", "all", "weighted"] and len(collection) == 5 and "gauc" in collection
    values = collection.compute()
    assert list(values) == list(collection.keys())
    alone = GroupedAUC()
    alone.update(preds, labels, groups=groups)
    assert float(values["gauc"]) == float(alone.compute())
    with pytest.raises(TypeError, match="groups"):
        AUC().update(preds, labels, groups=groups)  # the filtering is what keeps groups= from the others


def test_compute_is_cached_until_the_next_update_and_reset_restores_the_defaults() -> None:
    metric = LogLoss()
    preds, labels, _ = rows(0, 0, 20)
    metric.update(preds, labels)
    first = metric.compute()
    assert metric.compute() is first  # cached
    metric.total += 1.0  # a change outside update is not seen while cached (DecayAUC.decay drops the cache itself)
    assert metric.compute() is first
    metric.update(preds, labels)
    second = metric.compute()
    assert second is not first and float(second) == pytest.approx(float(first) + 1.0 / 40)
    metric.reset()
    assert float(metric.count) == 0 and metric.count.dtype == torch.float64
    assert torch.isnan(metric.compute())  # a mean of no rows
    auc = AUC()
    auc.update(preds, labels)
    auc.reset()
    assert auc.preds == [] and auc.labels == []
    decayed = DecayAUC(num_bins=10)
    decayed.update(preds, labels)
    before = decayed.compute()
    decayed.decay(0.5)  # changes the states outside update, and drops the cache itself
    assert decayed.compute() is not before


def test_update_runs_without_autograd() -> None:
    metric = LogLoss()
    preds = torch.rand(8, requires_grad=True)
    metric.update(preds * 1.0, (torch.rand(8) < 0.5).float())
    assert not metric.total.requires_grad


def torchmetrics_state_dict(preds: Tensor, labels: Tensor) -> dict[str, Any]:
    """AUC's states as torchmetrics' ``Metric`` saved them (the base train-metric checkpoints were written with)."""
    from torchmetrics import Metric as TorchmetricsMetric  # the reference only: the runner no longer imports it

    class Old(TorchmetricsMetric):
        def __init__(self) -> None:
            super().__init__()
            self.add_state("preds", default=[], dist_reduce_fx="cat")
            self.add_state("labels", default=[], dist_reduce_fx="cat")

        def update(self, preds: Tensor, labels: Tensor) -> None:
            self.preds.append(preds.double())
            self.labels.append(labels.double())

        def compute(self) -> Tensor:
            return torch.tensor(0.0)

    old = Old()
    old.persistent(True)
    old.update(preds, labels)
    return dict(old.state_dict())


def test_state_dict_holds_persistent_states_under_their_bare_names_and_loads_torchmetrics_ones() -> None:
    preds, labels, _ = rows(0, 0, 30)
    metric = AUC()
    metric.update(preds, labels)
    assert dict(metric.state_dict()) == {}  # not persistent: eval metrics are never checkpointed
    metric.persistent(True)
    saved = metric.state_dict()
    assert list(saved) == ["preds", "labels"]
    metric.preds[0][0] = 99.0  # a saved state is a copy
    assert float(saved["preds"][0][0]) != 99.0
    old = torchmetrics_state_dict(preds, labels)
    assert list(old) == list(saved)
    restored = AUC()
    restored.persistent(True)
    restored.load_state_dict(old)
    fresh = AUC()
    fresh.update(preds, labels)
    assert float(restored.compute()) == float(fresh.compute())
    wrapped = DecayingMetric(DecayAUC(num_bins=10), decay_rate=0.5, decay_step=2)
    wrapped.update(preds, labels)
    assert list(wrapped.checkpoint_state()["metric"]) == ["pos_hist", "neg_hist", "pos_buffer", "neg_buffer", "folds"]


def test_to_device_moves_tensor_and_list_states_and_keeps_their_dtype() -> None:
    preds, labels, groups = rows(0, 0, 6)
    collection = MetricCollection({"gauc": GroupedAUC(), "logloss": LogLoss()})
    collection.update(preds, labels, groups=groups)
    meta = torch.device("meta")
    collection.to(meta)
    gauc, logloss = collection["gauc"], collection["logloss"]
    assert isinstance(gauc, GroupedAUC) and isinstance(logloss, LogLoss)
    assert gauc.device == logloss.device == meta
    assert [t.device for t in gauc.preds + gauc.groups] == [meta] * 2 and logloss.total.device == meta
    assert gauc.groups[0].dtype == torch.long
    logloss.reset()
    assert logloss.total.device == meta  # defaults moved too
    collection.to(torch.float32)
    assert logloss.total.dtype == torch.float64  # states keep their dtype


def test_the_runner_imports_no_torchmetrics() -> None:
    """``import torchmetrics`` cost 4.7 s of the GPU machine's start-up; no runner module may bring it back."""
    modules = ["recsys_runner.__main__", "recsys_runner.build", "recsys_runner.train.loop", "recsys_runner.train.corpus",
               "recsys_runner.metrics.registry", "recsys_runner.evaluate"]
    code = ("import importlib, sys\n"
            f"for module in {modules!r}:\n    importlib.import_module(module)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchmetrics'))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"
