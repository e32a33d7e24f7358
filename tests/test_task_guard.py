"""The NaN guard names a multi-task model's task whose loss went non-finite, with its kind's fix (docs/training.md).

A regression task's huge amounts (1e20: its squared error overflows float32) stopped training with the guard's general
message (a learning rate too high, fp16, bad data), which did not say which task, nor that the amounts need scaling.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_runner.__main__ import run
from recsys_runner.checkpoint.guard import NonFiniteLossError

ROWS = 64


def _amounts(path: Path, huge: float) -> str:
    """A click and an amount label, one amount ``huge`` (row 5: in the first batch), and two id columns."""
    rng = np.random.default_rng(0)
    amount = rng.random(ROWS) * 20
    amount[5] = huge
    pq.write_table(pa.table({"click": rng.integers(0, 2, ROWS), "gmv": amount, "item": rng.integers(0, 20, ROWS),
                             "user": rng.integers(0, 10, ROWS)}), path)
    return str(path)


@pytest.mark.parametrize("where", [
    ["train.log_every_steps=1"],  # checked at a log step (the mean loss since the last log)
    ["train.log_every_steps=100", "checkpoint.every_steps=1"],  # before a checkpoint, between log steps (the step's loss)
], ids=["log_step", "checkpoint"])
def test_a_non_finite_task_loss_names_its_task_and_fix(make_cfg, tmp_path: Path, where: list[str]) -> None:
    cfg = make_cfg("model=mmoe", "model.tasks=[ctr,gmv]", "model.task_kinds=[binary,regression]", "data=parquet",
                   f"data.path={_amounts(tmp_path / 'a.parquet', 1e20)}", "data.label=null", "data.labels={ctr: click, gmv: gmv}",
                   "data.label_kinds={gmv: regression}", "data.sparse=[{name: item}, {name: user}]", "data.batch_size=16",
                   "train.num_steps=2", "train.eval_every_steps=null", "distributed.device=cpu", "tracking=none",
                   f"checkpoint.dir={tmp_path}/ck", *where, tiny=False)
    with pytest.raises(NonFiniteLossError, match=r"train loss is inf at step 1; .* task 'gmv' \(regression\) has loss inf: MSE "
                                                 r"squares each error.* Fix: scale the label column \(e\.g\. log1p .*"
                                                 r"'\+model\.task_specs\.gmv\.kind=huber'") as e:
        run(cfg)
    assert "task 'ctr'" not in str(e.value)  # the binary task's loss stayed finite
