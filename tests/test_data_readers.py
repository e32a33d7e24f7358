"""Readers: exact batch contents for known rows in every format, shuffling, sharding, eval splits."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_runner.configurable import make
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.data.encoding.stored import StoredEncoders, from_json, stored_types
from recsys_runner.data.files.criteo_config import CriteoDataConfig
from recsys_runner.data.files.tabular import CriteoData, CsvData, ParquetData
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig
from recsys_runner.data.generated.generate import write_criteo_parquet
from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec, SparseFeature


def fnv1a(text: str) -> int:
    """Reference FNV-1a 64, written independently of the vectorized one."""
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) % (1 << 64)
    return h


def bags(batch, key: str) -> list[list[int]]:
    jt = batch.sparse_features[key]
    return [t.tolist() for t in jt.to_dense()]


CRITEO_LINES = [
    # label, 13 counts (empty = missing, negatives), 26 hex categoricals (empty = missing)
    ["1", "5", "-1", "", "0", *["2"] * 9, "68fd1e64", "", *["0000000a"] * 24],
    ["0", "", "-2", "7", "3", *["0"] * 9, "FFFFFFFF", "80e26c9b", *["00000001"] * 24],
    ["0", "1", "1", "1", "1", *["1"] * 9, "00000000", "00000010", *["00000002"] * 24],
    ["1", "100", "0", "0", "0", *["0"] * 9, "0000000f", "", *["00000003"] * 24],
]


def test_criteo_tsv_exact_rows(tmp_path: Path) -> None:
    path = tmp_path / "day_0.tsv"
    path.write_text("".join("\t".join(line) + "\n" for line in CRITEO_LINES))
    data = CriteoData(make(CriteoDataConfig, path=str(path), eval_path=str(path), batch_size=2, shuffle=False, num_embeddings=1000))
    batches = list(data.train_batches(0, 0, 1))
    assert len(batches) == 2 and data.num_train_batches(1) == 2
    b0, b1 = batches
    assert b0.labels.tolist() == [1.0, 0.0] and b1.labels.tolist() == [0.0, 1.0]
    # dense: missing -> 0, negatives clamped to 0, log1p
    assert b0.dense_features[0, :4].tolist() == pytest.approx([math.log1p(5), 0.0, 0.0, 0.0])
    assert b0.dense_features[1, :4].tolist() == pytest.approx([0.0, 0.0, math.log1p(7), math.log1p(3)])
    # categoricals: hex -> int, modulo the table size; a missing one is an empty bag
    assert bags(b0, "cat_0") == [[0x68FD1E64 % 1000], [0xFFFFFFFF % 1000]]
    assert b0.sparse_features["cat_1"].lengths().tolist() == [0, 1]
    assert b0.sparse_features["cat_1"].values().tolist() == [0x80E26C9B % 1000]
    assert bags(b1, "cat_2") == [[2], [3]]
    assert data.features.num_dense == 13 and len(data.features.sparse) == 26


def test_parquet_list_string_and_id_columns(tmp_path: Path) -> None:
    table = pa.table({
        "clicked": pa.array([1, 0, 1, 0], pa.int8()),
        "price": pa.array([1.5, None, -3.0, 10.0]),
        "item": pa.array([3, 0, 9, None], pa.int64()),
        "tags": pa.array([[1, 2], [], None, [7]], pa.list_(pa.int64())),
        "city": pa.array(["paris", "oslo", None, "paris"]),
    })
    pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=3)
    data = ParquetData(make(ParquetDataConfig, path=str(tmp_path), eval_path=str(tmp_path), label="clicked", batch_size=4, shuffle=False, drop_remainder=False,
        dense=[{"name": "price", "fill": -1.0}],
        sparse=[{"name": "item", "num_embeddings": 10}, {"name": "tags", "num_embeddings": 8, "pooling": "mean"},
                {"name": "city", "num_embeddings": 50, "encoding": "hash"}],
    ))
    (batch,) = list(data.train_batches(0, 0, 1))
    assert batch.labels.tolist() == [1, 0, 1, 0]
    assert batch.dense_features[:, 0].tolist() == [1.5, -1.0, -3.0, 10.0]
    assert bags(batch, "item") == [[3], [0], [9], []]
    kjt = batch.sparse_features
    assert kjt["tags"].lengths().tolist() == [2, 0, 0, 1] and kjt["tags"].values().tolist() == [1, 2, 7]
    paris, oslo = fnv1a("paris") % 50, fnv1a("oslo") % 50
    assert kjt["city"].lengths().tolist() == [1, 1, 0, 1] and kjt["city"].values().tolist() == [paris, oslo, paris]
    tables = {t.name: t for t in data.features.embedding_tables(8)}
    assert tables["t_tags"].pooling.value == "MEAN" and tables["t_item"].num_embeddings == 10


def test_a_multi_hot_cap_keeps_each_lists_first_values_counts_the_rows_and_warns_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``max_values``: a list of 950 ids is not pooled whole; its first values are kept (their weights with them), the rows
    cut counted in ``data/truncated_lists`` and warned of once with the longest list, and the cap travels with the model."""
    long = list(range(950))
    table = pa.table({
        "clicked": pa.array([1, 0, 1, 0], pa.int8()),
        "tags": pa.array([long, [4, 5], [6, 7, 8, 9, 1], None], pa.list_(pa.int64())),
        "tag_w": pa.array([[float(i) for i in long], [0.5, 0.25], [1.0, 2.0, 3.0, 4.0, 5.0], None], pa.list_(pa.float32())),
        "item": pa.array([1, 2, 3, 4], pa.int64()),
    })
    pq.write_table(table, tmp_path / "part-0.parquet")
    sparse = [{"name": "tags", "num_embeddings": 1000, "weights": "tag_w", "max_values": 3}, {"name": "item", "num_embeddings": 10}]
    data = ParquetData(make(ParquetDataConfig, path=str(tmp_path), eval_path=str(tmp_path), label="clicked", batch_size=2,
                            shuffle=False, sparse=sparse))
    with caplog.at_level("WARNING"):
        batches = list(data.train_batches(0, 0, 1))
    tags = [b.sparse_features["tags"] for b in batches]
    assert [n for jt in tags for n in jt.lengths().tolist()] == [3, 2, 3, 0]
    assert [v for jt in tags for v in jt.values().tolist()] == [0, 1, 2, 4, 5, 6, 7, 8]
    assert [w for jt in tags for w in jt.weights().tolist()] == [0.0, 1.0, 2.0, 0.5, 0.25, 1.0, 2.0, 3.0]
    assert data.metrics()["data/truncated_lists"] == 2
    warned = [r.getMessage() for r in caplog.records if "max_values" in r.getMessage()]
    assert len(warned) == 1 and "data.sparse[tags] longer than max_values=3" in warned[0] and "longest so far: 950" in warned[0]
    assert '"max_values": 3' in data.encoders_document().decode()
    uncapped = ParquetData(make(ParquetDataConfig, path=str(tmp_path), eval_path=str(tmp_path), label="clicked", batch_size=4,
                                shuffle=False, sparse=[{**sparse[0], "max_values": None}, sparse[1]]))
    (batch,) = list(uncapped.train_batches(0, 0, 1))
    assert batch.sparse_features["tags"].lengths().tolist() == [950, 2, 5, 0] and "data/truncated_lists" not in uncapped.metrics()


@pytest.mark.parametrize(("entry", "message"), [
    ({"name": "tags", "num_embeddings": 10, "max_values": 0}, r"data.sparse\[tags\].max_values=0 must be a positive integer"),
    ({"name": "x", "num_embeddings": 10, "cross": ["a", "b"], "max_values": 2}, r"a cross has one value per row"),
])
def test_a_multi_hot_cap_that_cannot_apply_is_a_config_error(tmp_path: Path, entry: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make(ParquetDataConfig, path=str(tmp_path), sparse=[entry])


def test_a_history_takes_its_groups_max_len_not_max_values(tmp_path: Path) -> None:
    table = pa.table({"clicked": pa.array([1, 0], pa.int8()), "hist": pa.array([[1, 2, 3], [4]], pa.list_(pa.int64())),
                      "item": pa.array([1, 2], pa.int64())})
    pq.write_table(table, tmp_path / "a.parquet")
    with pytest.raises(ConfigError, match=r"data.sparse \['hist'\] set max_values but are histories in data.sequences"):
        ParquetData(make(ParquetDataConfig, path=str(tmp_path), label="clicked", sequences={"h": {"features": ["hist"], "max_len": 2}},
                         sparse=[{"name": "hist", "num_embeddings": 10, "max_values": 2, "table": "items"},
                                 {"name": "item", "num_embeddings": 10, "table": "items"}]))


def test_csv_multi_hot_missing_token_and_header(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("y,age,genres,user\n1,30,a|b|c,u1\n0,NA,,u2\n1,-4,b,NA\n0,5,c|c,u1\n")
    data = CsvData(make(CsvDataConfig, path=str(tmp_path / "a.csv"), eval_path=str(tmp_path / "a.csv"), label="y", batch_size=4, shuffle=False,
        null_values=["", "NA"], dense=[{"name": "age", "transform": "log1p"}],
        sparse=[{"name": "genres", "num_embeddings": 100, "encoding": "hash", "separator": "|"},
                {"name": "user", "num_embeddings": 7, "encoding": "hash"}],
    ))
    (batch,) = list(data.train_batches(0, 0, 1))
    assert batch.labels.tolist() == [1, 0, 1, 0]
    assert batch.dense_features[:, 0].tolist() == pytest.approx([math.log1p(30), 0.0, 0.0, math.log1p(5)])
    g = {t: fnv1a(t) % 100 for t in "abc"}
    assert bags(batch, "genres") == [[g["a"], g["b"], g["c"]], [], [g["b"]], [g["c"], g["c"]]]
    assert bags(batch, "user") == [[fnv1a("u1") % 7], [fnv1a("u2") % 7], [], [fnv1a("u1") % 7]]


def test_tsv_without_header_and_block_boundaries(tmp_path: Path) -> None:
    lines = [f"{i % 2}\t{i}\t{i}" for i in range(23)]
    (tmp_path / "x.tsv").write_text("\n".join(lines))  # no trailing newline on the last line
    data = CsvData(make(CsvDataConfig, path=str(tmp_path / "x.tsv"), eval_path=str(tmp_path / "x.tsv"), batch_size=5, shuffle=False, drop_remainder=False,
                   delimiter="\t", header=False, column_names=["label", "v", "id"], block_rows=4,
                   dense=[{"name": "v"}], sparse=[{"name": "id", "num_embeddings": 23}]))
    ids = [i for b in data.train_batches(0, 0, 1) for i in b.sparse_features["id"].values().tolist()]
    assert ids == list(range(23))
    dense = [v for b in data.eval_batches(0, 1) for v in b.dense_features[:, 0].tolist()]
    assert dense == [float(i) for i in range(23)]


def id_data(tmp_path: Path, n: int, **kw) -> ParquetData:
    pq.write_table(pa.table({"label": np.arange(n) % 2, "rid": np.arange(n)}), tmp_path / "a.parquet", row_group_size=7)
    pq.write_table(pa.table({"label": np.arange(n) % 2, "rid": np.arange(n, 2 * n)}), tmp_path / "b.parquet", row_group_size=11)
    args = {"path": str(tmp_path), "batch_size": 4, "sparse": [{"name": "rid", "num_embeddings": 2 * n}], "shuffle_buffer_rows": 16} | kw
    return ParquetData(make(ParquetDataConfig, **args))


def row_ids(batches) -> list[int]:
    return [i for b in batches for i in b.sparse_features["rid"].values().tolist()]


def test_shards_are_disjoint_and_complete_over_ranks_and_workers(tmp_path: Path) -> None:
    data = id_data(tmp_path, 100, eval_fraction=0.2, drop_remainder=False, num_workers=2)
    world = 3
    train = [row_ids(data.train_batches(1, r, world)) for r in range(world)]
    evals = [row_ids(data.eval_batches(r, world)) for r in range(world)]
    everything = sorted(sum(train, []) + sum(evals, []))
    assert everything == list(range(200)), "every row exactly once per epoch, train and eval together"
    assert not set(sum(train, [])) & set(sum(evals, []))
    assert 20 < len(sum(evals, [])) < 60  # about eval_fraction of 200
    # drop_remainder: equal full batches on every rank, rows still disjoint
    data = id_data(tmp_path, 100, eval_fraction=0.2, num_workers=2)
    train = [row_ids(data.train_batches(0, r, world)) for r in range(world)]
    assert len({len(t) for t in train}) == 1 and len(train[0]) == 4 * data.num_train_batches(world)
    assert len(set(sum(train, []))) == len(sum(train, []))


def test_shuffle_is_seeded_per_epoch_and_bounded(tmp_path: Path) -> None:
    data = id_data(tmp_path, 100, eval_fraction=0.2, drop_remainder=False)
    e0, again, e1 = row_ids(data.train_batches(0, 0, 1)), row_ids(data.train_batches(0, 0, 1)), row_ids(data.train_batches(1, 0, 1))
    assert e0 == again and e0 != e1 and sorted(e0) == sorted(e1)
    assert e0 != sorted(e0)
    unshuffled = row_ids(id_data(tmp_path, 100, eval_fraction=0.2, shuffle=False, drop_remainder=False).train_batches(0, 0, 1))
    assert unshuffled == sorted(unshuffled)
    assert row_ids(data.eval_batches(0, 1)) == row_ids(data.eval_batches(0, 1))


def test_convert_criteo_then_train_schema_from_file_and_inspect(tmp_path: Path, capsys) -> None:
    src = tmp_path / "day_0.tsv"
    src.write_text("".join("\t".join(line) + "\n" for line in CRITEO_LINES))
    assert data_main(["convert", "--format", "criteo", "--num-embeddings", "1000", str(src), str(tmp_path / "out")]) == 0
    converted = ParquetData(make(ParquetDataConfig, path=str(tmp_path / "out"), eval_path=str(tmp_path / "out"), batch_size=2, shuffle=False))
    raw = CriteoData(make(CriteoDataConfig, path=str(src), eval_path=str(src), batch_size=2, shuffle=False, num_embeddings=1000))
    for a, b in zip(converted.train_batches(0, 0, 1), raw.train_batches(0, 0, 1), strict=True):
        assert a.labels.tolist() == b.labels.tolist()
        assert a.dense_features.flatten().tolist() == pytest.approx(b.dense_features.flatten().tolist())
        assert a.sparse_features.values().tolist() == b.sparse_features.values().tolist()
        assert a.sparse_features.lengths().tolist() == b.sparse_features.lengths().tolist()
    assert [f.num_embeddings for f in converted.features.sparse] == [1000] * 26
    capsys.readouterr()
    assert data_main(["inspect", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "1 file(s), 4 rows" in out and "rate 0.5000" in out
    cat1 = next(line for line in out.splitlines() if line.startswith("cat_1 "))
    assert cat1.split()[-2:] == ["2", "2"]  # 2 nulls, 2 distinct values


def test_inspect_criteo_text(tmp_path: Path, capsys) -> None:
    src = tmp_path / "day_0.tsv"
    src.write_text("".join("\t".join(line) + "\n" for line in CRITEO_LINES))
    assert data_main(["inspect", "--format", "criteo", str(src)]) == 0
    out = capsys.readouterr().out
    int0 = next(line for line in out.splitlines() if line.startswith("int_0 "))
    assert int0.split()[-2:] == ["1", "3"]


def test_shared_tables_and_dims_from_schema(tmp_path: Path) -> None:
    spec = FeatureSpec(("d",), (SparseFeature("a", 10, table="shared"), SparseFeature("b", 10, table="shared"),
                                SparseFeature("c", 5, embedding_dim=4)))
    tables = spec.embedding_tables(8)
    assert [(t.name, t.feature_names, t.embedding_dim) for t in tables] == [("shared", ["a", "b"], 8), ("t_c", ["c"], 4)]
    with pytest.raises(ConfigError, match="needs one embedding width.*'c': 4"):
        spec.require_uniform_dim(8, "DeepFM")
    bad = FeatureSpec((), (SparseFeature("a", 10, table="s"), SparseFeature("b", 11, table="s")))
    with pytest.raises(ConfigError, match="share table 's' but differ"):
        bad.embedding_tables(8)


def test_converted_parquet_reader_matches_generator(tmp_path: Path) -> None:
    write_criteo_parquet(str(tmp_path / "g.parquet"), 1000, num_embeddings=321, row_group_rows=128)
    data = ParquetData(make(ParquetDataConfig, path=str(tmp_path / "g.parquet"), batch_size=100))
    n = sum(b.labels.shape[0] for b in data.train_batches(0, 0, 1)) + sum(b.labels.shape[0] for b in data.eval_batches(0, 1))
    assert 880 <= n <= 1000 and data.num_train_batches(1) * 100 <= n
    assert all(int(b.sparse_features.values().max()) < 321 for b in data.train_batches(0, 0, 1))


def test_inspect_reports_list_lengths_and_suggests_max_values_for_a_long_tail(tmp_path: Path, capsys) -> None:
    """Choosing a multi-hot column's max_values needs its list lengths: inspect gives the longest and the 99th percentile,
    and names the cap where a few rows are far longer than the rest."""
    tags = [[i % 7] * (1 + i % 3) for i in range(299)] + [list(range(500))]  # lengths 1-3, and one of 500
    pq.write_table(pa.table({"label": [i % 2 for i in range(300)], "tags": tags, "cats": [[1, 2]] * 300}), tmp_path / "lists.parquet")
    assert data_main(["inspect", str(tmp_path / "lists.parquet")]) == 0
    out = capsys.readouterr().out.splitlines()
    (tags_line,) = [line for line in out if line.startswith("list 'tags'")]
    assert tags_line.startswith("list 'tags': lengths max 500, p99 3 (over 300 rows); a long tail: "
                                "data.sparse[tags].max_values=3 keeps 99% of rows whole and cuts 1"), tags_line
    assert "list 'cats': lengths max 2, p99 2 (over 300 rows)" in out  # no tail: no cap suggested


def test_predict_says_the_lists_it_cuts_to_max_values(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Predict cuts a list to its column's max_values as training does (the cap travels with the model); training counts
    such rows in data/truncated_lists, predict says them in one line rather than silently."""
    from recsys_runner import scoring
    from recsys_runner.data.files.parquet_source import ParquetSource

    tags = [list(range(40)), [1, 2], [3, 4, 5, 6], [7]]
    pq.write_table(pa.table({"label": [1, 0, 1, 0], "tags": tags, "item": [1, 2, 3, 4]}), tmp_path / "score.parquet")
    data = ParquetData(make(ParquetDataConfig, path=str(tmp_path), eval_path=str(tmp_path), batch_size=2, shuffle=False,
                            sparse=[{"name": "tags", "num_embeddings": 100, "max_values": 3}, {"name": "item", "num_embeddings": 10}]))
    source = ParquetSource([str(tmp_path / "score.parquet")], data.schema.columns, 1000)
    with caplog.at_level("INFO"):
        batches = list(scoring._batches(source, source.units(), data.schema, data.features, 2, []))
    assert [n for _, b, _, _ in batches for n in b.sparse_features["tags"].lengths().tolist()] == [3, 2, 3, 1]
    said = [r.getMessage() for r in caplog.records if "max_values" in r.getMessage()]
    assert said == ["predict: lists longer than max_values were cut to their first values: data.sparse[tags] in 2 rows "
                    "(max_values=3, the longest list 40)"], said


def test_a_bool_column_as_a_sparse_feature_reads_ids_0_and_1_in_training_and_with_stored_encoders(tmp_path: Path) -> None:
    # a Parquet bool column in data.sparse was a bad row for encoding=id ("id True is outside [0, 4)") and hash, though the
    # start-up check admits it and a cross keys it as 0/1; now False/True are the ids 0/1, alike in every encoding, also
    # where stored encoders read it (evaluate, predict)
    flags = [True, False, None, True] * 10
    pq.write_table(pa.table({"label": [0, 1] * 20, "flag": flags}), tmp_path / "bools.parquet")
    pq.write_table(pa.table({"label": [0, 1] * 20, "flag": pa.array([None if f is None else int(f) for f in flags], pa.int8())}),
                   tmp_path / "ints.parquet")

    def ids(name: str, entry: dict, encoders: StoredEncoders | None = None) -> tuple[list[int], ParquetData]:
        data = ParquetData(make(ParquetDataConfig, path=str(tmp_path / name), eval_path=str(tmp_path / name), batch_size=40,
                                shuffle=False, sparse=[{"name": "flag", **entry}]), encoders=encoders)
        return next(iter(data.train_batches(0, 0, 1))).sparse_features["flag"].values().tolist(), data

    for entry in ({"num_embeddings": 2}, {"num_embeddings": 2, "encoding": "mod"}, {"num_embeddings": 50, "encoding": "hash"}, {}):
        read, data = ids("bools.parquet", entry)
        assert read == ids("ints.parquet", entry)[0], entry
        if entry in ({"num_embeddings": 2}, {}):  # ids; an inferred vocabulary's rows (True the most frequent: row 0)
            assert read == ([1, 0, 1] if entry else [0, 1, 0]) * 10
        document = data.encoders_document()
        schema, kinds = from_json(document, "ck")
        stored = StoredEncoders(schema, kinds, "ck", stored_types(document))
        assert ids("bools.parquet", entry, stored)[0] == read, entry


def test_an_empty_day_is_said_as_empty_not_as_a_schema_to_infer(tmp_path: Path) -> None:
    """A day partition whose part files hold no rows, fine-tuned on with the checkpoint's encoders (nothing inferred): the
    sample said "has no rows to infer a schema from"; it says what evaluate says of the same files."""
    from recsys_runner.data.files.parquet_source import ParquetSource
    from recsys_runner.errors import DataError

    for i in range(2):
        pq.write_table(pa.table({"label": pa.array([], pa.int64()), "user": pa.array([], pa.string())}), tmp_path / f"part-{i}.parquet")
    files = sorted(str(p) for p in tmp_path.glob("*.parquet"))
    with pytest.raises(DataError, match=r"part-0.parquet is an empty Parquet file \(0 rows\), as do all 2 files read with it: there "
                                        r"are no rows to read"):
        ParquetSource(files, [], 1000).sample(100)
