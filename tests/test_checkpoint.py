"""Checkpoints: exact resume, keep-last and best, atomic writes, fine-tuning, clear errors."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from recsys_runner.__main__ import run
from recsys_runner.build import build
from recsys_runner.checkpoint.storage import list_checkpoints
from recsys_runner.config import validate
from recsys_runner.errors import CheckpointError, CheckpointWriteFailed, ConfigError
from recsys_runner.train.signals import Interrupted
from tests.conftest import LogWarnings

# Adam on the dense part (lazy state), row-wise Adagrad on embeddings, a schedule that depends on
# the step: everything a resume must restore shows up in the per-step losses.
RESUMABLE = ["optim=rowwise_adagrad", "optim/dense=adam", "optim.dense.lr=0.003", "scheduler=cosine", "scheduler.warmup_steps=3",
             "train.num_steps=12", "train.log_every_steps=1"]


def history(uri: str, experiment: str, key: str = "train/loss") -> dict[int, float]:
    client = MlflowClient(tracking_uri=uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, key)}


def local(t: torch.Tensor) -> torch.Tensor:
    return t.local_tensor() if hasattr(t, "local_tensor") else t


def test_resumed_training_matches_uninterrupted(make_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    straight = make_cfg(*RESUMABLE, f"checkpoint.dir={tmp_path}/a", "tracking.experiment=resume_straight")
    run(straight)
    sliced = make_cfg(*RESUMABLE, f"checkpoint.dir={tmp_path}/b", "tracking.experiment=resume_sliced", "train.stop_after_steps=5")
    with pytest.raises(Interrupted, match="after step 5"):
        run(sliced)
    assert [p.name for p in list_checkpoints(tmp_path / "b")] == ["step_00000005"]
    with pytest.raises(Interrupted, match="after step 10"):
        run(sliced)  # the same command again: resumes at 5, runs another slice of 5
    run(sliced)  # and finishes 11..12 — all into the same MLflow run
    expected, resumed = history(mlflow_uri, "resume_straight"), history(mlflow_uri, "resume_sliced")
    assert sorted(resumed) == list(range(1, 13))
    for step in range(1, 13):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), f"step {step}: {resumed[step]} vs {expected[step]}"
    lr_a, lr_b = history(mlflow_uri, "resume_straight", "lr/dense"), history(mlflow_uri, "resume_sliced", "lr/dense")
    assert lr_b == pytest.approx(lr_a)
    client = MlflowClient(tracking_uri=mlflow_uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("resume_sliced").experiment_id])
    assert mlrun.info.status == "FINISHED" and mlrun.data.tags.get("resumed") == "true"


def test_keep_last_and_best_are_kept_apart(make_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    """The last two step checkpoints, and apart from them the one of the lowest logged eval/logloss (of 4 evals)."""
    cfg = make_cfg("train.num_steps=12", "train.eval_every_steps=3", "train.eval_max_batches=4", "checkpoint.every_steps=2",
                   "checkpoint.keep_last=2", "checkpoint.best_metric=eval/logloss", "checkpoint.best_mode=min",
                   f"checkpoint.dir={tmp_path}")
    run(cfg)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000010", "step_00000012"]
    (best,) = list_checkpoints(tmp_path, best=True)
    import json

    logloss = history(mlflow_uri, cfg.tracking.experiment, "eval/logloss")
    assert sorted(logloss) == [3, 6, 9, 12]
    lowest = min(logloss, key=logloss.__getitem__)
    assert len(set(logloss.values())) == 4 and lowest != 12, logloss  # else the newest eval would pass for the best
    assert best.name == f"best-step_{lowest:08d}"
    meta = json.loads((best / "meta.json").read_text())
    assert meta["step"] == lowest and meta["best"] == pytest.approx(logloss[lowest])
    assert meta["metrics"]["eval/logloss"] == pytest.approx(meta["best"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_unfinished_write_is_ignored_and_damaged_or_missing_checkpoints_error(make_cfg, tmp_path: Path) -> None:
    cfg = make_cfg("train.num_steps=4", f"checkpoint.dir={tmp_path}", "tracking=none")
    run(cfg)
    (last,) = list_checkpoints(tmp_path)
    # A crash mid-write leaves a .tmp- directory (or one without meta.json): never resumed from.
    shutil.copytree(last, tmp_path / ".tmp-step_00000008")
    shutil.copytree(last, tmp_path / "step_00000009", ignore=shutil.ignore_patterns("meta.json"))
    assert list_checkpoints(tmp_path) == [last]

    (last / ".metadata").write_bytes(b"truncated")  # now both are damaged (test_run_safety.py: the fallback when one is whole)
    with pytest.raises(CheckpointError, match=r"every checkpoint in .* is damaged"):
        run(make_cfg("train.num_steps=8", f"checkpoint.dir={tmp_path}", "tracking=none"))
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        run(make_cfg(f"checkpoint.dir={tmp_path}/empty", "checkpoint.resume=latest", "tracking=none"))
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        run(make_cfg(f"checkpoint.resume={tmp_path}/missing/step_00000001", "tracking=none"))
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        run(make_cfg(f"checkpoint.init_from={tmp_path}/empty", "tracking=none"))


def test_fine_tune_with_name_map_and_without_optimizer_state(make_cfg, tmp_path: Path) -> None:
    run(make_cfg("train.num_steps=6", f"checkpoint.dir={tmp_path}/src", "tracking=none"))
    (src,) = list_checkpoints(tmp_path / "src")

    def built(*overrides: str):
        cfg = make_cfg(f"checkpoint.dir={tmp_path}/ft", f"checkpoint.init_from={src}", "checkpoint.load_optimizer=false",
                       "tracking=none", *overrides)
        c = build(validate(cfg))
        state = {k: local(v).clone() for k, v in c.loop.evaluator.model.state_dict().items()}
        c.close()
        return c, state

    plain_c, plain = built()
    mapped_c, mapped = built("+checkpoint.name_map.t_cat_0=t_cat_1")
    assert plain_c.loop.state.step == 0 and mapped_c.loop.state.step == 0  # a new run, not a resume
    key = next(k for k in plain if k.endswith("t_cat_0.weight"))
    assert torch.equal(mapped[key], plain[key.replace("t_cat_0", "t_cat_1")])
    assert not torch.equal(mapped[key], plain[key])
    dense_key = next(k for k in plain if "t_cat" not in k)
    assert torch.equal(mapped[dense_key], plain[dense_key])
    with pytest.raises(CheckpointError, match="shares no parameter name"):
        built("+checkpoint.name_map.model=other")
    with pytest.raises(ConfigError, match=r"checkpoint.name_map.t_cat_O=t_cat_1: no tensor of this model has 't_cat_O'.*Fix: use a part of this model's names as the key \(e.g. t_cat_"):
        built("+checkpoint.name_map.t_cat_O=t_cat_1")  # renamed nothing, without a word: a fine-tune as if unmapped


def _default_dir_on_rank(rank: int, port: int, out: str) -> None:
    import json

    import torch.distributed as dist

    from recsys_runner.checkpoint.config import CheckpointConfig
    from recsys_runner.checkpoint.policy import Checkpointer
    from recsys_runner.runtime import Launch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:  # each rank's own Hydra run directory, as two ranks started a second apart name theirs
        launch = Launch(overrides=("train.num_steps=4",), output_dir=Path(out) / f"run-of-rank{rank}", config_name="config")
        checkpointer = Checkpointer(CheckpointConfig(), rank=rank, world_size=2, launch=launch)
        Path(out, f"rank{rank}.json").write_text(json.dumps(str(checkpointer.dir)))
    finally:
        dist.destroy_process_group()


def test_ranks_with_run_directories_of_their_own_checkpoint_into_rank_0s(tmp_path: Path) -> None:
    """Under torchrun each rank's Hydra run directory is named from its own clock: the default checkpoint.dir must be
    one directory for all ranks, or one checkpoint is split in two and a resume finds it damaged. The two ranks are forks
    of this process, which has imported everything they need (spawned, each imported this module and the whole runner
    afresh: half a minute on a loaded 2-core machine), with this process's garbage frozen first, as the data workers' fork
    does (recsys_runner/data/workers.py): a child must not finalize an earlier test's process group."""
    import gc
    import json

    import torch.multiprocessing as mp

    from tests.conftest import free_port

    gc.freeze()
    try:
        mp.start_processes(_default_dir_on_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    finally:
        gc.unfreeze()
    dirs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert dirs == [str(tmp_path / "run-of-rank0" / "checkpoints")] * 2


@pytest.mark.parametrize("failing", [4, 2], ids=["after_a_checkpoint", "at_the_first_checkpoint"])
def test_a_full_disk_stops_with_the_fix_keeps_the_previous_checkpoint_whole_and_fails_the_run(
    make_cfg, mlflow_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], failing: int
) -> None:
    """The disk fills while DCP writes a checkpoint's tensors: the error names the checkpoint and the fix (not DCP's
    ``CheckpointException``, a ``BaseException`` with a traceback), the partial write is removed (it holds the space),
    and the MLflow run ends FAILED. After a checkpoint (step 2 whole) the command's exit says how to resume from it; at
    the run's very first checkpoint there is nothing to resume from, and neither the error nor the exit pretends there
    is (no "checkpoints before it are whole", no keep_last that would free nothing, no "set checkpoint.dir")."""
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_files

    from recsys_runner.checkpoint.storage import damage
    from recsys_runner.lifecycle import exit_codes
    from recsys_runner.runtime import Launch

    write_item = dcp_files._write_item
    name = f"step_{failing:08d}"

    def full_disk(transforms, stream, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name in str(getattr(stream, "name", "")):
            raise OSError(errno.ENOSPC, "No space left on device", str(stream.name))
        return write_item(transforms, stream, *args, **kwargs)

    monkeypatch.setattr(dcp_files, "_write_item", full_disk)
    cfg = make_cfg("train.num_steps=6", "checkpoint.every_steps=2", f"checkpoint.dir={tmp_path}")
    with pytest.raises(CheckpointError) as failed:
        run(cfg)
    message = str(failed.value)
    assert f"{tmp_path}/{name} could not be written: No space left on device" in message, message
    assert f"free space on the disk holding {tmp_path}" in message and "checkpoint.dir=" in message, message
    assert isinstance(failed.value, CheckpointWriteFailed)
    if failing == 4:
        assert failed.value.last_good == str(tmp_path / "step_00000002")
        assert f"the checkpoints before it in {tmp_path} are whole (the newest: step_00000002)" in message, message
        assert "checkpoint.keep_last" in message, message
        assert sorted(p.name for p in tmp_path.iterdir() if p.name not in (".lock", ".mlflow_run")) == ["step_00000002"]
        assert damage(tmp_path / "step_00000002") is None
    else:
        assert failed.value.last_good is None
        assert f"no checkpoint was written in {tmp_path} before it, so there is none to resume from yet" in message, message
        assert "before it in" not in message and "keep_last" not in message, message
        assert sorted(p.name for p in tmp_path.iterdir() if p.name not in (".lock", ".mlflow_run")) == []
    client = MlflowClient(tracking_uri=mlflow_uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    assert mlrun.info.status == "FAILED"
    launch = Launch(overrides=("train.num_steps=6",), output_dir=tmp_path / "run", config_name="config")
    with pytest.raises(SystemExit), exit_codes(launch):  # what the command prints after the error
        raise failed.value
    hint = capsys.readouterr().err.strip().splitlines()[1:]
    if failing == 4:
        assert hint[0].startswith("Resume this run from step_00000002"), hint
    else:
        assert hint[0] == "Nothing to resume from: the run had written no checkpoint before this one. Once the cause is fixed, start it again, with:"
        assert "checkpoint.dir" not in "\n".join(hint) and "train.num_steps=6" in hint[1], hint


def test_resuming_an_older_checkpoint_writes_its_own_newer_ones_over_the_abandoned_ones(make_cfg, tmp_path: Path) -> None:
    """``checkpoint.resume=<dir>/step_2`` in a directory that also holds step 4 and 6 of the run it continues: those belong
    to the abandoned continuation. They are moved aside (named in a warning), so that neither this run's save at step 4
    (which found "step_4 complete" and kept the old weights) nor a later ``resume=auto`` takes them for this run's."""
    cfg = make_cfg("train.num_steps=6", "checkpoint.every_steps=2", f"checkpoint.dir={tmp_path}")
    run(cfg)
    old = {step: (tmp_path / f"step_{step:08d}" / "__0_0.distcp").read_bytes() for step in (4, 6)}
    again = make_cfg("train.num_steps=4", "checkpoint.every_steps=2", f"checkpoint.dir={tmp_path}", "optim.lr=0.2",
                     f"checkpoint.resume={tmp_path}/step_00000002")
    with LogWarnings("recsys_runner") as warned:
        run(again)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000004"]
    assert (tmp_path / "step_00000004" / "__0_0.distcp").read_bytes() != old[4]  # this run's step 4, not the abandoned one
    assert (tmp_path / "abandoned-step_00000006" / "__0_0.distcp").read_bytes() == old[6]
    assert any("abandoned-step_00000006" in w and "step_00000002" in w for w in warned.messages), warned.messages


def test_a_new_run_with_resume_never_sets_aside_an_earlier_runs_checkpoints(make_cfg, tmp_path: Path) -> None:
    """``checkpoint.resume=never`` in a directory holding an earlier run's checkpoints (a fixed ``checkpoint.dir`` reused; the
    documented fine-tune ``checkpoint.init_from=… checkpoint.resume=never``): this run's save at step 4 found the earlier
    step_4 complete and kept it, so the run ended with the earlier run's weights as its own, without a word, and a later
    ``resume=auto`` would continue the earlier run from its step 6. They are moved aside, named in a warning."""
    cfg = make_cfg("train.num_steps=6", "checkpoint.every_steps=2", "checkpoint.best_metric=eval/auc",
                   "train.eval_every_steps=2", "train.eval_max_batches=1", "tracking=none", f"checkpoint.dir={tmp_path}")
    run(cfg)
    earlier = {p.name: (p / "__0_0.distcp").read_bytes() for p in [*list_checkpoints(tmp_path), *list_checkpoints(tmp_path, True)]}
    fresh = make_cfg("train.num_steps=4", "checkpoint.every_steps=2", "optim.lr=0.2", "tracking=none", "checkpoint.resume=never",
                     f"checkpoint.dir={tmp_path}")
    with LogWarnings("recsys_runner") as warned:
        run(fresh)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000004"] and not list_checkpoints(tmp_path, True)
    assert (tmp_path / "step_00000004" / "__0_0.distcp").read_bytes() != earlier["step_00000004"]  # this run's own
    for name, data in earlier.items():
        assert (tmp_path / f"abandoned-{name}" / "__0_0.distcp").read_bytes() == data
    (said,) = [w for w in warned.messages if "checkpoint.resume=never" in w]
    assert f"starts a new run in {tmp_path}, which holds checkpoints of an earlier run: moved them aside to " in said
    assert "abandoned-step_00000006" in said and "give each its own checkpoint.dir" in said


def test_a_kill_while_rotation_deletes_the_oldest_leaves_nothing_half_deleted_behind(
    make_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process dies (here a ``SystemExit`` at that point) while ``keep_last`` deletes step 2, after its meta.json
    went: the resume continues from step 4, and no half-deleted step 2 stays behind, neither listed (a checkpoint
    without meta.json no rotation deletes again) nor taking the disk."""
    import recsys_runner.checkpoint.storage as storage_module

    rmtree = shutil.rmtree

    def killed_midway(path: str | Path, ignore_errors: bool = False) -> None:
        path = Path(path)
        if path.name.endswith("step_00000002") and (path / "meta.json").exists():
            (path / "meta.json").unlink()
            raise SystemExit("killed while deleting")
        rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(storage_module.shutil, "rmtree", killed_midway)
    args = ("checkpoint.every_steps=2", "checkpoint.keep_last=1", f"checkpoint.dir={tmp_path}", "tracking=none")
    with pytest.raises(SystemExit, match="killed while deleting"):
        run(make_cfg("train.num_steps=6", *args))
    monkeypatch.setattr(storage_module.shutil, "rmtree", rmtree)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004"]
    run(make_cfg("train.num_steps=8", *args))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".finished", ".lock", "step_00000008"]


def test_an_epoch_end_checkpoint_records_the_next_epochs_start(make_cfg, tmp_path: Path) -> None:
    """``checkpoint.every_epochs=1``: a checkpoint after each epoch's last step, whose position is the next epoch's start
    (epoch 1, step 0 of it), not "step 8 of epoch 0": that count is the whole epoch only on the ranks that wrote it
    (``tests/test_checkpoint_reshard.py`` resumes it on other ranks)."""
    import json

    cfg = make_cfg("data.num_train_rows=2048", "train.num_steps=null", "train.num_epochs=2", "checkpoint.every_epochs=1",
                   "checkpoint.keep_last=null", f"checkpoint.dir={tmp_path}", "checkpoint.at_end=false", "tracking=none")
    run(cfg)
    found = {p.name: json.loads((p / "meta.json").read_text()) for p in list_checkpoints(tmp_path)}
    assert {name: (meta["step"], meta["epoch"], meta["epoch_step"]) for name, meta in found.items()} == {
        "step_00000008": (8, 1, 0), "step_00000016": (16, 2, 0)}


def test_an_epoch_end_checkpoint_resumes_with_other_data_workers_at_the_next_epochs_start(
    make_cfg, mlflow_uri: str, tmp_path: Path
) -> None:
    """File data cut into 2 worker shards (each drops its last partial batch), stopped right after epoch 0's last step,
    resumed in process (1 shard, another epoch length): no "other shards" warning, no step of epoch 0 again, and epoch 1
    trained whole from its start (as many steps as 1 shard's epoch has), then epoch 2."""
    from tests.test_data_workers import _click_csv, _resumable

    csv = _click_csv(tmp_path / "clicks.csv", rows=630)  # 2 shards drop 1 batch more than 1 does

    def cfg(workers: int, *extra: str):  # type: ignore[no-untyped-def]
        return make_cfg(*_resumable(csv, f"data.num_workers={workers}", f"checkpoint.dir={tmp_path}/ck", *extra), tiny=False)

    per_epoch = {}
    for workers in (2, 0):
        built = build(validate(cfg(workers, "tracking=none", "checkpoint=none")))
        per_epoch[workers] = built.loop.steps_per_epoch
        built.close()
    assert per_epoch[2] != per_epoch[0], per_epoch  # the epoch is cut otherwise: its step count says so
    steps = per_epoch[2] + per_epoch[0] + 1
    with pytest.raises(Interrupted):
        run(cfg(2, f"train.num_steps={steps}", f"train.stop_after_steps={per_epoch[2]}"))
    with LogWarnings() as warned:
        run(cfg(0, f"train.num_steps={steps}"))
    epochs = history(mlflow_uri, cfg(0).tracking.experiment, "train/epoch")
    assert [int(epochs[s]) for s in range(per_epoch[2] + 1, steps + 1)] == [1] * per_epoch[0] + [2]
    assert not [m for m in warned.messages if "other shards" in m], warned.messages


def test_dcp_storage_without_a_process_group_says_nothing_of_assuming_one_process(tmp_path: Path) -> None:
    """DCP warns "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save (load) in a
    single process" on every call without a process group, even one that passes ``no_dist=True`` (torch 2.13); the
    storage, which knows it is one process, says so and keeps it quiet (export's unsharded load, a script reading a
    checkpoint). With several ranks and no group it stays loud: that is a bug to see."""
    import warnings

    import torch.distributed as dist

    from recsys_runner.checkpoint.storage import SINGLE_PROCESS, DcpFileStorage, single_process

    assert not dist.is_initialized()
    storage = DcpFileStorage()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        storage.write(tmp_path / "step_00000001", {"model/w": torch.arange(6.0)}, {}, {"step": 1})
        loaded = {"model/w": torch.zeros(6)}
        storage.load_tensors(tmp_path / "step_00000001", loaded)
    assert loaded["model/w"].tolist() == list(range(6))
    assert [str(w.message) for w in seen if "single process" in str(w.message)] == []
    with warnings.catch_warnings(record=True) as seen, single_process(world_size=2) as alone:
        warnings.simplefilter("always")
        warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in a single "
                      "process.", UserWarning, stacklevel=1)
    assert not alone and len(seen) == 1 and re.match(SINGLE_PROCESS, str(seen[0].message))


def test_init_from_a_run_directory_names_the_checkpoints_folder_to_give(tmp_path: Path) -> None:
    """A daily fine-tune pointed at yesterday's run directory (``outputs/day1``, whose checkpoints are in its ``checkpoints/``)
    was refused with "no complete checkpoint there" alone; ``load=`` named the fix, init_from now too. A path that is not
    there names what init_from takes, a run id among them (looked up by the builder: the tests of init_from=<run id>)."""
    from recsys_runner.checkpoint.config import CheckpointConfig
    from recsys_runner.checkpoint.object_storage import storage_for
    from recsys_runner.checkpoint.resume import init_source

    step = tmp_path / "day1" / "checkpoints" / "step_00000005"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    (step / ".metadata").write_bytes(b"")
    storage = storage_for(tmp_path)
    assert init_source(CheckpointConfig(init_from=str(tmp_path / "day1" / "checkpoints")), storage) == step
    with pytest.raises(CheckpointError, match=re.escape(f"its checkpoints/ folder holds some: it is a training run's directory. "
                                                        f"Fix: checkpoint.init_from={tmp_path}/day1/checkpoints (its newest, step_00000005)")):
        init_source(CheckpointConfig(init_from=str(tmp_path / "day1")), storage)
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint.init_from={tmp_path}/day0: no such directory. Fix: point it at a "
                                                        f"step_* checkpoint, a checkpoints root or the training run's MLflow run id")):
        init_source(CheckpointConfig(init_from=str(tmp_path / "day0")), storage)


def test_init_from_a_root_whose_best_is_not_its_newest_says_which_it_starts_from(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``evaluate``/``export`` ``load=<root>`` take its best checkpoint, ``init_from=<root>`` its newest: yesterday's model
    as compared and served and the one today's run continues differed without a word."""
    from recsys_runner.checkpoint.config import CheckpointConfig
    from recsys_runner.checkpoint.object_storage import storage_for
    from recsys_runner.checkpoint.resume import init_source

    for name in ("best-step_00000003", "step_00000003", "step_00000005"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text("{}")
        (tmp_path / name / ".metadata").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        assert init_source(CheckpointConfig(init_from=str(tmp_path)), storage_for(tmp_path)) == tmp_path / "step_00000005"
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (f"checkpoint.init_from={tmp_path} starts from its newest checkpoint, step_00000005, but evaluate, predict "
                    f"and export given this root (load=) use its best, best-step_00000003: the model you compared or served is "
                    f"not the one this run continues. Name the one you mean: checkpoint.init_from={tmp_path}/best-step_00000003")


@pytest.mark.slow
def test_a_fine_tunes_mlflow_run_names_the_checkpoint_and_run_it_started_from(make_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    """Day N's run, warm-started from day N-1's, named its start only by the ``checkpoint.init_from`` param as typed
    (a relative root); the tags give the checkpoint, its step and the run that wrote it: the chain of days in MLflow.
    Day N-1's MLflow run id, as the UI shows it, starts from the same checkpoint: it was refused as "no such directory",
    though ``load=`` took it."""
    run(make_cfg("train.num_steps=2", f"checkpoint.dir={tmp_path}/day1", "tracking.experiment=days"))
    (day1,) = list_checkpoints(tmp_path / "day1")
    run(make_cfg("train.num_steps=2", f"checkpoint.dir={tmp_path}/day2", f"checkpoint.init_from={tmp_path}/day1",
                 "tracking.experiment=days"))
    client = MlflowClient(tracking_uri=mlflow_uri)
    first, second = client.search_runs([client.get_experiment_by_name("days").experiment_id], order_by=["attributes.start_time ASC"])
    assert "init_from" not in first.data.tags
    lineage = {"init_from": str(day1), "init_from_step": "2", "init_from_run_id": first.info.run_id}
    assert {k: second.data.tags[k] for k in lineage} == lineage
    run(make_cfg("train.num_steps=2", f"checkpoint.dir={tmp_path}/day2b", f"checkpoint.init_from={first.info.run_id}",
                 "tracking.experiment=days"))
    *_, by_id = client.search_runs([client.get_experiment_by_name("days").experiment_id], order_by=["attributes.start_time ASC"])
    assert {k: by_id.data.tags[k] for k in lineage} == lineage
    assert by_id.data.params["checkpoint.init_from"] == first.info.run_id  # the param as typed, the tags as resolved


def test_init_from_a_run_id_that_leads_to_no_checkpoint_names_the_run_the_store_and_the_fix(
        make_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    """``checkpoint.init_from=<MLflow run id>`` is looked up as ``load=`` looks it up (its ``checkpoint_dir`` tag), in the
    store the run logs to; where that leads nowhere, one line says so before anything is built."""
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.create_experiment(f"init_from_ids_{tmp_path.name}")
    untagged = client.create_run(experiment).info.run_id
    moved = client.create_run(experiment, tags={"checkpoint_dir": str(tmp_path / "gone")}).info.run_id
    unknown = "0123456789abcdef0123456789abcdef"

    tracked, untracked = make_cfg(f"checkpoint.dir={tmp_path}/tuned"), make_cfg(f"checkpoint.dir={tmp_path}/tuned", "tracking=none")

    def refused(spec: str, cfg: DictConfig = tracked) -> str:
        cfg.checkpoint.init_from = spec
        with pytest.raises(CheckpointError) as e:
            build(validate(cfg))  # as the command builds: the error comes before the data and the model
        return str(e.value)

    fix = "Fix: tracking.uri=<the store the training run logged to>, or checkpoint.init_from=<its checkpoint directory>"
    assert refused(unknown) == (f"checkpoint.init_from={unknown} is neither a checkpoint directory nor a run in the MLflow store "
                                f"{mlflow_uri} (tracking.uri). {fix}")
    assert refused(untagged) == (f"MLflow run {untagged} in {mlflow_uri} (tracking.uri) has no 'checkpoint_dir' tag (it saved no "
                                 f"checkpoints, or was made by an older recsys_runner); pass the checkpoint directory instead: "
                                 f"checkpoint.init_from=<path>")
    assert refused(moved) == (f"MLflow run {moved} in {mlflow_uri} (tracking.uri) wrote its checkpoints to {tmp_path}/gone, which "
                              f"does not exist on this machine; copy them here and pass checkpoint.init_from=<path>")
    assert refused(unknown, untracked).startswith(
        f"checkpoint.init_from={unknown} looks like an MLflow run id, but this command has no MLflow store to look it up in "
        f"(tracking=none). Fix: drop tracking=none")


def test_init_from_a_checkpoint_whose_plan_trained_a_table_with_the_other_optimizer_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A fine-tune with another data.batch_size flipped 26 first-order tables from data_parallel (the dense optimizer's
    state, ``optim/dense.<param>/sum``) to table_wise (the fused one's, ``optim/sparse.<param>/<table>.momentum1``): their
    state started fresh under "26 tensors not in the checkpoint keep their fresh values", which named no cause."""
    from recsys_runner.checkpoint.weights import _shared

    param = "model.first_order.ebc.embedding_bags.first_order_t_cat_0.weight"
    index: dict[str, list[int] | None] = {f"model/{param}": [16, 1], f"optim/dense.{param}/sum": [16, 1], f"optim/dense.{param}/step": []}
    ours = {f"model/{param}": torch.zeros(16, 1), f"optim/sparse.{param}/first_order_t_cat_0.momentum1": torch.zeros(16, 1)}
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        kept = _shared(Path("ck"), index, ours, {k: k for k in ours}, {})
    assert kept == {f"model/{param}": f"model/{param}"}
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("init_from ck: the optimizer state of 1 embedding tables starts fresh: the checkpoint holds it in its "
                           "dense optimizer, while this run trains them with its sparse one, because the sharding plan placed "
                           "them otherwise"), line
    assert "Fix: give the tables the checkpoint's sharding type (distributed.sharding_types=[...]" in line
