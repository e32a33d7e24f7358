"""The config keys a checkpoint saves and a resume compares, per option of every group a training launch composes
(``tests/resume_keys.txt``), and the command that rewrites that snapshot: ``python -m tests.resume_keys --write``.

Why: a checkpoint saves its launch's composed config (:func:`recsys_runner.runtime.composed_settings`), and a resume
compares it key by key (:func:`recsys_runner.checkpoint.resume.check_changes`). A key added to the config since is
absent from every checkpoint written before, so resuming one after the upgrade warned ``key: (unset) -> value`` and
tagged the run ``resume_changes`` unless ``resume.ADDED_KEYS`` (or a ``silent`` rule) said what earlier runs had.
tests/test_resume_keys.py compares what composes today with the snapshot, so a new key without such a rule fails
there instead of in a user's resumed run.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

from recsys_runner.checkpoint.resume import RESUME_CHANGES, SECTIONS
from recsys_runner.config import register_configs
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.runtime import composed_settings

SNAPSHOT = Path(__file__).with_name("resume_keys.txt")
HEADER = """\
# The config keys a checkpoint's saved config holds and a resume compares (keys under a section resume never warns
# about, as checkpoint.* and tracking.*, are left out), for each option of each config group, the other groups at their
# defaults: the default composition's keys once (`(defaults) key`), then each option's difference from them
# (`group=option +key`, `group=option -key`). tests/test_resume_keys.py checks it (docs/architecture.md, "Adding a config key").
# Rewrite it with: python -m tests.resume_keys --write
"""
PRESETS = ("experiment", "debug")
"""Groups of presets, not snapshot: they set values of keys the other groups' options define and choose those options
(a structured schema refuses a key it lacks), so their keys are those of the options they choose."""
SILENT_SECTIONS = tuple(entry for entry, how, _ in RESUME_CHANGES if how == "silent" and entry in SECTIONS)
"""Sections whose every key a resume lets change without a word (``checkpoint``, ``tracking``, ``storage``,
``distributed``): a key added under one of them cannot make a resume warn, so the snapshot leaves them out."""


def compared(key: str) -> bool:
    """Whether a resume could warn about (or refuse) a change of ``key``: it is not under a :data:`SILENT_SECTIONS`."""
    return not any(key == s or key.startswith((f"{s}.", f"{s}/")) for s in SILENT_SECTIONS)


def _settings(overrides: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """What a launch with ``overrides`` saves in its checkpoints (its compared keys), and its groups' choices."""
    cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    choices = {str(group): choice for group, choice in cfg.hydra.runtime.choices.items() if not str(group).startswith("hydra/")}
    settings = composed_settings(cfg, choices)
    return {key: value for key, value in settings.items() if compared(key)}, choices


def compose_options() -> dict[str, dict[str, Any]]:
    """``{"model=dlrm": {key: value, …}, …}``: for every option of every group under ``conf/`` that the default
    composition chooses from (presets aside), the compared keys of the training config composed with that option, the
    others at their defaults (a group's default option shares the default composition)."""
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        defaults, choices = _settings([])
        out: dict[str, dict[str, Any]] = {}
        for group, default in sorted(choices.items()):
            folder = Path(CONFIG_PATH) / group
            if group.split("/")[0] in PRESETS or not folder.is_dir():
                continue
            for option in sorted(p.stem for p in folder.glob("*.yaml")):
                out[f"{group}={option}"] = defaults if option == default else _settings([f"{group}={option}"])[0]
    return out


DEFAULTS = "(defaults)"
"""The snapshot's name for the default composition, whose keys it lists once; each option's lines are its difference."""


def snapshot_lines(options: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The default composition's keys (``(defaults) key``), then each option's keys as its difference from them
    (``group=option +key`` / ``group=option -key``; an option that adds or drops nothing has no line), sorted: the
    snapshot a reader can diff, ~60 options × ~130 keys written out whole would be ~7,500 lines of repeats."""
    common = set(_defaults(options))
    lines = sorted(f"{DEFAULTS} {key}" for key in common)
    for option, settings in sorted(options.items()):
        lines += sorted([f"{option} +{key}" for key in settings.keys() - common] + [f"{option} -{key}" for key in common - settings.keys()])
    return lines


def _defaults(options: Mapping[str, Mapping[str, Any]]) -> Mapping[str, Any]:
    """The default composition's settings: :func:`compose_options` gives every group's default option that one mapping."""
    return next(v for o, v in options.items() if any(w is v for p, w in options.items() if p != o))


def read_snapshot(path: Path = SNAPSHOT) -> dict[str, set[str]]:
    """``{"model=dlrm": {key, …}, …}``: each option's keys, the defaults' with its differences applied."""
    common: set[str] = set()
    changes: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            option, key = line.split(" ", 1)
            if option == DEFAULTS:
                common.add(key)
            else:
                changes.setdefault(option, []).append(key)
    out = {option: set(common) for option in _options_listed(path)}
    for option, keys in changes.items():
        for change in keys:
            (out[option].add if change[0] == "+" else out[option].discard)(change[1:])
    return out


def _options_listed(path: Path) -> list[str]:
    """Every option the snapshot knows, those without a difference included (its ``# options:`` line)."""
    for line in path.read_text().splitlines():
        if line.startswith("# options: "):
            return line.removeprefix("# options: ").split()
    raise AssertionError(f"{path} lacks its '# options:' line. Fix: python -m tests.resume_keys --write")


def write_snapshot(path: Path = SNAPSHOT) -> None:
    """Rewrite the snapshot from what composes now."""
    options = compose_options()
    path.write_text(HEADER + f"# options: {' '.join(sorted(options))}\n" + "".join(f"{line}\n" for line in snapshot_lines(options)))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.resume_keys --write   (rewrites tests/resume_keys.txt from conf/ and the config dataclasses)")
    write_snapshot()
    print(f"wrote {SNAPSHOT}")
