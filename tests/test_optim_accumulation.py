"""Gradient accumulation on several ranks: the dense part's DDP all-reduces once per optimizer step (``no_sync`` in all but
a step's last micro-batch) and trains exactly as when it all-reduced every micro-batch, the fused embedding updates
included (they still happen every micro-batch, also for ``data_parallel`` tables, whose own DDP keeps all-reducing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import torchrun

ACCUMULATION, STEPS = 3, 5
ARGS = ["data.batch_size=64", "data.num_embeddings=1000", "data.num_train_rows=8192", "data.num_eval_rows=1024",
        f"train.num_steps={STEPS}", f"train.grad_accum_steps={ACCUMULATION}", "train.eval_every_steps=null", "distributed.device=cpu",
        "tracking=none", "checkpoint=none", "optim=rowwise_adagrad"]


def two_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, *overrides: str, every_micro: bool) -> list[list[dict[str, float]]]:
    """Each rank's steps (loss, dense buckets all-reduced) of a 2-rank gloo run of :mod:`tests.rank_sync`; ``every_micro``:
    with the step policy's DDP taken away, so every micro-batch all-reduces as before ``no_sync``."""
    folder = tmp_path / name
    folder.mkdir()
    monkeypatch.setenv("RANK_SYNC_EVERY_MICRO", "1" if every_micro else "0")
    out = torchrun(*ARGS, *overrides, f"hydra.run.dir={folder}/run", cwd=folder, module="tests.rank_sync")
    assert out.returncode == 0, out.stderr[-3000:]
    return [torch.load(folder / f"sync_rank{r}.pt")["steps"] for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["table_wise", "data_parallel"])
def test_no_sync_all_reduces_once_per_step_and_trains_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sharding: str) -> None:
    """Measured: the same losses to 1.2e-7 (the summed gradients are all-reduced once instead of each micro-batch's);
    ``ACCUMULATION`` bucket all-reduces per step before, 1 with ``no_sync`` — but in the first step, which a
    static-graph DDP must all-reduce in full (:mod:`recsys_runner.train.stepping`)."""
    placed = f"distributed.sharding_types=[{sharding}]"
    synced = two_ranks(tmp_path, monkeypatch, "every_micro", placed, every_micro=True)
    once = two_ranks(tmp_path, monkeypatch, "no_sync", placed, every_micro=False)
    for rank in range(2):
        assert [s["all_reduced_buckets"] for s in synced[rank]] == [ACCUMULATION] * STEPS
        assert [s["all_reduced_buckets"] for s in once[rank]] == [ACCUMULATION] + [1] * (STEPS - 1)
        for step, (a, b) in enumerate(zip(synced[rank], once[rank], strict=True), start=1):
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-6, rel=0), f"rank {rank} step {step}: {b['loss']} vs {a['loss']}"
    assert synced[0][-1]["loss"] != synced[1][-1]["loss"]  # each rank its own rows: the comparison is per rank
