"""Every training command README.md and docs/*.md show is one a newcomer can paste: it parses in the shell and in
Hydra's override grammar, and (unless it elides part with ``…``) composes and validates as the CLI would.

Commands are the ``python -m recsys_runner …`` and ``torchrun … -m recsys_runner …`` lines of the ``bash`` blocks (a
trailing backslash joins the next line) and the inline ones in backticks. A multirun's comma lists are cut to their
first value (one job of the sweep); commands with a ``<placeholder>`` or another config dir are left out. What the
commands do when run is the business of the tests of each feature; this catches a doc that drifted from the config:
a renamed key, an override the shell splits (an unquoted ``{a: b}``), a value Hydra cannot parse (a newline inside
quotes).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from recsys_runner.config import register_configs, validate
from recsys_runner.paths import CONFIG_PATH
from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ELIDED = ("…", "...")
# docs/lifecycle.md sets DATA once and uses $DATA in the commands after it
SHELL_VARIABLES = {"$DATA": "data=parquet data.path=data/day_0.parquet"}
# commands for a GPU machine that leave the device to distributed.device=auto (CUDA there): checked as on CUDA
ON_A_GPU = {"launch.md:19"}
ENTRY = re.compile(r"(?:python -m|torchrun\b.*?-m) recsys_runner(?=\s|$)(.*)")


def _commands(path: Path) -> list[tuple[str, str]]:
    """``(where, command)`` for each training command of ``path``: ``where`` is ``file:line``."""
    found: list[tuple[str, str]] = []
    lines = path.read_text().split("\n")
    block: str | None = None
    i = 0
    while i < len(lines):
        line, start = lines[i], i + 1
        if line.startswith("```"):
            block = None if block is not None else line[3:].strip()
        elif block == "bash":
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            found.append((f"{path.name}:{start}", line))
        elif block is None:
            found += [(f"{path.name}:{start}", m.group(1)) for m in re.finditer(r"`([^`]*recsys_runner[^`]*)`", line)]
        i += 1
    return [(where, text) for where, text in found if ENTRY.search(text)]


def _cases() -> list[tuple[str, str]]:
    cases = []
    for path in DOCS:
        for where, text in _commands(path):
            rest = ENTRY.search(text)
            assert rest is not None
            arguments = re.split(r"\s#", rest.group(1))[0]  # a shell comment ends the command
            if re.search(r"<|(^|\s)\[|--config-dir|--help", arguments):  # a placeholder, a usage form, another config dir
                continue
            cases.append((where, arguments))
    return cases


CASES = _cases()


def test_the_docs_show_training_commands() -> None:
    assert len(CASES) > 80, "the extraction found too few commands: did the docs' layout change?"


@pytest.fixture(scope="module")
def hydra_initialized() -> Iterator[None]:
    """Hydra initialized once for the module's hundred compositions (initializing costs as much as composing)."""
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        yield


@pytest.mark.parametrize(("where", "arguments"), CASES, ids=[where for where, _ in CASES])
def test_a_documented_command_composes(hydra_initialized: None, where: str, arguments: str) -> None:
    for variable, value in SHELL_VARIABLES.items():
        arguments = arguments.replace(variable, value)
    try:
        words = shlex.split(arguments)
    except ValueError as e:
        pytest.fail(f"{where}: the shell cannot split {arguments!r}: {e}")
    multirun = "-m" in words or "--multirun" in words
    overrides = []
    for word in words:
        if word in ("-m", "--multirun", "--cfg", "job", "hydra", "-p") or any(mark in word for mark in ELIDED):
            continue  # an elided word (`…`, or a list ending in `, …]`) is not meant to be pasted as it is
        key, _, value = word.partition("=")
        if key.startswith(("hydra/launcher", "hydra.launcher", "hydra.sweeper")):
            continue  # the launcher's and sweeper's keys exist only in a multirun's Hydra config
        if multirun and "," in value and not value.startswith(("[", "{", "'", '"')):
            word = f"{key}={value.split(',')[0]}"  # one job of the sweep
        overrides.append(word)
    if where in ON_A_GPU:
        overrides.append("distributed.device=cuda")
    cfg = compose(config_name="config", overrides=overrides)
    # an elided command may lack a required key (data.path); --cfg job prints the config without validating it
    if not any(mark in arguments for mark in ELIDED) and "--cfg" not in words:
        validate(cfg)
