"""Build the run's object graph from the validated config, in one fixed order.

The order is TorchRec's: process group → tracker (rank 0 checks its store and the local folders it writes:
TensorBoard's, the artifacts'; every rank the profiler's) and checkpointer (rank 0
locks its directory), both before anything expensive → data → model with embedding tables on
``meta`` → fused sparse optimizer attached → sharding plan → DistributedModelParallel → dense
optimizers over what is left → lr schedules → step policy → train pipeline → restore (a resumed or
fine-tuned state is loaded last, once everything it loads into exists). Every component is built by
its own config object (``run.model.build(features=…, dense_device=…)``, :mod:`recsys_runner.configurable`),
given only the runtime objects that exist here (the data's features, the device, the parameters left
after sharding, the step count). The model config's declared data needs (``data_needs()``) reach the data
config before the data is built, so generated data shapes itself to the model (``for_model``);
file-backed data keeps its columns and the model checks them. Nothing here knows a model's or an
optimizer's name, and nothing reads the composed ``DictConfig``: ``run`` is the only config.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recsys_runner import store_settings
from recsys_runner.checkpoint.config import TrainState
from recsys_runner.checkpoint.policy import Checkpointer
from recsys_runner.config import RunConfig
from recsys_runner.config_metrics import check_eval_keys
from recsys_runner.data.base import DataModule
from recsys_runner.data.files.downsample import negative_rate, start_line
from recsys_runner.data.files.tabular_config import TabularDataConfig
from recsys_runner.data_build import build_data
from recsys_runner.distributed.env import DistEnv, decided_on_rank0
from recsys_runner.distributed.sharding import Distributed
from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec
from recsys_runner.metrics.registry import default_objective, higher_is_better
from recsys_runner.metrics.tasks import TaskTrainMetrics, eval_metric_keys
from recsys_runner.models.common import store_tables
from recsys_runner.models.train_wrapper import TaskWeighting, TrainWrapper
from recsys_runner.optim.config import OptimConfig
from recsys_runner.optim.optimizers import DENSE, SPARSE, GroupedOptimizer, OptimizerGroup, decay_summary, dense_optimizers
from recsys_runner.optim.schedulers import Schedule, ScheduledLR, SchedulePosition, SchedulerConfig, schedule_error
from recsys_runner.optim.schedulers import lr_scheduler as make_lr_scheduler
from recsys_runner.optim.sparse import apply_sparse_optimizer, sparse_accumulation_warning
from recsys_runner.runtime import Launch
from recsys_runner.tasks import SINGLE_TASK, logit_shift
from recsys_runner.tracking import lineage
from recsys_runner.tracking.tensorboard import LOGDIR_NAME, TensorBoardTracker
from recsys_runner.tracking.tracker import MlflowTrackingConfig, NullTracker, Tracker
from recsys_runner.train.compile import check_static_shapes, compile_dense
from recsys_runner.train.config import TrainConfig
from recsys_runner.train.ema import DenseEMA
from recsys_runner.train.evaluation import BestEval, Evaluator
from recsys_runner.train.loop import Loop
from recsys_runner.train.pipeline import make_pipeline
from recsys_runner.train.profiling import PROFILE_DIR_NAME, check_profile_window, check_trace_folder
from recsys_runner.train.stepping import Stepper, StepPolicy, dense_ddp
from recsys_runner.train.stopping import EarlyStopping
from recsys_runner.train.summaries import Summaries
from recsys_runner.train.weighting import WeightingPosition

log = logging.getLogger(__name__)

MANY_EPOCHS = 10
"""A run longer than this many epochs of file-backed data gets a warning: it sees every row that often."""
FEW_EPOCH_STEPS = 50
"""An epoch of file-backed data shorter than this many optimizer steps gets a warning, with a batch size that fits."""
MOST_ROWS_LEFT_OUT = 0.05
"""An epoch of file-backed data that ``data.drop_remainder`` leaves more than this share of the training rows out of gets a
warning, with the shards that cause it and the fix."""


@dataclass
class Components:
    """A built run: the loop and what only the entry point needs around it; closed by :meth:`close`.

    Attributes:
        run: the validated config the run was built from.
        env: rank, world size and device.
        distributed: the process group and planner (closed at the end).
        plan: the sharding plan (logged as an artifact).
        loop: what :func:`recsys_runner.train.loop.train` drives.
    """

    run: RunConfig
    env: DistEnv
    distributed: Distributed
    plan: ShardingPlan
    loop: Loop

    def close(self) -> None:
        """Release the checkpoint directory and the process group (the tracker is finished by the runner, with a status)."""
        self.loop.checkpointer.close()
        self.distributed.close()


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (dense init, dropout) identically on every rank."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build(run: RunConfig, *, launch: Launch = Launch(), weights: Path | None = None) -> Components:
    """Build and wire every component of the run from the validated config; see the module docstring for the order.

    ``launch``: the command-line launch (:class:`~recsys_runner.runtime.Launch`; the default is a launch from Python),
    which sets the checkpoint directory's default and the overrides each checkpoint records.

    ``weights``: a checkpoint directory whose model (and EMA) weights to load instead of resuming or fine-tuning: its
    checkpoints directory is not locked, nothing is restored from ``checkpoint.*`` and a mismatching model config is
    refused (:meth:`Checkpointer.load_weights`). The whole training graph around a checkpoint's weights, e.g. to check
    the inference graph against it; evaluate and predict build only what scoring uses
    (:func:`recsys_runner.inference_build.build_inference`).
    """
    seed_everything(run.seed)
    store_settings.configure(run.storage)
    distributed: Distributed = run.distributed.build()
    env = distributed.setup()
    checkpointer: Checkpointer | None = None
    try:
        tracker = build_tracker(run, launch) if env.is_main else NullTracker()
        decided_on_rank0(tracker.check, env.rank, env.world_size)  # the store, and the folders the tracker writes
        profile_dir = launch.under_output_dir(PROFILE_DIR_NAME)
        if run.train.profile.enabled:
            check_trace_folder(profile_dir)
        checkpointer = run.checkpoint.build(rank=env.rank, world_size=env.world_size, device=env.device, nan_guard=run.train.nan_guard,
                                            launch=launch, run_checkpoints=init_from_runs(run))
        if weights is None:
            checkpointer.lock()
        precision = run.precision.build()
        precision.apply_tf32()
        data = build_data(run, env.device, weights if weights is not None else checkpointer.restore_source(),
                          checkpointer if weights is None else None)
        steps_per_epoch = _steps_per_epoch(data, env.world_size, run.train.grad_accum_steps)
        total_steps = _total_steps(run, steps_per_epoch, log_choice=env.is_main, world_size=env.world_size)
        check_profile_window(run.train.profile, total_steps)
        if env.is_main:
            _warn_rows_left_out(run, data, env.world_size)
            if (rate := negative_rate(run.served_data)) is not None:
                log.info("%s", start_line(rate))
        check_eval_cadence(run.train, steps_per_epoch)
        check_static_shapes(run.train.compile, data.features)
        model = with_catalogue(build_model(run, data.features, env.device), data)
        wrapped = TrainWrapper(model, autocast=precision.autocast(env.device), features=data.features,
                               weighting=_loss_weighting(run, model), logit_shift=logit_shift(negative_rate(run.served_data)))
        check_eval_keys(run, wrapped.tasks, data.features.sparse_names, type(model).__name__)  # before the tracker starts a run
        apply_sparse_optimizer(wrapped, run.optim.sparse)
        plan = distributed.plan(wrapped, batch_size=data.batch_size)
        sharded = distributed.shard(wrapped, plan)
        compile_dense(model, run.train.compile, wrapper=wrapped)  # the same module objects DMP now holds
        optimizer, lr_scheduler, policy = _optimizers(run, sharded, precision.grad_scaler(env.device), total_steps, steps_per_epoch)
        if env.is_main:
            _say_weight_decay(run.optim, policy.dense)
        if env.is_main and (caveat := sparse_accumulation_warning(run.optim.sparse, run.train.grad_accum_steps, run.data.batch_size)):
            log.warning("%s", caveat)
        if env.is_main and (said := precision.line(env.device)):
            log.info("%s", said)
        if env.is_main and (rounding := precision.table_rounding_warning(env.device)):
            log.warning("%s", rounding)
        if env.is_main and (unused := precision.unused_scaler_warning()):
            log.warning("%s", unused)
        ema = policy.ema
        pipeline = make_pipeline(run.distributed.pipeline, env, sharded, policy.dense, policy, annotate=run.train.profile.enabled,
                                 semi_sync_start_batch=run.distributed.semi_sync_start_batch)  # the fused lr is pushed by the Stepper
        stepper = Stepper(pipeline=pipeline, policy=policy, lr_scheduler=lr_scheduler, optimizer=optimizer,
                          train_metrics=TaskTrainMetrics(run.metrics, wrapped.tasks, env.device),
                          accumulation_steps=run.train.grad_accum_steps, weighting=wrapped.weighting)
        evaluator = Evaluator(model=sharded, pipeline=pipeline, data=data, env=env, tasks=wrapped.tasks, metrics=run.metrics,
                              max_batches=run.train.eval_max_batches, ema=ema if run.train.ema.eval_with_ema else None)
        early_stopping = EarlyStopping(run.train.early_stopping)
        best = watched_eval(run, eval_metric_keys(run.metrics, wrapped.tasks))
        checkpointer.attach(
            model=sharded, optimizer=optimizer, tensors={"ema": ema} if ema is not None else {},
            objects={"lr_scheduler": SchedulePosition(lr_scheduler), "policy": policy, "early_stopping": early_stopping,
                     "train_metrics": stepper.train_metrics, "best_eval": best, "loss_weighting": WeightingPosition(wrapped.weighting)},
        )
        state = _restore(checkpointer, tracker, weights)
    except BaseException:
        if checkpointer is not None:
            checkpointer.close()
        distributed.close()
        raise
    summaries = Summaries(run.train.summary_every_steps, histograms=run.train.summary_histograms, model=sharded, learning_rates=stepper.learning_rates,
                          dense=policy.dense, env=env, tracker=tracker, log_every_steps=run.train.log_every_steps,
                          total_steps=total_steps, next_step=state.step + 1)
    loop = Loop(config=run.train, env=env, data=data, stepper=stepper, evaluator=evaluator, checkpointer=checkpointer,
                early_stopping=early_stopping, tracker=tracker, total_steps=total_steps, steps_per_epoch=steps_per_epoch, state=state,
                best=best, summaries=summaries, profile_dir=profile_dir,
                stuck_after_signal_s=run.distributed.stuck_after_signal_s)
    return Components(run=run, env=env, distributed=distributed, plan=plan, loop=loop)


def _restore(checkpointer: Checkpointer, tracker: Tracker, weights: Path | None) -> TrainState:
    """Restore training (a resume, a fine-tune) or load ``weights``; a training resumed at step ``n`` purges what an
    earlier launch logged to the same TensorBoard folder after step ``n`` (:meth:`TensorBoardTracker.purge_from`)."""
    if weights is not None:
        return checkpointer.load_weights(weights)
    state = checkpointer.restore()
    if state.step > 0 and isinstance(tracker, TensorBoardTracker):
        tracker.purge_from(state.step + 1)
    return state


def build_tracker(run: RunConfig, launch: Launch) -> Tracker:
    """Rank 0's tracker: ``tracking``'s, writing TensorBoard event files too with ``tracking.tensorboard=true``
    (into ``<run dir>/tensorboard``; ``./tensorboard`` from Python)."""
    tracker: Tracker = run.tracking.build()
    if run.tracking.tensorboard:
        logdir = launch.under_output_dir(LOGDIR_NAME)
        elsewhere = "use another run directory (hydra.run.dir=<dir>)" if logdir is not None else "run from another directory"
        tracker = TensorBoardTracker(tracker, logdir or Path(LOGDIR_NAME), elsewhere)
    return tracker


def init_from_runs(run: RunConfig) -> Callable[[str], Path | None]:
    """How ``checkpoint.init_from=<MLflow run id>`` finds the run's checkpoints root: in the store this run logs to
    (``tracking.uri``), as ``load=<run id>`` does (:func:`~recsys_runner.tracking.lineage.run_checkpoints`); with
    ``tracking=none``, an error naming it. Asked only when the run starts from ``init_from`` (not on a resume)."""
    runs = lineage.run_tags(run.tracking.uri) if isinstance(run.tracking, MlflowTrackingConfig) else None
    return functools.partial(lineage.run_checkpoints, runs=runs, key="checkpoint.init_from")


def _loss_weighting(run: RunConfig, model: torch.nn.Module) -> TaskWeighting | None:
    """``train.loss_weighting`` built for the model's tasks; ``None`` for fixed weights (the TrainWrapper's own)."""
    return run.train.loss_weighting.build(tuple(getattr(model, "tasks", SINGLE_TASK)), accumulation_steps=run.train.grad_accum_steps)


def _optimizers(run: RunConfig, sharded: DistributedModelParallel, scaler: torch.amp.GradScaler | None, total_steps: int,
                steps_per_epoch: int | None) -> tuple[GroupedOptimizer, ScheduledLR, StepPolicy]:
    """The dense optimizers over the parameters sharding left (the fused one is the sharded model's), all of them
    combined, their lr schedules, and the step policy (accumulation, loss scaling, clipping, EMA) that steps them."""
    fused = sharded.fused_optimizer
    dense_params = dict(in_backward_optimizer_filter(sharded.named_parameters()))
    parts = {name: (part.pattern, part.optimizer.build) for name, part in run.optim.part_configs().items()}
    dense = dense_optimizers(dense_params, run.optim.dense.build, parts)
    optimizer = GroupedOptimizer([(SPARSE, fused), *dense])
    lr_scheduler = make_lr_scheduler(optimizer, *_schedules(run, total_steps, steps_per_epoch))
    ema = DenseEMA(dense_params, run.train.ema.decay) if run.train.ema.decay is not None else None
    policy = StepPolicy(sparse=fused, dense=GroupedOptimizer(dense), accumulation_steps=run.train.grad_accum_steps,
                        scaler=scaler, clip=run.train.clip_grad, ema=ema, ddp=dense_ddp(sharded))
    return optimizer, lr_scheduler, policy


def _say_weight_decay(optim: OptimConfig, dense: GroupedOptimizer) -> None:
    """Log once how many dense tensors each optimizer decays and how many it excludes, and warn of exclusions that do
    nothing."""
    if summary := decay_summary(dense.groups):
        log.info("%s", summary)
    for caveat in optim.decay_caveats():
        log.warning("%s", caveat)


def _schedules(run: RunConfig, total_steps: int, steps_per_epoch: int | None) -> tuple[dict[OptimizerGroup, Schedule], Schedule]:
    """The per-optimizer-group schedules that replace the default one, and the default."""

    def make(config: SchedulerConfig, where: str) -> Schedule:
        try:
            return config.build(total_steps=total_steps, steps_per_epoch=steps_per_epoch)
        except ConfigError as e:  # e.g. a warmup longer than the run: named by the key of this schedule's slot
            raise schedule_error(where, e) from None

    optim: OptimConfig = run.optim
    default = make(run.scheduler, "scheduler")
    own: dict[OptimizerGroup, Schedule] = {}
    if optim.sparse_scheduler is not None:
        own[SPARSE] = make(optim.sparse_scheduler, "optim.sparse_scheduler")
    dense = make(optim.dense_scheduler, "optim.dense_scheduler") if optim.dense_scheduler is not None else None
    if dense is not None:
        own[DENSE] = dense
    for name, part in optim.part_configs().items():
        if part.scheduler is not None:
            own[OptimizerGroup.part(name)] = make(part.scheduler, f"optim.parts.{name}.scheduler")
        elif dense is not None:
            own[OptimizerGroup.part(name)] = dense
    return own, default


ModelT = TypeVar("ModelT", bound=torch.nn.Module)


def build_model(run: RunConfig, features: FeatureSpec, device: torch.device) -> torch.nn.Module:
    """The model ``model.*`` describes (its dense parameters on ``device``, its tables on ``meta``), each table stored in
    its ``precision.embedding_data_type`` / ``embedding_data_type_by_feature`` type (:func:`~recsys_runner.models.common.store_tables`):
    what training, evaluate, predict, export and a plan all build, so that each sees the tables the checkpoint holds."""
    run.precision.check_features(features.sparse_names)
    return store_tables(run.model.build(features=features, dense_device=device), run.precision.table_data_type)


def with_catalogue(model: ModelT, data: DataModule) -> ModelT:
    """``model``, handed the data's item ids and popularity (``None`` when the data has no catalogue) when it reads them
    (``use_catalogue``: a two-tower model's logQ from the item counts), as copies: the catalogue's arrays may be
    read-only views of Arrow buffers, which ``torch.from_numpy`` warns of."""
    use = getattr(model, "use_catalogue", None)
    table = data.item_table() if use is not None else None
    if use is not None:
        use(*((None, None) if table is None else (torch.tensor(table.ids), torch.tensor(table.popularity))))
    return model


def _steps_per_epoch(data: Any, world_size: int, accumulation: int) -> int | None:
    per_epoch = data.num_train_batches(world_size)
    return per_epoch // accumulation if per_epoch else None


def _total_steps(run: RunConfig, steps_per_epoch: int | None, log_choice: bool = False, world_size: int = 1) -> int:
    """The run's length in optimizer steps: ``train.num_steps``, ``train.num_epochs`` × steps per epoch, or with
    neither the data's default (:meth:`~recsys_runner.data.base.DataConfig.default_num_steps`: one epoch of a file).

    Warns when explicit steps amount to more than :data:`MANY_EPOCHS` passes over file-backed data (a small
    file trained for "the usual 1000 steps"), and when an epoch of it is under :data:`FEW_EPOCH_STEPS` steps and the run
    is counted in epochs (a run of ``train.num_steps`` makes that many updates, however short an epoch);
    ``log_choice`` logs the length the data chose.
    """
    train, data_steps = run.train, run.data.default_num_steps()
    # train.num_steps sets the updates itself (too many passes over the file get the warning below)
    if log_choice and data_steps is None and train.num_steps is None and steps_per_epoch and steps_per_epoch < FEW_EPOCH_STEPS:
        _warn_short_epoch(run, steps_per_epoch, world_size)
    steps = train.num_steps if train.num_steps is not None else data_steps if train.num_epochs is None else None
    if steps is None:
        epochs = train.num_epochs or 1
        if not steps_per_epoch:
            what = f"train.num_epochs={epochs}" if train.num_epochs is not None else "the default length, one epoch of the data,"
            # both set is refused too: name the pair, or the fix's first half meets that error next (a preset's epochs)
            steps_fix = "train.num_steps=<steps> train.num_epochs=null" if train.num_epochs is not None else "train.num_steps=<steps>"
            raise ConfigError(
                f"{what} needs to know how many steps an epoch has before reading the data, and this data does not say "
                f"(its size is known only after reading: with data.on_bad_rows=skip, data.negative_rate or data.batch_tokens) or "
                f"has no full step per rank. "
                f"Fix: set {steps_fix}, or use more data / a smaller data.batch_size / train.grad_accum_steps"
            )
        if log_choice and train.num_epochs is None:
            log.info("training one epoch of the data: %d steps (set train.num_epochs or train.num_steps to change)", steps_per_epoch)
        return epochs * steps_per_epoch
    if log_choice and train.num_steps is None:
        log.info("training %d steps, the default of %s (set train.num_steps or train.num_epochs to change)", steps, type(run.data).__name__)
    if data_steps is None and steps_per_epoch and steps > MANY_EPOCHS * steps_per_epoch and log_choice:
        log.warning("train.num_steps=%d is %.1f epochs of this data (%d steps each): every row is seen ~%d times. For one pass "
                    "over it leave train.num_steps unset (the default for file data: one epoch) or set train.num_epochs=1; "
                    "else fewer steps", steps, steps / steps_per_epoch, steps_per_epoch, steps // steps_per_epoch)
    return steps


def _warn_short_epoch(run: RunConfig, steps_per_epoch: int, world_size: int) -> None:
    """Say that an epoch is under :data:`FEW_EPOCH_STEPS` steps, with its rows and a batch size (a power of 2) giving more."""
    accumulation = run.train.grad_accum_steps
    rows = steps_per_epoch * run.data.batch_size * accumulation * world_size
    most = rows // (FEW_EPOCH_STEPS * accumulation * world_size)
    batch = 1 << max(most.bit_length() - 1, 0)
    log.warning("an epoch of this data is only %d optimizer steps: %d rows trained an epoch, %d steps x data.batch_size=%d x %d "
                "rank(s)%s. So few updates leave a model barely trained. Fix: a smaller batch, e.g. data.batch_size=%d (>= %d steps "
                "an epoch), or more epochs (train.num_epochs)", steps_per_epoch, rows, steps_per_epoch, run.data.batch_size, world_size,
                f" x train.grad_accum_steps={accumulation}" if accumulation > 1 else "", batch, rows // (batch * accumulation * world_size))


def _warn_rows_left_out(run: RunConfig, data: DataModule, world_size: int) -> None:
    """Say when ``data.drop_remainder`` leaves more than :data:`MOST_ROWS_LEFT_OUT` of the training rows out of every epoch.

    Why: each (rank, DataLoader worker) shard drops its last partial batch, so the rows an epoch trains shrink with the
    shards: a small file on 8 GPUs with ``num_workers: auto`` (4 each) leaves up to 32 batches out, and a run of one epoch
    (file data's default) never trains them, though nothing in its config changed but the machine."""
    config, per_rank = run.served_data, data.num_train_batches(world_size)
    train = data.split_files().get("train")
    if not isinstance(config, TabularDataConfig) or not config.drop_remainder or not per_rank or train is None or not train.num_rows:
        return
    trained = per_rank * data.batch_size * world_size
    left = train.num_rows - trained
    if left <= MOST_ROWS_LEFT_OUT * train.num_rows:
        return
    shards = world_size * data.shards_per_rank()
    log.warning("an epoch of this data trains %d of its %d training rows: data.drop_remainder=true leaves out %d (%.0f%%), the last "
                "partial batch of each of its %d shards (%d rank(s) x %d per rank, one per DataLoader worker of data.num_workers; a different set each epoch when "
                "shuffling). Fix: data.drop_remainder=false (every row, ranks then agree step by step), fewer data.num_workers, or a "
                "smaller data.batch_size", trained, train.num_rows, left, 100 * left / train.num_rows, shards, world_size,
                data.shards_per_rank())


def check_eval_cadence(train: TrainConfig, steps_per_epoch: int | None) -> None:
    """``train.eval_every_epochs`` needs epoch ends the loop can see coming: the epoch length known up front."""
    if train.eval_every_epochs is not None and not steps_per_epoch:
        raise ConfigError(
            f"train.eval_every_epochs={train.eval_every_epochs} needs data whose epoch length is known before reading it "
            f"(not so with data.on_bad_rows=skip). Fix: train.eval_every_steps=<steps> instead"
        )


def watched_eval(run: RunConfig, eval_keys: list[str]) -> BestEval:
    """The eval metric whose best value the run reports beside the last: ``train.objective``, else
    ``checkpoint.best_metric``, else the early-stopping metric (when on), else the default objective
    (:func:`~recsys_runner.metrics.registry.default_objective`); its direction is the metric's own
    (:func:`~recsys_runner.metrics.registry.higher_is_better`), which ``validate()`` also gave the checkpoint's and
    early stopping's modes (a metric without one, e.g. calibration, takes the mode set there)."""
    train, ckpt, stopping = run.train, run.checkpoint, run.train.early_stopping
    stopping_metric = stopping.metric if stopping.patience is not None else None
    metric = train.objective or ckpt.best_metric or stopping_metric or default_objective(eval_keys)
    mode = ckpt.best_mode if metric == ckpt.best_metric else stopping.mode if metric == stopping_metric else None
    if mode is None:
        mode = "max" if higher_is_better(metric) else "min"
    return BestEval(metric=metric, mode=mode)


def meta_model(run: RunConfig) -> tuple[DataModule, TrainWrapper]:
    """The run's data module and its model in a :class:`TrainWrapper`, every tensor on ``meta``: what a plan (``python -m
    recsys_runner.plan``) and a sweep's objective (:func:`planned_eval_keys`) read of them (features, batch size,
    tables, tasks) without allocating an embedding row or reading a training row."""
    # The data module on meta too: a module may hold state per embedding row (generated data draws an effect per id:
    # 8 bytes a row, 208 GB for 26 tables of 1e9 rows).
    with torch.device("meta"):
        data = run.served_data.build(device="cpu")
    return data, TrainWrapper(build_model(run, data.features, torch.device("meta")))


def planned_eval_keys(run: RunConfig) -> list[str]:
    """The eval keys the run will log (:func:`~recsys_runner.metrics.tasks.eval_metric_keys` of its model's tasks), known
    before it is built: a sweep's parent reads its jobs' default objective from them (:mod:`recsys_runner.sweep`)."""
    _, model = meta_model(run)
    return eval_metric_keys(run.metrics, model.tasks)
