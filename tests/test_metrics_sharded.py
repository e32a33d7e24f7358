"""AUC and grouped AUC over 2 and 3 gloo ranks by routing rows (``metrics/sharded.py``), not by gathering them all.

Every value must be one process's over the union, bit for bit (``==``, or both NaN): uneven ranks, an empty rank,
predictions of few distinct values (ties across the cuts between ranks), a NaN prediction, one class, a huge group
beside many tiny ones, groups on every rank. And the memory claim, counted: no rank receives more than its share of the
rows plus the largest tie (AUC) or group (grouped AUC), and the state gather (``state._gathered_rows``, which copies
every rank's rows onto every rank) is never entered for them — while the macro AUC of class probabilities still is.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recsys_runner.metrics import sharded, state
from recsys_runner.metrics.classification import AUC, GroupedAUC
from recsys_runner.metrics.functional import binary_auc, grouped_auc
from tests.conftest import free_port

SIZES = {2: [[300, 0, 41], [1100, 7]], 3: [[], [500, 13], [1700, 300, 1]]}
"""Each rank's batch sizes by world size: uneven, and in the 3-rank world rank 0 holds no rows at all."""
CASES = ("ties", "continuous", "nan", "one_class", "empty")
"""``ties``: predictions in eighths (9 values); ``continuous``: float32 draws; ``nan``: ``ties`` with a NaN prediction on
the last rank; ``one_class``: every label 0; ``empty``: no rank holds a row."""
HUGE_GROUP = 10_000
"""The group id of a third of all rows (every rank's); the others are spread over 400 tiny groups."""


def batches(case: str, world: int, rank: int) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s batches of ``case`` in a world of ``world`` ranks: ``preds``, ``labels`` (0/1), ``groups``."""
    g = torch.Generator().manual_seed(1000 * world + 10 * rank + CASES.index(case))
    out = []
    for n in [] if case == "empty" else SIZES[world][rank]:
        preds = torch.rand(n, generator=g)
        if case != "continuous":
            preds = (preds * 8).round() / 8
        labels = (torch.rand(n, generator=g) < preds).float() if case != "one_class" else torch.zeros(n)
        groups = torch.where(torch.rand(n, generator=g) < 1 / 3, HUGE_GROUP, torch.randint(0, 400, (n,), generator=g))
        out.append({"preds": preds, "labels": labels, "groups": groups})
    if case == "nan" and rank == world - 1:
        out[-1]["preds"][0] = float("nan")
    return out


def union(case: str, world: int) -> dict[str, torch.Tensor]:
    """All ranks' rows of ``case`` concatenated in rank order."""
    parts = [b for r in range(world) for b in batches(case, world, r)]
    return {k: torch.cat([b[k] for b in parts]) if parts else torch.zeros(0, dtype=torch.long if k == "groups" else torch.float32)
            for k in ("preds", "labels", "groups")}


def metrics() -> dict[str, Any]:
    return {"auc": AUC(), "gauc": GroupedAUC("impressions"), "gauc_uniform": GroupedAUC("uniform")}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    gathered: list[str] = []
    routed: list[int] = []
    gather, route = state._gathered_rows, sharded.route

    def counting_gather(parts: Any, world: int, device: torch.device, what: str) -> Any:
        gathered.append(what)
        return gather(parts, world, device, what)

    def counting_route(*args: Any) -> Any:
        keys, payload, received = route(*args)
        routed.append(keys.numel())
        return keys, payload, received

    state._gathered_rows, sharded.route = counting_gather, counting_route  # type: ignore[assignment]
    try:
        out: dict[str, Any] = {}
        for case in CASES:
            for name, metric in metrics().items():
                for batch in batches(case, world, rank):
                    metric.update(batch["preds"], batch["labels"], **({"groups": batch["groups"]} if name != "auc" else {}))
                routed.clear()
                out[f"{case}/{name}"] = {"value": float(metric.compute()), "routed": list(routed)}
        out["gathered"] = list(gathered)
        # the macro AUC of class probabilities still gathers, and still equals one process's
        macro = AUC()
        g = torch.Generator().manual_seed(rank)
        for n in SIZES[world][rank]:
            macro.update(torch.softmax(torch.randn(n, 3, generator=g), 1), torch.randint(0, 3, (n,), generator=g))
        out["macro"] = float(macro.compute())
        out["macro_gathered"] = [w for w in gathered[len(out["gathered"]):]]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _same(a: float, b: float) -> bool:
    """Bit for bit, or both NaN."""
    return (math.isnan(a) and math.isnan(b)) or a == b


def _largest_run(values: torch.Tensor) -> int:
    """Rows of the most frequent value (a tie of predictions, or a group); 0 over none."""
    return int(torch.unique(values, return_counts=True)[1].max()) if values.numel() else 0


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_routed_auc_and_grouped_auc_equal_one_process_over_the_union(tmp_path: Path, world: int) -> None:
    mp.spawn(_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for case in CASES:
        rows = union(case, world)
        expected = {"auc": binary_auc(rows["preds"], rows["labels"]),
                    "gauc": grouped_auc(rows["preds"], rows["labels"], rows["groups"], "impressions"),
                    "gauc_uniform": grouped_auc(rows["preds"], rows["labels"], rows["groups"], "uniform")}
        for name, value in expected.items():
            for r, got in enumerate(ranks):
                assert _same(got[f"{case}/{name}"]["value"], float(value)), (case, name, r, got[f"{case}/{name}"], float(value))
            share, n = -(-rows["preds"].numel() // world), rows["preds"].numel()
            largest = _largest_run(rows["preds"] if name == "auc" else rows["groups"])
            received = [got[f"{case}/{name}"]["routed"] for got in ranks]
            if case in ("nan", "empty"):  # NaN at once, from the exchanged counts: no row moves
                assert received == [[]] * world, (case, name)
                continue
            # every row routed exactly once, and no rank above its share plus the largest tie or group
            assert all(len(calls) == 1 for calls in received), (case, name, received)
            assert sum(calls[0] for calls in received) == n
            assert max(calls[0] for calls in received) <= share + largest, (case, name, received, share, largest)
        if case in ("ties", "continuous"):  # the cases that compare numbers, not NaNs
            assert not any(math.isnan(float(v)) for v in expected.values()), case
    for got in ranks:
        assert got["gathered"] == [], "AUC and grouped AUC must not gather every rank's rows"
        assert "AUC.preds" in got["macro_gathered"]
    # the macro AUC, gathered, is one process's
    g = [torch.Generator().manual_seed(r) for r in range(world)]
    macro = AUC()
    for r in range(world):
        for n in SIZES[world][r]:
            macro.update(torch.softmax(torch.randn(n, 3, generator=g[r]), 1), torch.randint(0, 3, (n,), generator=g[r]))
    assert all(got["macro"] == float(macro.compute()) for got in ranks)

