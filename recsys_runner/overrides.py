"""A command line's overrides checked before ``@hydra.main`` composes them, so a typo is one line naming the fix.

Hydra reports its own composition errors in its own words, which leave a newcomer stuck: ``optim.lrr=0.1`` gets
"Key 'lrr' not in 'OptimConfig' … To append to your config use +optim.lrr=0.1" (advice the runner then refuses:
:func:`~recsys_runner.config_keys.check_known_keys`), ``model=deepfmm`` the list of all 21 models, and
``python -m recsys_runner evaluate`` "missing EQUAL at '<EOF>'". :func:`check_command_line` composes the overrides as
Hydra will, and for these mistakes — a key the config does not have (or another command's), an option a group does not
have, a value the key's type cannot take (a list key given one value without brackets), a word that is not an override
(most often a command typed as an argument) — raises a :class:`~recsys_runner.errors.ConfigError` with the closest
valid name or value, printed as one line with exit status 2 (:func:`~recsys_runner.errors.reported`).
Anything else it leaves to Hydra, which composes again and reports it as before: this check may only add clarity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import os
import re
import sys
import typing
from collections.abc import Sequence

from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ConfigTypeError, ValidationError

from recsys_runner.checkpoint.resume_changes import renamed
from recsys_runner.config import GROUPS, group_options, plugins, register_configs
from recsys_runner.config_keys import torcheasyrec_fix
from recsys_runner.errors import ConfigError, reported
from recsys_runner.paths import initialize_conf

log = logging.getLogger("recsys_runner")

COMMANDS = {
    "evaluate": "metrics of a checkpoint on eval data",
    "predict": "scores of a checkpoint written as Parquet",
    "export": "a checkpoint as a served artifact",
    "plan": "the sharding plan and memory per rank, without data",
    "compare": "a table and plots of runs",
    "data": "convert, inspect, sequences",
    "tracking": "replay metrics a run could not send",
    "bench": "the benchmarks",
}
"""The commands besides training, each ``python -m recsys_runner.<name>``: what a word on the command line that is not
an override most often is."""
TRAINING_WORDS = ("train", "training", "fit", "train_eval")
"""Words for training (TorchEasyRec's ``tzrec.train_eval`` among them): training is ``python -m recsys_runner`` itself."""
OTHER_COMMANDS_KEYS = {"load": "evaluate|predict|export", "predict": "predict", "export": "export"}
"""Top-level keys that only one command's config has (``load`` is evaluate's, predict's and export's): given to another
command, the message names the command rather than a look-alike key."""
_SKIPPED_FLAGS = ("help", "hydra_help", "info", "shell_completion", "version", "config_path", "config_dir", "experimental_rerun")
"""Hydra's options after which the check stays out of the way: they print, or compose from another search path."""


def check_command_line(config_name: str, argv: Sequence[str] | None = None) -> None:
    """The module docstring: raise (through :func:`reported`: one line, exit 2) for a mistake of those kinds in
    ``argv`` (``sys.argv`` by default), composed with ``config_name`` as the command's ``@hydra.main`` will."""
    from hydra._internal.utils import get_args_parser

    argv = list(sys.argv if argv is None else argv)
    try:
        args, unknown = get_args_parser().parse_known_args(argv[1:])
    except (Exception, SystemExit):  # noqa: BLE001 - Hydra's own parse reports bad arguments
        return
    if any(getattr(args, flag, None) for flag in _SKIPPED_FLAGS):
        return
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    with reported():
        _torcheasyrec_flags(unknown)
        explain(args.config_name or config_name, list(args.overrides or []), multirun=bool(args.multirun),
                module=spec.name.removesuffix(".__main__") if spec is not None else "recsys_runner")


def _torcheasyrec_flags(unknown: list[str]) -> None:
    """``--model_dir=out`` or ``--continue_train``: TorchEasyRec's ``train_eval`` flags, which Hydra's argument parser
    refuses with its usage text. Raise the one line naming our key (:func:`torcheasyrec_fix`) for the first of them."""
    for word in unknown:
        name, equals, value = word.removeprefix("--").partition("=")
        if word.startswith("--") and (message := torcheasyrec_fix([name], 0, [], value if equals else "<value>")) is not None:
            raise ConfigError(f"{word}: {message} (overrides are key=value, without --)")


def explain(config_name: str, overrides: list[str], *, multirun: bool = False, module: str = "recsys_runner") -> None:
    """Raise :class:`ConfigError` for a word that is not an override, an unknown option of a group or an unknown key in
    ``overrides`` (composed on ``config_name``); nothing for anything else."""
    parser = OverridesParser.create()
    parsed: list[Override] = []
    for text in overrides:
        try:
            parsed += parser.parse_overrides([text])
        except OverrideParseException:
            if "=" not in text:
                raise ConfigError(not_an_override(text, module)) from None
            return  # a malformed value: Hydra's message shows where
    chosen = [o for o in parsed if not o.is_hydra_override()]
    # another package's YAML options (hydra.searchpath=[pkg://theirpkg.conf]) are options here too
    searchpath = [o.input_line for o in parsed if o.key_or_group == "hydra.searchpath" and o.input_line is not None]
    for override in chosen:
        _require_one_option(override, module)
        _refused_entry_point(override)
    first = [_first_of_sweep(o) for o in chosen] if multirun else [o.input_line for o in chosen]
    single = [line for line in first if line is not None]
    if len(single) < len(chosen):
        return
    if not single:
        return  # nothing to check: no second composition
    register_configs()
    initialized = GlobalHydra.instance().is_initialized()  # by a caller that composes from conf/ itself (a test)
    with contextlib.nullcontext() if initialized else initialize_conf():
        try:
            compose(config_name=config_name, overrides=[*searchpath, *single])
        except MissingConfigException as e:
            message = _unknown_option(e, chosen, module)
            if message is not None:
                raise ConfigError(message) from None
        except AssertionError:  # OmegaConf's "Unexpected type for root: NoneType", a traceback: a key under a null slot
            message = _under_an_unchosen_schedule(config_name, chosen, single)
            if message is not None:
                raise ConfigError(message) from None
        except ConfigCompositionException as e:
            cause = e.__cause__
            message = _group_with_plus(chosen, str(e), module) or _preset_key_of_another_option(chosen, str(e), module)
            if message is not None:
                pass  # a group's option given with a leading +, or a preset setting a key the option chosen lacks
            elif isinstance(cause, ConfigKeyError | ConfigAttributeError) and str(e).startswith("Could not override"):
                message = (_map_without_plus(chosen, str(cause.full_key))
                           or _unknown_key(config_name, chosen, single, str(cause.full_key), module))
            elif isinstance(cause, ValidationError) and str(e).startswith("Error merging override"):
                message = (_schedule_given_as_a_value(chosen, cause) or _entries_not_mappings(chosen, cause)
                           or _wrong_type(config_name, chosen, single, cause))
            elif isinstance(cause, ConfigTypeError) and str(e).startswith("Error merging override"):
                message = _not_a_map(chosen, str(cause.full_key))
            if message is not None:
                raise ConfigError(message) from None


def not_an_override(word: str, module: str) -> str:
    """The message for ``word``, an argument without ``=``: the command it resembles, or what an override looks like."""
    entry = module.rpartition(".")[2] if module != "recsys_runner" else None
    here = f"python -m {module}"
    if word in TRAINING_WORDS and entry is None:
        return (f"{word!r} is not an override: training is this command itself, {here} [overrides] "
                "(key=value or group=option, e.g. model=dlrm train.num_steps=100)")
    close = difflib.get_close_matches(word, list(COMMANDS), n=1, cutoff=0.6)
    if close and close[0] != entry:
        name = close[0]
        same = "" if word == name else f" (did you mean {name}?)"
        return (f"{word!r} is not an override{same}: {name} is a command of its own, python -m recsys_runner.{name} "
                f"[overrides] ({COMMANDS[name]}); overrides are key=value or group=option")
    return (f"{word!r} is not an override: {here} takes key=value or group=option, e.g. data.batch_size=1024 "
            f"(the commands: python -m recsys_runner.<{'|'.join(COMMANDS)}>; --help lists groups and keys)")


def _require_one_option(override: Override, module: str) -> None:
    """``model=[deepfm,dlrm]``: a component group given a list. Hydra would merge every option listed into one node and then
    fail on an interpolation of the defaults list ("Error resolving interpolation '${experiment}_${model}'"), which names
    neither the group nor the fix: one option, or a sweep of them."""
    value = override.value()
    if override.key_or_group not in GROUPS or not isinstance(value, list):
        return
    group, options = override.key_or_group, [str(v) for v in value]
    raise ConfigError(f"{override.input_line}: {group} takes one option, not a list. Fix: choose one, e.g. {group}={options[0]}, "
                      f"or train each in a sweep: python -m {module} --multirun {group}={','.join(options)}")


def _refused_entry_point(override: Override) -> None:
    """``model=deepfm`` while an installed package's entry point is named ``deepfm`` too: the run gets the option that
    holds the name (the built-in, or the entry first by name), and one warning line says which entry was refused and
    why (:attr:`~recsys_runner.plugins.Plugins.refused`); a run that does not choose that name hears nothing of it.
    Said by rank 0 only: under torchrun every rank checks the same command line."""
    value = override.value()
    if isinstance(value, str) and (refused := plugins().refused.get((override.key_or_group, value))) is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            log.warning(refused)


def _first_of_sweep(override: Override) -> str | None:
    """A multirun's override as one job sees it (a sweep cut to its first value); ``None`` when it has no list of values
    (an interval for a search): the check then leaves the command line to Hydra."""
    if not override.is_sweep_override():
        return override.input_line
    try:
        first = next(override.sweep_string_iterator())
    except Exception:  # noqa: BLE001 - an interval sweep has no values to list
        return None
    return f"{override.get_key_element()}={first}"  # the key with its prefix (+, ++, ~)


def _unknown_option(e: MissingConfigException, chosen: list[Override], module: str) -> str | None:
    """``group=option`` where the group has no such option: the closest one and the list. The fix keeps how the group
    was given (``+scheduler@optim.sparse_scheduler=…``: the sparse group's own schedule, not the run's ``scheduler``). An
    option of a group below it (``optim=adamw``: ``optim/dense=adamw``) is named there, before any closest spelling
    (``optim=adam`` would train another optimizer, with fused Adam on the tables)."""
    missing, options = e.missing_cfg_file or "", list(e.options or [])
    group, _, option = missing.rpartition("/")
    given = next((o for o in chosen if o.key_or_group == group and str(o.value()) == option), None)
    if not group or given is None or not options:
        return None
    below = None if _same_option(option, options) else _option_below(group, option)
    if below is not None:
        return (f"{given.input_line}: {group} has no option {option!r}, but {below} is an option of one half of it. Fix: "
                f"{below} (python -m {module} --help lists every group)")
    close = _closest_option(option, options)
    chosen_as = given.get_key_element()
    hint = f" (did you mean {chosen_as}={close[0]}?)" if close else ""
    fix = f"{chosen_as}={close[0]}" if close else f"one of them, e.g. {chosen_as}={options[0]}"
    return (f"{given.input_line}: {group} has no option {option!r}{hint}; its options are {', '.join(options)}. "
            f"Fix: {fix} (python -m {module} --help lists every group)")


def _spelling(name: str) -> str:
    """``name`` without case, separators and TorchEasyRec's class suffixes: ``BF16`` and ``bf16``, ``AdamWOptimizer`` and
    ``adamw``, ``ExponentialDecayLR`` and ``exponential_decay`` are spelt alike."""
    bare = re.sub(r"[^a-z0-9]", "", name.lower())
    for suffix in ("optimizer", "lr"):
        if bare.endswith(suffix) and len(bare) > len(suffix):
            bare = bare[: -len(suffix)]
    return bare


TORCHEASYREC_OPTIONS = {"cosineannealing": "cosine", "cosineannealingwarmrestarts": "cosine_restarts"}
"""TorchEasyRec's class names (as :func:`_spelling` leaves them) of options named otherwise here."""


def _same_option(given: str, options: list[str]) -> list[str]:
    """The option spelt as ``given`` but for case, separators and a class suffix (:func:`_spelling`), or named so by
    TorchEasyRec (:data:`TORCHEASYREC_OPTIONS`: ``CosineAnnealingLR`` is ``cosine``), as a list of at most one."""
    spelt = TORCHEASYREC_OPTIONS.get(_spelling(given), _spelling(given))
    return [o for o in options if _spelling(o) == spelt][:1]


def _closest_option(given: str, options: list[str]) -> list[str]:
    """The option ``given`` most likely means, as a list of at most one: the one spelt alike (:func:`_same_option`:
    ``precision=BF16`` is ``bf16``, TorchEasyRec's spelling, where difflib's character match ranks ``fp16`` above it and
    the fix would train in another precision; ``optim/sparse=LarsSGDOptimizer`` is ``lars_sgd``), else the closest
    spelling."""
    return _same_option(given, options) or difflib.get_close_matches(given, options, n=1, cutoff=0.5)


def _option_below(group: str, option: str) -> str | None:
    """``<group>/<half>=<option>`` for an option spelt as ``option`` (:func:`_same_option`) in a group below ``group``
    (``optim/dense`` below ``optim``); ``None`` when none has it."""
    loader = GlobalHydra.instance().config_loader()
    for half in sorted(loader.list_groups(group)):
        if same := _same_option(option, loader.get_group_options(f"{group}/{half}")):
            return f"{group}/{half}={same[0]}"
    return None


def _group_with_plus(chosen: list[Override], error: str, module: str) -> str | None:
    """``+experiment=deepfm_criteo`` (the form Hydra's own docs use for a group outside the defaults list): every group of
    the root config is in its defaults list (``experiment`` and ``debug`` as ``null``, no preset), so Hydra refuses the
    ``+`` with "Multiple values for experiment. To override a value use 'override experiment: …'" (``++``: "force-add of
    config groups is not supported"), advice for a YAML defaults list, not for a command line. The fix: the plain form."""
    if not error.startswith(("Multiple values for ", "force-add of config groups")):
        return None
    for override in chosen:
        given, group = override.input_line or "", override.key_or_group
        if (override.is_add() or override.is_force_add()) and (f"Multiple values for {group}." in error or f"'{given}'" in error):
            plain = given.lstrip("+")
            return (f"{given}: {group} is a group of the config's defaults list already (python -m {module} --help lists its "
                    f"options), so an option of it is chosen without a leading +. Fix: {plain}")
    return None


_PRESET_KEY = re.compile(r"^In '(?P<group>\w+)/(?P<option>\w+)': ConfigKeyError raised while composing config:\n"
                         r"Key '[^']+' not in '(?P<schema>\w+)'\n\s*full_key: (?P<key>\S+)")
"""Hydra's words for a preset file (``debug/overfit``) that sets a key the option chosen for its section does not have."""


def _preset_key_of_another_option(chosen: list[Override], error: str, module: str) -> str | None:
    """``debug=overfit data=parquet``: a preset (``debug``, ``experiment``) sets a key of a group's other options
    (``data.num_train_rows``, which cuts only generated data's epoch), and Hydra says only "In 'debug/overfit':
    ConfigKeyError raised while composing config: Key 'num_train_rows' not in 'ParquetDataConfig'", with a traceback hint
    and exit status 1, naming neither the clash nor a way out. The message names the preset, the key, the options that
    have it and the two fixes: one of those options, or the preset's other settings given without it."""
    match = _PRESET_KEY.match(error)
    if match is None:
        return None
    preset = f"{match['group']}={match['option']}"
    key = match["key"]
    section, _, name = key.partition(".")
    given = next((o.input_line for o in chosen if o.key_or_group == section and not o.is_sweep_override()), None)
    named = [option for option, schema in group_options(section).items() if schema.__name__ == match["schema"]]
    option = given or (f"{section}={named[0]}" if len(named) == 1 else f"the {section} chosen")
    owners = _options_with_key(section, name)
    whose = f"a key of {section}={', '.join(owners)}" if owners else f"a key the {section} options do not all have"
    instead = f" with one of those, e.g. {preset} {section}={owners[0]}" if owners else f" with another {section}"
    return (f"{preset} sets {key}, {whose}, not of {option}: the preset is written for those. Fix: {preset}{instead}, or "
            f"leave {preset} out and give its other settings on the command line (conf/{match['group']}/{match['option']}.yaml "
            f"lists them; python -m {module} --help lists every key)")


SCHEDULE_SLOT = re.compile(r"^(optim\.(?:sparse|dense)_scheduler|optim\.parts\.[^.]+\.scheduler)\.(?P<key>[^.]+)$")
"""A key of a group's own schedule (``optim.sparse_scheduler.decay_rate``): a slot that is null until a schedule is chosen
into it with ``+scheduler@<slot>=<option>``."""


def _under_an_unchosen_schedule(config_name: str, chosen: list[Override], single: list[str]) -> str | None:
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
        owners = _options_with_key("scheduler", key) or ["<option>"]
        value = (override.input_line or "").split("=", 1)[1]
        return (f"{override.input_line}: {slot} is not set (the run's scheduler drives that lr), so it has no key {key!r} to "
                f"set; a schedule of its own is chosen into it first. Fix: +scheduler@{slot}={owners[0]} {slot}.{key}={value}, "
                f"or scheduler.{key}={value} for the run's schedule")
    return None


def _schedule_given_as_a_value(chosen: list[Override], cause: ValidationError) -> str | None:
    """``optim.sparse_scheduler=exponential_decay``: a schedule's name given as the slot's value, which OmegaConf refuses
    as "str is not a subclass of SchedulerConfig"; a schedule is chosen into the slot as an option of ``scheduler``."""
    key = str(cause.full_key)
    override = next((o for o in chosen if o.key_or_group == key and o.package is None), None)
    if override is None or not SCHEDULE_SLOT.match(f"{key}.x") or not isinstance(override.value(), str):
        return None
    return (f"{override.input_line}: {key} takes a schedule chosen as an option of the scheduler group, not a name as its "
            f"value. Fix: +scheduler@{key}={override.value()}")


def _map_without_plus(chosen: list[Override], key: str) -> str | None:
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


def _not_a_map(chosen: list[Override], key: str) -> str | None:
    """``map=[a, b]`` (or ``+map=[a, b]``) on a free-form map (``precision.embedding_data_type_by_feature``): Hydra's
    "Cannot merge DictConfig with ListConfig" names neither the map nor its form; the fix is entries, one per name."""
    for override in chosen:
        value = override.value()
        if override.key_or_group == key and isinstance(value, list):
            names = [str(v) for v in value if isinstance(v, str | int)] or ["<name>"]
            entries = ", ".join(f"{name}: <value>" for name in names)
            return f"{override.input_line or key}: {key} is a map of name: value entries, not a list. Fix: +{key}={{{entries}}}"
    return None


def _unknown_key(config_name: str, chosen: list[Override], single: list[str], key: str, module: str) -> str | None:
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


def _wrong_type(config_name: str, chosen: list[Override], single: list[str], cause: ValidationError) -> str | None:
    """``key=value`` whose value the key's type cannot take (``data.batch_size=abc``; a list key given one value without
    brackets): OmegaConf's reason and a value that fits, the default the config has without this override."""
    key = str(cause.full_key)  # an entry of a map the override gives whole (+distributed.tables={t: x}): that override;
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
    if isinstance(default, ListConfig) or "is not a ListConfig" in reason:
        return f"{given}: {key} is a list ({reason}). Fix: {key}=[{value}] (a list in brackets, e.g. {key}=[a,b])"
    example = f", e.g. its default {key}={_yaml(default)}" if default is not None else ""
    return f"{given}: {reason}. Fix: give {key} a value of its type{example}"


def _entries_not_mappings(chosen: list[Override], cause: ValidationError) -> str | None:
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
    text = OmegaConf.to_yaml({"v": value}, sort_keys=False).strip()[3:]
    return text if "\n" not in text else str(value)


def _options_with_key(group: str, key: str) -> list[str]:
    """The options of config group ``group`` whose schema has ``key`` (``model``, ``structure`` → ``dcn_v2``, ``masknet``)."""
    return [option for option, schema in group_options(group).items() if key in {f.name for f in dataclasses.fields(schema)}]


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
    if (migrated := torcheasyrec_fix(parts, i, siblings, value, lambda name: _options_with_key(parts[0], name))) is not None:
        return f"{given}: {migrated} ({every})"
    owners = _options_with_key(parts[0], parts[1]) if i == 1 else []
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
