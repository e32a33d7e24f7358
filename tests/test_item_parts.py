"""``data.items.path`` naming a folder of part files, as Spark writes a table: the same catalogue and the same full-corpus
eval as the single file; empty parts skipped, said once; an empty folder, a folder of empty parts, a part lacking a
column, parts of two formats or of two types of a column are errors naming the file and the fix; a part added to the
folder since a checkpoint was trained is a warning when it is evaluated; parts under an object-store prefix read alike."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from recsys_runner import evaluate, store_settings
from recsys_runner.__main__ import run as train
from recsys_runner.config import register_configs
from recsys_runner.configurable import make
from recsys_runner.data.catalogue.items import ItemTable
from recsys_runner.data.files.tabular_config import CsvDataConfig
from recsys_runner.errors import DataError
from recsys_runner.paths import CONFIG_PATH
from tests.object_store import moto_with_buckets
from tests.test_evaluate import compose_entry
from tests.test_exclude_seen import NUM_ITEMS, two_tower_files
from tests.test_retrieval_data import SPARSE, _items, _parquet, _rows


def write_parts(table: pa.Table, folder: Path, cuts: list[int], fmt: str = "parquet") -> Path:
    """``table`` as Spark leaves it: ``part-0000i`` files holding the rows between ``cuts`` (an empty range: a part of 0
    rows), a ``_SUCCESS`` marker and hidden ``.crc`` checksums."""
    folder.mkdir()
    bounds = [0, *cuts, table.num_rows]
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        part = table.slice(a, b - a)
        name = folder / f"part-{i:05d}-c000.{'snappy.parquet' if fmt == 'parquet' else 'csv'}"
        if fmt == "parquet":
            pq.write_table(part, name)
        else:
            part.to_pandas().to_csv(name, index=False)
        (folder / f".{name.name}.crc").write_bytes(b"\x00crc")
    (folder / "_SUCCESS").write_bytes(b"")
    return folder


def same_table(a: ItemTable | None, b: ItemTable | None) -> None:
    assert a is not None and b is not None and len(a) == len(b)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.popularity, b.popularity) and np.array_equal(a.dense, b.dense)
    assert a.features.keys() == b.features.keys()
    for name in a.features:
        assert all(np.array_equal(x, y) for x, y in zip(a.features[name], b.features[name], strict=True))


def test_a_folder_of_parquet_parts_is_the_catalogue_of_the_single_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pq.write_table(_rows(600, 1), tmp_path / "train.parquet", row_group_size=200)
    pq.write_table(_rows(200, 2), tmp_path / "eval.parquet")
    pq.write_table(_items(), tmp_path / "items.parquet")
    parts = write_parts(_items(), tmp_path / "items", [13, 13, 30])  # part 1 is empty
    with caplog.at_level(logging.INFO):
        folder = _parquet(tmp_path, {"path": str(parts)})
    same_table(folder.item_table(), _parquet(tmp_path).item_table())
    assert any("1 of 4 files in" in r.getMessage() and "part-00001" in r.getMessage() for r in caplog.records), "the empty part, said"
    recorded = folder.split_files()["items"]
    assert recorded.path == str(parts) and recorded.num_rows == 40 and [Path(f).name for f in recorded.files] == \
        ["part-00000-c000.snappy.parquet", "part-00002-c000.snappy.parquet", "part-00003-c000.snappy.parquet"]


def test_a_folder_of_csv_parts_is_the_catalogue_of_the_single_file(tmp_path: Path) -> None:
    _rows(300, 3).drop_columns(["hard"]).to_pandas().to_csv(tmp_path / "train.csv", index=False)
    _items().to_pandas().to_csv(tmp_path / "items.csv", index=False)
    parts = write_parts(_items(), tmp_path / "items", [10, 25, 25], fmt="csv")  # part 2: a header line alone
    last = parts / "part-00003-c000.csv"
    pd_part = pacsv.read_csv(last).to_pandas()
    pd_part.to_csv(parts / "part-00003-c000.csv.gz", index=False, compression="gzip")  # Spark's codec=gzip
    last.unlink()

    def data(path: Path) -> ItemTable | None:
        return make(CsvDataConfig, path=str(tmp_path / "train.csv"), label="label", sparse=SPARSE[:3], dense=[{"name": "price"}],
                    items={"path": str(path), "id": "item_id", "features": ["cate", "price"]}, batch_size=16,
                    num_workers=0).build().item_table()

    same_table(data(parts), data(tmp_path / "items.csv"))


def test_folder_mistakes_are_errors_naming_the_file_and_the_fix(tmp_path: Path) -> None:
    pq.write_table(_rows(600, 1), tmp_path / "train.parquet", row_group_size=200)
    pq.write_table(_rows(200, 2), tmp_path / "eval.parquet")
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "_SUCCESS").write_bytes(b"")
    with pytest.raises(DataError, match=r"data\.items\.path='.*none' is a directory without data files"):
        _parquet(tmp_path, {"path": str(tmp_path / "none")})
    empty = write_parts(_items().slice(0, 0), tmp_path / "empty", [0])
    with pytest.raises(DataError, match=r"part-00000-c000\.snappy\.parquet has no items \(no rows\), as do all 2 files.*"
                                        r"Fix: point data\.items\.path at files with rows"):
        _parquet(tmp_path, {"path": str(empty)})
    headers = write_parts(_items().slice(0, 0), tmp_path / "headers", [0], fmt="csv")  # text parts: a header line each
    with pytest.raises(DataError, match=r"part-00000-c000\.csv has a header line but no rows, as do all 2 files.*"
                                        r"Fix: point data\.items\.path at files with rows"):
        _parquet(tmp_path, {"path": str(headers)})
    wrong = write_parts(_items(), tmp_path / "wrong", [20])
    pq.write_table(_items(list(range(20, ITEMS_))).drop_columns(["cate"]), wrong / "part-00001-c000.snappy.parquet")
    with pytest.raises(DataError, match=r"part-00001-c000\.snappy\.parquet \(a part of data\.items\.path='.*wrong'\) has no column "
                                        r"'cate'.*Fix: add the column"):
        _parquet(tmp_path, {"path": str(wrong)})
    mixed = write_parts(_items(), tmp_path / "mixed", [20])
    (mixed / "README.txt").write_text("items of 2026-11\n")  # documentation is left out by its name (uris.is_data_name)
    (mixed / "items-2026-11.csv").write_text("item_id,cate\n1,2\n")
    with pytest.raises(DataError, match=r"names Parquet part files .* and other files \(.*items-2026-11\.csv\).*Fix: point data\.items\.path"):
        _parquet(tmp_path, {"path": str(mixed)})
    typed = write_parts(_items(), tmp_path / "typed", [20])
    ints = _items(list(range(20, ITEMS_))).set_column(0, "item_id", pa.array(range(20, ITEMS_), pa.int64()))
    pq.write_table(ints, typed / "part-00001-c000.snappy.parquet")
    with pytest.raises(DataError, match=r"column 'item_id' holds string values in .*part-00000.* but int64 values in .*part-00001.*"
                                        r"\(data\.items\.path\) must agree"):
        _parquet(tmp_path, {"path": str(typed)})
    zero = write_parts(_items(), tmp_path / "zero", [20])
    (zero / "part-00001-c000.snappy.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"part-00001-c000\.snappy\.parquet \(a part of .*\) is an empty file \(0 bytes\)"):
        _parquet(tmp_path, {"path": str(zero)})
    bad_line = write_parts(_items(), tmp_path / "bad_line", [20], fmt="csv")
    with open(bad_line / "part-00001-c000.csv", "a") as f:
        f.write("i99,1,2.0,3.0,surplus\n")
    with pytest.raises(DataError, match=r"bad row in .*part-00001-c000\.csv, line 22: expected 4 fields separated by ',', found 5 "
                                        r"\('i99,1,2.0,3.0,surplus'\)\. Fix the line, or set data\.on_bad_rows=skip"):
        _parquet(tmp_path, {"path": str(bad_line), "features": ["cate"], "popularity": None})
    misnamed = tmp_path / "items.csv"
    pq.write_table(_items(), misnamed)
    with pytest.raises(DataError, match=r"items\.csv \(data\.items\.path\) is a Parquet file .*Fix: rename it"):
        _parquet(tmp_path, {"path": str(misnamed)})
    dupes = write_parts(_items([*range(ITEMS_), 7]), tmp_path / "dupes", [20])
    with pytest.raises(DataError, match=r"part-00000.*, .*part-00001.* \(data\.items\.path\) has item 'i7' of column 'item_id' 2 times"):
        _parquet(tmp_path, {"path": str(dupes)})


ITEMS_ = 40
"""The items of ``test_retrieval_data``'s files."""


def _train(root: Path, items: Path) -> tuple[list[str], Path]:
    """dssm trained on ``two_tower_files`` with ``data.items.path=items``: its overrides and final checkpoint."""
    overrides = [*two_tower_files(root), f"data.items.path={items}"]
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        train(compose(config_name="config", overrides=overrides))
    return overrides, sorted((root / "ck").glob("step_*"))[-1]


def test_the_folder_gives_the_single_files_eval_and_a_part_added_since_training_is_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    two_tower_files(tmp_path)  # rows.parquet, items.parquet
    items = pq.read_table(tmp_path / "items.parquet")
    parts = write_parts(items, tmp_path / "items", [25, 25])
    overrides, checkpoint = _train(tmp_path, parts)
    from_folder = evaluate.run(compose_entry("evaluate", *overrides, f"load={checkpoint}"))
    from_file = evaluate.run(compose_entry("evaluate", *overrides, f"load={checkpoint}", f"data.items.path={tmp_path}/items.parquet"))
    assert from_folder == from_file and 0 < from_folder["eval/mrr"] < 1
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        evaluate.run(compose_entry("evaluate", *overrides, f"load={checkpoint}"))
    assert not [r for r in caplog.records if "changed since" in r.getMessage()], "the same folder: nothing to say"
    more = pa.table({"item_id": np.arange(NUM_ITEMS, NUM_ITEMS + 4), "cate": np.arange(NUM_ITEMS, NUM_ITEMS + 4) % 5})
    pq.write_table(more, parts / "part-00003-c000.snappy.parquet")  # the catalogue grew: 4 new items
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        grown = evaluate.run(compose_entry("evaluate", *overrides, f"load={checkpoint}"))
    said = [r.getMessage() for r in caplog.records if "changed since" in r.getMessage()]
    assert len(said) == 1 and "items (catalogue)" in said[0] and "full-corpus metrics over another catalogue" in said[0], said
    assert grown != from_folder, "4 more items to rank against"


def test_parts_under_an_object_store_prefix_are_the_catalogue_of_the_local_folder(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pq.write_table(_rows(600, 1), tmp_path / "train.parquet", row_group_size=200)
    pq.write_table(_rows(200, 2), tmp_path / "eval.parquet")
    parts = write_parts(_items(), tmp_path / "items", [13, 13, 30])
    with moto_with_buckets(tmp_path, "cat") as server, server.as_client(monkeypatch, store_settings.StorageConfig(max_attempts=2)):
        server.put(parts, "s3://cat/items")
        remote = _parquet(tmp_path, {"path": "s3://cat/items/"})
        same_table(remote.item_table(), _parquet(tmp_path, {"path": str(parts)}).item_table())
        assert remote.split_files()["items"].files == ("s3://cat/items/part-00000-c000.snappy.parquet",
                                                       "s3://cat/items/part-00002-c000.snappy.parquet",
                                                       "s3://cat/items/part-00003-c000.snappy.parquet")
