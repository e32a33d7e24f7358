"""Build the run's object graph from a validated config, in one fixed order.

The order is TorchRec's: process group → data → model with embedding tables on ``meta`` → fused
sparse optimizer attached → sharding plan → DistributedModelParallel → dense optimizer over what
is left → lr schedule → train pipeline → tracker. Every component comes from
``hydra.utils.instantiate``; the ones that need runtime objects (the data's features, the device,
the parameters that exist only after sharding, the step count) are partials completed here.
Nothing here knows a model's or an optimizer's name.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recsys_runner.config import RunConfig
from recsys_runner.data import DataModule
from recsys_runner.distributed import DistEnv, Distributed
from recsys_runner.errors import ConfigError
from recsys_runner.models.common import TrainWrapper
from recsys_runner.optim import apply_sparse_optimizer
from recsys_runner.tracking import NullTracker, Tracker


@dataclass
class Components:
    """Everything the runner drives; built by :func:`build`, closed by :meth:`close`."""

    run: RunConfig
    env: DistEnv
    distributed: Distributed
    data: DataModule
    model: nn.Module
    plan: ShardingPlan
    optimizer: CombinedOptimizer
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR
    pipeline: TrainPipelineBase | TrainPipelineSparseDist
    tracker: Tracker
    total_steps: int

    def close(self) -> None:
        """Release the process group (the tracker is finished by the runner, with a status)."""
        self.distributed.close()


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (dense init, dropout) identically on every rank."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build(cfg: DictConfig, run: RunConfig) -> Components:
    """Instantiate and wire every component of the run; see the module docstring for the order."""
    seed_everything(run.seed)
    distributed: Distributed = instantiate(cfg.distributed)
    env = distributed.setup()
    try:
        data: DataModule = instantiate(cfg.data)
        total_steps = _total_steps(run, data, env.world_size)
        model = instantiate(cfg.model)(features=data.features, dense_device=env.device)
        wrapped = TrainWrapper(model, autocast=instantiate(cfg.precision).autocast(env.device))
        apply_sparse_optimizer(wrapped, instantiate(cfg.optim.sparse))
        plan = distributed.plan(wrapped, batch_size=data.batch_size)
        sharded = distributed.shard(wrapped, plan)
        dense_factory = instantiate(cfg.optim.dense)
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(sharded.named_parameters())), lambda params: dense_factory(params)
        )
        optimizer = CombinedOptimizer([("sparse", sharded.fused_optimizer), ("dense", dense)])
        schedule = instantiate(cfg.scheduler)(total_steps=total_steps)
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=schedule)
        pipeline = distributed.pipeline(sharded, optimizer)
        tracker: Tracker = instantiate(cfg.tracking)() if env.is_main else NullTracker()
    except BaseException:
        distributed.close()
        raise
    return Components(
        run=run, env=env, distributed=distributed, data=data, model=sharded, plan=plan, optimizer=optimizer,
        lr_scheduler=lr_scheduler, pipeline=pipeline, tracker=tracker, total_steps=total_steps,
    )


def _total_steps(run: RunConfig, data: Any, world_size: int) -> int:
    if run.train.num_steps is not None:
        return run.train.num_steps
    per_epoch = data.num_train_batches(world_size)
    if not per_epoch:
        raise ConfigError(
            "train.num_epochs needs a dataset whose size is known up front, and this one has no full batch per "
            "rank; use train.num_steps instead, or more data / a smaller data.batch_size"
        )
    return run.train.num_epochs * per_epoch
