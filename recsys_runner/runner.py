"""The training loop: steps or epochs, periodic and final eval, logging. Nothing else.

Per-step mechanics (moving the batch, forward, backward, optimizer step, input distribution of
the next batch) belong to the TrainPipeline; building belongs to :mod:`recsys_runner.build`.
"""

from __future__ import annotations

import itertools
import logging

import torch

from recsys_runner.build import Components
from recsys_runner.distributed import detached
from recsys_runner.metrics import Throughput, eval_metrics

log = logging.getLogger(__name__)


def train(c: Components) -> dict[str, float]:
    """Train for ``c.total_steps`` steps, evaluating on the configured cadence; return final eval."""
    cfg, env = c.run.train, c.env
    meter = Throughput(c.total_steps, c.data.batch_size * env.world_size)
    step = 0
    for epoch in itertools.count():
        c.pipeline.reset()
        batches = iter(c.data.train_batches(epoch, env.rank, env.world_size))
        while step < c.total_steps:
            try:
                loss, _, _ = c.pipeline.progress(batches)
            except StopIteration:
                break
            step += 1
            c.lr_scheduler.step()
            meter.update(loss)
            if step % cfg.log_every_steps == 0 or step == c.total_steps:
                _log(c, meter.flush(step) | learning_rates(c.optimizer) | {"train/epoch": epoch}, step)
            if cfg.eval_every_steps and step % cfg.eval_every_steps == 0 and step < c.total_steps:
                with meter.paused():
                    _log(c, evaluate(c), step)
        if step >= c.total_steps:
            break
    final = evaluate(c)
    _log(c, final, step)
    return final


def evaluate(c: Components) -> dict[str, float]:
    """AUC and log loss over this rank's eval batches, combined over all ranks."""
    metrics = eval_metrics(c.env.device)
    batches = c.data.eval_batches(c.env.rank, c.env.world_size)
    limit = c.run.train.eval_max_batches
    with detached(c.pipeline, c.model) as model:
        model.eval()
        with torch.no_grad():
            for batch in itertools.islice(batches, limit):
                _, (_, logits, labels) = model(batch.to(c.env.device, non_blocking=True))
                metrics.update(torch.sigmoid(logits), labels.long())
        model.train()
    return {f"eval/{k}": float(v) for k, v in metrics.compute().items()}


def learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Current lr of each optimizer (``lr/sparse``, ``lr/dense``) from its first param group."""
    out: dict[str, float] = {}
    for key, opt in getattr(optimizer, "optimizers", [("all", optimizer)]):
        if opt.param_groups:
            out[f"lr/{key}"] = float(opt.param_groups[0]["lr"])
    return out


def _log(c: Components, metrics: dict[str, float], step: int) -> None:
    c.tracker.log_metrics(metrics, step)
    if c.env.is_main:
        parts = [f"{k}={v:.4g}" for k, v in metrics.items() if k != "train/eta_s"]
        eta = metrics.get("train/eta_s")
        suffix = f" eta={eta:.0f}s" if eta is not None else ""
        log.info("step %d/%d %s%s", step, c.total_steps, " ".join(parts), suffix)
