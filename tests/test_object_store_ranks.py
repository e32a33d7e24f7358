"""Two ranks with checkpoints in a bucket (moto's S3 server on loopback, tests/object_store.py): a 2-rank gloo run's
column-wise shards written through DCP's fsspec writer are read back on 1 rank (DCP's fsspec reader reshards them) to
the 2-rank run's eval, and the one-writer lock is rank 0's: a held lock refuses both ranks, a finished run leaves none."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import recsys_runner.__main__ as entry
from recsys_runner import evaluate, store_settings, uris
from recsys_runner.checkpoint.lock import ObjectStoreLock
from recsys_runner.checkpoint.object_storage import DcpObjectStorage
from recsys_runner.paths import CONFIG_PATH
from tests.conftest import TINY, torchrun
from tests.object_store import MotoServer, start_moto
from tests.test_evaluate import compose_entry

pytestmark = pytest.mark.slow

CKPT = "s3://ranks/ck"


@pytest.fixture
def bucket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoServer]:
    """A moto server with bucket ``ranks``; its endpoint and fake credentials in this process's environment (so in the
    torchrun ranks' too); stopped by its PID."""
    server = start_moto(tmp_path)
    try:
        server.bucket("ranks")
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        store_settings.configure(store_settings.StorageConfig())
        yield server
    finally:
        store_settings.configure(store_settings.StorageConfig())
        server.stop()


def _overrides(tmp_path: Path) -> list[str]:
    return [*[a for a in TINY if not a.startswith("train.")], "train.num_steps=12", "train.log_every_steps=6",
            "train.eval_every_steps=null", "train.eval_max_batches=null", f"checkpoint.dir={CKPT}", "checkpoint.every_steps=6",
            "checkpoint.keep_last=null", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.experiment=ranks"]


def _two_ranks(tmp_path: Path, *overrides: str) -> tuple[int, str]:
    out = torchrun("distributed.sharding_types=[column_wise]", "distributed.timeout_s=120", f"hydra.run.dir={tmp_path}/run2",
                   *overrides, cwd=tmp_path, timeout=400)
    return out.returncode, out.stdout + out.stderr


def test_two_rank_bucket_checkpoints_evaluate_on_one_rank_to_the_same_eval(bucket: MotoServer, tmp_path: Path) -> None:
    args, fs = _overrides(tmp_path), bucket.fs()
    held = ObjectStoreLock(CKPT)  # another live run holds the directory: both ranks refuse to start, neither takes it over
    held.acquire()
    try:
        code, out = _two_ranks(tmp_path, *args)
        holder = json.loads(fs.cat_file("ranks/ck/.lock"))
    finally:
        held.release()
    assert code != 0 and f"{CKPT} is in use by another live run: host" in out and f"pid {os.getpid()}" in out, out[-3000:]
    assert holder["pid"] == os.getpid() and not fs.find("ranks/ck/step_00000006")

    code, out = _two_ranks(tmp_path, *args)
    assert code == 0, out[-4000:]
    storage, root = DcpObjectStorage(), uris.as_path(CKPT)
    assert [p.name for p in storage.checkpoints(root)] == ["step_00000006", "step_00000012"]
    final = root / "step_00000012"
    assert storage.read_meta(final)["world_size"] == 2 and storage.damage(final) is None  # .metadata, data, rank0.pt, rank1.pt
    assert not fs.exists("ranks/ck/.lock") and fs.exists("ranks/ck/.finished")  # rank 0's lock released at the end
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (trained,) = client.search_runs([client.get_experiment_by_name("ranks").experiment_id])
    two_rank_eval = {k: v for k, v in trained.data.metrics.items() if k.startswith("eval/")}
    assert set(two_rank_eval) == {"eval/auc", "eval/logloss"} and trained.data.tags["world_size"] == "2"

    one_rank_eval = evaluate.run(compose_entry("evaluate", *args, f"load={CKPT}"))  # 1 rank, column-wise shards resharded
    assert one_rank_eval == pytest.approx(two_rank_eval, rel=1e-5)
    _resume_on_one_rank(tmp_path, args, root / "step_00000006")


def _resume_on_one_rank(tmp_path: Path, args: list[str], step6: Path) -> None:
    """Training resumed on 1 rank from the 2-rank checkpoint of step 6 in the bucket: every tensor (embedding shards,
    the fused optimizer's state) restored whole, as the 2 ranks saved it, then on to step 12."""
    saved = _saved(step6)
    assert any(k.startswith("model/") and "embedding_bags" in k for k in saved)
    loaded: dict[str, torch.Tensor] = {}
    real_train = entry.train

    def check_then_train(loop: Any) -> Any:  # right after build() restored the 2-rank checkpoint onto 1 rank
        assert loop.state.step == 6
        for k, v in loop.checkpointer._tensor_state().items():
            loaded[k] = (v.local_tensor() if hasattr(v, "local_tensor") else v).detach().clone()
        return real_train(loop)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(entry, "train", check_then_train)
        with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
            entry.run(compose(config_name="config", overrides=[*args, f"checkpoint.resume={step6}"]))
    assert set(loaded) == set(saved), set(loaded) ^ set(saved)
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), f"{k} differs after resharding 2 → 1 ranks through the bucket"


def _saved(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint in the bucket as one full tensor, whatever sharding wrote it."""
    reader = FsspecReader(str(path), **store_settings.fsspec_options())
    meta = reader.read_metadata().state_dict_metadata
    full = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(full, storage_reader=FsspecReader(str(path), **store_settings.fsspec_options()), no_dist=True)
    return full
