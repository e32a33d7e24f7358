"""Per-task metrics: what the runner drives, fed with the TrainWrapper's ``(logits, labels)``.

Each task (:mod:`recsys_runner.tasks`) gets its own eval collection and decaying train metrics, logged as
``eval/<task>/<metric>`` and ``train/<task>/<metric>`` (no task segment for an unnamed task).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError
from recsys_runner.metrics.corpus import check_k_below
from recsys_runner.metrics.registry import (
    METRICS,
    NAME_PATTERNS,
    SELECTION_KEY,
    MetricsConfig,
    build_eval_metrics,
    build_train_metrics,
    metric_entry,
    metric_key,
)
from recsys_runner.tasks import NextItemTask, Task, mask_task_index, output_columns

log = logging.getLogger(__name__)


def _task_spec(spec: MetricsConfig, task: Task) -> MetricsConfig:
    """``spec`` with the task's metric lists (:meth:`Task.eval_metric_names`, :meth:`Task.train_metric_names`)."""
    eval_names, train_names = task.eval_metric_names(spec.eval), task.train_metric_names(spec.train)
    if eval_names == list(spec.eval) and train_names == list(spec.train):
        return spec
    return replace(spec, eval=eval_names, train=train_names)


def catalogue_metric_names(spec: MetricsConfig, task: Task) -> list[str]:
    """``task``'s eval metrics computed over the data's item catalogue rather than from its output (its kind's
    :attr:`~recsys_runner.tasks.Task.catalogue_kinds`: a two-tower model's ``recall@k``, ``ndcg@k``, ``mrr``,
    ``coverage@k``), in config order; empty for most tasks."""
    return [n for n in _task_spec(spec, task).eval if metric_entry(n).inputs in task.catalogue_kinds]


def _output_spec(spec: MetricsConfig, task: Task) -> MetricsConfig:
    """``task``'s eval spec without its catalogue metrics (:func:`catalogue_metric_names`): what its output feeds."""
    own = _task_spec(spec, task)
    catalogue = catalogue_metric_names(spec, task)
    return replace(own, eval=[n for n in own.eval if n not in catalogue]) if catalogue else own


@dataclass(frozen=True)
class _TaskView:
    """Where one task's rows are in the TrainWrapper's ``(logits, labels)``: its output columns and the column of the task
    whose positive label masks it (``only_where_positive``); see :func:`_views`."""

    task: Task
    index: int
    columns: slice
    mask: int | None

    def rows(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """The task's ``(preds, targets)`` (:meth:`Task.metric_inputs`) and the rows kept (``None``: all): a named task's
        are its columns of ``logits [B, ΣW]`` (one, or ``C`` for a multi-class task) and column ``index`` of ``labels
        [B, T]``, an unnamed task's the whole tensors; a masked task keeps only the rows where its mask task's label is
        positive (the rows its loss counts)."""
        if self.task.name is None:
            return *self.task.metric_inputs(logits, labels), None
        out = logits[:, self.columns]
        preds, targets = self.task.metric_inputs(out if self.task.output_width > 1 else out[:, 0], labels[:, self.index])
        if self.mask is None:
            return preds, targets, None
        keep = labels[:, self.mask] > 0
        return preds[keep], targets[keep], keep


def _views(tasks: tuple[Task, ...]) -> list[_TaskView]:
    """Each task's :class:`_TaskView`, in task order."""
    columns = output_columns(tasks)
    return [_TaskView(t, i, columns[i], mask_task_index(t, tasks)) for i, t in enumerate(tasks)]


def _task_outputs(view: _TaskView, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """One task's ``(preds, targets)`` for its metrics (:meth:`_TaskView.rows`, the masked rows only)."""
    preds, targets, _ = view.rows(logits, labels)
    return preds, targets


def check_task_metrics(spec: MetricsConfig, tasks: tuple[Task, ...], model: str = "the model", eval_rows: int | None = None) -> None:
    """Raise :class:`ConfigError` unless each task's eval metrics apply to what it produces.

    A task's ``metric_inputs_kinds`` say which registered metrics read its outputs: per-row predictions
    (pointwise and grouped metrics) or query×candidate scores (``recall@<k>``). ``model`` names the
    model in the message. The ``k`` of a ranking metric must be below the candidates a row ranks among
    (:func:`~recsys_runner.metrics.corpus.check_k_below`): a next-item task's item table (or its sampled negatives and
    true item), and for ``inbatch_recall@<k>`` the ``eval_rows`` of an eval batch (``data.batch_size``; ``None``:
    batches of varying rows, not checked). A two-tower model's catalogue metrics are checked against the catalogue
    once the data has it (:meth:`recsys_runner.train.corpus.CorpusEval.for_run`).
    """
    for task in tasks:
        key = "model.eval_metrics" if task.eval_metrics is not None else "metrics.eval"
        for name in task.eval_metric_names(spec.eval):
            if metric_entry(name, key).reads(task.metric_inputs_kinds):
                continue
            valid = [n for n, e in sorted(METRICS.items()) if e.reads(task.metric_inputs_kinds)]
            valid += [p for p, inputs in NAME_PATTERNS.items() if inputs in task.metric_inputs_kinds]
            example = task.default_eval_metrics or ("auc",)
            raise ConfigError(
                f"{key} lists {name!r}; {model}'s eval is {task.metric_inputs_kinds[0]}, so only {', '.join(valid)} "
                f"appl{'ies' if len(valid) == 1 else 'y'}, e.g. [{','.join(example)}]"
            )
        _check_candidates(task, task.eval_metric_names(spec.eval), key, eval_rows)
    _check_eval_is_read(spec, tasks, model)


def _check_eval_is_read(spec: MetricsConfig, tasks: tuple[Task, ...], model: str) -> None:
    """``metrics.eval`` changed from its default while no task reads it: each takes its own eval metrics (a two-tower or
    next-item model's ``model.eval_metrics``, a task spec's, or its kind's default, e.g. ``mse``/``mae`` for regression),
    so the setting would change nothing and the run would log other metrics than the ones asked for, silently."""
    if list(spec.eval) == MetricsConfig().eval or any(not (t.eval_metrics or t.default_eval_metrics) for t in tasks):
        return
    own = "; ".join(f"{t.name or 'its task'}: {','.join(t.eval_metric_names(spec.eval))}" for t in tasks)
    raise ConfigError(f"metrics.eval={list(spec.eval)} has no effect: {model}'s tasks take their own eval metrics ({own}). "
                      f"Fix: set them where the model takes them (model.eval_metrics, or model.task_specs.<task>.eval_metrics; "
                      f"docs/metrics.md), or drop metrics.eval")


def _check_candidates(task: Task, names: list[str], key: str, eval_rows: int | None) -> None:
    """:func:`~recsys_runner.metrics.corpus.check_k_below` for the ``@k`` metrics of ``names`` that rank among a number
    of candidates known before the data is read (:func:`check_task_metrics`)."""
    if isinstance(task, NextItemTask) and task.num_items is not None:
        if task.eval_negatives:
            check_k_below(names, task.eval_negatives + 1, key, f"model.eval_negatives={task.eval_negatives} sampled items and "
                          f"the true one", "model.eval_negatives={k}")
        else:
            check_k_below(names, task.num_items, key, "the item table's items", "a larger item table")
    in_batch = [n for n in names if metric_entry(n, key).inputs == "retrieval"]
    if eval_rows is not None and in_batch:
        check_k_below(in_batch, eval_rows, key, "in-batch: the rows of an eval batch, data.batch_size; a last, shorter batch "
                      "has fewer", "data.batch_size>{k}")


def eval_key(task: Task, name: str) -> str:
    """The logged key of ``task``'s eval metric ``name``: ``eval/<task>/<metric>`` (``eval/<metric>`` for an
    unnamed task), through :func:`metric_key`; e.g. ``eval/auc``, ``eval/ctr/auc``, ``eval/recall_at_10``."""
    return f"eval/{'' if task.name is None else f'{task.name}/'}{metric_key(name)}"


def eval_metric_keys(spec: MetricsConfig, tasks: tuple[Task, ...]) -> list[str]:
    """Exactly the keys :meth:`TaskEvalMetrics.compute` returns for ``tasks`` and ``spec``, in its order.

    With ``metrics.selection`` the weighted sum ``eval/selection`` comes last (the Evaluator adds it).
    Known before training, so keys that name an eval metric (``train.objective``,
    ``checkpoint.best_metric``, ``train.early_stopping.metric``) are checked before the first step.
    """
    return [eval_key(task, name) for task in tasks for name in _task_spec(spec, task).eval] + ([SELECTION_KEY] if spec.selection else [])


class TaskEvalMetrics:
    """Each task's eval metrics fed by its output, keyed by :func:`eval_key` (``eval/auc``, ``eval/ctr/auc``):
    :func:`eval_metric_keys` less the catalogue metrics (:func:`catalogue_metric_names`, computed by the corpus pass).

    ``update(logits, labels, groups=None)`` takes the TrainWrapper's ``(logits, labels)``; a masked task
    (``only_where_positive``) updates its metrics with the rows where its mask task's label is positive only, so
    ``eval/cvr/auc`` is the AUC over clicked rows. ``compute()`` is collective under a process group, like
    :func:`build_eval_metrics` (ranks may keep different numbers of rows).
    """

    def __init__(self, spec: MetricsConfig, tasks: tuple[Task, ...], device: torch.device) -> None:
        self.tasks = tasks
        self.specs = [_output_spec(spec, t) for t in tasks]
        self.collections = [build_eval_metrics(s, device) for s in self.specs]
        self._views = _views(tasks)

    def update(self, logits: Tensor, labels: Tensor, groups: Tensor | None = None) -> None:
        extra = {} if groups is None else {"groups": groups}
        for view, metrics in zip(self._views, self.collections, strict=True):
            preds, targets, keep = view.rows(logits, labels)
            # Only metrics whose update takes ``groups`` (gauc) get them: MetricCollection filters keyword
            # arguments by each metric's signature.
            metrics.update(preds, targets, **(extra if keep is None or groups is None else {"groups": groups[keep]}))

    def compute(self) -> dict[str, float]:
        """``{key: value}`` in :func:`eval_metric_keys` order: task by task, each task's metrics as configured."""
        out: dict[str, float] = {}
        for task, task_spec, metrics in zip(self.tasks, self.specs, self.collections, strict=True):
            values = metrics.compute()
            out |= {eval_key(task, name): float(values[name]) for name in task_spec.eval}
        return out


class TaskTrainMetrics:
    """Each task's decaying train metrics, fed with the TrainWrapper's ``(logits, labels)``.

    Keys ``train/<task>/<metric>`` (plain ``train/<metric>`` for an unnamed task). ``update`` runs every
    micro-batch, so it only keeps the batch's detached ``(logits, labels)`` (nothing without metrics); each task's
    ``(preds, targets)`` (its column, a ``sigmoid`` for a binary task) are made when the metrics take the kept
    batches in order (:meth:`TrainMetrics.update_many`): when read (``compute``, ``state_dict``) or when
    ``flush_every`` batches are kept — the same values as updating
    them every micro-batch, for a fraction of the per-step host work and no host sync.
    ``state_dict``/``load_state_dict`` checkpoint each rank's decaying state, so a resumed run logs the
    train metrics the uninterrupted run would.

    Args:
        flush_every: most micro-batches kept before the metrics take them (bounds the memory held);
            ``None``: ``spec.decay_step``.
    """

    def __init__(self, spec: MetricsConfig, tasks: tuple[Task, ...], device: torch.device, flush_every: int | None = None) -> None:
        self.tasks = tasks
        self.per_task = [build_train_metrics(_task_spec(spec, t), device, "train/" if t.name is None else f"train/{t.name}/") for t in tasks]
        self._active = [(v, m) for v, m in zip(_views(tasks), self.per_task, strict=True) if len(m.metrics)]
        self.flush_every = max(1, flush_every if flush_every is not None else spec.decay_step)
        self._pending: list[tuple[Tensor, Tensor]] = []

    def update(self, logits: Tensor, labels: Tensor) -> None:
        if not self._active:
            return
        self._pending.append((logits, labels))  # per-task columns and sigmoid when flushed: no per-step ops
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Feed the kept micro-batches to the metrics, in order (every rank at the same steps: closing a window syncs)."""
        if not self._pending:
            return
        for view, metrics in self._active:
            metrics.update_many([_task_outputs(view, logits, labels) for logits, labels in self._pending])
        self._pending.clear()

    def compute(self) -> dict[str, float]:
        self.flush()
        out: dict[str, float] = {}
        for metrics in self.per_task:
            out |= metrics.compute()
        return out

    def state_dict(self) -> dict[str, Any]:
        """This rank's decaying state by logged key (:meth:`DecayingMetric.checkpoint_state`), and the saving rank."""
        self.flush()
        return {"rank": _rank(), "metrics": {key: m.checkpoint_state() for ms in self.per_task for key, m in ms.named_metrics()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`. A metric the checkpoint lacks (added to ``metrics.train`` since) starts
        fresh, one no longer configured is ignored. A rank resuming from another rank's file (more ranks than
        saved) takes the shared value and window position with an empty share of window and history, so no
        row is counted twice."""
        saved, own = state["metrics"], state["rank"] == _rank()
        self._pending.clear()
        fresh = []
        for metrics in self.per_task:
            for key, metric in metrics.named_metrics():
                if key in saved:
                    metric.load_checkpoint_state(saved[key], own=own)
                else:
                    fresh.append(key)
        if fresh:
            log.info("train metrics %s are not in the checkpoint and start fresh", fresh)


def grouping_ids(sparse: KeyedJaggedTensor, key: str) -> Tensor:
    """Each row's id of sparse feature ``key`` (the ``gauc`` group): ``[B]``.

    Raises:
        ConfigError: ``key`` is not a sparse feature, or some row has no or several ids.
    """
    if key not in sparse.keys():
        raise ConfigError(f"metrics.grouping_key={key!r} is not a sparse feature; the data has {', '.join(sparse.keys())}")
    jagged = sparse[key]
    if not bool((jagged.lengths() == 1).all()):
        raise ConfigError(f"metrics.grouping_key={key!r} must hold exactly one id per row (a user id, say); some rows have none or several")
    return jagged.values()


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
