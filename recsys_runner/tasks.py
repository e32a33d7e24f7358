"""Task kinds: what one model output is trained against, and what the metrics see of it.

A task kind is a class: it owns its loss, how it turns a model output and the batch's labels into
its targets and into the ``(preds, targets)`` the metrics read, and its default metrics. Models
(``models/``) say which tasks they have; the :class:`~recsys_runner.models.train_wrapper.TrainWrapper` and
the metrics (``metrics/tasks.py``) call these methods and never branch on a kind. Both depend on this
module; it depends on neither.

=====================  ======================  ==============================  =======================
kind (config name)     loss                    metrics see                     default metrics
=====================  ======================  ==============================  =======================
:class:`BinaryTask`    BCE on 0/1 labels       ``sigmoid(logits)``, labels     ``metrics.eval/train``
:class:`RegressionTask`  MSE                   raw predictions, targets        mse, mae / mse
:class:`HuberTask`     Huber (``delta``)       raw predictions, targets        mse, mae / mse
:class:`MulticlassTask`  softmax CE over        ``softmax(logits) [B, C]``,     accuracy, logloss, auc /
                       ``C`` logits            class indices ``[B]``           accuracy
:class:`InBatchSoftmaxTask`  softmax CE over   scores ``[Q, C]``, positive     inbatch_recall@10 / none
                       the in-batch scores     index ``[Q]`` (the diagonal)
:class:`NextItemTask`  softmax CE over the     full-table scores ``[B, N]``,   hr@10, ndcg@10, hr@50 /
                       model's sampled logits  true item ids ``[B]``           none
=====================  ======================  ==============================  =======================

Config names a kind once, in :data:`TASK_KINDS` (``model.task_kinds=[binary,regression]``). How several bound tasks'
outputs lie side by side (:func:`output_columns`, :func:`mask_task_index`, predict's :func:`score_columns`) is here too,
since it reads only the tasks; how the config's task names and specs bind to the data's label columns
(``TaskSpec``, ``resolve_tasks``) is :mod:`recsys_runner.task_specs`.

A task's checks of its label values (a class index within ``C``, a sample weight ``>= 0``, ESMM's funnel) run on the host,
on each batch's labels before the batch is copied to the device (:func:`check_batch_labels`, called as the loop and the
evaluator read the batches: :mod:`recsys_runner.train.batch_checks`), not in the model's forward, where reading a device
value back would make the host wait for the device in every step.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from recsys_runner.errors import ConfigError, DataError

__all__ = ["Task", "BinaryTask", "RegressionTask", "HuberTask", "MulticlassTask", "InBatchSoftmaxTask", "NextItemTask", "TASK_KINDS", "LABEL_TASK_KINDS", "SINGLE_TASK",
           "task_kind", "logit_shift", "calibrated", "output_columns", "mask_task_index", "checked_weights", "check_batch_labels"]


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
        weight_column: a column of ``Batch.labels`` holding each row's sample weight; ``None``: every row weighs 1.
        mask_column: a column of ``Batch.labels`` (another task's label): the loss and the metrics count only rows where it
            is positive (a conversion loss on clicked rows, as ESMM-style setups need); ``None``: every row.
        label: the data's name of the label column (for messages); ``None``: unknown.
    """

    name: str | None = None
    column: int | None = None
    weight: float = 1.0
    eval_metrics: tuple[str, ...] | None = None
    train_metrics: tuple[str, ...] | None = None
    weight_column: int | None = None
    mask_column: int | None = None
    label: str | None = None

    kind: ClassVar[str]
    """The kind's config name (``model.task_kinds``) and how error messages call it."""
    label_kind: ClassVar[str] = "binary"
    """How the data checks (and generated data draws) the task's label column: ``binary``, ``regression`` or ``multiclass``."""
    reads_labels: ClassVar[bool] = True
    """Whether the targets come from ``Batch.labels`` (an in-batch softmax's targets are row positions)."""
    default_eval_metrics: ClassVar[tuple[str, ...] | None] = None
    """Eval metrics when the task sets none; ``None``: ``metrics.eval``."""
    default_train_metrics: ClassVar[tuple[str, ...] | None] = None
    """Decaying train metrics when the task sets none; ``None``: ``metrics.train``."""
    metric_inputs_kinds: ClassVar[tuple[str, ...]] = ("pointwise", "grouped")
    """Which registered metrics apply (their ``inputs``, see ``metrics.register_metric``): per-row
    predictions feed pointwise and grouped metrics, score matrices feed retrieval metrics."""
    train_metric_choices: ClassVar[tuple[str, ...] | None] = None
    """The decaying train metrics the kind's outputs can feed; ``None``: any of ``metrics.train``'s."""
    catalogue_kinds: ClassVar[tuple[str, ...]] = ()
    """Which of :attr:`metric_inputs_kinds` are not computed from the output but by a pass over the data's item
    catalogue (a two-tower model's full-corpus ``recall@k``: ``train/corpus.py``); none for most kinds."""

    @property
    def output_width(self) -> int:
        """How many values the model outputs per row for this task: 1 (a logit ``[B]``); a multi-class task's ``C``."""
        return 1

    @property
    def checks_labels(self) -> bool:
        """Whether :func:`check_batch_labels` has anything to check for this task: its sample weights, or its kind's
        own check (:meth:`check_labels`)."""
        return self.weight_column is not None

    def check_labels(self, labels: Tensor, batch: str = "batch") -> None:
        """The kind's own check of its label column in one batch's ``labels`` (``[B]`` or ``[B, T]``, on the host before
        the batch's copy to the device); nothing by default. ``batch``: which batch (``training batch`` / ``eval
        batch``), for the message.

        Raises:
            DataError: a value the task cannot train on, naming the task, the value and the fix."""
        return

    def targets(self, output: Tensor, labels: Tensor) -> Tensor:
        """What ``output`` is trained against: the task's label column (``[B]``), unchecked (:meth:`check_labels` ran on the
        host)."""
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

    def nonfinite_fix(self) -> str | None:
        """What this kind's own loss suggests changing when it went NaN or infinite (the NaN guard's message names the
        task with it); ``None``: nothing beyond the guard's usual causes (the lr, fp16, the data)."""
        return None

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
    label_kind: ClassVar[str] = "regression"
    default_eval_metrics: ClassVar[tuple[str, ...] | None] = ("mse", "mae")
    default_train_metrics: ClassVar[tuple[str, ...] | None] = ("mse",)

    def row_losses(self, output: Tensor, targets: Tensor) -> Tensor:
        return (output - targets.float()).pow(2)

    def nonfinite_fix(self) -> str | None:
        # float32 ends at 3.4e38: an error beyond 1.8e19 squares to inf, and smaller huge ones blow the weights up
        return (f"MSE squares each error, so labels in the order of 1e19 (or huge amounts that drive the weights there) "
                f"overflow float32. Fix: scale the label column (e.g. log1p of the amounts, predicting log1p(amount)), or "
                f"train it with the Huber loss, linear in large errors: '+model.task_specs.{self.name}.kind=huber'")


@dataclass(frozen=True, slots=True)
class HuberTask(RegressionTask):
    """A real-valued label with heavy tails: Huber loss (quadratic within ``delta`` of the target, linear beyond), so a
    few huge amounts do not dominate the gradient; metrics as :class:`RegressionTask`."""

    kind: ClassVar[str] = "huber"
    delta: float = 1.0

    def row_losses(self, output: Tensor, targets: Tensor) -> Tensor:
        return F.huber_loss(output, targets.float(), reduction="none", delta=self.delta)

    def nonfinite_fix(self) -> str | None:
        return (f"huge labels still make huge predictions and gradients. Fix: scale the label column (e.g. log1p of the "
                f"amounts, predicting log1p(amount)), or lower model.task_specs.{self.name}.huber_delta")


def checked_classes(target: Tensor, num_classes: int, task: str, label: str) -> Tensor:
    """``target`` unchanged when every value is a class index ``0 … num_classes - 1``.

    Raises:
        DataError: a label outside ``[0, num_classes)`` or not a whole number, naming the task, its label and the fix.
    """
    bad = (target < 0) | (target >= num_classes) | (target != target.trunc())
    if bool(bad.any()):
        value = float(target[bad][0])
        raise DataError(f"task {task!r}: its label {label!r} holds {value:g}, but a multiclass task with "
                        f"num_classes={num_classes} needs class indices 0..{num_classes - 1}. Fix the data, or set "
                        f"model.task_specs.{task}.num_classes")
    return target


def checked_weights(weights: Tensor, task: str, batch: str = "batch") -> Tensor:
    """``weights`` (a task's sample-weight column) unchanged when none is negative: the data reads the column as any
    finite number (a ``regression`` label), and a negative weight would turn its row's loss into one to maximize, a
    silently wrong model. ``batch``: which batch (``training batch`` / ``eval batch``), for the message.

    Raises:
        DataError: a negative weight, naming the task, the setting and the fix.
    """
    if bool((weights < 0).any()):
        raise DataError(f"task {task!r}: its sample-weight column (model.task_specs.{task}.sample_weight) holds "
                        f"{float(weights.min()):g} in this {batch}, but a row's weight in the loss must be >= 0 (a negative one "
                        f"would train the model away from that row's label). Fix the data, e.g. clip the column at 0")
    return weights


@dataclass(frozen=True, slots=True)
class MulticlassTask(Task):
    """One of ``num_classes`` classes: the label column holds a class index ``0..C-1``, the model outputs ``C`` logits
    ``[B, C]``; softmax cross-entropy; metrics see ``softmax(logits) [B, C]`` and the class indices ``[B]``.

    A label outside ``[0, C)`` (or not an integer) is a :class:`~recsys_runner.errors.DataError` naming the column and
    the value, raised by :meth:`check_labels` on the host as the batch is read (``F.cross_entropy`` would assert inside
    the kernel)."""

    kind: ClassVar[str] = "multiclass"
    label_kind: ClassVar[str] = "multiclass"
    default_eval_metrics: ClassVar[tuple[str, ...] | None] = ("accuracy", "logloss", "auc")
    default_train_metrics: ClassVar[tuple[str, ...] | None] = ("accuracy",)
    metric_inputs_kinds: ClassVar[tuple[str, ...]] = ("multiclass",)
    train_metric_choices: ClassVar[tuple[str, ...]] = ("accuracy", "logloss")
    """The decaying train metrics that read class probabilities (the decaying ``auc`` is binary)."""
    num_classes: int = 2

    @property
    def output_width(self) -> int:
        return self.num_classes

    @property
    def checks_labels(self) -> bool:
        return True

    def check_labels(self, labels: Tensor, batch: str = "batch") -> None:
        target = labels if self.column is None else labels[:, self.column]
        checked_classes(target, self.num_classes, str(self.name), str(self.label or self.column))

    def row_losses(self, output: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(output, targets.long(), reduction="none")

    def metric_inputs(self, output: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        return torch.softmax(output, dim=-1), targets


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
      row's true next item id; the metrics (``hr@<k>``, ``ndcg@<k>``) rank it among all ``N`` items (with
      :attr:`eval_negatives` ``n``, among the true item and ``n`` sampled ones).
    """

    num_items: int | None = None
    """``N``, the item table's size (set by the model), against which each eval row ranks its true item: the ``k`` of
    every ``@k`` metric must stay below it (:func:`~recsys_runner.metrics.tasks.check_task_metrics`); ``None``: unknown."""
    eval_negatives: int = 0
    """``n > 0``: each eval row ranks its true item against ``n`` sampled items instead, ``n + 1`` candidates
    (``model.eval_negatives``)."""

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


TASK_KINDS: dict[str, type[Task]] = {cls.kind: cls for cls in (BinaryTask, RegressionTask, HuberTask, MulticlassTask, InBatchSoftmaxTask,
                                                        NextItemTask)}
"""Every task kind by its config name: the one place a kind's name is read."""

LABEL_TASK_KINDS: tuple[str, ...] = tuple(name for name, cls in TASK_KINDS.items() if cls.reads_labels)
"""The kinds a labelled task may have (``model.task_kinds``): ``binary``, ``regression`` (MSE) and ``huber``."""

SINGLE_TASK: tuple[Task, ...] = (BinaryTask(),)
"""The task of every model without a ``tasks`` attribute: one unnamed binary output ``[B]``."""


def logit_shift(negative_rate: float | None) -> float:
    """What a binary logit trained on rows whose negatives were kept at ``negative_rate`` (``data.negative_rate``) is corrected
    by to be the logit of the probability on all rows: ``log(r)``, since ``q = p / (p + (1 - p) / r)`` is
    ``logit(q) = logit(p) + log(r)`` (He et al., 2014); 0 for ``None`` (every row trained)."""
    return 0.0 if negative_rate is None else math.log(negative_rate)


def calibrated(out: Any, shift: float) -> Any:
    """A model's output (a logit ``[B]``, or a dict of one task's) with :func:`logit_shift`'s ``shift`` added: what evaluation,
    predict and the exported program score. The training loss reads the output without it (the rows it trained on)."""
    if shift == 0.0:
        return out
    return {name: value + shift for name, value in out.items()} if isinstance(out, dict) else out + shift


def task_kind(name: str, key: str, valid: Sequence[str] = LABEL_TASK_KINDS) -> type[Task]:
    """The task class config name ``name`` (of config key ``key``) stands for.

    Raises:
        ConfigError: ``name`` is not one of ``valid``, listing them.
    """
    if name not in valid:
        raise ConfigError(f"{key} has [{name!r}]; each must be one of {list(valid)}")
    return TASK_KINDS[name]


def score_columns(tasks: Sequence[Task], logits: Tensor) -> dict[str, np.ndarray]:
    """``predict``'s score columns of the TrainWrapper's ``logits [B, ΣW]``: ``score`` (``score_<task>`` for named tasks),
    each task's :meth:`~Task.metric_inputs` (a probability for a binary task, the value for a regression); for a
    multi-class task its most probable class ``class_<task>`` and that class's probability. The served MLflow model
    returns the same columns (:mod:`recsys_runner.data.encoding.served`)."""
    outputs = logits.float().reshape(logits.shape[0], -1)
    scores: dict[str, np.ndarray] = {}
    for task, columns in zip(tasks, output_columns(tasks), strict=True):
        name = "score" if task.name is None else f"score_{task.name}"
        out = outputs[:, columns]
        preds = task.metric_inputs(out if task.output_width > 1 else out[:, 0], out[:, 0])[0]
        if preds.dim() == 2:  # a multi-class task: its most probable class, and that class's probability
            prob, label = preds.max(dim=1)
            scores[f"class_{name.removeprefix('score_')}"] = label.cpu().numpy().astype(np.int64)
            preds = prob
        scores[name] = preds.cpu().numpy().astype(np.float32)
    return scores


def check_batch_labels(tasks: Sequence[Task], labels: Tensor, batch: str = "batch") -> None:
    """Every check of one batch's ``labels`` the ``tasks`` make, on the host (the batch before its copy to the device, so
    that no check makes the step wait for the device): each task's own (:meth:`Task.check_labels`), in task order, then
    each sample-weight column (:func:`checked_weights`), the order in which the loss reads them. ``batch``: which batch
    (``training batch`` / ``eval batch``), for the message.

    Raises:
        DataError: the first bad value, naming the task, the value, the batch and the fix.
    """
    for task in tasks:
        task.check_labels(labels, batch)
    for task in tasks:
        if task.weight_column is not None:
            checked_weights(labels[:, task.weight_column].float(), str(task.name), batch)


def output_columns(tasks: Sequence[Task]) -> list[slice]:
    """Each task's columns in the TrainWrapper's ``logits [B, ΣW]`` (the tasks' outputs side by side, ``W`` each task's
    :attr:`~Task.output_width`: one column per task unless a task is multi-class)."""
    ends = [sum(t.output_width for t in tasks[:i + 1]) for i in range(len(tasks))]
    return [slice(end - t.output_width, end) for t, end in zip(tasks, ends, strict=True)]


def mask_task_index(task: Task, tasks: Sequence[Task]) -> int | None:
    """The position in ``tasks`` (and in the TrainWrapper's ``labels [B, T]``) of the task whose positive label masks
    ``task`` (its :attr:`~Task.mask_column`), or ``None`` for an unmasked task.

    Raises:
        ConfigError: no task reads the mask column.
    """
    if task.mask_column is None:
        return None
    index = next((i for i, t in enumerate(tasks) if t.column == task.mask_column), None)
    if index is None:
        raise ConfigError(f"task {task.name!r} is masked by label column {task.mask_column}, which no task of {[t.name for t in tasks]} reads")
    return index
