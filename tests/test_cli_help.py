"""``--help``'s configuration groups (recsys_runner/help_groups.py): every ``conf/`` group with its options and no
``schema/*``, the composed config with the command line's overrides below them, Hydra's own groups in ``--hydra-help``,
and the listing made without Hydra 1.3.8's deep copy of the config repository per question (~4 s of an 8 s ``--help``),
counted, not timed. The hook replaces a Hydra method: the last tests fail when hydra-core is not the version it was
written against, or when Hydra's own listing no longer matches it."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import hydra
import pytest
from hydra._internal import config_loader_impl
from hydra._internal.config_repository import CachingConfigRepository, IConfigRepository
from hydra._internal.hydra import Hydra
from hydra.core.global_hydra import GlobalHydra

from recsys_runner import help_groups
from recsys_runner.config import register_configs
from recsys_runner.paths import initialize_conf
from tests.conftest import REPO, run_in_process

ENTRIES = ["recsys_runner", "recsys_runner.evaluate", "recsys_runner.predict", "recsys_runner.export", "recsys_runner.plan"]
"""Every command whose ``--help`` is Hydra's (``@hydra.main``)."""
CONF = REPO / "conf"


def conf_groups(root: Path = CONF, skip: str = "hydra") -> dict[str, str]:
    """Each folder of ``conf/`` that holds options (``hydra/`` aside), as ``--help`` should list it: ``group: a, b``."""
    groups = {}
    for folder in sorted(p for p in root.rglob("*") if p.is_dir() and p.relative_to(root).parts[:1] != (skip,)):
        if options := sorted(p.stem for p in folder.glob("*.yaml")):
            group = folder.relative_to(root).as_posix()
            groups[group] = f"{group}: {', '.join(options)}"
    return groups


def listed_groups(stdout: str) -> dict[str, str]:
    """The ``group: options`` lines of the help's "Configuration groups" section, by group."""
    section = stdout.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    lines = [line for line in section.splitlines() if re.match(r"^[\w/]+: ", line)]
    return {line.split(":", 1)[0]: line for line in lines}


@pytest.mark.parametrize("entry", ENTRIES)
def test_help_lists_every_conf_group_with_its_options_and_no_schema(tmp_path: Path, entry: str) -> None:
    out = run_in_process([sys.executable, "-m", entry, "--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    expected = conf_groups()
    assert {"model", "optim", "optim/dense", "optim/sparse", "scheduler", "data", "distributed", "precision", "tracking",
            "checkpoint", "experiment", "experiment/model", "experiment/data", "debug"} <= set(expected)
    assert listed_groups(out.stdout) == expected
    assert "schema" not in out.stdout.split("== Config ==", 1)[0]  # neither a group nor the footer's word for them


def test_help_prints_the_config_with_the_overrides(tmp_path: Path) -> None:
    out = run_in_process([sys.executable, "-m", "recsys_runner", "model=dlrm", "optim.lr=0.3", "train.num_steps=7",
                          "--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    config = out.stdout.split("== Config ==", 1)[1]
    assert "_target_: recsys_runner.models.dlrm.DLRM" in config and "DeepFM" not in config
    assert "\noptim:\n  lr: 0.3\n" in config and "\ntrain:\n  num_steps: 7\n" in config
    assert listed_groups(out.stdout) == conf_groups()  # the overrides choose options; the list still shows them all


def test_hydra_help_lists_hydras_groups(tmp_path: Path) -> None:
    out = run_in_process([sys.executable, "-m", "recsys_runner", "--hydra-help"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"Hydra ({hydra.__version__})") and "== Flags ==" in out.stdout
    ours = {f"hydra/{group}": line.split(": ", 1)[1].split(", ") for group, line in conf_groups(CONF / "hydra", skip="").items()}
    listed = {group: line.split(": ", 1)[1].split(", ") for group, line in listed_groups(out.stdout).items()}
    assert {"hydra/help", "hydra/job_logging", "hydra/launcher"} <= set(ours)
    for group, options in ours.items():  # ours beside Hydra's and its plugins' (hydra/launcher: basic, submitit_local, …)
        assert set(options) <= set(listed[group]), (group, listed.get(group))
    assert {"hydra/launcher", "hydra/sweeper", "hydra/job_logging", "hydra/hydra_logging"} <= set(listed)
    assert all(group.startswith("hydra/") or group == "hydra" for group in listed), sorted(listed)


class _Counted(CachingConfigRepository):
    """Hydra's ``CachingConfigRepository``, counting its constructions (each deep-copies the config repository)."""

    made = 0

    def __init__(self, delegate: IConfigRepository) -> None:
        type(self).made += 1
        super().__init__(delegate)


@pytest.mark.parametrize("overrides", [[], ["model=dlrm", "optim=adam"]])
def test_help_copies_the_repository_no_more_than_composing_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               overrides: list[str]) -> None:
    """Hydra 1.3.8 lists the groups with ~190 ``get_group_options`` calls, each a ``CachingConfigRepository``: with
    the listing replaced, ``--help`` builds as many as ``--cfg job`` (composing the same config) and no more."""
    monkeypatch.setattr(config_loader_impl, "CachingConfigRepository", _Counted)
    made = {}
    for flags in (["--cfg", "job"], ["--help"]):
        _Counted.made = 0
        out = run_in_process([sys.executable, "-m", "recsys_runner", *overrides, *flags], tmp_path)
        assert out.returncode == 0, out.stderr
        made[flags[0]] = _Counted.made
    assert made["--cfg"] >= 1, "the count sees no composition: Hydra no longer builds its repositories where patched"
    assert made["--help"] <= made["--cfg"], made  # --cfg also composes once more in the command-line check


def test_the_hook_is_installed_on_the_hydra_it_was_written_for() -> None:
    """``help_groups`` replaces ``Hydra.format_config_groups`` of hydra-core 1.3.8 only; pyproject.toml pins that one.
    A Hydra upgrade fails here first: check its ``get_help`` / ``format_config_groups`` / ``get_group_options``
    against help_groups.py (and the listing test below), then move both pins."""
    pinned = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"hydra-core=={help_groups.HYDRA_VERSION}" in pinned
    assert hydra.__version__ == help_groups.HYDRA_VERSION
    register_configs()
    assert Hydra.format_config_groups is help_groups.format_config_groups


def test_the_listing_is_hydras_own_without_schema() -> None:
    """The same lines as Hydra's own ``format_config_groups`` (its deep copy per question, ~3 s here), ``schema/*``
    aside, for every group of the real search path (``conf/``, Hydra's, its plugins', the ConfigStore), compact or
    not."""
    register_configs()
    with initialize_conf():
        instance = GlobalHydra.instance().hydra
        assert instance is not None
        hydras = help_groups._hydra_format_config_groups(instance, lambda group: True)
        ours = help_groups.format_config_groups(instance, lambda group: True)
        ours_long = help_groups.format_config_groups(instance, lambda group: group.startswith("optim"), compact=False)
    shown = [line for line in hydras.splitlines(keepends=True) if not line.startswith("schema/")]
    assert len(shown) < len(hydras.splitlines()), "Hydra's own listing has no schema/* groups: is the ConfigStore empty?"
    assert ours == "".join(shown)
    assert "optim/sparse:\n  adagrad\n  adam\n" in ours_long and "schema" not in ours_long
