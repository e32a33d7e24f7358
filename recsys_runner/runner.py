"""The training loop: steps or epochs, periodic eval, checkpoints, stopping, logging. Nothing else.

Per-step mechanics (moving the batch, forward, backward, optimizer step, input distribution of
the next batch) belong to the TrainPipeline and the step policy (:mod:`recsys_runner.stepping`);
building and restoring belong to :mod:`recsys_runner.build`; what a checkpoint holds to
:mod:`recsys_runner.checkpoint`. A step is one optimizer step (``train.grad_accum_steps``
micro-batches). Training stops at ``c.total_steps``, on early stopping, on a signal
(:mod:`recsys_runner.signals`) or on a non-finite loss (:mod:`recsys_runner.stopping`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Iterator

import torch

from recsys_runner.build import Components
from recsys_runner.checkpoint import TrainState
from recsys_runner.distributed import detached
from recsys_runner.errors import DataError
from recsys_runner.metrics import TaskEvalMetrics, Throughput, grouping_ids
from recsys_runner.optim import GroupedOptimizer
from recsys_runner.profiling import StepProfiler
from recsys_runner.signals import Interrupted, StopSignals

log = logging.getLogger(__name__)


def train(c: Components) -> dict[str, float]:
    """Train from ``c.state`` up to ``c.total_steps`` steps; return the final eval metrics."""
    cfg, env, state = c.run.train, c.env, dataclasses.replace(c.state)
    meter = Throughput(c.total_steps, c.data.batch_size * env.world_size * cfg.grad_accum_steps)
    profiler = StepProfiler(cfg.profile, env.device, env.rank) if cfg.profile.enabled else None
    stop: str | None = None
    evaluated: dict[str, float] | None = None
    with StopSignals(env.world_size, env.device, cfg.stop_check_every_steps) as signals:
        while state.step < c.total_steps and stop is None:
            batches = _epoch_batches(c, state)
            while state.step < c.total_steps and stop is None:
                loss = _train_step(c, batches, state)
                if loss is None:  # the data ran out: the epoch is over
                    break
                state.step, state.epoch_step, evaluated = state.step + 1, state.epoch_step + 1, None
                c.lr_scheduler.step()
                meter.update(loss)
                if profiler is not None:
                    profiler.step()
                if state.step % cfg.log_every_steps == 0 or state.step == c.total_steps:
                    logged = meter.flush(state.step)
                    c.checkpointer.loss_logged(state.step, logged["train/loss"])
                    _log(c, logged | learning_rates(c.optimizer) | c.train_metrics.compute() | _data_metrics(c) | {"train/epoch": state.epoch}, state.step)
                if cfg.eval_every_steps and state.step % cfg.eval_every_steps == 0:
                    evaluated = _evaluate_and_select(c, state, meter)
                    stop = "early_stopping" if c.early_stopping.update(evaluated) else None
                c.checkpointer.after_step(state, loss, evaluated, _epoch_end(c, state))
                if (signum := signals.requested(state.step)) is not None or _slice_done(c, state):
                    raise Interrupted(signum, state.step, c.checkpointer.on_interrupt(state, loss, evaluated))
                if _epoch_end(c, state) is not None:
                    break
            else:
                continue  # stopped mid-epoch: the position stays in this epoch
            state.epoch, state.epoch_step = state.epoch + 1, 0
    final = evaluated if evaluated is not None else _evaluate_and_select(c, state, meter)
    if stop is not None:
        log.info("early stopping at step %d: %s did not improve for %d evaluations", state.step, c.early_stopping.config.metric, c.early_stopping.config.patience)
    if profiler is not None:
        profiler.finish(c.tracker)
    c.checkpointer.on_end(state, final)
    return final


def _epoch_batches(c: Components, state: TrainState) -> Iterator:
    """This epoch's batches from the current position (skipping what a resumed run already saw)."""
    c.pipeline.reset()
    c.policy.reset()
    batches = iter(c.data.train_batches(state.epoch, c.env.rank, c.env.world_size))
    skip = state.epoch_step * c.run.train.grad_accum_steps
    return itertools.islice(batches, skip, None) if skip else batches


def _train_step(c: Components, batches: Iterator, state: TrainState) -> torch.Tensor | None:
    """One optimizer step (its micro-batches); the last micro-batch's loss, or ``None`` at the end of the data."""
    loss = None
    for _ in range(c.run.train.grad_accum_steps):
        try:
            loss, logits, labels = c.pipeline.progress(batches)
            c.train_metrics.update(logits, labels)
        except StopIteration:
            if state.epoch_step == 0:
                raise _no_step_error(c, state) from None
            return None
    return loss


def _no_step_error(c: Components, state: TrainState) -> DataError:
    """The epoch ended before one full step: say how much data the rank had (the data module's account)."""
    accumulation = c.run.train.grad_accum_steps
    why = c.data.explain_empty_epoch(state.epoch, c.env.rank)
    return DataError(f"epoch {state.epoch} gave rank {c.env.rank} no full training step of {c.data.batch_size * accumulation} rows "
                     f"(data.batch_size={c.data.batch_size} x train.grad_accum_steps={accumulation}): {why}")


def _slice_done(c: Components, state: TrainState) -> bool:
    """``train.stop_after_steps`` steps have run in this process (a time slice of a longer run) and the run is
    not over: a slice that ends on the last step finishes the run normally (eval, end checkpoint, FINISHED)."""
    limit = c.run.train.stop_after_steps
    return limit is not None and state.step - c.state.step >= limit and state.step < c.total_steps


def _epoch_end(c: Components, state: TrainState) -> int | None:
    """The epoch that just ended with this step, if one did (epoch length known up front)."""
    return state.epoch if c.steps_per_epoch and state.epoch_step >= c.steps_per_epoch else None


def _evaluate_and_select(c: Components, state: TrainState, meter: Throughput) -> dict[str, float]:
    """Evaluate, log, and keep the best checkpoint when the watched metric improved."""
    with meter.paused():
        metrics = evaluate(c)
        _log(c, metrics, state.step)
        c.checkpointer.maybe_save_best(state, metrics)
    return metrics


def evaluate(c: Components) -> dict[str, float]:
    """Each task's configured eval metrics over this rank's eval batches, combined over all ranks (EMA weights if configured)."""
    metrics = TaskEvalMetrics(c.run.metrics, c.tasks, c.env.device)
    key = c.run.metrics.grouping_key
    batches = c.data.eval_batches(c.env.rank, c.env.world_size)
    limit = c.run.train.eval_max_batches
    weights = c.ema.swapped_in() if c.ema is not None and c.run.train.ema.eval_with_ema else contextlib.nullcontext()
    with detached(c.pipeline, c.model) as model, weights:
        model.eval()
        with torch.no_grad():
            for batch in itertools.islice(batches, limit):
                batch = batch.to(c.env.device, non_blocking=True)
                _, (_, logits, labels) = model(batch)
                groups = {"groups": grouping_ids(batch.sparse_features, key)} if key else {}
                metrics.update(logits, labels, **groups)
        model.train()
    return metrics.compute()


def _data_metrics(c: Components) -> dict[str, float]:
    """The data module's counters (e.g. ``data/bad_rows_skipped``) summed over ranks; empty if it keeps none."""
    counters = c.data.metrics()
    if not counters or c.env.world_size == 1:
        return dict(counters)
    keys = sorted(counters)
    totals = torch.tensor([float(counters[k]) for k in keys], dtype=torch.float64, device=c.env.device)
    torch.distributed.all_reduce(totals)
    return dict(zip(keys, totals.tolist(), strict=True))


def learning_rates(optimizer: GroupedOptimizer) -> dict[str, float]:
    """Current lr of each optimizer group (``lr/sparse``, ``lr/dense``, ``lr/part.<name>``) from its first param group."""
    return {f"lr/{group.key}": float(opt.param_groups[0]["lr"]) for group, opt in optimizer.groups if opt.param_groups}


def _log(c: Components, metrics: dict[str, float], step: int) -> None:
    c.tracker.log_metrics(metrics, step)
    if c.env.is_main:
        parts = [f"{k}={v:.4g}" for k, v in metrics.items() if k != "train/eta_s"]
        eta = metrics.get("train/eta_s")
        suffix = f" eta={eta:.0f}s" if eta is not None else ""
        log.info("step %d/%d %s%s", step, c.total_steps, " ".join(parts), suffix)
