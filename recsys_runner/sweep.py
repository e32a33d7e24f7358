"""A multirun's objective: the eval key its jobs report (each returns it to the sweeper) and its parent ranks them by;
and the keys its jobs set, checked before any job runs.

With ``train.objective`` set that is the key. Unset, each job takes its default objective
(:func:`~recsys_runner.metrics.registry.default_objective` of the eval keys its model logs): ``eval/auc`` for a CTR
model, but ``eval/<task>/mse`` for a regression task and ``eval/hr_at_10`` or ``eval/inbatch_recall_at_1`` for a
next-item or two-tower model. The sweep's parent (:class:`SweepCallback`, ``hydra.callbacks.mlflow_sweep``) resolves
that same default before any job runs: it composes each job's config as far as its eval keys go (every combination of
the swept config groups' options, :func:`job_configs`), builds its data module and model on ``meta``
(:func:`~recsys_runner.build.planned_eval_keys`) and takes their default objective, so that Optuna's direction is
checked against the metric the jobs return and the best trial is looked up under the key they log. A sweep whose jobs
would log different default objectives (one that sweeps ``model`` across kinds) is refused until it names its
``train.objective``.

The same configs let :class:`SweptKeysCheck` refuse a key under a swept group that some option lacks
(``-m model=deepfm,dlrm model.dropoutt=0.1,0.2``) before the parent run exists.
"""

from __future__ import annotations

import itertools
from collections.abc import Set as AbstractSet
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from recsys_runner.build import planned_eval_keys
from recsys_runner.config import RunConfig, validate
from recsys_runner.config_keys import check_override_key, check_swept_keys, is_key_override
from recsys_runner.errors import ConfigError, reported
from recsys_runner.metrics.registry import default_objective
from recsys_runner.tracking.sweep import MlflowSweepCallback

_LISTED = (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP, ValueType.RANGE_SWEEP)
"""Sweeps whose values can be listed (``a,b``, ``choice(a,b)``, ``range(1,4)``)."""


def sweep_objective(config: DictConfig) -> str:
    """The eval key the jobs of the multirun ``config`` (the sweep's composed config) report: ``train.objective``, else
    the default objective its jobs' models share (module docstring).

    Raises:
        ConfigError: a job's config is invalid, or its model logs no eval metric with a direction, or the jobs' default
            objectives differ (the fix names each and asks for ``train.objective``).
    """
    given = OmegaConf.select(config, "train.objective")
    if given:
        return str(given)
    keys = {label: planned_eval_keys(_validated(job, label)) for label, job in job_configs(config)}
    objectives = {label: default_objective(logged) for label, logged in keys.items()}
    if len(set(objectives.values())) == 1:
        return next(iter(objectives.values()))
    shared = [k for k in next(iter(keys.values())) if all(k in logged for logged in keys.values())]
    fix = (f"set train.objective to a key every job logs ({', '.join(shared)}), e.g. train.objective={shared[0]}" if shared
           else "set train.objective to a key every job logs; these log none in common, so sweep each kind of model on its own")
    raise ConfigError("the sweep's jobs would report different objectives (train.objective is unset, so each takes its "
                      f"model's default: {'; '.join(f'{label} -> {o}' for label, o in objectives.items())}), and its parent "
                      f"ranks them by one. Fix: {fix}")


def _validated(job: DictConfig, label: str) -> RunConfig:
    """``validate(job)``; its :class:`ConfigError` names the jobs it is about (``label``) when the sweep has several."""
    try:
        return validate(job)
    except ConfigError as e:
        if not label:
            raise
        raise ConfigError(f"{e} (the sweep's jobs with {label})") from e


class SweptKeysCheck(Callback):
    """``hydra.callbacks.swept_keys`` (``conf/config.yaml``, before ``mlflow_sweep``): when a multirun starts,
    :func:`~recsys_runner.config_keys.check_swept_keys` and :func:`check_group_option_keys`, their one line and exit 2 (as
    every command's config error) before the parent run exists."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        with reported():
            check_swept_keys(config)
            check_group_option_keys(config)


def check_group_option_keys(config: DictConfig) -> None:
    """Refuse a key set under a swept config group (``model.dropoutt=0.1,0.2`` or ``model.dropout=0.1`` beside
    ``model=deepfm,dlrm``) that an option of the group does not have, with the one line of every key typo, before the
    sweep's parent run exists: otherwise Hydra reports it when it composes that option's first job, and the sweep ends
    an empty ``FAILED`` parent (or the jobs with that option fail). Each combination of the listed options is composed
    without those keys (:func:`job_configs`) and each key looked up in it.

    Raises:
        ConfigError: naming the key, the option that lacks it, the closest key and its section's keys.
    """
    groups = {str(g) for g in OmegaConf.select(config, "hydra.runtime.choices") or {}}
    swept = set(_listed_groups(config, groups))
    parsed = [(text, OverridesParser.create().parse_override(text)) for text in _given_overrides(config)]
    under = [(text, o) for text, o in parsed
             if is_key_override(o, groups) and any(o.key_or_group.startswith(f"{g}.") for g in swept)]
    if not under:
        return
    skipped = {o.get_key_element() for _, o in under}
    for label, job in job_configs(config, skip=skipped):
        for text, override in under:
            check_override_key(job, override, f"in {text}, for the sweep's jobs with {label}")


def job_configs(config: DictConfig, skip: AbstractSet[str] = frozenset()) -> list[tuple[str, DictConfig]]:
    """The config of each distinct kind of job of the multirun ``config``, as its sweeper composes it
    (:func:`job_overrides`, less the overrides of the keys in ``skip``), without the ``hydra`` node (as a job gets it);
    each with its label (``model=dlrm optim=adam``: the swept groups' options; ``""`` when no group is swept)."""
    loader = GlobalHydra.instance().config_loader()
    out = []
    for label, overrides in job_overrides(config):
        kept = [o for o in overrides if o.split("=", 1)[0] not in skip]
        job = loader.load_sweep_config(config, kept)
        with open_dict(job):
            del job["hydra"]
        out.append((label, job))
    return out


def first_job_overrides(config: DictConfig) -> list[str]:
    """The overrides of the multirun's first job as far as its eval keys go: :func:`job_overrides`' first."""
    return job_overrides(config)[0][1]


def job_overrides(config: DictConfig) -> list[tuple[str, list[str]]]:
    """The overrides that decide the jobs' eval keys and config keys, one list per combination of the swept groups'
    options (in the sweepers' order, the first job's first), each with its label (``model=dssm optim=adam``): the
    sweeper's ``hydra.sweeper.params`` and the command line's (``hydra.overrides.task``; a later one of a key winning,
    as in the sweepers), a listed sweep of a config group (``model=deepfm,dssm``, ``choice(...)``) at each of its values.
    Any other sweep (``optim.lr=0.01,0.1``, Optuna's ``interval``) keeps the config's own value: a hyperparameter
    changes no metric's name, and a job whose value is refused (``optim.lr=-1``) fails alone, as a sweep's jobs do,
    rather than the sweep."""
    groups = {str(g) for g in OmegaConf.select(config, "hydra.runtime.choices") or {}}
    chosen: dict[str, str | list[str]] = {}
    for override in OverridesParser.create().parse_overrides(_given_overrides(config)):
        key = override.get_key_element()
        if not override.is_sweep_override():
            chosen[key] = str(override.input_line)
        elif values := _listed_options(override, groups):
            chosen[key] = [f"{key}={value}" for value in values]
        else:
            chosen.pop(key, None)
    swept = [options for options in chosen.values() if isinstance(options, list)]
    jobs = []
    for combination in itertools.product(*swept):
        picked = iter(combination)
        jobs.append((" ".join(combination), [v if isinstance(v, str) else next(picked) for v in chosen.values()]))
    return jobs


def _listed_groups(config: DictConfig, groups: set[str]) -> list[str]:
    """The config groups among ``groups`` that the multirun sweeps over listed options (:func:`_listed_options`)."""
    parsed = OverridesParser.create().parse_overrides(_given_overrides(config))
    return [o.key_or_group for o in parsed if o.is_sweep_override() and _listed_options(o, groups)]


def _listed_options(override: Any, groups: set[str]) -> list[str]:
    """The options a sweep ``override`` of one of the config ``groups`` lists (``model=deepfm,dssm``); ``[]`` for a
    sweep of a key, or one whose values cannot be listed."""
    if override.key_or_group not in groups or override.value_type not in _LISTED:
        return []
    try:
        return [str(v) for v in override.sweep_string_iterator()]
    except HydraException:
        return []


def _given_overrides(config: DictConfig) -> list[str]:
    """The multirun's overrides as given: the sweeper's ``hydra.sweeper.params`` (``key=value`` each), then the command
    line's ``hydra.overrides.task``."""
    params = OmegaConf.select(config, "hydra.sweeper.params")
    given = [str(k) + f"={v}" for k, v in params.items() if v is not None] if isinstance(params, DictConfig) else []
    return given + [str(o) for o in OmegaConf.select(config, "hydra.overrides.task") or []]


class SweepCallback(MlflowSweepCallback):
    """:class:`~recsys_runner.tracking.sweep.MlflowSweepCallback` with the objective its jobs will report
    (:func:`sweep_objective`): what ``hydra.callbacks.mlflow_sweep`` instantiates."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(objective_of=sweep_objective, **kwargs)
