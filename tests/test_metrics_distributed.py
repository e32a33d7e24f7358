"""Two ranks (gloo on 127.0.0.1): every metric equals one process's value over the union of their data.

The ranks hold uneven shares (rank 1 has more rows, in more batches), and every group of the
grouped AUC has rows on both ranks, so averaging per-rank values would give a different answer.
The same launch checks the training summaries' embedding row norms of a table split over the two ranks
(``train/summaries.py``; ``tests/test_summaries.py`` has the 1-rank case): by rows, or by columns, whose squares the
ranks all-reduce.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.data.base import DataModule
from recsys_runner.features import FeatureSpec, SparseFeature
from recsys_runner.metrics.registry import MetricsConfig, build_eval_metrics, build_train_metrics
from tests.conftest import free_port

WORLD = 2
POINTWISE = MetricsConfig(
    eval=["auc", "logloss", "accuracy", "gauc", "xauc", "ne", "calibration", "mae", "mse"],
    train=["auc", "logloss", "ne", "calibration"],
    grouping_key="user",
    decay_rate=0.7,
    decay_step=2,
    xauc_max_pairs=5000,  # below the union's pair count: the sampled path must also agree
)
RETRIEVAL = MetricsConfig(eval=["inbatch_recall@1", "inbatch_recall@3"], train=[])
STEPS = 5


def rank_data(rank: int) -> dict[str, list[torch.Tensor]]:
    """Rank ``rank``'s eval batches (uneven sizes) and its per-step train batches."""
    g = torch.Generator().manual_seed(100 + rank)
    sizes = [37, 50] if rank == 0 else [64, 23, 41]
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("preds", "labels", "groups", "scores", "positives", "train_preds", "train_labels")}
    for n in sizes:
        preds = (torch.rand(n, generator=g) * 20).round() / 20  # ties within and across ranks
        out["preds"].append(preds)
        out["labels"].append((torch.rand(n, generator=g) < preds).float())
        out["groups"].append(torch.randint(0, 6, (n,), generator=g))  # every group on both ranks
        out["scores"].append(torch.randn(n, 5, generator=g).round(decimals=1))
        out["positives"].append(torch.randint(0, 5, (n,), generator=g))
    for _ in range(STEPS):
        n = 16 + 8 * rank
        p = torch.rand(n, generator=g)
        out["train_preds"].append(p)
        out["train_labels"].append((torch.rand(n, generator=g) < p).float())
    return out


def compute_all(shards: list[dict[str, list[torch.Tensor]]]) -> dict[str, float]:
    """Metric values from ``shards`` fed to this process's metrics (one shard per rank, or the union)."""
    pointwise, retrieval = build_eval_metrics(POINTWISE, torch.device("cpu")), build_eval_metrics(RETRIEVAL, torch.device("cpu"))
    train = build_train_metrics(POINTWISE, torch.device("cpu"))
    for shard in shards:
        for p, y, g in zip(shard["preds"], shard["labels"], shard["groups"], strict=True):
            pointwise.update(p, y, groups=g)
        for s, pos in zip(shard["scores"], shard["positives"], strict=True):
            retrieval.update(s, pos)
    values = {f"eval/{k}": float(v) for k, v in {**pointwise.compute(), **retrieval.compute()}.items()}
    for step in range(STEPS):  # one train step: every rank's batch of that step together
        train.update(torch.cat([s["train_preds"][step] for s in shards]), torch.cat([s["train_labels"][step] for s in shards]))
        if step == 0:
            values |= {f"{k}@step1": v for k, v in train.compute().items()}  # before any window closed
    return values | train.compute()


SPLITS = {"rows": [(0, 3, 0, 4), (3, 3, 0, 4)], "columns": [(0, 6, 0, 2), (0, 6, 2, 2)]}
"""A 6x4 table split over the 2 ranks: each rank's shard ``(first row, rows, first column, columns)``."""


def table() -> torch.Tensor:
    return torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))


def row_norms(rank: int) -> dict[str, list[float]]:
    """What the summaries' ``_local_row_norms`` gives on ``rank`` for a table whose other shard is on the other rank."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata

    from recsys_runner.distributed.env import DistEnv
    from recsys_runner.train.summaries import _local_row_norms

    whole, env = table(), DistEnv(rank, WORLD, rank, WORLD, torch.device("cpu"), "gloo")
    out = {}
    for split, shards in SPLITS.items():
        r, nr, c, nc = shards[rank]
        mine = Shard(whole[r:r + nr, c:c + nc].clone(), ShardMetadata([r, c], [nr, nc], f"rank:{rank}/cpu"))
        out[split] = _local_row_norms(ShardedTensor._init_from_local_shards([mine], [6, 4]), env).tolist()
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        values = compute_all([rank_data(rank)])
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(values))
        Path(out_dir, f"norms{rank}.json").write_text(json.dumps(row_norms(rank)))
    finally:
        dist.destroy_process_group()




@pytest.mark.slow
def test_two_ranks_equal_one_process_over_the_union(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    reference = compute_all([rank_data(r) for r in range(WORLD)])
    assert set(reference) == set(ranks[0])
    for rank_values in ranks:
        for key, expected in reference.items():
            assert rank_values[key] == pytest.approx(expected, rel=1e-9, abs=1e-12), key
    # the check has teeth: per-rank values averaged differ from the union's
    alone = [compute_all([rank_data(r)]) for r in range(WORLD)]
    for key in ("eval/auc", "eval/gauc", "eval/xauc", "eval/logloss", "train/auc"):
        assert (alone[0][key] + alone[1][key]) / 2 != pytest.approx(reference[key], rel=1e-6), key
    # row norms of the split table: each rank its own rows; a row split by columns counted once, on rank 0, whole
    norms = [json.loads((tmp_path / f"norms{r}.json").read_text()) for r in range(WORLD)]
    whole = table().norm(dim=1)
    assert sorted(norms[0]["rows"] + norms[1]["rows"]) == pytest.approx(sorted(whole.tolist()), rel=1e-12)
    assert len(norms[0]["rows"]) == len(norms[1]["rows"]) == 3
    assert norms[0]["columns"] == pytest.approx(whole.tolist(), rel=1e-12) and norms[1]["columns"] == []


EVAL_SIZES = {0: [40, 40, 7], 1: []}
"""Each rank's eval batches for the evaluator test: rank 1 has none at all (a tiny eval split on 2 ranks)."""


class _EvalData(DataModule):
    """Rank ``r``'s eval batches of :data:`EVAL_SIZES` (a dense column, a ``user`` id per row, 0/1 labels); no training. A
    :class:`DataModule` as every data module is (its defaults: no eval-row check, a generic hint)."""

    features = FeatureSpec(("x",), (SparseFeature("user", 6),))
    batch_size = 40

    def eval_batches(self, rank: int, world_size: int) -> list[Batch]:
        g = torch.Generator().manual_seed(rank)
        out = []
        for n in EVAL_SIZES[rank] if world_size > 1 else [s for r in sorted(EVAL_SIZES) for s in EVAL_SIZES[r]]:
            users = torch.randint(0, 6, (n,), generator=g)
            kjt = KeyedJaggedTensor(keys=["user"], values=users, lengths=torch.ones(n, dtype=torch.int32))
            out.append(Batch(dense_features=torch.randn(n, 1, generator=g), sparse_features=kjt,
                             labels=(torch.rand(n, generator=g) < 0.4).float()))
        return out


class _Collective(torch.nn.Module):
    """Logits ``2x``; each forward all-reduces, as a sharded model's embedding lookups do, and is counted."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards = 0

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if dist.is_initialized():
            dist.all_reduce(torch.ones(1))
        self.forwards += 1
        logits = 2 * batch.dense_features[:, 0]
        return logits.sum(), (logits.sum(), logits, batch.labels)


def _evaluate(rank: int, world: int) -> tuple[dict[str, float], int]:
    from recsys_runner.distributed.env import DistEnv
    from recsys_runner.tasks import BinaryTask
    from recsys_runner.train.evaluation import Evaluator

    model, env = _Collective(), DistEnv(rank, world, rank, world, torch.device("cpu"), "gloo")
    spec = MetricsConfig(eval=["auc", "gauc", "logloss", "accuracy"], grouping_key="user")
    evaluator = Evaluator(model, None, cast(Any, _EvalData()), env, (BinaryTask(),), spec)
    return evaluator.evaluate(), model.forwards


def _eval_worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        values, forwards = _evaluate(rank, WORLD)
        Path(out_dir, f"eval{rank}.json").write_text(json.dumps({"values": values, "forwards": forwards}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_evaluator_counts_every_row_once_when_one_rank_has_no_batches(tmp_path: Path) -> None:
    """Rank 0 holds 3 eval batches, rank 1 none: rank 1 forwards a stand-in 3 times (each forward is a collective, so
    the ranks must take as many) whose rows count nowhere, and joins the gathers with no rows of its own; every rank's
    metrics are one process's over rank 0's rows."""
    mp.spawn(_eval_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    alone, _ = _evaluate(0, 1)
    for rank in range(WORLD):
        got = json.loads((tmp_path / f"eval{rank}.json").read_text())
        assert got["forwards"] == 3, rank
        assert got["values"] == pytest.approx(alone, rel=1e-12), rank
