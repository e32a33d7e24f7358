"""The message for a key or a value a command line gives and Hydra refuses: a key the config does not have (another
command's, a renamed one, TorchEasyRec's name, one level too high, or misspelt), a free-form map's entries given without
``+`` or as a list, a key of a group's schedule not chosen yet, a value the key's type cannot take.

:func:`recsys_runner.overrides.explain` calls these once Hydra has refused to compose the command line, with its
error; each returns the line the :class:`~recsys_runner.errors.ConfigError` says, or ``None`` to leave Hydra's own.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Sequence

from hydra import compose
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ValidationError

from recsys_runner.checkpoint.resume_changes import renamed
from recsys_runner.config import options_with_key
from recsys_runner.config_keys import torcheasyrec_fix

OTHER_COMMANDS_KEYS = {"load": "evaluate|predict|export", "predict": "predict", "export": "export"}
"""Top-level keys that only one command's config has (``load`` is evaluate's, predict's and export's): given to another
command, the message names the command rather than a look-alike key."""


SCHEDULE_SLOT = re.compile(r"^(optim\.(?:sparse|dense)_scheduler|optim\.parts\.[^.]+\.scheduler)\.(?P<key>[^.]+)$")
"""A key of a group's own schedule (``optim.sparse_scheduler.decay_rate``): a slot that is null until a schedule is chosen
into it with ``+scheduler@<slot>=<option>``."""


def under_an_unchosen_schedule(config_name: str, chosen: list[Override], single: list[str]) -> str | None:
    """``optim.sparse_scheduler.decay_rate=0.5`` (or with ``+``) while no schedule was chosen for the sparse group: the slot
    is null (the run's ``scheduler`` drives that lr), and OmegaConf fails an assert with "Unexpected type for root:
    NoneType", printed as a traceback. The fix: choose the schedule that has the key into the slot first."""
    for override, line in zip(chosen, single, strict=True):
        match = SCHEDULE_SLOT.match(override.key_or_group)
        if match is None or override.package is not None:
            continue
        slot, key = override.key_or_group.rpartition(".")[0], match["key"]
        try:
            if OmegaConf.select(compose(config_name=config_name, overrides=[x for x in single if x != line]), slot) is not None:
                continue  # a schedule is chosen there: the key's own check names what is wrong
        except Exception:  # noqa: BLE001 - another override is wrong too: Hydra reports it
            return None
        owners = options_with_key("scheduler", key) or ["<option>"]
        value = (override.input_line or "").split("=", 1)[1]
        return (f"{override.input_line}: {slot} is not set (the run's scheduler drives that lr), so it has no key {key!r} to "
                f"set; a schedule of its own is chosen into it first. Fix: +scheduler@{slot}={owners[0]} {slot}.{key}={value}, "
                f"or scheduler.{key}={value} for the run's schedule")
    return None


def schedule_given_as_a_value(chosen: list[Override], cause: ValidationError) -> str | None:
    """``optim.sparse_scheduler=exponential_decay``: a schedule's name given as the slot's value, which OmegaConf refuses
    as "str is not a subclass of SchedulerConfig"; a schedule is chosen into the slot as an option of ``scheduler``."""
    key = str(cause.full_key)
    override = next((o for o in chosen if o.key_or_group == key and o.package is None), None)
    if override is None or not SCHEDULE_SLOT.match(f"{key}.x") or not isinstance(override.value(), str):
        return None
    return (f"{override.input_line}: {key} takes a schedule chosen as an option of the scheduler group, not a name as its "
            f"value. Fix: +scheduler@{key}={override.value()}")


def map_without_plus(chosen: list[Override], key: str) -> str | None:
    """``map={k: v}`` without a leading ``+`` on a free-form map (``checkpoint.name_map``,
    ``precision.embedding_data_type_by_feature``): Hydra merges the given entries into the map, and refuses each new
    one as "not in struct"; the fix is the ``+`` form, which adds them."""
    for override in chosen:
        prefix = override.key_or_group
        if not override.is_add() and not override.is_force_add() and key.startswith(f"{prefix}.") and isinstance(override.value(), dict):
            given = override.input_line or prefix
            return (f"{given}: {prefix} is a map whose entries a command line adds with a leading + (Hydra merges a "
                    f"map given with = into the existing one, which has no key {key[len(prefix) + 1:]!r}). Fix: +{given}")
    return None


def not_a_map(chosen: list[Override], key: str) -> str | None:
    """``map=[a, b]`` (or ``+map=[a, b]``) on a free-form map (``precision.embedding_data_type_by_feature``): Hydra's
    "Cannot merge DictConfig with ListConfig" names neither the map nor its form; the fix is entries, one per name."""
    for override in chosen:
        value = override.value()
        if override.key_or_group == key and isinstance(value, list):
            names = [str(v) for v in value if isinstance(v, str | int)] or ["<name>"]
            entries = ", ".join(f"{name}: <value>" for name in names)
            return f"{override.input_line or key}: {key} is a map of name: value entries, not a list. Fix: +{key}={{{entries}}}"
    return None


def unknown_key(config_name: str, chosen: list[Override], single: list[str], key: str, module: str) -> str | None:
    """``key=value`` (``key`` as Hydra names it, e.g. ``optim.lrr``) where the composed config has no such key: compose
    without that override (the options the command line chose stay, so the keys are theirs) and name the first part of
    it that is not there, with the closest key. ``single``: ``chosen`` as one job composes them."""
    failed = [i for i, o in enumerate(chosen) if (o.key_or_group == key or o.key_or_group.startswith(f"{key}."))
              and not o.is_add() and not o.is_force_add()]
    if not failed:
        return None
    override = chosen[failed[0]]
    key = override.key_or_group  # Hydra names the first part missing (predict of predict.output): the whole key
    try:
        base = compose(config_name=config_name, overrides=[line for i, line in enumerate(single) if i not in failed])
    except Exception:  # noqa: BLE001 - the rest does not compose either: Hydra reports that
        return None
    node: object = base
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None  # a list, a value or a null section on the way: Hydra's message stands
        if part not in node.keys():
            if i > 0 and OmegaConf.get_type(node) is dict:  # a free-form map (no schema): its entries are added with +
                given = override.input_line or key
                return (f"{given}: {'.'.join(parts[:i])} is a map whose entries a command line adds with a leading + (it "
                        f"has no key {part!r} yet). Fix: +{given}")
            siblings = [str(k) for k in node.keys() if not str(k).startswith("_")]
            return _no_such_key(parts, i, siblings, override.input_line or key, module, _one_level_down(node, part))
        node = OmegaConf.select(node, part, throw_on_missing=False)
    return None


def wrong_type(config_name: str, chosen: list[Override], single: list[str], cause: ValidationError) -> str | None:
    """``key=value`` whose value the key's type cannot take (``data.batch_size=abc``; a list key given one value without
    brackets; an entry of a list of the wrong type, ``model.deep_layer_sizes=[null]``, whose key OmegaConf gives as
    ``model.deep_layer_sizes[0]``): OmegaConf's reason and a value that fits, the default the config has without this
    override."""
    key = re.sub(r"\[\d+\]$", "", str(cause.full_key))  # an entry of a list: the list's key
    # an entry of a map the override gives whole (+distributed.tables={t: x}): that override;
    # not the group's choice (model=dlrm before model.embedding_dim=abc), whose key is a prefix too but whose value no map
    failed = [i for i, o in enumerate(chosen) if o.key_or_group == key
              or (key.startswith(f"{o.key_or_group}.") and isinstance(o.value(), dict))]
    if not key or len(failed) != 1:
        return None
    given = chosen[failed[0]].input_line or key
    value = given.split("=", 1)[1]
    reason = str(cause).splitlines()[0].rstrip(".")
    try:
        default = OmegaConf.select(compose(config_name=config_name, overrides=[x for i, x in enumerate(single) if i not in failed]),
                                   key, throw_on_missing=False)
    except Exception:  # noqa: BLE001 - the rest does not compose either: Hydra reports that
        return None
    if (isinstance(default, ListConfig) or "is not a ListConfig" in reason) and value != "null" and not value.startswith("["):
        return f"{given}: {key} is a list ({reason}). Fix: {key}=[{value}] (a list in brackets, e.g. {key}=[a,b])"
    if isinstance(default, ListConfig):  # null for the list, or an entry its type cannot take: the default is the example
        what = f"its entry {cause.full_key}" if str(cause.full_key) != key else f"{key} is a list, not null"
        return f"{given}: {what} ({reason}). Fix: e.g. its default {key}={_yaml(default)}"
    example = f", e.g. its default {key}={_yaml(default)}" if default is not None else ""
    return f"{given}: {reason}. Fix: give {key} a value of its type{example}"


def entries_not_mappings(chosen: list[Override], cause: ValidationError) -> str | None:
    """``data.dense=[price]``: a list whose entries are mappings with a required field (``DenseColumn``: ``name``) given
    bare values; OmegaConf's "str is not a subclass of DenseColumn" at ``data.dense[0]`` names neither the form nor the
    fix, which is each value as that field."""
    container, bracket, _ = str(cause.full_key).partition("[")
    entry = typing.get_args(getattr(cause, "ref_type", None))
    cls = entry[0] if bracket and len(entry) == 1 else None
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return None
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    override = next((o for o in chosen if o.key_or_group == container), None)
    values = override.value() if override is not None else None
    if not required or not isinstance(values, list) or not all(isinstance(v, str | int | float) for v in values):
        return None
    entries = ", ".join(f"{{{required[0]}: {v}}}" for v in values)
    return (f"{override.input_line if override is not None else container}: each entry of {container} is a mapping "
            f"({cls.__name__}, with {', '.join(required)}), not a bare value like {cause.value!r}. Fix: {container}=[{entries}]")


def _yaml(value: object) -> str:
    """``value`` as an override writes it (``true``, ``0.05``, ``[64,null]``)."""
    if isinstance(value, ListConfig | DictConfig):
        value = OmegaConf.to_container(value)
    if isinstance(value, list):  # YAML writes a list as a block, one entry a line: an override writes it in brackets
        return f"[{','.join(_yaml(v) for v in value)}]"
    if isinstance(value, dict):
        return f"{{{', '.join(f'{k}: {_yaml(v)}' for k, v in value.items())}}}"
    text = OmegaConf.to_yaml({"v": value}, sort_keys=False).strip()[3:]
    return text if "\n" not in text else str(value)


def _one_level_down(node: DictConfig, key: str) -> list[str]:
    """The sections of ``node`` that have ``key`` (``optim.no_decay_1d`` → ``dense``): a key given one level too high."""
    return [str(k) for k in node.keys() if not str(k).startswith("_")
            and isinstance(section := OmegaConf.select(node, str(k), throw_on_missing=False), DictConfig) and key in section.keys()]


def _no_such_key(parts: list[str], i: int, siblings: list[str], given: str, module: str, below: Sequence[str] = ()) -> str:
    """``parts[i]`` is not among ``siblings``, the keys at ``parts[:i]``: the command whose key it is, the key of that name
    in a section of them (``below``: one level down), or the closest of them as the fix."""
    parent = ".".join(parts[:i])
    where = f"{parent} has" if parent else "the config has"
    every = f"python -m {module} --help lists every key with its default"
    other = OTHER_COMMANDS_KEYS.get(parts[0]) if i == 0 else None
    if other is not None and module.rpartition(".")[2] not in other.split("|"):
        return (f"{given}: {parts[0]} is a setting of python -m recsys_runner.{other}, not of python -m {module}. Fix: run "
                f"it with that command, or drop it ({every})")
    value = given.split("=", 1)[1] if "=" in given else ""
    if (new := renamed(".".join(parts))) != ".".join(parts):  # a command line from before the rename (a resume command printed then)
        return f"{given}: {'.'.join(parts)} was renamed {new}. Fix: {new}={value} ({every})"
    if (migrated := torcheasyrec_fix(parts, i, siblings, value, lambda name: options_with_key(parts[0], name))) is not None:
        return f"{given}: {migrated} ({every})"
    owners = options_with_key(parts[0], parts[1]) if i == 1 else []
    if owners:  # before the closest name: data.sparse is no misspelt data.num_sparse but a key of the file options
        return (f"{given}: {parts[1]} is a key of {parts[0]}={', '.join(owners)}, not of the {parts[0]} chosen (its keys: "
                f"{', '.join(siblings)}). Fix: choose one of those, e.g. {parts[0]}={owners[0]} {given}, or drop it ({every})")
    if below:  # the key exists one level down: optim.no_decay_1d is optim.dense.no_decay_1d
        where_below = [".".join([*parts[:i], section, *parts[i:]]) for section in below]
        return (f"{given}: {where} no key {parts[i]!r}, but {' and '.join(where_below)} "
                f"{'is' if len(below) == 1 else 'are'}. Fix: {where_below[0]}={value} ({every})")
    close = difflib.get_close_matches(parts[i], siblings, n=1, cutoff=0.6)
    if not close:
        return (f"{given}: {where} no key {parts[i]!r}; its keys are {', '.join(siblings)} ({every}; a leading + adds "
                "keys only to free-form maps such as checkpoint.name_map)")
    right = ".".join([*parts[:i], close[0], *parts[i + 1:]])
    return f"{given}: {where} no key {parts[i]!r} (did you mean {right}?). Fix: {right}={value} ({every})"
