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
