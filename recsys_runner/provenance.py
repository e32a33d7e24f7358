"""Which code wrote an artifact: this package's version, the git commit of the source tree it was imported from, and
whether that tree had uncommitted changes (:func:`written_by`), recorded as ``written_by`` in a checkpoint's
``meta.json`` and an MLflow model's ``serving.json``; and the one line a command logs when it reads an artifact another
code wrote (:func:`note_other_code`).

Why: a project that upgrades recsys_runner mid-way holds checkpoints of several versions, and a resumed run, an
evaluation or a fine-tune that differs from what the checkpoint's own code gave should be traceable to the code that
wrote it. ``format`` says whether a checkpoint can be read; this says by whom it was written.

The commit comes from one ``git status`` call with a short timeout, made once per process and only when the package sits
at the top of a git checkout (a ``.git`` beside the package folder): an installed wheel records ``None``, as does a
machine without git or a call that fails or times out. Nothing here raises. Imports only the standard library.
"""

from __future__ import annotations

import functools
import logging
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recsys_runner import __version__

log = logging.getLogger(__name__)

KEY = "written_by"
"""The key of an artifact's metadata (``meta.json``, ``serving.json``) holding :func:`written_by`'s record."""
GIT_TIMEOUT_S = 5.0
"""How long the one ``git`` call may take: ~10 ms on a checkout, but its first call after a clone refreshes the index
(a stat of every file), slow on a loaded CI machine or a network disk; past it the commit is recorded as unknown."""
SOURCE_ROOT = Path(__file__).resolve().parent.parent
"""Where the package was imported from: a checkout's top (holding ``.git``) or ``site-packages``."""


@dataclass(frozen=True)
class Source:
    """The git state of a source tree; ``None`` fields when it is none (or git cannot say)."""

    commit: str | None = None
    """The commit checked out (40 hex digits)."""
    dirty: bool | None = None
    """Whether tracked files differ from it (untracked files are not counted)."""
    branch: str | None = None
    """The branch checked out; ``None`` on a detached head."""


def source_state(root: Path, timeout_s: float = GIT_TIMEOUT_S) -> Source:
    """The git state of the checkout whose top is ``root``, by one ``git status`` call (``--porcelain=v2 --branch`` prints
    the commit and the branch beside the changed files); ``Source()`` when ``root`` holds no ``.git`` (a wheel installed in
    ``site-packages``, even one inside another project's checkout), git is missing, fails or takes over ``timeout_s``."""
    if not (root / ".git").exists():
        return Source()
    try:
        done = subprocess.run(["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain=v2", "--branch",
                               "--untracked-files=no"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return Source()
    if done.returncode != 0:
        return Source()
    lines = done.stdout.splitlines()
    headers = {name: value for name, _, value in (line[2:].partition(" ") for line in lines if line.startswith("# "))}
    commit = headers.get("branch.oid")
    if commit is None or commit == "(initial)":  # a repository without a commit yet
        return Source()
    branch = headers.get("branch.head")
    dirty = any(line and not line.startswith("# ") for line in lines)  # a changed file's line: "1 .M …", "2 R. …", "u …"
    return Source(commit, dirty, None if branch in (None, "(detached)") else branch)


@functools.cache
def running_source() -> Source:
    """:func:`source_state` of the tree this package was imported from, computed once per process."""
    return source_state(SOURCE_ROOT)


def written_by() -> dict[str, Any]:
    """The record of the running code: ``{"version": "0.1.0", "commit": "<40 hex>" | None, "dirty": bool | None}``."""
    source = running_source()
    return {"version": __version__, "commit": source.commit, "dirty": source.dirty}


@dataclass(frozen=True)
class WrittenBy:
    """A ``written_by`` record as read back (any field may be missing from a file edited by hand)."""

    version: str | None
    commit: str | None
    dirty: bool | None

    @classmethod
    def of(cls, record: Any) -> WrittenBy | None:
        """The record in ``record`` (``meta[KEY]``); ``None`` when there is none (an artifact written before it was)."""
        if not isinstance(record, Mapping):
            return None
        dirty = record.get("dirty")
        return cls(_text(record.get("version")), _text(record.get("commit")), dirty if isinstance(dirty, bool) else None)

    def describe(self) -> str:
        """``recsys_runner 0.1.0 at commit 90ce50f4880b (with uncommitted changes)``; an unknown commit is not named."""
        at = f" at commit {self.commit[:12]}" if self.commit else " (commit unknown: not run from a git checkout)"
        return f"recsys_runner {self.version or '?'}{at}{' with uncommitted changes' if self.dirty else ''}"

    def same_code(self, other: WrittenBy) -> bool:
        """Whether the two are known to be one code, or cannot be told apart: one version, and where both commits are
        known, one commit with the same dirtiness. Two trees dirty over one commit cannot be compared (their changes are not
        recorded): taken as the same, so a developer's every resume does not say it."""
        if self.version != other.version:
            return False
        if self.commit is None or other.commit is None:
            return True
        return self.commit == other.commit and self.dirty == other.dirty


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def other_code(meta: Mapping[str, Any]) -> str | None:
    """``"<what wrote it>; this is <the running code>"`` when the artifact whose metadata is ``meta`` was written by other
    code than the running one (or before its writer was recorded); ``None`` for the same code."""
    now = WrittenBy.of(written_by())
    assert now is not None
    saved = WrittenBy.of(meta.get(KEY))
    if saved is None:
        return f"an older recsys_runner, which did not record its code (before {KEY} was saved); this is {now.describe()}"
    if saved.same_code(now):
        return None
    return f"{saved.describe()}; this is {now.describe()}"


def note_other_code(what: str, meta: Mapping[str, Any]) -> None:
    """Log one line when ``what`` (``checkpoint <path>``), whose metadata is ``meta``, was written by other code than the
    running one: a result that differs from the one that code gave can then be traced to the change. Same code: nothing."""
    differs = other_code(meta)
    if differs is not None:
        log.info("%s was written by %s", what, differs)
