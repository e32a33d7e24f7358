"""Histories in Parquet and CSV files (``data.sequences``): one id space per shared table, truncation counted, event times
carried, CSV ``|`` cells read like Parquet lists, mistakes named before step 1, and ``data.batch_tokens`` batches."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_runner.configurable import make
from recsys_runner.data.files.tabular import CsvData, ParquetData
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig
from recsys_runner.data.schema_files import read_schema_file, schema_yaml
from recsys_runner.data.sequences.events import LogSpec
from recsys_runner.data.sequences.interactions import convert_log
from recsys_runner.errors import ConfigError, DataError
from tests.conftest import REPO, free_port

N = 60
MAX_LEN = 3


def histories(seed: int = 0, n: int = N) -> list[dict[str, Any]]:
    """Rows with histories of 0 … 6 events (some null, some empty lists), string item ids, integer categories."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(n):
        k = int(rng.integers(0, 7))
        items = [f"i{int(v)}" for v in rng.integers(0, 15, k)]
        times = sorted(int(t) for t in rng.integers(1000, 2000, k))
        empty: list | None = None if r % 7 == 0 else []
        rows.append({"user": int(rng.integers(0, 10)), "item": f"i{int(rng.integers(0, 15))}", "category": int(rng.integers(0, 5)),
                     "hist_item": items if k else empty, "hist_category": [int(v) for v in rng.integers(0, 5, k)] if k else empty,
                     "hist_ts": times if k else empty, "click": int(rng.integers(0, 2))})
    return rows


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    schema = pa.schema([("user", pa.int64()), ("item", pa.string()), ("category", pa.int64()), ("hist_item", pa.list_(pa.string())),
                        ("hist_category", pa.list_(pa.int64())), ("hist_ts", pa.list_(pa.int64())), ("click", pa.int8())])
    pq.write_table(pa.Table.from_pylist(rows, schema), path, row_group_size=25)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    def cell(v: Any) -> str:
        return "" if v is None else "|".join(str(x) for x in v) if isinstance(v, list) else str(v)

    names = list(rows[0])
    path.write_text(",".join(names) + "\n" + "".join(",".join(cell(r[c]) for c in names) + "\n" for r in rows))


def columns(separator: str | None = None, **hist: Any) -> dict[str, Any]:
    sep = {"separator": separator} if separator else {}
    return {"label": "click", "sparse": [{"name": "user", "num_embeddings": 10}, {"name": "item", "table": "item"},
                                         {"name": "category", "num_embeddings": 5, "table": "category"},
                                         {"name": "hist_item", "table": "item", **sep},
                                         {"name": "hist_category", "num_embeddings": 5, "table": "category", **sep}],
            "sequences": {"hist": {"features": ["hist_item", "hist_category"], "max_len": MAX_LEN, "timestamps": "hist_ts", **hist}}}


@pytest.fixture
def files(tmp_path: Path) -> Path:
    write_parquet(tmp_path / "train.parquet", histories(0))
    write_parquet(tmp_path / "eval.parquet", histories(1, 20))
    write_csv(tmp_path / "train.csv", histories(0))
    write_csv(tmp_path / "eval.csv", histories(1, 20))
    return tmp_path


def parquet(files: Path, **overrides: Any) -> ParquetData:
    return ParquetData(make(ParquetDataConfig, **{"path": str(files / "train.parquet"), "eval_path": str(files / "eval.parquet"),
                                                  "num_workers": 0, "shuffle": False, "batch_size": 8, "drop_remainder": False,
                                                  **columns(), **overrides}))


def per_row_lengths(files: Path) -> list[list[int]]:
    """Every training row's history length, as the reader without token batches gives them (truncated to max_len)."""
    return [b.sparse_features["hist_item"].lengths().tolist() for b in parquet(files).train_batches(0, 0, 1)]


def per_row(batches: list, key: str) -> list[list[int]]:
    out = []
    for b in batches:
        jt = b.sparse_features[key]
        out += [v.tolist() for v in jt.values().split(jt.lengths().tolist())]
    return out


def test_parquet_histories_share_the_candidates_id_space_and_keep_recent_events(files: Path, caplog) -> None:
    data = parquet(files)
    assert data.features.kjt_keys == ["user", "item", "category", "hist_item", "hist_category", "hist_ts"]
    pooling = {f.name: f.pooling for f in data.features.sparse}
    assert pooling == {"user": "sum", "item": "mean", "category": "mean", "hist_item": "mean", "hist_category": "mean"}
    item, hist = (next(c for c in data.schema.sparse if c.name == n) for n in ("item", "hist_item"))
    assert item.encoding == hist.encoding == "vocab" and item.num_embeddings == hist.num_embeddings
    with caplog.at_level(logging.WARNING):
        batches = list(data.train_batches(0, 0, 1)) + list(data.train_batches(1, 0, 1))
    raw = histories(0)
    kept = [r["hist_item"][-MAX_LEN:] if r["hist_item"] else [] for r in raw] * 2
    # One vocabulary for both columns: a raw item id has one row whether it is a candidate or an event.
    row_of: dict[str, int] = {}
    for raw_items, ids in zip([[r["item"]] for r in raw] * 2 + kept, per_row(batches, "item") + per_row(batches, "hist_item"), strict=True):
        for v, i in zip(raw_items, ids, strict=True):
            assert row_of.setdefault(v, i) == i
    assert len(set(row_of.values())) == len(row_of)
    assert per_row(batches, "hist_ts") == [r["hist_ts"][-MAX_LEN:] if r["hist_ts"] else [] for r in raw] * 2
    assert per_row(batches, "hist_category") == [r["hist_category"][-MAX_LEN:] if r["hist_category"] else [] for r in raw] * 2
    long = sum(len(r["hist_item"] or []) > MAX_LEN for r in raw)
    assert long and data.metrics()["data/truncated_histories"] == 2 * long
    assert sum("were truncated" in r.message for r in caplog.records) == 1
    assert batches[0].sparse_features["hist_ts"].values().dtype.is_floating_point is False


def test_truncate_oldest_keeps_the_first_events(files: Path) -> None:
    data = parquet(files, **columns(truncate="oldest"))
    batches = list(data.train_batches(0, 0, 1))
    assert per_row(batches, "hist_ts") == [r["hist_ts"][:MAX_LEN] if r["hist_ts"] else [] for r in histories(0)]


def test_csv_with_separated_cells_reads_the_same_batches_as_parquet(files: Path) -> None:
    csv = CsvData(make(CsvDataConfig, path=str(files / "train.csv"), eval_path=str(files / "eval.csv"), num_workers=0, shuffle=False,
                       batch_size=8, drop_remainder=False, block_rows=16, **columns("|")))
    pq_data = parquet(files)
    for a, b in zip(list(csv.train_batches(0, 0, 1)) + list(csv.eval_batches(0, 1)),
                    list(pq_data.train_batches(0, 0, 1)) + list(pq_data.eval_batches(0, 1)), strict=True):
        assert a.sparse_features.keys() == b.sparse_features.keys()
        assert a.sparse_features.values().tolist() == b.sparse_features.values().tolist()
        assert a.sparse_features.lengths().tolist() == b.sparse_features.lengths().tolist()
        assert a.labels.tolist() == b.labels.tolist()


def test_the_schema_file_and_the_stored_schema_keep_the_histories(files: Path, tmp_path: Path) -> None:
    data = parquet(files)
    (tmp_path / "schema.yaml").write_text(schema_yaml(data.schema))
    parts, _ = read_schema_file(str(tmp_path / "schema.yaml"))
    assert parts["sequences"] == data.schema.sequences
    again = ParquetData(make(ParquetDataConfig, path=str(files / "train.parquet"), eval_path=str(files / "eval.parquet"), num_workers=0,
                             schema=str(tmp_path / "schema.yaml")))
    assert again.features.sequences == data.features.sequences


def test_unequal_lengths_name_file_row_and_column(files: Path, tmp_path: Path) -> None:
    rows = histories(0)
    bad = next(i for i, r in enumerate(rows) if r["hist_item"] and len(r["hist_item"]) >= 2)
    rows[bad]["hist_category"] = rows[bad]["hist_category"][:-1]
    write_parquet(tmp_path / "bad.parquet", rows)
    data = parquet(files, path=str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError, match=rf"bad\.parquet, row group \d, row {bad} of the file, column 'hist_category': its list has "
                                        rf"\d+ value\(s\) but 'hist_item' has \d+"):
        list(data.train_batches(0, 0, 1))
    skipping = parquet(files, path=str(tmp_path / "bad.parquet"), on_bad_rows="skip")
    assert sum(len(b.labels) for b in skipping.train_batches(0, 0, 1)) == N - 1


def test_a_history_that_is_not_a_list_is_refused_before_training(files: Path, tmp_path: Path) -> None:
    table = pq.read_table(files / "train.parquet")
    flat = table.set_column(table.schema.get_field_index("hist_category"), "hist_category", pa.array(np.zeros(N, np.int64)))
    pq.write_table(flat, tmp_path / "flat.parquet")
    with pytest.raises(DataError, match=r"flat\.parquet: column 'hist_category' is in history data.sequences.hist but has type int64, not a list"):
        parquet(files, path=str(tmp_path / "flat.parquet"))


@pytest.mark.parametrize(("change", "message"), [
    ({"sequences": {"hist": {"features": ["hist_item", "hist_x"], "max_len": 3}}}, r"data.sequences.hist.features names 'hist_x', which is not a data.sparse column"),
    ({"sparse": [*columns()["sparse"], {"name": "hist_ts", "num_embeddings": 10}]}, r"data.sequences.hist.timestamps='hist_ts' is also a data.sparse column"),
    ({"batch_tokens": 3}, r"data.batch_tokens=3 is smaller than one row of the longest history: max_len=3"),
    ({"sequences": {"hist": {"features": ["hist_item"], "max_len": 3, "lenght": 2}}}, r"data.sequences.hist has unknown key\(s\) \['lenght'\]"),
])
def test_config_mistakes_are_named_at_validation(files: Path, change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make(ParquetDataConfig, **{"path": str(files / "train.parquet"), **columns(), **change})


def test_csv_history_without_separator_and_split_id_spaces_are_refused(files: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.sparse\[hist_item\] is a history \(data.sequences.hist\) but has no separator.*"
                                          r"Fix: data.sparse\[hist_item\].separator='\|'"):
        make(CsvDataConfig, path=str(files / "train.csv"), **columns())
    split = columns()
    split["sparse"][1] = {"name": "item", "table": "item", "num_embeddings": 20, "encoding": "hash"}
    split["sparse"][3] = {"name": "hist_item", "table": "item", "num_embeddings": 20, "encoding": "vocab"}
    with pytest.raises(ConfigError, match=r"data.sparse\[hist_item\] \(history of data.sequences.hist\) and data.sparse\[item\] share "
                                          r"table 'item' but not one id space"):
        parquet(files, **split)
    with pytest.raises(ConfigError, match=r"data.batch_tokens=64 sizes batches by history tokens, but this data"):
        make(ParquetDataConfig, path=str(files / "train.parquet"), label="click", sparse=[{"name": "user", "num_embeddings": 10}],
             batch_tokens=64)


def test_a_csv_history_of_another_separator_is_refused_naming_it(files: Path) -> None:
    """Histories written ``i3;i7`` read with ``separator: '|'``: every history was one id (the whole text), trained on
    without a word (the vocabulary is fitted on those texts, so nothing was out of vocabulary)."""
    (files / "semicolon.csv").write_text((files / "train.csv").read_text().replace("|", ";"))
    with pytest.raises(ConfigError, match=r"data.sparse\[hist_item\].separator='\|', but none of the \d+ sampled values of column "
                                          r"'hist_item' in .*semicolon.csv.* holds '\|', while \d+ hold ';' \(e.g. 'i\d+;i\d+.*'\): each "
                                          r"would be read as one id.*Fix: data.sparse\[hist_item\].separator=';'"):
        CsvData(make(CsvDataConfig, path=str(files / "semicolon.csv"), num_workers=0, **columns("|")))
    data = CsvData(make(CsvDataConfig, path=str(files / "semicolon.csv"), num_workers=0, batch_size=8, drop_remainder=False,
                        **columns(";")))
    assert max(len(h) for h in per_row(list(data.train_batches(0, 0, 1)), "hist_item")) == MAX_LEN


@pytest.mark.parametrize("grouped", [False, True])
def test_batch_tokens_cut_training_batches_by_history_tokens(files: Path, grouped: bool) -> None:
    data = parquet(files, batch_tokens=12, group_by_length=grouped)
    assert data.num_train_batches(1) is None and 1 <= data.batch_size <= 12
    batches = list(data.train_batches(0, 0, 1))
    lengths = [b.sparse_features["hist_item"].lengths() for b in batches]
    costs = [int(x.sum()) + len(x) for x in lengths]
    assert max(costs) <= 12 and sum(len(b.labels) for b in batches) == N
    assert len({len(b.labels) for b in batches}) > 1  # rows per batch vary with the histories
    assert all(len(b.labels) <= data.batch_size for b in data.eval_batches(0, 1))  # eval batches: expected rows
    if grouped:  # rows of similar length together: each batch padded to its longest row fits the budget too
        assert all(len(x) * (int(x.max()) + 1) <= 12 for x in lengths)
        assert sorted(v for x in lengths for v in x.tolist()) == sorted(v for x in per_row_lengths(files) for v in x)


@pytest.mark.slow
def test_two_ranks_train_din_with_batch_tokens(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n = 3000
    items = rng.integers(0, 3000, n)
    log = pa.table({"user": rng.integers(0, 400, n), "item": items, "timestamp": rng.integers(0, 10_000, n), "category": items % 300,
                    "click": (rng.random(n) < 0.4).astype(np.int8)})
    pq.write_table(log, tmp_path / "log.parquet")
    convert_log(str(tmp_path / "log.parquet"), str(tmp_path / "out"), LogSpec(label="click", sides=["category"], max_len=20,
                                                                             split="time", eval_from=9000))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", "recsys_runner", "model=din", "data=parquet", f"data.path={tmp_path}/out/train.parquet",
           f"data.eval_path={tmp_path}/out/eval.parquet", "data.batch_tokens=400", "data.num_workers=0",
           "train.num_steps=120", "tracking=none", "checkpoint=none", "distributed.device=cpu", "distributed.sharding_types=[table_wise]",
           "distributed.timeout_s=120", "train.log_every_steps=5"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-4000:]
    logs = out.stderr + out.stdout
    assert "step 120/120" in logs and "eval/auc=" in logs  # several epochs of unknown length, ranks in step


def test_convert_keeps_histories_and_their_times(files: Path, tmp_path: Path) -> None:
    from recsys_runner.data.__main__ import main as data_main

    csv = CsvData(make(CsvDataConfig, path=str(files / "train.csv"), eval_path=str(files / "eval.csv"), num_workers=0, shuffle=False,
                       batch_size=8, drop_remainder=False, **columns("|")))
    (tmp_path / "schema.yaml").write_text(schema_yaml(csv.schema, {"delimiter": ","}))
    assert data_main(["convert", "--format", "csv", "--schema", str(tmp_path / "schema.yaml"), str(files / "train.csv"),
                      str(tmp_path / "conv"), "--progress", "log"]) == 0
    converted = ParquetData(make(ParquetDataConfig, path=str(tmp_path / "conv"), eval_path=str(tmp_path / "conv"), num_workers=0,
                                 shuffle=False, batch_size=8, drop_remainder=False))
    assert converted.features.sequences == csv.features.sequences
    for a, b in zip(csv.train_batches(0, 0, 1), converted.train_batches(0, 0, 1), strict=True):
        assert a.sparse_features.keys() == b.sparse_features.keys()
        assert a.sparse_features.values().tolist() == b.sparse_features.values().tolist()
        assert a.sparse_features.lengths().tolist() == b.sparse_features.lengths().tolist()


def test_bad_event_times_name_the_line_or_the_column(files: Path, tmp_path: Path) -> None:
    rows = histories(0)
    bad = next(i for i, r in enumerate(rows) if r["hist_ts"])
    text = (files / "train.csv").read_text().splitlines()
    fields = text[bad + 1].split(",")
    fields[5] = "x" + fields[5]  # hist_ts
    text[bad + 1] = ",".join(fields)
    (tmp_path / "bad.csv").write_text("\n".join(text) + "\n")
    csv = CsvData(make(CsvDataConfig, path=str(tmp_path / "bad.csv"), eval_path=str(files / "eval.csv"), num_workers=0, shuffle=False,
                       batch_size=8, **columns("|")))
    with pytest.raises(DataError, match=rf"bad\.csv, line {bad + 2}, column 'hist_ts': an event time is not an integer"):
        list(csv.train_batches(0, 0, 1))
    table = pq.read_table(files / "train.parquet")
    floats = table.set_column(table.schema.get_field_index("hist_ts"), "hist_ts", table.column("hist_ts").cast(pa.list_(pa.float64())))
    pq.write_table(floats, tmp_path / "floats.parquet")
    with pytest.raises(DataError, match=r"floats\.parquet: column 'hist_ts' \(event times of data.sequences.hist\) holds double"):
        list(parquet(files, path=str(tmp_path / "floats.parquet")).train_batches(0, 0, 1))
