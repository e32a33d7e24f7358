"""``python -m recsys_runner.predict``: the model's scores, pass-through columns, input order, disjoint parts per rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from recsys_runner import predict
from recsys_runner.__main__ import run as train
from recsys_runner.build import build
from recsys_runner.config import register_configs, validate
from recsys_runner.data.generate import write_criteo_parquet
from recsys_runner.errors import ConfigError
from recsys_runner.paths import CONFIG_PATH
from tests.conftest import free_port
from tests.test_evaluate import MANIFEST_TAGS, compose_entry

BATCH = 128


def _overrides(tmp_path: Path, uri: str) -> list[str]:
    return ["data=parquet", f"data.path={tmp_path}/train", f"data.batch_size={BATCH}", "train.num_steps=8", "train.log_every_steps=4",
            "train.eval_every_steps=null", "distributed.device=cpu", f"tracking.uri={uri}", "tracking.experiment=predict",
            f"checkpoint.dir={tmp_path}/ck"]


def _score_file(path: Path, num_rows: int, seed: int, row_group_size: int) -> pa.Table:
    """A Criteo-shaped Parquet file with a ``request_id`` column and several row groups; returns its table."""
    write_criteo_parquet(str(path), num_rows, seed=seed, num_embeddings=1000)
    table = pq.read_table(path)
    metadata = table.schema.metadata
    table = table.append_column("request_id", pa.array([f"{path.stem}-{i}" for i in range(num_rows)]))
    table = table.replace_schema_metadata(metadata)
    pq.write_table(table, path, row_group_size=row_group_size)
    return table


@pytest.fixture
def trained(tmp_path: Path) -> list[str]:
    """A DeepFM trained a few steps on Parquet data, checkpointed; returns the training's overrides."""
    (tmp_path / "train").mkdir()
    write_criteo_parquet(str(tmp_path / "train" / "a.parquet"), 3000, seed=0, num_embeddings=1000)
    overrides = _overrides(tmp_path, f"sqlite:///{tmp_path}/mlflow.db")
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        train(compose(config_name="config", overrides=overrides))
    return overrides


def test_predict_scores_are_the_models_in_input_order(trained: list[str], tmp_path: Path) -> None:
    (tmp_path / "score").mkdir()
    # 1000 rows in row groups of 300: batches cross row groups and the last one (1000 = 7 x 128 + 104) is partial.
    table = _score_file(tmp_path / "score" / "b.parquet", 1000, seed=1, row_group_size=300)
    load = f"load={tmp_path}/ck"
    cfg = compose_entry("predict", *trained, load, f"predict.input={tmp_path}/score",
                        f"predict.output={tmp_path}/out", "predict.columns=[request_id,label]")
    result = predict.run(cfg)
    assert result.rows == 1000 and result.parts == [tmp_path / "out" / "part-00000-00000.parquet"]
    written = pq.read_table(result.parts[0])
    assert written.column_names == ["request_id", "label", "score"]
    assert written["request_id"].to_pylist() == table["request_id"].to_pylist()
    assert written["label"].to_pylist() == table["label"].to_pylist()
    assert pq.read_schema(result.parts[0]).metadata[predict.SOURCE_KEY] == str(tmp_path / "score" / "b.parquet").encode()

    # The model's own scores of those rows: the same checkpoint built as evaluate builds it, the file as eval data.
    spec = validate(compose_entry("predict", *trained, load, f"data.eval_path={tmp_path}/score"))
    c = build(spec, weights=tmp_path / "ck" / "step_00000008")
    try:
        model = c.loop.evaluator.model
        model.eval()
        with torch.no_grad():
            expected = torch.cat([torch.sigmoid(model(b)[1][1]) for b in c.loop.data.eval_batches(0, 1)]).numpy()
    finally:
        c.close()
    assert len(expected) == 1000
    np.testing.assert_array_equal(written["score"].to_numpy(), expected)

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("predict").experiment_id], "tags.entry = 'predict'")
    assert all(tag in run.data.tags for tag in MANIFEST_TAGS)
    assert run.data.tags["predict.output"] == str(tmp_path / "out")
    assert run.data.metrics["predict/rows"] == 1000 and run.data.metrics["predict/rows_per_s"] > 0
    assert run.data.tags["mlflow.parentRunId"] == run.data.tags["source_run_id"]

    with pytest.raises(ConfigError, match="already holds part files"):  # a second run into the same output would mix
        predict.run(cfg)


def test_predict_two_ranks_write_disjoint_parts_covering_the_input(trained: list[str], tmp_path: Path) -> None:
    (tmp_path / "score").mkdir()
    tables = [_score_file(tmp_path / "score" / f"{name}.parquet", n, seed=i + 1, row_group_size=200)
              for i, (name, n) in enumerate([("b", 900), ("c", 500)])]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "recsys_runner.predict", *trained, f"load={tmp_path}/ck",
           f"predict.input={tmp_path}/score", f"predict.output={tmp_path}/out", "predict.columns=[request_id]",
           "distributed.sharding_types=[column_wise]"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "rows/s" in out.stderr + out.stdout
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    by_rank = {r: [p.name for p in parts if p.name.startswith(f"part-0000{r}-")] for r in (0, 1)}
    # 1400 rows in 7 row groups of <= 200: rank 0 takes b's first 800 rows (7 batches of <= 128), rank 1 b's last 100
    # and c's 500 (1 + 4 batches), so rank 1 steps twice more with the placeholder while rank 0 finishes.
    assert [p.name for p in parts] == ["part-00000-00000.parquet", "part-00001-00000.parquet", "part-00001-00001.parquet"]
    ids = [pq.read_table(p)["request_id"].to_pylist() for p in parts]
    rank0 = {i for p, part_ids in zip(parts, ids, strict=True) if p.name in by_rank[0] for i in part_ids}
    rank1 = {i for p, part_ids in zip(parts, ids, strict=True) if p.name in by_rank[1] for i in part_ids}
    assert not rank0 & rank1
    # The parts in name order are the input rows in input order, each once.
    assert [i for part_ids in ids for i in part_ids] == [i for t in tables for i in t["request_id"].to_pylist()]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("predict").experiment_id], "tags.entry = 'predict'")
    assert run.data.tags["manifest.world_size"] == "2" and run.data.metrics["predict/rows"] == 1400
