"""The one run lifecycle every command shares: train, evaluate, predict and export.

Modelled on lightning-hydra-template's ``task_wrapper``: each entry point wraps its work once, in
:func:`tracked_run` (open or continue the MLflow run with its tags, params, ``config.yaml`` and the reproducibility
manifest; set ``FINISHED``, ``FAILED`` or ``KILLED`` on every exit; then release what the run holds) inside
:func:`exit_codes` (a user error prints its one line and exits 2, an interrupted training prints how to resume and
exits ``128 + signal``, a non-finite loss exits 1). Nothing else starts or ends an MLflow run.

May import ``build``'s rooms (``train``, ``tracking``) and the shared modules; only entry points import it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from recsys_runner.checkpoint.guard import NonFiniteLossError
from recsys_runner.errors import reported
from recsys_runner.runtime import Launch
from recsys_runner.tracking import lineage
from recsys_runner.tracking.tracker import Tracker
from recsys_runner.train.signals import Interrupted

log = logging.getLogger("recsys_runner")

ENTRY_TAG, SOURCE_RUN_TAG, CHECKPOINT_TAG, CHECKPOINT_STEP_TAG = "entry", "source_run_id", "checkpoint", "checkpoint_step"
OVERRIDES_TAG = "hydra.overrides"


@dataclass
class RunStart:
    """How a command's MLflow run begins: what a new run records, or the run a resumed training continues."""

    run_name: str
    tags: dict[str, str] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    """Text artifacts of a new run, ``{artifact file: text}`` (``config.yaml``, ``sharding_plan.txt``)."""
    continue_run: str | None = None
    """A checkpoint's MLflow run id: a resumed training continues that run (a new one if this store lacks it)."""
    world_size: int = 1
    device: torch.device | None = None
    """Where the command runs, for the manifest (``None``: no manifest, e.g. a rank other than 0)."""
    step: int = 0
    """The step a continued run resumes at (names its ``manifest_resume_step<n>.json``)."""
    manifest: lineage.Manifest | None = None
    """The manifest, when the command collected it already (export writes it beside its files); else collected here."""


def link_tags(entry: str, checkpoint: Path, step: int | None, source_run: str | None) -> dict[str, str]:
    """The tags that say which checkpoint a run used and nest it under the training run that wrote it."""
    tags = {ENTRY_TAG: entry, CHECKPOINT_TAG: str(checkpoint.absolute()), CHECKPOINT_STEP_TAG: str(step)}
    if source_run:
        tags |= {SOURCE_RUN_TAG: source_run, "mlflow.parentRunId": source_run}
    return tags


@contextlib.contextmanager
def tracked_run(tracker: Tracker, start: RunStart, launch: Launch, *, close: Callable[[], None] | None = None) -> Iterator[None]:
    """Open (or continue) the run ``start`` describes on ``tracker``; on exit set its status and call ``close``.

    ``FINISHED`` when the body returns, ``KILLED`` on Ctrl-C or a signal (a preempted job is tagged ``preempted`` so
    its requeued relaunch is recognised), ``FAILED`` on any other exception, which propagates.
    """
    status = "FAILED"
    try:
        _open(tracker, start, launch)
        yield
        status = "FINISHED"
    except (KeyboardInterrupt, Interrupted) as e:
        status = "KILLED"
        if getattr(e, "preempted", False):
            tracker.set_tag("preempted", "true")  # submitit requeues it; the relaunch resumes this run
        raise
    finally:
        tracker.finish(status)
        if close is not None:
            close()


def _open(tracker: Tracker, start: RunStart, launch: Launch) -> None:
    """Continue ``start.continue_run`` if the store has it, else start a new run with its tags, params and texts."""
    manifest = start.manifest
    if manifest is None and start.device is not None:
        manifest = lineage.collect(world_size=start.world_size, device=start.device)
    if start.continue_run and _continued(tracker, start.continue_run):
        if manifest is not None:  # the run's manifest.json stays the first launch's; each resume adds its own
            tracker.log_text(manifest.to_json(), f"manifest_resume_step{start.step}.json")
        return
    tags = start.tags | {OVERRIDES_TAG: " ".join(launch.overrides), "world_size": str(start.world_size)}
    if manifest is not None:
        tags |= manifest.tags()
    tracker.start(run_name=start.run_name, tags=tags, params=start.params)
    for artifact_file, text in start.texts.items():
        tracker.log_text(text, artifact_file)
    if manifest is not None:
        lineage.record(tracker, manifest)


def _continued(tracker: Tracker, run_id: str) -> bool:
    """Continue the checkpoint's MLflow run; ``False`` (start a new one) if this store lacks it."""
    try:
        tracker.resume(run_id)
        return True
    except Exception as e:  # a different tracking store, or the run was deleted
        log.warning("cannot continue MLflow run %s (%s); starting a new run", run_id, e)
        return False


@contextlib.contextmanager
def exit_codes(launch: Launch) -> Iterator[None]:
    """Every command's exit: a user error is one line and status 2 (:func:`recsys_runner.errors.reported`); an
    interrupted training prints how to resume (or hands a preempted job to submitit) and exits ``128 + signal``;
    a non-finite loss prints the last good checkpoint and exits 1."""
    try:
        with reported():
            yield
    except Interrupted as e:
        print(f"Interrupted: {e}", file=sys.stderr)
        if e.handover is not None:  # preempted inside submitit: its handler resubmits this job and requeues it
            print("Preempted: handing over to submitit to requeue this job", file=sys.stderr)
            e.handover()
        else:
            print(resume_hint(launch, e.checkpoint), file=sys.stderr)
        sys.exit(e.exit_code)
    except NonFiniteLossError as e:
        print(f"Training failed: {e}", file=sys.stderr)
        if e.checkpoint is not None:
            print(resume_hint(launch, e.checkpoint, after_fix=True), file=sys.stderr)
        sys.exit(1)


def resume_hint(launch: Launch, checkpoint: str | None, after_fix: bool = False) -> str:
    """The lines telling how to continue from ``checkpoint`` (a ``step_*`` directory), for stderr;
    ``after_fix``: the command is to be changed first (a NaN loss would only recur)."""
    if checkpoint is None:
        return "Nothing to resume from: no checkpoint was written (set checkpoint.dir or checkpoint.every_steps)."
    command = launch.resume_command(Path(checkpoint).parent)
    if command is None:
        return f"Resume from {checkpoint} with checkpoint.dir={Path(checkpoint).parent.absolute()} (same MLflow run)."
    how = "this command with your change made" if after_fix else "this command"
    return f"Resume this run from {Path(checkpoint).name}, into the same MLflow run, with {how}:\n  {command}"
