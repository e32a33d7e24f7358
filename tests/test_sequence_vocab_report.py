"""What ``data sequences --vocab`` says about a new log's rows the earlier mapping has not seen (docs/sequences.md, *The id
mapping*): cold-start users counted by distinct raw user id, never by row or by the OOV row they share, and each part's
rows split into those whose items are all known and those holding an item the mapping has not seen."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from recsys_runner.data.__main__ import main as data_main


def _sequences(tmp_path: Path, log: pa.Table, name: str, *flags: str) -> tuple[str, Path]:
    pq.write_table(log, tmp_path / f"{name}.parquet")
    out = tmp_path / name
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = data_main(["sequences", str(tmp_path / f"{name}.parquet"), str(out), "--user", "user", "--item", "item", "--time", "ts", *flags])
    assert rc == 0, buf.getvalue()
    return buf.getvalue(), out


EARLIER = pa.table({"user": ["a", "a", "b", "b"], "item": [1, 2, 2, 3], "ts": [1, 2, 1, 2]})
"""The earlier output's log: users a, b; items 1, 2, 3 (one OOV row each)."""
NEW = pa.table({
    "user": ["a", "a", "a", "n1", "n1", "n2", "n2", "n3", "n4"],
    "item": [1, 9, 2, 1, 2, 3, 8, 1, 6],
    "ts": [10, 11, 12, 10, 11, 10, 11, 10, 10],
})
"""The next log, leave-last-out. Known user a: its rows hold item 9 (unseen) as the candidate (train) and in the history
(eval). New users n1-n4 all read the one OOV user row: n1 (known items), n2 (its eval candidate 8 unseen), n3 (one event,
known item) and n4 (one event, item 6 unseen) — n3 and n4 have no training row, though their OOV row has (n1's, n2's)."""


def test_vocab_counts_cold_start_users_by_raw_id_and_splits_rows_by_their_items(tmp_path: Path) -> None:
    _, first = _sequences(tmp_path, EARLIER, "first")
    said, second = _sequences(tmp_path, NEW, "second", "--vocab", str(first))
    assert f"--vocab {first}: 4 user_id id(s) of this log are not in its mapping (each reads an OOV row)" in said
    assert f"--vocab {first}: 3 item id(s) of this log are not in its mapping" in said
    # train: a@10 (known items), a@11 (candidate 9), n1@10, n2@10 (known items); eval: a@12 (9 in its history), n1@11,
    # n2@11 (candidate 8), n3, n4 (candidate 6)
    assert (f"--vocab {first}, train (4 rows): 2 rows of 2 user(s) its mapping has not seen (cold-start users, by raw user id); "
            f"3 rows hold only items it has seen, 1 an item it has not (the candidate or one in the history: 0 of them rows of "
            f"cold-start users)") in said, said
    assert (f"--vocab {first}, eval (5 rows): 4 rows of 4 user(s) its mapping has not seen (cold-start users, by raw user id); "
            f"2 rows hold only items it has seen, 3 an item it has not (the candidate or one in the history: 2 of them rows of "
            f"cold-start users)") in said, said
    # n3 and n4 share the OOV user row with n1 and n2, which have training rows: still users without one
    assert "2 of the 5 eval rows are of users without a training row" in said, said
    eval_users = pq.read_table(second / "eval.parquet").column("user_id").to_pylist()
    assert eval_users.count(2) == 4  # the four new users read the one OOV row (2 users + 0): a bucket is no user


def test_without_vocab_nothing_is_said_of_a_mapping(tmp_path: Path) -> None:
    said, _ = _sequences(tmp_path, NEW, "plain")
    assert "--vocab" not in said and "cold-start users" not in said
    assert "2 of the 5 eval rows are of users without a training row" in said, said


def test_vocab_report_of_per_user_rows_counts_each_users_row_and_its_whole_history(tmp_path: Path) -> None:
    _, first = _sequences(tmp_path, EARLIER, "first")
    said, _ = _sequences(tmp_path, NEW, "second", "--vocab", str(first), "--rows", "per-user")
    # train: a (candidate 9, history [1]), n1, n2; eval as per event (each user's last event, its history all before it)
    assert (f"--vocab {first}, train (3 rows): 2 rows of 2 user(s) its mapping has not seen (cold-start users, by raw user id); "
            f"2 rows hold only items it has seen, 1 an item it has not") in said, said
    assert f"--vocab {first}, eval (5 rows): 4 rows of 4 user(s) its mapping has not seen" in said, said
