"""A run saved before a module split still resumes and evaluates: what a checkpoint records of its launch names classes
and config options by their paths, and those must keep resolving, unchanged, after code moves between modules.

A checkpoint's ``meta.json`` holds its launch's overrides (which evaluate, predict and export carry over) and its
composed config flattened (which a resume compares, key by key, with its own launch's). The classes in it are named
only by ``_target_`` (a dotted path) and the options by their group's choice; per-rank objects are pickled without
any class of ours (plain state dicts). So moving a class that a ``_target_`` names would make a resume see a changed
setting and an old path fail to import; moving anything else (the split of ``optim/optimizers.py``,
``models/common.py``, ``config.py`` and ``build.py``: no ``_target_`` names what moved) changes nothing a saved run
reads. :data:`SAVED` is, literally, what a checkpoint written before that split recorded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from recsys_runner.configurable import locate_class
from tests.conftest import run_in_process

SAVED = yaml.safe_load("""
# meta.json of recsys_runner c29aa42 (before the split): model=mmoe with Pareto loss weighting, the AdamW dense optimizer
# and a cosine schedule of the fused Adagrad's lr. Its overrides, and of its composed config every _target_ and choice.
overrides:
  - model=mmoe
  - train.loss_weighting.kind=pareto
  - data.batch_size=128
  - data.num_embeddings=100
  - data.num_train_rows=4096
  - data.num_eval_rows=1024
  - train.num_steps=10
  - train.eval_every_steps=null
  - distributed.device=cpu
  - tracking=none
  - optim/dense=adamw
  - scheduler.warmup_steps=0
  - +scheduler@optim.sparse_scheduler=cosine
  - optim.sparse_scheduler.warmup_steps=0
config:
  debug: null
  experiment: null
  checkpoint: default
  tracking: none
  precision: fp32
  distributed: env
  scheduler: constant
  optim: adagrad
  optim/dense: adamw
  optim/sparse: adagrad
  data: synthetic
  model: mmoe
  experiment/data@data: None_synthetic
  experiment/model@model: None_mmoe
  model._target_: recsys_runner.models.mmoe.MMoE
  data._target_: recsys_runner.data.generated.synthetic.SyntheticData
  optim.sparse._target_: torchrec.optim.Adagrad
  optim.dense._target_: torch.optim.AdamW
  optim.sparse_scheduler._target_: recsys_runner.optim.schedulers.Cosine
  scheduler._target_: recsys_runner.optim.schedulers.Constant
  distributed._target_: recsys_runner.distributed.sharding.Distributed
  precision._target_: recsys_runner.train.precision.Precision
  tracking._target_: recsys_runner.tracking.tracker.NullTracker
  checkpoint._target_: recsys_runner.checkpoint.policy.Checkpointer
""")


def _saved_targets() -> dict[str, str]:
    return {key: value for key, value in SAVED["config"].items() if key.endswith("._target_")}


@pytest.mark.parametrize("key", sorted(_saved_targets()))
def test_every_class_a_saved_run_names_still_imports(key: str) -> None:
    target = _saved_targets()[key]
    assert locate_class(target).__name__ == target.rsplit(".", 1)[-1]  # a ConfigError naming the path if it moved


def test_a_run_saved_before_the_split_resumes_and_evaluates_with_no_changed_setting(tmp_path: Path) -> None:
    checkpoints = tmp_path / "ck"
    launch = [*SAVED["overrides"], f"checkpoint.dir={checkpoints}"]
    first = run_in_process([sys.executable, "-m", "recsys_runner", *launch, f"hydra.run.dir={tmp_path}/run1"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]

    # The checkpoint as the run before the split wrote it: its launch's overrides and composed config's targets and
    # choices, literally (the weights and the rest of the config are what the same launch writes now).
    meta_file = checkpoints / "step_00000010" / "meta.json"
    meta = json.loads(meta_file.read_text())
    assert set(SAVED["config"]) <= set(meta["config"]), "the saved config's keys are the ones a run records"
    meta["overrides"] = launch
    meta["config"] |= SAVED["config"]
    meta_file.write_text(json.dumps(meta))

    resumed = run_in_process([sys.executable, "-m", "recsys_runner", *launch, "train.num_steps=12",
                              f"hydra.run.dir={tmp_path}/run2"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    logged = resumed.stdout + resumed.stderr
    assert f"resuming from {checkpoints}/step_00000010 at step 10" in logged
    changed = [line for line in logged.splitlines() if "with changed settings" in line]
    assert len(changed) == 1 and "train.num_steps: 10 -> 12" in changed[0], changed
    assert "_target_" not in changed[0] and "optim/" not in changed[0], changed  # nothing the saved config named moved
    assert (checkpoints / "step_00000012" / "meta.json").is_file()

    # evaluate carries the saved overrides (meta.json's) into its own composition
    evaluated = run_in_process([sys.executable, "-m", "recsys_runner.evaluate", f"load={checkpoints}/step_00000010",
                                f"hydra.run.dir={tmp_path}/run3"], cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "eval/ctr/auc=" in evaluated.stdout + evaluated.stderr
