"""``python -m tests.rank_weighting [overrides]``: ``python -m recsys_runner`` that saves each rank's loss weighting to
``weighting_rank<r>.pt`` in the working directory once training ends: its tensors (log-variances, Pareto shares and
weights) then, and ``steps``, the tensors as each training forward left them (before that step's optimizer update). A
test compares the ranks of one torchrun launch with each other and with one process (:func:`record_steps`). Several jobs
may share the launch, each in its own folder (:mod:`tests.rank_jobs`)."""

from __future__ import annotations

from pathlib import Path

import torch

import recsys_runner.__main__ as entry
from recsys_runner.models.train_wrapper import TaskWeighting
from recsys_runner.train.loop import Loop
from tests.rank_jobs import run_jobs

_train = entry.train


def state(weighting: TaskWeighting) -> dict[str, torch.Tensor]:
    """The weighting's tensors now, on the CPU, and the weights it gives the task losses."""
    tensors = {k: v.detach().cpu().clone() for k, v in weighting.state_dict().items() if v.is_floating_point()}
    return {**tensors, "weights": weighting.weights().detach().cpu().clone()}


def record_steps(weighting: TaskWeighting) -> list[dict[str, torch.Tensor]]:
    """A list that gets :func:`state` after each training forward's ``combine`` (the weights that step trains with,
    before its optimizer update), with that forward's task ``losses``."""
    steps: list[dict[str, torch.Tensor]] = []
    combine = weighting.combine

    def recorded(losses: torch.Tensor, *args: object) -> torch.Tensor:
        out = combine(losses, *args)  # type: ignore[arg-type]
        if weighting.training and torch.is_grad_enabled():
            steps.append({**state(weighting), "losses": losses.detach().float().cpu().clone()})
        return out

    weighting.combine = recorded  # type: ignore[method-assign]
    return steps


def train_and_save(loop: Loop) -> dict[str, float]:
    weighting = loop.stepper.weighting
    assert weighting is not None, "a run with train.loss_weighting.kind=uncertainty or pareto"
    steps = record_steps(weighting)
    final = _train(loop)
    torch.save({**state(weighting), "steps": steps}, Path.cwd() / f"weighting_rank{torch.distributed.get_rank()}.pt")
    return final


if __name__ == "__main__":
    entry.train = train_and_save  # here only: importing record_steps must not change the runner's train
    run_jobs()
