"""The one run lifecycle every command shares: train, evaluate, predict and export.

Modelled on lightning-hydra-template's ``task_wrapper``: each entry point wraps its work once, in
:func:`tracked_run` (open or continue the MLflow run with its tags, params, ``config.yaml`` and the reproducibility
manifest; set ``FINISHED``, ``FAILED`` or ``KILLED`` on every exit; then release what the run holds) inside
:func:`exit_codes` (a user error prints its one line and exits 2, an interrupted command says what was kept and the
command that resumes or redoes it and exits ``128 + signal``, a non-finite loss exits 1, a rank whose peer was lost
exits 75). Nothing else starts or ends an MLflow run.

**Many jobs in one process.** A Hydra sweep's basic launcher, a notebook and the tests run job after job in one process:
each entry's ``run`` is :func:`one_job`, which frees what the job held once it returns or raises (its process group,
its model), rather than when Python's collector next happens to run.

**Signals, the same for every command.** :func:`exit_codes` holds SIGTERM, SIGINT and SIGUSR1 for the command's whole
run (:class:`~recsys_runner.train.signals.RaiseOnSignal`): one raises
:class:`~recsys_runner.train.signals.Interrupted` where the command is, its ``finally`` blocks run (predict and export
remove their partial files), :func:`tracked_run` ends the MLflow run ``KILLED``, and one line says that nothing was kept
and the command that redoes it, e.g. ``python -m recsys_runner.evaluate <overrides>``; exit ``128 + signal`` (143 for
SIGTERM, 130 for SIGINT). Training's loop takes the signals over (:class:`~recsys_runner.train.signals.StopSignals`):
the step, or the final eval, ends, the checkpoint is written and the command that resumes from it is printed.

**A lost rank.** When one rank of a multi-rank run dies (``kill -9``, an OOM kill, a lost node), the others fail in
their next collective. The loop turns that error into :class:`~recsys_runner.distributed.peers.RankLost` with the last
complete checkpoint; :func:`exit_codes` prints one line (``Rank lost: rank 1 of 2 stopped: a collective on rank 0 …``)
and the command that resumes, with no traceback, and exits
:data:`~recsys_runner.distributed.peers.EXIT_RANK_LOST` (75); the MLflow run ends ``FAILED`` (when rank 0, which
owns it, is the survivor). The SIGTERM torchrun sends the survivors next is only noted: the cause is the lost rank.

**An interrupted run in the default place.** With ``checkpoint.dir`` unset every CLI launch checkpoints into its own new
``<Hydra run dir>/checkpoints``, so relaunching the same command starts over. :func:`note_interrupted_runs` looks in the
sibling run directories for checkpoints of a launch with the same overrides that did not finish (no :data:`FINISHED_MARK`,
written by :func:`mark_finished`) and logs one line naming the newest and the command that resumes it; nothing is resumed
without being asked.

**A job preempted before its first checkpoint.** A training records its MLflow run in its checkpoint directory as the
run opens (:class:`RunRecord`); a relaunch that finds no checkpoint continues that run when it was preempted and nothing
would tell the two launches apart in it, else says why not in one line (:mod:`recsys_runner.tracking.requeue`).

May import ``build``'s rooms (``train``, ``tracking``) and the shared modules; only entry points import it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch

from recsys_runner import stores, uris
from recsys_runner.checkpoint.guard import NonFiniteLossError
from recsys_runner.checkpoint.storage import CheckpointStorage
from recsys_runner.collection import job_collected
from recsys_runner.distributed.peers import EXIT_RANK_LOST, RANK_LOST_LABEL, RankLost, peer_gone
from recsys_runner.errors import CheckpointError, CheckpointWriteFailed, UserError, fail, reported
from recsys_runner.runtime import TRAIN_MODULE, Launch
from recsys_runner.tracking import lineage, requeue
from recsys_runner.tracking.datasets import DataRecord
from recsys_runner.tracking.tracker import Tracker
from recsys_runner.train import signals
from recsys_runner.train.signals import Interrupted

log = logging.getLogger("recsys_runner")

P = ParamSpec("P")
R = TypeVar("R")

ENTRY_TAG, SOURCE_RUN_TAG, CHECKPOINT_TAG, CHECKPOINT_STEP_TAG = "entry", "source_run_id", "checkpoint", "checkpoint_step"
OVERRIDES_TAG = "hydra.overrides"
FINISHED_MARK = ".finished"
"""A file in a checkpoint directory whose training finished (:func:`mark_finished`): nothing there to resume."""


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
    datasets: list[DataRecord] = field(default_factory=list)
    """The data the command reads, logged as the run's dataset inputs (:mod:`recsys_runner.tracking.datasets`), by a new
    run and a continued one alike (MLflow keeps a dataset once)."""
    record: RunRecord | None = None
    """Where a training records its run for a relaunch of the job (rank 0, with a checkpoint directory); ``None``: nowhere."""


@dataclass(frozen=True)
class RunRecord:
    """A training's record of its MLflow run in its checkpoint directory (:mod:`recsys_runner.tracking.requeue`): written
    once the run is open, so that a relaunch of a job preempted before its first checkpoint continues the same run."""

    storage: CheckpointStorage
    directory: Path
    read: bool
    """Look for an earlier launch's record first: this launch resumed no checkpoint (``checkpoint.resume=auto`` found
    none), so a run that launch left is named nowhere else."""


def link_tags(entry: str, checkpoint: Path, step: int | None, source_run: str | None) -> dict[str, str]:
    """The tags that say which checkpoint a run used and nest it under the training run that wrote it."""
    tags = {ENTRY_TAG: entry, CHECKPOINT_TAG: str(checkpoint.absolute()), CHECKPOINT_STEP_TAG: str(step)}
    if source_run:
        tags |= {SOURCE_RUN_TAG: source_run, "mlflow.parentRunId": source_run}
    return tags


def one_job(run: Callable[P, R]) -> Callable[P, R]:
    """An entry's ``run(cfg, launch)`` (train, evaluate, predict, export: one job) that leaves nothing of the job behind
    in the process: what it left in reference cycles is collected once it returns or raises
    (:func:`~recsys_runner.collection.job_collected`).

    Why: TorchRec's sharded modules, their fused optimizers and sharded tensors hold each other in reference cycles, and
    through them the job's process group, destroyed but not freed: its gloo threads, sockets and pipes and the model's
    memory outlived the job until Python's collector next made a full pass, which a process that allocates little
    between jobs rarely makes. A process that runs many jobs (a Hydra sweep's basic launcher, a notebook, the tests)
    piled them up: a 5-job sweep measured 3 native threads, 4 descriptors and ~40 MB more after every job. Collected
    here, at the job's end, in the thread that ran it, rather than at a later job's allocation or, worse, inside a
    forked DataLoader worker, whose collector would finalize the group without its threads (data/workers.py).

    Not in a rank of a multi-rank launch: such a process runs one job and ends without freeing its group at all
    (:func:`end_rank_process`). Collecting it there deadlocked a rank (seen in the suite, 2 ranks on gloo): the group's
    destructor, run by the collector with the GIL held, joins its work threads, one of which was finishing a collective
    whose tensors it must release under the GIL.
    """

    @functools.wraps(run)
    def job(*args: P.args, **kwargs: P.kwargs) -> R:
        if _multi_rank():
            return run(*args, **kwargs)
        with job_collected():
            return run(*args, **kwargs)

    return job


@contextlib.contextmanager
def tracked_run(tracker: Tracker, start: RunStart, launch: Launch, *, close: Callable[[], None] | None = None) -> Iterator[None]:
    """Open (or continue) the run ``start`` describes on ``tracker``; on exit set its status and call ``close``.

    ``FINISHED`` when the body returns, ``KILLED`` on Ctrl-C or a signal (a preempted job is tagged ``preempted`` so
    its requeued relaunch is recognised), ``FAILED`` on any other exception, which propagates. A signal that comes
    while the end is written waits for it (:func:`~recsys_runner.train.signals.deferred`); after a ``FINISHED`` end it
    is then raised as an :class:`Interrupted` that says the run had finished.
    """
    status = "FAILED"
    try:
        _open(tracker, start, launch)
        yield
        status = "FINISHED"
    except (KeyboardInterrupt, Interrupted) as e:
        status = "KILLED"
        if isinstance(e, Interrupted):
            e.run_id = tracker.run_id
        if getattr(e, "preempted", False):
            tracker.set_tag(requeue.PREEMPTED_TAG, "true")  # submitit requeues it; the relaunch resumes this run
        raise
    finally:
        with signals.deferred() as late:
            tracker.finish(status)
            if close is not None:
                close()
        if status == "FINISHED" and (signum := late()) is not None:
            raise Interrupted(signum, None, None, when=f"as {launch.command_name} ended", finished=True)


def _open(tracker: Tracker, start: RunStart, launch: Launch) -> None:
    """Continue ``start.continue_run`` if the store has it, else start a new run with its tags, params and texts."""
    manifest = start.manifest
    if manifest is None and start.device is not None:
        manifest = lineage.collect(world_size=start.world_size, device=start.device)
    if (start.continue_run and _continued(tracker, start.continue_run)) or _preempted_run_continued(tracker, start):
        _record(tracker, start.record)
        if manifest is not None:  # the run's manifest.json stays the first launch's; each resume adds its own
            tracker.log_text(manifest.to_json(), f"manifest_resume_step{start.step}.json")
        tracker.log_inputs(start.datasets)
        return
    tags = start.tags | {OVERRIDES_TAG: " ".join(launch.overrides), "world_size": str(start.world_size)}
    if manifest is not None:
        entry = start.tags.get(ENTRY_TAG)  # evaluate, predict, export: their module, however they were called
        tags |= manifest.tags(source_name=f"{TRAIN_MODULE}.{entry}" if entry else launch.module)
    tracker.start(run_name=start.run_name, tags=tags, params=start.params)
    _record(tracker, start.record)
    tracker.log_inputs(start.datasets)
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


def _preempted_run_continued(tracker: Tracker, start: RunStart) -> bool:
    """Continue the run an earlier launch of this job recorded in its checkpoint directory and left with no checkpoint,
    when it was preempted and nothing would tell the two launches apart in it (:func:`~recsys_runner.tracking.requeue
    .why_not_continue`); else one line says why not, and a new run starts."""
    record = start.record
    if record is None or not record.read or (text := _read_record(record)) is None:
        return False
    run_id, why = requeue.recorded_id(text), tracker.why_not_continue(text, start.params)
    if why is None and run_id is not None and _continued(tracker, run_id):
        log.info("continuing MLflow run %s, preempted before its first checkpoint", run_id)
        return True
    if why is not None:
        log.info("not continuing MLflow run %s recorded in %s by an earlier launch: %s; starting a new run",
                 run_id or "(unknown)", record.directory / requeue.RECORD_FILE, why)
    return False


def _read_record(record: RunRecord) -> str | None:
    """The text of the record in ``record.directory``; ``None`` when there is none, or it cannot be read (said)."""
    try:
        return record.storage.read_note(record.directory, requeue.RECORD_FILE)
    except (OSError, UserError) as e:
        log.warning("could not read %s (%s); starting a new MLflow run", record.directory / requeue.RECORD_FILE, e)
        return None


def _record(tracker: Tracker, record: RunRecord | None) -> None:
    """Record the open run in the checkpoint directory for a relaunch of this job (:mod:`recsys_runner.tracking.requeue`).
    A failure only warns: the run goes on; a relaunch before the first checkpoint would then start a new run."""
    text = tracker.run_record() if record is not None else None
    if record is None or text is None:
        return
    try:
        record.storage.write_note(record.directory, requeue.RECORD_FILE, text)
    except (OSError, UserError) as e:
        log.warning("could not record MLflow run %s in %s (%s): a relaunch of this job before its first checkpoint would "
                    "start a new run", tracker.run_id, record.directory / requeue.RECORD_FILE, e)


@contextlib.contextmanager
def exit_codes(launch: Launch) -> Iterator[None]:
    """Every command's exit: a user error is one line and status 2 (:func:`recsys_runner.errors.reported`); a signal
    (SIGTERM, SIGINT, SIGUSR1) stops the command where it is (:class:`~recsys_runner.train.signals.RaiseOnSignal`;
    training's loop stops after its step or final eval instead), which prints what was kept and the command that
    resumes or redoes it (or hands a preempted job to submitit) and exits ``128 + signal`` (a preempted job's rank other
    than 0 exits 0: rank 0 requeues the job, and srun's ``--kill-on-bad-exit`` would end rank 0 on a sibling's non-zero
    exit, SIGKILL after ``KillWait``, before it did: docs/launch.md); a non-finite loss prints
    the last good checkpoint and exits 1; a collective that failed because another rank is gone prints which rank, the
    last checkpoint and the command that resumes (:func:`rank_lost_message`) and exits ``75``. These failures of the
    command's own end in :func:`~recsys_runner.errors.fail`, whose exit carries the message (a sweep's job names its
    failure by it); a signal's exit is a plain ``SystemExit``, never taken for a failure."""
    try:
        with signals.RaiseOnSignal(f"during {launch.command_name}", account=functools.partial(_account, launch)), reported():
            try:
                yield
            except CheckpointWriteFailed as e:  # the store failed mid-run: the checkpoints before stay, resume from them
                hint = resume_hint(launch, e.last_good) if e.last_good is not None else start_again_hint(launch)
                raise CheckpointError(f"{e}\n{hint}") from None
            except RuntimeError as e:  # lost outside the training loop (building, restoring): no checkpoint of this launch
                if peer_gone(e) is None or not _multi_rank():
                    raise
                signals.stopping()
                raise RankLost(e) from e
    except RankLost as e:
        with contextlib.suppress(ValueError):  # torchrun's SIGTERM to the survivors must not cut this exit short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        fail(rank_lost_message(launch, e), EXIT_RANK_LOST)
    except Interrupted as e:
        if e.handover is not None:  # preempted inside submitit: its handler resubmits this job and requeues it
            print(f"Interrupted: {e}", file=sys.stderr)
            if _rank_other_than_zero():  # submitit's handler only logs here: rank 0 requeues the job
                e.handover()
                print(f"Preempted: rank {os.environ['RANK']} leaves the requeue to rank 0 and exits 0", file=sys.stderr)
                sys.exit(0)
            print("Preempted: handing over to submitit to requeue this job", file=sys.stderr)
            e.handover()
        elif not _told_by_rank_zero(e):
            print(interrupted_message(launch, e), file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:  # a second Ctrl-C as the command ended on its first (inside the training loop it is
        first = e.__context__         # an Interrupted naming the last checkpoint: train/fault_ends.py's stopped_again)
        if isinstance(first, Interrupted):
            print(interrupted_message(launch, first), file=sys.stderr)
        else:
            command = launch.command()
            print(f"Interrupted: stopped by SIGINT at once{f'; redo it with: {command}' if command else ''}",
                  file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except NonFiniteLossError as e:
        hint = f"\n{resume_hint(launch, e.checkpoint, after_fix=True)}" if e.checkpoint is not None else ""
        fail(f"Training failed: {e}{hint}", 1)


def _account(launch: Launch, error: BaseException) -> str:
    """What this command says of ``error`` when it ends the process from a watching thread (:func:`~recsys_runner.train
    .signals.end_now`): a lost rank's line and resume command as its own exit says them, else the error's words."""
    return rank_lost_message(launch, error) if isinstance(error, RankLost) else str(error)


def _multi_rank() -> bool:
    """Whether this process is one rank of several (the launcher's ``WORLD_SIZE`` > 1; unset or empty: a single process)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def _told_by_rank_zero(e: Interrupted) -> bool:
    """Whether this rank leaves the account of ``e`` to rank 0: a rank other than 0 of a multi-rank launch whose stop every
    rank agreed on (:attr:`~recsys_runner.train.signals.Interrupted.agreed`: the same step, checkpoint and command on each),
    so that the "Interrupted / Resume this run" block is printed once, not once per rank. A rank's own stop (a signal
    while it waited on the store, a second Ctrl-C, one during the build) is still told by each rank: they may differ."""
    return e.agreed and _rank_other_than_zero()


def _rank_other_than_zero() -> bool:
    """Whether this process is a rank other than 0 of a multi-rank launch."""
    return _multi_rank() and os.environ.get("RANK", "0") != "0"


def end_rank_process() -> None:
    """After a command's work is done: in a rank of a multi-rank launch (``WORLD_SIZE`` > 1: torchrun, SLURM tasks), end the
    process as Python's own exit would, but without the interpreter's native teardown; elsewhere, return.

    Why: with the process group destroyed and every output written, a native thread of the closed gloo group was seen to
    abort a rank during that teardown ("terminate called without an active exception", SIGABRT) on a loaded machine: the
    launcher then reports a rank failed (exit -6) for a command whose work was done, and a SLURM job or sweep job fails.
    So: wait for the non-daemon threads, run the ``atexit`` handlers (MLflow's, logging's flush, temporary files' cleanup),
    flush the standard streams and ``os._exit(0)``. Only reached when the entry point's ``main`` returned: an error or a
    signal leaves through :func:`exit_codes`' ``sys.exit`` as before.
    """
    if not _multi_rank():
        return
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def rank_lost_message(launch: Launch, e: RankLost) -> str:
    """The survivor's account of a lost rank: which rank, where and the error (one line), then the command that resumes
    from the last complete checkpoint (:func:`resume_hint`), or, with none written, the command that runs it again."""
    if e.checkpoint is not None:
        return f"{RANK_LOST_LABEL}: {e}; the checkpoints written are intact\n{resume_hint(launch, e.checkpoint)}"
    command = launch.command()
    again = f"; no checkpoint was written, run it again with:\n  {command}" if command else "; no checkpoint was written"
    return f"{RANK_LOST_LABEL}: {e}{again}"


def interrupted_message(launch: Launch, e: Interrupted) -> str:
    """What an interruption kept and the exact command that goes on: training that stopped after a step resumes from
    its checkpoint (:func:`resume_hint`); a command stopped elsewhere kept nothing and is redone as launched."""
    if e.step is not None:
        return f"Interrupted: {e}\n{resume_hint(launch, e.checkpoint)}"
    run = f"MLflow run {e.run_id} " if e.run_id else "the MLflow run "
    if e.finished:
        return f"Interrupted: {e}; {run}had FINISHED with everything kept, nothing to redo."
    kept = f"nothing was kept ({run}is KILLED)" if e.run_id else "nothing was kept"
    command = launch.command()
    return f"Interrupted: {e}; {kept}; redo it with: {command}" if command else f"Interrupted: {e}; {kept}."


def resume_hint(launch: Launch, checkpoint: str | None, after_fix: bool = False) -> str:
    """The lines telling how to continue from ``checkpoint`` (a ``step_*`` directory), for stderr;
    ``after_fix``: the command is to be changed first (a NaN loss would only recur)."""
    if checkpoint is None:
        return "Nothing to resume from: no checkpoint was written (set checkpoint.dir or checkpoint.every_steps)."
    command = launch.resume_command(uris.as_path(checkpoint).parent)
    if command is None:
        return f"Resume from {checkpoint} with checkpoint.dir={uris.as_path(checkpoint).parent.absolute()} (same MLflow run)."
    how = "this command with your change made" if after_fix else "this command"
    return f"Resume this run from {uris.as_path(checkpoint).name}, into the same MLflow run, with {how}:\n  {command}"


def start_again_hint(launch: Launch) -> str:
    """The line after a checkpoint write that failed before the run had written any: checkpoints were asked for (the
    write was one), so :func:`resume_hint`'s "set checkpoint.dir" does not apply; the run starts over once fixed."""
    command = launch.command()
    again = f", with:\n  {command}" if command else ""
    return f"Nothing to resume from: the run had written no checkpoint before this one. Once the cause is fixed, start it again{again}"


def mark_finished(directory: Path | None) -> None:
    """Training into ``directory`` finished: mark it, so a later launch does not offer to resume it."""
    if directory is None:
        return
    text = b"training finished; nothing to resume here\n"
    if uris.is_remote(directory):  # an object store has no directories: the mark is an object under the prefix
        stores.write_bytes(str(directory / FINISHED_MARK), text, CheckpointError)
    elif directory.is_dir():
        (directory / FINISHED_MARK).write_bytes(text)


def interrupted_runs(launch: Launch, storage: CheckpointStorage, own: Path | None) -> list[Path]:
    """Checkpoint directories of earlier single launches of this same command (the same overrides, in any order) under
    ``launch.runs_root`` (``<runs root>/<date>/<time>/checkpoints``) that hold complete checkpoints and did not finish,
    newest last; ``own`` (this launch's directory) excluded."""
    if launch.runs_root is None or not launch.runs_root.is_dir():
        return []
    found = []
    for directory in launch.runs_root.glob("*/*/checkpoints"):
        if (own is not None and directory.absolute() == own.absolute()) or (directory / FINISHED_MARK).exists():
            continue
        try:
            newest = storage.checkpoints(directory)[-1:]
            overrides = storage.read_meta(newest[0]).get("overrides") if newest else None
        except (OSError, ValueError):
            continue  # unreadable: not one to offer
        if overrides is not None and sorted(overrides) == sorted(launch.overrides):
            found.append((newest[0].stat().st_mtime, directory))
    return [d for _, d in sorted(found)]


def note_interrupted_runs(launch: Launch, storage: CheckpointStorage, own: Path | None) -> None:
    """Log one line when an earlier launch of this command left checkpoints in its default directory and did not
    finish (see the module docstring): which, and the command that resumes it. This launch starts over all the same.
    Under ``torchrun --max-restarts``, warn that a restart would start over too (it is this same launch again)."""
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "")
    if restarts.isdigit() and int(restarts) > 0 and launch.from_cli:
        log.warning("torchrun --max-restarts=%s relaunches this command as it is, and with checkpoint.dir unset each launch "
                    "checkpoints into its own new run directory: a restart would start over from step 0 in a new MLflow run. "
                    "Set checkpoint.dir=<path> so that a restart resumes from the last checkpoint (docs/launch.md)", restarts)
    found = interrupted_runs(launch, storage, own)
    if not found or (command := launch.resume_command(found[-1])) is None:
        return
    newest = storage.checkpoints(found[-1])[-1]
    older = f" (and {len(found) - 1} older)" if len(found) > 1 else ""
    log.warning("an interrupted run of this command left checkpoints in %s%s, up to %s; this launch starts a new run "
                "from step 0 instead. To continue that run, stop this one and run: %s", found[-1], older, newest.name, command)
