"""``data.batch_tokens`` on generated histories: batches cut to a token budget, and a runner that counts real rows.

What is checked: every batch fits the budget and is nearly full; a batch is a pure function of its index; ranks get
equal batch counts; bad budgets fail at validation naming the key; a resume trains the same batches; and the logged ``train/samples_per_s`` /
``train/tokens_per_s`` are the rows and tokens really trained over the window's time (a fake clock makes the
window's seconds exact).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torchrec.datasets.utils import Batch

from recsys_runner.__main__ import run
from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.generated.synthetic_sequences import POOL_BATCHES, SyntheticSequences, SyntheticSequencesConfig
from recsys_runner.data.sequences.tokens import padded_slices
from recsys_runner.errors import ConfigError
from recsys_runner.train import throughput
from recsys_runner.train.loop import train
from recsys_runner.train.signals import Interrupted
from recsys_runner.train.throughput import Throughput
from tests.test_checkpoint import history

BUDGET, MAX_LEN = 2048, 60
SMALL = {"num_items": 2000, "num_users": 5000, "num_train_rows": 16_384, "num_eval_rows": 2048}


def tokens_data(**kw: object) -> SyntheticSequences:
    data = make(SyntheticSequencesConfig, **{"batch_tokens": BUDGET, "max_len": MAX_LEN, "length_skew": 1.0, **SMALL, **kw}).build()
    assert isinstance(data, SyntheticSequences)
    return data


def history_tokens(batch: Batch) -> int:
    """The batch's tokens: its history lengths + one per row."""
    return int(batch.sparse_features["hist_item_id"].lengths().sum()) + int(batch.labels.shape[0])


def test_batches_fit_the_budget_and_are_nearly_full() -> None:
    data = tokens_data(group_by_length=False)
    batches = list(itertools.islice(data.train_batches(0, 0, 1), 40))
    used = [history_tokens(b) for b in batches]
    assert all(t <= BUDGET for t in used), used
    # A greedy cut stops at the first row that does not fit: at most one longest row's tokens are left unused.
    assert all(t > BUDGET - (MAX_LEN + 1) for t in used), used
    assert sum(used) / (len(used) * BUDGET) > 0.97
    rows = [int(b.labels.shape[0]) for b in batches]
    assert len(set(rows)) > 1, "rows per batch should vary with the lengths drawn"
    # batch_size (what the planner reads) is the expected rows of a token batch
    assert abs(sum(rows) / len(rows) - data.batch_size) < 0.1 * data.batch_size


def test_grouped_batches_fit_the_budget_pad_little_and_keep_the_lengths() -> None:
    grouped, plain = tokens_data(group_by_length=True), tokens_data(group_by_length=False)
    batches = [grouped.batch(0, i) for i in range(2 * POOL_BATCHES)]  # two whole pools
    lengths = [b.sparse_features["hist_item_id"].lengths() for b in batches]
    used = [history_tokens(b) for b in batches]
    # cut by padded size: rows x (longest + 1) fits the budget, so the tokens do too
    assert all(x.numel() * (int(x.max()) + 1) <= BUDGET for x in lengths)
    assert all(t <= BUDGET for t in used), used
    assert sum(used) / (len(used) * BUDGET) > 0.8, used
    padded = sum(x.numel() * max(int(x.max()), 1) for x in lengths)
    assert padded < 1.2 * sum(used), "rows of a grouped batch should have nearly one length"
    plain_lengths = [plain.batch(0, i).sparse_features["hist_item_id"].lengths() for i in range(2 * POOL_BATCHES)]
    plain_padded = sum(x.numel() * max(int(x.max()), 1) for x in plain_lengths)
    assert plain_padded > 2 * padded  # what grouping is for: mixed lengths pad to the longest row
    # rows are dropped per cut at random, not per length: the mean length stays the data's (within sampling noise)
    mean = float(torch.cat(lengths).float().mean())
    assert abs(mean - (grouped.config.expected_row_tokens() - 1)) < 0.25 * mean
    again = tokens_data(group_by_length=True).batch(0, 5)
    assert torch.equal(again.sparse_features.lengths(), batches[5].sparse_features.lengths())
    assert torch.equal(again.labels, batches[5].labels)


def test_each_batch_is_a_pure_function_of_its_index() -> None:
    a, b = tokens_data(), tokens_data()
    for index in (0, 7):
        x, y = a.batch(0, index), b.batch(0, index)
        assert torch.equal(x.labels, y.labels)
        assert torch.equal(x.sparse_features.values(), y.sparse_features.values())
        assert torch.equal(x.sparse_features.lengths(), y.sparse_features.lengths())
    assert not torch.equal(a.batch(0, 1).sparse_features.lengths(), a.batch(0, 2).sparse_features.lengths())


def test_batches_are_the_same_in_another_process() -> None:
    """Ranks and a resumed run are other processes: a batch must not depend on Python's per-process str hashing."""
    code = ("from recsys_runner.configurable import make\n"
            "from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig as C\n"
            f"d = make(C, batch_tokens={BUDGET}, max_len={MAX_LEN}, length_skew=1.0, num_items=2000, num_users=5000, group_by_length=True)"
            ".build()\nprint([int(d.batch(0, i).labels.sum()) * 100000 + int(d.batch(0, i).labels.shape[0]) for i in range(3)])")
    here = tokens_data(group_by_length=True)
    expected = [int(here.batch(0, i).labels.sum()) * 100000 + int(here.batch(0, i).labels.shape[0]) for i in range(3)]
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        assert out.strip().splitlines()[-1] == str(expected), seed


def fingerprint(batch: Batch) -> str:
    """A digest of the batch's whole content (labels, dense features, history lengths and ids), to tell batches apart."""
    parts = (batch.labels, batch.dense_features, batch.sparse_features.lengths(), batch.sparse_features.values())
    return hashlib.sha256(b"|".join(t.numpy().tobytes() for t in parts)).hexdigest()


def test_ranks_get_equal_batch_counts_of_distinct_batches() -> None:
    """Every batch of an epoch on two ranks: the same count of training batches on each rank (a rank with one batch
    fewer would hang the other in its collective), and no batch trained or evaluated twice (on both ranks, or twice on
    one). Eval: one rank's batches, each once over the two (7 and 6: the evaluator steps the rank with fewer in step)."""
    data = tokens_data(group_by_length=False)
    per_rank = [[fingerprint(b) for b in data.train_batches(0, rank, 2)] for rank in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == data.num_train_batches(2) > 0
    assert data.num_train_batches(2) == SMALL["num_train_rows"] // data.batch_size // 2
    assert len(set(per_rank[0]) | set(per_rank[1])) == 2 * data.num_train_batches(2), "a batch is dealt twice"
    evals = [[fingerprint(b) for b in data.eval_batches(rank, 2)] for rank in (0, 1)]
    alone = [fingerprint(b) for b in data.eval_batches(0, 1)]
    assert len(evals[0]) - len(evals[1]) in (0, 1) and len(evals[1]) > 0
    assert sorted(evals[0] + evals[1]) == sorted(alone) and len(set(alone)) == len(alone), "an eval batch dealt twice or left out"


def test_without_batch_tokens_the_batches_are_unchanged() -> None:
    fixed = make(SyntheticSequencesConfig, batch_size=64, max_len=MAX_LEN, **SMALL).build()
    assert fixed.batch_size == 64 and fixed.batch(0, 3).labels.shape[0] == 64


def test_a_budget_below_one_row_is_refused_at_validation(make_cfg) -> None:
    cfg = make_cfg("model=din", "data=synthetic_sequences", f"data.max_len={MAX_LEN}", f"data.batch_tokens={MAX_LEN}", tiny=False)
    with pytest.raises(ConfigError, match=r"data\.batch_tokens=60 .*max_len=60 events \+ 1 = 61 tokens"):
        validate(cfg)


def test_batch_tokens_on_data_without_histories_is_refused(make_cfg) -> None:
    with pytest.raises(ConfigError, match=r"data\.batch_tokens=4096 .*no histories"):
        validate(make_cfg("model=deepfm", "data.batch_tokens=4096"))


class _Recorder:
    """A tracker that keeps every logged metric."""

    run_id: str | None = None

    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}

    def check(self) -> None: ...
    def start(self, **_: object) -> None: ...
    def resume(self, run_id: str) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def set_tag(self, key: str, value: str) -> None: ...
    def finish(self, status: str) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.logged.setdefault(step, {}).update(metrics)


class _Clock:
    """``time`` for the meter: every reading is one second after the last, so a window lasts exactly 1 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_din_run_logs_samples_and_tokens_per_s_of_the_real_rows(make_cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    args = [f"data.{k}={v}" for k, v in SMALL.items()]
    cfg = make_cfg("model=din", "data=synthetic_sequences", f"data.max_len={MAX_LEN}", "data.length_skew=1.0",
                   f"data.batch_tokens={BUDGET}", *args, "train.num_steps=6", "train.log_every_steps=3",
                   "train.eval_every_steps=null", "train.eval_max_batches=1", "tracking=none", "checkpoint=none",
                   # the fake clock ticks a second per reading: the sanity eval's pause (two readings) would add one
                   "train.sanity_eval_batches=0", "distributed.device=cpu", tiny=False)
    c = build(validate(cfg))
    try:
        trained = list(itertools.islice(c.loop.data.train_batches(0, 0, 1), 6))  # the batches the run trains, in order
        recorder = _Recorder()
        monkeypatch.setattr(throughput, "time", SimpleNamespace(perf_counter=_Clock().perf_counter))
        train(replace(c.loop, tracker=recorder))
    finally:
        c.close()
    for step, window in ((3, trained[:3]), (6, trained[3:])):
        rows = sum(int(b.labels.shape[0]) for b in window)
        assert recorder.logged[step]["train/samples_per_s"] == pytest.approx(rows), step  # rows / 1 s
        assert recorder.logged[step]["train/tokens_per_s"] == pytest.approx(sum(history_tokens(b) for b in window)), step
        assert rows != 3 * c.loop.data.batch_size  # not steps x batch_size


def test_meter_takes_a_steps_micro_batches_in_fetch_order_and_forgets_an_old_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    def batch(rows: int) -> Batch:
        return Batch(dense_features=torch.zeros(rows, 0), sparse_features=None, labels=torch.zeros(rows))  # type: ignore[arg-type]

    monkeypatch.setattr(throughput, "time", SimpleNamespace(perf_counter=_Clock().perf_counter))
    meter = Throughput(10, micro_batches=2)
    batches = meter.counted([batch(3), batch(5), batch(7)])
    next(batches), next(batches), next(batches)  # a pipeline fetches ahead: the third is not trained in this step
    meter.update(torch.tensor(1.0))
    out = meter.flush(step=1)
    assert out["train/samples_per_s"] == 3 + 5 and "train/tokens_per_s" not in out
    epoch = meter.counted([batch(11)])  # a new epoch: the prefetched, untrained 7 rows are forgotten
    next(epoch)
    meter.update(torch.tensor(1.0))  # the epoch's data ended mid-accumulation: its one batch counts
    assert meter.flush(step=2)["train/samples_per_s"] == 11


def test_padded_slices_bound_rows_times_the_widest_row() -> None:
    costs = np.array([1, 1, 2, 2, 3, 5, 5, 9])
    cuts = padded_slices(costs, 10)
    assert cuts == [(0, 4), (4, 6), (6, 7), (7, 8)]  # 4 x 2, 2 x 5, 1 x 5, 1 x 9: each at most 10, each cut greedy
    assert all((b - a) * int(costs[a:b].max()) <= 10 and int(costs[a:b].sum()) <= 10 for a, b in cuts)
    with pytest.raises(ValueError, match="more than the budget"):
        padded_slices(np.array([3, 11]), 10)


def test_a_resumed_token_budget_run_trains_the_same_batches(make_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    """Rows per step vary, so a resume must skip whole batches by index, not rows: the losses match a straight run."""
    args = ["model=din", "data=synthetic_sequences", f"data.max_len={MAX_LEN}", "data.length_skew=1.0", f"data.batch_tokens={BUDGET}",
            "data.group_by_length=true", *[f"data.{k}={v}" for k, v in SMALL.items()], "train.num_steps=6",
            "train.log_every_steps=1", "train.eval_every_steps=null", "train.eval_max_batches=1", "distributed.device=cpu"]
    run(make_cfg(*args, f"checkpoint.dir={tmp_path}/a", "tracking.experiment=tokens_straight", tiny=False))
    sliced = make_cfg(*args, f"checkpoint.dir={tmp_path}/b", "tracking.experiment=tokens_sliced", "train.stop_after_steps=3", tiny=False)
    with pytest.raises(Interrupted, match="after step 3"):
        run(sliced)
    run(make_cfg(*args, f"checkpoint.dir={tmp_path}/b", "tracking.experiment=tokens_sliced", tiny=False))
    expected, resumed = history(mlflow_uri, "tokens_straight"), history(mlflow_uri, "tokens_sliced")
    assert sorted(resumed) == list(range(1, 7))
    assert resumed == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert sorted(history(mlflow_uri, "tokens_sliced", "train/tokens_per_s")) == list(range(1, 7))
