"""Resharding resume: a checkpoint written by 2 ranks (column-wise embedding shards) resumes on 1 rank, and one
written by 1 rank resumes on 2, continuing the same MLflow run from the saved step.

torch.distributed.checkpoint stores every ShardedTensor (DMP embedding shards and the fused optimizer's state)
as one global tensor with its shards' offsets, and loads into whatever sharding the new plan gives.

Every 2-rank part of the module's four tests is a job of one torchrun launch (:func:`launched`, :mod:`tests.rank_jobs`),
each job in its test's own folder with its own output files; the 1-rank parts run in this process, before the launch
(checkpoints it resumes) or after it (resuming its checkpoints).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import recsys_runner.__main__ as entry
from recsys_runner.checkpoint.config import TrainState
from recsys_runner.checkpoint.resume_changes import epoch_cut_change
from recsys_runner.checkpoint.storage import DcpFileStorage, list_checkpoints
from recsys_runner.config import register_configs
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.train.signals import Interrupted
from tests.conftest import REPO, TINY, LogWarnings, free_port
from tests.rank_jobs import jobs, run_jobs

pytestmark = pytest.mark.slow

STEPS, SLICE = 12, 5
WIDE = ["data.num_sparse=4", "model.embedding_dim=256"]
"""Tables twice as wide as TorchRec's narrowest column shard (128), so column-wise sharding on 2 ranks splits every
table's columns between them: resharding then cuts and joins the tables themselves, not only moves whole ones."""


def _overrides(tmp_path: Path, experiment: str) -> list[str]:
    return [*[a for a in TINY if not a.startswith("train.")], *WIDE, f"train.num_steps={STEPS}", "train.log_every_steps=1",
            "train.eval_every_steps=null", "train.eval_max_batches=2", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"tracking.experiment={experiment}", f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.keep_last=null"]


def _job(tmp_path: Path, *overrides: str, column_wise: bool = True) -> tuple[Path, dict[str, str], list[str]]:
    """A 2-rank job of :func:`launched` in ``tmp_path``."""
    return tmp_path, {}, [*(["distributed.sharding_types=[column_wise]"] if column_wise else []), f"hydra.run.dir={tmp_path}/run2",
                          *overrides]


def _said(tmp_path: Path, stream: str = "stderr") -> str:
    """What the 2-rank job in ``tmp_path`` wrote to ``stream`` (both ranks, rank 0 first)."""
    return "".join((tmp_path / f"rank{r}.{stream}").read_text() for r in (0, 1))


def _run_in_process(*overrides: str) -> float:
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return entry.run(cfg)


def _saved(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint as one full tensor, whatever sharding wrote it."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    full = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
    DcpFileStorage().load_tensors(path, full)  # one process, no group: the storage tells DCP so, which then does not warn
    return full


def _wide_tables(saved: dict[str, torch.Tensor]) -> list[str]:
    """The embedding tables of :data:`WIDE`'s width (DeepFM's first-order tables are one column: never split)."""
    return [k for k, v in saved.items() if k.startswith("model/") and "embedding_bags" in k and v.shape[-1] == 256]


def _one_run(tmp_path: Path, experiment: str) -> tuple[object, list[int]]:
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run, sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))


def test_two_rank_checkpoint_resumes_on_one_rank(launched: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path = _launched(launched, "2to1")
    args = _overrides(tmp_path, "reshard_2to1")
    stderr = _said(tmp_path)
    assert stderr.count("Resume this run from") == 1, stderr[-4000:]  # told by rank 0 alone: every rank agreed
    (ckpt,) = list_checkpoints(tmp_path / "ckpt")
    saved = _saved(ckpt)
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    wide = _wide_tables(saved)
    assert wide and all(len(meta[k].chunks) == 2 for k in wide), "each wide table should be saved as 2 column shards"

    loaded: dict[str, torch.Tensor] = {}
    real_train = entry.train

    def check_then_train(loop):  # right after build() restored the 2-rank checkpoint onto 1 rank
        flat = loop.checkpointer._tensor_state()
        for k, v in flat.items():
            full = v.local_tensor() if hasattr(v, "local_tensor") else v  # 1 rank: the one shard is the whole table
            loaded[k] = full.detach().clone()
        assert loop.state.step == SLICE
        return real_train(loop)

    monkeypatch.setattr(entry, "train", check_then_train)
    with LogWarnings() as warned:
        _run_in_process(*args)
    # mid-epoch on another number of ranks: what happens to the rest of that epoch's rows is said, not left silent
    assert [w for w in warned.messages if "other shards" in w] == [
        f"resuming {ckpt} in the middle of epoch 0 (step {SLICE} of it), whose rows it now cuts into other shards than the "
        f"run it continues: 2 rank(s) x 1 shard(s) per rank then, 1 rank(s) x 1 now (file data: each rank and each of its "
        f"data.num_workers DataLoader workers reads its own share; data.num_workers=auto decides by the device). The order "
        f"of the epoch's batches follows the shards, so the batches skipped to reach the step are not the ones the "
        f"checkpoint trained: rows of this epoch are trained twice or never (the epochs after it are whole). Fix: resume "
        f"with 2 rank(s), as the run was written"]
    mid, start = TrainState(step=SLICE, epoch_step=SLICE), TrainState(step=SLICE, epoch=1)
    assert epoch_cut_change({"world_size": 2, "data_shards_per_rank": 1}, mid, 2, 1) is None  # the same ranks
    assert epoch_cut_change({"world_size": 2, "data_shards_per_rank": 1}, start, 1, 1) is None  # at an epoch's start
    assert epoch_cut_change({"world_size": 2}, mid, 1, 1) is not None  # an older checkpoint: compared by its ranks
    assert set(loaded) == set(saved), set(loaded) ^ set(saved)
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), f"{k} differs after resharding 2 → 1 ranks"
    run, steps = _one_run(tmp_path, "reshard_2to1")
    assert run.info.status == "FINISHED" and run.data.tags["resumed"] == "true"
    assert steps == list(range(1, STEPS + 1)), steps


EPOCH_ROWS, BATCH = 4096, 256
"""An epoch of 16 batches: 16 steps on 1 rank, 8 on each of 2."""
PER_EPOCH = {r: EPOCH_ROWS // BATCH // r for r in (1, 2)}


def _epoch_args(tmp_path: Path, saved_on: int, resumed_on: int) -> list[str]:
    steps = PER_EPOCH[saved_on] + PER_EPOCH[resumed_on] + 1
    return [*[a for a in TINY if not a.startswith(("train.", "data.num_train_rows", "data.batch_size"))],
            f"data.num_train_rows={EPOCH_ROWS}", f"data.batch_size={BATCH}", f"train.num_steps={steps}", "train.log_every_steps=1",
            "train.eval_every_steps=null", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.experiment=epoch_end",
            f"checkpoint.dir={tmp_path}/ckpt"]


def _in_process(*overrides: str) -> str:
    """A 1-rank run in this process, stopped or not: the warnings it logged."""
    with LogWarnings() as warned:
        try:
            _run_in_process(*overrides)
        except Interrupted:
            pass
    return "\n".join(warned.messages)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The module's one torchrun launch: a folder per test, the 1-rank checkpoints the launch resumes written before it
    (``saved``: the checkpoints then, ``said``: the 1-rank run's warnings), the 2-rank checkpoints the tests resume after
    it. ``returncode``: the launch's."""
    root = tmp_path_factory.mktemp("reshard")
    dirs = {name: root / name for name in ("2to1", "1to2", "epoch_1to2", "epoch_2to1")}
    for d in dirs.values():
        d.mkdir()
    with pytest.raises(Interrupted):
        _run_in_process(*_overrides(dirs["1to2"], "reshard_1to2"), f"train.stop_after_steps={SLICE}")
    said = {"epoch_1to2": _in_process(*_epoch_args(dirs["epoch_1to2"], 1, 2), f"train.stop_after_steps={PER_EPOCH[1]}")}
    saved = {name: list_checkpoints(dirs[name] / "ckpt") for name in ("1to2", "epoch_1to2")}
    env = jobs(_job(dirs["2to1"], *_overrides(dirs["2to1"], "reshard_2to1"), f"train.stop_after_steps={SLICE}"),
               _job(dirs["epoch_2to1"], *_epoch_args(dirs["epoch_2to1"], 2, 1), f"train.stop_after_steps={PER_EPOCH[2]}", column_wise=False),
               _job(dirs["1to2"], *_overrides(dirs["1to2"], "reshard_1to2")),
               _job(dirs["epoch_1to2"], *_epoch_args(dirs["epoch_1to2"], 1, 2), column_wise=False), own_output=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", "tests.test_checkpoint_reshard", "distributed.timeout_s=120"]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600, env={**os.environ, **env, "PYTHONPATH": str(REPO)})
    return {"dirs": dirs, "saved": saved, "said": said, "returncode": out.returncode, "output": (out.stdout + out.stderr)[-4000:]}


def _launched(launched: dict[str, Any], name: str) -> Path:
    """The folder of test ``name``, once its 2-rank job ended well."""
    d = launched["dirs"][name]
    assert launched["returncode"] == 0, launched["output"] + "\n".join(
        f"{f.name}: {f.read_text()[-3000:]}" for f in sorted(d.glob("rank*.std*")))
    return d


Pieces = list[tuple[list[int], torch.Tensor]]
"""One rank's pieces of a tensor, each with its offsets in the whole one."""


def _local_pieces(value: Any) -> tuple[bool, Pieces]:
    """Whether a loaded tensor is sharded, and this rank's pieces of it: a ShardedTensor's local shards (none when the
    rank holds none of it), or the whole tensor at offset 0 (a dense one, replicated on every rank)."""
    if isinstance(value, ShardedTensor):
        return True, [(list(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()]
    assert isinstance(value, torch.Tensor), type(value)
    return False, [([0] * value.dim(), value.detach().clone())]


def _dump_loaded_then_train(loop: Any) -> dict[str, float]:
    """``entry.train`` of a ``python -m tests.test_checkpoint_reshard`` rank: saves what build() restored on this rank
    (before any step) to ``loaded_rank<r>.pt`` in the working directory, then trains."""
    loaded = {k: _local_pieces(v) for k, v in loop.checkpointer._tensor_state().items()}
    torch.save({"step": loop.state.step, "tensors": loaded}, Path.cwd() / f"loaded_rank{torch.distributed.get_rank()}.pt")
    return _real_train(loop)


def test_one_rank_checkpoint_resumes_on_two_ranks(launched: dict[str, Any]) -> None:
    """What the two ranks restored (each dumped it before its first step) is the one rank's saved tensors: every key on
    some rank (a table's optimizer state only where the table is), the sharded ones covered exactly once by the ranks'
    shards and the dense ones whole on both, every element equal, and every wide table's columns split between the ranks
    (:data:`WIDE`)."""
    tmp_path = _launched(launched, "1to2")
    (ckpt,) = launched["saved"]["1to2"]  # the 1-rank run's, before the launch
    saved = _saved(ckpt)
    said = _said(tmp_path) + _said(tmp_path, "stdout")
    assert f"resuming from {ckpt} at step {SLICE}" in said
    assert "1 rank(s) x 1 shard(s) per rank then, 2 rank(s) x 1 now" in said
    ranks = [torch.load(tmp_path / f"loaded_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [r["step"] for r in ranks] == [SLICE, SLICE]
    assert set(ranks[0]["tensors"]) | set(ranks[1]["tensors"]) == set(saved)
    tables = [k for k in saved if k.startswith("model/") and "embedding_bags" in k]
    held = [{k for k in tables if ranks[r]["tensors"][k][1]} for r in (0, 1)]
    assert held[0] | held[1] == set(tables), "the two ranks should hold the tables between them"
    assert set(_wide_tables(saved)) <= held[0] & held[1], "column-wise on 2 ranks: each should hold a part of every wide table"
    for k, whole in saved.items():
        mine = [rank["tensors"][k] for rank in ranks if k in rank["tensors"]]
        sharded = mine[0][0]
        assert sharded or len(mine) == 2, f"{k}: a dense tensor must be restored on both ranks"
        covered = torch.zeros(whole.shape, dtype=torch.int32)
        for _, pieces in mine:
            for offsets, piece in pieces:
                where = tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape, strict=True))
                assert torch.equal(piece, whole[where]), f"{k} at {offsets} differs after resharding 1 → 2 ranks"
                covered[where] += 1
        assert (covered == (1 if sharded else 2)).all(), f"{k}: the ranks' pieces do not cover it as they should"
    run, steps = _one_run(tmp_path, "reshard_1to2")
    assert run.info.status == "FINISHED" and run.data.tags["resumed"] == "true" and run.data.tags["world_size"] == "1"
    assert steps == list(range(1, STEPS + 1)), steps
    # The 2-rank run's final checkpoint holds column-wise shards again, readable as whole tables.
    final = _saved(list_checkpoints(tmp_path / "ckpt")[-1])
    assert all(torch.isfinite(v).all() for v in final.values())


_real_train = entry.train

if __name__ == "__main__":  # a rank of the module's torchrun (:func:`launched`): its jobs dump what they restored
    entry.train = _dump_loaded_then_train
    run_jobs()


@pytest.mark.parametrize("ranks", [(1, 2), (2, 1)], ids=["1to2", "2to1"])
def test_a_checkpoint_at_an_epochs_end_resumes_on_other_ranks_at_the_next_epochs_start(launched: dict[str, Any],
                                                                                      ranks: tuple[int, int]) -> None:
    """A run stopped right after the last step of epoch 0 (``train.stop_after_steps`` = its steps per epoch) resumes on
    another number of ranks at the start of epoch 1: no "other shards" warning (the position is no epoch's middle), no
    batch of epoch 0 trained again (on 1 rank, 2 ranks' 8 steps are half of epoch 0's 16), none of epoch 1 skipped (on
    2 ranks, 1 rank's 16 steps are more than epoch 0's 8): every step after the resume is one of epoch 1, which is
    whole (the new ranks' steps per epoch), and then epoch 2 begins."""
    saved_on, resumed_on = ranks
    name = f"epoch_{saved_on}to{resumed_on}"
    tmp_path = _launched(launched, name)
    per_epoch = PER_EPOCH
    stop, steps = per_epoch[saved_on], per_epoch[saved_on] + per_epoch[resumed_on] + 1
    if saved_on == 1:  # saved in this process before the launch, resumed by it
        (ckpt,) = launched["saved"][name]
        said = _said(tmp_path, "stdout") + _said(tmp_path)
    else:  # saved by the launch, resumed here
        (ckpt,) = list_checkpoints(tmp_path / "ckpt")
        said = _in_process(*_epoch_args(tmp_path, saved_on, resumed_on))
    assert ckpt.name == f"step_{stop:08d}"
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("epoch_end").experiment_id])
    epochs = {m.step: int(m.value) for m in client.get_metric_history(run.info.run_id, "train/epoch")}
    assert sorted(epochs) == list(range(1, steps + 1))
    assert [epochs[s] for s in range(1, stop + 1)] == [0] * stop  # the saving run: epoch 0
    resumed = [epochs[s] for s in range(stop + 1, steps + 1)]
    assert resumed == [1] * per_epoch[resumed_on] + [2], resumed  # epoch 1 whole from its start, then epoch 2
    assert "other shards" not in said, said[-3000:]
    # the rows per step do change: data.batch_size is per rank (resume_changes.rows_per_step_change; the 1-rank launch is one from
    # Python, whose checkpoint records no config, so that case says the ratio alone)
    rows = (f"{resumed_on} x data.batch_size={BATCH} x train.grad_accum_steps=1 = {resumed_on * BATCH} rows, {saved_on * BATCH} before"
            if saved_on == 2 else f"{resumed_on}/{saved_on} as many rows as before")
    assert f"on {resumed_on} rank(s), written by {saved_on}: data.batch_size is per rank, so each step from here on trains {rows}" in said
