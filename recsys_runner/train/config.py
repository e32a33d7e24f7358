"""``train.*``: the schema of the ``train`` section (run length, log/eval cadence, accumulation, clipping, EMA, early
stopping, NaN guard, profiling, interruption, progress display); read by the loop and the builder."""

from __future__ import annotations

from dataclasses import dataclass, field

from recsys_runner.errors import require
from recsys_runner.progress import MODES as PROGRESS_MODES
from recsys_runner.train.compile import CompileConfig
from recsys_runner.train.ema import EmaConfig
from recsys_runner.train.profiling import ProfileConfig
from recsys_runner.train.stepping import ClipConfig
from recsys_runner.train.stopping import EarlyStoppingConfig
from recsys_runner.train.weighting import LossWeightingConfig


@dataclass(kw_only=True)
class TrainConfig:
    """The ``train`` section: how long to train and how often to log and evaluate."""

    num_steps: int | None = None
    """Optimizer steps to run. At most one of ``num_steps`` and ``num_epochs`` is set; with neither, the
    data decides the length (:meth:`~recsys_runner.data.base.DataConfig.default_num_steps`): one epoch of
    a file, 1000 steps of generated data (``data=synthetic``, whose rows never run out)."""
    num_epochs: int | None = None
    """Passes over the training data, e.g. ``train.num_epochs=2`` (not together with ``train.num_steps``)."""
    log_every_steps: int = 50
    """Log train loss, learning rates and samples/s every this many steps."""
    eval_every_steps: int | None = None
    """Evaluate every this many steps; ``null`` (and no ``eval_every_epochs``) evaluates only at the end."""
    eval_every_epochs: int | None = None
    """Evaluate at the end of every this many epochs (data whose epoch length is known up front). Combines
    with ``eval_every_steps``: an eval runs when either is due, once per step; set
    ``train.eval_every_steps=null`` for epoch ends only."""
    eval_max_batches: int | None = None
    """Cap on eval batches per rank (``null`` = the whole eval split)."""
    sanity_eval_batches: int = 2
    """Before the first training step of every launch (a resumed one too: its eval data may have changed), run the eval's
    per-batch path (forward, metric updates and compute, on every rank) on this many eval batches and discard it: nothing
    logged, nothing checkpointed, training unchanged bit for bit. An error only the eval meets (a bad eval row, a
    missing grouping id) then stops the run in seconds instead of after the training. The full-corpus pass of a
    retrieval eval is not covered (:meth:`~recsys_runner.train.evaluation.Evaluator.sanity_check`). 0 turns it off
    (PyTorch Lightning's ``num_sanity_val_steps``)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; dense gradients are averaged over them. The fused embedding optimizers still
    update every micro-batch, and all but SGD at full size: for them the tables train as without accumulation
    (docs/training.md; a warning at build time)."""
    clip_grad: ClipConfig = field(default_factory=ClipConfig)
    """Clipping of the dense gradients (``train.clip_grad.max=1.0``)."""
    ema: EmaConfig = field(default_factory=EmaConfig)
    """Moving average of the dense weights (``train.ema.decay=0.999``)."""
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    """Stop when an eval metric stops improving (``train.early_stopping.patience=3``)."""
    loss_weighting: LossWeightingConfig = field(default_factory=LossWeightingConfig)
    """How a multi-task model's task losses are combined: ``fixed``, ``uncertainty`` or ``pareto``
    (``train.loss_weighting.kind=pareto``; docs/multitask.md)."""
    nan_guard: bool = True
    """Stop with a clear error when the train loss is NaN/inf (checked at log steps and before each
    checkpoint, so a non-finite state is never saved)."""
    compile: CompileConfig = field(default_factory=CompileConfig)
    """``torch.compile`` of the model's dense modules, optionally as CUDA graphs (``train.compile.enabled=true``,
    ``train.compile.cuda_graphs=true``; docs/performance.md measures both on a GPU)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """torch.profiler trace of a few steps, stored in MLflow (``debug=profile``)."""
    stop_after_steps: int | None = None
    """Train at most this many steps in this process, then checkpoint and exit like an interruption;
    relaunching continues (time slices on a preemptible cluster). ``null``: run to the end."""
    objective: str | None = None
    """The final eval metric a job returns (the value Hydra sweepers optimize), e.g. ``eval/ctr/auc``;
    ``null`` means ``eval/auc`` when the model logs it, else its first eval metric."""
    stop_check_every_steps: int = 10
    """With several ranks, how often (in steps) they agree on a pending stop signal. Agreeing is an
    all-reduce plus a host sync, so it is not done every step; a signal is honoured within this many
    steps, or right after an eval (which synced the ranks anyway). A single process checks every step for free."""
    summary_every_steps: int | None = None
    """Every this many steps, log training summaries (:mod:`recsys_runner.train.summaries`): the global gradient norm of
    the dense parameters and of the looked-up embeddings (``grad_norm/dense``, ``grad_norm/sparse``), each embedding
    table's row-norm mean/max/min and every optimizer group's lr; ``null`` or 0: off (the default). Each summary reads
    every table once; every 100 steps costs well under 3 % (docs/performance.md)."""
    summary_histograms: bool = False
    """On summary steps also log histograms of every dense parameter and its gradient (MLflow: a JSON artifact per
    step; TensorBoard with ``tracking.tensorboard=true``). Needs ``train.summary_every_steps``."""
    progress: str = "auto"
    """How rank 0 shows progress: ``auto`` draws one live bar (step/total, steps/s, ETA, loss, samples/s,
    the latest eval metrics) when stdout and stderr are a terminal, else logs a ``step N/M ...`` line every
    ``log_every_steps``; ``bar`` always draws, ``log`` never does. The log file and MLflow get every line either way."""

    def __post_init__(self) -> None:
        require(
            self.num_steps is None or self.num_epochs is None,
            f"train.num_steps={self.num_steps} and train.num_epochs={self.num_epochs} are both set; the run length is one "
            f"of them. Fix: train.num_steps={self.num_steps} train.num_epochs=null for the steps, or "
            f"train.num_epochs={self.num_epochs} train.num_steps=null for the epochs (the other may come from a preset: "
            f"the file and Taobao presets, experiment=criteo_tsv, avazu_csv, movielens, mmoe_taobao, esmm_taobao, dssm_taobao, …, "
            f"set train.num_epochs=1; debug=fast sets train.num_steps)",
        )
        require(self.num_steps is None or self.num_steps > 0, f"train.num_steps must be positive, got {self.num_steps}")
        require(self.num_epochs is None or self.num_epochs > 0, f"train.num_epochs must be positive, got {self.num_epochs}")
        require(self.log_every_steps > 0, f"train.log_every_steps must be positive, got {self.log_every_steps}")
        require(
            self.eval_every_steps is None or self.eval_every_steps > 0,
            f"train.eval_every_steps must be positive or null, got {self.eval_every_steps}",
        )
        require(
            self.eval_every_epochs is None or self.eval_every_epochs > 0,
            f"train.eval_every_epochs must be positive or null, got {self.eval_every_epochs}",
        )
        require(
            self.eval_max_batches is None or self.eval_max_batches > 0,
            f"train.eval_max_batches must be positive or null, got {self.eval_max_batches}",
        )
        require(self.sanity_eval_batches >= 0,
                f"train.sanity_eval_batches must be 0 (off) or a number of eval batches, got {self.sanity_eval_batches}. "
                f"Fix: e.g. train.sanity_eval_batches=2")
        require(self.stop_after_steps is None or self.stop_after_steps > 0,
                f"train.stop_after_steps must be positive or null, got {self.stop_after_steps}")
        require(self.objective is None or self.objective.startswith("eval/"),
                f"train.objective={self.objective!r} must be an eval metric key, e.g. eval/auc or eval/ctr/auc")
        require(self.progress in PROGRESS_MODES, f"train.progress={self.progress!r} must be one of {PROGRESS_MODES}")
        require(self.stop_check_every_steps > 0, f"train.stop_check_every_steps must be positive, got {self.stop_check_every_steps}")
        require(self.summary_every_steps is None or self.summary_every_steps >= 0,
                f"train.summary_every_steps must be positive, or 0/null for off, got {self.summary_every_steps}. "
                f"Fix: e.g. train.summary_every_steps=100")
        require(not self.summary_histograms or bool(self.summary_every_steps),
                "train.summary_histograms=true has no effect without summaries. Fix: set train.summary_every_steps "
                "(e.g. 100), or drop train.summary_histograms")
        require(self.grad_accum_steps > 0, f"train.grad_accum_steps must be positive, got {self.grad_accum_steps}")
        require(
            self.early_stopping.patience is None or self.eval_every_steps is not None or self.eval_every_epochs is not None,
            "train.early_stopping.patience needs periodic evaluation: set train.eval_every_steps (e.g. 500) or train.eval_every_epochs (e.g. 1)",
        )
