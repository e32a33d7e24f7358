"""Options from other installed packages: config classes found by Python entry points, no edit of this package.

A package declares, in its ``pyproject.toml``::

    [project.entry-points."recsys_runner.models"]
    tiny = "mypkg.tiny:TinyConfig"

and ``config.register_configs`` stores ``TinyConfig`` as ``schema/model/tiny`` and as the option ``model=tiny`` (its
dataclass defaults; no YAML needed), exactly where the built-in options live, so composition, ``--help``, sweeps and
:func:`~recsys_runner.config.validate` treat it as one of ours. :data:`ENTRY_POINT_GROUPS` maps each entry-point group to
the config group it fills and the base class its classes must subclass.

A broken entry (it does not import, names something that is not a subclass of the group's base, or takes a name that is
already an option) is left out with one warning line naming the entry point, its distribution and the cause, and every
other option still works: one broken package in a shared environment must not stop runs that do not use it, and a run
that does choose it is told why the option is missing (:attr:`Plugins.refused`, read by ``overrides.py``'s message for an
unknown option) rather than only that it is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

log = logging.getLogger("recsys_runner")

ENTRY_POINT_GROUPS: dict[str, str] = {"recsys_runner.models": "model", "recsys_runner.data": "data"}
"""Entry-point group → the config group its entries become options of (``model=<name>``, ``data=<name>``)."""


@dataclass(frozen=True)
class Plugins:
    """What the installed entry points add: the options loaded, and the entries left out with the reason."""

    options: dict[str, dict[str, type]]
    """Config group → option name → its config class (a subclass of the group's base)."""
    refused: dict[tuple[str, str], str]
    """``(config group, option name)`` → the one-line reason the entry was left out."""


def _where(ep: EntryPoint) -> str:
    """``entry point 'tiny = mypkg.tiny:TinyConfig' (group recsys_runner.models) of distribution mypkg``."""
    dist = ep.dist.name if ep.dist is not None else "an unknown distribution"
    return f"entry point '{ep.name} = {ep.value}' (group {ep.group}) of distribution {dist}"


def _load_one(ep: EntryPoint, base: type, taken: dict[str, str]) -> type | str:
    """The config class ``ep`` names, or the reason it is refused; ``taken`` maps each option name already in use to
    what holds it (a built-in's class, or an earlier entry point)."""
    group = ENTRY_POINT_GROUPS[ep.group]
    if ep.name in taken:
        return (f"{_where(ep)} is refused: {group}={ep.name} is already {taken[ep.name]}. Fix: give the entry point "
                f"another name in that package's pyproject.toml")
    try:
        cls = ep.load()
    except Exception as e:  # noqa: BLE001 - whatever the user's module raises on import: reported, the others still load
        first = str(e).splitlines()[0] if str(e) else ""
        return (f"{_where(ep)} failed to import: {type(e).__name__}: {first}. Fix: install what it needs, or uninstall "
                f"that distribution; {group}={ep.name} is unavailable")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        return (f"{_where(ep)} is refused: it names {cls!r}, not a subclass of {base.__module__}.{base.__name__}. Fix: "
                f"point it at the config dataclass (whose _target_ names the {group} class)")
    return cls


def load(builtin: dict[str, dict[str, type]], bases: dict[str, type]) -> Plugins:
    """Every entry point of :data:`ENTRY_POINT_GROUPS`, each as an option of its config group, next to ``builtin``
    (config group → option → class) whose names it may not take; ``bases`` gives each config group's base class. A
    refused entry is logged (one warning line) and recorded in :attr:`Plugins.refused`."""
    options: dict[str, dict[str, type]] = {}
    refused: dict[tuple[str, str], str] = {}
    for ep_group, group in ENTRY_POINT_GROUPS.items():
        taken = {name: f"the built-in {cls.__module__}.{cls.__qualname__}" for name, cls in builtin.get(group, {}).items()}
        found = options.setdefault(group, {})
        for ep in sorted(entry_points(group=ep_group), key=lambda e: (e.name, e.value)):
            result = _load_one(ep, bases[group], taken)
            if isinstance(result, str):
                log.warning(result)
                refused.setdefault((group, ep.name), result)
                continue
            found[ep.name] = result
            taken[ep.name] = f"taken by {_where(ep)}"
    return Plugins(options=options, refused=refused)

