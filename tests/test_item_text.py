"""A delimited-text catalogue (``data.items.path``) read as the training files are: their delimiter, null markers and
header convention (``data.header``, ``data.column_names``, ``data.null_values``), or its own layout named by
``data.items.header`` / ``data.items.column_names``; header-less parts, gzip parts and ``NA`` nulls give the catalogue of
the plain headered file, and a catalogue laid out otherwise than configured is an error naming the file and the key."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_runner import evaluate
from recsys_runner.checkpoint.resume_changes import Launched, check_changes
from recsys_runner.configurable import make
from recsys_runner.data.catalogue.items import ItemTable
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig
from recsys_runner.errors import ConfigError, DataError
from tests.test_evaluate import compose_entry
from tests.test_exclude_seen import train_two_tower
from tests.test_item_parts import same_table
from tests.test_retrieval_data import ITEMS, SPARSE, _items, _rows

COLUMNS = ["label", "user_id", "item_id", "cate", "price"]
"""The training files' columns, in file order."""


def _csv(path: Path, table: pa.Table, header: bool = True, compression: str | None = None) -> Path:
    table.to_pandas().to_csv(path, index=False, header=header, compression=compression)
    return path


def _train_files(root: Path, header: bool, null: str = "") -> Path:
    """Training rows as CSV (``COLUMNS``); ``null``: the text of every 5th item's missing ``cate``."""
    rows = _rows(300, 3).select(COLUMNS)
    cate = [null if int(i[1:]) % 5 == 0 else str(c) for i, c in zip(rows["item_id"].to_pylist(), rows["cate"].to_pylist(), strict=True)]
    return _csv(root / "train.csv", rows.set_column(3, "cate", pa.array(cate)), header)


def _item_rows(null: str = "") -> pa.Table:
    """:func:`_items` with every 5th item's ``cate`` missing, written as ``null``."""
    items = _items()
    cate = [null if i % 5 == 0 else str(i % 8) for i in range(ITEMS)]
    return items.set_column(1, "cate", pa.array(cate))


def _table(train: Path, items: dict, **csv: object) -> ItemTable | None:
    """The item table of CSV training files ``train`` with ``data.items=items`` and the reader settings ``csv``."""
    config = make(CsvDataConfig, path=str(train), label="label", sparse=SPARSE[:3], dense=[{"name": "price"}],
                  items={"id": "item_id", "features": ["cate", "price"], "popularity": "count", **items}, batch_size=16,
                  num_workers=0, **csv)
    return config.build().item_table()


def test_header_less_gzip_parts_with_the_training_column_names_and_null_marker_are_the_headered_catalogue(tmp_path: Path) -> None:
    """Header-less training files with ``data.column_names`` and ``NA`` nulls: the catalogue's parts, header-less, one of
    them gzip, written with ``NA`` too, named by ``data.items.column_names``, give the catalogue of the plain headered file
    with empty nulls, and an ``NA`` item feature is missing (no id), as it is in the training rows."""
    (tmp_path / "plain").mkdir()
    baseline = _table(_train_files(tmp_path / "plain", header=True), {"path": str(_csv(tmp_path / "items.csv", _item_rows()))})
    train = _train_files(tmp_path, header=False, null="NA")
    rows = _item_rows("NA").select(["count", "price", "item_id", "cate"])
    parts = tmp_path / "parts"
    parts.mkdir()
    for i, (a, b) in enumerate([(0, 15), (15, 30), (30, ITEMS)]):  # Spark's header=false; the last part gzip-compressed
        gz = i == 2
        _csv(parts / f"part-{i:05d}.csv{'.gz' if gz else ''}", rows.slice(a, b - a), header=False, compression="gzip" if gz else None)
    (parts / "_SUCCESS").write_bytes(b"")
    items = {"path": str(parts), "column_names": ["count", "price", "item_id", "cate"]}
    table = _table(train, items, header=False, column_names=COLUMNS, null_values=["", "NA"])
    same_table(table, baseline)
    assert table is not None and table.features["cate"][1].tolist() == [0 if i % 5 == 0 else 1 for i in range(ITEMS)]


def test_a_catalogue_laid_out_as_the_header_less_training_files_reads_with_their_column_names(tmp_path: Path) -> None:
    """``data.items.header`` and ``column_names`` null: a header-less catalogue of the training files' columns is read
    with ``data.column_names``; one of other columns is an error naming ``data.items.column_names``."""
    train = _train_files(tmp_path, header=False)
    items = _item_rows()
    as_rows = pa.table({"label": np.ones(ITEMS, np.int64), "user_id": np.zeros(ITEMS, np.int64), "item_id": items["item_id"],
                        "cate": items["cate"], "price": items["price"]})
    table = _table(train, {"path": str(_csv(tmp_path / "items_as_rows.csv", as_rows, header=False)), "popularity": None},
                   header=False, column_names=COLUMNS)
    baseline = _table(train, {"path": str(_csv(tmp_path / "items.csv", items)), "popularity": None, "header": True},
                      header=False, column_names=COLUMNS)
    same_table(table, baseline)
    own = _csv(tmp_path / "own.csv", items.select(["item_id", "cate", "price"]), header=False)
    with pytest.raises(DataError, match=r"own\.csv \(data\.items\.path\): its first line 'i0,,0\.0' has 3 field\(s\) split by ',', "
                                        r"but data\.column_names \(the training files' columns.*names 5 columns.*Fix: "
                                        r"data\.items\.column_names=\[\.\.\.\] \(its 3 columns, in file order\)"):
        _table(train, {"path": str(own), "popularity": None}, header=False, column_names=COLUMNS)


def test_a_catalogue_whose_header_differs_from_the_training_files_is_an_error_naming_data_items_header(tmp_path: Path) -> None:
    headered = _csv(tmp_path / "headered.csv", _item_rows())
    bare = _csv(tmp_path / "bare.csv", _item_rows(), header=False)
    train = _train_files(tmp_path, header=False)
    with pytest.raises(DataError, match=r"headered\.csv begins with a header line .*but the training files \(data\.path\) have none "
                                        r"\(data\.items\.header=null reads items files as data\.header=false does\).*Fix: "
                                        r"data\.items\.header=true"):
        _table(train, {"path": str(headered)}, header=False, column_names=COLUMNS)
    assert _table(train, {"path": str(headered), "header": True}, header=False, column_names=COLUMNS) is not None
    (tmp_path / "h").mkdir()
    with_header = _train_files(tmp_path / "h", header=True)
    with pytest.raises(DataError, match=r"bare\.csv has no column 'item_id': its first line 'i0,,0\.0,40\.0' looks like data.*the "
                                        r"training files \(data\.path\) have a header line, this items file has none.*Fix: "
                                        r"data\.items\.header=false \(every line of the items files is data, under "
                                        r"data\.items\.column_names=\[\.\.\.\]"):
        _table(with_header, {"path": str(bare)})
    same_table(_table(with_header, {"path": str(bare), "header": False, "column_names": ["item_id", "cate", "price", "count"]}),
               _table(with_header, {"path": str(headered)}))
    with pytest.raises(ConfigError, match=r"data\.items\.header=false reads every line .*Fix: data\.items\.column_names=\[\.\.\.\]"):
        _table(with_header, {"path": str(bare), "header": False})
    with pytest.raises(ConfigError, match=r"data\.items\.column_names=\['item_id', 'cate', 'item_id'\] names a column twice"):
        _table(with_header, {"path": str(bare), "header": False, "column_names": ["item_id", "cate", "item_id"]})
    # data.items.column_names replaces the header's names: a misspelt id is said to be that key's, not the file's
    with pytest.raises(DataError, match=r"headered\.csv \(data\.items\.path\) has no column 'item_id', which data\.items names; "
                                        r"data\.items\.column_names names its columns \['itemid', 'cate', 'price', 'count'\]\. "
                                        r"Fix: correct data\.items\.column_names"):
        _table(with_header, {"path": str(headered), "column_names": ["itemid", "cate", "price", "count"]})
    with pytest.raises(DataError, match=r"bare\.csv \(data\.items\.path\) has no column 'item_id', which data\.items names; "
                                        r"data\.items\.column_names names its columns .*Fix: correct data\.items\.column_names"):
        _table(with_header, {"path": str(bare), "header": False, "column_names": ["itemid", "cate", "price", "count"]})


def test_evaluate_with_a_header_less_text_catalogue_equals_the_parquet_one(tmp_path: Path) -> None:
    """dssm trained on Parquet rows with a Parquet catalogue; evaluated with the same items as header-less CSV parts
    (``data.items.header=false``, its own column order in ``data.items.column_names``, a gzip part): the same metrics."""
    overrides, checkpoint = train_two_tower(tmp_path)
    items = pq.read_table(tmp_path / "items.parquet").select(["cate", "item_id"])
    (tmp_path / "parts").mkdir()
    _csv(tmp_path / "parts" / "part-0.csv", items.slice(0, 20), header=False)
    _csv(tmp_path / "parts" / "part-1.csv.gz", items.slice(20), header=False, compression="gzip")
    from_parquet = evaluate.run(compose_entry("evaluate", *overrides, f"load={checkpoint}"))
    from_text = evaluate.run(compose_entry("evaluate", *overrides, f"load={checkpoint}", f"data.items.path={tmp_path}/parts",
                                           "data.items.header=false", "data.items.column_names=[cate,item_id]"))
    assert from_text == from_parquet and 0 < from_parquet["eval/mrr"] < 1


def test_parquet_training_files_read_a_text_catalogue_with_empty_fields_as_nulls(tmp_path: Path) -> None:
    """Beside Parquet training files a text catalogue's empty field is missing, as a Parquet null is."""
    pq.write_table(_rows(600, 1), tmp_path / "train.parquet", row_group_size=200)
    pq.write_table(_rows(200, 2), tmp_path / "eval.parquet")
    items = _item_rows()
    nulls = items.set_column(1, "cate", pa.array([None if c == "" else int(c) for c in items["cate"].to_pylist()], pa.int64()))
    pq.write_table(nulls, tmp_path / "items.parquet")
    _csv(tmp_path / "items.csv", items)

    def table(path: Path) -> ItemTable | None:
        return make(ParquetDataConfig, path=str(tmp_path / "train.parquet"), eval_path=str(tmp_path / "eval.parquet"), label="label",
                    sparse=SPARSE, dense=[{"name": "price"}], items={"path": str(path), "id": "item_id", "features": ["cate", "price"],
                                                                     "popularity": "count"}, batch_size=32, num_workers=0).build().item_table()

    same_table(table(tmp_path / "items.csv"), table(tmp_path / "items.parquet"))


def test_the_training_files_null_marker_is_a_missing_item_feature(tmp_path: Path) -> None:
    """``data.null_values=['', NA]``: an items file's ``NA`` is a missing value, as in the training rows (not an id of its own)."""
    (tmp_path / "plain").mkdir()
    baseline = _table(_train_files(tmp_path / "plain", header=True), {"path": str(_csv(tmp_path / "items.csv", _item_rows()))})
    marked = _table(_train_files(tmp_path, header=True, null="NA"), {"path": str(_csv(tmp_path / "items_na.csv", _item_rows("NA")))},
                    null_values=["", "NA"])
    same_table(marked, baseline)


def test_resuming_a_checkpoint_saved_before_the_catalogue_layout_keys_warns_of_no_change(tmp_path: Path) -> None:
    """A checkpoint whose composed config predates ``data.items.header`` / ``column_names`` lacks them: their ``null``
    default is no change of setting to warn about (``resume_changes.ADDED_KEYS``); another value is."""
    old = {"data.items.path": "items.csv", "data.seed": 0}
    now = {**old, "data.items.header": None, "data.items.column_names": None}
    assert check_changes(Launched([], old), Launched([], now), tmp_path) == ()
    assert check_changes(Launched([], old), Launched([], {**now, "data.items.header": False}), tmp_path) != ()


def test_a_bad_items_line_follows_data_on_bad_rows(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``fail``: the line is named; ``skip``: its item is left out of the catalogue, said in one warning."""
    train = _train_files(tmp_path, header=True)
    items = _csv(tmp_path / "items.csv", _item_rows())
    lines = items.read_text().splitlines()
    lines[3] += ",surplus"  # item i2
    items.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"bad row in .*items\.csv, line 4: expected 4 fields separated by ',', found 5"):
        _table(train, {"path": str(items)})
    with caplog.at_level(logging.WARNING):
        table = _table(train, {"path": str(items)}, on_bad_rows="skip")
    assert table is not None and len(table) == ITEMS - 1
    said = [r.getMessage() for r in caplog.records if "bad lines skipped" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("1 bad lines skipped (data.on_bad_rows=skip): their items are not in the catalogue")


def test_the_text_layout_keys_beside_a_parquet_catalogue_are_said_to_have_no_effect(tmp_path: Path,
                                                                                    caplog: pytest.LogCaptureFixture) -> None:
    pq.write_table(_item_rows().set_column(1, "cate", pa.array([i % 8 for i in range(ITEMS)], pa.int64())), tmp_path / "items.parquet")
    with caplog.at_level(logging.WARNING):
        _table(_train_files(tmp_path, header=True), {"path": str(tmp_path / "items.parquet"), "header": False,
                                                     "column_names": ["item_id", "cate", "price", "count"]})
    assert any("is Parquet: data.items.header and data.items.column_names lay out delimited text and have no effect" in r.getMessage()
               for r in caplog.records)
