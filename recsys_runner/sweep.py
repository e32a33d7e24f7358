"""A multirun's objective: the eval key its jobs report (each returns it to the sweeper) and its parent ranks them by.

With ``train.objective`` set that is the key. Unset, each job takes its default objective
(:func:`~recsys_runner.metrics.registry.default_objective` of the eval keys its model logs): ``eval/auc`` for a CTR
model, but ``eval/<task>/mse`` for a regression task and ``eval/hr_at_10`` or ``eval/inbatch_recall_at_1`` for a
next-item or two-tower model. The sweep's parent (:class:`SweepCallback`, ``hydra.callbacks.mlflow_sweep``) resolves
that same default before any job runs: it composes the first job's config (each swept config group at its first
option), builds its data module and model on ``meta`` (:func:`~recsys_runner.build.planned_eval_keys`) and takes their
default objective, so that Optuna's direction is checked against the metric the jobs return and the best trial is
looked up under the key they log. A sweep whose jobs log different default objectives (one that sweeps ``model``
across kinds) names its ``train.objective``.
"""

from __future__ import annotations

from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict

from recsys_runner.build import planned_eval_keys
from recsys_runner.config import validate
from recsys_runner.metrics.registry import default_objective
from recsys_runner.tracking.sweep import MlflowSweepCallback

_LISTED = (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP, ValueType.RANGE_SWEEP)
"""Sweeps whose values can be listed (``a,b``, ``choice(a,b)``, ``range(1,4)``)."""


def sweep_objective(config: DictConfig) -> str:
    """The eval key the jobs of the multirun ``config`` (the sweep's composed config) report: ``train.objective``, else
    the default objective of its first job's model (module docstring).

    Raises:
        ConfigError: the first job's config is invalid (every job's would be), or its model logs no eval metric with a
            direction.
    """
    given = OmegaConf.select(config, "train.objective")
    if given:
        return str(given)
    return default_objective(planned_eval_keys(validate(first_job_config(config))))


def first_job_config(config: DictConfig) -> DictConfig:
    """The config of the multirun's first job, as its sweeper composes it (:func:`first_job_overrides`), without the
    ``hydra`` node (as a job gets it)."""
    job = GlobalHydra.instance().config_loader().load_sweep_config(config, first_job_overrides(config))
    with open_dict(job):
        del job["hydra"]
    return job


def first_job_overrides(config: DictConfig) -> list[str]:
    """The overrides that decide the first job's eval keys: the sweeper's ``hydra.sweeper.params`` and the command
    line's (``hydra.overrides.task``; a later one of a key winning, as in the sweepers), a listed sweep of a config group
    (``model=deepfm,dssm``, ``choice(...)``) at its first value. Any other sweep (``optim.lr=0.01,0.1``, Optuna's
    ``interval``) keeps the config's own value: a hyperparameter changes no metric's name, and a job whose value is
    refused (``optim.lr=-1``) fails alone, as a sweep's jobs do, rather than the sweep."""
    params = OmegaConf.select(config, "hydra.sweeper.params")
    given = [str(k) + f"={v}" for k, v in params.items() if v is not None] if isinstance(params, DictConfig) else []
    given += [str(o) for o in OmegaConf.select(config, "hydra.overrides.task") or []]
    groups = {str(g) for g in OmegaConf.select(config, "hydra.runtime.choices") or {}}
    chosen: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(given):
        key = override.get_key_element()
        if not override.is_sweep_override():
            chosen[key] = str(override.input_line)
        elif override.key_or_group in groups and override.value_type in _LISTED:
            try:
                chosen[key] = f"{key}={next(iter(override.sweep_string_iterator()))}"
            except (HydraException, StopIteration):
                chosen.pop(key, None)
        else:
            chosen.pop(key, None)
    return list(chosen.values())


class SweepCallback(MlflowSweepCallback):
    """:class:`~recsys_runner.tracking.sweep.MlflowSweepCallback` with the objective its jobs will report
    (:func:`sweep_objective`): what ``hydra.callbacks.mlflow_sweep`` instantiates."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(objective_of=sweep_objective, **kwargs)
