"""The config keys that name an eval metric (``train.objective``, ``checkpoint.best_metric``, early stopping's
``metric``, ``metrics.selection``) or a feature (``metrics.grouping_key``), checked against what the run logs, and the
direction each watched metric is better in.

:func:`recsys_runner.config.validate` settles each watched metric's direction (:func:`metric_mode`) with the rest of the
config; :func:`check_eval_keys` needs the model's tasks and the data's features, so the builders call it as soon as those
exist, before any MLflow run starts. Each mistake is one :class:`~recsys_runner.errors.ConfigError` naming the key and
the closest valid value.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from recsys_runner.errors import ConfigError, require
from recsys_runner.metrics.registry import (
    AT_K_NAME,
    DEFAULT_OBJECTIVE,
    METRICS,
    SELECTION_KEY,
    higher_is_better,
    metric_name,
    torcheasyrec_key,
)
from recsys_runner.metrics.tasks import check_task_metrics, eval_metric_keys
from recsys_runner.tasks import Task

if TYPE_CHECKING:
    from recsys_runner.config import RunConfig


def metric_mode(key: str, mode: str | None, where: str) -> str | None:
    """``max`` or ``min`` for the watched metric ``key``: its own direction (the metric class's ``higher_is_better``)
    unless ``mode`` is set for a metric that has none. ``None`` for a name no metric has, which
    :func:`check_eval_keys` reports with the valid keys once the model's tasks are known.

    Raises:
        ConfigError: ``mode`` contradicts the metric's direction, or the metric has none and ``mode`` is unset.
    """
    if metric_name(key) not in METRICS and not AT_K_NAME.fullmatch(metric_name(key)):
        return mode
    try:
        own = "max" if higher_is_better(key) else "min"
    except ConfigError:  # best at a target value (calibration): the user says which way
        require(mode is not None, f"{where} must be max or min for {key}, which has no better direction of its own")
        return mode
    require(mode in (None, own), f"{where}={mode} contradicts {key}, for which {'higher' if own == 'max' else 'lower'} is "
                                 f"better. Fix: drop {where} (the metric's own direction is used)")
    return own


def check_eval_keys(run: RunConfig, tasks: tuple[Task, ...], sparse_names: list[str], model: str = "the model") -> None:
    """Check every key that names an eval metric or a feature against what this run will produce.

    Called by :func:`recsys_runner.build.build` as soon as the model's tasks and the data's features
    exist, before any MLflow run starts, so a typo fails the job up front rather than after
    training (when a sweep would lose the trial). The eval keys are :func:`eval_metric_keys`, the
    ones the runner's evaluation logs. ``train.early_stopping.metric`` is checked when early stopping is on
    (``patience`` set) and, with it off, when the metric was set to anything but its default
    (:data:`~recsys_runner.metrics.registry.DEFAULT_OBJECTIVE`): a name no metric of this run has is a mistake either
    way (most often a typo made while also forgetting ``patience``), while the untouched default is not checked, so
    a model that logs no ``eval/auc`` (a regression task) needs no setting to turn it off. Each task's eval metrics must apply to what it produces
    (:func:`~recsys_runner.metrics.tasks.check_task_metrics`; ``model`` names the model in that message).

    Raises:
        ConfigError: naming the key, the valid values and the closest one.
    """
    data = run.served_data
    check_task_metrics(run.metrics, tasks, model, eval_rows=data.batch_size if data.batch_tokens is None else None)
    keys = eval_metric_keys(run.metrics, tasks)
    require(bool(keys), "no eval metric is configured, so the job has no result (train.objective). Fix: list at least one "
            "in metrics.eval (or in the model's own eval_metrics where it has them), e.g. metrics.eval=[auc]")
    stopping = run.train.early_stopping
    watched = stopping.patience is not None or stopping.metric != DEFAULT_OBJECTIVE
    named = {"train.objective": run.train.objective, "checkpoint.best_metric": run.checkpoint.best_metric,
             "train.early_stopping.metric": stopping.metric if watched else None}
    off = "; early stopping is off until train.early_stopping.patience is set, or drop the setting" if stopping.patience is None else ""
    for name, value in named.items():
        _require_torcheasyrec_metric(name, value, keys)
        _require_one_of(name, value, keys, "an eval metric this run logs", also=off if name == "train.early_stopping.metric" else "")
    logged = [k for k in keys if k != SELECTION_KEY]
    for key in run.metrics.selection:
        if key not in logged:
            closest = difflib.get_close_matches(key, logged, n=1, cutoff=0.0)
            raise ConfigError(f"metrics.selection names {key!r}, which this run does not log (its tasks: "
                              f"{[t.name for t in tasks]}); valid: {', '.join(logged)}. Fix: use {closest[0] if closest else 'one of them'}")
    _require_one_of("metrics.grouping_key", run.metrics.grouping_key, sparse_names, "a sparse feature of the data")


def _require_torcheasyrec_metric(name: str, value: str | None, keys: list[str]) -> None:
    """:class:`ConfigError` for a key naming its metric as TorchEasyRec does (``checkpoint.best_metric=eval/grouped_auc``),
    whose closest spelling among the keys logged is another metric (``eval/auc``): ours, and how to log it if it is not."""
    ours = torcheasyrec_key(value) if value is not None and value not in keys else None
    if ours is None:
        return
    if ours in keys:
        raise ConfigError(f"{name}={value!r} names the metric as TorchEasyRec does; here it is {ours}. Fix: {name}={ours}")
    raise ConfigError(f"{name}={value!r} names the metric as TorchEasyRec does; here it is {ours}, which this run does not "
                      f"log (it logs {', '.join(keys)}). Fix: add {ours.rpartition('/')[2]} to metrics.eval and set {name}={ours}")


def _require_one_of(name: str, value: str | None, valid: list[str], what: str, also: str = "") -> None:
    """:class:`ConfigError` unless ``value`` is ``None`` or in ``valid``, suggesting the closest valid value (``also``
    ends the fix)."""
    if value is None or value in valid:
        return
    closest = difflib.get_close_matches(value, valid, n=1, cutoff=0.0)
    if not closest:
        raise ConfigError(f"{name}={value!r} is not {what}, and there is none. Fix: {name}=null{also}")
    raise ConfigError(f"{name}={value!r} is not {what} (closest: {closest[0]}); valid: {', '.join(valid)}. "
                      f"Fix: {name}={closest[0]}{also}")
