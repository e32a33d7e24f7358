"""``--help``'s configuration groups: listed in one walk of the config search path, without the ``schema/*`` groups.

The one place this project reaches into Hydra's help, pinned to hydra-core 1.3.8 (``pyproject.toml``) and checked
against Hydra's own listing by ``tests/test_cli_help.py``. Hydra 1.3.8's ``Hydra.get_help`` formats both
``$APP_CONFIG_GROUPS`` and ``$HYDRA_CONFIG_GROUPS`` whatever the help template uses (so no template can skip them),
through ``Hydra.format_config_groups``, which asks ``ConfigLoaderImpl.get_group_options`` ~190 times; each call
builds a ``CachingConfigRepository`` that deep-copies the loader's repository, the ConfigStore's schemas with it:
~4 s of an 8 s ``--help``. Those calls pass no config name and no overrides, so every copy lists what the loader's
own repository lists (no source is re-initialised); :func:`config_groups` asks that repository directly (~30 ms).

The ConfigStore's ``schema/<group>/<name>`` groups (``config.register_configs``) are the typed bases the options in
``conf/`` extend, not options to choose: the listing leaves them out (:data:`HIDDEN`).
"""

from __future__ import annotations

from collections.abc import Callable

import hydra
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.config_repository import IConfigRepository
from hydra._internal.hydra import Hydra
from hydra.core.object_type import ObjectType

HYDRA_VERSION = "1.3.8"
"""The hydra-core whose ``get_help`` and ``format_config_groups`` :func:`install` replaces the latter of; on another,
Hydra's own listing stays (slow, with ``schema/*``) and ``tests/test_cli_help.py`` fails."""
HIDDEN = "schema"
"""The top-level group not listed, nor anything under it: the ConfigStore's schemas (``schema/model/dlrm``, …)."""

_hydra_format_config_groups = Hydra.format_config_groups
"""Hydra's own, kept for a loader that is not 1.3.8's ``ConfigLoaderImpl`` and for the test comparing the listings."""


def config_groups(repository: IConfigRepository) -> dict[str, list[str]]:
    """Every group with at least one config, with its options (sorted), as Hydra's ``list_all_config_groups`` and
    ``get_group_options`` find them: the same walk (a group's subgroups, depth first) over the same repository, without
    a deep copy of it per question, and without :data:`HIDDEN`."""
    groups: dict[str, list[str]] = {}

    def walk(parent: str) -> None:
        for child in repository.get_group_options(parent, ObjectType.GROUP):
            name = f"{parent}/{child}" if parent else child
            if name == HIDDEN:
                continue
            if options := repository.get_group_options(name, ObjectType.CONFIG):
                groups[name] = options
            walk(name)

    walk("")
    return groups


def format_config_groups(self: Hydra, predicate: Callable[[str], bool], compact: bool = True) -> str:
    """``Hydra.format_config_groups`` (1.3.8) from :func:`config_groups`: the same lines, ``group: a, b`` (or the
    options one per line when not ``compact``), sorted by group."""
    loader = self.config_loader
    if not isinstance(loader, ConfigLoaderImpl):
        return _hydra_format_config_groups(self, predicate, compact)
    listing = config_groups(loader.repository)
    lines = []
    for group in sorted(g for g in listing if predicate(g)):
        options = listing[group]
        lines.append(f"{group}: {', '.join(options)}" if compact else f"{group}:\n" + "\n".join(f"  {o}" for o in options))
    return "".join(f"{line}\n" for line in lines)


def install() -> None:
    """Make Hydra's ``--help`` and ``--hydra-help`` list groups with :func:`format_config_groups` (idempotent); only
    on :data:`HYDRA_VERSION`. Every Hydra entry runs it before ``@hydra.main`` (``config.register_configs``)."""
    if hydra.__version__ == HYDRA_VERSION:
        Hydra.format_config_groups = format_config_groups  # type: ignore[method-assign]
