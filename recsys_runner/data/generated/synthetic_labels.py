"""The task labels of generated data, shared by ``data=synthetic`` and ``data=synthetic_sequences``: their config fields
(:class:`SyntheticLabelsConfig`: ``tasks``, ``label_kinds``, ``label_classes`` and the funnel's shape, with their checks
and how the model's tasks fill them) and how a batch's labels are drawn from its scores (:class:`TaskLabels`).

Each source scores its rows its own way (a Criteo-shaped row by per-id effects, a history by what it holds); from there
the labels are the same: the first task is the click, each later task a conversion observed only on clicked rows (the
funnel), a ``regression`` task an amount, a ``multiclass`` task a class (:func:`class_index`). One copy of that, so the
two sources cannot drift apart in what ``data.tasks`` means.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from recsys_runner.data.base import DataConfig
from recsys_runner.data.schema import LABEL_KINDS
from recsys_runner.errors import require
from recsys_runner.features import DataNeeds

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class SyntheticLabelsConfig(DataConfig):
    """The label fields of generated data (a base of ``SyntheticDataConfig`` and ``SyntheticSequencesConfig``)."""

    tasks: list[str] | None = None
    """Task names, one label each (``labels [B, T]``): the first is the click, each later one a
    conversion observed only on clicked rows, e.g. ``[ctr, cvr]``. ``null``: the model's tasks — one
    click label ``[B]`` for a single-task model, one label per task for a multi-task one (``model=mmoe``,
    ``model=hstu_rank model.tasks=[ctr,cvr]``)."""
    label_kinds: Any = None
    """Per task of ``tasks``: ``binary`` (the default) or ``regression`` (an amount on every row: ``softplus`` of
    the task's own score, e.g. a watch time), e.g. ``{watch: regression}``. With
    ``tasks: null``, the model's task kinds. A mapping, typed ``Any`` so that ``data.label_kinds={…}``
    works as a plain override."""
    label_classes: Any = None
    """Per ``multiclass`` task of ``label_kinds``: its number of classes ``C >= 2``, e.g. ``{category: 5}``; its label is a
    class index ``0..C-1``, the ``C`` quantiles of ``sigmoid(score_t + logistic noise)`` (learnable: the class rises with
    the task's own score). With ``tasks: null``, the model's (``model.task_specs.<task>.num_classes``)."""
    conversion_bias: float = 0.0
    """Logit offset of each later task's own score: its base rate given a click (0: about one in two; -3: a few in
    a hundred, a rare task whose loss is small next to the click's)."""
    conversion_conflict: float = 0.0
    """How strongly each later task's score falls with the click's score (``score_t - c·score_click``): with ``c > 0`` the
    tasks pull the shared layers apart — a seesaw, where equal fixed loss weights favour the click (docs/multitask.md)."""
    conversion_amount: float | None = None
    """A later ``regression`` task's label as a purchase amount: ``conversion_amount·(1 + softplus(score_t))`` on rows that
    convert (the funnel: a click, then ``Bernoulli(sigmoid(score_t))``), 0 elsewhere — a large-variance amount whose MSE
    dwarfs the click's log loss; its ``auc`` ranks the converting rows. ``null``: ``softplus(score_t)`` on every row."""
    selection_bias: float = 0.0
    """How strongly the click selects on conversion: the click's score gains ``selection_bias`` times the first later
    task's own score, so rows that would convert are clicked more and clicked rows are a biased sample of the impressions
    (a CVR model fitted on them alone ranks the unclicked ones badly; ESMM's setting, ``data=synthetic_esmm``). 0: the
    click ignores the conversion world."""
    conversion_truth: str | None = None
    """Name of one more label column, written on every row: whether the row would convert if clicked (the first later
    task's conversion draw before the click gates it), so a CVR model can be evaluated on all impressions (ESMM's
    ``cvr_all`` task, docs/multitask.md). Ground truth no logged data has: no task trains on it unless told to.
    ``null``: no such column."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tasks is not None:
            require(len(self.tasks) > 0 and len(set(self.tasks)) == len(self.tasks),
                    f"data.tasks={self.tasks} must list distinct task names, e.g. data.tasks=[ctr,cvr], or be null")
        kinds = self.label_kinds or {}
        require(isinstance(kinds, dict), f"data.label_kinds must map task names to kinds, e.g. {{watch: regression}}; got {kinds!r}")
        require(not kinds or self.tasks is not None,
                f"data.label_kinds={kinds} is set but data.tasks is null (the model's tasks, with the model's kinds). "
                f"Fix: data.label_kinds=null and model.task_kinds=[...], or list data.tasks as well")
        unknown = sorted(set(kinds) - set(self.tasks or []))
        require(not unknown, f"data.label_kinds names {unknown}, which are not in data.tasks={self.tasks}. Fix: one entry per task to change")
        wrong = sorted({k for k in kinds.values() if k not in LABEL_KINDS})
        require(not wrong, f"data.label_kinds has kind(s) {wrong}; each must be one of {list(LABEL_KINDS)}")
        self._check_classes(kinds)
        if self.selection_bias or self.conversion_truth is not None:
            what = "data.selection_bias" if self.selection_bias else f"data.conversion_truth={self.conversion_truth!r}"
            require(self.tasks is None or (len(self.tasks) >= 2 and kinds.get(self.tasks[1], "binary") == "binary"),
                    f"{what} reads the funnel's first conversion, but data.tasks={self.tasks} has no binary task after the click. "
                    f"Fix: data.tasks=[ctr,cvr] (or null: the model's tasks), or data.selection_bias=0 data.conversion_truth=null")
            require(self.conversion_truth not in (self.tasks or []),
                    f"data.conversion_truth={self.conversion_truth!r} is also a task of data.tasks={self.tasks}; it is a column of "
                    f"its own. Fix: another name, e.g. data.conversion_truth=cvr_if_clicked")
        # a negative amount would make purchases refunds: not a setting of the data the docs describe, and nothing
        # would refuse it later
        require(self.conversion_amount is None or self.conversion_amount > 0,
                f"data.conversion_amount must be positive (the amount's scale) or null, got {self.conversion_amount}. "
                f"Fix: e.g. data.conversion_amount=50, or null for softplus(score) on every row")

    def _check_classes(self, kinds: dict[str, str]) -> None:
        """``label_classes``: a count ``>= 2`` for each multiclass task of ``label_kinds``, and for no other."""
        classes = self.label_classes or {}
        require(isinstance(classes, dict), f"data.label_classes must map task names to class counts, e.g. {{category: 5}}; got {classes!r}")
        multi = sorted(t for t, k in kinds.items() if k == "multiclass")
        require(sorted(classes) == multi, f"data.label_classes={classes} must give exactly the multiclass tasks of "
                f"data.label_kinds ({multi}) their number of classes, e.g. data.label_classes={{{multi[0] if multi else 'category'}: 5}}")
        small = {t: c for t, c in classes.items() if not isinstance(c, int) or c < 2}
        require(not small, f"data.label_classes has {small}; each must be an integer >= 2")

    def label_changes(self, needs: DataNeeds) -> dict[str, Any]:
        """The label fields left ``null`` filled from the model's ``needs``: its tasks, their kinds and classes (for
        :meth:`DataConfig.for_model`); empty when the fields are set or the model has one unnamed label."""
        if self.tasks is not None or not needs.labels:
            return {}
        if needs.task_label_columns:  # a column to read exists only in files
            log.warning("%s: generated data has no label columns to choose from; it draws each task's label (the click, then the "
                        "funnel's conversions) and only names it so, so this has no effect here. It picks a label column of files "
                        "(data=parquet|csv)", ", ".join(f"model.task_specs.{task}.label={column}"
                                                        for task, column in needs.task_label_columns))
        changes: dict[str, Any] = {"tasks": list(needs.labels)}
        kinds = {n: k for n, k in zip(needs.labels, needs.label_kinds, strict=False) if k != "binary"}
        if kinds:
            changes["label_kinds"] = kinds
        classes = {n: c for n, c in zip(needs.labels, needs.label_classes, strict=False) if c}
        if classes:
            changes["label_classes"] = classes
        return changes

    def label_columns(self) -> str | tuple[str, ...]:
        """The data's ``FeatureSpec.label``: ``label`` (one click ``[B]``), or the tasks then the ``conversion_truth`` column.

        Raises:
            ConfigError: ``selection_bias`` or ``conversion_truth`` on data left with one label (no funnel to read).
        """
        require(not (self.selection_bias or self.conversion_truth is not None) or len(self.tasks or []) >= 2,
                f"data.selection_bias / data.conversion_truth read the funnel's first conversion, but the data has labels "
                f"{list(self.tasks or ['label'])}. Fix: data.tasks=[ctr,cvr], or a multi-task model (model=esmm)")
        if self.tasks is None:
            return "label"
        return (*self.tasks, *([self.conversion_truth] if self.conversion_truth is not None else []))

    def label_column_kinds(self) -> tuple[str, ...]:
        """The data's ``FeatureSpec.label_kinds``: each label column of :meth:`label_columns`'s kind (``data.label_kinds``,
        else binary; the ``conversion_truth`` column is binary); empty for one label."""
        if self.tasks is None:
            return ()
        kinds = self.label_kinds or {}
        return (*(kinds.get(t, "binary") for t in self.tasks), *(["binary"] if self.conversion_truth is not None else []))

    def task_labels(self) -> TaskLabels:
        """How this config's batches turn scores into labels (:class:`TaskLabels`)."""
        tasks = self.tasks or []
        return TaskLabels(kinds=[(self.label_kinds or {}).get(t, "binary") for t in tasks],
                          classes=[(self.label_classes or {}).get(t, 0) for t in tasks], conflict=self.conversion_conflict,
                          amount=self.conversion_amount, truth=self.conversion_truth is not None)


@dataclass(frozen=True)
class TaskLabels:
    """The labels of a multi-task batch, one per task: the first task's from the click's score, each later task's
    from its own score, a conversion observed only on clicked rows (the funnel)."""

    kinds: list[str]
    """Per task: ``binary``, ``regression`` or ``multiclass``."""
    classes: list[int]
    """Per task: its number of classes when ``multiclass``, else 0."""
    conflict: float
    """``conversion_conflict``: how strongly each later task's score falls with the click's."""
    amount: float | None
    """``conversion_amount``: a later ``regression`` task's label as a purchase amount on the converting rows."""
    truth: bool = False
    """``conversion_truth``: one more column after the tasks', the first later task's conversion draw on every row (would
    it convert if clicked), the ground truth of CVR over all impressions."""

    def labels(self, click: torch.Tensor, score: torch.Tensor, task_scores: list[torch.Tensor],
               g: torch.Generator) -> list[torch.Tensor]:
        """Each task's label ``[B]``: the click, then the funnel's conversions; a ``regression`` task's is ``softplus(score_t)``,
        or with ``conversion_amount`` an amount on the converting rows; with :attr:`truth`, then the first conversion's draw
        before the click gates it.

        Args:
            click: the click's draw ``[B]`` (0/1).
            score: the click's score ``[B]``, whose draw ``click`` is.
            task_scores: each later task's own score ``[B]`` (before ``conversion_conflict``), one per task after the first.
            g: the batch's generator, which the conversions and classes are drawn from.
        """
        first = {"binary": click, "multiclass": class_index(score, self.classes[0] if self.classes else 0, g)}
        columns = [first.get(self.kinds[0], F.softplus(score))]
        draws: list[torch.Tensor] = []
        for own, kind, classes in zip(task_scores, self.kinds[1:], self.classes[1:], strict=True):
            task_score = own - self.conflict * score if self.conflict else own
            if kind == "multiclass":
                columns.append(class_index(task_score, classes, g))
                continue
            if kind != "binary" and self.amount is None:
                columns.append(F.softplus(task_score))
                continue
            draws.append(torch.bernoulli(torch.sigmoid(task_score), generator=g))
            converted = click * draws[-1]
            columns.append(converted if self.amount is None or kind == "binary" else converted * self.amount * (1 + F.softplus(task_score)))
        return [*columns, draws[0]] if self.truth else columns


def class_index(score: torch.Tensor, classes: int, g: torch.Generator) -> torch.Tensor:
    """A multiclass label ``[B]`` (float class indices ``0..classes-1``): the ``classes`` quantiles of
    ``sigmoid(score + logistic noise)``, so a row's class rises with its score; zeros (no draw) when the task is not multiclass."""
    if classes < 2:
        return score.new_zeros(score.shape)
    u = torch.rand(score.shape, generator=g, dtype=score.dtype).clamp(1e-6, 1 - 1e-6)
    noisy = torch.sigmoid(score + torch.log(u / (1 - u)))
    return (noisy * classes).floor().clamp(max=classes - 1)
