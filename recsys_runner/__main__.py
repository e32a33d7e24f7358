"""``python -m recsys_runner [overrides]``: compose the config, validate it, build, train, log.

Kept tiny on purpose (torchtitan's ``train.py``): building lives in ``build.py``, the loop in
``runner.py``, tracking in ``tracking.py``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from recsys_runner.build import Components, build
from recsys_runner.checkpoint import resume_command
from recsys_runner.config import flatten, register_configs, to_yaml, validate
from recsys_runner.errors import ConfigError, reported
from recsys_runner.noise import quiet_known_noise
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.tracking import lineage
from recsys_runner.tracking.tracker import Tracker
from recsys_runner.train.loop import Loop, train
from recsys_runner.train.signals import Interrupted
from recsys_runner.train.stopping import NonFiniteLossError

log = logging.getLogger("recsys_runner")
quiet_known_noise()  # first, before Hydra composes: the known library warnings, each with its reason (noise.py)
register_configs()


def run(cfg: DictConfig) -> float:
    """Run one job; returns its objective, the final eval metric ``train.objective`` (for sweepers)."""
    spec = validate(cfg)
    c = build(spec)
    status = "FAILED"
    try:
        loop = c.loop
        manifest = lineage.collect(world_size=c.env.world_size, device=c.env.device) if c.env.is_main else None
        if not (loop.state.run_id and _resume_tracking(loop.tracker, loop.state.run_id)):
            overrides = _overrides()
            tags = {"hydra.overrides": " ".join(overrides), "world_size": str(c.env.world_size)}
            if loop.checkpointer.dir is not None:
                tags[lineage.CHECKPOINT_DIR_TAG] = str(loop.checkpointer.dir.absolute())
            if manifest is not None:
                tags |= manifest.tags()
            loop.tracker.start(run_name=",".join(overrides) or "defaults", tags=tags, params=flatten(spec) | _run_length(loop))
            loop.tracker.log_text(to_yaml(spec), "config.yaml")
            loop.tracker.log_text(str(c.plan), "sharding_plan.txt")
            if manifest is not None:
                lineage.record(loop.tracker, manifest)
        elif manifest is not None:  # the run's manifest.json stays the first launch's; each resume adds its own
            loop.tracker.log_text(manifest.to_json(), f"manifest_resume_step{loop.state.step}.json")
        loop.state.run_id = loop.tracker.run_id or loop.state.run_id
        _note_resume(c)
        final = train(loop)
        status = "FINISHED"
        return objective(final, spec.train.objective)
    except (KeyboardInterrupt, Interrupted) as e:
        status = "KILLED"
        if getattr(e, "preempted", False):
            c.loop.tracker.set_tag("preempted", "true")  # submitit requeues it; the relaunch resumes this run
        raise
    finally:
        c.loop.tracker.finish(status)
        c.close()


def _run_length(loop: Loop) -> dict[str, int]:
    """The length the run decided (params ``run.total_steps``, ``run.steps_per_epoch``): ``train.num_steps`` and
    ``train.num_epochs`` are logged as given, ``None`` when the data chose (one epoch of a file), so the UI needs these."""
    length = {"run.total_steps": loop.total_steps}
    if loop.steps_per_epoch is not None:
        length["run.steps_per_epoch"] = loop.steps_per_epoch
    return length


def objective(final: dict[str, float], key: str | None) -> float:
    """``final[key]``; by default ``eval/auc`` if logged, else the first eval metric."""
    if key is None:
        key = "eval/auc" if "eval/auc" in final else next(iter(final))
    if key not in final:
        raise ConfigError(f"train.objective={key!r} is not among this model's eval metrics {sorted(final)}; pick one of them")
    return final[key]


def _resume_tracking(tracker: Tracker, run_id: str) -> bool:
    """Continue the checkpoint's MLflow run; ``False`` (start a new one) if this store lacks it."""
    try:
        tracker.resume(run_id)
        return True
    except Exception as e:  # a different tracking store, or the run was deleted
        log.warning("cannot continue MLflow run %s (%s); starting a new run", run_id, e)
        return False


def _note_resume(c: Components) -> None:
    """Tag a fallback past damaged checkpoints; log where checkpoints go and how to resume after a crash."""
    state, tracker = c.loop.state, c.loop.tracker
    if state.set_aside:
        tracker.set_tag("checkpoint_fallback", f"resumed from {state.resumed_from}; damaged, moved aside: {', '.join(state.set_aside)}")
    directory = c.loop.checkpointer.dir
    if directory is not None and c.env.is_main and (command := resume_command(directory)):
        log.info("checkpoints: %s (if this run dies, resume it with: %s)", directory, command)


def _resume_hint(checkpoint: str | None, after_fix: bool = False) -> str:
    """The lines telling how to continue from ``checkpoint`` (a ``step_*`` directory), for stderr;
    ``after_fix``: the command is to be changed first (a NaN loss would only recur)."""
    if checkpoint is None:
        return "Nothing to resume from: no checkpoint was written (set checkpoint.dir or checkpoint.every_steps)."
    command = resume_command(Path(checkpoint).parent)
    if command is None:
        return f"Resume from {checkpoint} with checkpoint.dir={Path(checkpoint).parent.absolute()} (same MLflow run)."
    how = "this command with your change made" if after_fix else "this command"
    return f"Resume this run from {Path(checkpoint).name}, into the same MLflow run, with {how}:\n  {command}"


def _overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


@hydra.main(config_path=CONFIG_PATH, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        with reported():
            return run(cfg)
    except Interrupted as e:
        print(f"Interrupted: {e}", file=sys.stderr)
        if e.handover is not None:  # preempted inside submitit: its handler resubmits this job and requeues it
            print("Preempted: handing over to submitit to requeue this job", file=sys.stderr)
            e.handover()
        else:
            print(_resume_hint(e.checkpoint), file=sys.stderr)
        sys.exit(e.exit_code)
    except NonFiniteLossError as e:
        print(f"Training failed: {e}", file=sys.stderr)
        if e.checkpoint is not None:
            print(_resume_hint(e.checkpoint, after_fix=True), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
