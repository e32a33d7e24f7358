"""Several label columns (``data.labels``: task → column): exact ``[B, T]`` batches from Parquet and
CSV, per-column checks and errors, ``convert``/``inspect`` with the mapping, and MMoE trained from a file."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from recsys_runner.__main__ import run
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.data.base import DataError
from recsys_runner.data.files.tabular import CsvData, ParquetData
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig
from recsys_runner.data.generated.generate import write_funnel_parquet
from recsys_runner.data.schema_files import stored_schema
from recsys_runner.errors import ConfigError

LABELS = {"ctr": "click", "cvr": "conversion"}
SPARSE = [{"name": "item", "num_embeddings": 10}]


def two_label_parquet(tmp_path: Path, conversion: list | None = None) -> str:
    table = pa.table({
        "click": pa.array([1, 0, 1, 1, 0], pa.int8()),
        "conversion": pa.array(conversion or [0, 0, 1, 1, 0], pa.int64()),
        "price": pa.array([1.0, 2.0, 3.0, 4.0, 5.0]),
        "item": pa.array([3, 1, 4, 1, 5], pa.int64()),
    })
    path = tmp_path / "two.parquet"
    pq.write_table(table, path, row_group_size=3)
    return str(path)


def reader(path: str, cls=ParquetData, **kw):
    fields = {"path": path, "eval_path": path, "labels": LABELS, "dense": [{"name": "price"}], "sparse": SPARSE,
              "batch_size": 5, "shuffle": False, "drop_remainder": False}
    return cls(make({ParquetData: ParquetDataConfig, CsvData: CsvDataConfig}[cls], **(fields | kw)))


def test_parquet_two_labels_exact_batch(tmp_path: Path) -> None:
    data = reader(two_label_parquet(tmp_path))
    assert data.features.label == ("ctr", "cvr") and data.features.multi_label
    (batch,) = list(data.train_batches(0, 0, 1))
    assert batch.labels.shape == (5, 2) and batch.labels.dtype.is_floating_point
    assert batch.labels.tolist() == [[1, 0], [0, 0], [1, 1], [1, 1], [0, 0]]
    assert batch.dense_features[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert batch.sparse_features["item"].values().tolist() == [3, 1, 4, 1, 5]
    # the mapping's order is the column order, whatever the file's order
    swapped = reader(two_label_parquet(tmp_path), labels={"cvr": "conversion", "ctr": "click"})
    assert swapped.features.label == ("cvr", "ctr")
    assert next(iter(swapped.train_batches(0, 0, 1))).labels[:, 0].tolist() == [0, 0, 1, 1, 0]


def test_csv_two_labels_exact_batches_and_regression_label(tmp_path: Path) -> None:
    path = tmp_path / "logs.csv"
    path.write_text("item,click,conversion,watch\n3,1,1,12.5\n1,0,0,0\n4,1,0,3.25\n")
    data = reader(str(path), CsvData, labels={"ctr": "click", "cvr": "conversion", "watch": "watch"},
                  label_kinds={"watch": "regression"}, dense=[], batch_size=2)
    b0, b1 = list(data.train_batches(0, 0, 1))
    assert data.features.label_names == ("ctr", "cvr", "watch")
    assert b0.labels.tolist() == [[1, 1, 12.5], [0, 0, 0]] and b1.labels.tolist() == [[1, 0, 3.25]]
    assert b0.sparse_features["item"].values().tolist() == [3, 1]
    # the same float column as a binary label is a bad row naming it and the fix
    with pytest.raises(DataError, match=r"logs\.csv, line 2, column 'watch': the label \(task 'watch'\) is 12\.5, but the task is "
                       r"binary \(BCE\) and needs 0 or 1; a float label: data\.label_kinds\.watch=regression, a class index: "
                       r"data\.label_kinds\.watch=multiclass \(.*model\.task_specs\.watch\.kind"):
        list(reader(str(path), CsvData, labels={"ctr": "click", "watch": "watch"}, dense=[]).train_batches(0, 0, 1))


def test_bad_value_in_second_label_column_names_it(tmp_path: Path) -> None:
    path = two_label_parquet(tmp_path, conversion=[0, 0, 1, 1, 2])
    with pytest.raises(DataError, match=r"two\.parquet, row group 1, row 4 of the file, column 'conversion': the label \(task 'cvr'\) "
                       r"is 2, but the task is binary"):
        list(reader(path).train_batches(0, 0, 1))
    skipping = reader(path, on_bad_rows="skip")
    (batch,) = list(skipping.train_batches(0, 0, 1))
    assert batch.labels.tolist() == [[1, 0], [0, 0], [1, 1], [1, 1]]
    assert skipping.metrics()["data/bad_rows_skipped"] == 1.0
    csv = tmp_path / "nulls.csv"
    csv.write_text("click,conversion,item\n1,1,3\n0,,1\n")
    with pytest.raises(DataError, match=r"nulls\.csv, line 3, column 'conversion': the label \(task 'cvr'\) is missing"):
        list(reader(str(csv), CsvData, dense=[]).train_batches(0, 0, 1))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"label": "click"}, r"data.label='click' and data.labels=\{'ctr': 'click', 'cvr': 'conversion'\} are both set.*Fix: data.label=null"),
        ({"labels": {}}, r"data.labels is empty; give task name -> column"),
        ({"labels": {"ctr": "click", "cvr": "click"}}, r"reads column\(s\) \['click'\] for several tasks"),
        ({"label_kinds": {"ltv": "regression"}}, r"data.label_kinds names task\(s\) \['ltv'\] that are not in data.labels"),
        ({"label_kinds": {"cvr": "ordinal"}}, r"data.label_kinds has \{'cvr': 'ordinal'\}; each kind must be one of"),
        ({"labels": {"ctr": "click", "cvr": "item"}}, r"columns \['item'\] appear more than once among data.label\(s\)"),
    ],
)
def test_label_config_errors(tmp_path: Path, fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        reader(two_label_parquet(tmp_path), **fields)


def test_label_and_labels_both_set_through_hydra(make_cfg, tmp_path: Path) -> None:
    cfg = make_cfg("data=parquet", f"data.path={two_label_parquet(tmp_path)}", "data.label=click", "data.labels={ctr: click}",
                   "data.sparse=[{name: item, num_embeddings: 10}]", "tracking=none", tiny=False)
    with pytest.raises(ConfigError, match=r"data.label='click' and data.labels=\{'ctr': 'click'\} are both set"):
        validate(cfg)


def test_convert_csv_stores_the_mapping_and_inspect_reports_each_label(tmp_path: Path, capsys) -> None:
    src = tmp_path / "logs.csv"
    src.write_text("click,conversion,item\n1,1,3\n0,0,1\n1,0,4\n1,1,9\n")
    schema = tmp_path / "schema.yaml"
    schema.write_text("labels: {ctr: click, cvr: conversion}\nsparse: [{name: item, num_embeddings: 10}]\n")
    assert data_main(["convert", "--format", "csv", "--schema", str(schema), str(src), str(tmp_path / "out")]) == 0
    out_file = str(tmp_path / "out" / "logs.parquet")
    stored = stored_schema(out_file)
    assert stored is not None and stored.labels == LABELS and stored.label is None
    converted = ParquetData(make(ParquetDataConfig, path=out_file, eval_path=out_file, batch_size=4, shuffle=False))  # no column list
    (batch,) = list(converted.train_batches(0, 0, 1))
    assert converted.features.label == ("ctr", "cvr")
    assert batch.labels.tolist() == [[1, 1], [0, 0], [1, 0], [1, 1]]
    capsys.readouterr()
    assert data_main(["inspect", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "label 'click': rate 0.7500" in out and "label 'conversion': rate 0.5000" in out
    assert data_main(["inspect", "--format", "csv", "--label", "conversion", str(src)]) == 0
    out = capsys.readouterr().out
    assert "label 'conversion': rate 0.5000" in out and "label 'click'" not in out


def test_mmoe_trains_from_a_two_label_parquet_file(make_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    path = tmp_path / "funnel.parquet"
    write_funnel_parquet(str(path), 12_000, seed=4, num_embeddings=1000, row_group_rows=2000)
    cfg = make_cfg("model=mmoe", "data=parquet", f"data.path={path}", "data.batch_size=256", "optim=adagrad", "optim.lr=0.05",
                   "train.num_steps=30", "train.log_every_steps=10", "train.eval_every_steps=null", "distributed.device=cpu", tiny=False)
    assert run(cfg) > 0.6  # the objective: eval/ctr/auc
    client = MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    assert exp is not None
    (mlrun,) = client.search_runs([exp.experiment_id])
    logged = mlrun.data.metrics
    assert {"eval/ctr/auc", "eval/cvr/auc", "train/ctr/auc", "train/cvr/auc"} <= set(logged), sorted(logged)
    assert logged["eval/cvr/auc"] > 0.6 and "eval/auc" not in logged
