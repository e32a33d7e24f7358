"""Feeding a GPU: DataLoader workers and pinned memory (``data.num_workers``, ``data.pin_memory``).

Synthetic data made by workers is exactly the in-process data; file-backed data with workers reads every row
once per epoch, deterministically; ``auto`` means workers and pinning on CUDA and neither on CPU (checked
without a GPU, by reporting CUDA available).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from torchrec.datasets.utils import Batch

import recsys_runner.data.workers as data_workers
from recsys_runner.__main__ import run
from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.base import MAX_AUTO_WORKERS, auto_workers, data_device_type
from recsys_runner.data.files.tabular import CsvData, ParquetData
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig
from recsys_runner.data.generated.synthetic import SyntheticData
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.errors import ConfigError
from recsys_runner.train.signals import Interrupted
from tests.collecting_dataset import Collecting
from tests.conftest import REPO, LogWarnings
from tests.test_checkpoint import history
from tests.test_sequence_files import columns, histories, write_csv

SMALL = dict(batch_size=16, num_dense=3, num_sparse=4, num_embeddings=50, num_train_rows=16 * 11, num_eval_rows=16 * 5)


def same(a: list[Batch], b: list[Batch]) -> bool:
    """The same batches in the same order: dense, KJT keys/values/lengths, labels, bit for bit."""
    return len(a) == len(b) and all(
        torch.equal(x.dense_features, y.dense_features) and torch.equal(x.labels, y.labels)
        and x.sparse_features.keys() == y.sparse_features.keys()
        and torch.equal(x.sparse_features.values(), y.sparse_features.values())
        and torch.equal(x.sparse_features.lengths(), y.sparse_features.lengths())
        for x, y in zip(a, b, strict=True)
    )


def synthetic_data(**kw: Any) -> SyntheticData:
    return SyntheticData(make(SyntheticDataConfig, **(SMALL | kw)))


@pytest.mark.parametrize("extra", [{}, {"tasks": ["ctr", "cvr", "watch"], "label_kinds": {"watch": "regression"}, "user_item_clusters": 4}],
                         ids=["click", "funnel_and_pairs"])
def test_synthetic_workers_yield_exactly_the_in_process_batches(extra: dict[str, Any]) -> None:
    here, workers = synthetic_data(num_workers=0, **extra), synthetic_data(num_workers=2, **extra)
    assert (here.config.num_workers, workers.config.num_workers) == (0, 2)
    for world in (1, 2):  # 11 batches: odd shares (5 and 6, then 5 each) so one worker has one more
        for rank in range(world):
            for epoch in (0, 1):
                expected = list(here.train_batches(epoch, rank, world))
                assert len(expected) == here.num_train_batches(world) and expected
                assert same(list(workers.train_batches(epoch, rank, world)), expected), (world, rank, epoch)
            assert same(list(workers.eval_batches(rank, world)), list(here.eval_batches(rank, world)))
    # Equal counts per rank, whatever the workers.
    assert {len(list(workers.train_batches(0, r, 3))) for r in range(3)} == {here.num_train_batches(3)}


def test_synthetic_more_workers_than_batches() -> None:
    here, workers = synthetic_data(num_workers=0), synthetic_data(num_workers=4, num_eval_rows=16 * 2)
    assert same(list(workers.eval_batches(0, 1)), list(synthetic_data(num_workers=0, num_eval_rows=16 * 2).eval_batches(0, 1)))
    assert same(list(workers.train_batches(3, 1, 8)), list(here.train_batches(3, 1, 8)))  # 1 batch for this rank


def id_files(tmp_path: Path, n: int = 100) -> Path:
    pq.write_table(pa.table({"label": np.arange(n) % 2, "rid": np.arange(n)}), tmp_path / "a.parquet", row_group_size=7)
    pq.write_table(pa.table({"label": np.arange(n) % 2, "rid": np.arange(n, 2 * n)}), tmp_path / "b.parquet", row_group_size=11)
    lines = ["label,rid", *(f"{i % 2},{i}" for i in range(2 * n))]
    (tmp_path / "ids.csv").write_text("\n".join(lines) + "\n")
    return tmp_path


def reader(kind: str, tmp_path: Path, **kw: Any) -> ParquetData | CsvData:
    common = {"batch_size": 4, "sparse": [{"name": "rid", "num_embeddings": 200}], "shuffle_buffer_rows": 16, "eval_fraction": 0.2} | kw
    if kind == "parquet":
        return ParquetData(make(ParquetDataConfig, path=str(tmp_path / "*.parquet"), **common))
    return CsvData(make(CsvDataConfig, path=str(tmp_path / "ids.csv"), block_rows=13, **common))


def rids(batches: Any) -> list[int]:
    return [i for b in batches for i in b.sparse_features["rid"].values().tolist()]


@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_file_readers_with_workers_read_every_row_once_deterministically(kind: str, tmp_path: Path) -> None:
    """Each (rank, worker) reads its own shard, so the order differs from the in-process one, but an epoch
    holds the same rows, twice the same order, and every rank the same number of batches."""
    id_files(tmp_path)
    here = reader(kind, tmp_path, num_workers=0, drop_remainder=False)
    workers = reader(kind, tmp_path, num_workers=2, drop_remainder=False)
    for epoch in (0, 1):
        for world in (1, 2):
            mine = [rids(workers.train_batches(epoch, r, world)) for r in range(world)]
            assert sorted(sum(mine, [])) == sorted(rids(here.train_batches(epoch, 0, 1)))
            assert mine == [rids(workers.train_batches(epoch, r, world)) for r in range(world)]  # deterministic
    assert sorted(rids(workers.eval_batches(0, 1))) == sorted(rids(here.eval_batches(0, 1)))
    dropped = reader(kind, tmp_path, num_workers=2)
    counts = {len(list(dropped.train_batches(0, r, 2))) for r in range(2)}
    assert counts == {dropped.num_train_batches(2)} and dropped.num_train_batches(2) > 0


# -- auto ------------------------------------------------------------------------------------------


ON_8_CPUS = 6
"""``data.num_workers=auto`` on CUDA with 8 CPUs for one rank: three quarters of them."""


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA reported available (nothing is ever copied to a GPU in these tests), on 8 CPUs: ``auto`` is 6 workers."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")


def test_auto_is_in_process_and_unpinned_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert data_device_type() == "cpu"
    config = make(SyntheticDataConfig, **SMALL)
    assert (config.num_workers, config.pin_memory) == ("auto", None)
    data = config.build()
    assert isinstance(data, SyntheticData) and (data.config.num_workers, data.config.pin_memory) == (0, False)
    assert config.num_workers == "auto", "the run's config keeps its setting; the module gets the decision"
    assert (SyntheticData(config).config.num_workers, SyntheticData(config).config.pin_memory) == (0, False)


def test_auto_workers_per_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    assert auto_workers(1) == MAX_AUTO_WORKERS == 12  # 3/4 of 16: four cores stay with the training process and its threads
    assert auto_workers(2) == 6 and auto_workers(4) == 3  # 3/4 of a rank's 8 and 4 cores
    assert auto_workers(8) == 1 and auto_workers(16) == 1  # at least one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert auto_workers() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)), raising=False)
    assert auto_workers(1) == 12 and auto_workers(4) == 12 and auto_workers(8) == 6  # at most 12 per rank
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    assert auto_workers(1) == 1


class Recorder:
    """Stands in for the loader (WorkerLoader): records its arguments and iterates a real, unpinned one."""

    calls: list[dict[str, Any]]

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, dataset: Any, **kw: Any) -> torch.utils.data.DataLoader:
        self.calls.append(kw)
        return torch.utils.data.DataLoader(dataset, **(kw | {"pin_memory": False}))


def test_auto_uses_workers_and_pinned_memory_on_cuda(fake_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert data_device_type() == "cuda" and auto_workers() == ON_8_CPUS
    config = make(SyntheticDataConfig, **SMALL)
    data = config.build()
    assert isinstance(data, SyntheticData) and (data.config.num_workers, data.config.pin_memory) == (ON_8_CPUS, True)
    loader = Recorder()
    monkeypatch.setattr(data_workers, "WorkerLoader", loader)
    made = list(data.train_batches(0, 0, 1))
    assert [(c["num_workers"], c["pin_memory"]) for c in loader.calls] == [(ON_8_CPUS, True)]
    assert same(made, list(synthetic_data(num_workers=0, pin_memory=False).train_batches(0, 0, 1)))
    # The run's device decides, not the machine: a CPU run on a CUDA machine neither forks nor pins.
    on_cpu = config.build(device=torch.device("cpu"))
    assert isinstance(on_cpu, SyntheticData) and (on_cpu.config.num_workers, on_cpu.config.pin_memory) == (0, False)
    # A value that is set wins over auto.
    fixed = make(SyntheticDataConfig, num_workers=1, pin_memory=False, **SMALL).build(device="cuda:0")
    assert isinstance(fixed, SyntheticData) and (fixed.config.num_workers, fixed.config.pin_memory) == (1, False)


def test_auto_file_reader_on_cuda(fake_cuda: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    id_files(tmp_path)
    config = make(ParquetDataConfig, path=str(tmp_path / "a.parquet"), batch_size=4, eval_fraction=0.2,
                  sparse=[{"name": "rid", "num_embeddings": 200}])
    data = config.build()
    assert isinstance(data, ParquetData) and (data.config.num_workers, data.config.pin_memory) == (ON_8_CPUS, True)
    loader = Recorder()
    monkeypatch.setattr(data_workers, "WorkerLoader", loader)
    assert rids(data.train_batches(0, 0, 1))
    assert [(c["num_workers"], c["pin_memory"]) for c in loader.calls] == [(ON_8_CPUS, True)]
    on_cpu = config.build(device="cpu")
    assert isinstance(on_cpu, ParquetData) and (on_cpu.config.num_workers, on_cpu.config.pin_memory) == (0, False)


@pytest.mark.parametrize(("value", "says"), [(-1, "data.num_workers=-1 must be"), ("many", "data.num_workers='many' must be"),
                                             (1.5, "incompatible with type hint"), (True, "incompatible with type hint")])
def test_num_workers_is_validated(value: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        make(SyntheticDataConfig, num_workers=value, **SMALL)


def test_num_workers_from_the_command_line(make_cfg: Any) -> None:
    assert validate(make_cfg("data=synthetic")).data.num_workers == "auto"
    assert validate(make_cfg("data=synthetic", "data.num_workers=2")).data.num_workers == 2
    cfg = make_cfg("data=parquet", "data.path=/nowhere", "data.num_workers=auto", "data.pin_memory=true", tiny=False)
    assert OmegaConf.select(cfg, "data.num_workers") == "auto" and OmegaConf.select(cfg, "data.pin_memory") is True
    with pytest.raises(ConfigError, match="data.num_workers"):
        validate(make_cfg("data=synthetic", "data.num_workers=lots"))


# -- a resume in the middle of an epoch ------------------------------------------------------------


def _click_csv(path: Path, rows: int = 1200) -> Path:
    rng = np.random.default_rng(0)
    users, items = rng.integers(0, 40, rows), rng.integers(0, 60, rows)
    clicks = ((users + items) % 3 == 0).astype(int)
    path.write_text("click,user,item\n" + "".join(f"{c},{u},{i}\n" for c, u, i in zip(clicks, users, items, strict=True)))
    return path


def _resumable(csv: Path, *extra: str) -> list[str]:
    return ["data=csv", f"data.path={csv}", "data.batch_size=16", "data.label=click", "data.sparse=[{name: user}, {name: item}]",
            "model=deepfm", "optim/dense=adam", "distributed.device=cpu", "train.num_steps=8", "train.log_every_steps=1",
            "train.eval_every_steps=null", *extra]


@pytest.fixture(scope="module")
def forked_losses(mlflow_uri: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The per-step losses of :func:`_resumable`'s 8 steps, uninterrupted, with 2 forked workers on :func:`_click_csv`'s
    rows: what a resume mid-epoch must train again, step for step, whatever starts its workers (one run for the tests of
    both; the constant schedule makes a 3-step run's losses the first 3 of these)."""
    from hydra import compose, initialize_config_dir

    from recsys_runner.config import register_configs
    from recsys_runner.paths import CONFIG_PATH

    root = tmp_path_factory.mktemp("workers_straight")
    csv = _click_csv(root / "clicks.csv")
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        run(compose(config_name="config", overrides=[*_resumable(csv, "data.num_workers=2", f"checkpoint.dir={root}/ck"),
                                                     f"tracking.uri={mlflow_uri}", "tracking.experiment=workers_straight"]))
    return history(mlflow_uri, "workers_straight")


def test_a_resume_mid_epoch_with_workers_trains_the_uninterrupted_runs_batches(make_cfg: Any, mlflow_uri: str, tmp_path: Path,
                                                                              forked_losses: dict[int, float]) -> None:
    """Each of 2 workers reads its own shard: the resumed run skips the batches its checkpoint trained in that same order,
    so its losses are the uninterrupted run's (:func:`forked_losses`), step for step (an epoch is ~33 steps: steps 6..8
    are mid-epoch)."""
    csv = _click_csv(tmp_path / "clicks.csv")
    sliced = make_cfg(*_resumable(csv, "data.num_workers=2", f"checkpoint.dir={tmp_path}/b", "tracking.experiment=workers_sliced",
                                  "train.stop_after_steps=5"), tiny=False)
    with pytest.raises(Interrupted):
        run(sliced)
    with LogWarnings() as warned:
        run(sliced)
    assert not [m for m in warned.messages if "data.num_workers" in m]
    resumed = history(mlflow_uri, "workers_sliced")
    assert sorted(resumed) == list(range(1, 9))
    assert resumed == pytest.approx(forked_losses, rel=1e-5, abs=1e-6)


def test_a_resume_mid_epoch_with_another_worker_count_says_its_epoch_is_cut_otherwise(make_cfg: Any, tmp_path: Path) -> None:
    """File data's epoch order depends on the (rank, worker) shards; a resume on other shards (a changed data.num_workers,
    or num_workers=auto decided on another device) went on without a word, training some rows of that epoch twice and
    others never. Resumed at an epoch's end, nothing is said: the next epoch starts whole."""
    csv = _click_csv(tmp_path / "clicks.csv")
    common = ("tracking=none", f"checkpoint.dir={tmp_path}/ck")
    with pytest.raises(Interrupted):
        run(make_cfg(*_resumable(csv, "data.num_workers=2", "train.stop_after_steps=4", *common), tiny=False))
    with LogWarnings() as warned:
        run(make_cfg(*_resumable(csv, "data.num_workers=0", "train.num_steps=6", *common), tiny=False))
    (said,) = [m for m in warned.messages if "data.num_workers" in m]
    assert "in the middle of epoch 0 (step 4 of it)" in said and "1 rank(s) x 2 shard(s) per rank" in said and "1 rank(s) x 1" in said
    assert "Fix: resume with data.num_workers=2" in said
    with LogWarnings() as again:  # resumed with the shards its checkpoint (step 6) was written with: nothing to say
        run(make_cfg(*_resumable(csv, "data.num_workers=0", "train.num_steps=8", *common), tiny=False))
    assert not [m for m in again.messages if "data.num_workers" in m]


def test_an_epoch_that_drop_remainder_cuts_much_of_is_said_with_its_shards(make_cfg: Any, tmp_path: Path) -> None:
    """Each (rank, worker) shard drops its last partial batch: 4 workers leave ~15% of 900 rows out of every epoch (a run of
    one epoch, file data's default, never trains them), where the same run in process leaves 4 rows out. It went unsaid."""
    csv = _click_csv(tmp_path / "clicks.csv", rows=1000)

    def said(*extra: str) -> list[str]:
        cfg = make_cfg(*_resumable(csv, "data.batch_size=64", "data.eval_fraction=0.1", "tracking=none", "checkpoint=none", *extra), tiny=False)
        with LogWarnings() as warned:
            build(validate(cfg)).close()
        return [m for m in warned.messages if "drop_remainder" in m]

    (warned,) = said("data.num_workers=4")
    rows = int(warned.split(" of its ")[1].split(" ")[0])
    assert 880 < rows < 920 and f"an epoch of this data trains {4 * (rows // 4 // 64) * 64} of its {rows} training rows" in warned
    assert "the last partial batch of each of its 4 shards (1 rank(s) x 4 per rank" in warned
    assert "Fix: data.drop_remainder=false" in warned and "fewer data.num_workers" in warned
    assert not said("data.num_workers=0")
    assert not said("data.num_workers=4", "data.drop_remainder=false")


# -- how workers start (data.worker_start) ---------------------------------------------------------


def test_forkserver_workers_make_the_fork_workers_batches(tmp_path: Path) -> None:
    """Outside fork the worker-side dataset is pickled to each worker and opens its files there: the batches are those of
    forked workers, bit for bit and in the same order (synthetic pairs with funnel labels, hard and sampled negatives;
    Parquet files through a shuffle buffer, every epoch and every rank's eval share; CSV histories in token batches)."""
    extra = {"tasks": ["ctr", "cvr"], "user_item_clusters": 4, "hard_negatives": 2, "negatives": {"num_negatives": 4}}
    forked, served = (synthetic_data(num_workers=2, worker_start=start, **extra) for start in ("fork", "forkserver"))
    for epoch in (0, 1):
        assert same(list(served.train_batches(epoch, 1, 2)), list(forked.train_batches(epoch, 1, 2))), epoch
    assert same(list(served.eval_batches(0, 1)), list(forked.eval_batches(0, 1)))
    id_files(tmp_path)
    forked_files, served_files = (reader("parquet", tmp_path, num_workers=2, worker_start=start) for start in ("fork", "forkserver"))
    for epoch in (0, 1):
        expected = list(forked_files.train_batches(epoch, 0, 1))
        assert expected and same(list(served_files.train_batches(epoch, 0, 1)), expected), epoch
    assert same(list(served_files.eval_batches(1, 2)), list(forked_files.eval_batches(1, 2)))
    write_csv(tmp_path / "histories.csv", histories(0))  # sequences: histories in CSV, batches of history tokens
    forked_seq, served_seq = (CsvData(make(CsvDataConfig, path=str(tmp_path / "histories.csv"), batch_tokens=24, shuffle_buffer_rows=16,
                                           num_workers=2, worker_start=start, **columns("|"))) for start in ("fork", "forkserver"))
    expected = list(forked_seq.train_batches(1, 0, 1))
    assert expected and same(list(served_seq.train_batches(1, 0, 1)), expected)


class _Finalized:
    """An object in a reference cycle (garbage only the collector frees) that writes down the process finalizing it."""

    def __init__(self, log: Path) -> None:
        self.log, self.cycle = log, self

    def __del__(self) -> None:
        with open(self.log, "a") as log:
            log.write(f"{os.getpid()}\n")


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_forked_worker_never_finalizes_the_training_processs_garbage(start: str, tmp_path: Path) -> None:
    """Garbage of the training process still uncollected when a round of workers starts (an earlier run's gloo process
    group in a cycle: its destructor joins threads a forked child does not have, and hangs or aborts there) is finalized
    by the training process, once, and by no worker; the collector is unfrozen again after the workers start."""
    log = tmp_path / "finalized"
    gc.disable()
    try:
        _Finalized(log)
        loader = data_workers.worker_loader(Collecting(), num_workers=2, pin_memory=False, method=start)
        workers = {int(batch) for batch in loader}
    finally:
        gc.enable()
    assert len(workers) == 2 and os.getpid() not in workers
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert log.read_text().split() == [str(os.getpid())]


GLOO_IN_A_CYCLE = """
import datetime, gc, os, sys
import torch, torch.distributed as dist
from recsys_runner.data.workers import worker_loader

class Collecting(torch.utils.data.IterableDataset):
    def __iter__(self):
        gc.collect()
        yield torch.tensor([os.getpid()])

class Run:  # what an earlier in-process run leaves: its process group, in a reference cycle
    pass

gc.disable()
run = Run()
run.cycle, run.group = run, dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
run.group.allreduce(torch.ones(2)).wait()
del run
print(sorted(int(b) for b in worker_loader(Collecting(), num_workers=2, pin_memory=False, method="fork")))
"""


def test_forked_workers_of_a_process_with_a_dead_gloo_group_in_a_cycle_do_not_hang() -> None:
    """The real case behind :class:`WorkerLoader`: a gloo process group that an earlier run left in a reference cycle,
    collected in a forked worker, joins threads the worker does not have (it hangs; CI saw workers abort). In a process of
    its own, so that a hang is a timeout here, not a hung suite."""
    process = subprocess.Popen([sys.executable, "-c", GLOO_IN_A_CYCLE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        out, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the hung workers too
        process.communicate()
        raise AssertionError("the forked workers hung collecting the parent's process group") from None
    assert process.returncode == 0, err[-2000:]
    assert len(out.split(",")) == 2, out


@pytest.mark.parametrize(("settings", "says"), [
    ({"worker_start": "threads"}, "data.worker_start='threads' must be one of ['fork', 'forkserver', 'spawn']"),
    ({"worker_start": "forkserver", "num_workers": 2, "windows": True}, "data.worker_start=forkserver is not available on this platform"),
])
def test_worker_start_is_validated(settings: dict[str, Any], says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if settings.pop("windows", False):
        monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(ConfigError, match=re.escape(says)) as refused:
        make(SyntheticDataConfig, **(SMALL | settings))
    assert "Fix: data.worker_start=" in str(refused.value)


def test_worker_start_needs_no_platform_method_without_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """On Windows (spawn only), forkserver with no workers starts nothing and is fine; fork, the default, falls back to the
    platform's method as it always did."""
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    assert make(SyntheticDataConfig, worker_start="forkserver", num_workers=0, **SMALL).worker_start == "forkserver"
    assert make(SyntheticDataConfig, num_workers=2, **SMALL).worker_start == "fork"
    assert data_workers.worker_context("fork", "m") is None


def test_a_run_resumed_with_forkserver_workers_trains_the_forked_runs_batches(make_cfg: Any, mlflow_uri: str, tmp_path: Path,
                                                                              forked_losses: dict[int, float]) -> None:
    """Training with forkserver workers, stopped after step 2 and resumed in the middle of the epoch: its losses are those of
    the same run with forked workers (:func:`forked_losses`' first 3), step for step."""
    csv = _click_csv(tmp_path / "clicks.csv")
    short = ("train.num_steps=3", "data.num_workers=2")
    served = make_cfg(*_resumable(csv, *short, "data.worker_start=forkserver", f"checkpoint.dir={tmp_path}/b",
                                  "tracking.experiment=start_forkserver", "train.stop_after_steps=2"), tiny=False)
    with pytest.raises(Interrupted):
        run(served)
    run(served)
    resumed = history(mlflow_uri, "start_forkserver")
    assert sorted(resumed) == [1, 2, 3]
    assert resumed == pytest.approx({step: forked_losses[step] for step in (1, 2, 3)}, rel=1e-5, abs=1e-6)
