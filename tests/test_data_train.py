"""Training from files: Criteo TSV and a Parquet directory on 1 rank (in process) and 2 ranks (torchrun)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recsys_runner.__main__ import run
from recsys_runner.data.generated.generate import write_criteo_parquet, write_criteo_tsv
from tests.conftest import REPO, free_port
from tests.rank_jobs import jobs

TRAIN = ["train.log_every_steps=10", "train.eval_every_steps=null", "distributed.device=cpu", "data.batch_size=256"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("criteo")
    write_criteo_tsv(str(root / "day_0.tsv"), 12_000, seed=1)
    (root / "pq").mkdir()
    write_criteo_parquet(str(root / "pq" / "part-0.parquet"), 6_000, seed=2, num_embeddings=1000, row_group_rows=1000)
    write_criteo_parquet(str(root / "pq" / "part-1.parquet"), 6_000, seed=3, num_embeddings=1000, row_group_rows=1500)
    return root


def test_train_from_criteo_tsv(make_cfg, files: Path) -> None:
    cfg = make_cfg("data=criteo", f"data.path={files}/day_0.tsv", "data.num_embeddings=1000", "train.num_steps=60", *TRAIN, tiny=False)
    assert run(cfg) > 0.6


def test_train_epochs_from_parquet_directory_with_workers(make_cfg, files: Path) -> None:
    cfg = make_cfg("data=parquet", f"data.path={files}/pq", "data.num_workers=2", "train.num_steps=null", "train.num_epochs=2",
                   "model=dlrm", *TRAIN, tiny=False)
    assert run(cfg) > 0.6




def torchrun(tmp_path: Path, *overrides: str, module: str = "recsys_runner",
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", module, "tracking=none", "distributed.sharding_types=[table_wise]", "distributed.timeout_s=120", *TRAIN, *overrides]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=400,
                          env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO)})


@pytest.mark.slow
def test_two_ranks_train_from_parquet_dir_and_criteo(tmp_path: Path, files: Path) -> None:
    """Both jobs in one launch (:mod:`tests.rank_jobs`), one after the other; each one's last step is its own line."""
    (tmp_path / "pq").mkdir()
    (tmp_path / "tsv").mkdir()
    env = jobs((tmp_path / "pq", {}, ["data=parquet", f"data.path={files}/pq", "data.num_workers=1", "train.num_steps=null",
                                      "train.num_epochs=1", f"hydra.run.dir={tmp_path}/pq/run"]),
               (tmp_path / "tsv", {}, ["data=criteo", f"data.path={files}/day_0.tsv", "data.num_embeddings=1000", "train.num_steps=30",
                                       f"hydra.run.dir={tmp_path}/tsv/run"]))
    out = torchrun(tmp_path, module="tests.rank_jobs", env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    # 12000 rows, 10% held out, 2 ranks x 256: 21 full batches per rank in one epoch
    assert "step 21/21" in out.stderr + out.stdout
    assert "step 30/30" in out.stderr + out.stdout


@pytest.mark.slow
def test_uneven_ranks_end_together(tmp_path: Path, files: Path) -> None:
    # Every other line of the first half is bad: rank 0's share yields far fewer batches than rank 1's.
    lines = (files / "day_0.tsv").read_text().splitlines(keepends=True)
    for i in range(0, len(lines) // 2, 2):
        lines[i] = "7" + lines[i][1:]
    (tmp_path / "uneven.tsv").write_text("".join(lines))
    out = torchrun(tmp_path, "data=criteo", f"data.path={tmp_path}/uneven.tsv", "data.num_embeddings=1000", "data.on_bad_rows=skip",
                   "data.shuffle=false", "train.num_steps=50")
    assert out.returncode == 0, out.stderr[-4000:]
    logs = out.stderr + out.stdout
    assert "step 50/50" in logs and "eval/auc=" in logs
    assert "skipped" in logs and "bad rows" in logs


@pytest.mark.slow
def test_a_bad_row_on_one_rank_stops_both_with_its_error(tmp_path: Path, files: Path) -> None:
    """A bad label in rank 1's share only (the file's second half), with data.on_bad_rows=fail: rank 1 stops with the
    data error naming the file, line and column and the user-error exit status (2) (or torchrun's signal, if rank 0's
    report of the lost peer reached torchrun first); rank 0, in a collective with it, does not wait for it (it reports the lost peer, or torchrun stops it
    first): the launch fails, not hangs (the helper's subprocess timeout)."""
    lines = (files / "day_0.tsv").read_text().splitlines(keepends=True)
    lines[11_000] = "7" + lines[11_000][1:]
    (tmp_path / "bad.tsv").write_text("".join(lines))
    out = torchrun(tmp_path, "data=criteo", f"data.path={tmp_path}/bad.tsv", "data.num_embeddings=1000", "train.num_steps=30")
    logs = out.stderr + out.stdout
    assert out.returncode != 0
    assert f"Data error: bad row in {tmp_path}/bad.tsv, line 11001, column 'label': the label is 7" in logs, logs[-4000:]
    # rank 1 exits with the user-error status (2), unless rank 0 saw the lost peer first and torchrun stopped rank 1
    # with a signal while it was closing down (a race the launch cannot order): either way rank 1 is a listed failure
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: (2|-\d+) ", logs), logs[-4000:]
    assert "step 30/30" not in logs
