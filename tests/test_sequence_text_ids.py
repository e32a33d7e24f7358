"""``sequences`` on a CSV log: ids that Arrow's type inference would merge ("007" and "7", "+3" and "3", "1e3" and
"1000", an id beyond int64) are refused naming the file, column, row and ``--ids-as-text``; with it they stay apart
(recorded in vocab.json, followed by a later ``--vocab`` run); a lossless integer log gives the rows it gave before."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_runner.data.sequences.events import LogSpec
from recsys_runner.data.sequences.interactions import convert_log
from recsys_runner.errors import ConfigError, DataError


def _csv(path: Path, header: str, rows: list[str]) -> str:
    path.write_text("\n".join([header, *rows]) + "\n")
    return str(path)


def _convert(log: str, out: Path, **spec: object) -> None:
    convert_log(log, str(out), LogSpec(**spec))  # type: ignore[arg-type]


LOSSY = [  # (column, ids in file order, the id named, what it reads as / merges with)
    ("user", ["007", "7", "007", "8", "8"], "'007'", "the same id as '7' in row 1"),
    ("item", ["+3", "3", "4", "4", "5"], "'+3'", "the same id as '3' in row 1"),
    ("item", ["1000", "1e3", "4", "4", "5"], "'1e3'", "the same id as '1000' in row 0"),
    ("item", ["99999999999999999999", "2", "3", "3", "4"], "'99999999999999999999'", "would hold '1e+20'"),
    ("user", ["01", "02", "02", "03", "03"], "'01'", "would hold '1'"),
    ("category", [" 12", "12", "5", "5", "5"], "' 12'", "the same id as '12' in row 1"),
]


def _log(tmp_path: Path, column: str, ids: list[str]) -> str:
    base = {"user": ["1", "1", "2", "2", "3"], "item": ["10", "11", "10", "12", "11"], "category": ["1", "2", "1", "3", "2"]}
    base[column] = ids
    return _csv(tmp_path / "log.csv", "user,item,timestamp,category",
                [f"{base['user'][i]},{base['item'][i]},{i},{base['category'][i]}" for i in range(5)])


@pytest.mark.parametrize(("column", "ids", "named", "merge"), LOSSY)
def test_ids_that_inference_would_merge_are_refused_naming_file_column_and_fix(tmp_path: Path, column: str, ids: list[str],
                                                                               named: str, merge: str) -> None:
    log = _log(tmp_path, column, ids)
    with pytest.raises(DataError) as e:
        _convert(log, tmp_path / "out", sides=["category"])
    message = str(e.value)
    assert log in message and f"column {column!r}" in message and named in message and merge in message
    assert "--ids-as-text" in message
    assert not (tmp_path / "out" / "train.parquet").exists()


def test_ids_as_text_keeps_them_apart_and_records_it(tmp_path: Path) -> None:
    log = _log(tmp_path, "user", ["007", "7", "007", "8", "8"])
    _convert(log, tmp_path / "out", ids_as_text=True)
    assert (tmp_path / "out" / "vocab" / "user_id.txt").read_text().split() == ["007", "7", "8"]
    index = json.loads((tmp_path / "out" / "vocab.json").read_text())
    assert index["ids_as_text"] is True and index["tables"]["user_id"]["integers"] is False
    rows = pa.concat_tables([pq.read_table(tmp_path / "out" / f"{p}.parquet") for p in ("train", "eval")])
    assert sorted(set(rows.column("user_id").to_pylist())) == [0, 1, 2]  # "007" and "7" are two users

    # a later --vocab run reads alike without the flag (its "007" keeps id 0), and the other setting is refused
    _convert(log, tmp_path / "again", vocab=str(tmp_path / "out"))
    for part in ("train", "eval"):
        assert pq.read_table(tmp_path / "again" / f"{part}.parquet").equals(pq.read_table(tmp_path / "out" / f"{part}.parquet"))
    with pytest.raises(ConfigError, match="read the earlier log's id columns as text.*Fix: drop --no-ids-as-text"):
        _convert(log, tmp_path / "other", vocab=str(tmp_path / "out"), ids_as_text=False)


def test_vocab_of_an_inferred_mapping_refuses_ids_as_text(tmp_path: Path) -> None:
    log = _log(tmp_path, "user", ["1", "1", "2", "2", "3"])
    _convert(log, tmp_path / "out")
    with pytest.raises(ConfigError, match=r"as Arrow infers them \(no --ids-as-text\).*Fix: drop --ids-as-text"):
        _convert(log, tmp_path / "other", vocab=str(tmp_path / "out"), ids_as_text=True)


def test_empty_id_field_read_as_text_is_refused_as_missing(tmp_path: Path) -> None:
    log = _log(tmp_path, "user", ["a", "", "b", "b", "c"])
    with pytest.raises(DataError, match=r"row 1 .*column 'user' is missing"):
        _convert(log, tmp_path / "out", ids_as_text=True)


def test_lossless_integer_log_gives_the_rows_and_mapping_it_gave_before(tmp_path: Path) -> None:
    """The check reads more, changes nothing: a CSV of plain integer ids gives exactly the output of the same log as a
    Parquet file of int64 columns (the path the check never touches), and vocab.json records no ids_as_text."""
    lines = [f"{u},{100 + (u * 7 + k) % 13},{1000 + k},{k % 2},{(u + k) % 4}" for u in range(1, 9) for k in range(6)]
    log = _csv(tmp_path / "log.csv", "user,item,timestamp,click,category", lines)
    columns = list(zip(*(map(int, line.split(",")) for line in lines), strict=True))
    names = ["user", "item", "timestamp", "click", "category"]
    pq.write_table(pa.table({n: pa.array(c, pa.int64()) for n, c in zip(names, columns, strict=True)}), tmp_path / "log.parquet")
    _convert(log, tmp_path / "csv", label="click", sides=["category"])
    _convert(str(tmp_path / "log.parquet"), tmp_path / "pq", label="click", sides=["category"])
    for name in ("train.parquet", "eval.parquet"):
        assert pq.read_table(tmp_path / "csv" / name).equals(pq.read_table(tmp_path / "pq" / name))
    for name in ("vocab.json", "vocab/user_id.txt", "vocab/item.txt", "vocab/category.txt"):
        assert (tmp_path / "csv" / name).read_bytes() == (tmp_path / "pq" / name).read_bytes()
    assert "ids_as_text" not in json.loads((tmp_path / "csv" / "vocab.json").read_text())
    assert (tmp_path / "csv" / "vocab" / "user_id.txt").read_text().split() == [str(u) for u in range(1, 9)]


def test_vocab_run_on_float_ids_gives_the_ids_of_the_first_run(tmp_path: Path) -> None:
    """Float ids that read back as written (``1.5``) pass the check; a ``--vocab`` run keys them as the text of their
    vocab file (it stopped on an assertion: floats have no key of their own), so the same log gets the same ids."""
    log = _csv(tmp_path / "log.csv", "user,item,timestamp", ["1,1.5,1", "1,2.5,2", "2,1.5,3", "2,3.25,4", "3,9.5,5"])
    _convert(log, tmp_path / "out")
    assert (tmp_path / "out" / "vocab" / "item.txt").read_text().split() == ["1.5", "2.5", "3.25", "9.5"]
    _convert(log, tmp_path / "again", vocab=str(tmp_path / "out"))
    for part in ("train", "eval"):
        assert pq.read_table(tmp_path / "again" / f"{part}.parquet").equals(pq.read_table(tmp_path / "out" / f"{part}.parquet"))


def test_files_reading_an_id_column_as_integers_and_text_name_ids_as_text_which_reads_them(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    _csv(tmp_path / "logs" / "a.csv", "user,item,timestamp", ["1,10,1", "1,11,2", "2,10,3", "2,12,4"])
    _csv(tmp_path / "logs" / "b.csv", "user,item,timestamp", ["u3,10,5", "u3,11,6"])
    with pytest.raises(DataError, match=r"column 'user' holds int64 in .*a.csv but string in .*b.csv.*or --ids-as-text"):
        _convert(str(tmp_path / "logs"), tmp_path / "out")
    _convert(str(tmp_path / "logs"), tmp_path / "out", ids_as_text=True)
    assert (tmp_path / "out" / "vocab" / "user_id.txt").read_text().split() == ["1", "2", "u3"]


def test_files_joining_integer_ids_beyond_2_53_with_float_ids_are_refused(tmp_path: Path) -> None:
    """Integer ids in one file and floats in another are joined as floats: exact below 2**53 (the log reads as before),
    but 2**53 + 1 would read as 2**53, another user's id. Refused naming the file, the id and ``--ids-as-text``."""
    (tmp_path / "logs").mkdir()
    big = 2**53
    _csv(tmp_path / "logs" / "a.csv", "user,item,timestamp", [f"{big + 1},10,1", f"{big + 1},11,2", f"{big},10,3", f"{big},12,4"])
    _csv(tmp_path / "logs" / "b.csv", "user,item,timestamp", ["3.5,10,5", "3.5,11,6"])
    with pytest.raises(DataError, match=rf"a.csv, row 0 .*'user' holds integers here but floats in .*b.csv.*{big + 1} as {big}.*--ids-as-text"):
        _convert(str(tmp_path / "logs"), tmp_path / "out")
    _convert(str(tmp_path / "logs"), tmp_path / "out", ids_as_text=True)
    assert sorted((tmp_path / "out" / "vocab" / "user_id.txt").read_text().split()) == sorted([str(big), str(big + 1), "3.5"])
    (tmp_path / "small").mkdir()  # below 2**53 the join is exact and the log reads as before
    _csv(tmp_path / "small" / "a.csv", "user,item,timestamp", ["7,10,1", "7,11,2", "8,10,3", "8,12,4"])
    _csv(tmp_path / "small" / "b.csv", "user,item,timestamp", ["3.5,10,5", "3.5,11,6"])
    _convert(str(tmp_path / "small"), tmp_path / "small_out")
    assert (tmp_path / "small_out" / "vocab" / "user_id.txt").read_text().split() == ["3.5", "7.0", "8.0"]


def test_a_vocab_run_that_follows_ids_as_text_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command line: a ``--vocab`` run without the flag reads ids as its mapping did, and one line says it (a user
    who never passed ``--ids-as-text`` to this run learns why "007" and "7" stay apart); an inferred mapping: no line."""
    from recsys_runner.data.__main__ import main as data_main

    log = _log(tmp_path, "user", ["007", "7", "007", "8", "8"])
    args = ["--user", "user", "--item", "item", "--time", "timestamp"]
    assert data_main(["sequences", log, str(tmp_path / "out"), *args, "--ids-as-text"]) == 0
    capsys.readouterr()
    assert data_main(["sequences", log, str(tmp_path / "again"), *args, "--vocab", str(tmp_path / "out")]) == 0
    assert "its mapping read the id columns as text (--ids-as-text), and so did this run" in capsys.readouterr().out
    (tmp_path / "plain").mkdir()
    plain = _log(tmp_path / "plain", "user", ["1", "1", "2", "2", "3"])
    assert data_main(["sequences", plain, str(tmp_path / "p1"), *args]) == 0
    assert data_main(["sequences", plain, str(tmp_path / "p2"), *args, "--vocab", str(tmp_path / "p1")]) == 0
    assert "--ids-as-text" not in capsys.readouterr().out


def test_parquet_files_of_uint64_ids_beyond_2_53_beside_float_ids_are_refused_by_name(tmp_path: Path) -> None:
    """The join check reads any integer width: a Parquet file's uint64 ids beyond int64 are refused by name, not with
    Arrow's cast error."""
    (tmp_path / "logs").mkdir()
    big = 2**64 - 1
    pq.write_table(pa.table({"user": pa.array([big, big, 5, 5], pa.uint64()), "item": [10, 11, 10, 12], "timestamp": [1, 2, 3, 4]}),
                   tmp_path / "logs" / "a.parquet")
    pq.write_table(pa.table({"user": [3.5, 3.5], "item": [10, 11], "timestamp": [5, 6]}), tmp_path / "logs" / "b.parquet")
    with pytest.raises(DataError, match=rf"a.parquet, row 0 .*'user' holds integers here but floats .*{big} as .*--ids-as-text"):
        _convert(str(tmp_path / "logs"), tmp_path / "out")
