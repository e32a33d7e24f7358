"""Known, harmless noise from the libraries under us (TorchRec, torch, Hydra, MLflow), silenced in one place.

Every entry point calls :func:`quiet_known_noise` first (at import, before Hydra composes anything).
Each filter names the exact message, its category (warnings) or logger (log records), and the
module it comes from, and says why it is harmless: nothing is silenced wholesale, so any other
warning, even of the same category from the same library, still reaches the screen. To see the
silenced ones again, run with ``RECSYS_RUNNER_SHOW_NOISE=1``.

When a pinned version changes (Makefile ``TORCH``/``TORCHREC``), an entry whose message no longer
appears is dead weight: ``tests/test_progress.py`` runs the default training and checks that none
of these messages reach the screen, and that a look-alike from elsewhere still does.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class WarningNoise:
    """A ``warnings.warn`` to ignore: all three of message, category and module must match."""

    message: str
    """Regular expression matched against the start of the warning's text."""
    category: type[Warning]
    """The exact warning class (subclasses match too, as in :func:`warnings.filterwarnings`)."""
    module: str
    """Regular expression matched against the start of the module the warning is attributed to."""
    why: str
    """Why it is harmless here (shown by ``python -c 'from recsys_runner.noise import describe; print(describe())'``)."""


@dataclass(frozen=True)
class LogNoise:
    """A log record to drop: the named logger (not its parents or children) and the message's start."""

    logger: str
    message: str
    """Regular expression matched against the start of the formatted message."""
    why: str


WARNINGS: tuple[WarningNoise, ...] = (
    WarningNoise(
        message=r"`broadcast_buffers` is deprecated",
        category=FutureWarning,
        module=r"torchrec\.distributed\.model_parallel$",
        why="DistributedModelParallel builds its DDP wrapper with broadcast_buffers=False, which torch 2.13 renamed; "
            "the behaviour is unchanged and the call is TorchRec's, not ours (once per rank at start-up).",
    ),
    WarningNoise(
        message=r"`broadcast_buffers` is deprecated",
        category=FutureWarning,
        module=r"torchrec\.distributed\.embeddingbag$",
        why="the same rename, from TorchRec's lookup of data_parallel tables, which wraps them in DDP with "
            "broadcast_buffers=False: the planner replicates small tables on GPU (the 4-float per-id weights of DeepFM's "
            "first-order term, Wide&Deep's wide head, LR and FM, or tables sized from a small file). Unchanged behaviour, "
            "TorchRec's call (once per rank at start-up).",
    ),
    WarningNoise(
        message=r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered",
        category=UserWarning,
        module=r"torch\.autograd\.graph$",  # raised by the C++ engine inside backward(); torch blames its Python entry
        why="the lookup of a data_parallel (replicated) table, fbgemm's dense TBE kernel, builds its own autograd "
            "function inside the op instead of registering one to the Autograd key, so torch's fallback warns once on the "
            "first backward; the gradients are exact (each id's row gets its bag's gradient: checked against a plain "
            "sum), and the planner replicates only small tables (per-id linear weights, tables sized from small files).",
    ),
    WarningNoise(
        message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`",
        category=UserWarning,
        module=r"recsys_runner\.optim\.schedulers$",  # torch blames its caller: ScheduledLR.step, whose first step is torch's own
        why="the schedule steps the GroupedOptimizer of all parameter groups, while the train pipeline steps the dense "
            "optimizers and the fused sparse optimizer steps inside backward; torch cannot see those steps, but they "
            "always run before Stepper.step calls lr_scheduler.step(), so no step of the schedule is skipped.",
    ),
    WarningNoise(
        message=r"Please use DTensor instead and we are deprecating ShardedTensor",
        category=FutureWarning,
        module=r"torch\.distributed\.checkpoint\.",
        why="TorchRec keeps sharded embedding tables as ShardedTensors, and torch.distributed.checkpoint warns about each "
            "one it plans to save or load; the tensors are TorchRec's, nothing a user can change (a pair per resume or load).",
    ),
    WarningNoise(
        message=r"To copy construct from a tensor, it is recommended to use sourceTensor\.detach\(\)\.clone\(\)",
        category=UserWarning,
        module=r"torchrec\.modules\.hash_mc_modules$",
        why="HashZchManagedCollisionModule.__init__ (data.managed_collision with module hash_zch, the choice on CUDA) builds its "
            "rank offsets with torch.tensor(<a cumsum it just computed>), which copies a tensor that has no grad and no other "
            "user: the copy is what detach().clone() would give. TorchRec's line, once per managed table at start-up.",
    ),
    WarningNoise(
        message=r"Operation with range is deprecated",
        category=DeprecationWarning,  # pandas' Pandas4Warning, a DeprecationWarning: named by its base, pandas is not imported here
        module=r"mlflow\.models\.utils$",
        why="an export saves the MLflow model with its input example (a DataFrame of the training files' first rows), and MLflow "
            "decides whether to write the example's column names by df.columns == range(n), which pandas 3 deprecates; our "
            "columns are names, so the answer is no now and under pandas 4's scalar-like comparison alike, and the names are "
            "written either way (twice per export of an MLflow model: saved, then logged). Python hides it outside pytest.",
    ),
    WarningNoise(
        message=r"\s*'hydra/launcher/submitit_(slurm|local)' is validated against ConfigStore schema",
        category=UserWarning,
        # Hydra warns with a fixed stacklevel, so the frame it blames depends on how deep the launch path is (python -m
        # blames recsys_runner/__main__.py, module __main__, or a multirun's runpy frame).
        module=r"(recsys_runner|hydra|sys$|__main__$|runpy$)",
        why="conf/hydra/launcher/submitit_slurm.yaml and submitit_local.yaml deliberately extend the plugin's same-named schemas "
            "(max_num_timeout); Hydra 1.3 still supports that but warns on every launch.",
    ),
)

LOG_RECORDS: tuple[LogNoise, ...] = (
    LogNoise(
        logger="root",  # TorchRec's planner logs it with logging.warning, on the root logger
        message=r"Sharding spec not found for ",
        why="the planner replicated a table (data_parallel: it chooses that for small tables, such as the 4-float per-id "
            "weights of DeepFM's first-order term or a table sized from a small file, on GPU), and a replicated table has "
            "no sharding spec by design; torchrec.distributed.planner.planners.validate_rank_assignment still logs one "
            "line per such table of a valid plan. The plan is logged by the runner (sharding plan: … data_parallel).",
    ),
    LogNoise(
        logger="torchrec.modules.mc_modules",
        message=r"Skipping validation on ManagedCollisionModule\. ",  # "…  This module may not be Reshard-able as a result"
        why="HashZchManagedCollisionModule always builds its base class with skip_state_validation=True (TorchRec's choice, "
            "for its own publishing), so every hash_zch table logs it at start-up. Resharding is checked by us instead: a "
            "hash_zch checkpoint loaded on another number of ranks is refused with a CheckpointError naming the fix "
            "(recsys_runner/models/collision.py, CountedHashZch).",
    ),
    LogNoise(
        logger="torchrec.distributed.utils",
        message=r"Sharding Type is data_parallel, caching params will be ignored",
        why="one line per replicated (data_parallel) table: its weights are an ordinary dense tensor, so the UVM-caching "
            "options TorchRec passes every sharded table have nothing to apply to; we set no caching options at all.",
    ),
    LogNoise(
        logger="torch.fx._symbolic_trace",
        message=r"is_fx_tracing will return true for both fx\.symbolic_trace and torch\.export",
        why="a one-time notice about what is_fx_tracing() means under torch.export, printed when TorchRec's modules "
            "ask it in an ordinary eager forward; nothing is traced or exported in training.",
    ),
    LogNoise(
        logger="mlflow.pyfunc",
        message=r"Validating input example against model signature",
        why="MLflow announces at INFO, in its own format, each check of a saved model's input example against its "
            "signature: twice per export of an MLflow model (saved into export.dir, then logged to the export's run); a "
            "failing check still raises, naming the mismatch.",
    ),
    LogNoise(
        logger="mlflow.store.db.utils",
        message=r"(Creating initial MLflow database tables|Updating database tables)",
        why="MLflow creating the tables of a new sqlite store (the first run of `make run` makes ./mlflow.db); "
            "its failures still raise and its warnings still show.",
    ),
)


class _DropKnown(logging.Filter):
    """Drops the records of one logger whose message starts with one of ``patterns``."""

    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


def quiet_known_noise() -> None:
    """Install the filters of :data:`WARNINGS` and :data:`LOG_RECORDS` (idempotent; a no-op with
    ``RECSYS_RUNNER_SHOW_NOISE=1``)."""
    if os.environ.get("RECSYS_RUNNER_SHOW_NOISE") == "1":
        return
    for w in WARNINGS:
        warnings.filterwarnings("ignore", message=w.message, category=w.category, module=w.module)
    by_logger: dict[str, list[str]] = {}
    for r in LOG_RECORDS:
        by_logger.setdefault(r.logger, []).append(r.message)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(patterns))


def describe() -> str:
    """What is silenced and why, one paragraph per filter."""
    lines = [f"warning {w.category.__name__} from {w.module}: {w.message}\n  {w.why}" for w in WARNINGS]
    lines += [f"log record of {r.logger}: {r.message}\n  {r.why}" for r in LOG_RECORDS]
    return "\n".join(lines)
