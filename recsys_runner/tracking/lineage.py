"""Where a run came from and what it produced: the reproducibility manifest and checkpoint lookup.

Every entry point (training, evaluate, predict, export) records a **manifest**: the code version
(git commit of the source tree recsys_runner runs from, whether it was dirty, the diff when it was),
library versions, hardware, world size, host and the exact command line. It goes to the MLflow run
as ``manifest.*`` tags (plus MLflow's standard ``mlflow.source.*`` tags: the command's module, the git commit, branch
and ``origin`` URL, which the UI shows as the run's source) and as
one ``manifest.json`` artifact, because runs are created through ``MlflowClient`` and so get none
of MLflow's automatic source tags. Months later, ``python -m recsys_runner.compare`` can list the
columns beside the metrics.

A training run also tags where its checkpoints are (``checkpoint_dir``), so later commands accept
an MLflow run id wherever they take a checkpoint (:func:`resolve_checkpoint`).
"""

from __future__ import annotations

import json
import logging
import platform
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import torch

from recsys_runner import provenance, uris
from recsys_runner.checkpoint.object_storage import storage_for
from recsys_runner.checkpoint.storage import RUN_DIR_FOLDER, STEP_DIR, CheckpointStorage, step_of
from recsys_runner.errors import CheckpointError
from recsys_runner.tracking.store import failure, is_remote, missing_store, no_http_retries, resolve_uri, uri_source

log = logging.getLogger(__name__)

CHECKPOINT_DIR_TAG = "checkpoint_dir"
"""Tag on a training run: the absolute directory its checkpoints were written to."""
MANIFEST_FILE = "manifest.json"
DIFF_FILE = "git_diff.patch"
_PACKAGES = {"torch": "torch", "torchrec": "torchrec", "fbgemm": "fbgemm_gpu", "hydra": "hydra-core", "mlflow": "mlflow",
             "recsys_runner": "recsys_runner"}
_FBGEMM_DISTRIBUTIONS = ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly", "fbgemm-gpu-genai")


@dataclass
class Manifest:
    """What it takes to reproduce a run; see the module docstring. Serialised as ``manifest.json``."""

    command: str
    """The exact command line, as a user would type it (``python -m recsys_runner.<entry> …``)."""
    git_commit: str | None
    """Commit of the source tree recsys_runner was imported from; ``None`` for an installed wheel."""
    git_dirty: bool | None
    """Whether that tree had uncommitted changes (then the diff is logged as ``git_diff.patch``)."""
    versions: dict[str, str]
    """``python``, ``torch``, ``torchrec``, ``fbgemm``, ``hydra``, ``mlflow``, ``recsys_runner`` (``missing`` if absent)."""
    device_type: str
    device_name: str
    device_count: int
    """Accelerators visible to this process (0 on a CPU-only host)."""
    world_size: int
    hostname: str
    num_threads: int
    """torch's intra-op threads (``distributed.num_threads``; ``auto`` depends on the machine's load at start, and
    CPU reductions may round differently with another count)."""
    git_diff: str = field(default="", repr=False)
    """The uncommitted changes (``git diff HEAD``); logged as an artifact, not as a tag."""
    git_branch: str | None = None
    """The branch checked out in that tree; ``None`` on a detached head or outside git."""
    git_repo_url: str | None = None
    """The tree's ``origin`` remote, without any credentials in it; ``None`` when it has none."""

    def tags(self, source_name: str = "recsys_runner") -> dict[str, str]:
        """The ``manifest.*`` tags, and MLflow's standard source tags, which its UI shows in the runs table's Source
        column (``mlflow.source.name``: the command's module, ``source_name``; ``LOCAL``) and on a run's page (the commit,
        linked to the repository when ``mlflow.source.git.repoURL`` names one it knows, and the branch)."""
        out = {
            "manifest.command": self.command[:5000],
            "manifest.git_commit": self.git_commit or "unknown",
            "manifest.git_dirty": "unknown" if self.git_dirty is None else str(self.git_dirty).lower(),
            "manifest.device": f"{self.device_type}:{self.device_name}",
            "manifest.device_count": str(self.device_count),
            "manifest.world_size": str(self.world_size),
            "manifest.num_threads": str(self.num_threads),
            "manifest.hostname": self.hostname,
        }
        out.update({f"manifest.version.{name}": version for name, version in self.versions.items()})
        out |= {"mlflow.source.name": source_name, "mlflow.source.type": "LOCAL"}
        known = {"mlflow.source.git.commit": self.git_commit, "mlflow.source.git.branch": self.git_branch,
                 "mlflow.source.git.repoURL": self.git_repo_url}
        out |= {key: value for key, value in known.items() if value}
        return out

    def to_json(self) -> str:
        record = asdict(self)
        record.pop("git_diff")
        return json.dumps(record, indent=2, sort_keys=True)


def collect(*, world_size: int, device: torch.device, argv: list[str] | None = None) -> Manifest:
    """The manifest of this process (rank 0's view; every rank runs the same code by construction)."""
    source = provenance.SOURCE_ROOT
    commit, dirty, diff = _git_state(source)
    branch, repo_url = _git_origin(source) if commit else (None, None)
    name, count = _device(device)
    return Manifest(command=command_line(argv), git_commit=commit, git_dirty=dirty, versions=_versions(),
                    device_type=device.type, device_name=name, device_count=count, world_size=world_size,
                    hostname=socket.gethostname(), num_threads=torch.get_num_threads(), git_diff=diff, git_branch=branch,
                    git_repo_url=repo_url)


def record(tracker: Any, manifest: Manifest) -> None:
    """Log ``manifest.json`` to the tracker's run, and the diff when the tree was dirty. The tags go in with the
    run's creation (``tracker.start(tags=… | manifest.tags())``): one store call instead of one per tag."""
    tracker.log_text(manifest.to_json(), MANIFEST_FILE)
    if manifest.git_diff:
        tracker.log_text(manifest.git_diff, DIFF_FILE)


def command_line(argv: list[str] | None = None) -> str:
    """``sys.argv`` as the command a user typed: ``python -m <module> …`` for a module run, quoted for a shell."""
    args = list(sys.argv if argv is None else argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)  # None when run as a script or in an interactive session
    if argv is None and spec is not None and spec.name:
        module = spec.name.removesuffix(".__main__")
        return shlex.join(["python", "-m", module, *args[1:]])
    return shlex.join(["python", *args] if argv is None else args)


def _git_state(source: Path) -> tuple[str | None, bool | None, str]:
    """(commit, dirty, diff) of the git checkout whose top is ``source``; ``(None, None, "")`` for none (an installed
    wheel) or without git. Commit and dirtiness are the ones a checkpoint records as written_by
    (:func:`recsys_runner.provenance.source_state`), read once per process for the package's own tree."""
    state = provenance.running_source() if source == provenance.SOURCE_ROOT else provenance.source_state(source)
    if state.commit is None or not state.dirty:
        return state.commit, state.dirty, ""
    try:
        diff = subprocess.run(["git", "-C", str(source), "diff", "HEAD"], capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        diff = ""
    return state.commit, True, diff


def _git_origin(source: Path) -> tuple[str | None, str | None]:
    """(branch, ``origin``'s URL) of the git tree holding ``source``: ``None`` for a detached head, for no ``origin``.
    A URL's user and password (a token in ``https://user:token@host/…``) are dropped: tags are readable by anyone with
    the store."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(source), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return (done.stdout.strip() or None) if done.returncode == 0 else None

    branch = git("rev-parse", "--abbrev-ref", "HEAD")
    url = git("remote", "get-url", "origin")
    if url is not None and "://" in url:
        parts = urlsplit(url)
        url = urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else ""))) if parts.hostname else url
    return (None if branch == "HEAD" else branch), url


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name, distribution in _PACKAGES.items():
        candidates = _FBGEMM_DISTRIBUTIONS if name == "fbgemm" else (distribution,)
        out[name] = next((v for d in candidates if (v := _version(d)) is not None), "missing")
    return out


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _device(device: torch.device) -> tuple[str, int]:
    """(name, count) of this process's device kind: the GPU model, or the CPU's."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device), torch.cuda.device_count()
    return _cpu_model() or platform.processor() or platform.machine() or "cpu", 0


def _cpu_model() -> str | None:
    """The CPU's model name on Linux (``platform.processor()`` only says ``x86_64`` there)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class Located:
    """What :func:`locate_checkpoint` found: the checkpoint to load, and the newer ones passed over on the way."""

    path: Path
    skipped: tuple[tuple[Path, str], ...] = ()
    """(checkpoint, why) of each newer one of the kind looked for (best, else step) that cannot be loaded (incomplete,
    damaged), newest first: ``load=<root>`` then uses an older one, which scores differently, so it is said."""

    def fallback_note(self) -> str | None:
        """The warning that says an older checkpoint is used than the root's newest, or ``None``."""
        if not self.skipped:
            return None
        passed = "; ".join(f"{p.name} ({why})" for p, why in self.skipped)
        return (f"load={self.path.parent}: skipped {passed}, incomplete or damaged (copied part-way, a deleted file, or still "
                f"being written); loading {self.path.name}, the newest complete one there, instead. Its weights are older: "
                f"what it scores is not the newest checkpoint's. Fix: copy the skipped one again whole, or load= the one "
                f"you mean")


_RUN_ID = re.compile(r"[0-9a-f]{32}")
"""An MLflow run id (32 lowercase hex digits): one given without a store to look it up in is said to be one (it was
"neither a directory nor a known MLflow run id", as if the id were wrong)."""


@dataclass(frozen=True)
class RunTags:
    """The MLflow store at ``uri``, read for a run's tags: how ``load=`` and ``checkpoint.init_from=`` find the checkpoints
    of a run id (:func:`run_checkpoints`). Made by :func:`run_tags`."""

    uri: str
    source: str = "tracking.uri"
    """Where ``uri`` came from, for messages (:func:`~recsys_runner.tracking.store.uri_source`)."""

    def read(self, run_id: str, key: str) -> Mapping[str, str]:
        """The tags of run ``run_id``. Raises :class:`CheckpointError` naming ``key=run_id``, the store and the fix when the
        store is not there (a sqlite file or folder that does not exist: never created to look in), has no such run, or
        does not answer (a server down: asked once, without MLflow's minutes of retries)."""
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        given, store = f"{key}={run_id} is", f"the MLflow store {self.uri} ({self.source})"
        fix = f"tracking.uri=<the store the training run logged to>, or {key}=<its checkpoint directory>"
        if (missing := missing_store(self.uri)) is not None:
            raise CheckpointError(f"{given} no checkpoint directory, and {store} to look it up in as a run id is not there: "
                                  f"{missing}. Fix: {fix}")
        try:
            with no_http_retries(is_remote(self.uri)):
                return dict(MlflowClient(tracking_uri=self.uri).get_run(run_id).data.tags)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise CheckpointError(f"{given} neither a checkpoint directory nor a run in {store}. Fix: {fix}") from None
            raise CheckpointError(f"{given} no checkpoint directory, and {store}, which would know it as a run id, did not "
                                  f"answer ({failure(e)}). Fix: start the store, or {fix}") from None


def run_checkpoints(spec: str, runs: RunTags | None, *, key: str = "load") -> Path | None:
    """The checkpoints root of the MLflow run ``spec`` names (its ``checkpoint_dir`` tag, as read from ``runs``); ``None``
    when ``spec`` is a path: one that exists, or holds a ``/``. The one place a run id is told from a path and looked up,
    for ``load=`` (:func:`locate_checkpoint`) and ``checkpoint.init_from=`` (:func:`recsys_runner.build.build`); ``key``
    names the setting in the errors: a run id without a store (``runs`` ``None``: ``tracking=none``), and those of
    :meth:`RunTags.read`, a run without the tag or whose checkpoints are gone."""
    if _exists(uris.as_path(spec)) or "/" in spec:
        return None
    if runs is None:
        if _RUN_ID.fullmatch(spec):
            raise CheckpointError(f"{key}={spec} looks like an MLflow run id, but this command has no MLflow store to look it "
                                  f"up in (tracking=none). Fix: drop tracking=none (the run is looked up at tracking.uri, by "
                                  f"default ./mlflow.db, or the store the training logged to: tracking.uri=<it>), or {key}=<the "
                                  f"run's checkpoint directory>")
        return None
    tags = runs.read(spec, key)
    if CHECKPOINT_DIR_TAG not in tags:
        raise CheckpointError(f"MLflow run {spec} in {runs.uri} ({runs.source}) has no {CHECKPOINT_DIR_TAG!r} tag (it saved no "
                              f"checkpoints, or was made by an older recsys_runner); pass the checkpoint directory instead: "
                              f"{key}=<path>")
    path = uris.as_path(tags[CHECKPOINT_DIR_TAG])
    if not _exists(path):
        raise CheckpointError(f"MLflow run {spec} in {runs.uri} ({runs.source}) wrote its checkpoints to {path}, which does not "
                              f"exist on this machine; copy them here and pass {key}=<path>")
    return path


def resolve_checkpoint(spec: str, *, lookup_run: RunTags | None = None) -> Path:
    """:func:`locate_checkpoint`'s checkpoint, with a warning naming the newer ones skipped on the way. Called once per
    command (:func:`recsys_runner.inference.checkpoint_to_load`); a second look-up of the same ``spec`` uses
    :func:`locate_checkpoint`, which says nothing, so the warning comes once."""
    found = locate_checkpoint(spec, lookup_run=lookup_run)
    if (note := found.fallback_note()) is not None:
        log.warning("%s", note)
    return found.path


def locate_checkpoint(spec: str, *, lookup_run: RunTags | None = None) -> Located:
    """The checkpoint directory ``spec`` names: a ``step_*`` directory, a checkpoints root (its newest complete best
    checkpoint if one was kept, else its newest complete one; those newer and incomplete are :attr:`Located.skipped`), or an
    MLflow run id whose ``checkpoint_dir`` tag gives the root (read from ``lookup_run``, :func:`run_checkpoints`).
    Raises :class:`CheckpointError` naming what was looked for and where, and the ``load=`` that works where one is at
    hand (:func:`_nothing_to_load`)."""
    path = run_checkpoints(spec, lookup_run) or uris.as_path(spec)
    if not _exists(path):
        raise CheckpointError(f"checkpoint {spec!r} is neither a directory nor a known MLflow run id; pass a step_* checkpoint "
                              f"directory, a checkpoints root, or the training run's id")
    storage = storage_for(path)
    if storage.is_complete(path):
        _refuse_newer(storage, path)
        return Located(path)
    skipped: list[tuple[Path, str]] = []
    for kind in (storage.checkpoints(path, best=True, complete=False), storage.checkpoints(path, complete=False)):
        for candidate in reversed(kind):
            if storage.is_complete(candidate):  # a file missing inside it is found, and refused, by the loader
                _refuse_newer(storage, candidate)
                return Located(candidate, tuple(skipped))
            skipped.append((candidate, storage.damage(candidate) or "incomplete"))
    raise CheckpointError(_nothing_to_load(storage, path))


def _refuse_newer(storage: CheckpointStorage, path: Path) -> None:
    """Refuse ``load=``'s checkpoint here, before anything is built, when a later recsys_runner wrote it in a format this
    one does not know (the storage's ``read_meta`` checks it); a ``meta.json`` that does not parse is left to the loader,
    which names it as damage."""
    try:
        storage.read_meta(path)
    except CheckpointError:
        raise
    except (OSError, ValueError):
        return


def _nothing_to_load(storage: CheckpointStorage, path: Path) -> str:
    """Why ``path`` (``load=``'s) holds no complete checkpoint, and the ``load=`` to use instead: for a step folder that
    lacks a file, the newest complete checkpoint beside it; for a training run's directory, its checkpoints folder."""
    if STEP_DIR.match(path.name):
        beside = sorted((p for p in [*storage.checkpoints(path.parent), *storage.checkpoints(path.parent, best=True)] if p != path),
                        key=step_of)
        fix = (f"load={beside[-1]} (the newest complete checkpoint beside it, step {step_of(beside[-1])})" if beside
               else "load= a copy of this checkpoint kept elsewhere (no complete one is beside it)")
        return (f"{path} is an incomplete checkpoint ({storage.damage(path) or 'meta.json or .metadata is missing'}): damaged, "
                f"or copied part-way (a run writes meta.json last, once the rest is whole). Fix: {fix}, or copy it "
                f"again whole")
    inside = path / RUN_DIR_FOLDER
    best = storage.checkpoints(inside, best=True)
    if found := best or storage.checkpoints(inside):
        return (f"{path} holds no checkpoint, but its {RUN_DIR_FOLDER}/ folder does: it is a training run's directory, whose "
                f"checkpoints are in <run dir>/{RUN_DIR_FOLDER}. Fix: load={inside} (its {'best' if best else 'newest'} "
                f"checkpoint, {found[-1].name})")
    if partial := sorted([*storage.checkpoints(path, complete=False), *storage.checkpoints(path, best=True, complete=False)], key=step_of):
        names = ", ".join(p.name for p in partial)
        return (f"{path} holds no complete checkpoint: its step folders ({names}) are incomplete ({partial[-1].name}: "
                f"{storage.damage(partial[-1])}), damaged or copied part-way. Fix: copy them again whole, or point load= at a "
                f"checkpoint kept elsewhere")
    if jobs := _jobs_checkpoints(storage, path):
        listed = "\n  ".join(f"load={folder}" for folder in jobs)
        return (f"{path} holds no checkpoint: it is a multirun's directory, whose jobs each keep theirs in <job>/"
                f"{RUN_DIR_FOLDER}. Fix: load= one job's, e.g.\n  {listed}")
    return (f"{path} holds no complete checkpoint (a step_* or best-step_* directory with meta.json and .metadata); point "
            f"load= at one")


_MAX_LISTED_JOBS = 20
"""How many jobs' checkpoints folders :func:`_jobs_checkpoints` lists (a sweep may have hundreds)."""


def _jobs_checkpoints(storage: CheckpointStorage, path: Path) -> list[Path]:
    """The ``<job>/checkpoints`` folders holding a checkpoint under ``path``, a multirun's directory (Hydra numbers its jobs'
    folders ``0``, ``1``, … with the default ``hydra.sweep.subdir``); at most :data:`_MAX_LISTED_JOBS`."""
    found: list[Path] = []
    job = 0
    while len(found) < _MAX_LISTED_JOBS and storage.exists(path / str(job)):
        folder = path / str(job) / RUN_DIR_FOLDER
        if storage.checkpoints(folder) or storage.checkpoints(folder, best=True):
            found.append(folder)
        job += 1
    return found


def _exists(path: Path) -> bool:
    return storage_for(path).exists(path)


def run_tags(uri: str | None) -> RunTags:
    """The run lookup of :func:`locate_checkpoint` and :func:`run_checkpoints` in the MLflow store ``tracking.uri`` names
    (``uri``; ``None``: ``$MLFLOW_TRACKING_URI``, else ``./mlflow.db``, :func:`~recsys_runner.tracking.store.resolve_uri`)."""
    return RunTags(resolve_uri(uri), uri_source(uri))
