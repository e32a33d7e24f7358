"""The training loop: steps or epochs, periodic eval, checkpoints, stopping, logging. Nothing else.

Per-step mechanics (moving the batch, forward, backward, optimizer step, input distribution of
the next batch) belong to the TrainPipeline and the step policy (:mod:`recsys_runner.train.stepping`);
building and restoring belong to :mod:`recsys_runner.build`; what a checkpoint holds to
:mod:`recsys_runner.checkpoint`. A step is one optimizer step (``train.grad_accum_steps``
micro-batches). Before a launch's first step a sanity eval (``train.sanity_eval_batches``, :func:`_sanity_eval`) runs the
eval's per-batch path on a few eval batches and discards it, so an error only the eval meets stops the run before the
training, not after it. Training stops at ``loop.total_steps``, on early stopping, on a signal
(:mod:`recsys_runner.train.signals`), on a non-finite loss (:mod:`recsys_runner.train.stopping`) or when another rank
is lost (:class:`~recsys_runner.distributed.peers.RankLost`, with the last complete checkpoint).

A signal is handled from the sanity eval to the end checkpoint. One that comes before the sanity eval ends stops the run
before the first step, with no step trained and nothing written: with one rank the sanity eval is abandoned between two
eval batches, with several it ends first and the ranks agree on the signal after it (:func:`_sanity_eval`); the
:class:`~recsys_runner.train.signals.Interrupted` names the checkpoint the launch resumed from, or none (without a
sanity eval, ``train.sanity_eval_batches=0``, such a signal is taken after the first step). During the steps the current
step ends, its checkpoint is written and :class:`~recsys_runner.train.signals.Interrupted` is raised. During an eval,
periodic or final, with one rank, the eval is abandoned between two pieces of its work (an eval batch; with an item
catalogue, a chunk of the item index, of the items a query batch is ranked against, of the items mined: the evaluator's
``stop`` hook), so the stop comes within one chunk's work, not after the whole eval: nothing of the eval is logged, the
checkpoint of its step is written without eval metrics and the run is interrupted there; a resume evaluates that step
first (a periodic eval before the next step, so early stopping and the best checkpoint see it; the final eval).
Abandoning a periodic eval is safe: the eval changes nothing a checkpoint holds until it returns (the EMA weights are
swapped back and the pipeline reattached in its ``finally`` blocks, mined negatives are stored only whole) and its step
is evaluated again. With several ranks an eval ends first, so that no rank leaves its collectives early, and the ranks
agree on the signal right after it, not only every ``train.stop_check_every_steps`` steps: the run stops after the step's
checkpoint, written with the eval's metrics (or after the end checkpoint), and every rank has trained the same steps; a
signal after the eval lets its checkpoint be written, then interrupts. A signal while the loop waits on an object store (a checkpoint write, a unit read ahead) is
taken there at once, since a stalled store can hold a step for its whole retry bound: the run is interrupted with its
last complete checkpoint (:func:`~recsys_runner.train.fault_ends.store_wait`; the loop's other endings on a fault are
there too).

A step's eval metrics are logged once per MLflow run: a resumed run does not evaluate again the step it resumes at when
an earlier launch completed and logged that eval. Its checkpoint recorded them (``TrainState.metrics``); or, when that
checkpoint was written before the eval completed (at an abandoned eval, redone by a launch that was then stopped after
it), the MLflow run holds them at that step (``Tracker.logged_at``). Those metrics are then the step's result.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from recsys_runner.checkpoint.config import TrainState
from recsys_runner.checkpoint.policy import Checkpointer
from recsys_runner.data.base import DataModule
from recsys_runner.data.encoding.stored import oov_rates, unfitted_vocabularies
from recsys_runner.distributed.config import DistributedConfig
from recsys_runner.distributed.env import DistEnv, decided_on_rank0
from recsys_runner.errors import DataError
from recsys_runner.models.collision import collision_counters, collision_rates
from recsys_runner.progress import Progress
from recsys_runner.tracking.tracker import Tracker
from recsys_runner.train import fault_ends
from recsys_runner.train.batch_checks import checked_batches
from recsys_runner.train.config import TrainConfig
from recsys_runner.train.evaluation import BestEval, Evaluator
from recsys_runner.train.log_line import in_the_line, line_extra, on_the_bar
from recsys_runner.train.profiling import StepProfiler
from recsys_runner.train.signals import Interrupted, StopSignals
from recsys_runner.train.stepping import Stepper
from recsys_runner.train.stopping import EarlyStopping
from recsys_runner.train.summaries import Summaries
from recsys_runner.train.throughput import Throughput

log = logging.getLogger(__name__)


@dataclass
class Loop:
    """What the loop drives, and nothing else; built by :func:`recsys_runner.build.build`.

    Attributes:
        config: the ``train`` section (length, logging, eval cadence, slices, profiling).
        env: rank, world size and device.
        data: the data module (this epoch's batches, its counters).
        stepper: one optimizer step: pipeline, step policy, lr schedule, train metrics.
        evaluator: evaluation between steps and at the end.
        checkpointer: the whole checkpoint policy (when, what, NaN refusal, best).
        early_stopping: stops when the watched eval metric stops improving.
        tracker: where metrics are logged (MLflow, or nothing off rank 0).
        total_steps: optimizer steps of the whole run (``train.num_steps``, epochs × steps per epoch, or the data's default).
        steps_per_epoch: optimizer steps per epoch when the data's size is known up front.
        state: where training starts (step, epoch, position in it), restored from a checkpoint or new.
        best: the best eval of the watched metric so far, reported beside the last.
        summaries: gradient norms, embedding row norms, lrs, histograms every ``train.summary_every_steps`` (or nothing).
        unfitted: the vocabularies said to miss too many training values (each said once).
        profile_dir: where ``train.profile`` writes its traces (``<run dir>/profile`` under the CLI); ``None``: a new
            temporary folder (:class:`~recsys_runner.train.profiling.StepProfiler`).
        stuck_after_signal_s: ``distributed.stuck_after_signal_s`` (:func:`~recsys_runner.train.fault_ends.when_stuck`).
    """

    config: TrainConfig
    env: DistEnv
    data: DataModule
    stepper: Stepper
    evaluator: Evaluator
    checkpointer: Checkpointer
    early_stopping: EarlyStopping
    tracker: Tracker
    total_steps: int
    steps_per_epoch: int | None
    state: TrainState
    best: BestEval
    summaries: Summaries
    unfitted: set[str] = field(default_factory=set)
    """Columns whose vocabulary was said to miss too many training values (:func:`_warn_unfitted`): each is said once."""
    profile_dir: Path | None = None
    stuck_after_signal_s: float = DistributedConfig.stuck_after_signal_s


def train(loop: Loop) -> dict[str, float]:
    """Train from ``loop.state`` up to ``loop.total_steps`` steps; return the final eval metrics."""
    cfg, env, state = loop.config, loop.env, dataclasses.replace(loop.state)
    meter = Throughput(loop.total_steps, features=loop.data.features, micro_batches=cfg.grad_accum_steps,
                       world_size=env.world_size, device=env.device)  # counts the rows each step really trained
    profiler = (StepProfiler(cfg.profile, env.device, env.rank, loop.profile_dir, first_step=state.step)
                if cfg.profile.enabled else None)
    stop: str | None = None
    evaluated: dict[str, float] | None = None
    last_loss: torch.Tensor | None = None  # the NaN guard checks it before a checkpoint written after the steps
    with (StopSignals(env.world_size, env.device, cfg.stop_check_every_steps, stuck_after_s=loop.stuck_after_signal_s,
                      on_stuck=fault_ends.when_stuck(loop.checkpointer, loop.tracker, state)) as signals,
          Progress(loop.total_steps, enabled=env.is_main, unit="step", initial=state.step, mode=cfg.progress) as progress,
          fault_ends.rank_lost(loop.checkpointer, env.world_size, state), fault_ends.store_wait(loop.checkpointer, state),
          fault_ends.stopped_again(loop.checkpointer, state)):
        _sanity_eval(loop, state, signals, meter)
        evaluated, stop = _resumed_eval(loop, state, signals, meter, progress)
        while state.step < loop.total_steps and stop is None:
            batches = meter.counted(_epoch_batches(loop, state))
            while state.step < loop.total_steps and stop is None:
                loss = loop.stepper.step(batches)
                if loss is None:  # the data ran out: the epoch is over
                    if state.epoch_step == 0:
                        raise _no_step_error(loop, state)
                    state.epoch, state.epoch_step = state.epoch + 1, 0
                    break
                state.step, state.epoch_step, evaluated = state.step + 1, state.epoch_step + 1, None
                meter.update(loss)
                last_loss = loss
                progress.update(1)
                if profiler is not None:
                    profiler.step(state.step)
                loop.summaries.after_step(state.step)
                if state.step % cfg.log_every_steps == 0 or state.step == loop.total_steps:
                    logged = meter.flush(state.step)
                    loop.checkpointer.loss_logged(state.step, logged["train/loss"])
                    _log(loop, logged | loop.stepper.learning_rates() | loop.stepper.loss_scale() | loop.stepper.task_losses()
                         | loop.stepper.train_metrics.compute() | _data_metrics(loop) | {"train/epoch": state.epoch}, state.step, progress)
                if loop.steps_per_epoch and state.epoch_step >= loop.steps_per_epoch:
                    state.epoch, state.epoch_step = state.epoch + 1, 0  # before any checkpoint of this step: see _epoch_end
                if _eval_due(loop, state):
                    evaluated = _periodic_eval(loop, state, loss, signals, meter, progress)
                    stop = "early_stopping" if loop.early_stopping.update(evaluated) else None
                loop.checkpointer.after_step(state, loss, evaluated, _epoch_end(loop, state))
                if (signum := signals.requested(state.step, evaluated=evaluated is not None)) is not None or _slice_done(loop, state):
                    raise Interrupted(signum, state.step, loop.checkpointer.on_interrupt(state, loss, evaluated), agreed=True)
                if state.epoch_step == 0:  # the epoch ended with this step
                    break
        final = evaluated if evaluated is not None else _final_eval(loop, state, last_loss, signals, meter, progress)
        if stop is not None:
            log.info("early stopping at step %d: %s did not improve for %d evaluations", state.step,
                     loop.early_stopping.config.metric, loop.early_stopping.config.patience)
        if env.is_main:
            log.info("%s", loop.best.summary(final))
        if profiler is not None:
            profiler.finish(loop.tracker)
        loop.checkpointer.on_end(state, final)
        if (signum := signals.agreed()) is not None:  # came during the end checkpoint: it is written, then stop
            raise Interrupted(signum, state.step, loop.checkpointer.save_guarded(state, last_loss, final),
                              when="at the end of training", agreed=True)
    return final


class _Abandoned(Exception):
    """A signal asked to stop during an eval (raised between two pieces of its work)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _StopBetweenChunks:
    """The evaluator's ``stop`` hook: between two pieces of an eval's work, raise :class:`_Abandoned` if a signal asked
    to stop (a point where the eval's own ``finally`` blocks, EMA weights swapped back and the pipeline reattached,
    still run)."""

    def __init__(self, signals: StopSignals) -> None:
        self._signals = signals

    def __call__(self) -> None:
        if self._signals.signum is not None:
            raise _Abandoned(self._signals.signum)


def _stop_hook(loop: Loop, signals: StopSignals) -> Callable[[], None] | None:
    """The eval's ``stop`` hook with one rank; none with several (every rank must finish the eval's collectives)."""
    return _StopBetweenChunks(signals) if loop.env.world_size == 1 else None


def _periodic_eval(loop: Loop, state: TrainState, loss: torch.Tensor | None, signals: StopSignals, meter: Throughput,
                   progress: Progress) -> dict[str, float]:
    """The eval of this step; a signal during it with one rank abandons it, writes the checkpoint of this step without
    eval metrics and raises :class:`Interrupted`, so a resume evaluates this step again before the next one."""
    try:
        return _evaluate_and_select(loop, state, meter, progress, _stop_hook(loop, signals))
    except _Abandoned as e:
        raise Interrupted(e.signum, state.step, loop.checkpointer.save_guarded(state, loss, None), when="during the eval") from None


def _final_eval(loop: Loop, state: TrainState, loss: torch.Tensor | None, signals: StopSignals, meter: Throughput,
                progress: Progress) -> dict[str, float]:
    """The final eval; a signal before it, or during it with one rank (abandoned between two pieces of its work), writes
    the checkpoint of this step and raises :class:`Interrupted`, so a resume evaluates again. With several ranks the eval
    ends first (one rank must not leave its collectives early) and the signal stops the run after the end checkpoint."""
    signum = signals.agreed()
    if signum is None:
        try:
            return _evaluate_and_select(loop, state, meter, progress, _stop_hook(loop, signals))
        except _Abandoned as e:
            signum = e.signum
    raise Interrupted(signum, state.step, loop.checkpointer.save_guarded(state, loss, None), when="during the final eval",
                      agreed=True)


def _sanity_eval(loop: Loop, state: TrainState, signals: StopSignals, meter: Throughput) -> None:
    """Before this launch's first step, the eval's per-batch path on ``train.sanity_eval_batches`` eval batches, discarded
    (:meth:`Evaluator.sanity_check`), so that an eval-only error stops the run before the training, not after it; one log
    line says it ran (batches, seconds) or why not. Skipped when this launch trains no step (a resume at the last step: the
    final eval comes at once). Its time is left out of the first samples/s window (``meter``).

    A signal before it ends stops the run before the first step (:func:`_before_first_step`), rather than after a step
    whose checkpoint nobody asked for: with one rank it is abandoned between two eval batches (:func:`_stop_hook`); with
    several it ends first (its gathers are collectives every rank must finish) and the ranks then agree on the signal."""
    wanted = loop.config.sanity_eval_batches
    if not wanted or state.step >= loop.total_steps:
        if loop.env.is_main:
            why = "train.sanity_eval_batches=0" if not wanted else f"no step to train in this launch (at step {state.step} of {loop.total_steps})"
            log.info("sanity eval skipped: %s", why)
        return
    start = time.perf_counter()
    try:
        with meter.paused():
            ran = loop.evaluator.sanity_check(wanted, stop=_stop_hook(loop, signals))
    except _Abandoned as e:
        raise _before_first_step(e.signum, state) from None
    if loop.env.is_main:
        log.info("sanity eval: %d eval batches (forward, metric updates and compute; nothing logged) in %.2fs before step %d "
                 "(train.sanity_eval_batches=%d, 0 turns it off)", ran, time.perf_counter() - start, state.step + 1, wanted)
    if (signum := signals.agreed()) is not None:
        raise _before_first_step(signum, state)


def _before_first_step(signum: int, state: TrainState) -> Interrupted:
    """The stop on a signal that came by the end of the sanity eval: no step trained, no checkpoint written. A resumed
    launch names the checkpoint it resumed from (its command resumes there again); a new run kept nothing (``step``
    ``None``: the entry point prints the command that runs it again, as for a signal while it was being built)."""
    kept = state.resumed_from
    return Interrupted(signum, state.step if kept is not None else None, kept, when="during the sanity eval", agreed=True)


def _resumed_eval(loop: Loop, state: TrainState, signals: StopSignals, meter: Throughput,
                  progress: Progress) -> tuple[dict[str, float] | None, str | None]:
    """The eval of the step a resumed run starts at, if one is due there: ``(its metrics, "early_stopping" or None)``.

    An eval an earlier launch completed and logged is not run again (module docstring): recorded by the checkpoint,
    which was written after it (early stopping and the best already count it), or found in the MLflow run (the
    checkpoint came before it, so early stopping and the best take it now). A periodic eval abandoned on a signal runs
    now, before the next step; a final eval that did not complete is left to :func:`_final_eval`."""
    start, keys = loop.state, loop.evaluator.keys()
    if start.step == 0 or not (start.step == loop.total_steps or _eval_due(loop, state)):
        return None, None
    if start.metrics and set(keys) <= set(start.metrics):
        _not_again(loop, "its checkpoint recorded it")
        return {k: start.metrics[k] for k in keys}, "early_stopping" if loop.early_stopping.stopped() else None
    logged = decided_on_rank0(lambda: loop.tracker.logged_at(start.step, keys), loop.env.rank, loop.env.world_size)
    if logged is not None:
        _not_again(loop, "the MLflow run holds its metrics at this step")
        loop.best.update(logged, start.step)
        loop.checkpointer.maybe_save_best(state, logged)
    elif start.step < loop.total_steps:
        logged = _periodic_eval(loop, state, None, signals, meter, progress)
        if (signum := signals.agreed()) is not None:  # came during it (several ranks end it first): stop right after it
            raise Interrupted(signum, state.step, loop.checkpointer.save_guarded(state, None, logged), agreed=True)
    else:
        return None, None
    return logged, "early_stopping" if loop.early_stopping.update(logged) else None


def _not_again(loop: Loop, why: str) -> None:
    """One line: the eval of the resumed step is not run again, and why."""
    if loop.env.is_main:
        log.info("step %d: its eval was completed and logged by an earlier launch (%s); not evaluated again", loop.state.step, why)


def _epoch_batches(loop: Loop, state: TrainState) -> Iterator:
    """This epoch's batches from the current position (skipping what a resumed run already saw), each one's labels checked
    by the model's tasks on the host as it is read (:mod:`recsys_runner.train.batch_checks`: no sync in the step)."""
    loop.stepper.reset()
    batches = iter(loop.data.train_batches(state.epoch, loop.env.rank, loop.env.world_size))
    skip = state.epoch_step * loop.config.grad_accum_steps
    return iter(checked_batches(itertools.islice(batches, skip, None) if skip else batches, loop.evaluator.tasks, "training batch"))


def _no_step_error(loop: Loop, state: TrainState) -> DataError:
    """The epoch ended before one full step: say how much data the rank had (the data module's account)."""
    accumulation, batch_size = loop.config.grad_accum_steps, loop.data.batch_size
    why = loop.data.explain_empty_epoch(state.epoch, loop.env.rank)
    tokens = getattr(getattr(loop.data, "config", None), "batch_tokens", None)
    sized = f"data.batch_tokens={tokens}: ~{batch_size} rows a batch" if tokens is not None else f"data.batch_size={batch_size}"
    return DataError(f"epoch {state.epoch} gave rank {loop.env.rank} no full training step of {batch_size * accumulation} rows "
                     f"({sized} x train.grad_accum_steps={accumulation}): {why}")


def _slice_done(loop: Loop, state: TrainState) -> bool:
    """``train.stop_after_steps`` steps have run in this process (a time slice of a longer run) and the run is
    not over: a slice that ends on the last step finishes the run normally (eval, end checkpoint, FINISHED)."""
    limit = loop.config.stop_after_steps
    return limit is not None and state.step - loop.state.step >= limit and state.step < loop.total_steps


def _epoch_end(loop: Loop, state: TrainState) -> int | None:
    """The epoch that just ended with this step, if one did (epoch length known up front).

    At an epoch's end the position is the next epoch's start (``epoch + 1``, ``epoch_step`` 0), set right after the step,
    before its eval and checkpoint: a checkpoint then says "start epoch ``e + 1``", which holds on any number of ranks and
    DataLoader workers. ``epoch_step`` = the steps of epoch ``e`` would not: that count of batches is the whole epoch
    only for the shards that wrote it, so a resume cutting the epoch otherwise (2 ranks to 1) would train its rows again
    and warn of a mid-epoch change. A checkpoint written before positions rolled at the end still reads as its epoch's end."""
    if not loop.steps_per_epoch or state.step == 0:
        return None
    if state.epoch_step == 0:
        return state.epoch - 1
    return state.epoch if state.epoch_step >= loop.steps_per_epoch else None


def _eval_due(loop: Loop, state: TrainState) -> bool:
    """Whether this step evaluates: every ``train.eval_every_steps`` steps, or at the end of every
    ``train.eval_every_epochs``-th epoch (once when both fall on the same step)."""
    cfg, ended = loop.config, _epoch_end(loop, state)
    by_steps = cfg.eval_every_steps is not None and state.step % cfg.eval_every_steps == 0
    return by_steps or (cfg.eval_every_epochs is not None and ended is not None and (ended + 1) % cfg.eval_every_epochs == 0)


def _evaluate_and_select(loop: Loop, state: TrainState, meter: Throughput, progress: Progress,
                         stop: Callable[[], None] | None = None) -> dict[str, float]:
    """Evaluate, log (with ``best/<metric>`` when the watched metric improved), and keep the best checkpoint; ``stop``
    is called between two pieces of the eval's work (:meth:`Evaluator.evaluate`)."""
    with meter.paused():
        metrics = loop.evaluator.evaluate(stop=stop)
        _log(loop, metrics, state.step, progress)
        if best := loop.best.update(metrics, state.step):
            loop.tracker.log_metrics(best, state.step)
        loop.checkpointer.maybe_save_best(state, metrics)
    return metrics


def _data_metrics(loop: Loop) -> dict[str, float]:
    """The data module's counters (e.g. ``data/bad_rows_skipped``, each vocabulary's ``data/oov_rate/<column>``) and the
    model's managed-collision tables' counters (``mc/<table>/…``, since the last log), summed over ranks in one
    reduction; empty if neither keeps any."""
    counters = loop.data.metrics() | collision_counters(loop.evaluator.model)
    if counters and loop.env.world_size > 1:
        keys = sorted(counters)
        totals = torch.tensor([float(counters[k]) for k in keys], dtype=torch.float64, device=loop.env.device)
        torch.distributed.all_reduce(totals)
        counters = dict(zip(keys, totals.tolist(), strict=True))
    if loop.env.is_main:
        _warn_unfitted(loop, counters)
    return oov_rates(collision_rates(dict(counters)))


def _warn_unfitted(loop: Loop, counters: dict[str, float]) -> None:
    """Say once per column that its vocabulary misses a share of the training values no fair sample would
    (:func:`~recsys_runner.data.encoding.stored.unfitted_vocabularies`): those values all share its few OOV rows, which
    ``data/oov_rate/<column>`` shows but no line said."""
    for name, (share, values) in unfitted_vocabularies(counters).items():
        if name not in loop.unfitted:
            loop.unfitted.add(name)
            log.warning("the vocabulary of %r lacks %.0f%% of the %d values of it that training has read so far (data/oov_rate/%s): "
                        "they all share its few OOV rows. It was fitted on data.infer.sample_rows rows of data.path (runs "
                        "spread over the files; the first rows of each compressed text file, and for a checkpoint written "
                        "before encoders were stored) or read from its vocab_file, which looked to cover the column, so the "
                        "rows outside the sample hold other values: files sorted by time (Avazu's hour, ids that appear later) "
                        "hold them between the runs or after the first rows. Fix: data.infer.sample_rows=<every row of the "
                        "files> to fit on all of them, shuffle the files' rows once, or convert a compressed text file to "
                        "Parquet (python -m recsys_runner.data convert), whose sample is spread over all its rows",
                        name, 100 * share, values, name)


def _log(loop: Loop, metrics: dict[str, float], step: int, progress: Progress) -> None:
    """To the tracker, and one ``step N/M ...`` line; with a progress bar up, train lines only reach the log
    file (the bar shows loss and samples/s), eval lines are printed above it and their values join the bar."""
    loop.tracker.log_metrics(metrics, step)
    if loop.env.is_main:
        eta = metrics.get("train/eta_s")
        suffix = line_extra(metrics) + (f" eta={eta:.0f}s" if eta is not None else "")
        parts = [f"{k}={v:.4g}" for k, v in in_the_line(metrics).items()]
        training = "train/loss" in metrics
        log.info("step %d/%d %s%s", step, loop.total_steps, " ".join(parts), suffix, extra=progress.shown_on_bar() if training else None)
        progress.set_postfix(**on_the_bar(metrics))
