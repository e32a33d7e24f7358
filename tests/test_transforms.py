"""Feature transforms with stored state (issue 29): dense ``clip`` and ``normalize: zscore`` (``mean`` / ``std``), and
numbers bucketized into ids (``boundaries`` / ``quantiles``, ``encoding: bucketize``).

What is fitted (a zscore column's mean and std, quantile boundaries) is fitted on a sample of the training files by
``complete_schema``, stored in ``encoders.json`` with every checkpoint, and reused by ``evaluate`` on files that changed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from recsys_runner import evaluate
from recsys_runner.__main__ import run as train
from recsys_runner.data.encoding.fit import InferConfig, complete_schema
from recsys_runner.data.encoding.rows import Encoder, Location
from recsys_runner.data.encoding.stored import ENCODERS_FILE, from_json, to_json
from recsys_runner.data.schema import DenseColumn, Schema, SparseColumn
from recsys_runner.data.schema_files import read_schema_file
from recsys_runner.errors import ConfigError, DataError
from tests.test_evaluate import compose_entry


def _encode(schema: Schema, table: pa.Table, on_bad_rows: str = "fail") -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """``table`` (a CSV block: text columns) encoded by ``schema``: the dense matrix and the sparse (values, lengths)."""
    rows = Encoder(schema, on_bad_rows, DataError).encode(table, Location("t.csv", "lines 2-", np.arange(table.num_rows), 2))
    return rows.dense, rows.sparse


def _schema(dense: list[DenseColumn], sparse: list[SparseColumn] | None = None) -> Schema:
    return Schema(label="label", dense=dense, sparse=sparse or [SparseColumn(name="item", num_embeddings=10)])


def _table(**columns: list[str | None]) -> pa.Table:
    n = len(next(iter(columns.values())))
    return pa.table({"label": ["0"] * n, "item": ["1"] * n, **{k: pa.array(v, pa.string()) for k, v in columns.items()}})


def _complete(table: pa.Table, dense: list[DenseColumn], sparse: list[SparseColumn]) -> tuple[Schema, list[str]]:
    done = complete_schema(label="label", labels=None, label_kinds=None, label_threshold=None, dense=dense, sparse=sparse,
                           sample=lambda: table, config=InferConfig(), where="the sample")
    return done.schema, done.notes


# -- dense: clip and zscore ----------------------------------------------------------------------------


def test_clip_after_fill_before_transform_and_zscore() -> None:
    col = DenseColumn(name="x", fill=500.0, clip=[0, 99], transform="log1p", normalize="zscore", mean=1.0, std=2.0)
    dense, _ = _encode(_schema([col]), _table(x=["-5", "10", None, "1e9"]))
    expected = (np.log1p(np.array([0.0, 10.0, 99.0, 99.0])) - 1.0) / 2.0  # the fill (500) is clipped too
    np.testing.assert_allclose(dense[:, 0], expected, rtol=1e-6)


def test_zscore_fitted_on_the_values_the_encoder_sees() -> None:
    table = _table(x=["1", "2", "3", None, "1000"])
    schema, _ = _complete(table, [DenseColumn(name="x", clip=[0, 10], normalize="zscore")],
                          [SparseColumn(name="item", num_embeddings=10)])
    values = np.array([1.0, 2.0, 3.0, 0.0, 10.0])  # missing → fill 0; 1000 clipped to 10
    fitted = schema.dense[0]
    assert fitted.mean == pytest.approx(values.mean()) and fitted.std == pytest.approx(values.std())
    dense, _ = _encode(schema, table)
    assert dense[:, 0].mean() == pytest.approx(0.0, abs=1e-6) and dense[:, 0].std() == pytest.approx(1.0, abs=1e-6)


def test_zscore_keeps_user_stats_and_maps_a_constant_column_to_std_one() -> None:
    table = _table(x=["4", "4", "4"], y=["1", "2", "3"])
    schema, notes = _complete(table, [DenseColumn(name="x", normalize="zscore"), DenseColumn(name="y", normalize="zscore", mean=10.0)],
                              [SparseColumn(name="item", num_embeddings=10)])
    x, y = schema.dense
    assert (x.mean, x.std) == (4.0, 1.0) and any("std 0" in n and "x" in n for n in notes)
    assert y.mean == 10.0 and y.std == pytest.approx(np.std([1, 2, 3]))


def test_nan_in_a_zscore_column_is_a_bad_row_naming_the_column() -> None:
    schema = _schema([DenseColumn(name="price", normalize="zscore", mean=0.0, std=1.0)])
    with pytest.raises(DataError, match=r"t.csv, line 4, column 'price': the value is nan.*normalize=zscore"):
        _encode(schema, _table(price=["1", "2", "nan"]))
    dense, _ = _encode(schema, _table(price=["1", "nan", "3"]), on_bad_rows="skip")
    np.testing.assert_allclose(dense[:, 0], [1.0, 3.0])


@pytest.mark.parametrize(("fields", "message"), [
    ({"clip": [5, 5]}, r"data.dense\[x\].clip=\[5, 5\] must be \[lo, hi\]"),
    ({"clip": [3, 1]}, r"lo < hi"),
    ({"clip": [0, float("inf")]}, r"two finite numbers"),
    ({"clip": [1]}, r"must be \[lo, hi\]"),
    ({"normalize": "minmax"}, r"data.dense\[x\].normalize='minmax' must be one of"),
    ({"mean": 1.0}, r"data.dense\[x\]: mean=1.0 / std=None apply only with normalize=zscore"),
    ({"normalize": "zscore", "std": 0.0}, r"data.dense\[x\].std must be a positive"),
])
def test_dense_transform_config_errors(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DenseColumn(name="x", **fields)


# -- sparse: bucketize ---------------------------------------------------------------------------------


def test_bucketize_edges_nulls_and_default_size() -> None:
    col = SparseColumn(name="age", boundaries=[18, 30, 50])
    assert (col.encoding, col.num_embeddings) == ("bucketize", 4)
    _, sparse = _encode(_schema([], [col]), _table(age=["-1", "18", "29.9", "30", "50", "1e6", None]))
    values, lengths = sparse[0]
    assert values.tolist() == [0, 1, 1, 2, 3, 3, 0]  # a boundary starts its bucket (side='right'); missing → bucket 0
    assert lengths.tolist() == [1] * 7


def test_bucketize_reads_parquet_numbers_and_multi_hot_text() -> None:
    schema = _schema([], [SparseColumn(name="n", boundaries=[0.5]), SparseColumn(name="m", boundaries=[1, 2], separator="|")])
    table = pa.table({"label": [0, 1], "n": pa.array([1.0, None]), "m": ["0|1.5|7", None]})
    _, sparse = _encode(schema, table)
    assert sparse[0][0].tolist() == [1, 0]
    assert sparse[1][0].tolist() == [0, 1, 2] and sparse[1][1].tolist() == [3, 0]


def test_bucketize_text_that_is_no_number_is_a_bad_row() -> None:
    schema = _schema([], [SparseColumn(name="age", boundaries=[18])])
    with pytest.raises(DataError, match=r"line 3, column 'age': 'teen' is not a number, which encoding=bucketize reads"):
        _encode(schema, _table(age=["20", "teen"]))
    _, sparse = _encode(schema, _table(age=["20", "teen", "3"]), on_bad_rows="skip")
    assert sparse[0][0].tolist() == [1, 0]


def test_quantiles_fit_deduplicated_boundaries() -> None:
    table = _table(a=[str(v) for v in range(1, 101)], b=["7"] * 80 + ["8"] * 20)
    schema, _ = _complete(table, [], [SparseColumn(name="item", num_embeddings=10), SparseColumn(name="a", quantiles=4),
                                      SparseColumn(name="b", quantiles=4)])
    a, b = schema.sparse[1:]
    np.testing.assert_allclose(a.boundaries or [], np.quantile(np.arange(1, 101), [0.25, 0.5, 0.75]))
    assert (a.encoding, a.num_embeddings) == ("bucketize", 4)
    assert b.boundaries == [7.0] and b.num_embeddings == 2  # the quartiles of 80 sevens and 20 eights, repeats dropped
    _, sparse = _encode(schema, table)
    assert np.bincount(sparse[1][0]).tolist() == [25, 25, 25, 25]


@pytest.mark.parametrize(("fields", "message"), [
    ({"boundaries": [1, 1, 2]}, r"data.sparse\[age\].boundaries=\[1, 1, 2\] must be strictly increasing"),
    ({"boundaries": [3, 2]}, r"strictly increasing"),
    ({"boundaries": []}, r"non-empty list of finite numbers"),
    ({"quantiles": 1}, r"data.sparse\[age\].quantiles=1 must be an integer >= 2"),
    ({"boundaries": [1, 2], "encoding": "hash"}, r"data.sparse\[age\].encoding='hash' does not read boundaries"),
    ({"encoding": "bucketize"}, r"encoding=bucketize needs data.sparse\[age\].boundaries"),
    ({"boundaries": [1, 2], "num_embeddings": 2}, r"num_embeddings=2 is below the 3 buckets"),
    ({"boundaries": [1, 2], "hex": True}, r"hex=true"),
])
def test_bucketize_config_errors(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SparseColumn(name="age", **fields)


def test_schema_file_and_stored_document_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "schema.yaml"
    path.write_text("label: label\ndense: [{name: x, clip: [0, 10], normalize: zscore, mean: 1.5, std: 2}]\n"
                    "sparse: [{name: age, boundaries: [18, 30]}]\n")
    parts, _ = read_schema_file(str(path))
    schema = Schema(**parts)
    again, _ = from_json(to_json(schema, {}), "encoders.json")
    assert again.dense == schema.dense and again.sparse == schema.sparse
    assert again.sparse[0].num_embeddings == 3 and again.dense[0].clip == [0.0, 10.0]


# -- end to end: fitted once, stored, reused ----------------------------------------------------------


def _csv(rng: np.random.Generator, n: int, price_scale: float, min_age: int = 10) -> str:
    """``label,user,price,age`` rows: the label follows the price (high prices click) and the age bucket."""
    price = rng.exponential(price_scale, n)
    age = rng.integers(min_age, min_age + 70, n)
    label = ((price > price_scale) ^ (age < 30)).astype(int)
    return "".join(f"{label[i]},u{int(rng.integers(20))},{price[i]:.3f},{age[i]}\n" for i in range(n))


def test_fitted_transforms_are_stored_and_reused_by_evaluate(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    header = "label,user,price,age\n"
    (tmp_path / "train.csv").write_text(header + _csv(rng, 2000, 10.0))
    (tmp_path / "eval.csv").write_text(header + _csv(rng, 500, 10.0))
    data = ["data=csv", f"data.path={tmp_path}/train.csv", f"data.eval_path={tmp_path}/eval.csv", "data.batch_size=64",
            "data.shuffle=false", "data.dense=[{name: price, clip: [0, 60], normalize: zscore}]",
            "data.sparse=[{name: user}, {name: age, quantiles: 5}]", "model=deepfm", "optim=adagrad",
            "distributed.device=cpu", "tracking=none"]
    train(compose_entry("config", *data, "train.num_steps=30", "train.log_every_steps=30", f"checkpoint.dir={tmp_path}/ck"))
    checkpoint = tmp_path / "ck" / "step_00000030"
    stored = json.loads((checkpoint / ENCODERS_FILE).read_text())
    price, (_, age) = stored["dense"][0], stored["sparse"]
    assert price["normalize"] == "zscore" and price["clip"] == [0.0, 60.0] and price["mean"] > 5 and price["std"] > 1
    assert age["encoding"] == "bucketize" and len(age["boundaries"]) == 4 and age["num_embeddings"] == 5

    def run_evaluate() -> dict[str, float]:
        return evaluate.run(compose_entry("evaluate", *data, f"load={checkpoint}"))

    before = run_evaluate()
    assert before["eval/auc"] > 0.8, f"the model must have learned price and age for the test to mean anything: {before}"
    # The training file changes (prices ten times higher, older users): fitted again, mean/std and boundaries would move.
    (tmp_path / "train.csv").write_text(header + _csv(rng, 2000, 100.0, min_age=40))
    after = run_evaluate()
    assert after["eval/auc"] == pytest.approx(before["eval/auc"], abs=1e-6)
    assert after["eval/logloss"] == pytest.approx(before["eval/logloss"], abs=1e-6)


def test_a_served_request_is_told_what_is_wrong_not_how_to_train_another_model() -> None:
    """An id past an ``encoding=id`` table, or text in a bucketized column: training is told the setting that takes it
    (``data.sparse[item].num_embeddings``); a client of the served model, whose tables are fixed, is told the range."""
    from recsys_runner.data.encoding.served_request import RequestEncoder, RequestRows

    schema = _schema([], [SparseColumn(name="item", encoding="id", num_embeddings=10), SparseColumn(name="age", boundaries=[18, 30])])
    for item, age, training, served in ((["3", "12"], ["20", "40"], "Raise data.sparse[item].num_embeddings",
                                         "id '12' is outside [0, 10) (encoding=id): the model's table for 'item' has 10 rows"),
                                        (["3", "4"], ["20", "old"], "data.sparse[age].boundaries/quantiles",
                                         "'old' is not a number, which the model reads from this column (its values are bucketized)")):
        table = pa.table({"label": ["1", "0"], "item": item, "age": age})
        with pytest.raises(DataError, match=re.escape(training)):
            _encode(schema, table)
        with pytest.raises(DataError) as refused:
            RequestEncoder(schema, "fail", DataError).encode(table, RequestRows("request", "rows", np.arange(2), 0))
        assert f"request row 1, column '{'item' if item[1] == '12' else 'age'}': {served}. Fix the request" in str(refused.value)
        assert "data.sparse" not in str(refused.value)
