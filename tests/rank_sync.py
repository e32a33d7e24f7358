"""``python -m tests.rank_sync [overrides]``: ``python -m recsys_runner`` that saves to ``sync_rank<r>.pt`` in the working
directory, once training ends, each optimizer step's loss on this rank and the number of buckets the dense part's DDP
all-reduced during it (counted by a comm hook that then all-reduces as DDP's default does). With ``RANK_SYNC_EVERY_MICRO=1``
the step policy forgets its DDP, so every micro-batch all-reduces (the behaviour before ``no_sync``), for a test to
compare the two (``tests/test_optim_accumulation.py``, which runs its four jobs in one launch: :mod:`tests.rank_jobs`).

No ``from __future__ import annotations``: DDP checks the comm hook's annotations as objects."""

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torchrec.datasets.utils import Batch

import recsys_runner.__main__ as entry
from recsys_runner.train.loop import Loop
from recsys_runner.train.stepping import dense_ddp
from tests.rank_jobs import run_jobs

_train = entry.train


def train_and_save(loop: Loop) -> dict[str, float]:
    stepper = loop.stepper
    ddp = dense_ddp(loop.evaluator.model)
    assert ddp is not None, "a 2-rank run: DMP wraps the dense part in DDP"
    assert stepper.policy.ddp is ddp
    if os.environ.get("RANK_SYNC_EVERY_MICRO") == "1":
        stepper.policy.ddp = None
    buckets = [0]

    def counted(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buckets[0] += 1
        return allreduce_hook(process_group, bucket)

    ddp.register_comm_hook(None, counted)
    steps: list[dict[str, float]] = []
    step = stepper.step

    def recorded(batches: Iterator[Batch]) -> torch.Tensor | None:
        buckets[0] = 0
        loss = step(batches)
        if loss is not None:
            steps.append({"loss": float(loss), "all_reduced_buckets": buckets[0]})
        return loss

    stepper.step = recorded  # type: ignore[method-assign]
    final = _train(loop)
    torch.save({"steps": steps, "accumulation": stepper.accumulation_steps},
               Path.cwd() / f"sync_rank{dist.get_rank()}.pt")
    return final


if __name__ == "__main__":
    entry.train = train_and_save  # here only: importing this module must not change the runner's train
    run_jobs()
