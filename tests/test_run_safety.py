"""Never lose or mix up a run: true resume hints, one writer per checkpoint dir, damaged checkpoints.

The CLI tests run exactly what a user would: the default config (checkpoints in a new Hydra run dir
per launch), the printed resume command executed verbatim, a second launch racing a live one. A launch whose process
is not the point (the one that prints the hint, a refused second writer, a resume after a kill -9, a fixed relaunch) runs
in this process as ``python -m`` would run it (:func:`tests.conftest.run_in_process`): the same exit status and output,
without ~10 s of imports each; the hint itself is executed verbatim, as a process, in the first test.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import pytest
import torch
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from recsys_runner.__main__ import run
from recsys_runner.checkpoint import resume_changes
from recsys_runner.checkpoint.lock import DirectoryInUse, DirectoryLock
from recsys_runner.checkpoint.storage import CheckpointStorage, damage, list_checkpoints
from recsys_runner.checkpoint.weights import load_into
from recsys_runner.config import register_configs
from recsys_runner.errors import CheckpointError
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.train.signals import Interrupted
from tests.conftest import REPO, TINY, hint_of, run_in_process

TRAIN = [sys.executable, "-m", "recsys_runner"]

SMALL = [a for a in TINY if not a.startswith("train.")] + ["train.log_every_steps=1", "train.eval_every_steps=null",
                                                          "train.eval_max_batches=2"]


def runs(uri: str, experiment: str) -> list:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


def steps_logged(uri: str, run_id: str, key: str = "train/loss") -> list[int]:
    return sorted(m.step for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key))


# -- 1. the resume hint is true --------------------------------------------------------------------------------------
def test_stop_hint_executed_verbatim_continues_the_same_mlflow_run(store_uri: str, tmp_path: Path) -> None:
    uri = store_uri
    first = run_in_process([*TRAIN, *SMALL, "train.num_steps=8", "train.stop_after_steps=5", f"tracking.uri={uri}",
                            "tracking.experiment=hint"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Interrupted: stopped by train.stop_after_steps after step 5" in first.stderr
    command = hint_of(first.stderr)
    assert command is not None, first.stderr[-2000:]
    assert any(a.startswith("checkpoint.dir=/") for a in command)  # the default dir was this launch's own run dir
    (mlrun,) = runs(uri, "hint")
    assert mlrun.info.status == "KILLED"

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    outputs = []
    for _ in range(2):  # 5 → 8: the relaunch of the printed command runs one more slice, which ends the run
        again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
        outputs.append(again.stdout + again.stderr)
        if hint_of(again.stderr) is None:
            break
        assert hint_of(again.stderr) == command  # the same command keeps resuming the same dir
    assert len(outputs) == 1 and "resuming from" in outputs[0] and "step_00000005 at step 5" in outputs[0]
    (mlrun,) = runs(uri, "hint")  # one run, continued, not a new one per launch
    assert mlrun.info.status == "FINISHED" and mlrun.data.tags.get("resumed") == "true"
    assert steps_logged(uri, mlrun.info.run_id) == list(range(1, 9))


def test_the_hint_of_a_run_that_resumes_never_still_resumes(store_uri: str, tmp_path: Path) -> None:
    # checkpoint=none (as debug=fast, debug=profile) composes checkpoint.resume=never, yet a stop writes a checkpoint and
    # prints a command to resume it: that command must say checkpoint.resume=auto, or it starts over in a new MLflow run
    # (and writes its own step_00000003 over the one it was to resume from). Twice, so the second hint says it too.
    uri = store_uri
    launch = [*TRAIN, *SMALL, "checkpoint=none", "train.num_steps=7", "train.stop_after_steps=3", f"tracking.uri={uri}",
              "tracking.experiment=never", "hydra.run.dir=outputs/never"]
    first = run_in_process(launch, tmp_path)
    assert first.returncode == 0 and "after step 3" in first.stderr, first.stderr[-3000:]
    # no periodic checkpoints: the start-up line must not promise a resume after a crash
    log = first.stdout + first.stderr
    assert ", written only on a stop by a signal: a crash keeps none (checkpoint.every_steps=N" in log, log[-3000:]
    assert "if this run dies" not in log
    command = hint_of(first.stderr)
    assert command is not None and "checkpoint.resume=auto" in command, first.stderr[-2000:]
    second = run_in_process(command, tmp_path)
    assert second.returncode == 0 and "step_00000003 at step 3" in second.stdout + second.stderr, second.stderr[-3000:]
    assert hint_of(second.stderr) == command  # stable: the relaunch's own hint resumes as well
    third = run_in_process(command, tmp_path)
    assert third.returncode == 0 and hint_of(third.stderr) is None, third.stderr[-3000:]
    (mlrun,) = runs(uri, "never")  # one run, continued twice
    assert mlrun.info.status == "FINISHED" and mlrun.data.tags.get("resumed") == "true"
    assert steps_logged(uri, mlrun.info.run_id) == list(range(1, 8))


def test_nan_guard_hint_resumes_from_a_truly_good_checkpoint(store_uri: str, make_cfg, tmp_path: Path) -> None:
    uri = store_uri
    # The lr jumps to 1e29 for the 5th update: the 5th loss is still finite, the weights after it are not good.
    blowup = ["optim=sgd", "scheduler=manual_step", "scheduler.boundaries=[4]", "scheduler.rates=[1.0,1e30]"]
    common = [*SMALL, "train.num_steps=10", "checkpoint.every_steps=1", f"tracking.uri={uri}", "tracking.experiment=nan_hint"]
    failed = run_in_process([*TRAIN, *common, *blowup], tmp_path)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "Training failed: train loss is nan at step 6" in failed.stderr
    assert ", every 1 steps (if this run dies, resume it with: " in failed.stdout + failed.stderr  # periodic checkpoints outlive a crash
    assert "the last good checkpoint is" in failed.stderr and "step_00000004)" in failed.stderr
    command = hint_of(failed.stderr)
    assert command is not None and "scheduler.rates=[1.0,1e30]" in command
    ckpt_dir = Path(next(a for a in command if a.startswith("checkpoint.dir=")).split("=", 1)[1])
    assert [p.name for p in list_checkpoints(ckpt_dir)][-1] == "step_00000004"
    assert (ckpt_dir / "diverged-step_00000005").is_dir()  # kept for inspection, never resumed from

    fixed = [a if a != "scheduler.rates=[1.0,1e30]" else "scheduler.rates=[1.0,1.0]" for a in command]
    again = run_in_process(fixed, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step_00000004 at step 4" in again.stdout + again.stderr
    (mlrun,) = runs(uri, "nan_hint")
    assert mlrun.info.status == "FINISHED"
    assert steps_logged(uri, mlrun.info.run_id)[-6:] == [5, 6, 7, 8, 9, 10]

    run(make_cfg(*common, "optim=sgd", "tracking.experiment=nan_straight", f"checkpoint.dir={tmp_path}/ref"))  # in-process: faster
    (ref,) = runs(uri, "nan_straight")
    # After the resume the run is exactly the uninterrupted one with the fixed lr (the lr is recomputed, not restored).
    assert mlrun.data.metrics["train/loss"] == pytest.approx(ref.data.metrics["train/loss"], rel=1e-5)


def test_resume_takes_the_new_lr_not_the_saved_one(make_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    args = ["train.num_steps=6", "train.log_every_steps=1", f"checkpoint.dir={tmp_path}"]
    with pytest.raises(Interrupted):
        run(make_cfg(*args, "optim.lr=0.05", "train.stop_after_steps=3"))
    cfg = make_cfg(*args, "optim.lr=0.01")
    run(cfg)
    (mlrun,) = runs(mlflow_uri, cfg.tracking.experiment)
    lrs = {m.step: m.value for m in MlflowClient(tracking_uri=mlflow_uri).get_metric_history(mlrun.info.run_id, "lr/dense")}
    assert lrs[3] == pytest.approx(0.05) and lrs[4] == pytest.approx(0.01) and lrs[6] == pytest.approx(0.01)


def test_resume_with_changed_settings_refuses_another_experiment_and_warns_and_tags_the_rest(
    store_uri: str, tmp_path: Path
) -> None:
    # was: data.batch_size, seed … changed on resume were taken silently (another experiment in the same MLflow run, whose
    # params still showed the first launch's values), and so were optim.lr and train.num_steps
    uri = store_uri
    first = run_in_process([*TRAIN, *SMALL, "train.num_steps=5", "train.stop_after_steps=3", f"tracking.uri={uri}",
                            "tracking.experiment=changed"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    command = hint_of(first.stderr)
    assert command is not None, first.stderr[-2000:]
    ckpt_dir = Path(next(a for a in command if a.startswith("checkpoint.dir=")).split("=", 1)[1])

    refused = run_in_process([*command, "data.batch_size=64", "seed=3"], tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert (f"Checkpoint error: resuming {ckpt_dir}/step_00000003 with changed settings that would make it another experiment: "
            "data.batch_size: 256 -> 64 (the position in the epoch") in refused.stderr
    assert "seed: 0 -> 3 (the resumed run restores the RNG states" in refused.stderr
    assert ("Fix: resume with the run's own settings (put back data.batch_size=256 seed=0 on the command line, or undo the edit "
            f"of the config file that changed it; the first launch's overrides and composed config are in {ckpt_dir}/step_00000003/"
            "meta.json)") in refused.stderr
    assert [p.name for p in list_checkpoints(ckpt_dir)] == ["step_00000003"]  # nothing resumed

    changed = [a.replace("train.num_steps=5", "train.num_steps=6") for a in command]
    warned = run_in_process([*changed, "optim.lr=0.01", "train.log_every_steps=2"], tmp_path)
    assert warned.returncode == 0, warned.stderr[-3000:]
    said = warned.stdout + warned.stderr
    line = "optim.lr: 0.05 -> 0.01; train.num_steps: 5 -> 6"  # train.log_every_steps: how it is watched, silent
    assert said.count(f"resuming {ckpt_dir}/step_00000003 with changed settings: {line}. Each takes effect") == 1, said[-3000:]
    (mlrun,) = runs(uri, "changed")
    assert mlrun.data.tags["resume_changes"] == f"at step 3: {line}" and mlrun.data.params["optim.lr"] != "0.01"


def test_resume_compares_what_was_composed_so_a_yaml_edit_counts_and_a_respelling_does_not(
    store_uri: str, tmp_path: Path
) -> None:
    # was: only the command lines were compared, as text: a preset edited between a launch and its resume trained another
    # experiment into the same MLflow run without a word, while optim.lr=1e-1 for optim.lr=0.1 was warned about
    uri = store_uri
    preset = tmp_path / "my_conf" / "experiment" / "mine.yaml"
    preset.parent.mkdir(parents=True)
    written = "# @package _global_\ndata:\n  seed: 1\ntrain:\n  clip_grad:\n    max: 1.0\n"
    preset.write_text(written)
    first = run_in_process([*TRAIN, "--config-dir", str(preset.parent.parent), "experiment=mine", *SMALL, "train.num_steps=8",
                            "train.stop_after_steps=2", "optim.lr=0.1", "seed=1", f"tracking.uri={uri}", "tracking.experiment=composed"],
                           tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    command = hint_of(first.stderr)
    assert command is not None, first.stderr[-2000:]
    ckpt_dir = Path(next(a for a in command if a.startswith("checkpoint.dir=")).split("=", 1)[1])
    saved = json.loads((ckpt_dir / "step_00000002" / "meta.json").read_text())
    assert saved["config"]["data.seed"] == 1 and saved["config"]["experiment"] == "mine" and saved["cwd"] == str(tmp_path)
    respelled = [{"optim.lr=0.1": "optim.lr=1e-1", "seed=1": "++seed=1"}.get(a, a) for a in command]

    def resumed(argv: list[str], step: int) -> str:
        out = run_in_process(argv, tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        said = out.stdout + out.stderr
        assert f"step_{step:08d} at step {step}" in said, said[-3000:]
        return said

    assert "with changed settings" not in resumed(command, 2)  # the plain resume
    assert "with changed settings" not in resumed(respelled, 4)
    meta = ckpt_dir / "step_00000006" / "meta.json"  # as a checkpoint written before the composed config was saved
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k not in ("config", "cwd")}))
    assert "with changed settings" not in resumed(respelled, 6)  # compared by its overrides, by value: silent
    preset.write_text(written.replace("seed: 1", "seed: 2"))
    refused = run_in_process(command, tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert (f"Checkpoint error: resuming {ckpt_dir}/step_00000008 with changed settings that would make it another experiment: "
            "data.seed: 1 -> 2 (another shuffle order: the position in the epoch") in refused.stderr
    assert "Fix: resume with the run's own settings (put back data.seed=1 on the command line, or undo the edit" in refused.stderr

    preset.write_text(written.replace("max: 1.0", "max: 2.0"))
    longer = [a.replace("train.num_steps=8", "train.num_steps=10") for a in command]
    said = resumed(longer, 8)
    line = "train.clip_grad.max: 1.0 -> 2.0; train.num_steps: 8 -> 10"
    assert said.count(f"resuming {ckpt_dir}/step_00000008 with changed settings: {line}. Each takes effect") == 1, said[-3000:]
    (mlrun,) = runs(uri, "composed")
    assert mlrun.data.tags["resume_changes"] == f"at step 8: {line}"


def test_a_resume_on_another_number_of_ranks_says_how_the_rows_per_step_change() -> None:
    """data.batch_size is per rank: a resharding resume changes the rows every later step trains (a global batch change a
    resume refuses as data.batch_size), and at an epoch's end nothing else said so. Checked by the policy on each resume
    (tests/test_checkpoint_reshard.py sees it said through the CLI, 1 -> 2 and 2 -> 1 ranks)."""
    path = Path("/ck/step_00000020")
    meta = {"world_size": 2, "config": {"data.batch_size": 256, "train.grad_accum_steps": 2, "data.batch_tokens": None}}
    assert resume_changes.rows_per_step_change(meta, path, 2) is None
    said = resume_changes.rows_per_step_change(meta, path, 1)
    assert said is not None and said[0] == "ranks: 2 -> 1 (rows per step x0.5)"
    assert said[1] == ("on 1 rank(s), written by 2: data.batch_size is per rank, so each step from here on trains 1 x "
                       "data.batch_size=256 x train.grad_accum_steps=2 = 512 rows, 1024 before, while train.num_steps, the lr "
                       "schedule and the eval and checkpoint cadence still count steps. Fix: resume on 2 rank(s) to keep the "
                       "rows per step, or start a new run from these weights in its own checkpoint.dir with "
                       "checkpoint.init_from=/ck/step_00000020 data.batch_size=512")
    more = resume_changes.rows_per_step_change({"world_size": 1, "config": {"data.batch_size": 256}}, path, 2)
    assert more is not None and more[1].endswith("data.batch_size=128") and "= 512 rows, 256 before" in more[1]
    odd = resume_changes.rows_per_step_change({"world_size": 2, "config": {"data.batch_size": 100}}, path, 3)  # no whole batch keeps it
    assert odd is not None and odd[1].endswith("checkpoint.init_from=/ck/step_00000020")
    tokens = resume_changes.rows_per_step_change({"world_size": 1, "config": {"data.batch_size": 64, "data.batch_tokens": 4096}}, path, 2)
    assert tokens is not None and "each step from here on trains 2/1 as many rows as before" in tokens[1]


def test_resume_changes_table_treats_each_key_once() -> None:
    assert resume_changes.treatment("checkpoint.every_steps")[0] == "silent" and resume_changes.treatment("distributed.sharding.plan")[0] == "silent"
    # train.profile is a section: profiling a resumed run (train.profile.enabled=true) changes nothing learned
    assert resume_changes.treatment("train.profile.enabled")[0] == "silent" and resume_changes.treatment("train.profile.active")[0] == "silent"
    assert resume_changes.treatment("data.path")[0] == "refuse" and resume_changes.treatment("data")[0] == "refuse"
    assert resume_changes.treatment("optim/sparse")[0] == "refuse" and resume_changes.treatment("model")[0] == "refuse"
    assert resume_changes.treatment("experiment")[0] == "refuse"
    # the loop skips epoch_step x grad_accum_steps batches of the epoch: another accumulation restores another position
    assert resume_changes.treatment("train.grad_accum_steps")[0] == "refuse"
    assert resume_changes.treatment("data.eval_path")[0] == "warn" and resume_changes.treatment("optim.lr")[0] == "warn"
    assert resume_changes.treatment("scheduler")[0] == "warn" and resume_changes.treatment("model.dropout")[0] == "warn"
    path = Path("/ck/step_00000004")

    def changes(saved: list[str] | None, now: list[str] | None) -> tuple[resume_changes.Change, ...]:  # checkpoints saving overrides only
        return resume_changes.check_changes(resume_changes.Launched(saved), resume_changes.Launched(now), path)

    with pytest.raises(CheckpointError, match=r"data.path: a.parquet -> b.parquet \(other training files: .*its overrides are in "):
        changes(["data=parquet", "data.path=a.parquet"], ["data=parquet", "data.path=b.parquet"])
    unchanged = ["data=parquet", "+train.stop_after_steps=3", "checkpoint.every_steps=2"]
    assert changes(unchanged, ["data=parquet", "checkpoint.every_steps=5"]) == ()
    assert changes(None, ["seed=3"]) == ()  # a checkpoint written outside the CLI saved no overrides
    # values, not spellings: was a false alarm (refused or warned) for each of these
    here = os.getcwd()
    assert changes(["optim.lr=0.1", "data.path=./d", "+seed=1", "+data.labels={a:1,b:2}", "data.eval_path=x/../e"],
                   ["optim.lr=1e-1", f"data.path={here}/d", "seed=1", "+data.labels={b:2, a:1}", "data.eval_path=e"]) == ()
    (lr,) = changes(["optim.lr=0.1", "model.deep_layer_sizes=[8,4]"], ["optim.lr=0.2", "model.deep_layer_sizes=[8, 4]"])
    assert lr.line() == "optim.lr: 0.1 -> 0.2"
    (order,) = changes(["model.deep_layer_sizes=[8,4]"], ["model.deep_layer_sizes=[4,8]"])  # a list's order is its meaning
    assert order.line() == "model.deep_layer_sizes: [8,4] -> [4,8]"

    def composed(before: dict, after: dict, cwd_before: str = "/a", cwd_after: str = "/a") -> tuple[resume_changes.Change, ...]:
        return resume_changes.check_changes(resume_changes.Launched([], before, cwd_before), resume_changes.Launched([], after, cwd_after), path)

    # a relative path is read from the directory its launch started in: one file, two spellings; two files, one spelling
    assert composed({"data.path": "d/x.parquet"}, {"data.path": "/a/d/x.parquet"}, "/a", "/b") == ()
    with pytest.raises(CheckpointError, match=r"data.path: x -> /b/x \(other training files.*put back data.path=x on the"):
        composed({"data.path": "x"}, {"data.path": "/b/x"}, "/a", "/b")
    # another option of a group is one change: its keys come with it
    (added, scheduler) = composed({"scheduler": "constant", "scheduler._target_": "C"},
                                  {"scheduler": "cosine", "scheduler._target_": "Co", "scheduler.min_lr": 0.0, "model.dropout": 0.1})
    assert scheduler.line() == "scheduler: constant -> cosine" and added.line() == "model.dropout: (unset) -> 0.1"
    assert added.put_back == "~model.dropout"
    # was: turning the EMA on was refused by the loader naming missing ema/ tensors, not the setting to put back
    with pytest.raises(CheckpointError, match=r"train.ema.decay: null -> 0.99 \(the checkpoint's run trained without a moving "
                                              r"average.*put back train.ema.decay=null on the.*checkpoint.init_from=/ck/step_"):
        composed({"train.ema.decay": None}, {"train.ema.decay": 0.99})
    with pytest.raises(CheckpointError, match=r"train.ema.decay: \(default\) -> 0.99 \(the checkpoint's run trained without"):
        changes([], ["train.ema.decay=0.99"])
    (decay,) = composed({"train.ema.decay": 0.99}, {"train.ema.decay": 0.999})  # another decay of an average it holds
    assert decay.treatment == "warn"
    assert composed({"train.ema.decay": 0.99}, {"train.ema.decay": None})[0].treatment == "warn"  # off: its average unused
    keys = [key for key, _, _ in resume_changes.RESUME_CHANGES]
    assert len(keys) == len(set(keys))


def test_a_resume_outside_the_cli_that_turns_the_ema_on_names_the_setting() -> None:
    """Without a saved config to compare (a run launched from Python) the loader refuses: it named the missing ema/
    tensors and "the same config", not train.ema.decay nor checkpoint.init_from."""
    class Holds:  # a checkpoint whose run trained without EMA: its dense weight, no ema/ twin
        def tensor_index(self, path: Path) -> dict[str, list[int] | None]:
            return {"model/dense.weight": [2, 2]}

    ours = {"model/dense.weight": torch.zeros(2, 2), "ema/model/dense.weight": torch.zeros(2, 2)}
    with pytest.raises(CheckpointError, match=r"holds no moving average of the dense weights \(1 ema/ tensors, e.g. "
                                              r"ema/model/dense.weight\): its run trained without train.ema.decay.*Fix: resume "
                                              r"without train.ema.decay, or .*checkpoint.init_from=/ck/step_00000004"):
        load_into(cast(CheckpointStorage, Holds()), Path("/ck/step_00000004"), ours, rule="resume")


def test_a_slice_ending_on_the_last_step_finishes_the_run(make_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    cfg = make_cfg("train.num_steps=6", "train.stop_after_steps=3", f"checkpoint.dir={tmp_path}")
    with pytest.raises(Interrupted, match="after step 3"):
        run(cfg)
    assert run(cfg) > 0  # steps 4..6 end the run: evaluated and FINISHED, not "interrupted after step 6"
    (mlrun,) = runs(mlflow_uri, cfg.tracking.experiment)
    assert mlrun.info.status == "FINISHED" and "eval/auc" in mlrun.data.metrics


# -- 2. one writer per checkpoint directory -------------------------------------------------------------------------
def test_directory_lock_names_its_holder_and_frees_on_release(tmp_path: Path) -> None:
    first, second = DirectoryLock(tmp_path / "ckpt"), DirectoryLock(tmp_path / "ckpt")
    first.acquire()
    with pytest.raises(DirectoryInUse, match=rf"in use by another live run: host {socket.gethostname()}, pid {os.getpid()}"):
        second.acquire()
    first.release()
    second.acquire()  # a released (or dead) holder does not block
    assert json.loads((tmp_path / "ckpt" / ".lock").read_text())["pid"] == os.getpid()
    second.release()


def test_a_checkpoint_dir_on_a_file_system_without_locks_is_refused_at_start_with_the_fix(
    make_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS mounted ``nolock`` (or a FUSE mount) answers ``flock`` with ENOLCK: a clear error naming the directory and
    the fix before anything is built, not an ``OSError`` traceback."""
    import errno
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(CheckpointError, match=rf"checkpoint.dir={tmp_path}/ck: its file system refuses file locks "
                                              r"\(No locks available\).*Fix: set checkpoint.dir=<a directory on a local disk"):
        run(make_cfg(f"checkpoint.dir={tmp_path}/ck", "tracking=none"))


@pytest.mark.slow
def test_second_live_writer_is_refused_and_a_killed_ones_lock_does_not_block_resume(store_uri: str, tmp_path: Path) -> None:
    uri = store_uri
    ckpt = tmp_path / "shared_ckpt"
    args = [*SMALL, "train.num_steps=100000", "checkpoint.every_steps=5", f"checkpoint.dir={ckpt}", f"tracking.uri={uri}",
            "tracking.experiment=lock"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    live = subprocess.Popen([sys.executable, "-m", "recsys_runner", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert live.stdout is not None
        deadline = time.monotonic() + 240
        for line in live.stdout:
            if "checkpoint saved" in line or time.monotonic() > deadline:
                break
        assert live.poll() is None
        for tid in os.listdir(f"/proc/{live.pid}/task"):  # still live and writing, but no longer on the cores the second needs
            os.setpriority(os.PRIO_PROCESS, int(tid), 19)  # (not SIGSTOP: stopped inside a commit, it would lock MLflow's sqlite)
        second = run_in_process([*TRAIN, *args], tmp_path)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"Checkpoint error: checkpoint.dir: {ckpt} is in use by another live run: host {socket.gethostname()}, pid {live.pid}" \
            in second.stderr
        assert "Fix:" in second.stderr and "Traceback" not in second.stderr
        (mlrun,) = runs(uri, "lock")  # the refused launch neither created a run nor took over the live one
        assert mlrun.info.status == "RUNNING"
    finally:
        live.send_signal(signal.SIGKILL)  # dies holding the lock: no cleanup at all
        live.wait(timeout=60)
    resumed = run_in_process([*TRAIN, *args, "train.stop_after_steps=3"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout + resumed.stderr and "previous holder" in resumed.stdout + resumed.stderr
    (again,) = runs(uri, "lock")
    assert again.info.run_id == mlrun.info.run_id


# -- 5. damaged checkpoints -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory: pytest.TempPathFactory, created_store: Path) -> Path:
    """A TINY DeepFM trained 6 steps with a checkpoint every 2, once for the damaged-checkpoint tests, in a store of its
    own (``mlflow.db`` next to ``ckpt/``, experiment ``damaged``): each test damages a copy of both
    (:func:`_three_checkpoints`)."""
    root = tmp_path_factory.mktemp("three_checkpoints")
    shutil.copyfile(created_store, root / "mlflow.db")
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        run(compose(config_name="config", overrides=[*TINY, "train.num_steps=6", "checkpoint.every_steps=2",
                                                     f"checkpoint.dir={root}/ckpt", f"tracking.uri=sqlite:///{root}/mlflow.db",
                                                     "tracking.experiment=damaged"]))
    return root


def _three_checkpoints(three_checkpoints: Path, tmp_path: Path) -> tuple[list[Path], str]:
    """This test's copy of :func:`three_checkpoints`: its checkpoints (in ``<tmp_path>/ckpt``) and the URI of its store,
    whose one run wrote them."""
    shutil.copytree(three_checkpoints / "ckpt", tmp_path / "ckpt")
    shutil.copyfile(three_checkpoints / "mlflow.db", tmp_path / "mlflow.db")
    found = list_checkpoints(tmp_path / "ckpt")
    assert [p.name for p in found] == ["step_00000002", "step_00000004", "step_00000006"]
    return found, f"sqlite:///{tmp_path}/mlflow.db"


@pytest.mark.parametrize("harm", ["truncate_data", "delete_data", "delete_metadata", "edit_meta"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one_with_a_warning(
    make_cfg, three_checkpoints: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, harm: str
) -> None:
    found, uri = _three_checkpoints(three_checkpoints, tmp_path)
    newest, ckpt = found[-1], tmp_path / "ckpt"
    data = newest / "__0_0.distcp"
    if harm == "truncate_data":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif harm == "delete_data":
        data.unlink()
    elif harm == "delete_metadata":
        (newest / ".metadata").unlink()
    else:  # by hand: a resume would fail part-way, reading where training stands
        meta = json.loads((newest / "meta.json").read_text())
        del meta["epoch"]
        (newest / "meta.json").write_text(json.dumps(meta))
    assert damage(newest) is not None
    cfg = make_cfg("train.num_steps=8", "checkpoint.every_steps=2", f"checkpoint.dir={ckpt}", f"tracking.uri={uri}",
                   "tracking.experiment=damaged")
    with caplog.at_level(logging.WARNING, logger="recsys_runner.checkpoint"):
        run(cfg)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert f"checkpoint {newest} is damaged" in warned and "falling back" in warned
    assert f"resuming from {newest.with_name('step_00000004')}" in warned
    assert (ckpt / "damaged-step_00000006").is_dir()  # kept for inspection, not deleted
    assert [p.name for p in list_checkpoints(ckpt)][-1] == "step_00000008"
    (mlrun,) = runs(uri, "damaged")  # the run that wrote step 4, continued
    assert "step_00000006" in mlrun.data.tags["checkpoint_fallback"] and mlrun.info.status == "FINISHED"


def test_all_damaged_or_a_damaged_explicit_choice_is_refused_with_the_way_out(make_cfg, three_checkpoints: Path,
                                                                             tmp_path: Path) -> None:
    found, _ = _three_checkpoints(three_checkpoints, tmp_path)
    ckpt = tmp_path / "ckpt"
    (found[-1] / "rank0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint.resume=.*step_00000006: this checkpoint is damaged \(rank0.pt is missing\)\. "
                                              r"Fix: checkpoint.resume=.*step_00000004"):
        run(make_cfg("train.num_steps=8", f"checkpoint.dir={ckpt}", f"checkpoint.resume={found[-1]}", "tracking=none"))
    for p in found[:-1]:
        (p / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"every checkpoint in .* is damaged .* Fix: start over with checkpoint.resume=never"):
        run(make_cfg("train.num_steps=8", f"checkpoint.dir={ckpt}", "tracking=none"))
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("damaged-")) == [
        "damaged-step_00000002", "damaged-step_00000004", "damaged-step_00000006"]
