"""Task kinds: what one model output is trained against, and what the metrics see of it.

A task kind is a class: it owns its loss, how it turns a model output and the batch's labels into
its targets and into the ``(preds, targets)`` the metrics read, and its default metrics. Models
(``models/``) say which tasks they have; the :class:`~recsys_runner.models.common.TrainWrapper` and
the metrics (``metrics/tasks.py``) call these methods and never branch on a kind. Both depend on this
module; it depends on neither.

=====================  ======================  ==============================  =======================
kind (config name)     loss                    metrics see                     default metrics
=====================  ======================  ==============================  =======================
:class:`BinaryTask`    BCE on 0/1 labels       ``sigmoid(logits)``, labels     ``metrics.eval/train``
:class:`RegressionTask`  MSE                   raw predictions, targets        mse, mae / mse
:class:`InBatchSoftmaxTask`  softmax CE over   scores ``[Q, C]``, positive     inbatch_recall@10 / none
                       the in-batch scores     index ``[Q]`` (the diagonal)
:class:`NextItemTask`  softmax CE over the     full-table scores ``[B, N]``,   hr@10, ndcg@10, hr@50 /
                       model's sampled logits  true item ids ``[B]``           none
=====================  ======================  ==============================  =======================

Config names a kind once, in :data:`TASK_KINDS` (``model.task_kinds=[binary,regression]``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from recsys_runner.errors import ConfigError, require
from recsys_runner.features import FeatureSpec

__all__ = ["Task", "BinaryTask", "RegressionTask", "InBatchSoftmaxTask", "NextItemTask", "TASK_KINDS", "LABEL_TASK_KINDS", "SINGLE_TASK",
           "task_kind", "resolve_tasks"]


@dataclass(frozen=True, slots=True)
class Task(abc.ABC):
    """What one model output is trained and evaluated as; subclassed once per kind.

    A model with several outputs has a ``tasks`` attribute (a tuple of tasks, in output order) and
    returns ``{task.name: output}``; a model without one is :data:`SINGLE_TASK`, one unnamed binary output.

    Attributes:
        name: metric-key prefix (``eval/<name>/auc``) and the key of its output; ``None`` keeps the plain
            keys (``eval/auc``) and means the model returns one tensor, not a dict.
        column: the task's column in ``Batch.labels [B, T]``; ``None`` when labels are ``[B]``.
        weight: the task's weight in the summed loss.
        eval_metrics: the task's own eval metric names; ``None`` takes the kind's default, else ``metrics.eval``.
        train_metrics: the task's own train metric names; ``None`` takes the kind's default, else ``metrics.train``.
    """

    name: str | None = None
    column: int | None = None
    weight: float = 1.0
    eval_metrics: tuple[str, ...] | None = None
    train_metrics: tuple[str, ...] | None = None

    kind: ClassVar[str]
    """The kind's config name (``model.task_kinds``) and how error messages call it."""
    reads_labels: ClassVar[bool] = True
    """Whether the targets come from ``Batch.labels`` (an in-batch softmax's targets are row positions)."""
    default_eval_metrics: ClassVar[tuple[str, ...] | None] = None
    """Eval metrics when the task sets none; ``None``: ``metrics.eval``."""
    default_train_metrics: ClassVar[tuple[str, ...] | None] = None
    """Decaying train metrics when the task sets none; ``None``: ``metrics.train``."""
    metric_inputs_kinds: ClassVar[tuple[str, ...]] = ("pointwise", "grouped")
    """Which registered metrics apply (their ``inputs``, see ``metrics.register_metric``): per-row
    predictions feed pointwise and grouped metrics, score matrices feed retrieval metrics."""
    catalogue_kinds: ClassVar[tuple[str, ...]] = ()
    """Which of :attr:`metric_inputs_kinds` are not computed from the output but by a pass over the data's item
    catalogue (a two-tower model's full-corpus ``recall@k``: ``train/corpus.py``); none for most kinds."""

    def targets(self, output: Tensor, labels: Tensor) -> Tensor:
        """What ``output`` is trained against: the task's label column (``[B]``)."""
        return labels if self.column is None else labels[:, self.column]

    def output_and_targets(self, out: Any, labels: Tensor) -> tuple[Tensor, Tensor]:
        """An unnamed task's model output as float32 and its targets (:meth:`targets`); a kind whose model returns
        its own targets beside its output (:class:`NextItemTask`) overrides this."""
        output = out.float()
        return output, self.targets(output, labels)

    def served(self, out: Any) -> Any:
        """What a server gets of the model's eval-mode output (the exported program's output): all of it by default."""
        return out

    @abc.abstractmethod
    def row_losses(self, output: Tensor, targets: Tensor) -> Tensor:
        """Each row's unweighted loss ``[B]`` (``output`` is float32)."""

    def loss(self, output: Tensor, targets: Tensor) -> Tensor:
        """The task's unweighted loss: the mean of :meth:`row_losses`, a float32 scalar."""
        return self.row_losses(output, targets).mean()

    def metric_inputs(self, output: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """``(preds, targets)`` for the metrics' ``update``."""
        return output, targets

    def eval_metric_names(self, configured: Sequence[str]) -> list[str]:
        """The eval metrics of this task: its own, else its kind's default, else ``configured`` (``metrics.eval``)."""
        return list(self.eval_metrics or self.default_eval_metrics or configured)

    def train_metric_names(self, configured: Sequence[str]) -> list[str]:
        """The decaying train metrics of this task: its own, else its kind's default, else ``configured``."""
        own = self.train_metrics if self.train_metrics is not None else self.default_train_metrics
        return list(configured if own is None else own)


@dataclass(frozen=True, slots=True)
class BinaryTask(Task):
    """A 0/1 label: BCE on logits ``[B]``; metrics see ``sigmoid(logits)``."""

    kind: ClassVar[str] = "binary"

    def row_losses(self, output: Tensor, targets: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(output, targets.float(), reduction="none")

    def metric_inputs(self, output: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        return torch.sigmoid(output), targets


@dataclass(frozen=True, slots=True)
class RegressionTask(Task):
    """A real-valued label (an amount, a watch time): MSE on the raw output ``[B]``, which metrics see as is."""

    kind: ClassVar[str] = "regression"
    default_eval_metrics: ClassVar[tuple[str, ...] | None] = ("mse", "mae")
    default_train_metrics: ClassVar[tuple[str, ...] | None] = ("mse",)

    def row_losses(self, output: Tensor, targets: Tensor) -> Tensor:
        return (output - targets.float()).pow(2)


@dataclass(frozen=True, slots=True)
class InBatchSoftmaxTask(Task):
    """Retrieval by in-batch softmax: the output is query×candidate scores ``[Q, C]`` (``Q <= C``: the batch's last
    ``C - Q`` rows may be sampled items, candidates only) whose positive for query ``q`` is candidate ``q``; softmax
    cross-entropy over each row (any logQ correction is the model's, in its training scores). Metrics see the scores
    and the positives' indices ``[Q]`` (``inbatch_recall@k``); the full-corpus ranking metrics (``recall@k``,
    ``ndcg@k``, ``mrr``, ``coverage@k``) are computed over the data's item catalogue instead; the train step logs
    no metrics."""

    kind: ClassVar[str] = "retrieval"
    reads_labels: ClassVar[bool] = False
    default_eval_metrics: ClassVar[tuple[str, ...] | None] = ("inbatch_recall@10",)
    default_train_metrics: ClassVar[tuple[str, ...] | None] = ()
    metric_inputs_kinds: ClassVar[tuple[str, ...]] = ("retrieval", "ranking")
    catalogue_kinds: ClassVar[tuple[str, ...]] = ("ranking",)

    def targets(self, output: Tensor, labels: Tensor) -> Tensor:
        return torch.arange(output.shape[0], device=output.device)

    def row_losses(self, output: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(output, targets, reduction="none")

    def loss(self, output: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(output, targets)


@dataclass(frozen=True, slots=True)
class NextItemTask(Task):
    """Next-item prediction (SASRec, HSTU): the model returns ``(scores, targets)`` itself, because its targets are
    items of the batch, not labels.

    * training: ``scores [P, C]`` of the batch's ``P`` positions with a next event against ``C`` candidate items (the
      in-batch positives, the model's sampled-softmax logits, any logQ correction applied), ``targets [P]`` the index
      of each position's positive among them; the loss is softmax cross-entropy;
    * evaluation: ``scores [B, N]`` of each row's user state against every item of the table, ``targets [B]`` the
      row's true next item id; the metrics (``hr@<k>``, ``ndcg@<k>``) rank it among all ``N`` items.
    """

    kind: ClassVar[str] = "next_item"
    reads_labels: ClassVar[bool] = False
    default_eval_metrics: ClassVar[tuple[str, ...] | None] = ("hr@10", "ndcg@10", "hr@50")
    default_train_metrics: ClassVar[tuple[str, ...] | None] = ()
    metric_inputs_kinds: ClassVar[tuple[str, ...]] = ("ranking",)

    def output_and_targets(self, out: Any, labels: Tensor) -> tuple[Tensor, Tensor]:
        scores, targets = out
        return scores.float(), targets

    def served(self, out: Any) -> Any:
        """The scores ``[B, N]`` of every item for each row: the true next items are the eval's, not a server's."""
        return out[0]

    def row_losses(self, output: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(output, targets, reduction="none")

    def loss(self, output: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(output, targets)


TASK_KINDS: dict[str, type[Task]] = {cls.kind: cls for cls in (BinaryTask, RegressionTask, InBatchSoftmaxTask, NextItemTask)}
"""Every task kind by its config name: the one place a kind's name is read."""

LABEL_TASK_KINDS: tuple[str, ...] = tuple(name for name, cls in TASK_KINDS.items() if cls.reads_labels)
"""The kinds a labelled task may have (``model.task_kinds``): ``binary`` and ``regression``."""

SINGLE_TASK: tuple[Task, ...] = (BinaryTask(),)
"""The task of every model without a ``tasks`` attribute: one unnamed binary output ``[B]``."""


def task_kind(name: str, key: str, valid: Sequence[str] = LABEL_TASK_KINDS) -> type[Task]:
    """The task class config name ``name`` (of config key ``key``) stands for.

    Raises:
        ConfigError: ``name`` is not one of ``valid``, listing them.
    """
    if name not in valid:
        raise ConfigError(f"{key} has [{name!r}]; each must be one of {list(valid)}")
    return TASK_KINDS[name]


def resolve_tasks(features: FeatureSpec, names: list[str], loss_weights: list[float] | None, kinds: list[str] | None) -> tuple[Task, ...]:
    """Tasks ``names`` of kinds ``kinds``, bound to their label columns in the data.

    Args:
        features: the data's schema; its ``label_names`` are the tasks it has labels for.
        names: the model's task names (``model.tasks``).
        loss_weights: one weight per task, or ``None`` for all 1.
        kinds: one kind name per task (:data:`LABEL_TASK_KINDS`), or ``None`` for all binary.

    Raises:
        ConfigError: a task has no label column in the data, a kind is unknown, or a list's length differs from ``names``.
    """
    weights = [1.0] * len(names) if loss_weights is None else list(loss_weights)
    task_kinds = [BinaryTask.kind] * len(names) if kinds is None else list(kinds)
    require(len(weights) == len(names), f"model.loss_weights has {len(weights)} entries but model.tasks={list(names)} has "
            f"{len(names)}. Fix: give one weight per task, e.g. model.loss_weights=[{','.join(['1.0'] * len(names))}]")
    require(len(task_kinds) == len(names), f"model.task_kinds has {len(task_kinds)} entries but model.tasks={list(names)} "
            f"has {len(names)}. Fix: give one kind ({'/'.join(LABEL_TASK_KINDS)}) per task, or model.task_kinds=null")
    classes = [task_kind(k, "model.task_kinds") for k in task_kinds]
    labels = features.label_names
    missing = [n for n in names if n not in labels]
    if missing or not features.multi_label:
        raise ConfigError(
            f"model.tasks={list(names)}: task(s) {missing or list(names)} have no label column; the data's label(s): "
            f"{list(labels)}{'' if features.multi_label else ' (a single [B] label)'}. Fix: name tasks after the data's "
            f"labels, or give the data one label per task (data.tasks=[...] for synthetic data, data.labels={{task: column}} "
            f"for Parquet/CSV)"
        )
    return tuple(cls(n, column=labels.index(n), weight=float(w)) for n, cls, w in zip(names, classes, weights, strict=True))
