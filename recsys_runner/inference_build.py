"""Build what scoring a checkpoint uses (``python -m recsys_runner.evaluate`` / ``.predict``), in one fixed order.

The training build's order (:mod:`recsys_runner.build`) without what only training uses: process group → tracker (rank
0 checks its store) → checkpointer, only to read the weights (nothing locked, nothing written) → precision → data,
encoded by the checkpoint's stored encoders → model with embedding tables on ``meta`` → TrainWrapper (the fixed task
weights: a learned loss weighting only shapes the training loss) → sharding plan → DistributedModelParallel → the
EMA's dense weights when ``train.ema.eval_with_ema`` (the weights scored) → Evaluator (evaluate only) → the checkpoint's weights,
loaded strictly (:meth:`~recsys_runner.checkpoint.policy.Checkpointer.load_weights`). No optimizer (the sharded
tables get fbgemm's kernels without a fused optimizer's state, which the planner then does not budget either), no lr
schedule, step policy, train pipeline, train metrics or early stopping.

The data, the tracker and the model's catalogue come from the training build's own helpers, so both graphs read and
encode the data alike; a ``train.compile`` the checkpoint was trained with compiles the same dense modules, so
evaluate reproduces the training's evaluations exactly (``tests/test_evaluate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recsys_runner import store_settings
from recsys_runner.build import build_model, build_tracker, seed_everything, with_catalogue
from recsys_runner.checkpoint.config import TrainState
from recsys_runner.config import RunConfig
from recsys_runner.config_metrics import check_eval_keys
from recsys_runner.data.base import DataModule
from recsys_runner.data.files.downsample import negative_rate, trained_rate
from recsys_runner.data_build import build_data
from recsys_runner.distributed.env import DistEnv, decided_on_rank0
from recsys_runner.distributed.sharding import Distributed
from recsys_runner.models.train_wrapper import TrainWrapper
from recsys_runner.runtime import Launch
from recsys_runner.tasks import Task, logit_shift
from recsys_runner.tracking.tracker import NullTracker, Tracker
from recsys_runner.train.compile import check_static_shapes, compile_dense
from recsys_runner.train.ema import DenseEMA
from recsys_runner.train.evaluation import Evaluator


@dataclass
class Inference:
    """A checkpoint's model, ready to score: what evaluate and predict hold; closed by :meth:`close`.

    Attributes:
        run: the validated config it was built from.
        env: rank, world size and device.
        distributed: the process group (closed at the end).
        tracker: rank 0's tracker (a null one on the other ranks).
        data: the data module (eval batches; predict's reader and encoders).
        model: the sharded model (``TrainWrapper`` inside DistributedModelParallel), in train mode as built.
        tasks: the model's tasks, in output order.
        ema: the checkpoint's EMA weights to swap in (``train.ema.eval_with_ema``), or ``None``: the raw weights.
        evaluator: the eval pass over the data's eval split (the training loop's own); ``None`` for predict, which
            scores its own input: building it checks the eval rows against the catalogue (one pass over them), a
            refusal about rows predict never reads.
        state: the checkpoint's step and MLflow run id; ``resumed_from`` names the checkpoint loaded.
    """

    run: RunConfig
    env: DistEnv
    distributed: Distributed
    tracker: Tracker
    data: DataModule
    model: DistributedModelParallel
    tasks: tuple[Task, ...]
    ema: DenseEMA | None
    evaluator: Evaluator | None
    state: TrainState

    def close(self) -> None:
        """Release the process group (the tracker is finished by the entry's lifecycle, with a status)."""
        self.distributed.close()


def build_inference(run: RunConfig, *, weights: Path, launch: Launch = Launch(), evaluate: bool = True) -> Inference:
    """Build the scoring graph from the validated config and load checkpoint ``weights`` into it; see the module
    docstring for the order.

    ``launch``: the command-line launch, which sets ``checkpoint.dir``'s default (where the checkpoint storage is
    chosen from, as in training); nothing is written there. ``evaluate``: build the :class:`Evaluator` (false for
    predict, whose :attr:`Inference.evaluator` is then ``None``).

    Raises:
        CheckpointError: ``weights`` is damaged, or was written by another model config (naming the tensors).
    """
    seed_everything(run.seed)
    store_settings.configure(run.storage)
    distributed: Distributed = run.distributed.build()
    env = distributed.setup()
    try:
        tracker = build_tracker(run, launch) if env.is_main else NullTracker()
        decided_on_rank0(tracker.check, env.rank, env.world_size)
        checkpointer = run.checkpoint.build(rank=env.rank, world_size=env.world_size, device=env.device, nan_guard=run.train.nan_guard,
                                            launch=launch)  # reads the weights only: never locked, never saves
        precision = run.precision.build()
        precision.apply_tf32()
        shift = logit_shift(trained_rate(weights, negative_rate(run.served_data)))  # the rate the checkpoint trained with
        data = build_data(run, env.device, weights)
        check_static_shapes(run.train.compile, data.features)
        model = with_catalogue(build_model(run, data.features, env.device), data)
        wrapped = TrainWrapper(model, autocast=precision.autocast(env.device), features=data.features, logit_shift=shift)
        check_eval_keys(run, wrapped.tasks, data.features.sparse_names, type(model).__name__)  # before the tracker starts a run
        sharded = distributed.shard(wrapped, distributed.plan(wrapped, batch_size=data.batch_size))
        compile_dense(model, run.train.compile, wrapper=wrapped)  # the same module objects DMP now holds
        ema = _ema_weights(sharded, run.train.ema.decay) if run.train.ema.eval_with_ema else None
        evaluator = Evaluator(model=sharded, pipeline=None, data=data, env=env, tasks=wrapped.tasks, metrics=run.metrics,
                              max_batches=run.train.eval_max_batches, ema=ema) if evaluate else None
        checkpointer.attach(model=sharded, optimizer=NO_OPTIMIZER, tensors={"ema": ema} if ema is not None else {}, objects={})
        state = checkpointer.load_weights(weights)
    except BaseException:
        distributed.close()
        raise
    return Inference(run=run, env=env, distributed=distributed, tracker=tracker, data=data, model=sharded, tasks=wrapped.tasks,
                     ema=ema, evaluator=evaluator, state=state)


NO_OPTIMIZER = CombinedOptimizer([])
"""What the checkpointer is given for the optimizer it registers beside the model: one over nothing. Loading weights
reads no optimizer state (:meth:`~recsys_runner.checkpoint.policy.Checkpointer.load_weights`)."""


def _ema_weights(sharded: nn.Module, decay: float | None) -> DenseEMA:
    """The EMA holder training checkpoints: over the dense parameters, those no embedding kernel updates in backward
    (the training build's choice, :func:`recsys_runner.build.build`); its shadow weights are the checkpoint's, once loaded."""
    assert decay is not None, "train.ema.eval_with_ema needs train.ema.decay (EmaConfig checks it)"
    return DenseEMA(dict(in_backward_optimizer_filter(sharded.named_parameters())), decay)
