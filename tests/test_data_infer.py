"""Schema inference and schema files on generated CTR-shaped files: what ``data=csv`` / ``data=parquet`` infer without a
column list, the schema file a run prints and takes back (``data.schema``), and ``convert`` inferring the same schema."""

from __future__ import annotations

import gzip
import logging
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from recsys_runner.configurable import make
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.data.encoding.fit import bucket_count
from recsys_runner.data.files.parquet_source import ParquetSource
from recsys_runner.data.files.spread_sample import PARQUET_DECODE_FACTOR, group_runs, sampled_groups
from recsys_runner.data.files.tabular import CsvData, ParquetData
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig
from recsys_runner.data.schema_files import schema_json
from recsys_runner.errors import ConfigError, DataError

ROWS = 600


def mixed_columns(rows: int = ROWS, seed: int = 0) -> dict[str, list]:
    """Columns of every kind inference tells apart, with a click that depends on them."""
    rng = np.random.default_rng(seed)
    user = rng.integers(0, 40, rows)
    site = rng.integers(0, 25, rows)
    price = rng.gamma(2.0, 10.0, rows).round(3)
    seconds = rng.integers(0, 10**9, rows)  # nearly every value distinct: a measurement, dense
    delta = rng.normal(0, 1, rows).round(4)  # negative values: no log1p
    click = (rng.random(rows) < 1 / (1 + np.exp(-(user % 3 - 1 + (site % 2))))).astype(int)
    tags = ["|".join(f"t{int(t)}" for t in rng.choice(12, size=int(rng.integers(1, 4)), replace=False)) for _ in range(rows)]
    return {"row_id": [f"r{i:06d}" for i in range(rows)], "Click": click.tolist(), "user_id": user.tolist(),
            "site": [f"{int(s) * 7919:08x}" for s in site], "price": price.tolist(), "seconds": seconds.tolist(),
            "delta": delta.tolist(), "tags": tags}


def write_mixed_csv(path: Path, rows: int = ROWS) -> dict[str, list]:
    cols = mixed_columns(rows)
    names = list(cols)
    lines = [",".join(names)] + [",".join(str(cols[n][i]) for n in names) for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return cols


def csv_data(path: Path, **fields) -> CsvData:
    return CsvData(make(CsvDataConfig, path=str(path), batch_size=32, num_workers=0, **fields))


def test_infer_schema_from_csv(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cols = write_mixed_csv(tmp_path / "mixed.csv")
    with caplog.at_level(logging.INFO, logger="recsys_runner"):
        data = csv_data(tmp_path / "mixed.csv")
    schema = data.schema
    assert schema.label == "Click"  # a column named click, in any case
    assert [(d.name, d.transform) for d in schema.dense] == [("price", "log1p"), ("seconds", "log1p"), ("delta", "none")]
    sparse = {s.name: s for s in schema.sparse}
    assert list(sparse) == ["user_id", "site", "tags"]  # row_id: a different value in every row, left out
    # the sample holds every row: a vocabulary of each column's values plus data.infer.oov_buckets (16) rows
    assert sparse["user_id"].num_embeddings == len(set(cols["user_id"])) + 16 == 56 and sparse["user_id"].encoding == "vocab"
    assert sparse["site"].num_embeddings == 25 + 16 and sparse["site"].encoding == "vocab" and sparse["site"].oov_buckets == 16
    assert sparse["tags"].separator == "|" and sparse["tags"].num_embeddings == 12 + 16
    assert "left out 'row_id': a different value in every sampled row" in caplog.text
    batch = next(iter(data.train_batches(0, 0, 1)))
    assert batch.sparse_features.keys() == ["user_id", "site", "tags"] and batch.dense_features.shape == (32, 3)
    assert int(batch.sparse_features["tags"].lengths().max()) > 1  # multi-hot bags


def test_integer_columns_named_as_ids_are_never_dense(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A sample of a table with many users holds mostly distinct user ids: by the distinct-values rule alone an integer
    ``user_id`` / ``movieId`` became a dense ``log1p`` column; a name that says identifier keeps it sparse, and an
    integer ``id`` with a different value in every row is a row id, left out like a text one. Distinct integers
    without such a name (``seconds``) stay dense."""
    rng = np.random.default_rng(1)
    rows = 400
    cols = {"label": rng.integers(0, 2, rows), "id": np.arange(rows), "user_id": rng.integers(0, 1000, rows),
            "movieId": rng.integers(0, 2000, rows), "seconds": rng.integers(0, 10**9, rows), "paid": rng.integers(0, 10**6, rows)}
    (tmp_path / "r.csv").write_text(",".join(cols) + "\n" + "".join(
        ",".join(str(int(cols[c][i])) for c in cols) + "\n" for i in range(rows)))
    with caplog.at_level(logging.INFO, logger="recsys_runner"):
        schema = csv_data(tmp_path / "r.csv").schema
    assert [s.name for s in schema.sparse] == ["user_id", "movieId"]
    assert [d.name for d in schema.dense] == ["seconds", "paid"]  # no id-like name: a measurement, as before
    assert "left out 'id': a different value in every sampled row" in caplog.text


def test_id_named_columns_of_whole_floats_are_ids(tmp_path: Path) -> None:
    """pandas writes an integer ``movieId`` holding nulls as floats (``6.0``, empty): the id rule held for integers
    only, so such a column became a dense ``log1p`` number line without a word. Whole floats under an id name are ids;
    fractional ones (``score_id`` of 0.5s) and unnamed whole floats (``weight``) stay dense."""
    rng = np.random.default_rng(2)
    rows = 400
    movie = [str(float(m)) if i % 7 else "" for i, m in enumerate(rng.integers(0, 2000, rows))]
    cols = {"label": [str(v) for v in rng.integers(0, 2, rows)], "movieId": movie, "item": [str(v) for v in rng.integers(0, 9, rows)],
            "score_id": [str(v + 0.5) for v in rng.integers(0, 10**6, rows)], "weight": [str(float(v)) for v in rng.integers(0, 10**6, rows)]}
    (tmp_path / "r.csv").write_text(",".join(cols) + "\n" + "".join(",".join(cols[c][i] for c in cols) + "\n" for i in range(rows)))
    data = csv_data(tmp_path / "r.csv")
    assert [s.name for s in data.schema.sparse] == ["movieId", "item"]
    assert [d.name for d in data.schema.dense] == ["score_id", "weight"]
    movies = next(iter(data.train_batches(0, 0, 1))).sparse_features["movieId"]
    assert set(movies.lengths().tolist()) == {0, 1}  # a null movieId is no id, as in a Parquet column of integers


def test_bucket_counts_round_up_to_1_2_5() -> None:
    assert [bucket_count(n, 2.0) for n in (1, 3, 40, 943, 1682, 30_000)] == [5, 10, 100, 2000, 5000, 100_000]
    assert bucket_count(943, 1.0) == 1000


def test_infer_schema_from_parquet(tmp_path: Path) -> None:
    cols = mixed_columns()
    table = pa.table({"target": pa.array(cols["Click"], pa.int8()), "user_id": pa.array(cols["user_id"], pa.int64()),
                      "site": cols["site"], "price": pa.array(cols["price"], pa.float32()),
                      "tags": pa.array([t.split("|") for t in cols["tags"]], pa.list_(pa.string())),
                      "seen": pa.array([i % 2 == 0 for i in range(ROWS)])})
    pq.write_table(table, tmp_path / "f.parquet", row_group_size=200)
    data = ParquetData(make(ParquetDataConfig, path=str(tmp_path / "f.parquet"), batch_size=32, num_workers=0))
    assert data.schema.label == "target"
    assert [d.name for d in data.schema.dense] == ["price", "seen"]
    assert [(s.name, s.num_embeddings, s.separator) for s in data.schema.sparse] == [
        ("user_id", 56, None), ("site", 41, None), ("tags", 28, None)]  # a list column: multi-hot as is
    batch = next(iter(data.train_batches(0, 0, 1)))
    assert int(batch.sparse_features["tags"].lengths().max()) > 1


def test_no_label_column_names_the_columns_and_the_fix(tmp_path: Path) -> None:
    (tmp_path / "r.csv").write_text("user,item,rating\n" + "".join(f"{i % 7},{i % 11},{i % 5 + 1}\n" for i in range(50)))
    with pytest.raises(DataError, match=r"no label column in data.path=.*r.csv.*\['user', 'item', 'rating'\] is named label / click.* "
                                        r"Fix: name it, e.g. data.label=user .*data.label_threshold"):
        csv_data(tmp_path / "r.csv")
    data = csv_data(tmp_path / "r.csv", label="rating", label_threshold=4)
    labels = torch.cat([b.labels for b in data.eval_batches(0, 1)] + [b.labels for b in data.train_batches(0, 0, 1)])
    assert set(labels.tolist()) == {0.0, 1.0}


def test_sparse_columns_without_sizes_are_sized_from_the_data(tmp_path: Path) -> None:
    write_mixed_csv(tmp_path / "m.csv")
    data = csv_data(tmp_path / "m.csv", label="Click", sparse=[{"name": "user_id"}, {"name": "site", "num_embeddings": 64}])
    assert [(s.name, s.num_embeddings, s.encoding) for s in data.schema.sparse] == [("user_id", 56, "vocab"), ("site", 64, "id")]
    hashed = csv_data(tmp_path / "m.csv", label="Click", sparse=[{"name": "user_id", "encoding": "hash"}])  # asked for: hashed, sized × 2
    assert [(s.name, s.num_embeddings, s.encoding) for s in hashed.schema.sparse] == [("user_id", bucket_count(40, 2.0), "hash")]
    sampled = csv_data(tmp_path / "m.csv", label="Click", sparse=[{"name": "user_id"}, {"name": "row_id"}],
                       infer={"sample_rows": 300, "max_unseen_fraction": 0.05})
    # 300 of 600 rows sampled: user_id's 40 values recur (covered: a vocabulary), row_id's are each seen once (hashed)
    assert [(s.name, s.encoding) for s in sampled.schema.sparse] == [("user_id", "vocab"), ("row_id", "hash")]
    assert data.schema.dense == []  # a listed schema is used as written


def test_printed_schema_round_trips_as_a_schema_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_mixed_csv(tmp_path / "m.csv")
    with caplog.at_level(logging.INFO, logger="recsys_runner"):
        inferred = csv_data(tmp_path / "m.csv")
    message = next(r.getMessage() for r in caplog.records if "data.schema=<file>" in r.getMessage())
    text = message.split("data.schema=<file>:\n", 1)[1]
    (tmp_path / "schema.yaml").write_text(text)
    assert yaml.safe_load(text)["label"] == "Click"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="recsys_runner"):
        again = csv_data(tmp_path / "m.csv", schema=str(tmp_path / "schema.yaml"))
    assert schema_json(again.schema) == schema_json(inferred.schema)
    assert "inferred" not in caplog.text  # nothing left to infer
    # the file's reader options win over the config's, and convert reads the same form
    (tmp_path / "m.tsv").write_text((tmp_path / "m.csv").read_text().replace(",", "\t"))
    (tmp_path / "tsv.yaml").write_text(text.replace("delimiter: ','", "delimiter: \"\\t\""))
    assert csv_data(tmp_path / "m.tsv", schema=str(tmp_path / "tsv.yaml")).csv.delimiter == "\t"
    assert data_main(["convert", "--format", "csv", "--schema", str(tmp_path / "schema.yaml"), str(tmp_path / "m.csv"),
                      str(tmp_path / "out")]) == 0
    assert pq.read_table(tmp_path / "out" / "m.parquet").num_rows == ROWS


def test_convert_infers_the_schema_a_training_run_infers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``convert --format csv`` without ``--schema``: the schema ``data=csv`` would infer, stored in the Parquet and
    printed as a schema file that ``--schema`` takes back; a file without a label column names the flag to set."""
    write_mixed_csv(tmp_path / "m.csv")
    assert data_main(["convert", "--format", "csv", str(tmp_path / "m.csv"), str(tmp_path / "out"), "--progress", "log"]) == 0
    printed = capsys.readouterr().out
    trained_on_text = csv_data(tmp_path / "m.csv")
    converted = ParquetData(make(ParquetDataConfig, path=str(tmp_path / "out"), batch_size=32, num_workers=0))
    assert [(s.name, s.num_embeddings) for s in converted.schema.sparse] == [(s.name, s.num_embeddings) for s in trained_on_text.schema.sparse]
    assert [d.name for d in converted.schema.dense] == [d.name for d in trained_on_text.schema.dense]
    assert converted.schema.label == "Click" and pq.read_table(tmp_path / "out" / "m.parquet").num_rows == ROWS
    text = printed.split("pass --schema <file>:\n", 1)[1].split("\n\n", 1)[0]
    (tmp_path / "schema.yaml").write_text(text)
    assert data_main(["convert", "--format", "csv", "--schema", str(tmp_path / "schema.yaml"), str(tmp_path / "m.csv"),
                      str(tmp_path / "again"), "--progress", "log"]) == 0
    assert pq.read_table(tmp_path / "again" / "m.parquet").equals(pq.read_table(tmp_path / "out" / "m.parquet"))
    # ratings -> clicks, with flags; an excluded column is not a feature
    (tmp_path / "r.csv").write_text("user,item,rating\n" + "".join(f"{i % 7},{i % 11},{i % 5 + 1}\n" for i in range(50)))
    assert data_main(["convert", "--format", "csv", str(tmp_path / "r.csv"), str(tmp_path / "r"), "--label", "rating",
                      "--label-threshold", "4", "--exclude", "item", "--progress", "log"]) == 0
    table = pq.read_table(tmp_path / "r" / "r.parquet")
    assert table.column_names == ["rating", "user"] and set(table.column("rating").to_pylist()) == {0, 1}
    capsys.readouterr()
    assert data_main(["convert", "--format", "csv", str(tmp_path / "r.csv"), str(tmp_path / "r2")]) == 2
    assert re.search(r"no label column in the input .*r\.csv.*Fix: name it, e\.g\. --label user", capsys.readouterr().err)


def test_schema_file_mistakes_are_config_errors(tmp_path: Path) -> None:
    write_mixed_csv(tmp_path / "m.csv")
    (tmp_path / "bad.yaml").write_text("label: Click\nsparce: []\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['sparce'\]; a schema file has label, labels"):
        csv_data(tmp_path / "m.csv", schema=str(tmp_path / "bad.yaml"))
    with pytest.raises(ConfigError, match="data.schema=.* and data.label\\(s\\)/dense/sparse are both set"):
        make(CsvDataConfig, path=str(tmp_path / "m.csv"), schema=str(tmp_path / "bad.yaml"), sparse=[{"name": "site"}])
    with pytest.raises(ConfigError, match="cannot be read"):
        csv_data(tmp_path / "m.csv", schema=str(tmp_path / "missing.yaml"))


def write_hours(path: Path, hours: range, rows_per_hour: int = 500, row_group_size: int = 700) -> None:
    """A click log sorted by time: ``hours`` of ``rows_per_hour`` rows each, a low-cardinality ``hour`` column (what a
    vocabulary fitted on the first rows alone covers badly) and a ``row`` number across files."""
    n = len(hours) * rows_per_hour
    first = hours.start * rows_per_hour
    pq.write_table(pa.table({"click": pa.array([int(i % 3 == 0) for i in range(n)], pa.int8()),
                             "hour": pa.array([h for h in hours for _ in range(rows_per_hour)], pa.int64()),
                             "row": pa.array(range(first, first + n), pa.int64())}), path, row_group_size=row_group_size)


def test_encoders_are_fitted_on_rows_spread_over_time_sorted_parquet_files(tmp_path: Path) -> None:
    """12 hours in two files (6,000 rows) and data.infer.sample_rows=2000: the first 2,000 rows are hours 0-3 alone, and
    every later hour's rows read the OOV rows. The sample is taken in runs spread over both files' row groups."""
    write_hours(tmp_path / "a.parquet", range(0, 6))
    write_hours(tmp_path / "b.parquet", range(6, 12))
    config = make(ParquetDataConfig, path=str(tmp_path), label="click", sparse=[{"name": "hour"}], batch_size=32,
                  num_workers=0, infer={"sample_rows": 2000})
    vocabulary = ParquetData(config).schema.vocabularies["hour"]
    assert vocabulary.size >= 10  # the first 2,000 rows: 4
    again = ParquetData(config).schema.vocabularies["hour"]  # the same files: the same sample
    np.testing.assert_array_equal(again.keys, vocabulary.keys)
    np.testing.assert_array_equal(again.rows, vocabulary.rows)
    source = ParquetSource([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], [], read_rows=256)
    rows = source.sample(2000, spread=True)["row"].to_numpy()
    assert len(rows) == 2000 and len(set(rows)) == 2000 and rows.max() >= 5000 and list(rows) == sorted(rows)
    head = source.sample(2000)["row"].to_pylist()  # unspread (a checkpoint's kind checks): the first rows
    assert head == list(range(len(head))) and len(head) >= 2000
    # files holding no more rows than the sample: every row, read as the head sample reads it
    for rows in (6000, 10_000):
        assert source.sample(rows, spread=True).equals(source.sample(rows))


def test_encoders_are_fitted_on_lines_spread_over_a_time_sorted_csv_file(tmp_path: Path) -> None:
    """The CSV twin of the Parquet case: an uncompressed file's sample is read from byte offsets spread over it (each
    resynced to a line start); a bad line deep in the file is named by its true line number; a gzip-compressed copy
    (whose later lines are reached only by decompressing those before them) keeps its first lines."""
    rows = [f"{int(i % 3 == 0)},{i // 500},{i}" for i in range(6000)]  # 12 hours of 500 rows, in time order
    (tmp_path / "log.csv").write_text("click,hour,row\n" + "\n".join(rows) + "\n")
    config = make(CsvDataConfig, path=str(tmp_path / "log.csv"), label="click", sparse=[{"name": "hour"}], batch_size=32,
                  num_workers=0, infer={"sample_rows": 2000})
    vocabulary = CsvData(config).schema.vocabularies["hour"]
    assert vocabulary.size >= 10  # the first 2,000 rows: 4
    np.testing.assert_array_equal(CsvData(config).schema.vocabularies["hour"].keys, vocabulary.keys)  # the same sample again
    source = CsvData._sampler(config)
    sampled = [int(r) for r in source.sample(2000, spread=True)["row"].to_pylist()]
    assert len(sampled) == len(set(sampled)) == 2000 and sampled == sorted(sampled) and sampled[-1] >= 5000
    assert [int(r) for r in source.sample(2000)["row"].to_pylist()] == list(range(2000))  # unspread: the head
    for rows in (6000, 10_000):  # no more lines than the sample: every line, in order, as the head sample reads them
        assert source.sample(rows, spread=True).equals(source.sample(rows))
    # two files: the runs spread over both
    text = (tmp_path / "log.csv").read_text().splitlines(keepends=True)
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "a.csv").write_text("".join(text[:3001]))
    (tmp_path / "parts" / "b.csv").write_text(text[0] + "".join(text[3001:]))
    parts = [int(r) for r in CsvData._sampler(replace(config, path=str(tmp_path / "parts"))).sample(2000, spread=True)["row"].to_pylist()]
    assert len(set(parts)) == 2000 and min(parts) == 0 and max(parts) >= 5000 and 2000 < parts[1000] < 4000
    # a line of a later piece that is not UTF-8 (its hour's digits as as many 0xff bytes: the pieces stay where they were)
    # is named by its line number in the file, which counts the lines before it (line 1: the header)
    row = sampled[1950]
    lines = (tmp_path / "log.csv").read_bytes().split(b"\n")
    lines[row + 1] = b"%d,%s,%d" % (int(row % 3 == 0), b"\xff" * len(str(row // 500)), row)
    (tmp_path / "bad.csv").write_bytes(b"\n".join(lines))
    with pytest.raises(DataError, match=rf"bad.csv, line {row + 2}\b.*not UTF-8"):
        CsvData._sampler(replace(config, path=str(tmp_path / "bad.csv"))).sample(2000, spread=True)
    packed = tmp_path / "log.csv.gz"
    packed.write_bytes(gzip.compress((tmp_path / "log.csv").read_bytes()))
    compressed = CsvData._sampler(replace(config, path=str(packed)))
    assert [int(r) for r in compressed.sample(2000, spread=True)["row"].to_pylist()] == list(range(2000))


def test_every_hour_of_a_long_time_sorted_log_is_in_the_vocabulary(tmp_path: Path) -> None:
    """240 hours of 100 rows each, in time order, and data.infer.sample_rows=6000: the sample is 300 runs of 20 rows, a
    run every 80 rows, so every hour is in the vocabulary of ``hour``, as plain CSV and as Parquet (all 12 row groups
    read: 24,000 rows are within the decode budget, PARQUET_DECODE_FACTOR × 6000). 100 spans of CSV and 10 runs of Parquet missed hours between them."""
    n = 24_000
    rows = [f"{int(i % 3 == 0)},{i // 100},{i}" for i in range(n)]
    (tmp_path / "log.csv").write_text("click,hour,row\n" + "\n".join(rows) + "\n")
    write_hours(tmp_path / "log.parquet", range(240), rows_per_hour=100, row_group_size=2000)
    for data, cls in ((CsvDataConfig, CsvData), (ParquetDataConfig, ParquetData)):
        suffix = "csv" if cls is CsvData else "parquet"
        config = make(data, path=str(tmp_path / f"log.{suffix}"), label="click", sparse=[{"name": "hour"}], batch_size=32,
                      num_workers=0, infer={"sample_rows": 6000})
        vocabulary = cls(config).schema.vocabularies["hour"]
        assert vocabulary.capacity == 240, suffix


def test_a_parquet_spread_sample_of_many_row_groups_decodes_a_bounded_share_of_them() -> None:
    """Runs inside a row group decode its rows before them, so over files holding more than PARQUET_DECODE_FACTOR times
    the sample the runs are spread over evenly spaced row groups holding about that many rows, not over every group."""
    groups = [("f", g, 1000) for g in range(100)]
    budget = PARQUET_DECODE_FACTOR * 2000 // 1000  # groups of 1,000 rows whose decoding the budget allows
    spaced = [j * 100 // budget for j in range(budget)]  # the groups holding evenly spaced rows
    assert [g for _, g, _ in sampled_groups(groups, 2000)] == spaced
    runs = group_runs(groups, 2000)
    assert sorted(g for _, g in runs) == spaced and sum(hi - lo for r in runs.values() for lo, hi in r) == 2000
    assert sampled_groups(groups[:budget], 2000) == groups[:budget]  # within the budget: every group
    uneven = [("f", 0, 50_000)] + [("f", g, 100) for g in range(1, 200)]  # one huge group: still enough rows picked
    assert sum(n for *_, n in sampled_groups(uneven, 2000)) >= 2000


def test_compressed_files_are_each_sampled_from_their_first_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A compressed file is entered only at its start, so several of them give the sample from each one's first lines (the
    head sample read the first file alone); one compressed file holding more lines than the sample is sampled from its
    head, said in a warning naming the fix."""
    (tmp_path / "days").mkdir()
    for day in range(4):  # four days of 1,500 rows, in time order
        lines = "".join(f"{int(i % 3 == 0)},{day * 100 + i // 500},{day * 1500 + i}\n" for i in range(1500))
        (tmp_path / "days" / f"day_{day}.csv.gz").write_bytes(gzip.compress(("click,hour,row\n" + lines).encode()))
    config = make(CsvDataConfig, path=str(tmp_path / "days"), label="click", sparse=[{"name": "hour"}], batch_size=32,
                  num_workers=0, infer={"sample_rows": 2000})
    source = CsvData._sampler(config)
    with caplog.at_level(logging.INFO, logger="recsys_runner"):
        rows = [int(r) for r in source.sample(2000, spread=True)["row"].to_pylist()]
    assert rows == [r for day in range(4) for r in range(day * 1500, day * 1500 + 500)]
    assert "spread over 4 compressed files" in caplog.text and "WARNING" not in caplog.text
    for n in (6000, 8000):  # no more lines than the sample: every line, in order, as the head sample reads them
        assert source.sample(n, spread=True).equals(source.sample(n))
    caplog.clear()
    one = CsvData._sampler(replace(config, path=str(tmp_path / "days" / "day_0.csv.gz")))
    with caplog.at_level(logging.INFO, logger="recsys_runner"):
        assert [int(r) for r in one.sample(1000, spread=True)["row"].to_pylist()] == list(range(1000))
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "day_0.csv.gz is gzip-compressed" in warning and "FIRST 1000 lines" in warning and "recsys_runner.data convert" in warning
