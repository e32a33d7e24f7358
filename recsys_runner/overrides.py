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
The messages for a refused option are :mod:`~recsys_runner.override_options`'s, for a refused key or value
:mod:`~recsys_runner.override_keys`'s.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import sys
from collections.abc import Sequence

from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ConfigTypeError, ValidationError

from recsys_runner.config import GROUPS, plugins, register_configs
from recsys_runner.config_keys import torcheasyrec_fix
from recsys_runner.errors import ConfigError, reported
from recsys_runner.override_keys import (
    entries_not_mappings,
    map_without_plus,
    not_a_map,
    schedule_given_as_a_value,
    under_an_unchosen_schedule,
    unknown_key,
    wrong_type,
)
from recsys_runner.override_options import group_with_plus, preset_key_of_another_option, unknown_option
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
            if (message := _equals_in_value(parser, text)) is not None:
                raise ConfigError(message) from None
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
            message = unknown_option(e, chosen, module)
            if message is not None:
                raise ConfigError(message) from None
        except AssertionError:  # OmegaConf's "Unexpected type for root: NoneType", a traceback: a key under a null slot
            message = under_an_unchosen_schedule(config_name, chosen, single)
            if message is not None:
                raise ConfigError(message) from None
        except ConfigCompositionException as e:
            cause = e.__cause__
            message = group_with_plus(chosen, str(e), module) or preset_key_of_another_option(chosen, str(e), module)
            if message is not None:
                pass  # a group's option given with a leading +, or a preset setting a key the option chosen lacks
            elif isinstance(cause, ConfigKeyError | ConfigAttributeError) and str(e).startswith("Could not override"):
                message = (map_without_plus(chosen, str(cause.full_key))
                           or unknown_key(config_name, chosen, single, str(cause.full_key), module))
            elif isinstance(cause, ValidationError) and str(e).startswith("Error merging override"):
                message = (schedule_given_as_a_value(chosen, cause) or entries_not_mappings(chosen, cause)
                           or wrong_type(config_name, chosen, single, cause))
            elif isinstance(cause, ConfigTypeError) and str(e).startswith("Error merging override"):
                message = not_a_map(chosen, str(cause.full_key))
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


def _equals_in_value(parser: OverridesParser, text: str) -> str | None:
    """``data.path=data/day=2026-11-01``: a value holding ``=`` (a Hive-partitioned folder), which Hydra's grammar refuses
    with "mismatched input '=' expecting <EOF>", naming neither the override nor the fix. The fix, when quoting the value
    makes it parse: Hydra's quotes around it, inside the shell's."""
    key, _, value = text.partition("=")
    if "=" not in value or "'" in value:
        return None
    quoted = f"{key}='{value}'"
    try:
        parser.parse_overrides([quoted])
    except OverrideParseException:
        return None
    return (f"{text}: Hydra's override grammar reads only the first '=' as the one between key and value, and refuses "
            f"another in an unquoted value (a Hive-style folder such as day=2026-11-01). Fix: quote the value for Hydra, "
            f"inside the shell's quotes: \"{quoted}\"")


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
