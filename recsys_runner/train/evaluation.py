"""Evaluation: each task's configured metrics over the eval split, combined over all ranks.

One object the train loop calls between steps (and, later, an eval-only entry point): it owns what
evaluation needs and nothing the loop needs, so the loop does not reach into the model, the
pipeline or the EMA to evaluate.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torchrec.datasets.utils import Batch

from recsys_runner.data.base import DataModule, in_step, placeholder
from recsys_runner.distributed.env import DistEnv
from recsys_runner.errors import DataError
from recsys_runner.metrics.registry import SELECTION_KEY, MetricsConfig, improved, selection_score
from recsys_runner.metrics.tasks import TaskEvalMetrics, eval_metric_keys, grouping_ids
from recsys_runner.models.collision import eval_counts_kept
from recsys_runner.progress import Progress
from recsys_runner.tasks import Task
from recsys_runner.train.batch_checks import checked_batches
from recsys_runner.train.corpus import CorpusEval, Rewrite, inner_with
from recsys_runner.train.ema import DenseEMA
from recsys_runner.train.pipeline import detached
from recsys_runner.train.stepping import Pipeline


@dataclass
class Evaluator:
    """Evaluates the sharded model on this rank's eval batches (with the EMA weights swapped in when given).

    Attributes:
        model: the sharded model (``TrainWrapper`` inside DistributedModelParallel).
        pipeline: the train pipeline, whose in-flight batches are kept aside while evaluating; ``None`` where nothing
            trains (evaluate, predict: :mod:`recsys_runner.inference_build`).
        data: the data module (its ``eval_batches``).
        env: rank, world size and device.
        tasks: the model's tasks, in output order.
        metrics: which metrics (``metrics.*``), and the grouping key for grouped ones.
        max_batches: cap on eval batches per rank (``train.eval_max_batches``), ``None`` for all.
        ema: the dense weights' moving average to evaluate with (``train.ema.eval_with_ema``), or ``None``.
        corpus: the full-corpus pass of a two-tower model over the data's item catalogue (``train/corpus.py``), made
            from the tasks' metrics when ``None`` (refused, at build time, when they ask for one the data lacks).
    """

    model: nn.Module
    pipeline: Pipeline | None
    data: DataModule
    env: DistEnv
    tasks: tuple[Task, ...]
    metrics: MetricsConfig
    max_batches: int | None = None
    ema: DenseEMA | None = None
    corpus: CorpusEval | None = None

    def __post_init__(self) -> None:
        self.data.check_eval_rows()  # before the first step: eval data known to hold no row is refused now, not after the training
        if self.corpus is None:
            self.corpus = CorpusEval.for_run(self.model, self.data, self.tasks, self.metrics, say=self.env.is_main)

    def keys(self) -> list[str]:
        """The metric keys :meth:`evaluate` returns (``eval/auc``, ``eval/recall_at_10``, …)."""
        return eval_metric_keys(self.metrics, self.tasks)

    def evaluate(self, progress: Progress | None = None, *, stop: Callable[[], None] | None = None,
                 rewrite: Rewrite | None = None) -> dict[str, float]:
        """Each task's eval metrics over this rank's eval batches, combined over all ranks; ``progress`` counts the
        batches (``python -m recsys_runner.evaluate``; during training the train bar shows the results instead).

        Every eval row counts once, on any number of ranks: ranks whose shares hold different numbers of batches
        step together (:func:`~recsys_runner.data.base.in_step`), one that is done forwarding a stand-in batch
        whose outputs count nowhere, so the values equal one process's over the same eval data.

        ``stop`` is called between two pieces of the eval's work (each eval batch; with a catalogue, each chunk of the
        item index, of the items a query batch is scored against, and of the items mined) and may raise to abandon the
        eval there: the loop's pending-signal check, given with one rank only (with several, the forwards and gathers
        are collectives that every rank must finish). The EMA weights are swapped back, the pipeline reattached and the
        model put back in train mode all the same.

        ``rewrite(n, batch)`` is what the model reads of this rank's ``n``-th eval batch (on the host, before the forward):
        the permutation importance's batch with one feature's rows shuffled (:mod:`recsys_runner.importance`). The eval's
        bookkeeping still reads the batch itself: the labels, the grouping key, a next-item model's seen items and sampled
        negatives (its ``protocol_rows``), and in the corpus pass each query's target and seen items; only the query
        vectors come from the rewritten batch."""
        metrics = TaskEvalMetrics(self.metrics, self.tasks, self.env.device)
        batches = self.data.eval_batches(self.env.rank, self.env.world_size)
        weights = self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()
        corpus: dict[str, float] = {}
        with detached(self.pipeline, self.model) as model, weights:
            model.eval()
            try:
                with torch.no_grad():
                    mine: Iterator[Batch] = itertools.islice(batches, self.max_batches)
                    self._score(model, metrics, mine, progress, stop, rewrite)
                    if self.corpus is not None:  # a second pass: the user tower's queries against the whole catalogue
                        corpus = self.corpus.evaluate(model, self.data, self.env, itertools.islice(
                            self.data.eval_batches(self.env.rank, self.env.world_size), self.max_batches), stop=stop,
                            rewrite=rewrite)
            finally:
                model.train()
        out = metrics.compute() | corpus
        if self.metrics.selection:
            out[SELECTION_KEY] = selection_score(self.metrics.selection, out)
        return {k: out[k] for k in self.keys()}

    def sanity_check(self, num_batches: int, *, stop: Callable[[], None] | None = None) -> int:
        """Run the eval's per-batch path on the first ``num_batches`` eval batches of this rank (capped by
        ``train.eval_max_batches``) and discard what it computed; the number of batches stepped. ``stop`` is called after
        each batch and may raise to abandon it there, as in :meth:`evaluate` (the loop's pending-signal check, one rank
        only); everything below is put back all the same.

        What the loop runs before the first step (``train.sanity_eval_batches``), so that an error only the eval path
        meets — a bad eval row under ``data.on_bad_rows=fail``, a label a task refuses, a grouping key an eval row lacks,
        a forward that fails on the eval data, no eval row at all — is raised, with the same message, before any training
        step or checkpoint.
        It runs what :meth:`evaluate` runs per batch (the EMA weights swapped in, the pipeline detached, eval mode, the
        forward, every task's metric update) and the metrics' compute (their gathers over ranks), on every rank, so the
        ranks' collectives match. It does not run the full-corpus pass (:mod:`recsys_runner.train.corpus`: the item index
        over the whole catalogue, the queries ranked against it, hard negatives mined from it), whose cost is the
        catalogue's, not a few batches', and whose mining would change the training data.

        Training continues bit for bit as without it: the random generators (Python, NumPy, torch on the CPU and the
        device) are restored, every module's train/eval mode is put back as it was, the data module's counters
        (:meth:`~recsys_runner.data.base.DataModule.counters_kept`) and the managed tables' eval counts are restored, and
        nothing is logged; the training batches and the optimizers are not touched.
        """
        limit = num_batches if self.max_batches is None else min(num_batches, self.max_batches)
        metrics = TaskEvalMetrics(self.metrics, self.tasks, self.env.device)
        modes = [(m, m.training) for m in self.model.modules()]
        weights = self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()
        with (_random_state_kept(self.env.device), self.data.counters_kept(), eval_counts_kept(self.model),
              detached(self.pipeline, self.model) as model, weights):
            batches = self.data.eval_batches(self.env.rank, self.env.world_size)
            model.eval()
            try:
                with torch.no_grad():
                    steps = self._score(model, metrics, itertools.islice(batches, limit), None, stop)
                    metrics.compute()
            finally:
                for module, training in modes:
                    module.training = training
                close = getattr(batches, "close", None)
                if close is not None:  # a generator left part read: its readers (DataLoader workers) end now
                    close()
        return steps

    def _score(self, model: nn.Module, metrics: TaskEvalMetrics, batches: Iterable[Batch], progress: Progress | None,
               stop: Callable[[], None] | None, rewrite: Rewrite | None = None) -> int:
        """Forward ``batches`` (each as ``rewrite`` makes it, see :meth:`evaluate`) in step with the other ranks and update
        ``metrics`` with their rows; the steps taken.

        Raises:
            DataError: no rank had an eval row (every metric would be NaN).
        """
        key = self.metrics.grouping_key
        last: Batch | None = None
        steps = 0  # a step on every rank while any has a batch: none means no rank had an eval row
        protocol = inner_with(model, "protocol_rows") if rewrite is not None else None
        # each batch's labels checked by the tasks on the host, before its copy to the device (no sync)
        for mine in in_step(checked_batches(batches, self.tasks, "eval batch")):
            # a rank out of batches steps with a stand-in while another scores its last ones: its rows count
            # nowhere (an update with none of them keeps this rank's metric states in the gathers)
            batch = mine.to(self.env.device, non_blocking=True) if mine is not None else \
                last if last is not None else placeholder(self.data.features).to(self.env.device)
            last = batch
            read = rewrite(steps, mine).to(self.env.device, non_blocking=True) if rewrite is not None and mine is not None else batch
            steps += 1
            if protocol is not None:  # the ranking protocol reads the row's own history, the model the rewritten one
                protocol.protocol_rows = batch.sparse_features
            try:
                _, (_, logits, labels) = model(read)
            finally:
                if protocol is not None:
                    protocol.protocol_rows = None
            rows = slice(None) if mine is not None else slice(0)
            groups = {"groups": grouping_ids(batch.sparse_features, key)[rows]} if key else {}
            metrics.update(logits[rows], labels[rows], **groups)
            if progress is not None and mine is not None:
                progress.update(1)
            if stop is not None:
                stop()
        if not steps:  # every metric would be NaN; an eval with rows whose label has one class is not this
            raise DataError(f"the eval data gave no row to evaluate (its metrics would all be NaN): "
                            f"{self.data.explain_empty_eval(self.env.rank)}")
        return steps


@contextlib.contextmanager
def _random_state_kept(device: torch.device) -> Iterator[None]:
    """Within the block, draws from Python's, NumPy's and torch's generators (the CPU's and ``device``'s) are undone:
    the sanity eval must leave the training's random stream (dropout, sampled negatives) where it was."""
    python, numpy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


@dataclass
class BestEval:
    """The best value of the run's watched eval metric so far and the step it came at, beside the last.

    The last evaluation is what a run returns (``train.objective``) and what a sweep compares; a run whose
    metric peaked earlier says so: :meth:`update` reports each improvement (logged as ``best/<metric>`` and
    ``best/step``) and :meth:`summary` is the closing line. Saved in checkpoints, so a resumed run keeps
    the best of the steps before its interruption.

    Attributes:
        metric: the watched eval metric (``train.objective``, else ``checkpoint.best_metric``, else the
            early-stopping metric, else the default objective; chosen by :func:`recsys_runner.build.build`).
        mode: ``max`` if higher is better, ``min`` if lower is.
        value: the best value so far (``None`` before the first evaluation).
        step: the step of ``value``.
    """

    metric: str
    mode: str
    value: float | None = None
    step: int | None = None

    def update(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """Record the evaluation at ``step``; the metrics to log (``best/<metric>``, ``best/step``) when it is a new
        best, else none."""
        value = metrics.get(self.metric)
        if value is None or not improved(value, self.value, self.mode == "max"):
            return {}
        self.value, self.step = value, step
        return {f"best/{self.metric}": value, "best/step": float(step)}

    def summary(self, last: dict[str, float]) -> str:
        """``best eval/auc=0.7102 at step 400; last 0.7013``: the closing log line of a run."""
        final = last.get(self.metric)
        if self.value is None:  # none yet, or only NaNs (which are never the best: metrics.registry.improved)
            return f"no evaluation logged {self.metric}" if final is None else f"no finite {self.metric} logged; last {final:.4g}"
        return f"best {self.metric}={self.value:.4g} at step {self.step}; last {final:.4g}" if final is not None else \
            f"best {self.metric}={self.value:.4g} at step {self.step}"

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": self.value, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's best, unless it watched another metric (the run's settings changed)."""
        if state.get("metric") == self.metric:
            self.value, self.step = state.get("value"), state.get("step")
