"""What the command line launched, read from Hydra's runtime once, at the entry, and handed down as plain values.

Hydra's ``HydraConfig`` is a process global that only exists inside ``@hydra.main``. Reading it deep in the library
made every component behave differently under the CLI than in a test or a notebook, without saying so. Instead each
entry point (``python -m recsys_runner``, ``.evaluate``, ``.predict``, ``.export``) calls :meth:`Launch.from_hydra`
once and passes the :class:`Launch` on: the checkpoint directory's default, the overrides saved with each checkpoint,
the command that resumes a run and the MLflow tags are all derived from it. ``Launch()`` (the default) is a launch from
Python: no run directory, no overrides, no resume command. A training launch also carries what Hydra composed, flattened
(:attr:`Launch.settings`): a resume compares it with the one its checkpoint saved.

May import ``uris`` only.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recsys_runner import uris

TRAIN_MODULE = "recsys_runner"
ENTRY_CONFIGS = {TRAIN_MODULE: "config", "recsys_runner.evaluate": "evaluate", "recsys_runner.predict": "predict",
                 "recsys_runner.export": "export"}
"""Each command's module and its own primary config (``--config-name`` is repeated only when it differs)."""


@dataclass(frozen=True)
class Launch:
    """One command-line launch: its overrides, Hydra's output directory and how the config was found."""

    overrides: tuple[str, ...] = ()
    """The command line's overrides (Hydra's ``overrides.task``), e.g. ``("model=dlrm", "optim.lr=0.1")``."""
    output_dir: Path | None = None
    """Hydra's run directory (``outputs/<date>/<time>``, a sweep job's own directory); ``None`` outside the CLI."""
    config_name: str | None = None
    """The primary config (``config``, ``evaluate``, …); ``None`` outside the CLI."""
    config_dir: str | None = None
    """A ``--config-dir`` given on the command line, else ``None``."""
    module: str = TRAIN_MODULE
    """The module launched, ``python -m <module>``: ``recsys_runner`` (training), ``recsys_runner.evaluate``, …"""
    runs_root: Path | None = None
    """Where a single launch's run directories are (``outputs`` for the default ``outputs/<date>/<time>``: two levels
    above :attr:`output_dir`); ``None`` for a multirun job and outside the CLI."""
    settings: Mapping[str, Any] | None = field(default=None, compare=False)
    """What the launch trained with, as Hydra composed it (:func:`composed_settings`): every config key's value and every
    group's choice (``model: deepfm``, ``optim/sparse: adagrad``), wherever it came from — an override, a YAML file, a
    dataclass default. ``None`` outside the CLI and for the commands other than training."""
    cwd: str | None = None
    """The directory the command was launched in, against which relative paths among :attr:`settings` are read."""
    job_num: int | None = None
    """A multirun job's number in its sweep (``hydra.job.num``), by which the launcher that sees the job die finds its
    MLflow run (:mod:`recsys_runner.tracking.sweep_jobs`); ``None`` for a single launch and outside the CLI."""

    @property
    def from_cli(self) -> bool:
        """Whether this is a command-line launch (Hydra composed the config)."""
        return self.config_name is not None

    @property
    def command_name(self) -> str:
        """The command in words: ``training``, ``evaluate``, ``predict``, ``export``."""
        return "training" if self.module == TRAIN_MODULE else self.module.rsplit(".", 1)[-1]

    @classmethod
    def from_hydra(cls, module: str | None = None, config: DictConfig | None = None) -> Launch:
        """The launch Hydra is running now; ``Launch()`` outside ``@hydra.main`` (tests, notebooks). ``module``: the
        command's module, by default the one ``python -m`` ran (else the one whose config Hydra composed); ``config``:
        the config Hydra composed, for :attr:`settings` (training passes it: a resume compares it)."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return cls()
        hc = HydraConfig.get()
        config_dir = next((s.path for s in hc.runtime.config_sources
                           if s.provider == "command-line" and s.schema == "file"), None)
        config_name = str(hc.job.config_name) if hc.job.config_name is not None else None
        output_dir = Path(hc.runtime.output_dir)
        runs_root = output_dir.parent.parent if hc.mode == RunMode.RUN else None
        choices = {str(group): choice for group, choice in hc.runtime.choices.items() if not str(group).startswith("hydra/")}
        return cls(overrides=tuple(hc.overrides.task), output_dir=output_dir, config_name=config_name, config_dir=config_dir,
                   module=module or _launched_module(config_name),
                   runs_root=runs_root if runs_root is not None and len(runs_root.absolute().parts) > 2 else None,
                   settings=composed_settings(config, choices) if config is not None else None, cwd=str(hc.runtime.cwd),
                   job_num=int(hc.job.num) if hc.mode == RunMode.MULTIRUN else None)

    def under_output_dir(self, name: str) -> Path | None:
        """``<run dir>/<name>`` (``checkpoints``, ``export``) under the CLI; ``None`` from Python."""
        return self.output_dir / name if self.output_dir is not None else None

    def resume_command(self, checkpoint_dir: str | Path) -> str | None:
        """The shell command that resumes this launch from ``checkpoint_dir``; ``None`` outside the CLI.

        It is the launch's own overrides (config dir and name included) with ``checkpoint.dir`` set to the
        absolute directory and any ``checkpoint.resume``/``checkpoint.dir`` override dropped, so the
        relaunch continues from the newest checkpoint there, into the same MLflow run. Where the launch did not
        compose ``checkpoint.resume=auto`` (``checkpoint=none`` and the ``debug`` presets say ``never``, yet a stop on a
        signal still writes a checkpoint) or set it on the command line, ``checkpoint.resume=auto`` is added: the
        relaunch would otherwise start over, and a second interruption's command must say it again. A torchrun launch
        is repeated as torchrun with the same number of processes per node.
        """
        if not self.from_cli:
            return None
        keep = [o for o in self.overrides if not re.match(r"^[+~]*checkpoint\.(dir|resume)=", o)]
        where = uris.as_path(checkpoint_dir).absolute()
        resume_set = len(keep) < len([o for o in self.overrides if not re.match(r"^[+~]*checkpoint\.dir=", o)])
        composed = self.settings.get("checkpoint.resume", "auto") if self.settings is not None else "auto"
        auto = ["checkpoint.resume=auto"] if resume_set or composed != "auto" else []
        return self._command(TRAIN_MODULE, [*keep, f"checkpoint.dir={where}", *auto])

    def command(self) -> str | None:
        """The shell command that repeats this launch as it was (the same module and overrides), e.g. to redo an
        interrupted ``evaluate``; ``None`` outside the CLI."""
        if not self.from_cli:
            return None
        return self._command(self.module, list(self.overrides))

    def _command(self, module: str, overrides: list[str]) -> str:
        """``python -m <module>`` (torchrun with the same processes per node under torchrun) with the config dir and
        name of this launch, then ``overrides``."""
        args = overrides
        if self.config_dir is not None:
            args = ["--config-dir", self.config_dir, *args]
        if self.config_name not in (None, ENTRY_CONFIGS.get(module, "config")):
            args = ["--config-name", str(self.config_name), *args]
        nproc = os.environ.get("LOCAL_WORLD_SIZE")
        if os.environ.get("TORCHELASTIC_RUN_ID") and nproc and os.environ.get("GROUP_WORLD_SIZE", "1") == "1":
            launcher = ["torchrun", f"--nproc_per_node={nproc}", "-m", module]
        else:
            launcher = ["python", "-m", module]
        return shlex.join([*launcher, *args])


def _launched_module(config_name: str | None) -> str:
    """The command ``python -m`` (or torchrun ``-m``) ran; under another runner (submitit) the one whose primary
    config Hydra composed; training otherwise."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = str(getattr(spec, "name", "") or "").removesuffix(".__main__")
    if name in ENTRY_CONFIGS:
        return name
    return next((module for module, config in ENTRY_CONFIGS.items() if config == config_name), TRAIN_MODULE)


_REFERENCE = re.compile(r"\$\{[^${}:]*\}")
"""An interpolation that names another key (``${..lr}``, ``${optim.lr}``), as opposed to a resolver (``${oc.env:X}``)."""


def composed_settings(config: DictConfig, choices: Mapping[str, str | None]) -> dict[str, Any]:
    """``{"optim.lr": 0.05, "model.deep_layer_sizes": [256, 128, 64], "optim/sparse": "adagrad", …}``: the composed
    ``config`` flattened to its leaves (a list is one value; ``hydra.*`` is left out) plus the groups' ``choices``, as
    the plain values ``meta.json`` holds (so a saved one and this launch's compare alike). A key that only refers to
    another (``optim.sparse.lr: ${..lr}``) keeps the reference, so a change is named once, by the key it was made to; a
    resolver's value (``${oc.env:…}``) is resolved."""
    written = OmegaConf.to_container(config, resolve=False, enum_to_str=True)
    try:
        values = OmegaConf.to_container(config, resolve=True, enum_to_str=True)
    except OmegaConfBaseException:  # an interpolation that fails: validation names it, inside the command's error handling
        values = written
    out: dict[str, Any] = dict(choices)

    def walk(raw: Any, value: Any, prefix: str) -> None:
        if isinstance(raw, dict) and isinstance(value, dict):
            for key in raw:
                if prefix or key != "hydra":
                    walk(raw[key], value[key], f"{prefix}.{key}" if prefix else str(key))
        else:
            out[prefix] = raw if isinstance(raw, str) and _REFERENCE.fullmatch(raw) else value

    walk(written, values, "")
    plain: dict[str, Any] = json.loads(json.dumps(out, default=str))
    return plain
