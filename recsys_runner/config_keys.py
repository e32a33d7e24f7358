"""Unknown keys: a config key, an added key or a swept key that the schema does not define, named with the closest
valid one before anything runs.

Hydra's ``+key=value`` adds a key even to a structured config and ``OmegaConf.to_object`` would drop it silently, and
a multirun reports a swept typo only when it composes its first job; these checks make each one line of
:class:`~recsys_runner.errors.ConfigError` naming the fix. :func:`recsys_runner.config.validate` runs
:func:`check_known_keys` on every config it types; the commands and the sweep callbacks call the others.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from recsys_runner.errors import ConfigError
from recsys_runner.tracking.sweep_names import sweep_overrides


@dataclasses.dataclass(frozen=True)
class Renamed:
    """Where a TorchEasyRec ``TrainConfig`` field (or optimizer/scheduler field) lives here (docs/training.md's table)."""

    ours: str
    """Our key: a name in the same section (``decay_rate`` for ``scheduler.decay_factor``) or, with a dot, the whole key
    (``checkpoint.every_steps`` for ``train.save_checkpoints_steps``); the rest of a longer key follows it."""
    note: str = ""
    """How the value differs, said after the name (``min_factor`` is a fraction of the base lr, not an lr)."""
    fix: str | None = None
    """The fix when it is not ``<ours>=<value>``, with ``{value}`` the value given (``precision={value}``)."""
    top: bool = False
    """``ours`` is a top-level name (a config group: ``precision``), not one in the section the key was given in."""


TORCHEASYREC_KEYS: dict[str, Renamed] = {
    "learning_rate": Renamed("lr"),
    "decay_size": Renamed("decay_steps"),
    "decay_factor": Renamed("decay_rate"),
    "min_learning_rate": Renamed("min_factor", ", a fraction of the base lr (optim.lr): min_learning_rate / lr",
                                 fix="scheduler.min_factor=<min_learning_rate / optim.lr>"),
    "warmup_learning_rate": Renamed("warmup_start", ", a fraction of the base lr (optim.lr): warmup_learning_rate / lr",
                                    fix="scheduler.warmup_start=<warmup_learning_rate / optim.lr>"),
    "warmup_size": Renamed("warmup_steps"),
    "T_0": Renamed("cycle_steps"),
    "T_mult": Renamed("cycle_mult"),
    "schedule_sizes": Renamed("boundaries", ", counted from the end of the warmup"),
    "learning_rates": Renamed("rates", ", multipliers of the base lr (optim.lr), one more than scheduler.boundaries "
                              "(the rate before the first boundary first)",
                              fix="scheduler.rates=[1,<each of learning_rates / optim.lr>]"),
    "gradient_accumulation_steps": Renamed("train.grad_accum_steps", ", counted in optimizer steps as every step count here "
                                           "(docs/training.md)"),
    "log_step_count_steps": Renamed("train.log_every_steps"),
    "save_checkpoints_steps": Renamed("checkpoint.every_steps"),
    "save_checkpoints_epochs": Renamed("checkpoint.every_epochs"),
    "fine_tune_checkpoint": Renamed("checkpoint.init_from"),
    "model_dir": Renamed("checkpoint.dir", " (the rest of a run, logs and config, goes to hydra.run.dir)"),
    "continue_train": Renamed("checkpoint.resume", ", on by default (auto: from the newest checkpoint in checkpoint.dir)",
                              fix="checkpoint.resume=auto checkpoint.dir=<the run's checkpoints>"),
    "train_input_path": Renamed("data.path", ", a key of the file data options (data=parquet, csv, criteo)"),
    "eval_input_path": Renamed("data.eval_path", ", a key of the file data options (data=parquet, csv, criteo)"),
    "fine_tune_ckpt_param_map": Renamed("checkpoint.name_map", ", a map of ours: theirs name parts, not a file",
                                        fix="+checkpoint.name_map.<our name part>=<theirs>"),
    "ignore_restore_optimizer": Renamed("checkpoint.load_optimizer", ", the opposite", fix="checkpoint.load_optimizer=false"),
    "mixed_precision": Renamed("precision", ", a config group", fix="precision={value_lower}", top=True),
    "grad_scaler": Renamed("precision.grad_scaler"),
    "cudnn_allow_tf32": Renamed("precision.allow_tf32_cudnn"),
    "cuda_matmul_allow_tf32": Renamed("precision.allow_tf32_matmul"),
    "is_profiling": Renamed("train.profile.enabled"),
    "use_tensorboard": Renamed("tracking.tensorboard"),
    "sparse_optimizer": Renamed("optim/sparse", ", a config group", fix="optim/sparse=<sgd|adagrad|rowwise_adagrad|…>"),
    "dense_optimizer": Renamed("optim/dense", ", a config group", fix="optim/dense=<sgd|adagrad|adam|adamw>"),
    "global_embedding_constraints": Renamed("distributed.sharding_types", " and distributed.compute_kernels",
                                            fix="distributed.sharding_types=[table_wise,row_wise] (docs/launch.md)"),
}
"""TorchEasyRec's names for settings this config names otherwise, by the last part of a key given (``decay_factor`` in
``scheduler.decay_factor``): a migrating user types them, and the closest spelling among our keys is often another
setting (``decay_factor`` → ``min_factor``)."""


def torcheasyrec_fix(parts: list[str], i: int, siblings: list[str], value: str, owners: Callable[[str], list[str]] | None = None) -> str | None:
    """The message for the key ``parts`` given ``value``, whose part ``i`` is not among ``siblings`` (the keys beside it),
    when that part is a TorchEasyRec name (:data:`TORCHEASYREC_KEYS`) whose key here exists: that name, ours and the fix
    (the rest of the key after it); ``None`` otherwise. ``owners(name)``: the options of the group ``parts[0]`` that have
    key ``name`` (``scheduler.decay_factor`` before ``scheduler=exponential_decay`` is chosen: that option's
    ``decay_rate``)."""
    entry = TORCHEASYREC_KEYS.get(parts[i])
    if entry is None:
        return None
    relative = not entry.top and "." not in entry.ours and "/" not in entry.ours
    choose = owners(entry.ours) if relative and i == 1 and entry.ours not in siblings and owners is not None else []
    if relative and entry.ours not in siblings and not choose:
        return None
    head = [*parts[:i], entry.ours] if relative else entry.ours.split(".")
    ours = ".".join([*head, *parts[i + 1:]])
    fix = entry.fix.format(value=value, value_lower=value.lower()) if entry.fix else f"{ours}={value}"
    where = f" (a key of {parts[0]}={', '.join(choose)})" if choose else ""
    fix = f"{parts[0]}={choose[0]} {fix}" if choose else fix
    return f"{parts[i]} is TorchEasyRec's name; here it is {ours}{where}{entry.note}. Fix: {fix}"


def check_known_keys(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for a key the schema does not define, e.g. ``+train.num_step=5``.

    Hydra's ``+key=value`` adds a key even to a structured config, and ``OmegaConf.to_object``
    would then drop it silently, so a typo would train with the default instead. The rule follows
    the dataclass field types, as OmegaConf records them on each node: a node typed by a dataclass
    holds only that dataclass's fields; a node typed as a mapping (a ``dict[str, X]`` field such as
    ``checkpoint.name_map``, ``distributed.tables`` or ``optim.parts``, or a mapping given to an
    ``Any`` field such as ``data.labels``) is free-form, and each of its values is checked by its own
    type in turn (``distributed.tables.<name>`` is a ``TableShardingConfig``, a scheduler chosen with
    ``+scheduler@optim.parts.<name>.scheduler=…`` is that scheduler's dataclass). ``hydra.*`` is
    Hydra's own and not checked here.
    """
    keys = list(_schema_keys(cfg, ""))
    unknown = [(key, siblings) for key, siblings in keys if siblings is not None]
    if not unknown:
        return
    key, siblings = unknown[0]
    others = f" Also unknown: {', '.join(k for k, _ in unknown[1:])}." if len(unknown) > 1 else ""
    raise unknown_key(key, siblings, [k for k, s in keys if s is None], given_as=(
        "a leading + adds keys only to free-form maps such as checkpoint.name_map", others),
        value=str(OmegaConf.select(cfg, key, default="<value>", throw_on_missing=False)))


def unknown_key(key: str, siblings: list[str], known: list[str], given_as: tuple[str, str], value: str = "<value>") -> ConfigError:
    """The :class:`ConfigError` for ``key``, which the config does not have: ours for a TorchEasyRec name
    (:func:`torcheasyrec_fix`, ``value`` the value given), else the closest of its ``siblings`` (the keys of its section),
    else a ``known`` key with a similar last part (the right name in the wrong section), and the section's keys.
    ``given_as``: what to say about how it was given, inside the fix and after the message."""
    parent, _, name = key.rpartition(".")
    if (migrated := torcheasyrec_fix(key.split("."), key.count("."), siblings, value)) is not None:
        return ConfigError(f"unknown key {key}: {migrated} (python -m recsys_runner --help lists every key).{given_as[1]}")
    close = difflib.get_close_matches(name, siblings, n=1)
    suggestion: str | None
    if close:
        suggestion = f"{parent}.{close[0]}" if parent else close[0]
    else:  # perhaps the right name in the wrong section: a known key with a similar last part
        similar = [k for k in known if difflib.get_close_matches(name, [k.rpartition(".")[2]], n=1)]
        suggestion = max(similar, key=lambda k: difflib.SequenceMatcher(None, key, k).ratio()) if similar else None
    hint = f" (did you mean {suggestion}?)" if suggestion else ""
    fix = f"set {suggestion} instead" if suggestion else "remove it"
    valid = ", ".join(s for s in siblings if not s.startswith("_"))
    where = f"the keys of {parent} are" if parent else "the top-level keys are"
    note, after = given_as
    return ConfigError(f"unknown key {key}{hint}. Fix: {fix} ({note}); {where} {valid} "
                       f"(python -m recsys_runner --help lists every key).{after}")


def check_swept_keys(config: DictConfig) -> None:
    """Refuse a multirun that sweeps a key its config does not have (``-m optim.lrr=0.1,0.2``), as a single run's
    :func:`check_known_keys` would, before the sweep's MLflow parent run or any job exists: Hydra reports it only when
    it composes the first job, after the parent was created, and the sweep ends an empty ``FAILED`` parent.

    ``config`` is the multirun's own (Hydra composes it without the sweep overrides). The sweeps checked are the command
    line's and the sweeper's ``hydra.sweeper.params``: a key changed (``optim.lrr=…``) must exist; a key added
    (``+optim.lrr=…``) must go into a free-form map. Config groups (``model=deepfm,dlrm``), ``hydra.*`` and keys under a
    swept group (``model.dropout`` beside ``model=…``: each option has its own keys, which
    :func:`recsys_runner.sweep.check_group_option_keys` checks in each option's config) are not checked here.

    Raises:
        ConfigError: naming the key, the closest one and its section's keys.
    """
    overrides = sweep_overrides(config)
    groups = {str(g) for g in OmegaConf.select(config, "hydra.runtime.choices") or {}}
    swept_groups = {o.key_or_group for _, o in overrides if o.key_or_group in groups or "/" in o.key_or_group}
    for text, override in overrides:
        if is_key_override(override, groups) and not any(override.key_or_group.startswith(f"{g}.") for g in swept_groups):
            check_override_key(config, override, f"in the sweep {text}")


def is_key_override(override: Any, groups: set[str]) -> bool:
    """Whether the Hydra ``Override`` changes or adds a config key (``optim.lr=…``, ``+train.x=…``) rather than choosing a
    config group's option (one of ``groups``, or ``hydra/sweeper=…``), deleting a key, or setting ``hydra.*``."""
    from hydra.core.override_parser.types import OverrideType

    key = override.key_or_group
    return (override.type in (OverrideType.CHANGE, OverrideType.ADD) and override.package is None and "/" not in key
            and key not in groups and key.split(".")[0] != "hydra")


def check_override_key(config: DictConfig, override: Any, where: str) -> None:
    """Refuse the Hydra ``Override`` of a key ``config`` lacks, with :func:`unknown_key`'s one line (``where``: how it
    was given, e.g. ``in the sweep optim.lrr=0.1,0.2``): a key changed must exist; a key added (``+key=…``) must go into
    a free-form map.

    Raises:
        ConfigError: naming the key, the closest one and its section's keys.
    """
    from hydra.core.override_parser.types import OverrideType

    key = override.key_or_group
    parent_key, _, name = key.rpartition(".")
    parent = OmegaConf.select(config, parent_key) if parent_key else config
    if not isinstance(parent, DictConfig) or name in parent.keys():
        return
    if override.type == OverrideType.ADD and not dataclasses.is_dataclass(OmegaConf.get_type(parent)):
        return  # +key into a free-form map (checkpoint.name_map): any name goes
    known = [k for k, s in _schema_keys(config, "") if s is None]
    raise unknown_key(key, [str(k) for k in parent.keys()], known, given_as=(where, " Nothing was started."))


def _schema_keys(node: Any, path: str) -> Iterator[tuple[str, list[str] | None]]:
    """Every key under ``node`` with ``None`` if the schema allows it, else the fields its dataclass has."""
    if not isinstance(node, DictConfig | ListConfig) or node._is_none() or node._is_missing():
        return  # a value, or a null or missing section
    if isinstance(node, ListConfig):
        for i, item in enumerate(node):
            yield from _schema_keys(item, f"{path}[{i}]")
        return
    typ = OmegaConf.get_type(node)
    fields = [f.name for f in dataclasses.fields(typ)] if typ is not None and dataclasses.is_dataclass(typ) else None
    for raw_key, child in node.items_ex(resolve=False):
        key = str(raw_key)
        full = f"{path}.{key}" if path else key
        if not path and key == "hydra":
            continue
        if fields is not None and key not in fields:
            yield full, fields
            continue
        yield full, None
        yield from _schema_keys(child, full)
