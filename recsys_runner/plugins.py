"""Options from other installed packages: config classes found by Python entry points, no edit of this package.

A package declares, in its ``pyproject.toml``::

    [project.entry-points."recsys_runner.models"]
    tiny = "mypkg.tiny:TinyConfig"

and ``config.register_configs`` stores ``TinyConfig`` as ``schema/model/tiny`` and as the option ``model=tiny`` (its
dataclass defaults; no YAML needed), exactly where the built-in options live, so composition, ``--help``, sweeps and
:func:`~recsys_runner.config.validate` treat it as one of ours. :data:`ENTRY_POINT_GROUPS` maps each entry-point group to
the config group it fills and the base class its classes must subclass.

Entry points are listed by name from the installed distributions' metadata (:func:`listed`), which imports nothing;
an option's module is imported only when Hydra loads that option (:func:`store_lazily`), i.e. when a run chooses it
(or a preset extends its schema). So a package whose module is slow to import, or broken, costs nothing to a run that
does not use it: ``--help`` and the typo hints need only the names. What cannot be used is said where it matters:

- an entry whose name is already an option (a built-in's, or an earlier entry's) is refused from the names alone
  (:attr:`Plugins.refused`); the command line check warns when a run chooses that name (it gets the other option);
- an entry that fails to import, or names something that is not a subclass of the group's base, stops the run that
  chooses it with one ``Config error:`` line naming the entry point, its distribution and the cause (:func:`load_class`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from hydra.core.config_store import ConfigNode, ConfigStore
from omegaconf import DictConfig, OmegaConf

from recsys_runner.errors import ConfigError

ENTRY_POINT_GROUPS: dict[str, str] = {"recsys_runner.models": "model", "recsys_runner.data": "data"}
"""Entry-point group → the config group its entries become options of (``model=<name>``, ``data=<name>``)."""


@dataclass(frozen=True)
class Plugins:
    """What the installed entry points add, from their names alone: the options, and the entries refused with the reason."""

    entries: dict[str, dict[str, EntryPoint]]
    """Config group → option name → its entry point (not imported: :func:`load_class` does, when the option is used)."""
    refused: dict[tuple[str, str], str]
    """``(config group, option name)`` → the one-line reason an entry of that name was left out (the name was taken)."""


def _where(ep: EntryPoint) -> str:
    """``entry point 'tiny = mypkg.tiny:TinyConfig' (group recsys_runner.models) of distribution mypkg``."""
    dist = ep.dist.name if ep.dist is not None else "an unknown distribution"
    return f"entry point '{ep.name} = {ep.value}' (group {ep.group}) of distribution {dist}"


def listed(builtin: dict[str, dict[str, type]]) -> Plugins:
    """Every entry point of :data:`ENTRY_POINT_GROUPS` by name, next to ``builtin`` (config group → option → class) whose
    names it may not take; nothing is imported. Of two entries of one name the first by name and value keeps it."""
    entries: dict[str, dict[str, EntryPoint]] = {}
    refused: dict[tuple[str, str], str] = {}
    for ep_group, group in ENTRY_POINT_GROUPS.items():
        taken = {name: f"the built-in {cls.__module__}.{cls.__qualname__}" for name, cls in builtin.get(group, {}).items()}
        found = entries.setdefault(group, {})
        for ep in sorted(entry_points(group=ep_group), key=lambda e: (e.name, e.value)):
            if ep.name in taken:
                refused.setdefault((group, ep.name), f"{_where(ep)} is refused: {group}={ep.name} is already {taken[ep.name]}. "
                                                     f"Fix: give the entry point another name in that package's pyproject.toml")
                continue
            found[ep.name] = ep
            taken[ep.name] = f"taken by {_where(ep)}"
    return Plugins(entries=entries, refused=refused)


def load_class(ep: EntryPoint, base: type) -> type:
    """The config class ``ep`` names, imported now.

    Raises:
        ConfigError: ``<group>=<name>: entry point … failed to import: …`` (or names no subclass of ``base``), one line.
    """
    group = ENTRY_POINT_GROUPS[ep.group]
    try:
        cls = ep.load()
    except Exception as e:  # noqa: BLE001 - whatever the user's module raises on import: one line, for this option only
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"{group}={ep.name}: {_where(ep)} failed to import: {type(e).__name__}: {first}. Fix: install "
                          f"what it needs, or uninstall that distribution") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{group}={ep.name}: {_where(ep)} is refused: it names {cls!r}, not a subclass of "
                          f"{base.__module__}.{base.__name__}. Fix: point it at the config dataclass (whose _target_ "
                          f"names the {group} class)")
    return cls


class _LazyNode(ConfigNode):
    """A ConfigStore entry whose node is built on first use: Hydra lists an option by its name (``ConfigStore.list``) and
    reads ``node`` only to compose it (``ConfigStore.load``, which copies the entry and then sets ``node``)."""

    def __init__(self, name: str, group: str | None, schema: Callable[[], type]) -> None:
        self.name, self.group, self.package, self.provider = name, group, None, "recsys_runner.plugins"
        self._schema = schema
        self._node: DictConfig | None = None

    @property
    def node(self) -> DictConfig:
        if self._node is None:
            self._node = OmegaConf.structured(self._schema())
        return self._node

    @node.setter
    def node(self, value: DictConfig) -> None:
        self._node = value

    def __copy__(self) -> _LazyNode:
        twin = _LazyNode(self.name, self.group, self._schema)
        twin._node = self._node
        return twin

    def __deepcopy__(self, memo: dict[int, Any]) -> _LazyNode:
        twin = _LazyNode(self.name, self.group, self._schema)
        twin._node = copy.deepcopy(self._node, memo)
        return twin


def store_lazily(group: str, name: str, schema: Callable[[], type]) -> None:
    """Store ``<group>/<name>`` in Hydra's ConfigStore as :meth:`ConfigStore.store` would store ``schema()``, calling
    ``schema`` (and so importing its module) only when Hydra first loads the option."""
    cs = ConfigStore.instance()
    cs.store(group=group, name=name, node={})  # the folders and the entry's name, as store() makes them
    folder = cs.repo
    for part in group.split("/"):
        folder = folder[part]
    folder[f"{name}.yaml"] = _LazyNode(f"{name}.yaml", group, schema)
