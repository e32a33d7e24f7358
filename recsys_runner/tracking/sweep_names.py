"""What a sweep tries, and how its runs say so: the swept keys and their ranges, the parent's name, each job's run name,
``swept.<key>`` params and job-number tag.

The parent (:mod:`recsys_runner.tracking.sweep`) is named by what it tries (``sweep optim.lr=0.01,0.05,0.1``) and logs a
param ``sweep.range.<key>`` per swept key; the swept keys reach every job in :data:`SWEPT_KEYS_ENV`, and a job names its
run by the values it tried (``lr=0.05``) and logs them as params ``swept.<key>``, the same keys in every child: what the
UI's parallel-coordinates and contour charts plot.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from recsys_runner.tracking.tracker import PARENT_RUN_ENV

SWEPT_KEYS_ENV = "RECSYS_RUNNER_SWEPT_KEYS"
"""The swept keys, comma-separated (``optim.lr,model``), exported to every job of a sweep with the parent's id."""
SWEPT_KEYS_TAG = "sweep.params"
"""The parent's tag listing the swept keys, comma-separated, in the order the sweep gave them."""
RANGE_PARAM, SWEPT_PARAM = "sweep.range.", "swept."
"""Param prefixes: the parent's range of each swept key, a child's value of it."""
JOB_NUM_TAG = "sweep.job_num"
"""On a sweep job's run: the job's number in the sweep (``hydra.job.num``), by which the side that sees the job die finds
the run it left RUNNING (:func:`recsys_runner.tracking.sweep_jobs.end_left_runs`)."""
_MAX_NAME_CHARS = 80


def swept_ranges(config: DictConfig) -> dict[str, str]:
    """The keys a multirun sweeps → their values or range as given (``{"optim.lr": "0.01,0.05,0.1"}``).

    Both places a sweep is declared: the sweeper's ``hydra.sweeper.params`` (what ``sweeps/*.yaml`` set, for the
    basic and the Optuna sweeper alike), then the command line's overrides (``hydra.overrides.task``), a later one
    winning as in the sweepers. Only sweep overrides count (``a,b``, ``choice``, ``range``, ``interval``, ``glob``):
    a plain ``key=value`` there is the same in every job.
    """
    ranges = dict[str, str]()
    for text, override in sweep_overrides(config):
        ranges.pop(override.key_or_group, None)  # re-inserted last: a command-line sweep follows the file's
        ranges[override.key_or_group] = text.partition("=")[2]
    return ranges


def sweep_overrides(config: DictConfig) -> list[tuple[str, Any]]:
    """A multirun's sweep overrides, each as given (``optim.lr=0.01,0.05``) and as Hydra parsed it (its ``Override``):
    the sweeper's ``hydra.sweeper.params``, then the command line's ``hydra.overrides.task`` (see :func:`swept_ranges`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    params = OmegaConf.select(config, "hydra.sweeper.params")
    given = [str(k) + f"={v}" for k, v in params.items() if v is not None] if isinstance(params, DictConfig) else []
    given += [str(o) for o in OmegaConf.select(config, "hydra.overrides.task") or []]
    parser, swept = OverridesParser.create(), []
    for text in given:
        try:
            override = parser.parse_override(text)
        except HydraException:  # the sweeper has parsed them already; one we cannot read is no sweep we can name
            continue
        if override.is_sweep_override():
            swept.append((text, override))
    return swept


def sweep_name(ranges: Mapping[str, str]) -> str | None:
    """The parent run's name: what it tries, ``sweep optim.lr=0.01,0.05,0.1 model=deepfm,dlrm`` (each range compact,
    ``interval(0.005,0.5)`` without its tags, the whole clipped to 80 characters); ``None`` when nothing is swept."""
    if not ranges:
        return None
    return clip("sweep " + " ".join(f"{key}={clip(_compact(value), 40)}" for key, value in ranges.items()), _MAX_NAME_CHARS)


def job_swept_values(overrides: Sequence[str]) -> dict[str, str]:
    """In a sweep's job: the value it tries of each swept key (:data:`SWEPT_KEYS_ENV`), read from the job's overrides
    (``hydra.overrides.task``: ``optim.lr=0.05``); ``{}`` outside a sweep."""
    keys = [k for k in os.environ.get(SWEPT_KEYS_ENV, "").split(",") if k]
    if not keys or not os.environ.get(PARENT_RUN_ENV):
        return {}
    values = dict(override_values(overrides))
    return {key: values[key] for key in keys if key in values}


def child_name(values: Mapping[str, str]) -> str | None:
    """A sweep job's run name: the values it tried, ``lr=0.05 model=dlrm`` (each key's last component, more of it
    where two would read the same: ``sparse.lr=… dense.lr=…``; long numbers to 4 significant digits); ``None``
    outside a sweep."""
    if not values:
        return None
    return clip(" ".join(f"{_label(key, values)}={_short_value(value)}" for key, value in values.items()), _MAX_NAME_CHARS)


def _label(key: str, keys: Iterable[str]) -> str:
    """The shortest tail of ``key``'s dotted parts that no other key ends with the same way (the full key at most)."""
    parts, others = key.split("."), [k.split(".") for k in keys if k != key]
    for n in range(1, len(parts) + 1):
        if all(other[-n:] != parts[-n:] for other in others):
            return ".".join(parts[-n:])
    return key


def child_params(values: Mapping[str, str]) -> dict[str, str]:
    """A sweep job's params ``swept.<key>``: the same keys in every child, so the UI's parallel-coordinates and
    contour charts can plot them (the flattened config spells a choice like ``model`` as ``model._target_``)."""
    return {f"{SWEPT_PARAM}{key}": value for key, value in values.items()}


def child_tags(job_num: int | None) -> dict[str, str]:
    """A sweep job's run tags: its number in the sweep (:data:`JOB_NUM_TAG`); ``{}`` outside a multirun."""
    return {JOB_NUM_TAG: str(job_num)} if job_num is not None else {}


def log_ranges(client: Any, run_id: str, ranges: Mapping[str, str]) -> None:
    from mlflow.entities import Param

    if ranges:  # 6000 characters: MLflow's limit for a param's value
        client.log_batch(run_id, params=[Param(f"{RANGE_PARAM}{k}", v[:6000]) for k, v in ranges.items()])


def override_values(overrides: Sequence[str]) -> list[tuple[str, str]]:
    """``["+x.y=2", "model@m=dlrm", "tracking.uri=sqlite\\:///a.db"]`` → ``[("x.y", "2"), ("model", "dlrm"),
    ("tracking.uri", "sqlite:///a.db")]``: one job's overrides as Hydra wrote them, spaces inside values kept."""
    pairs = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep:
            pairs.append((key.lstrip("+~").split("@")[0], unescape(value)))
    return pairs


def _compact(value: str) -> str:
    """A sweep's values for a name: ``0.01,0.05``, ``deepfm,dlrm`` for ``choice(deepfm, dlrm)``, ``interval(0.005,0.5)``
    for ``tag(log, interval(0.005, 0.5))``; other sweeps as given, without spaces."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep

    sweep = OverridesParser.create().parse_override(f"k={value}").value()
    if isinstance(sweep, ChoiceSweep):
        return ",".join(str(v) for v in sweep.list)
    if isinstance(sweep, IntervalSweep):
        return f"interval({sweep.start},{sweep.end})"
    return value.replace(" ", "")


def _short_value(value: str) -> str:
    """``0.05`` as given; ``0.0334721651`` (an Optuna trial's) as ``0.03347``; a long text clipped."""
    try:
        number = float(value)
    except ValueError:
        return clip(value, 24)
    return value if len(value) <= 8 else f"{number:.4g}"


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def unescape(override: str) -> str:
    return override.replace("\\", "")
