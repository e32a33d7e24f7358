"""Which code wrote an artifact (recsys_runner/provenance.py): a checkpoint's ``meta.json`` records ``written_by``; a
resume, an evaluate and an ``init_from`` of a checkpoint other code wrote say so in one line, the same code says nothing;
no git (or no checkout) records nulls without an error."""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import DictConfig

from recsys_runner import __version__, evaluate, provenance
from recsys_runner.__main__ import run
from recsys_runner.checkpoint.storage import list_checkpoints
from tests.conftest import TINY
from tests.test_evaluate import compose_entry

HERE = provenance.Source("a" * 40, False, "main")
"""The running code, as these tests pin it (so they mean the same from a wheel, a dirty tree or a clean one)."""


@pytest.fixture
def running_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(provenance, "running_source", lambda: HERE)


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == provenance.__name__]


def _set_written_by(checkpoint: Path, **fields: object) -> None:
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta[provenance.KEY] |= fields
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def test_a_checkpoint_of_other_code_is_named_once_on_resume_evaluate_and_init_from(
        make_cfg: Callable[..., DictConfig], tmp_path: Path, running_here: None, caplog: pytest.LogCaptureFixture) -> None:
    """``meta.json`` records the running code; resuming it with the same code logs nothing; once its record names another
    commit, a resume, an evaluate (``load=``) and an ``init_from`` each log one line naming both, the dirty tree said."""
    caplog.set_level(logging.INFO, logger=provenance.__name__)
    args = ("checkpoint.every_steps=2", f"checkpoint.dir={tmp_path}/ck", "tracking=none", "train.sanity_eval_batches=0")
    run(make_cfg("train.num_steps=2", *args))
    (first,) = list_checkpoints(tmp_path / "ck")
    assert json.loads((first / "meta.json").read_text())[provenance.KEY] == {"version": __version__, "commit": "a" * 40, "dirty": False}
    run(make_cfg("train.num_steps=4", *args))
    assert _lines(caplog) == []  # the same code: nothing
    second = list_checkpoints(tmp_path / "ck")[-1]
    _set_written_by(second, commit="b" * 40, dirty=True)
    other = (f"checkpoint {second} was written by recsys_runner {__version__} at commit {'b' * 12} with uncommitted changes; "
             f"this is recsys_runner {__version__} at commit {'a' * 12}")
    run(make_cfg("train.num_steps=6", *args))
    assert _lines(caplog) == [other]
    caplog.clear()
    evaluate.run(compose_entry("evaluate", *TINY, "tracking=none", f"load={second}"))
    assert _lines(caplog) == [other]
    caplog.clear()
    run(make_cfg("train.num_steps=2", "tracking=none", f"checkpoint.dir={tmp_path}/tuned", f"checkpoint.init_from={second}"))
    assert _lines(caplog) == [other]


@pytest.mark.parametrize(("saved", "line"), [
    ({"version": __version__, "commit": "a" * 40, "dirty": False}, None),
    ({"version": __version__, "commit": None, "dirty": None}, None),  # a wheel of this version: no commit to tell apart
    ({"version": __version__, "commit": "a" * 40, "dirty": True},
     f"recsys_runner {__version__} at commit {'a' * 12} with uncommitted changes; this is recsys_runner {__version__} at commit {'a' * 12}"),
    ({"version": "0.0.9", "commit": None, "dirty": None},
     f"recsys_runner 0.0.9 (commit unknown: not run from a git checkout); this is recsys_runner {__version__} at commit {'a' * 12}"),
    (None, f"an older recsys_runner, which did not record its code (before written_by was saved); this is recsys_runner "
           f"{__version__} at commit {'a' * 12}"),
])
def test_other_code_is_another_version_commit_or_dirtiness(running_here: None, saved: object, line: str | None) -> None:
    assert provenance.other_code({} if saved is None else {provenance.KEY: saved}) == line


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True, capture_output=True)


def test_source_state_reads_commit_dirtiness_and_branch_of_a_checkouts_top(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q", "-b", "main")
    assert provenance.source_state(tmp_path) == provenance.Source()  # no commit yet
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "one")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert provenance.source_state(tmp_path) == provenance.Source(head, False, "main")
    (tmp_path / "untracked.py").write_text("")
    assert provenance.source_state(tmp_path).dirty is False
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert provenance.source_state(tmp_path) == provenance.Source(head, True, "main")
    # a folder inside a checkout is not one's top: a wheel installed in a project's .venv is not that project's code
    assert provenance.source_state(tmp_path / "pkg") == provenance.Source()


def test_without_git_or_a_checkout_the_record_is_null_and_nothing_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed as a wheel (no ``.git`` beside the package), on a machine without git, or with a git that hangs: nulls."""
    assert provenance.source_state(tmp_path) == provenance.Source()
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "one")
    assert provenance.source_state(tmp_path).commit is not None
    empty = tmp_path / "no-git"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert provenance.source_state(tmp_path) == provenance.Source()
    hangs = tmp_path / "hangs"
    hangs.mkdir()
    (hangs / "git").write_text("#!/bin/sh\nexec sleep 30\n")
    (hangs / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{hangs}:/usr/bin:/bin")
    assert provenance.source_state(tmp_path, timeout_s=0.2) == provenance.Source()
    monkeypatch.setattr(provenance, "SOURCE_ROOT", tmp_path / "site-packages")
    provenance.running_source.cache_clear()
    try:
        assert provenance.written_by() == {"version": __version__, "commit": None, "dirty": None}
    finally:
        provenance.running_source.cache_clear()
