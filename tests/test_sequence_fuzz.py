"""Users' own sequence data, messy as it comes: event logs for ``python -m recsys_runner.data sequences`` and history
files for ``data=parquet``. Each case does the documented thing or stops early with one message naming the column, the
row and the fix; never a stack trace from inside pyarrow or torch, never a row lost or a value changed unsaid."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.files.tabular import CsvData, ParquetData
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig
from recsys_runner.errors import ConfigError, DataError
from tests.test_evaluate import compose_entry
from tests.test_sequence_rows import distinct_times_log, run_sequences


@pytest.mark.parametrize("protocol", [[], ["metrics.exclude_seen=true"], ["model.eval_negatives=5", "model.eval_metrics=[hr@3,mrr]"]],
                         ids=["full_table", "exclude_seen", "sampled"])
def test_eval_rows_whose_true_item_the_mapping_has_not_seen_are_misses_not_a_crash(tmp_path: Path, protocol: list[str]) -> None:
    """The next day's log encoded with ``--vocab`` holds items the earlier mapping lacks: an eval row whose true item
    is one of them ranks no candidate (a miss, docs/sequences.md) and its loss is left out, where the eval's loss
    indexed the candidates' scores by its OOV id and stopped inside torch (``IndexError: Target 30 is out of bounds``)."""
    rows = run_sequences(tmp_path, distinct_times_log(num_users=30, seed=5), "rows", "--max-len", "6")
    first = pq.read_table(tmp_path / "log.parquet").to_pylist()[0]
    new = pa.table({"user": [first["user"]] * 2 + ["user-new"] * 2, "item": [first["item"], 999_999, first["item"], first["item"]],
                    "timestamp": [5000, 5001, 5000, 5001]})
    later = run_sequences(tmp_path, new, "later", "--vocab", str(rows), name="later.parquet")
    assert pq.read_table(later / "eval.parquet").column("item_id").to_pylist()[0] >= len((rows / "vocab" / "item.txt").read_text().split())
    spec = validate(compose_entry(
        "config", "model=sasrec", "model.embedding_dim=8", "data=parquet", f"data.path={rows}/train.parquet",
        f"data.eval_path={later}/eval.parquet", "data.batch_size=16", "distributed.device=cpu", "tracking=none",
        f"checkpoint.dir={tmp_path}/ck", "model.eval_metrics=[hr@10,mrr]", *protocol))
    c = build(spec)
    try:
        metrics = c.loop.evaluator.evaluate()
    finally:
        c.close()
    hits = [v for k, v in metrics.items() if k.startswith("eval/hr_at_")]
    assert hits and max(hits) <= 0.5  # of the two rows, the OOV target's is a miss


def _sequences(tmp_path: Path, log: pa.Table | list[pa.Table], *flags: str) -> tuple[int, str, Path]:
    """``data sequences`` on ``log`` (several tables: a folder of files), its exit status, what it said, and its output."""
    from recsys_runner.data.__main__ import main as data_main

    folder = tmp_path / "log"
    folder.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(log if isinstance(log, list) else [log]):
        pq.write_table(t, folder / f"part-{i}.parquet")
    out = tmp_path / "out"
    buf_out, buf_err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf_out), contextlib.redirect_stderr(buf_err):
        rc = data_main(["sequences", str(folder), str(out), "--user", "user", "--item", "item", "--time", "ts", "--overwrite", *flags])
    return rc, buf_out.getvalue() + buf_err.getvalue(), out


LOG = {"user": [1, 1, 1, 2, 2], "item": [10, 11, 12, 10, 13], "ts": [100, 90, 95, 50, 60]}


def _log(**columns: object) -> pa.Table:
    return pa.table({**LOG, **columns})


@pytest.mark.parametrize(("log", "message"), [
    (_log(item=[[10], [11], [12], [10], [13]]), r"column 'item' holds list<element: int64> values, one list per line.*Fix: one event "
                                                 r"per line \(explode the lists first\)"),
    (_log(item=[10.0, 11.0, float("nan"), 10.0, 13.0]), r"row 2 \(0-based, header not counted\): column 'item' is missing \(null or NaN\)"),
    (_log(rating=[5.0, float("nan"), 3.0, 4.0, 1.0]), r"row 1 .*column 'rating' is missing \(null or NaN\).*--label"),
    (_log(ts=pa.array([1, 2, 3, 4, 2**63 + 4], pa.uint64())), r"the time column 'ts' \(uint64\) holds times beyond int64"),
    ([_log(), _log(item=["a", "b", "c", "d", "10"])], r"the log's column 'item' holds int64 in .*part-0.parquet but string in "
                                                       r".*part-1.parquet.*Fix: write the column with one type in every file"),
], ids=["list_ids", "nan_item", "nan_label", "uint64_times", "int_and_text_ids_across_files"])
def test_a_bad_log_column_is_refused_by_name(tmp_path: Path, log: pa.Table | list[pa.Table], message: str) -> None:
    """Each stopped inside pyarrow (a list or a mix of types: ``ArrowNotImplementedError``, ``ArrowTypeError``), or made a
    value of nothing: a NaN item became the item ``nan``, a NaN rating the label 0, uint64 times past int64 wrapped
    negative."""
    flags = ["--label", "rating", "--label-threshold", "4"] if "rating" in (log if isinstance(log, list) else [log])[0].column_names else []
    rc, said, out = _sequences(tmp_path, log, *flags)
    assert rc == 2 and said.startswith("Data error: ") and re.search(message, said), said
    assert not out.exists()


def test_timestamps_of_any_unit_and_dictionary_ids_make_the_rows_of_plain_columns(tmp_path: Path) -> None:
    """pandas writes datetimes as ``timestamp[ns]`` (or ``[us]``, with a time zone) and a ``category`` column
    dictionary-encoded: both stopped inside pyarrow (``Casting from timestamp[ms] to timestamp[s] would lose data``,
    ``Array type doesn't match type of values set``). Times are Unix seconds, a fraction floored."""
    rc, _, plain = _sequences(tmp_path / "plain", _log(item=["a", "b", "c", "a", "d"]))
    assert rc == 0
    fractions = pa.array([1_000_000_000 * t + 999_999_999 for t in LOG["ts"]], pa.int64()).cast(pa.timestamp("ns", tz="Europe/Paris"))
    rc, said, pandas_like = _sequences(tmp_path / "pandas", _log(item=pa.array(["a", "b", "c", "a", "d"]).dictionary_encode(),
                                                                ts=fractions))
    assert rc == 0, said
    for part in ("train", "eval"):
        assert pq.read_table(pandas_like / f"{part}.parquet").to_pylist() == pq.read_table(plain / f"{part}.parquet").to_pylist()
    assert pq.read_table(plain / "eval.parquet").column("ts").to_pylist() == [100, 60]


def test_held_out_rows_of_users_without_a_training_row_are_counted_and_said(tmp_path: Path) -> None:
    """A user with a single event (leave-last-out makes it an eval row with an empty history) and users whose every
    event is after ``--eval-from``: the eval's cold-start rows, said in one line; before, nothing said them."""
    single = pa.table({"user": [1, 1, 2, 3], "item": [10, 11, 12, 13], "ts": [1, 2, 3, 4]})
    rc, said, out = _sequences(tmp_path / "l", single)
    assert rc == 0 and "2 of the 3 eval rows are of users without a training row" in said
    assert sorted(len(h) for h in pq.read_table(out / "eval.parquet").column("hist_item_id").to_pylist()) == [0, 0, 1]
    later = pa.table({"user": [1, 1, 2, 2], "item": [10, 11, 12, 13], "ts": [1, 2, 30, 40]})
    rc, said, _ = _sequences(tmp_path / "t", later, "--split", "time", "--eval-from", "20")
    assert rc == 0 and "2 of the 2 eval rows are of users without a training row" in said
    rc, said, _ = _sequences(tmp_path / "n", pa.table(LOG))
    assert rc == 0 and "without a training row" not in said


def _history_file(tmp_path: Path, **columns: object) -> ParquetData:
    """``data=parquet`` over eight rows with two-event histories (``columns`` replace the defaults), group ``hist``."""
    table = {"user": list(range(8)), "item": [i % 5 for i in range(8)], "hist_item": [[1, 2]] * 8, "hist_ts": [[10, 20]] * 8,
             "click": [i % 2 for i in range(8)], **columns}
    pq.write_table(pa.table(table), tmp_path / "rows.parquet")
    sequences = {"hist": {"features": ["hist_item"], "max_len": 3, **({"timestamps": "hist_ts"} if "hist_ts" in table else {})}}
    return ParquetData(make(ParquetDataConfig, path=str(tmp_path / "rows.parquet"), eval_path=str(tmp_path / "rows.parquet"),
                            num_workers=0, shuffle=False, batch_size=4,
                            drop_remainder=False, label="click", sequences=sequences,
                            sparse=[{"name": "user", "num_embeddings": 10}, {"name": "item", "table": "item"},
                                    {"name": "hist_item", "table": "item"}]))


@pytest.mark.parametrize(("columns", "message"), [
    ({"hist_item": [[1, 2]] * 7 + [[1, None]]}, r"row 7 of the file, column 'hist_item': an id inside the history list is missing \(null"),
    ({"hist_item": [[1, 2]] * 7 + [[1, None]], "hist_ts": None}, r"row 7 of the file, column 'hist_item': an id inside the history "
                                                                    r"list is missing \(null"),
    ({"item": [str(i % 5) for i in range(8)], "hist_item": [["1", "2"]] * 7 + [["1", ""]]},
     r"row 7 of the file, column 'hist_item': an id inside the history list is missing \(null or empty\)"),
    ({"hist_ts": [[10, 20]] * 7 + [[20, 10]]}, r"row 7 of the file, column 'hist_ts': its event times fall.*Fix: write each history "
                                                r"oldest event first"),
], ids=["null_id_beside_times", "null_id_alone", "empty_text_id", "newest_first"])
def test_a_history_list_that_would_lose_or_misorder_an_event_is_a_bad_row(tmp_path: Path, columns: dict[str, object], message: str) -> None:
    """A null (or an empty text) inside a history list was dropped from that list alone: said as unequal lengths naming
    ``hist_ts``, or, alone in its group, not at all (the row trained on one event fewer). A newest-first history (times
    falling) was read as it is: truncation kept its oldest events and models read it backwards."""
    if columns.get("hist_ts", ()) is None:
        del columns["hist_ts"]
    data = _history_file(tmp_path, **columns)
    with pytest.raises(DataError, match=message):
        list(data.train_batches(0, 0, 1))


def test_history_times_as_timestamps_are_unix_seconds(tmp_path: Path) -> None:
    """A ``list<timestamp[ms]>`` history read its raw milliseconds as the times (1000x the seconds of int64 times)."""
    data = _history_file(tmp_path, hist_ts=pa.array([[10_000, 20_999]] * 8, pa.list_(pa.timestamp("ms", tz="UTC"))))
    times = [b.sparse_features["hist_ts"].values().tolist() for b in data.train_batches(0, 0, 1)]
    assert times == [[10, 20] * 4] * 2


def test_a_candidate_and_its_history_with_ids_of_two_kinds_are_refused(tmp_path: Path) -> None:
    """The item 1 as an integer candidate and as the text ``"1"`` in its history read two rows of the item table (the
    history never matched its candidate), unsaid."""
    with pytest.raises(DataError, match=r"data.sparse\[item\] holds integer ids and data.sparse\[hist_item\] text ids, but both read "
                                        r"table 'item'"):
        _history_file(tmp_path, hist_item=pa.array([["1", "2"]] * 8, pa.list_(pa.string())))


def test_float_ids_of_a_candidate_and_its_history_are_named_not_sized_to_nothing(tmp_path: Path) -> None:
    """pandas writes an id column with a missing value as float64, a history with one as list<double>: on one table left
    unsized, no value was keyed and the table was refused as ``num_embeddings=16 leaves no row for the vocabulary beside
    oov_buckets=16``, a config error naming neither the column nor its type."""
    with pytest.raises(DataError, match=r"column 'item' holds double values, but data.sparse\[item\].*reads ids: integers or text.*"
                                        r"pandas turns an id column with a missing value into float64"):
        _history_file(tmp_path, item=[float(i % 5) for i in range(8)], hist_item=[[1.0, 2.0]] * 8)


def test_an_empty_event_in_a_csv_history_field_is_a_bad_row_and_an_empty_field_no_history(tmp_path: Path) -> None:
    """``1||2`` in a CSV history field dropped its middle event from that list alone (said as unequal lengths naming
    the times column); an empty field stays an empty history."""
    def csv_data(cell: str) -> CsvData:
        lines = [f"{i},{i % 3},{cell if i == 0 else '1|2'},{'5|6|7' if i == 0 and cell else '' if i == 0 else '5|6'},{i % 2}" for i in range(6)]
        (tmp_path / "rows.csv").write_text("user,item,hist_item,hist_ts,click\n" + "\n".join(lines) + "\n")
        return CsvData(make(CsvDataConfig, path=str(tmp_path / "rows.csv"), eval_path=str(tmp_path / "rows.csv"), num_workers=0,
                            shuffle=False, batch_size=4, drop_remainder=False, label="click",
                            sparse=[{"name": "user", "num_embeddings": 10}, {"name": "item", "table": "item"},
                                    {"name": "hist_item", "table": "item", "separator": "|"}],
                            sequences={"hist": {"features": ["hist_item"], "max_len": 3, "timestamps": "hist_ts"}}))

    with pytest.raises(DataError, match=r"rows\.csv, line 2, column 'hist_item': an id inside the history list is missing"):
        list(csv_data("1||2").train_batches(0, 0, 1))
    lengths = [b.sparse_features["hist_item"].lengths().tolist() for b in csv_data("").train_batches(0, 0, 1)]
    assert lengths == [[0, 2, 2, 2], [2, 2]]


def test_rows_moved_away_from_their_mapping_are_named_with_the_fix(tmp_path: Path) -> None:
    """Copying ``train.parquet`` and ``eval.parquet`` out of the output folder left their mapping behind: the eval's
    candidates (and predict's top-k) were refused as ``the mapping folder=moved is not an earlier output of sequences
    ... Fix: point it at an earlier output folder``, naming no setting to point and not the file that named it."""
    import shutil

    from recsys_runner.data.sequences.mapping import candidate_items

    rows = run_sequences(tmp_path, distinct_times_log(num_users=5), "rows")
    (tmp_path / "moved").mkdir()
    shutil.copy(rows / "eval.parquet", tmp_path / "moved" / "eval.parquet")
    assert candidate_items([str(rows / "eval.parquet")], "item", 10_000).folder == str(rows)
    with pytest.raises(ConfigError, match=r"moved/eval\.parquet was written by python -m recsys_runner.data sequences with its id mapping "
                                          r"beside it, but its folder .*moved has no vocab.json.*Fix: keep the rows files in the output "
                                          r"folder with vocab.json and vocab/"):
        candidate_items([str(tmp_path / "moved" / "eval.parquet")], "item", 10_000)
