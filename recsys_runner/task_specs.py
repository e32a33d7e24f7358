"""Task specs: how the config's task names and specs bind to the data's label columns.

``model.tasks`` / ``loss_weights`` / ``task_kinds`` and ``model.task_specs.<task>`` (a :class:`TaskSpec`) are checked
here (:func:`check_task_specs`) and bound to the data's label columns (:func:`resolve_tasks`), which makes the
:class:`~recsys_runner.tasks.Task` objects a multi-task model sets as its ``tasks``. This is apart from
:mod:`recsys_runner.tasks` because it is about config and data, not about what a task is: the metrics and the serving
code read bound tasks (their kinds, losses, output columns) and never a spec, so they import ``tasks`` alone; this
module imports ``tasks`` and the feature schema, and ``tasks`` never imports it. The module is named after the config
key it reads, ``model.task_specs``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from recsys_runner.errors import ConfigError, require
from recsys_runner.features import FeatureSpec
from recsys_runner.tasks import LABEL_TASK_KINDS, BinaryTask, HuberTask, MulticlassTask, Task, task_kind

__all__ = ["TaskSpec", "check_task_specs", "task_labels", "resolve_tasks"]


@dataclass(kw_only=True)
class TaskSpec:
    """One task's definition beyond its name: ``model.task_specs.<task>`` (a field left ``null`` follows ``model.tasks`` /
    ``loss_weights`` / ``task_kinds`` and the metrics config)."""

    label: str | None = None
    """The data's label column the task is trained on; ``null``: the column named like the task."""
    kind: str | None = None
    """``binary`` (BCE), ``regression`` (MSE), ``huber`` (Huber loss) or ``multiclass`` (softmax cross-entropy over
    ``num_classes`` logits); ``null``: its ``model.task_kinds`` entry, else binary."""
    weight: float | None = None
    """Weight of the task's loss (fixed and uncertainty weighting); ``null``: its ``model.loss_weights`` entry, else 1."""
    huber_delta: float = 1.0
    """Where a ``huber`` task's loss turns from quadratic to linear (in label units)."""
    num_classes: int | None = None
    """A ``multiclass`` task's number of classes ``C >= 2`` (its label holds ``0..C-1``, its head outputs ``C`` logits);
    required for that kind, refused for any other."""
    eval_metrics: list[str] | None = None
    """The task's own eval metrics (``[auc, gauc]``, at least one); ``null``: its kind's default, else ``metrics.eval``."""
    train_metrics: list[str] | None = None
    """The task's own decaying train metrics; ``null``: its kind's default, else ``metrics.train``."""
    sample_weight: str | None = None
    """A column of the data holding each row's weight in the task's loss (a weighted mean over rows); ``null``: all 1."""
    only_where_positive: str | None = None
    """Another (binary) task: this task's loss counts only rows where that task's label is positive, e.g. ``cvr``'s on
    ``ctr``-positive (clicked) rows, as ESMM-style setups need; ``null``: every row. The task's metrics see those rows
    only too (``eval/cvr/auc`` over clicked rows)."""


def check_task_specs(names: Sequence[str], specs: Mapping[str, TaskSpec], kinds: Sequence[str] | None,
                     weights: Sequence[float] | None) -> None:
    """Check ``model.task_specs`` against the task names before anything is built.

    Raises:
        ConfigError: naming the key: an unknown task, an unknown kind, a negative weight or all weights 0, a mask naming
            an unknown or non-binary task or the task itself, a non-positive ``huber_delta``, an empty
            ``eval_metrics``.
    """
    unknown = sorted(set(specs) - set(names))
    require(not unknown, f"model.task_specs names {unknown}, which are not tasks (model.tasks={list(names)}). Fix: one entry per task")
    resolved_kinds = _per_task(names, specs, "kind", list(kinds) if kinds is not None else [BinaryTask.kind] * len(names))
    for name, kind in zip(names, resolved_kinds, strict=True):
        task_kind(kind, f"model.task_specs.{name}.kind")
    resolved = _per_task(names, specs, "weight", list(weights) if weights is not None else [1.0] * len(names))
    negative = [f"{n}={w}" for n, w in zip(names, resolved, strict=True) if w < 0]
    require(not negative, f"task weights must be >= 0 (model.task_specs.<task>.weight / model.loss_weights), got {', '.join(negative)}")
    require(sum(resolved) > 0, "task weights are all 0 (model.task_specs.<task>.weight / model.loss_weights): nothing would be "
            "trained. Fix: give some task a positive weight")
    _check_classes(names, specs, resolved_kinds)
    for name, spec in specs.items():
        require(spec.huber_delta > 0, f"model.task_specs.{name}.huber_delta must be positive, got {spec.huber_delta}")
        require(spec.eval_metrics is None or len(spec.eval_metrics) > 0,
                f"model.task_specs.{name}.eval_metrics=[] lists no metric, and the task's eval would log its kind's default ones "
                f"(or metrics.eval) instead. Fix: list the metrics to log, e.g. model.task_specs.{name}.eval_metrics=[auc], or drop "
                f"it for the default")
        gate = spec.only_where_positive
        if gate is None:
            continue
        require(gate in names and gate != name, f"model.task_specs.{name}.only_where_positive={gate!r} must name another task "
                f"of model.tasks={list(names)}, e.g. model.task_specs.{name}.only_where_positive={next((n for n in names if n != name), 'ctr')}")
        require(resolved_kinds[list(names).index(gate)] == BinaryTask.kind,
                f"model.task_specs.{name}.only_where_positive={gate!r} names a {resolved_kinds[list(names).index(gate)]} task; "
                f"a mask needs a binary task's 0/1 label")


def _check_classes(names: Sequence[str], specs: Mapping[str, TaskSpec], kinds: Sequence[str]) -> None:
    """``num_classes`` given, and at least 2, exactly for the multiclass tasks; their train metrics read class probabilities."""
    for name, kind in zip(names, kinds, strict=True):
        spec = specs.get(name)
        classes = spec.num_classes if spec is not None else None
        if kind != MulticlassTask.kind:
            require(classes is None, f"model.task_specs.{name}.num_classes={classes} is only for a multiclass task, but {name!r} is "
                    f"{kind}. Fix: remove it, or set model.task_specs.{name}.kind=multiclass")
            continue
        require(classes is not None, f"task {name!r} is multiclass but has no number of classes. Fix: "
                f"'+model.task_specs.{name}={{kind: multiclass, num_classes: <C>}}'")
        require(isinstance(classes, int) and classes >= 2,
                f"model.task_specs.{name}.num_classes must be an integer >= 2, got {classes!r}")
        assert spec is not None
        allowed = MulticlassTask.train_metric_choices or ()
        wrong = [m for m in (spec.train_metrics or []) if m not in allowed]
        require(not wrong, f"model.task_specs.{name}.train_metrics lists {wrong}; a multiclass task's train metrics are {list(allowed)}")


def _per_task(names: Sequence[str], specs: Mapping[str, TaskSpec], key: str, defaults: list[Any]) -> list[Any]:
    """Each task's ``key``: its spec's value when set, else its entry of ``defaults``."""
    values = [getattr(specs[n], key) if n in specs else None for n in names]
    return [d if v is None else v for v, d in zip(values, defaults, strict=True)]


def task_labels(names: Sequence[str], specs: Mapping[str, TaskSpec]) -> list[str]:
    """The data columns tasks ``names`` read: each task's label (its own name unless ``label`` says), then the
    sample-weight columns, each once."""
    labels = [(specs[n].label if n in specs else None) or n for n in names]
    weights = [s.sample_weight for n in names if n in specs for s in [specs[n]] if s.sample_weight is not None]
    return list(dict.fromkeys([*labels, *weights]))


def resolve_tasks(features: FeatureSpec, names: list[str], loss_weights: list[float] | None, kinds: list[str] | None,
                  specs: Mapping[str, TaskSpec] | None = None) -> tuple[Task, ...]:
    """Tasks ``names`` of kinds ``kinds``, bound to their label columns in the data.

    Args:
        features: the data's schema; its ``label_names`` are the tasks it has labels for.
        names: the model's task names (``model.tasks``).
        loss_weights: one weight per task, or ``None`` for all 1.
        kinds: one kind name per task (:data:`LABEL_TASK_KINDS`), or ``None`` for all binary.
        specs: per task, what overrides the lists and adds to them (``model.task_specs``: :class:`TaskSpec`).

    Raises:
        ConfigError: a task's label or sample-weight column is not in the data, a kind is unknown, or a list's length
            differs from ``names``.
    """
    specs = dict(specs or {})
    weights = [1.0] * len(names) if loss_weights is None else list(loss_weights)
    task_kinds = [BinaryTask.kind] * len(names) if kinds is None else list(kinds)
    require(len(weights) == len(names), f"model.loss_weights has {len(weights)} entries but model.tasks={list(names)} has "
            f"{len(names)}. Fix: give one weight per task, e.g. model.loss_weights=[{','.join(['1.0'] * len(names))}]")
    require(len(task_kinds) == len(names), f"model.task_kinds has {len(task_kinds)} entries but model.tasks={list(names)} "
            f"has {len(names)}. Fix: give one kind ({'/'.join(LABEL_TASK_KINDS)}) per task, or model.task_kinds=null")
    check_task_specs(names, specs, task_kinds, weights)
    classes = [task_kind(k, "model.task_kinds") for k in _per_task(names, specs, "kind", task_kinds)]
    labels, columns = features.label_names, [(specs[n].label if n in specs else None) or n for n in names]
    renamed = [f"model.task_specs.{n}.label={c!r}" for n, c in zip(names, columns, strict=True) if c != n and c not in labels]
    require(not renamed or not features.multi_label, f"{', '.join(renamed)} is not a label column of the data; its label columns: "
            f"{list(labels)}. Fix: name one of them: for files these are the names data.labels={{name: column}} gives the "
            f"file's columns, not the columns' own names (a task reads its label through that mapping; add the column there)")
    missing = [n for n, c in zip(names, columns, strict=True) if c not in labels]
    if missing or not features.multi_label:
        raise ConfigError(
            f"model.tasks={list(names)}: task(s) {missing or list(names)} have no label column; the data's label(s): "
            f"{list(labels)}{'' if features.multi_label else ' (a single [B] label)'}. Fix: name tasks after the data's "
            f"labels (or set model.task_specs.<task>.label), or give the data one label per task (data.tasks=[...] for "
            f"data=synthetic and data=synthetic_sequences, data.labels={{task: column}} for Parquet/CSV)"
        )
    _check_label_kinds(features, names, classes, columns)
    return tuple(_bind(n, cls, c, w, specs.get(n), names, columns, labels)
                 for n, cls, c, w in zip(names, classes, columns, _per_task(names, specs, "weight", weights), strict=True))


def _check_label_kinds(features: FeatureSpec, names: list[str], classes: list[type[Task]], columns: list[str]) -> None:
    """Each task's label read as the kind its loss trains on: the data checks a label's values by its own kind
    (``data.label_kinds``), the model trains it by the task's, and where they differ the data lets through values the
    loss cannot take (BCE on a ``regression`` label's 12.5, which trains on it and then fails inside the eval's log loss)
    or refuses good ones under a message about the wrong kind. Data that declares no kinds (one label) is not checked.

    Raises:
        ConfigError: naming the task, its kind, the label's kind in the data and both settings.
    """
    if not features.label_kinds:
        return
    kinds = dict(zip(features.label_names, features.label_kinds, strict=True))
    for name, cls, column in zip(names, classes, columns, strict=True):
        read = kinds[column]
        if read == cls.label_kind:
            continue
        task = (f"'+model.task_specs.{name}={{kind: multiclass, num_classes: <C>}}'" if read == "multiclass"
                else f"'+model.task_specs.{name}.kind={read}'" + (" (or huber)" if read == "regression" else ""))
        raise ConfigError(
            f"task {name!r} is {cls.kind} (model.task_kinds / model.task_specs.{name}.kind) and trains on a {cls.label_kind} "
            f"label, but the data reads its label {column!r} as {read} (data.label_kinds; unset: binary): the data checks each "
            f"label's values by data.label_kinds, the model trains it by the task's kind, and the two must agree. Fix: "
            f"data.label_kinds.{column}={cls.label_kind}, or {task}")


def _bind(name: str, cls: type[Task], column: str, weight: float, spec: TaskSpec | None, names: list[str], columns: list[str],
          labels: Sequence[str]) -> Task:
    """Task ``name`` of kind ``cls`` on label ``column``, with its spec's metrics, sample-weight column and mask."""
    extra: dict[str, Any] = {}
    if spec is not None:
        if spec.sample_weight is not None:
            require(spec.sample_weight in labels, f"model.task_specs.{name}.sample_weight={spec.sample_weight!r} is not a column of "
                    f"the data; its label columns: {list(labels)}. Fix: name one of them, or add it to data.labels")
            extra["weight_column"] = list(labels).index(spec.sample_weight)
        if spec.only_where_positive is not None:
            extra["mask_column"] = list(labels).index(columns[names.index(spec.only_where_positive)])
        if spec.eval_metrics is not None:
            extra["eval_metrics"] = tuple(spec.eval_metrics)
        if spec.train_metrics is not None:
            extra["train_metrics"] = tuple(spec.train_metrics)
        if cls is HuberTask:
            extra["delta"] = spec.huber_delta
        if cls is MulticlassTask:
            extra["num_classes"] = spec.num_classes
    return cls(name, column=list(labels).index(column), weight=float(weight), label=column, **extra)
