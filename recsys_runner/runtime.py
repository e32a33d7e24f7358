"""What the command line launched, read from Hydra's runtime once, at the entry, and handed down as plain values.

Hydra's ``HydraConfig`` is a process global that only exists inside ``@hydra.main``. Reading it deep in the library
made every component behave differently under the CLI than in a test or a notebook, without saying so. Instead each
entry point (``python -m recsys_runner``, ``.evaluate``, ``.predict``, ``.export``) calls :meth:`Launch.from_hydra`
once and passes the :class:`Launch` on: the checkpoint directory's default, the overrides saved with each checkpoint,
the command that resumes a run and the MLflow tags are all derived from it. ``Launch()`` (the default) is a launch from
Python: no run directory, no overrides, no resume command.

May import nothing of the package.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path


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

    @property
    def from_cli(self) -> bool:
        """Whether this is a command-line launch (Hydra composed the config)."""
        return self.config_name is not None

    @classmethod
    def from_hydra(cls) -> Launch:
        """The launch Hydra is running now; ``Launch()`` outside ``@hydra.main`` (tests, notebooks)."""
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return cls()
        hc = HydraConfig.get()
        config_dir = next((s.path for s in hc.runtime.config_sources
                           if s.provider == "command-line" and s.schema == "file"), None)
        return cls(overrides=tuple(hc.overrides.task), output_dir=Path(hc.runtime.output_dir),
                   config_name=str(hc.job.config_name) if hc.job.config_name is not None else None, config_dir=config_dir)

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
        args = [*keep, f"checkpoint.dir={Path(checkpoint_dir).absolute()}"]
        if self.config_dir is not None:
            args = ["--config-dir", self.config_dir, *args]
        if self.config_name not in (None, "config"):
            args = ["--config-name", str(self.config_name), *args]
        nproc = os.environ.get("LOCAL_WORLD_SIZE")
        if os.environ.get("TORCHELASTIC_RUN_ID") and nproc and os.environ.get("GROUP_WORLD_SIZE", "1") == "1":
            launcher = ["torchrun", f"--nproc_per_node={nproc}", "-m", "recsys_runner"]
        else:
            launcher = ["python", "-m", "recsys_runner"]
        return shlex.join([*launcher, *args])
