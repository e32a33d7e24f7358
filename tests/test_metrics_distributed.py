"""Two ranks (gloo on 127.0.0.1): every metric equals one process's value over the union of their data.

The ranks hold uneven shares (rank 1 has more rows, in more batches), and every group of the
grouped AUC has rows on both ranks, so averaging per-rank values would give a different answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        values = compute_all([rank_data(rank)])
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(values))
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
