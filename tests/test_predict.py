"""``python -m recsys_runner.predict``: the model's scores, pass-through columns, input order, disjoint parts per rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from recsys_runner import predict, scoring
from recsys_runner.__main__ import run as train
from recsys_runner.build import build
from recsys_runner.config import register_configs, validate
from recsys_runner.data.generated.generate import write_criteo_parquet
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


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A DeepFM trained a few steps on Parquet data, checkpointed, once for the two tests that score with it (each logs
    its predict run to an experiment of its own in this store); its directory and the training's overrides."""
    root = tmp_path_factory.mktemp("predict_trained_8")
    (root / "train").mkdir()
    write_criteo_parquet(str(root / "train" / "a.parquet"), 3000, seed=0, num_embeddings=1000)
    overrides = _overrides(root, f"sqlite:///{root}/mlflow.db")
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        train(compose(config_name="config", overrides=overrides))
    return root, overrides


def test_predict_scores_are_the_models_in_input_order(trained: tuple[Path, list[str]], tmp_path: Path) -> None:
    root, trained_overrides = trained
    (tmp_path / "score").mkdir()
    # 1000 rows in row groups of 300: batches cross row groups and the last one (1000 = 7 x 128 + 104) is partial.
    table = _score_file(tmp_path / "score" / "b.parquet", 1000, seed=1, row_group_size=300)
    load = f"load={root}/ck"
    cfg = compose_entry("predict", *trained_overrides, "tracking.experiment=predict_order", load, f"predict.input={tmp_path}/score",
                        f"predict.output={tmp_path}/out", "predict.columns=[request_id,label]")
    result = predict.run(cfg)
    assert result.rows == 1000 and result.parts == [tmp_path / "out" / "part-00000-00000.parquet"]
    written = pq.read_table(result.parts[0])
    assert written.column_names == ["request_id", "label", "score"]
    assert written["request_id"].to_pylist() == table["request_id"].to_pylist()
    assert written["label"].to_pylist() == table["label"].to_pylist()
    assert pq.read_schema(result.parts[0]).metadata[scoring.SOURCE_KEY] == str(tmp_path / "score" / "b.parquet").encode()

    # The model's own scores of those rows: the same checkpoint in the training's own graph, the file as eval data.
    spec = validate(compose_entry("predict", *trained_overrides, load, f"data.eval_path={tmp_path}/score"))
    c = build(spec, weights=root / "ck" / "step_00000008")
    try:
        model = c.loop.evaluator.model
        model.eval()
        with torch.no_grad():
            expected = torch.cat([torch.sigmoid(model(b)[1][1]) for b in c.loop.data.eval_batches(0, 1)]).numpy()
    finally:
        c.close()
    assert len(expected) == 1000
    np.testing.assert_array_equal(written["score"].to_numpy(), expected)

    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("predict_order").experiment_id], "tags.entry = 'predict'")
    assert all(tag in run.data.tags for tag in MANIFEST_TAGS)
    assert run.data.tags["predict.output"] == str(tmp_path / "out")
    assert run.data.metrics["predict/rows"] == 1000 and run.data.metrics["predict/rows_per_s"] > 0
    assert run.data.tags["mlflow.parentRunId"] == run.data.tags["source_run_id"]

    with pytest.raises(ConfigError, match="already holds part files"):  # a second run into the same output would mix
        predict.run(cfg)


def test_predict_two_ranks_write_disjoint_parts_covering_the_input(trained: tuple[Path, list[str]], tmp_path: Path) -> None:
    root, trained_overrides = trained
    (tmp_path / "score").mkdir()
    tables = [_score_file(tmp_path / "score" / f"{name}.parquet", n, seed=i + 1, row_group_size=200)
              for i, (name, n) in enumerate([("b", 900), ("c", 500)])]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "recsys_runner.predict", *trained_overrides, "tracking.experiment=predict_ranks", f"load={root}/ck",
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
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("predict_ranks").experiment_id], "tags.entry = 'predict'")
    assert run.data.tags["manifest.world_size"] == "2" and run.data.metrics["predict/rows"] == 1400


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A DeepFM trained once for this module's cheap tests (its own store): its directory and training overrides."""
    root = tmp_path_factory.mktemp("predict_trained")
    (root / "train").mkdir()
    write_criteo_parquet(str(root / "train" / "a.parquet"), 1000, seed=0, num_embeddings=1000)
    overrides = [*_overrides(root, f"sqlite:///{root}/mlflow.db"), "train.num_steps=2"]
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        train(compose(config_name="config", overrides=overrides))
    return root, overrides


def _no_build(*_: object, **__: object) -> None:
    raise AssertionError("the model was built before the config was refused")


def _unloaded_checkpoint(root: Path) -> None:
    """A checkpoint under ``root`` as ``load=`` sees one (``load=`` is checked first), for tests that never load it."""
    step = root / "step_00000001"
    step.mkdir(parents=True)
    (step / ".metadata").touch()
    (step / "meta.json").write_text('{"step": 1}')


def test_predict_default_columns_and_a_stop_mid_write_leaves_no_part(trained_once: tuple[Path, list[str]], tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    root, trained = trained_once
    (tmp_path / "score").mkdir()
    for i, name in enumerate(["b", "c"]):
        _score_file(tmp_path / "score" / f"{name}.parquet", 300, seed=i + 1, row_group_size=300)
    entry = [*trained, f"load={root}/ck", f"predict.input={tmp_path}/score"]

    # predict.columns=[] (the default): the scores alone, one row per input row
    result = predict.run(compose_entry("predict", *entry, f"predict.output={tmp_path}/out"))
    assert [p.name for p in result.parts] == ["part-00000-00000.parquet", "part-00000-00001.parquet"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [p.name for p in result.parts]
    for part in result.parts:
        written = pq.read_table(part)
        assert written.column_names == ["score"] and written.num_rows == 300
    assert result.rows == 600, "the rows counted without pass-through columns"

    # Ctrl-C (or the lifecycle's SIGTERM) in the second file's second batch: b's finished part and c's temp part are deleted
    write = scoring._PartWriter.write
    in_c = []

    def stop_in_second_file(self: scoring._PartWriter, path: str, *args: Any) -> None:
        if path.endswith("c.parquet"):
            in_c.append(path)
            if len(in_c) == 2:
                stopped = sorted(p.name for p in (tmp_path / "stopped").iterdir())
                assert stopped == [".tmp-part-00000-00001.parquet", "part-00000-00000.parquet"]
                raise KeyboardInterrupt
        write(self, path, *args)

    monkeypatch.setattr(scoring._PartWriter, "write", stop_in_second_file)
    with pytest.raises(KeyboardInterrupt):
        predict.run(compose_entry("predict", *entry, f"predict.output={tmp_path}/stopped"))
    assert list((tmp_path / "stopped").iterdir()) == []

    # a write failing mid-file (after its first batch is written) leaves no temp part either
    calls = []

    def fail_after_first_batch(self: scoring._PartWriter, *args: Any) -> None:
        calls.append(1)
        if len(calls) > 1:
            assert len(list((tmp_path / "failed").glob(".tmp-part-*"))) == 1 and not list((tmp_path / "failed").glob("part-*"))
            raise OSError("disk full")
        write(self, *args)

    monkeypatch.setattr(scoring._PartWriter, "write", fail_after_first_batch)
    with pytest.raises(OSError, match="disk full"):
        predict.run(compose_entry("predict", *entry, f"predict.output={tmp_path}/failed", f"data.batch_size={BATCH // 2}"))
    assert list((tmp_path / "failed").iterdir()) == []


def test_predict_skips_an_empty_part_file_of_its_input(trained_once: tuple[Path, list[str]], tmp_path: Path) -> None:
    """A partitioned writer's part of 0 rows among the files to score is skipped (logged), not fatal, and not recorded as
    a file the predict read."""
    root, trained = trained_once
    (tmp_path / "score").mkdir()
    table = _score_file(tmp_path / "score" / "part-00000.parquet", 300, seed=1, row_group_size=300)
    pq.write_table(table.slice(0, 0), tmp_path / "score" / "part-00001.parquet")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    result = predict.run(compose_entry("predict", *trained, f"tracking.uri={uri}", f"load={root}/ck", f"predict.input={tmp_path}/score",
                                       f"predict.output={tmp_path}/out"))
    assert result.rows == 300 and [p.name for p in result.parts] == ["part-00000-00000.parquet"]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("predict").experiment_id], "tags.entry = 'predict'")
    scored = {d.dataset.name: d.dataset for d in client.get_run(run.info.run_id).inputs.dataset_inputs}["parquet/predict"]
    assert json.loads(scored.profile)["files"] == 1


def test_an_input_without_a_feature_column_is_named_as_the_inputs_mistake(trained_once: tuple[Path, list[str]], tmp_path: Path) -> None:
    """A file to score that lacks a feature the model was trained on (a user column left out of the nightly export): the
    fix said to correct the column names in data.label(s) / data.dense / data.sparse, which are right (the training
    files'); it now names the training file that has the column and predict.input."""
    from recsys_runner.errors import DataError

    root, trained = trained_once
    table = _score_file(tmp_path / "b.parquet", 50, seed=1, row_group_size=50)
    pq.write_table(table.drop_columns(["cat_3"]), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b.parquet has no column 'cat_3' \(its columns are .*\), but the training files \(data.path\) "
                                        r"have it, e.g. .*a.parquet: input files \(predict.input\) are read with the training files' "
                                        r"columns. Fix: write .*b.parquet with the column 'cat_3', or point predict.input at files"):
        predict.run(compose_entry("predict", *trained, f"load={root}/ck", f"predict.input={tmp_path}/b.parquet",
                                  f"predict.output={tmp_path}/out"))


def test_predict_refuses_an_output_with_earlier_parts_naming_the_incomplete_ones(
        trained_once: tuple[Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, trained = trained_once
    table = _score_file(tmp_path / "b.parquet", 200, seed=1, row_group_size=200)
    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(table, out / "part-00000-00000.parquet")
    truncated = (out / "part-00000-00000.parquet").read_bytes()[:-100]
    (out / "part-00001-00000.parquet").write_bytes(truncated)  # a part killed mid-write by an older version
    (out / ".tmp-part-00002-00000.parquet").write_bytes(truncated)  # a temp part of a process killed with SIGKILL
    cfg = compose_entry("predict", *trained, f"load={root}/ck", f"predict.input={tmp_path}/b.parquet", f"predict.output={out}",
                        "predict.columns=[request_id]")
    monkeypatch.setattr(predict, "build_inference", _no_build)
    with pytest.raises(ConfigError, match=r"already holds part files of an earlier run \(complete: part-00000-00000.parquet; "
                                          r"incomplete .*: .tmp-part-00002-00000.parquet, part-00001-00000.parquet\).*"
                                          r"Fix: predict.overwrite=true to delete them first"):
        predict.run(cfg)
    under_a_part = out / "part-00000-00000.parquet" / "out"  # not a raw NotADirectoryError once the model is built
    with pytest.raises(ConfigError, match=rf"predict.output={under_a_part} cannot be written: a file is in the place of its parent folder"):
        predict.run(compose_entry("predict", *trained, f"load={root}/ck", f"predict.input={tmp_path}/b.parquet",
                                  f"predict.output={under_a_part}"))
    monkeypatch.undo()

    cfg.predict.overwrite = True
    result = predict.run(cfg)
    assert sorted(p.name for p in out.iterdir()) == ["part-00000-00000.parquet"]
    assert pq.read_table(result.parts[0])["request_id"].to_pylist() == table["request_id"].to_pylist()


def test_predict_of_a_model_trained_on_generated_data_says_which_files_it_can_score(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``make run``'s model, then ``predict load=<it>``: the data is the training's, generated. The error named only the
    class and asked for "the training's data settings", which are the generated data's; it names the files that fit."""
    monkeypatch.setattr(predict, "build_inference", _no_build)
    _unloaded_checkpoint(tmp_path / "ck")
    with pytest.raises(ConfigError, match=r"data is SyntheticDataConfig, which generates its rows .* no files to score\. "
                                          r"Fix: data=parquet\|csv\|criteo data\.path=<files .*Criteo-shaped Parquet"):
        predict.run(compose_entry("predict", f"load={tmp_path}/ck", f"predict.output={tmp_path}/out"))


def test_predict_columns_missing_from_the_input_fail_before_the_model_is_built(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(predict, "build_inference", _no_build)
    _score_file(tmp_path / "b.parquet", 10, seed=1, row_group_size=10)
    _unloaded_checkpoint(tmp_path / "ck")
    with pytest.raises(ConfigError, match=r"predict.columns=\['request_id', 'request'\] names \['request'\] \(not in .*b.parquet.*"
                                          r"its columns are \[.*'request_id'\]. Fix: predict.columns="):
        predict.run(compose_entry("predict", "data=parquet", f"data.path={tmp_path}/b.parquet", f"load={tmp_path}/ck",
                                  f"predict.output={tmp_path}/out", "predict.columns=[request_id,request]"))
    (tmp_path / "in.csv").write_text("label,price,item\n1,2.0,7\n")
    with pytest.raises(ConfigError, match=r"names \['id'\] .*its columns are \['label', 'price', 'item'\]"):
        predict.run(compose_entry("predict", "data=csv", f"data.path={tmp_path}/in.csv", f"load={tmp_path}/ck",
                                  f"predict.output={tmp_path}/out", "predict.columns=[id]"))
    assert not (tmp_path / "out").exists()
