"""submitit's job environment → torch.distributed's variables, and a real 2-task submitit job with two sharding types."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from recsys_runner.distributed.launch import map_submitit_env
from tests.conftest import TINY, free_port, run_cli

SLURM_TASK = {
    "SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "77", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[01-02]",
}


TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_torch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset the torch variables so that monkeypatch removes what map_submitit_env writes afterwards."""
    for k in TORCH_VARS:
        monkeypatch.setenv(k, "unset")
        monkeypatch.delenv(k)


def test_map_submitit_env_inside_a_slurm_task(monkeypatch: pytest.MonkeyPatch, clean_torch_env: None) -> None:
    for k, v in SLURM_TASK.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    values = map_submitit_env()
    assert values == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "gpu01",
                      "MASTER_PORT": values["MASTER_PORT"]}
    assert {k: os.environ[k] for k in TORCH_VARS} == values
    assert 20000 <= int(values["MASTER_PORT"]) < 32768, "below the kernel's ephemeral ports (launch.JOB_PORTS)"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1", "cuda:<LOCAL_RANK> indexes all of the node's GPUs"
    for k in TORCH_VARS:  # rank 0, on the first node, of the same job
        monkeypatch.delenv(k)
    for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"):
        monkeypatch.setenv(k, "0")
    again = map_submitit_env()
    assert again["RANK"] == "0" and again["MASTER_PORT"] == values["MASTER_PORT"], "every task of a job must agree on the port"
    for k in TORCH_VARS:
        monkeypatch.delenv(k)
    monkeypatch.setenv("MASTER_PORT", "29400")  # chosen in hydra.launcher.setup (docs/launch.md)
    assert map_submitit_env()["MASTER_PORT"] == "29400"


def test_map_submitit_env_leaves_torchrun_and_single_tasks_alone(monkeypatch: pytest.MonkeyPatch, clean_torch_env: None) -> None:
    for k, v in SLURM_TASK.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert map_submitit_env() == {} and os.environ["WORLD_SIZE"] == "16"
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert map_submitit_env() == {} and "RANK" not in os.environ
    monkeypatch.delenv("SUBMITIT_EXECUTOR")
    assert map_submitit_env() == {}


@pytest.mark.slow
def test_submitit_local_two_tasks_shard_with_two_sharding_types(tmp_path: Path, store_uri: str) -> None:
    """One submitit job of 2 tasks: each task maps its environment to a rank, they form a gloo group,
    and the plan mixes data-parallel (one table) with column-wise (the rest)."""
    uri = store_uri
    out = run_cli("-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=5",
                  *TINY, "train.num_steps=20", "distributed.sharding_types=[column_wise]",
                  "+distributed.tables={t_cat_0: {sharding_types: [data_parallel]}}",
                  f"tracking.uri={uri}", "tracking.experiment=two_tasks", cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("two_tasks").experiment_id], "tags.world_size = '2'")
    assert len(runs) == 1, "one run, logged by rank 0 only"
    (run,) = runs
    assert run.info.status == "FINISHED" and run.data.metrics["eval/auc"] > 0.55
    plan = Path(client.download_artifacts(run.info.run_id, "sharding_plan.txt", str(tmp_path))).read_text()
    assert "data_parallel" in plan and "column_wise" in plan and "rank:1" in plan


@pytest.mark.slow
def test_torchrun_two_ranks_table_wise_with_a_data_parallel_table(tmp_path: Path, store_uri: str) -> None:
    """torchrun, 2 ranks: tables placed whole on either rank, one table replicated — two sharding types in one plan."""
    import subprocess
    import sys

    uri = store_uri
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", "recsys_runner", *TINY, "train.num_steps=20", "distributed.sharding_types=[table_wise]",
           "+distributed.tables={t_cat_0: {sharding_types: [data_parallel]}}", f"tracking.uri={uri}", "tracking.experiment=tw"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tw").experiment_id])
    assert run.data.tags["world_size"] == "2" and run.data.metrics["eval/auc"] > 0.55
    plan = Path(client.download_artifacts(run.info.run_id, "sharding_plan.txt", str(tmp_path))).read_text()
    assert "data_parallel" in plan and "table_wise" in plan
    assert "rank:0" in plan and "rank:1" in plan, "table-wise tables spread over both ranks"
