"""The message for a group's option a command line gives and Hydra refuses: an option the group does not have (named as
the option spelt alike, by TorchEasyRec's class name too, or the closest spelling), a group's option given with a
leading ``+``, a preset that sets a key the option chosen lacks.

:func:`recsys_runner.overrides.explain` calls these once Hydra has refused to compose the command line, with its
error; each returns the line the :class:`~recsys_runner.errors.ConfigError` says, or ``None`` to leave Hydra's own.
"""

from __future__ import annotations

import difflib
import re

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.types import Override
from hydra.errors import MissingConfigException

from recsys_runner.config import group_options, options_with_key


def unknown_option(e: MissingConfigException, chosen: list[Override], module: str) -> str | None:
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


def group_with_plus(chosen: list[Override], error: str, module: str) -> str | None:
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


def preset_key_of_another_option(chosen: list[Override], error: str, module: str) -> str | None:
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
    owners = options_with_key(section, name)
    whose = f"a key of {section}={', '.join(owners)}" if owners else f"a key the {section} options do not all have"
    instead = f" with one of those, e.g. {preset} {section}={owners[0]}" if owners else f" with another {section}"
    return (f"{preset} sets {key}, {whose}, not of {option}: the preset is written for those. Fix: {preset}{instead}, or "
            f"leave {preset} out and give its other settings on the command line (conf/{match['group']}/{match['option']}.yaml "
            f"lists them; python -m {module} --help lists every key)")
