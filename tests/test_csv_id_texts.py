"""CSV training data keeps ids spelled differently apart: every CSV field is read as text (never as Arrow infers it), so
``hash``, ``vocab`` (fitted or a ``vocab_file``) and an inferred schema key ``"007"``, ``"7"``, ``"+7"`` and ``" 7"``
as four ids; ``encoding: id`` reads each as the row number 7, as its values are row numbers (docs/data.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from recsys_runner.configurable import make
from recsys_runner.data.files.tabular import CsvData
from recsys_runner.data.files.tabular_config import CsvDataConfig

SPELLINGS = ["007", "7", "+7", " 7", "70", "8", "9", "10"]


def _ids(tmp_path: Path, sparse: list[dict[str, Any]] | None) -> dict[str, set[int]]:
    """Each raw spelling → the ids the training batches give it (rows told apart by their dense ``x``)."""
    lines = ["label,user,x"] + [f"{i % 2},{u},{i}" for i, u in enumerate(SPELLINGS * 4)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    columns: dict[str, Any] = {"sparse": sparse, "dense": [{"name": "x"}]} if sparse is not None else {}
    data = CsvData(make(CsvDataConfig, path=str(tmp_path / "t.csv"), label="label", num_workers=0, shuffle=False, batch_size=64,
                        drop_remainder=False, **columns))
    out: dict[str, set[int]] = {}
    for batch in data.train_batches(0, 0, 1):
        x = batch.dense_features[:, 0].tolist() if sparse is not None else None
        for row, user in enumerate(batch.sparse_features["user"].values().tolist()):
            spelling = SPELLINGS[int(round(x[row])) % len(SPELLINGS)] if x is not None else str(row)
            out.setdefault(spelling, set()).add(user)
    return out


@pytest.mark.parametrize("sparse", [[{"name": "user", "encoding": "hash", "num_embeddings": 1_000_003}],
                                    [{"name": "user", "encoding": "vocab"}], "vocab_file"], ids=["hash", "vocab", "vocab_file"])
def test_hash_and_vocabularies_key_each_spelling_of_an_id_apart(tmp_path: Path, sparse: Any) -> None:
    if sparse == "vocab_file":
        (tmp_path / "v.txt").write_text("007\n7\n+7\n 7\n70\n8\n9\n10\n")
        sparse = [{"name": "user", "vocab_file": str(tmp_path / "v.txt")}]
    ids = _ids(tmp_path, sparse)
    assert all(len(v) == 1 for v in ids.values()), ids
    assert len({min(ids[s]) for s in ("007", "7", "+7", " 7")}) == 4, ids


def test_an_inferred_schema_keys_each_spelling_apart(tmp_path: Path) -> None:
    lines = ["label,user"] + [f"{i % 2},{u}" for i, u in enumerate(SPELLINGS * 4)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    data = CsvData(make(CsvDataConfig, path=str(tmp_path / "t.csv"), label="label", num_workers=0, shuffle=False, batch_size=64,
                        drop_remainder=False))
    ids = {v for b in data.train_batches(0, 0, 1) for v in b.sparse_features["user"].values().tolist()}
    assert len(ids) == len(SPELLINGS)  # eight spellings, eight ids (a type inference would make "007", "7", "+7", " 7" one)


def test_encoding_id_reads_each_spelling_as_its_row_number(tmp_path: Path) -> None:
    ids = _ids(tmp_path, [{"name": "user", "num_embeddings": 100}])
    assert {s: ids[s] for s in ("007", "7", "+7", " 7", "70")} == {"007": {7}, "7": {7}, "+7": {7}, " 7": {7}, "70": {70}}


def _inspected(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, list[str]]:
    """``data inspect``'s column lines: name → [type, nulls, distinct]."""
    from recsys_runner.data.__main__ import main as data_main

    capsys.readouterr()
    assert data_main(["inspect", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("column "))
    return {line.split()[0]: line.split()[1:] for line in lines[start + 1:] if not line.startswith("list ")}


def test_inspect_counts_a_csv_id_column_as_the_readers_key_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``inspect --format csv`` counted distinct values of Arrow's inferred types, so ``007`` and ``7`` (``+7``, `` 7``)
    were one value there and four ids in training (tests above); a dense column's ``1.0`` and ``1``, which training
    reads as one number, stay one; a multi-hot field counts its ids."""
    lines = ["label,user,price,tags"] + [f"{i % 2},{u},{p},{t}" for i, (u, p, t) in enumerate(
        [("007", "1.0", "a|b"), ("7", "1", "b"), ("+7", "2.5", "a||c"), (" 7", "1e3", ""), ("8", "1000", "c")] * 20)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    columns = _inspected(capsys, str(tmp_path / "t.csv"), "--format", "csv")
    assert columns["user"][-1] == "5"  # 007, 7, +7, " 7", 8: five ids (Arrow's int64 made them 7 and 8)
    assert columns["price"][-1] == "3"  # 1, 2.5, 1000
    assert columns["tags"][-2:] == ["20", "3"]  # a, b, c; the empty fields missing


def test_inspect_reads_a_csv_whose_later_rows_are_not_what_its_first_block_looked_like(tmp_path: Path,
                                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Arrow infers a CSV column's type from the file's first block, and its streaming reader then failed on a later
    block's text id (``ArrowInvalid: CSV conversion error to int64: invalid value 'abc'``, a traceback); training reads
    every field as text, and so does inspect now."""
    lines = ["label,item"] + [f"{i % 2},{i % 1000}" for i in range(200_000)] + ["1,abc"]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    assert _inspected(capsys, str(tmp_path / "t.csv"), "--format", "csv")["item"][-1] == "1001"


def test_inspect_of_parquet_counts_the_stored_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Parquet is read as stored: a text id column keeps ``007`` and ``7`` apart, an integer column holds 7 once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"label": [0, 1, 0, 1], "text_id": ["007", "7", "7", None], "int_id": [7, 7, 8, 8],
                             "x": [1.0, 1.0, 2.5, None]}), tmp_path / "t.parquet")
    columns = _inspected(capsys, str(tmp_path / "t.parquet"))
    assert columns == {"label": ["int64", "0", "2"], "text_id": ["string", "1", "2"], "int_id": ["int64", "0", "2"],
                       "x": ["double", "1", "2"]}
