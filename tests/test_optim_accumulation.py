"""Gradient accumulation on several ranks: the dense part's DDP all-reduces once per optimizer step (``no_sync`` in all but
a step's last micro-batch) and trains exactly as when it all-reduced every micro-batch, the fused embedding updates
included (they still happen every micro-batch, also for ``data_parallel`` tables, whose own DDP keeps all-reducing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import torchrun
from tests.rank_jobs import jobs

ACCUMULATION, STEPS = 3, 5
ARGS = ["data.batch_size=64", "data.num_embeddings=1000", "data.num_train_rows=8192", "data.num_eval_rows=1024",
        f"train.num_steps={STEPS}", f"train.grad_accum_steps={ACCUMULATION}", "train.eval_every_steps=null", "distributed.device=cpu",
        "tracking=none", "checkpoint=none", "optim=rowwise_adagrad"]


SHARDINGS = ("table_wise", "data_parallel")


def two_ranks(tmp_path: Path) -> dict[tuple[str, bool], list[list[dict[str, float]]]]:
    """Each rank's steps (loss, dense buckets all-reduced) of 2-rank gloo jobs of :mod:`tests.rank_sync`, per sharding and
    ``every_micro`` (with the step policy's DDP taken away, so every micro-batch all-reduces as before ``no_sync``): the
    four jobs of one launch (:mod:`tests.rank_jobs`), each in its own folder."""
    specs = {(sharding, every_micro): tmp_path / f"{sharding}_{'every_micro' if every_micro else 'no_sync'}"
             for sharding in SHARDINGS for every_micro in (True, False)}
    for folder in specs.values():
        folder.mkdir()
    env = jobs(*[(folder, {"RANK_SYNC_EVERY_MICRO": "1" if every_micro else "0"},
                  [f"distributed.sharding_types=[{sharding}]", f"hydra.run.dir={folder}/run"])
                 for (sharding, every_micro), folder in specs.items()])
    out = torchrun(*ARGS, cwd=tmp_path, module="tests.rank_sync", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return {key: [torch.load(folder / f"sync_rank{r}.pt")["steps"] for r in range(2)] for key, folder in specs.items()}


@pytest.mark.slow
def test_no_sync_all_reduces_once_per_step_and_trains_as_before(tmp_path: Path) -> None:
    """Measured, for ``table_wise`` and ``data_parallel`` tables: the same losses to 1.2e-7 (the summed gradients are
    all-reduced once instead of each micro-batch's); ``ACCUMULATION`` bucket all-reduces per step before, 1 with
    ``no_sync`` — but in the first step, which a static-graph DDP must all-reduce in full (:mod:`recsys_runner.train.stepping`)."""
    runs = two_ranks(tmp_path)
    for sharding in SHARDINGS:
        synced, once = runs[sharding, True], runs[sharding, False]
        for rank in range(2):
            assert [s["all_reduced_buckets"] for s in synced[rank]] == [ACCUMULATION] * STEPS, sharding
            assert [s["all_reduced_buckets"] for s in once[rank]] == [ACCUMULATION] + [1] * (STEPS - 1), sharding
            for step, (a, b) in enumerate(zip(synced[rank], once[rank], strict=True), start=1):
                assert b["loss"] == pytest.approx(a["loss"], abs=1e-6, rel=0), f"{sharding} rank {rank} step {step}: {b['loss']} vs {a['loss']}"
        assert synced[0][-1]["loss"] != synced[1][-1]["loss"]  # each rank its own rows: the comparison is per rank
