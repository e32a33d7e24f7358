"""What the command line launched, read from Hydra's runtime once, at the entry, and handed down as plain values.

Hydra's ``HydraConfig`` is a process global that only exists inside ``@hydra.main``. Reading it deep in the library
made every component behave differently under the CLI than in a test or a notebook, without saying so. Instead each
entry point (``python -m recsys_runner``, ``.evaluate``, ``.predict``, ``.export``) calls :meth:`Launch.from_hydra`
once and passes the :class:`Launch` on: the checkpoint directory's default, the overrides saved with each checkpoint,
the command that resumes a run and the MLflow tags are all derived from it. ``Launch()`` (the default) is a launch from
Python: no run directory, no overrides, no resume command.

May import ``uris`` only.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

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

    @property
    def from_cli(self) -> bool:
        """Whether this is a command-line launch (Hydra composed the config)."""
        return self.config_name is not None

    @property
    def command_name(self) -> str:
        """The command in words: ``training``, ``evaluate``, ``predict``, ``export``."""
        return "training" if self.module == TRAIN_MODULE else self.module.rsplit(".", 1)[-1]

    @classmethod
    def from_hydra(cls, module: str | None = None) -> Launch:
        """The launch Hydra is running now; ``Launch()`` outside ``@hydra.main`` (tests, notebooks). ``module``: the
        command's module, by default the one ``python -m`` ran (else the one whose config Hydra composed)."""
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
        return cls(overrides=tuple(hc.overrides.task), output_dir=output_dir, config_name=config_name, config_dir=config_dir,
                   module=module or _launched_module(config_name),
                   runs_root=runs_root if runs_root is not None and len(runs_root.absolute().parts) > 2 else None)

    def under_output_dir(self, name: str) -> Path | None:
        """``<run dir>/<name>`` (``checkpoints``, ``export``) under the CLI; ``None`` from Python."""
        return self.output_dir / name if self.output_dir is not None else None

    def resume_command(self, checkpoint_dir: str | Path) -> str | None:
        """The shell command that resumes this launch from ``checkpoint_dir``; ``None`` outside the CLI.

        It is the launch's own overrides (config dir and name included) with ``checkpoint.dir`` set to the
        absolute directory and any ``checkpoint.resume``/``checkpoint.dir`` override dropped, so the
        relaunch continues from the newest checkpoint there, into the same MLflow run. A torchrun launch
        is repeated as torchrun with the same number of processes per node.
        """
        if not self.from_cli:
            return None
        keep = [o for o in self.overrides if not re.match(r"^[+~]*checkpoint\.(dir|resume)=", o)]
        where = uris.as_path(checkpoint_dir).absolute()
        return self._command(TRAIN_MODULE, [*keep, f"checkpoint.dir={where}"])

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
