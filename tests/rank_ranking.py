"""The 2-rank ranking-metric check's worker (tests/test_next_item.py), in a module of its own: ``mp.spawn``'s children
import only this (torch and the metrics), not the test module's Hydra, MLflow, TorchRec models and the runner's entry."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from recsys_runner.metrics.registry import MetricsConfig, build_eval_metrics

RANKING = MetricsConfig(eval=["hr@1", "hr@3", "ndcg@3", "ndcg@10"], train=[])


def rank_scores(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s uneven batches of full-table scores (rounded: ties within rows) and true item ids."""
    g = torch.Generator().manual_seed(7 + rank)
    sizes = [9, 30] if rank == 0 else [41, 5, 17]
    return [(torch.randn(n, 25, generator=g).round(decimals=1), torch.randint(0, 25, (n,), generator=g)) for n in sizes]


def ranking_values(shards: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, float]:
    metrics = build_eval_metrics(RANKING, torch.device("cpu"))
    for shard in shards:
        for scores, targets in shard:
            metrics.update(scores, targets)
    return {k: float(v) for k, v in metrics.compute().items()}


def ranking_worker(rank: int, port: int, out_dir: str) -> None:
    """``mp.spawn``'s rank ``rank``: its own shard's metrics, synced over gloo by ``compute``, to ``out_dir/rank<r>.json``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(ranking_values([rank_scores(rank)])))
    finally:
        dist.destroy_process_group()
