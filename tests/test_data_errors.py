"""Bad data: one test per case, each asserting the message names the file, row and column and the fix."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys_runner.__main__ import run
from recsys_runner.configurable import make
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.data.base import DataError
from recsys_runner.data.encoding.keys import splitmix64
from recsys_runner.data.encoding.rows import Encoder, Location
from recsys_runner.data.files.criteo_config import CRITEO_COLUMNS, CriteoDataConfig
from recsys_runner.data.files.tabular import CriteoData, CsvData, ParquetData
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig
from recsys_runner.data.generated.generate import write_criteo_tsv
from recsys_runner.data.schema import Schema, SparseColumn
from recsys_runner.errors import ConfigError

SPARSE = [{"name": "item", "num_embeddings": 10}]


def parquet(tmp_path: Path, name: str = "p.parquet", **cols) -> str:
    table = pa.table(cols or {"label": [0, 1, 0], "item": [1, 2, 3], "price": [1.0, 2.0, 3.0]})
    path = tmp_path / name
    pq.write_table(table, path)
    return str(path)


def read_all(data) -> int:
    return sum(b.labels.shape[0] for b in data.train_batches(0, 0, 1)) + sum(b.labels.shape[0] for b in data.eval_batches(0, 1))


def parquet_data(path: str, **kw) -> ParquetData:
    return ParquetData(make(ParquetDataConfig, **({"path": path, "eval_path": path, "batch_size": 2, "shuffle": False, "sparse": SPARSE} | kw)))


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.path='.*nope' does not exist\. Fix: point data.path at a file, a directory or a glob"):
        parquet_data(str(tmp_path / "nope"))


def test_glob_matching_nothing(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.path='.*day_\*.parquet' is a glob pattern that matches no files"):
        parquet_data(str(tmp_path / "day_*.parquet"))


def test_directory_without_parquet_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"is a directory without data files with a name ending in \.parquet"):
        parquet_data(str(tmp_path))


def test_missing_column(tmp_path: Path) -> None:
    path = parquet(tmp_path)
    with pytest.raises(DataError, match=r"p\.parquet has no column 'itme'; its columns are \['label', 'item', 'price'\] \(did you mean "
                                        r"'item'\?\)\. Fix: correct the column names"):
        parquet_data(path, sparse=[{"name": "itme", "num_embeddings": 10}])


def test_missing_column_in_csv_header(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("label,item\n1,2\n")
    with pytest.raises(DataError, match=r"a\.csv has no column 'price'; its header lists \['label', 'item'\]"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "a.csv"), sparse=SPARSE, dense=[{"name": "price"}]))


def test_wrong_type_string_as_dense_is_refused_at_start_up(tmp_path: Path) -> None:
    # was refused at the first read, after the model had been built; the file's footer tells it when the data is built
    path = parquet(tmp_path, label=[0, 1], item=[1, 2], price=["cheap", "dear"])
    with pytest.raises(DataError, match=r"p\.parquet: column 'price' holds string values, but data\.dense reads numbers\. "
                                        r"Fix: move it to data\.sparse"):
        parquet_data(path, dense=[{"name": "price"}])


def test_text_label_is_refused_at_start_up_with_a_labels_fix(tmp_path: Path) -> None:
    # the fix offered was the dense column's, "move it to data.sparse": wrong for a label
    path = parquet(tmp_path, label=["yes", "no"] * 50, item=[1, 2, 3, 4, 5] * 20)
    said = (r"p\.parquet: column 'label' holds string values, but it is a label, and a label is a number: 0 or 1 for a binary "
            r"task, .*Fix: write it as numbers, e\.g\. in pandas df\['label'\] = \(df\['label'\] == '<positive value>'\)")
    with pytest.raises(DataError, match=said):
        parquet_data(path)
    with pytest.raises(DataError, match=said):
        ParquetData(make(ParquetDataConfig, path=path))  # the label found by its name, the features inferred
    encoder = Encoder(Schema(label="label", sparse=[SparseColumn(name="item", num_embeddings=10)]))  # a served model's rows
    with pytest.raises(ValueError, match=r"p\.parquet, row group 0: column 'label' holds string values, but it is a label"):
        encoder.encode(pq.read_table(path), Location(path, "row group 0", np.arange(100)))


def test_wrong_type_csv_field_names_the_line(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("label,item,price\n1,2,3.5\n0,1,abc\n")
    data = CsvData(make(CsvDataConfig, path=str(tmp_path / "a.csv"), eval_path=str(tmp_path / "a.csv"), batch_size=1, sparse=SPARSE, dense=[{"name": "price"}]))
    with pytest.raises(DataError, match=r"bad row in .*a\.csv, line 3, column 'price': 'abc' is not a number\. Fix the data, or set data.on_bad_rows=skip"):
        read_all(data)


def test_null_label(tmp_path: Path) -> None:
    path = parquet(tmp_path, label=[0, None, 1], item=[1, 2, 3])
    with pytest.raises(DataError, match=r"bad row in .*p\.parquet, row group 0, row 1 of the file, column 'label': the label is missing"):
        read_all(parquet_data(path))


def test_non_binary_label(tmp_path: Path) -> None:
    path = parquet(tmp_path, label=[0, 1, 2], item=[1, 2, 3])
    with pytest.raises(DataError, match=r"row 2 of the file, column 'label': the label is 2, but the task is binary \(BCE\) and needs 0 or 1"):
        read_all(parquet_data(path))


def test_truncated_parquet(tmp_path: Path) -> None:
    path = parquet(tmp_path)
    blob = Path(path).read_bytes()
    Path(path).write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DataError, match=r"p\.parquet is not a readable Parquet file \(.*\): it is truncated or corrupt\. Fix: write it again"):
        parquet_data(path)


def test_corrupt_row_group(tmp_path: Path) -> None:
    path = parquet(tmp_path, label=list(range(2)) * 500, item=[3] * 1000)
    blob = bytearray(Path(path).read_bytes())
    blob[4:200] = b"\xff" * 196  # garbage over the first column chunk's pages, footer intact
    Path(path).write_bytes(bytes(blob))
    with pytest.raises(DataError, match=r"p\.parquet, row group 0: cannot be read \(.*\); the file is corrupt"):
        read_all(parquet_data(path))


def test_files_that_disagree_on_a_columns_type(tmp_path: Path) -> None:
    # one file of a folder with its ids as text: the sample for an inferred schema died in pyarrow's concat_tables, and
    # with the schema given, "7" and 7 keyed different rows of a hash (or vocabulary), silently
    parquet(tmp_path, "a.parquet", label=[0, 1, 0], item=[1, 2, 3])
    parquet(tmp_path, "b.parquet", label=[1, 0, 1], item=["1", "2", "3"])
    clash = r"column 'item' holds int64 values in .*a\.parquet but string values in .*b\.parquet: .* Fix: write 'item' of .*b\.parquet as int64"
    with pytest.raises(DataError, match=clash):
        parquet_data(str(tmp_path), sparse=[])  # inferred: the sample meets both files
    with pytest.raises(DataError, match=clash):
        parquet_data(str(tmp_path), sparse=[{"name": "item", "num_embeddings": 10, "encoding": "hash"}])
    held_out = tmp_path / "eval"
    held_out.mkdir()
    (tmp_path / "b.parquet").rename(held_out / "b.parquet")
    with pytest.raises(DataError, match=clash):
        parquet_data(str(tmp_path / "a.parquet"), eval_path=str(held_out), sparse=[{"name": "item", "num_embeddings": 10, "encoding": "hash"}])


def test_files_may_differ_in_a_columns_width(tmp_path: Path) -> None:
    parquet(tmp_path, "a.parquet", label=pa.array([0, 1, 0], pa.int8()), item=pa.array([1, 2, 3], pa.int32()),
            price=pa.array([1.0, 2.0, 3.0], pa.float32()))
    parquet(tmp_path, "b.parquet", label=[1, 0, 1], item=[4, 5, 6], price=[4.0, 5.0, 6.0])
    # the sample for the vocabulary widens int32 and float32 to one type; each file is read at its own width
    data = parquet_data(str(tmp_path), sparse=[{"name": "item"}], dense=[{"name": "price"}], eval_path=None, eval_fraction=0.5,
                        batch_size=1)
    assert data.schema.vocabularies["item"].keys.size == 6
    assert read_all(data) == 6


def test_empty_files(tmp_path: Path) -> None:
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.parquet is an empty file \(0 bytes\)"):
        parquet_data(str(tmp_path / "empty.parquet"))
    pq.write_table(pa.table({"label": pa.array([], pa.int64()), "item": pa.array([], pa.int64())}), tmp_path / "norows.parquet")
    with pytest.raises(DataError, match=r"norows\.parquet is an empty Parquet file \(0 rows\): there are no rows to read"):
        parquet_data(str(tmp_path / "norows.parquet"))
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(DataError, match=r"e\.csv is an empty file"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "e.csv"), sparse=SPARSE))
    (tmp_path / "h.csv").write_text("label,item\n")
    with pytest.raises(DataError, match=r"h\.csv has a header line but no rows: there are no rows to read\. Fix: point data\.path at"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "h.csv"), sparse=SPARSE))
    (tmp_path / "t.csv").write_text("label,item\n1,3\n0,4\n")
    with pytest.raises(DataError, match=r"h\.csv has a header line but no rows: there are no rows to read\. Fix: point data\.eval_path at"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "t.csv"), eval_path=str(tmp_path / "h.csv"), sparse=SPARSE))


def _no_rows(path: Path, item: pa.DataType | None = None) -> None:
    pq.write_table(pa.table({"label": pa.array([], pa.int64()), "item": pa.array([], item or pa.int64())}), path)


def test_empty_part_files_are_skipped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Partitioned writers (Spark, Hive, pandas) leave part files of no rows: skipped with one line, not fatal; files all
    empty stay an error, and an empty file's schema is still checked."""
    train, held = tmp_path / "train", tmp_path / "eval"
    train.mkdir()
    held.mkdir()
    parquet(train, "part-00000.parquet", label=[0, 1, 0, 1], item=[1, 2, 3, 4])
    _no_rows(train / "part-00001.parquet")
    parquet(train, "part-00002.parquet", label=[1, 0], item=[5, 6])
    parquet(held, "part-00000.parquet", label=[0, 1, 1], item=[1, 2, 3])
    _no_rows(held / "part-00001.parquet")
    with caplog.at_level("INFO"):
        data = parquet_data(str(train), eval_path=str(held))
    assert read_all(data) == 6 + 3
    skipped = [r.getMessage() for r in caplog.records if "are skipped" in r.getMessage()]
    assert len(skipped) == 2 and "1 of 3 files in" in skipped[0] and "part-00001.parquet" in skipped[0], skipped
    # the run's record of its inputs lists the files read (an empty part added or removed later is no other data)
    splits = data.split_files()
    assert [Path(f).name for f in splits["train"].files] == ["part-00000.parquet", "part-00002.parquet"]
    assert [Path(f).name for f in splits["eval"].files] == ["part-00000.parquet"]
    # a hash split of the same folder: the empty part holds out nothing and keys no other file's rows otherwise
    assert read_all(parquet_data(str(train), eval_path=None, eval_fraction=0.5)) == 6

    _no_rows(train / "part-00003.parquet", pa.string())  # empty, but of another type than the others: named
    with pytest.raises(DataError, match=r"column 'item' holds int64 values in .*part-00000\.parquet but string values in .*part-00003"):
        parquet_data(str(train), eval_path=str(held))
    (train / "part-00003.parquet").unlink()

    for f in ("part-00000.parquet", "part-00002.parquet"):
        _no_rows(train / f)
    with pytest.raises(DataError, match=r"part-00000\.parquet is an empty Parquet file \(0 rows\), as do all 3 files read with it: "
                                        r"there are no rows to read"):
        parquet_data(str(train), eval_path=str(held))

    # pandas writes an empty partition's text and list columns as nulls only: the first file with rows gives the types
    pandas = tmp_path / "pandas"
    pandas.mkdir()
    pq.write_table(pa.table({"label": pa.array([], pa.int64()), "hist": pa.array([], pa.null()), "item": pa.array([], pa.null())}),
                   pandas / "part-00000.parquet")
    pq.write_table(pa.table({"label": [0, 1, 0, 1], "hist": pa.array([["a"], ["b", "c"], [], ["a"]], pa.list_(pa.string())),
                             "item": ["a", "b", "a", "c"]}), pandas / "part-00001.parquet")
    histories = parquet_data(str(pandas), eval_path=str(pandas), sequences={"h": {"features": ["hist"], "max_len": 2}},
                             sparse=[{"name": "hist", "num_embeddings": 10, "encoding": "hash", "table": "items"},
                                     {"name": "item", "num_embeddings": 10, "encoding": "hash", "table": "items"}])
    assert read_all(histories) == 8

    text = tmp_path / "csv"
    text.mkdir()
    (text / "a.csv").write_text("label,item\n0,1\n1,2\n0,3\n1,4\n")
    (text / "b.csv").write_text("label,item\n")
    caplog.clear()
    with caplog.at_level("INFO"):
        csv = CsvData(make(CsvDataConfig, path=str(text), eval_path=str(text), batch_size=2, shuffle=False, sparse=SPARSE))
    assert read_all(csv) == 8
    said = [r.getMessage() for r in caplog.records if "are skipped" in r.getMessage()]
    assert len(said) == 1 and "1 of 2 files in" in said[0] and "(b.csv)" in said[0], said  # eval_path is data.path: said once
    assert [Path(f).name for f in csv.split_files()["train"].files] == ["a.csv"]
    # convert, as training: the empty part makes no Parquet file
    (tmp_path / "schema.yaml").write_text("label: label\nsparse:\n- {name: item, num_embeddings: 10}\n")
    assert data_main(["convert", "--format", "csv", "--schema", str(tmp_path / "schema.yaml"), str(text), str(tmp_path / "converted"),
                      "--progress", "log"]) == 0
    assert sorted(p.name for p in (tmp_path / "converted").iterdir()) == ["a.parquet"]
    (text / "a.csv").write_text("label,item\n")
    with pytest.raises(DataError, match=r"a\.csv has a header line but no rows, as do all 2 files read with it"):
        CsvData(make(CsvDataConfig, path=str(text), sparse=SPARSE))


def test_out_of_range_id(tmp_path: Path) -> None:
    path = parquet(tmp_path, label=[0, 1, 0], item=[1, 10, -1])
    with pytest.raises(DataError, match=r"row 1 of the file, column 'item': id 10 is outside \[0, 10\) \(encoding=id\)\. "
                                        r"Raise data.sparse\[item\].num_embeddings, or use encoding=mod or hash"):
        read_all(parquet_data(path))


@pytest.mark.parametrize("encoding", ["id", "mod", "hash"])
def test_float_id_column_is_one_type_error_not_every_row_out_of_range(tmp_path: Path, encoding: str) -> None:
    # pandas writes an id column with one missing value as float64: 1.0 is in range, yet it was reported as
    # "id 1.0 is outside [0, 10)" on every row (and skipped as a bad row with on_bad_rows=skip); refused when the data is
    # built (the file's footer says it), as the encoder refuses it at a read
    path = parquet(tmp_path, label=[0, 1, 0], item=[1.0, 2.0, None])
    sparse = [{"name": "item", "num_embeddings": 10, "encoding": encoding}]
    said = rf"column 'item' holds double values, but data\.sparse\[item\] \(encoding={encoding}\) reads ids: integers or text\. Fix: write the column as int64"
    with pytest.raises(DataError, match=r"p\.parquet: " + said):
        parquet_data(path, sparse=sparse, on_bad_rows="skip")
    encoder = Encoder(Schema(label="label", sparse=[SparseColumn(**sparse[0])]))
    with pytest.raises(ValueError, match=r"p\.parquet, row group 0: " + said):
        encoder.encode(pq.read_table(path), Location(path, "row group 0", np.arange(3)))


def test_wrong_field_count_in_csv(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("label,item\n1,2\n0,1,7\n1,3\n")
    with pytest.raises(DataError, match=r"bad row in .*a\.csv, line 3: expected 2 fields separated by ',', found 3"):
        read_all(CsvData(make(CsvDataConfig, path=str(tmp_path / "a.csv"), eval_path=str(tmp_path / "a.csv"), batch_size=1, sparse=SPARSE)))


def test_skip_mode_skips_and_counts_every_kind(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("label,item,price\n1,2,3.5\n0,1,abc\n2,1,1\n,1,1\n1,99,1\n0,1,1,1\n1,4,0\n")
    data = CsvData(make(CsvDataConfig, path=str(tmp_path / "a.csv"), eval_path=str(tmp_path / "a.csv"), batch_size=1, shuffle=False, on_bad_rows="skip",
                   sparse=SPARSE, dense=[{"name": "price"}]))
    assert data.num_train_batches(1) is None
    items = [b.sparse_features.values().tolist() for b in data.train_batches(0, 0, 1)]
    assert items == [[2], [4]]
    assert data.metrics()["data/bad_rows_skipped"] == 5  # non-number, label 2, null label, id 99, extra field


def test_mixed_embedding_dims_rejected_for_deepfm(make_cfg, tmp_path: Path) -> None:
    path = parquet(tmp_path, label=[0, 1] * 50, item=[1, 2] * 50, tag=[3, 4] * 50)
    cfg = make_cfg("data=parquet", f"data.path={path}", "data.batch_size=8",
                   "data.sparse=[{name: item, num_embeddings: 10}, {name: tag, num_embeddings: 10, embedding_dim: 8}]",
                   "train.num_steps=2", "distributed.device=cpu", "tracking=none", tiny=False)
    with pytest.raises(ConfigError, match=r"DeepFM needs one embedding width for every feature \(model.embedding_dim=16\): its FM term .*\{'tag': 8\}"):
        run(cfg)


def test_config_mistakes_name_the_key() -> None:
    with pytest.raises(ConfigError, match="data.path is required"):
        ParquetData(make(ParquetDataConfig, sparse=SPARSE))
    with pytest.raises(ConfigError, match=r"data.sparse\[item\].encoding='hsh' must be one of"):
        ParquetData(make(ParquetDataConfig, path="x", sparse=[{"name": "item", "num_embeddings": 10, "encoding": "hsh"}]))
    with pytest.raises(ConfigError, match="data.eval_path and data.eval_fraction=0.2 are both set"):
        ParquetData(make(ParquetDataConfig, path="x", eval_path="y", eval_fraction=0.2, sparse=SPARSE))
    with pytest.raises(ConfigError, match="data.header=false needs data.column_names"):
        CsvData(make(CsvDataConfig, path="x", header=False, sparse=SPARSE))


def test_uint64_ids_beyond_int64_are_bad_rows_not_wrapped(tmp_path: Path) -> None:
    path = parquet(tmp_path, label=[0, 1, 0], item=pa.array([1, 2**64 - 1, 3], pa.uint64()))
    with pytest.raises(DataError, match=r"row 1 of the file, column 'item': 18446744073709551615 does not fit in a signed 64-bit integer: "
                                        r"ids must lie in \[-2\*\*63, 2\*\*63\)\. Hash such ids into the table with data.sparse\[item\].encoding=hash"):
        read_all(parquet_data(path, sparse=[{"name": "item", "num_embeddings": 10, "encoding": "mod"}]))
    hashed = parquet_data(path, sparse=[{"name": "item", "num_embeddings": 10, "encoding": "hash"}])  # the fix the message names
    ids = [v for b in hashed.eval_batches(0, 1) for v in b.sparse_features.values().tolist()]
    assert ids == (splitmix64(np.array([1, 2**64 - 1, 3], np.uint64)) % np.uint64(10)).astype(np.int64).tolist()


def test_binary_file_given_to_data_csv(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"label,item\n\x00\x01\x02\n")
    with pytest.raises(DataError, match=r"a\.bin is not a text file \(NUL bytes in its first 15 bytes\).*Fix: point data.path at CSV/TSV files"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "a.bin"), sparse=SPARSE))


def test_header_less_csv_with_another_delimiter_names_it(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("1;2\n0;3\n")
    data = CsvData(make(CsvDataConfig, path=str(tmp_path / "a.txt"), eval_path=str(tmp_path / "a.txt"), batch_size=1, header=False,
                   column_names=["label", "item"], sparse=SPARSE))
    with pytest.raises(DataError, match=r"a\.txt, line 1: expected 2 fields separated by ',', found 1 \('1;2'\)\. The line contains "
                                        r"semicolons: the file looks semicolon-separated, but data.delimiter=','\. Fix: set data.delimiter=';'"):
        read_all(data)


def test_csv_file_removed_after_start_up(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("label,item\n1,2\n0,3\n")
    data = CsvData(make(CsvDataConfig, path=str(tmp_path / "a.csv"), eval_path=str(tmp_path / "a.csv"), batch_size=1, sparse=SPARSE))
    (tmp_path / "a.csv").unlink()
    with pytest.raises(DataError, match=r"a\.csv cannot be read \(No such file or directory\)\. Fix: check that it exists"):
        read_all(data)


def test_unclosed_quote_in_csv_is_the_bad_row_not_the_lines_after_it(tmp_path: Path) -> None:
    # a stray quote ran the reader on into the next lines: an inferred schema was fitted on the lines before it only
    # ("inferred no sparse column"), the read said "found 2 fields", and on_bad_rows=skip lost every later line as one bad row
    lines = ["label,item,price", "1,2,0.5", '0,"7,0.5', *(f"{i % 2},{i % 5 + 10},0.{i}" for i in range(10, 30))]
    (tmp_path / "a.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "fixed.csv").write_text("\n".join(lines[:2] + lines[3:]) + "\n")
    path = str(tmp_path / "a.csv")
    said = r"bad row in .*a\.csv, line 3: a field opens a quote \(\"\) that the line does not close \('0,\"7,0\.5'\).*Fix the line"
    with pytest.raises(DataError, match=said):
        CsvData(make(CsvDataConfig, path=path))  # the sample for the inferred schema
    with pytest.raises(DataError, match=said):
        read_all(CsvData(make(CsvDataConfig, path=path, eval_path=path, batch_size=1, sparse=SPARSE, dense=[{"name": "price"}])))
    skipped = CsvData(make(CsvDataConfig, path=path, eval_path=path, batch_size=1, shuffle=False, on_bad_rows="skip"))
    assert skipped.schema == CsvData(make(CsvDataConfig, path=str(tmp_path / "fixed.csv"))).schema  # every line but the bad one
    items = [v for b in skipped.train_batches(0, 0, 1) for v in b.sparse_features.values().tolist()]
    assert len(items) == 21 and skipped.metrics()["data/bad_rows_skipped"] == 1


def test_csv_not_in_utf8_names_the_line_and_the_encoding(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_bytes(b"label,item,price\n1,2,0.5\n0,3,0.1\n1,caf\xe9,0.2\n0,4,0.3\n")
    path = str(tmp_path / "a.csv")
    said = (r"a\.csv, line 4: not UTF-8 text \(byte b'\\xe9' at position 6 of the line: .*\); delimited text is read as UTF-8.*"
            r"Fix: convert the file to UTF-8, e\.g\. iconv -f latin1 -t utf-8 ")
    with pytest.raises(DataError, match=said):
        CsvData(make(CsvDataConfig, path=path))  # the sample for the inferred schema
    with pytest.raises(DataError, match=said):
        read_all(CsvData(make(CsvDataConfig, path=path, eval_path=path, batch_size=1,
                              sparse=[{"name": "item", "num_embeddings": 10, "encoding": "hash"}])))


def test_dense_value_beyond_float32_is_a_bad_row(tmp_path: Path) -> None:
    # 1e39 is a finite float64 but the model's dense input is float32: it read as inf, silently, and trained on NaN losses
    path = parquet(tmp_path, label=[0, 1, 0], item=[1, 2, 3], price=[1.0, 2.0, 1e39])
    with pytest.raises(DataError, match=r"row 2 of the file, column 'price': the value is 1e\+39, beyond the range of a 32-bit float "
                                        r"\(±3\.4e38\).*Log-scale it \(data\.dense\[price\]\.transform=log1p\) or clip it"):
        read_all(parquet_data(path, dense=[{"name": "price", "transform": "none"}]))
    data = parquet_data(path, dense=[{"name": "price", "transform": "log1p"}])  # log1p(1e39) is 89.8: fine
    assert all(torch.isfinite(b.dense_features).all() for b in data.train_batches(0, 0, 1))
    regression = parquet(tmp_path, "r.parquet", label=[0.5, 1e39, 2.0], item=[1, 2, 3])
    with pytest.raises(DataError, match=r"row 1 of the file, column 'label': the label \(task 'watch'\) is 1e\+39, but a regression label "
                                        r"must be finite \(within ±3\.4e38"):
        read_all(parquet_data(regression, labels={"watch": "label"}, label_kinds={"watch": "regression"}))


def test_int64_dense_values_beyond_2_53_are_read(tmp_path: Path) -> None:
    # Arrow's safe cast to float64 refused them: a traceback from inside Arrow ("Integer value ... not in range")
    path = parquet(tmp_path, label=[0, 1, 0], item=[1, 2, 3], stamp=pa.array([1, -2**63, 2**63 - 1], pa.int64()))
    data = parquet_data(path, dense=[{"name": "stamp", "transform": "none"}], batch_size=1)
    dense = torch.cat([b.dense_features for b in data.train_batches(0, 0, 1)]).flatten().tolist()
    assert dense == [1.0, float(np.float32(-2.0**63)), float(np.float32(2.0**63))]


def test_a_byte_order_mark_is_not_part_of_the_first_columns_name(tmp_path: Path) -> None:
    # Excel's "CSV UTF-8" begins with a BOM: the first column was named '\ufefflabel', so no label column was found, and the
    # fix offered, data.label=\ufefflabel, carried the invisible character
    (tmp_path / "excel.csv").write_text("\ufefflabel,item\n" + "".join(f"{i % 2},{i % 10}\n" for i in range(20)))
    data = CsvData(make(CsvDataConfig, path=str(tmp_path / "excel.csv"), eval_fraction=0.5, batch_size=1))  # label found by name
    assert data.schema.label == "label" and read_all(data) == 20
    (tmp_path / "excel.tsv").write_text("\ufefflabel\titem\n" + "".join(f"{i % 2}\t{i % 10}\n" for i in range(20)))
    data = CsvData(make(CsvDataConfig, path=str(tmp_path / "excel.tsv"), delimiter=None, header=None, sparse=SPARSE, batch_size=1))
    assert data.schema.label == "label"  # the header detected despite the mark


def test_repeated_column_names_are_refused(tmp_path: Path) -> None:
    # a CSV header naming 'item' twice read the first 'item' silently; a Parquet schema so made failed in Arrow with a KeyError
    (tmp_path / "d.csv").write_text("label,item,item\n1,2,3\n0,3,4\n")
    with pytest.raises(DataError, match=r"d\.csv: its header line names the column 'item' 2 times \(its columns are \['label', 'item', "
                                        r"'item'\]\).*Fix: rename the repeated columns in the header line, or name every column with "
                                        r"data\.column_names=\[\.\.\.\]"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "d.csv"), sparse=SPARSE))
    CsvData(make(CsvDataConfig, path=str(tmp_path / "d.csv"), eval_path=str(tmp_path / "d.csv"), column_names=["label", "item", "item2"],
                 sparse=SPARSE))  # the fix
    table = pa.Table.from_arrays([pa.array([0, 1]), pa.array([1, 2]), pa.array([3, 4])], names=["label", "item", "item"])
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet: its schema names the column 'item' 2 times .*Fix: write it again with a name "
                                        r"of its own for each column"):
        parquet_data(str(tmp_path / "d.parquet"))
    with pytest.raises(DataError, match=r"inferred no sparse \(categorical\) column .* left out 'item': the files name more than one "
                                        r"column so, and which is meant cannot be told \(rename one to read it\)"):
        parquet_data(str(tmp_path / "d.parquet"), sparse=[])  # inferred: not proposed, and said


def test_a_repeated_column_name_is_refused_only_where_a_column_of_that_name_is_read(tmp_path: Path) -> None:
    # two 'unused' columns (an export's) refused the file even where no column of that name was read; now such columns are
    # left alone (an inferred schema leaves them out, saying so) and only naming one of them is refused
    (tmp_path / "u.csv").write_text("label,item,unused,unused\n" + "".join(f"{i % 2},{i % 7},x,{i}\n" for i in range(20)))
    table = pa.Table.from_arrays([pa.array([i % 2 for i in range(20)]), pa.array([i % 7 for i in range(20)]), pa.array(["x"] * 20),
                                  pa.array(list(range(20)))], names=["label", "item", "unused", "unused"])
    pq.write_table(table, tmp_path / "u.parquet")
    unused = [{"name": "unused", "num_embeddings": 10, "encoding": "hash"}]
    for name, build, listed in (("u.csv", lambda path, **kw: CsvData(make(CsvDataConfig, path=path, eval_path=path, batch_size=2, **kw)),
                                 "its header line"), ("u.parquet", parquet_data, "its schema")):
        path = str(tmp_path / name)
        assert read_all(build(path, sparse=SPARSE)) == 40  # train and eval: every row
        inferred = build(path, sparse=[])
        assert inferred.schema.columns == ["label", "item"]
        for sparse in (unused, [{"name": "unused"}]):  # sized, and sized from the sample (which leaves the repeats out)
            with pytest.raises(DataError, match=rf"{re.escape(name)}: {listed} names the column 'unused' 2 times"):
                build(path, sparse=sparse)


def test_documentation_and_schema_files_in_a_text_directory_are_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # a directory of text files takes any name, so a dataset's README or the schema file saved beside the data was read
    # as rows: for an inferred schema its first line was every file's header ("none of its columns ['hello'] is named label")
    (tmp_path / "part-0.csv").write_text("label,item\n" + "".join(f"{i % 2},{i % 10}\n" for i in range(20)))
    for name in ("README", "LICENSE.txt", "notes.md", "schema.yaml", "part-0.csv.md5"):
        (tmp_path / name).write_text("hello\n")
    with caplog.at_level("INFO"):
        data = CsvData(make(CsvDataConfig, path=str(tmp_path), eval_fraction=0.5, batch_size=1))
    assert data.schema.label == "label" and read_all(data) == 20
    assert [Path(f).name for f in data.split_files()["train"].files] == ["part-0.csv"]
    said = [r.getMessage() for r in caplog.records if "left out as no data by their names" in r.getMessage()]
    assert len(said) == 1 and "5 file(s)" in said[0] and "LICENSE.txt, README, notes.md, part-0.csv.md5, schema.yaml" in said[0], said
    (tmp_path / "train.txt").write_text("label,item\n1,3\n")  # .txt stays data (Criteo's train.txt)
    assert "train.txt" in [Path(f).name for f in CsvData(make(CsvDataConfig, path=str(tmp_path), eval_fraction=0.5)).split_files()["train"].files]


def test_a_dictionary_encoded_column_reads_as_its_values(tmp_path: Path) -> None:
    # pandas writes a 'category' column as a Parquet dictionary column: hashed, it was a bad row "'a' is not an integer
    # (encoding=hash); use encoding=hash for strings", and the inferred schema left it out as "neither a number, text nor a list"
    names = ["a", "b", "c", "a"] * 10
    category = parquet(tmp_path, "category.parquet", label=[0, 1] * 20, item=pa.array(names).dictionary_encode())
    plain = parquet(tmp_path, "plain.parquet", label=[0, 1] * 20, item=names)
    hashed = [{"name": "item", "num_embeddings": 100, "encoding": "hash"}]

    def ids(path: str, sparse: list) -> list[int]:
        return [i for b in parquet_data(path, sparse=sparse).train_batches(0, 0, 1) for i in b.sparse_features.values().tolist()]
    assert ids(category, hashed) == ids(plain, hashed)
    view = parquet(tmp_path, "view.parquet", label=[0, 1] * 20, item=pa.array(names, pa.string_view()))  # Polars' text
    assert ids(view, hashed) == ids(plain, hashed)
    assert ids(category, []) == ids(plain, [])  # inferred: a vocabulary of its values, as of the text column
    assert parquet_data(category, sparse=[]).schema.vocabularies["item"].keys.size == 3


def test_a_sparse_column_of_another_type_than_ids_is_refused_at_start_up(tmp_path: Path) -> None:
    # a struct, a list of lists, bytes: each row was a bad row "id {'a': 1} is outside [0, 10)", or, hashed, "b'a' is not an
    # integer (encoding=hash); use encoding=hash for strings"
    for item, shown in ((pa.array([{"a": 1}, {"a": 2}]), "struct<a: int64>"), (pa.array([[[1]], [[2]]]), "list<element: list<element: int64>>"),
                        (pa.array([b"a", b"b"]), "binary")):
        path = parquet(tmp_path, label=[0, 1], item=item)
        for encoding in ("id", "hash"):
            with pytest.raises(DataError, match=rf"p\.parquet: column 'item' holds {re.escape(shown)} values, but data\.sparse\[item\] "
                                                r"reads ids: integers or text, or a list of them per row \(multi-hot\)\. Fix: write the "
                                                r"column as int64 or string"):
                parquet_data(path, sparse=[{"name": "item", "num_embeddings": 10, "encoding": encoding}])


def test_a_symbolic_link_to_nothing_is_refused_not_left_out(tmp_path: Path) -> None:
    # a broken link is no file: a directory's or a glob's listing dropped it without a word (training on fewer files), and
    # as data.path it "did not exist"
    (tmp_path / "a.csv").write_text("label,item\n1,2\n0,3\n")
    (tmp_path / "b.csv").symlink_to(tmp_path / "moved" / "b.csv")
    (tmp_path / "loop1.csv").symlink_to(tmp_path / "loop2.csv")
    (tmp_path / "loop2.csv").symlink_to(tmp_path / "loop1.csv")
    link = r"a symbolic link to '.*{}', which does not exist \(deleted or moved, or a loop of links\)\. Fix: restore the link's target"
    for path, said in ((tmp_path, r"holds .*b\.csv: " + link.format(r"moved/b\.csv")), (tmp_path / "*.csv", r"holds .*b\.csv: "
                       + link.format(r"moved/b\.csv")), (tmp_path / "loop1.csv", r"is " + link.format(r"loop2\.csv"))):
        with pytest.raises(DataError, match=rf"data\.path='{re.escape(str(path))}' {said}"):
            CsvData(make(CsvDataConfig, path=str(path), sparse=SPARSE))


def test_a_directorys_subdirectories_are_named_where_they_are_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # a Hive-partitioned folder (date=.../part-0.parquet): its subdirectories were left out silently
    parts = tmp_path / "events"
    (parts / "date=2026-11-01").mkdir(parents=True)
    parquet(parts / "date=2026-11-01", "part-0.parquet")
    with pytest.raises(DataError, match=r"is a directory without data files with a name ending in \.parquet, \.parq, \.pq \(its "
                                        r"subdirectories date=2026-11-01 are not read: name their files with a glob, e\.g\. "
                                        r"data\.path='.*events/\*\*/\*\.parquet'\)"):
        parquet_data(str(parts))
    parquet(parts, "part-0.parquet")
    with caplog.at_level("INFO"):
        parquet_data(str(parts))
    assert any("its files are read, not its 1 subdirectories (date=2026-11-01)" in r.getMessage() for r in caplog.records)
    assert read_all(parquet_data(str(parts / "**" / "*.parquet"))) == 2 * 6  # the glob the message gives reads both


def test_text_that_is_no_integer_in_an_id_column_is_said_so(tmp_path: Path) -> None:
    # was "id 'abc' is outside [0, 10) (encoding=id). Raise data.sparse[item].num_embeddings": no size holds 'abc'
    (tmp_path / "a.csv").write_text("label,item\n1,2\n0,abc\n")
    data = CsvData(make(CsvDataConfig, path=str(tmp_path / "a.csv"), eval_path=str(tmp_path / "a.csv"), batch_size=1, sparse=SPARSE))
    with pytest.raises(DataError, match=r"line 3, column 'item': 'abc' is not an integer, which encoding=id reads \(ids in \[0, 10\)\); "
                                        r"use encoding=hash for text"):
        read_all(data)


def test_zscore_statistics_that_overflow_name_the_column_and_the_fix(tmp_path: Path) -> None:
    # a std of inf was refused as a config error, "data.dense[price].std must be a positive finite number … got inf"
    path = parquet(tmp_path, label=[0, 1, 0], item=[1, 2, 3], price=[1.0, 1e200, 2.0])
    with pytest.raises(DataError, match=r"data\.dense\[price\]\.normalize=zscore: the mean and std of its 3 sampled values in "
                                        r"data\.path='.*p\.parquet' overflow a float \(mean=3\.33333e\+199, std=inf; the largest value is "
                                        r"1e\+200\)\. Fix: data\.dense\[price\]\.transform=log1p or clip"):
        parquet_data(path, dense=[{"name": "price", "transform": "none", "normalize": "zscore"}])


def test_a_directory_that_cannot_be_listed_is_a_data_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # os.listdir's PermissionError was a traceback; a mode of 000 does not stop root (as CI may run), so listing is refused here
    locked = tmp_path / "locked"
    locked.mkdir()
    listdir = os.listdir

    def refused(path: str) -> list[str]:
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)
    monkeypatch.setattr(os, "listdir", refused)
    with pytest.raises(DataError, match=r"data\.path='.*locked' is a directory that cannot be listed \(Permission denied\)\. Fix: check "
                                        r"that you may read it \(ls -ld .*locked\)"):
        CsvData(make(CsvDataConfig, path=str(locked), sparse=SPARSE))


def test_blank_lines_and_carriage_return_line_endings_are_named(tmp_path: Path) -> None:
    # a blank line was reported as "the label is missing (null or empty)"; a file of \r line endings alone as one header line,
    # "has no column 'price'; its header lists ['label', 'item', 'price\r1', ...]"
    for name, text, line in (("end.csv", "label,item\n1,2\n0,3\n\n", 4), ("middle.csv", "label,item\n1,2\r\n\r\n0,3\r\n", 3)):
        (tmp_path / name).write_text(text, newline="")
        data = CsvData(make(CsvDataConfig, path=str(tmp_path / name), eval_path=str(tmp_path / name), batch_size=1, sparse=SPARSE))
        with pytest.raises(DataError, match=rf"bad row in .*{name}, line {line}: the line is empty \(a blank line between the rows or "
                                            r"after the last one is a row without a label\)\. Fix: remove the blank lines"):
            read_all(data)
    skipping = CsvData(make(CsvDataConfig, path=str(tmp_path / "end.csv"), eval_path=str(tmp_path / "end.csv"), batch_size=1,
                            sparse=SPARSE, on_bad_rows="skip"))
    assert read_all(skipping) == 4 and skipping.metrics()["data/bad_rows_skipped"] == 2  # counted as bad rows, as before
    (tmp_path / "mac.csv").write_text("label,item\r1,2\r0,3\r", newline="")
    with pytest.raises(DataError, match=r"mac\.csv: its lines end in a carriage return alone \(\\r, classic Mac OS line endings; its first "
                                        r"line reads 'label,item\\r1,2\\r0,3'\).*Fix: convert its line endings, e\.g\. tr '\\r' '\\n'"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "mac.csv"), sparse=SPARSE))


def test_a_criteo_file_laid_out_otherwise_says_what_data_criteo_reads(tmp_path: Path) -> None:
    # a header line was a bad row "'label' is not a number"; commas offered "Fix: set data.delimiter=','", a key data=criteo lacks
    write_criteo_tsv(str(tmp_path / "day_0.tsv"), 20)
    lines = (tmp_path / "day_0.tsv").read_text().splitlines(keepends=True)
    (tmp_path / "header.tsv").write_text("\t".join(CRITEO_COLUMNS) + "\n" + "".join(lines))
    (tmp_path / "commas.csv").write_text("".join(line.replace("\t", ",") for line in lines))
    criteo = r"data=criteo reads Criteo's layout: tab-separated, no header line, 40 fields .*Fix: write the file so \(tail -n \+2"
    with pytest.raises(DataError, match=rf"header\.tsv begins with a header line \('label\\tint_0.*'\), but {criteo}"):
        CriteoData(make(CriteoDataConfig, path=str(tmp_path / "header.tsv"), num_embeddings=100))
    data = CriteoData(make(CriteoDataConfig, path=str(tmp_path / "commas.csv"), eval_path=str(tmp_path / "commas.csv"), num_embeddings=100))
    with pytest.raises(DataError, match=rf"commas\.csv, line 1: expected 40 fields separated by '\\t', found 1 .* The line contains commas: "
                                        rf"the file looks comma-separated, but {criteo}"):
        read_all(data)


def test_a_comma_separated_file_read_as_tsv_offers_the_comma_by_name(tmp_path: Path) -> None:
    # the fix offered, data.delimiter=',', reaches Hydra as a bare comma (the shell drops the quotes): a list separator
    (tmp_path / "a.csv").write_text("label,item\n1,2\n0,3\n")
    with pytest.raises(DataError, match=r"The line contains commas: the file looks comma-separated, but data\.delimiter='\\t'\. "
                                        r"Fix: set data\.delimiter=comma$"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "a.csv"), delimiter="\t", sparse=SPARSE))


def test_a_quoted_header_name_holding_the_delimiter_is_one_column(tmp_path: Path) -> None:
    # the header was split at every comma, quotes or not: 4 names for rows of 3 fields, so every row was "expected 4 fields"
    (tmp_path / "a.csv").write_text('"label","item","price, USD"\n1,2,3.5\n0,3,"4,5"\n')
    data = CsvData(make(CsvDataConfig, path=str(tmp_path / "a.csv"), eval_path=str(tmp_path / "a.csv"), batch_size=1, sparse=SPARSE,
                       dense=[{"name": "price, USD", "transform": "none"}]))
    with pytest.raises(DataError, match=r"line 3, column 'price, USD': '4,5' is not a number"):  # read as one field, as Arrow reads it
        read_all(data)


def test_an_empty_element_of_a_multi_hot_value_is_dropped_as_fitting_drops_it(tmp_path: Path) -> None:
    # 'a||b' read three ids, the third the hash of '' (and '|' two of them), where the fitted vocabulary leaves '' out and
    # docs/data.md says an empty list element is dropped
    (tmp_path / "a.csv").write_text("label,tags\n1,a|b\n0,a||b\n1,|\n0,a|\n")
    tags = {"name": "tags", "num_embeddings": 100, "encoding": "hash", "separator": "|"}
    data = CsvData(make(CsvDataConfig, path=str(tmp_path / "a.csv"), eval_path=str(tmp_path / "a.csv"), batch_size=4, sparse=[tags],
                        shuffle=False))
    kjt = next(iter(data.train_batches(0, 0, 1))).sparse_features
    a_b = kjt.values()[:2].tolist()
    assert kjt.lengths().tolist() == [2, 2, 0, 1] and kjt.values().tolist() == a_b + a_b + a_b[:1]


def test_a_file_without_a_column_the_first_file_has_is_named_as_the_odd_one(tmp_path: Path) -> None:
    # the fix offered was "correct the column names in data.label(s) / data.dense / data.sparse", also for a schema inferred
    # from the first file, whose names are not the mistake
    parquet(tmp_path, "a.parquet", label=[0, 1, 0], item=[1, 2, 3], price=[1.0, 2.0, 3.0])
    parquet(tmp_path, "b.parquet", label=[1, 0], item=[4, 5], cost=[1.0, 2.0])
    with pytest.raises(DataError, match=r"b\.parquet has no column 'price'; its columns are \['label', 'item', 'cost'\], but .*a\.parquet "
                                        r"has it: files read together hold the same columns\. Fix: write .*b\.parquet with the column, or "
                                        r"remove it"):
        parquet_data(str(tmp_path), dense=[{"name": "price"}])


def test_an_eval_file_without_a_column_of_the_training_files_names_itself_the_column_and_the_fix(tmp_path: Path) -> None:
    # was "ev.csv has no column 'price'; its header lists [...]. Fix: correct the column names in data.label(s) / data.dense
    # / data.sparse": the names are right (the training files' columns), the eval file is what lacks one
    (tmp_path / "tr.csv").write_text("label,item,price\n1,2,1.0\n0,3,2.0\n")
    (tmp_path / "ev.csv").write_text("label,item\n1,2\n")
    parquet(tmp_path, "tr.parquet")
    parquet(tmp_path, "ev.parquet", label=[0, 1], item=[1, 2])
    fix = (r"but the training files \(data\.path\) have it, e\.g\. .*tr\.{}: eval files \(data\.eval_path\) are read with the training "
           r"files' columns\. Fix: write .*ev\.{} with the column 'price', or point data\.eval_path at files that hold the training files' columns")
    with pytest.raises(DataError, match=r"ev\.csv has no column 'price' \(its header lists \['label', 'item'\]\), " + fix.format("csv", "csv")):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "tr.csv"), eval_path=str(tmp_path / "ev.csv"), sparse=SPARSE, dense=[{"name": "price"}]))
    with pytest.raises(DataError, match=r"ev\.parquet has no column 'price' \(its columns are \['label', 'item'\]\), "
                                        + fix.format("parquet", "parquet")):
        parquet_data(str(tmp_path / "tr.parquet"), eval_path=str(tmp_path / "ev.parquet"), dense=[{"name": "price"}])


def test_a_named_pipe_as_data_path_is_refused_without_opening_it(tmp_path: Path) -> None:
    # a FIFO was "a directory that cannot be listed (Not a directory)"; opened, a pipe without a writer blocks forever,
    # hence the alarm: the test fails rather than hangs should the path be opened
    fifo = tmp_path / "rows.csv"
    os.mkfifo(fifo)
    before = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(20)
    try:
        with pytest.raises(DataError, match=rf"data\.path='{re.escape(str(fifo))}' is a named pipe \(FIFO\), not a regular file: .* "
                                            r"Fix: write the data to a file and point data\.path at it"):
            CsvData(make(CsvDataConfig, path=str(fifo), sparse=SPARSE))
        with pytest.raises(DataError, match=r"is a directory without data files \(rows\.csv is a named pipe \(FIFO\): only regular "
                                            r"files are read\)"):
            CsvData(make(CsvDataConfig, path=str(tmp_path), sparse=SPARSE))
        with pytest.raises(DataError, match=r"is a glob pattern that matches no files \(rows\.csv is a named pipe \(FIFO\)"):
            CsvData(make(CsvDataConfig, path=str(tmp_path / "*.csv"), sparse=SPARSE))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


def _hung(*_: object) -> None:
    raise TimeoutError("reading the named pipe blocked: the data path was opened instead of refused")


def test_documentation_files_under_an_object_store_prefix_are_left_out_and_said(caplog: pytest.LogCaptureFixture) -> None:
    # a prefix left README and the like out as a local directory does, but without the log line that names them
    fs = fsspec.filesystem("memory")
    root = f"/datasmall-{os.getpid()}/train"
    fs.pipe(f"{root}/part-0.csv", ("label,item\n" + "".join(f"{i % 2},{i % 10}\n" for i in range(20))).encode())
    for name in ("README", "schema.yaml", "_SUCCESS"):
        fs.pipe(f"{root}/{name}", b"hello\n")
    try:
        with caplog.at_level("INFO"):
            data = CsvData(make(CsvDataConfig, path=f"memory://{root}/", eval_fraction=0.5, batch_size=1))
        assert read_all(data) == 20
        said = [r.getMessage() for r in caplog.records if "left out as no data by their names" in r.getMessage()]
        assert len(said) == 1 and "2 file(s) left out as no data by their names (README, schema.yaml)" in said[0], said
    finally:
        fs.rm(root, recursive=True)
