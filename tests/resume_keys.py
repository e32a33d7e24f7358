"""The config keys a checkpoint saves and a resume compares, per option of every group a training launch composes
(``tests/resume_keys.txt``), and the command that rewrites that snapshot: ``python -m tests.resume_keys --write``.

Why: a checkpoint saves its launch's composed config (:func:`recsys_runner.runtime.composed_settings`), and a resume
compares it key by key (:func:`recsys_runner.checkpoint.resume_changes.check_changes`). A key added to the config since is
absent from every checkpoint written before, so resuming one after the upgrade warned ``key: (unset) -> value`` and
tagged the run ``resume_changes`` unless ``resume_changes.ADDED_KEYS`` (or a ``silent`` rule) said what earlier runs had.
tests/test_resume_keys.py compares what composes today with the snapshot, so a new key without such a rule fails
there instead of in a user's resumed run.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir

from recsys_runner.checkpoint.resume_changes import RESUME_CHANGES, SECTIONS
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
    others at their defaults (a group's default option shares the default composition).

    Composed in rounds (:func:`_rounds`), not once per option: one compose chooses an option of every group at once, and
    each option's settings are the round's under its group (:func:`_owned`) and the default composition's elsewhere. That
    is the option's own composition whenever the option reaches nothing outside its group, which :func:`_self_contained`
    checks from its file (no ``# @package``, a defaults list of its schema, its own subgroups and ``_self_``); one that
    may reach further is composed alone. ~20 composes instead of ~60."""
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        defaults, choices = _settings([])
        out: dict[str, dict[str, Any]] = {}
        varied: list[tuple[str, str]] = []
        for group, default in sorted(choices.items()):
            folder = Path(CONFIG_PATH) / group
            if group.split("/")[0] in PRESETS or not folder.is_dir():
                continue
            for option in sorted(p.stem for p in folder.glob("*.yaml")):
                if option == default:
                    out[f"{group}={option}"] = defaults
                else:
                    varied.append((group, option))
        for group, option in varied:
            if not _self_contained(group, option):
                out[f"{group}={option}"] = _settings([f"{group}={option}"])[0]
        for chosen in _rounds([v for v in varied if f"{v[0]}={v[1]}" not in out]):
            settings = _settings([f"{group}={option}" for group, option in chosen])[0]
            for group, option in chosen:
                out[f"{group}={option}"] = {k: v for k, v in defaults.items() if not _owned(group, k)} | {
                    k: v for k, v in settings.items() if _owned(group, k)}
    return dict(sorted(out.items()))


def _owned(group: str, key: str) -> bool:
    """Whether ``key`` is ``group``'s: its choice (``optim/sparse``), a subgroup's choice, a key under its package, or the
    choice of a group placed in its package, named by its option (``experiment/data@data``: ``${experiment}_${data}``)."""
    package = group.replace("/", ".")
    return key in (group, package) or key.startswith((f"{group}/", f"{package}.")) or key.endswith(f"@{package}")


def _self_contained(group: str, option: str) -> bool:
    """Whether ``conf/<group>/<option>.yaml`` can only set keys under its group: it names no other package
    (``# @package``) and its defaults list holds only its schema (``/schema/…@_here_``), ``_self_`` and options of its
    own subgroups (``optim/adagrad.yaml``'s ``sparse: adagrad``)."""
    path = Path(CONFIG_PATH) / group / f"{option}.yaml"
    text = path.read_text()
    if "@package" in text:
        return False
    entries = (yaml.safe_load(text) or {}).get("defaults") or []
    subgroups = {p.name for p in path.parent.iterdir() if p.is_dir()}
    for entry in entries:
        if entry == "_self_" or (isinstance(entry, str) and entry.startswith("/schema/") and entry.endswith("@_here_")):
            continue
        if isinstance(entry, dict) and len(entry) == 1 and next(iter(entry)) in subgroups:
            continue
        return False
    return True


def _rounds(varied: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """``varied`` (group, option) pairs in rounds each choosing at most one option per group, and never a group with one
    of its subgroups (``optim=sgd`` chooses ``optim/sparse`` itself): a group's options come first, then its subgroups'
    side by side (``optim/sparse`` and ``optim/dense`` are apart)."""
    queues: dict[str, list[list[tuple[str, str]]]] = {}
    for family in sorted({group.split("/")[0] for group, _ in varied}):
        own = [[v] for v in varied if v[0] == family]
        nested = sorted({group for group, _ in varied if group.startswith(f"{family}/")})
        assert all(group.count("/") == 1 for group in nested), nested  # deeper groups would need their own rounds
        by_group = [[v for v in varied if v[0] == group] for group in nested]
        side_by_side = [[v for options in by_group if i < len(options) for v in [options[i]]]
                        for i in range(max(map(len, by_group), default=0))]
        queues[family] = own + side_by_side
    return [[v for queue in queues.values() if i < len(queue) for v in queue[i]] for i in range(max(map(len, queues.values()), default=0))]


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
