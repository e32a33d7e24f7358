"""Where ``conf/`` is found, and the resolver that gives each launch (a single run, a sweep) a folder of its own.

In a checkout (editable install or ``python -m`` from the repo root) the top-level ``conf/``
directory beside the package is used, so edits to YAML take effect immediately. A wheel ships the
same files as the package ``recsys_runner.conf`` (see ``pyproject.toml``), found via ``pkg://``.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from hydra import initialize_config_dir, initialize_config_module
from omegaconf import OmegaConf

_CHECKOUT_CONF = Path(__file__).resolve().parent.parent / "conf"

CONFIG_PATH: str = str(_CHECKOUT_CONF) if (_CHECKOUT_CONF / "config.yaml").is_file() else "pkg://recsys_runner.conf"


def initialize_conf() -> AbstractContextManager[Any]:
    """Hydra's ``initialize`` for composing from :data:`CONFIG_PATH` outside ``@hydra.main``: the checkout's folder, or
    the installed package's (``pkg://``, which ``initialize_config_dir`` refuses as not absolute)."""
    if CONFIG_PATH.startswith("pkg://"):
        return initialize_config_module(CONFIG_PATH.removeprefix("pkg://"), version_base="1.3")
    return initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3")

NEW_DIR_RESOLVER = "new_dir"
"""``${new_dir:<path>}`` in ``conf/config.yaml``'s ``hydra.run.dir`` and ``hydra.sweep.dir``: :func:`new_dir`."""
_MAX_SUFFIX = 1000


def new_dir(path: str) -> str:
    """``path``, made now, or ``<path>_2``, ``<path>_3`` … when another launch made it first: a folder no other launch
    writes into.

    Hydra's default folders, ``outputs/<date>/<time>`` and ``multirun/<date>/<time>``, are to the second: two launches
    started in the same second in one folder would share one, and the second would find the first one's checkpoints in
    ``<run dir>/checkpoints`` (a sweep's job ``<n>``: ``<sweep dir>/<n>/checkpoints``) and resume them
    (``checkpoint.resume=auto``), a result changed without a word (a test relaunching a command that had taken under a
    second did just that). Making the folder claims it atomically (``mkdir`` fails for the second, on one machine or a
    shared file system). Resolved once per launch: the value is cached in the config, as Hydra's ``now`` is, and carried
    to every job of a sweep, a requeued SLURM job included (it resumes its own checkpoints, in the same folder).

    A torchrun rank other than 0 (``RANK`` set and not ``0``) claims nothing and takes ``path`` as it is: its ranks are
    one launch, whose checkpoints are rank 0's run directory's on every rank
    (:class:`~recsys_runner.checkpoint.policy.Checkpointer`); a claim per rank would leave an extra folder per launch.
    """
    if os.environ.get("RANK", "0") != "0":
        return path
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, _MAX_SUFFIX):
        candidate = base if n == 1 else base.with_name(f"{base.name}_{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return str(candidate)
    raise FileExistsError(f"{base} and {_MAX_SUFFIX - 2} numbered folders beside it exist already; clean up {base.parent} "
                          f"or set hydra.sweep.dir=<a new folder>")


def register_resolvers() -> None:
    """Register :func:`new_dir` with OmegaConf (idempotent): by every entry point (:func:`recsys_runner.config.register_configs`)
    and by the project's Hydra plugin module, which Hydra imports in every process it composes in (a submitit job's too)."""
    OmegaConf.register_new_resolver(NEW_DIR_RESOLVER, new_dir, use_cache=True, replace=True)
