"""``python -m recsys_runner [overrides]``: compose the config, validate it, build, train, log.

Kept tiny on purpose (torchtitan's ``train.py``): Hydra's runtime is read once here (:class:`~recsys_runner.runtime.Launch`),
building lives in ``build.py``, the loop in ``train/loop.py``, the run's start and end (MLflow status, manifest, exit
codes) in ``lifecycle.py``, shared with evaluate, predict and export.
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from recsys_runner.build import Components, build
from recsys_runner.collection import skip_the_exit_collection
from recsys_runner.config import flatten, register_configs, to_yaml, validate
from recsys_runner.data.encoding.stored import ENCODERS_FILE
from recsys_runner.errors import ConfigError
from recsys_runner.lifecycle import (
    RunRecord,
    RunStart,
    end_rank_process,
    exit_codes,
    mark_finished,
    note_interrupted_runs,
    one_job,
    tracked_run,
)
from recsys_runner.noise import quiet_known_noise
from recsys_runner.overrides import check_command_line
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.runtime import TRAIN_MODULE, Launch
from recsys_runner.tracking import datasets, lineage, sweep_names
from recsys_runner.tracking.datasets import DataRecord
from recsys_runner.train.loop import Loop, train

log = logging.getLogger("recsys_runner")
quiet_known_noise()  # first, before Hydra composes: the known library warnings, each with its reason (noise.py)
register_configs()


def stored_texts(files: dict[str, bytes]) -> dict[str, str]:
    """What every checkpoint stores beside the weights (the data's fitted encoders), also as MLflow artifacts."""
    return {name: content.decode() for name, content in files.items()}


@one_job
def run(cfg: DictConfig, launch: Launch = Launch()) -> float:
    """Run one job; returns its objective, the final eval metric ``train.objective`` (for sweepers)."""
    spec = validate(cfg)
    c = build(spec, launch=launch)
    loop = c.loop
    swept = sweep_names.job_swept_values(launch.overrides)  # {} unless a job of a sweep: then its name and swept.* params
    data_inputs = _data_inputs(c)
    start = RunStart(
        run_name=sweep_names.child_name(swept) or ",".join(launch.overrides) or "defaults",
        params=flatten(spec) | _run_length(loop) | sweep_names.child_params(swept),
        tags=sweep_names.child_tags(launch.job_num) | (
            {lineage.CHECKPOINT_DIR_TAG: str(loop.checkpointer.dir.absolute())} if loop.checkpointer.dir is not None else {})
            | loop.checkpointer.init_tags(),
        texts={"config.yaml": to_yaml(spec), "sharding_plan.txt": str(c.plan), **stored_texts(loop.checkpointer.files)},
        continue_run=loop.state.run_id,
        world_size=c.env.world_size, device=c.env.device if c.env.is_main else None, step=loop.state.step, datasets=data_inputs,
        record=_run_record(c))
    if c.env.is_main and spec.checkpoint.dir is None and spec.checkpoint.resume == "auto" and loop.state.step == 0:
        note_interrupted_runs(launch, loop.checkpointer.storage, loop.checkpointer.dir)  # the default dir is new per launch
    with tracked_run(loop.tracker, start, launch, close=c.close):
        loop.state.run_id = loop.tracker.run_id or loop.state.run_id
        _note_resume(c, launch)
        final = train(loop)
        if c.env.is_main:
            mark_finished(loop.checkpointer.dir)
        return objective(final, spec.train.objective)


def _data_inputs(c: Components) -> list[DataRecord]:
    """Rank 0's record of the data this run trains and evaluates on (digests read the files once, so on one rank), also
    written into every checkpoint beside the encoders fitted on it (``data_inputs.json``): a later evaluate compares, and
    so does a resume, against the checkpoint it resumes (a warning where the files changed since)."""
    if not c.env.is_main:
        return []
    files = c.loop.checkpointer.files
    records = datasets.describe(c.run.served_data, c.loop.data, max_digest_mb=c.run.tracking.dataset_digest_max_mb,
                                encoders=files.get(ENCODERS_FILE))
    files[datasets.DATA_INPUTS_FILE] = datasets.to_json(records)
    if (resumed := c.loop.state.resumed_from) is not None:  # the files it started on, as the checkpoint recorded them
        stored = datasets.read_stored(resumed)
        trained = [r for r in records if r.context in (datasets.CONTEXTS["train"], datasets.CONTEXTS["items"])]
        datasets.note_changes(stored, trained, resumed, consequence=datasets.RESUMED_ON_CHANGED)
        datasets.note_split_changes(stored, records, resumed, consequence=datasets.RESUMED_ON_RESPLIT)
    elif (source := c.loop.checkpointer.restore_source()) is not None:  # a fine-tune: today's files against yesterday's
        datasets.note_shrunk(datasets.read_stored(source), records, source)
    return records


def _run_record(c: Components) -> RunRecord | None:
    """Where rank 0 records its MLflow run: the checkpoint directory, read first when no checkpoint was resumed
    (``checkpoint.resume=auto`` found none), for the run of a launch preempted before its first checkpoint; nowhere with
    ``checkpoint.resume=never`` (``checkpoint=none``), whose relaunch resumes nothing."""
    checkpointer = c.loop.checkpointer
    if not c.env.is_main or checkpointer.dir is None or checkpointer.config.resume == "never":
        return None
    return RunRecord(checkpointer.storage, checkpointer.dir, read=c.loop.state.resumed_from is None)


def _run_length(loop: Loop) -> dict[str, int]:
    """The length the run decided (params ``run.total_steps``, ``run.steps_per_epoch``): ``train.num_steps`` and
    ``train.num_epochs`` are logged as given, ``None`` when the data chose (one epoch of a file), so the UI needs these."""
    length = {"run.total_steps": loop.total_steps}
    if loop.steps_per_epoch is not None:
        length["run.steps_per_epoch"] = loop.steps_per_epoch
    return length


def objective(final: dict[str, float], key: str | None) -> float:
    """``final[key]``; by default the default objective (:func:`~recsys_runner.metrics.registry.default_objective`)."""
    from recsys_runner.metrics.registry import default_objective

    if key is None:
        key = default_objective(final)
    if key not in final:
        raise ConfigError(f"train.objective={key!r} is not among this model's eval metrics {sorted(final)}; pick one of them")
    return final[key]


def _note_resume(c: Components, launch: Launch) -> None:
    """Tag a fallback past damaged checkpoints and the settings changed on resuming; log where checkpoints go and how to
    resume after a crash."""
    state, tracker = c.loop.state, c.loop.tracker
    if state.set_aside:
        tracker.set_tag("checkpoint_fallback", f"resumed from {state.resumed_from}; damaged, moved aside: {', '.join(state.set_aside)}")
    if state.resume_changes:  # the continued run's params stay the first launch's: the tag says what changed since
        tracker.set_tag("resume_changes", f"at step {state.step}: {'; '.join(state.resume_changes)}")
    directory = c.loop.checkpointer.dir
    if directory is not None and c.env.is_main and (command := launch.resume_command(directory)):
        if during := c.loop.checkpointer.kept_through_a_crash():
            log.info("checkpoints: %s, %s (if this run dies, resume it with: %s)", directory, " and ".join(during), command)
        else:
            log.info("checkpoints: %s, written only %son a stop by a signal: a crash keeps none (checkpoint.every_steps=N keeps one "
                     "every N steps; after a stop, resume it with: %s)", directory, "at the end and " if c.loop.checkpointer.config.at_end else "",
                     command)


@hydra.main(config_path=CONFIG_PATH, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    skip_the_exit_collection()  # a sweep job's process too (submitit's, which calls this function): collection.py says why
    launch = Launch.from_hydra(TRAIN_MODULE, cfg)  # Hydra's runtime, read here once and handed down
    with exit_codes(launch):  # a signal: KILLED, what was kept and how to go on, exit 128 + signal (lifecycle.py)
        return run(cfg, launch)


if __name__ == "__main__":
    skip_the_exit_collection()  # the launching process of a sweep too, whose main() runs in its jobs
    check_command_line("config")  # a typo: one line with the closest valid name (overrides.py)
    main()
    end_rank_process()  # a rank of a multi-rank launch skips the native teardown (lifecycle.py says why)
