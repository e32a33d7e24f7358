"""``python -m recsys_runner.data sequences``: an interaction log → rows whose histories hold only earlier events.

The leakage test builds a log whose every item names its own event, so a history can be decoded back to events and
checked: never the row's own event, never one at or after its time; a naive per-row reference agrees row by row, and
a deliberately leaky history builder is caught by the same check. Repeated events are dropped (or kept, or refused)
and never make an eval row a training row; empty logs and used output folders are refused by name; a real SIGTERM
while the files are written leaves the output folder as it was, with one line and exit 143; an object store works
as a folder does.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_runner import store_settings
from recsys_runner.__main__ import run
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.data.schema_files import stored_schema
from recsys_runner.data.sequences.events import LogSpec, encode_log
from recsys_runner.data.sequences.interactions import history_bounds, log_to_rows, rows_table
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.train import signals
from tests.conftest import REPO
from tests.object_store import start_moto

MAX_LEN = 4


def event_log(num_users: int = 40, seed: int = 0) -> pa.Table:
    """Events in shuffled order; item ``u*1000 + k`` is user ``u``'s ``k``-th event, times with many ties."""
    rng = np.random.default_rng(seed)
    users, items, times = [], [], []
    for u in range(num_users):
        k = int(rng.integers(1, 12))
        t = np.sort(rng.integers(0, 8, k)) * 10  # few distinct times: ties within a user
        users += [f"u{u}"] * k
        items += [u * 1000 + j for j in range(k)]
        times += t.tolist()
    order = rng.permutation(len(users))
    return pa.table({"user": np.array(users)[order], "item": np.array(items)[order], "timestamp": np.array(times)[order],
                     "category": np.array(items)[order] % 7})


def decoded(rows: pa.Table, log: pa.Table, column: str) -> list:
    """Raw log values of an id column (ids number the log's distinct values in sorted order)."""
    dictionary = sorted(set(log.column(column).to_pylist()))
    return [[dictionary[i] for i in v] if isinstance(v, list) else dictionary[v] for v in rows.to_pylist()]


def reference_histories(log: pa.Table, max_len: int) -> dict[int, list[int]]:
    """Naively, per event (by its item): the same user's items strictly earlier in time, in (time, item) order (ties by
    id, whatever the log's order), last max_len."""
    events = log.to_pylist()
    out = {}
    for e in events:
        before = [(f["timestamp"], f["item"]) for f in events if f["user"] == e["user"] and f["timestamp"] < e["timestamp"]]
        out[e["item"]] = [item for _, item in sorted(before)][-max_len:] if max_len else []
    return out


def leaks(rows: pa.Table, log: pa.Table) -> list[str]:
    """Every row whose history holds its own event, another user's event or one at or after the row's time."""
    time_of = dict(zip(log.column("item").to_pylist(), log.column("timestamp").to_pylist(), strict=True))
    own, hists = decoded(rows.column("item_id"), log, "item"), decoded(rows.column("hist_item_id"), log, "item")
    found = []
    for item, hist in zip(own, hists, strict=True):
        bad = [h for h in hist if h == item or h // 1000 != item // 1000 or time_of[h] >= time_of[item]]
        if bad:
            found.append(f"event {item} at {time_of[item]}: history holds {bad}")
    return found


def convert(tmp_path: Path, log: pa.Table, *flags: str, name: str = "log.parquet", out: str = "out") -> tuple[pa.Table, pa.Table]:
    pq.write_table(log, tmp_path / name)
    assert data_main(["sequences", str(tmp_path / name), str(tmp_path / out), "--side", "category", *flags]) == 0
    return pq.read_table(tmp_path / out / "train.parquet"), pq.read_table(tmp_path / out / "eval.parquet")


def test_no_history_holds_its_own_event_or_a_later_one(tmp_path: Path) -> None:
    log = event_log()
    train, held = convert(tmp_path, log, "--max-len", str(MAX_LEN), "--split", "leave-last-out")
    rows = pa.concat_tables([train, held])
    assert rows.num_rows == log.num_rows
    assert leaks(rows, log) == []
    reference = reference_histories(log, MAX_LEN)
    for item, hist in zip(decoded(rows.column("item_id"), log, "item"), decoded(rows.column("hist_item_id"), log, "item"), strict=True):
        assert hist == reference[item], item
    # The side column's history and the event times follow the same events.
    cats = decoded(rows.column("hist_category"), log, "category")
    time_of = dict(zip(log.column("item").to_pylist(), log.column("timestamp").to_pylist(), strict=True))
    for hist, hist_cats, ts in zip(decoded(rows.column("hist_item_id"), log, "item"), cats, rows.column("hist_ts").to_pylist(), strict=True):
        assert hist_cats == [h % 7 for h in hist] and ts == [time_of[h] for h in hist]
    assert any(len(h) == MAX_LEN for h in rows.column("hist_item_id").to_pylist())  # truncation was exercised


def test_the_leakage_check_catches_a_leaky_history_builder() -> None:
    log = event_log()
    spec = LogSpec(sides=["category"], max_len=MAX_LEN)
    events = encode_log(log, spec, "log")
    for inclusive, expect_leak in ((False, False), (True, True)):
        h = history_bounds(events.user, events.time, MAX_LEN, inclusive=inclusive)
        rows = rows_table(events, h, np.arange(log.num_rows))
        assert bool(leaks(rows, log)) is expect_leak


def test_time_split(tmp_path: Path) -> None:
    log = event_log(seed=1)
    cut = 40
    train, held = convert(tmp_path, log, "--split", "time", "--eval-from", str(cut))
    assert train.num_rows + held.num_rows == log.num_rows
    assert max(train.column("ts").to_pylist()) < cut <= min(held.column("ts").to_pylist())
    # Eval rows' histories hold the same user's earlier (training) events.
    assert any(t < cut for hist in held.column("hist_ts").to_pylist() for t in hist)
    assert leaks(held, log) == [] and leaks(train, log) == []


def test_leave_last_out_split(tmp_path: Path) -> None:
    log = event_log(seed=2)
    train, held = convert(tmp_path, log, "--split", "leave-last-out")
    users = decoded(held.column("user_id"), log, "user")
    assert sorted(users) == sorted(set(log.column("user").to_pylist()))  # one eval row per user
    last = {}
    for e in log.to_pylist():  # each user's last event: latest time, then the largest item id (ties by id, not log order)
        key = (e["timestamp"], e["item"])
        if e["user"] not in last or key > last[e["user"]][0]:
            last[e["user"]] = (key, e["item"])
    assert sorted(decoded(held.column("item_id"), log, "item")) == sorted(item for _, item in last.values())
    assert train.num_rows == log.num_rows - len(last)


def parts(tmp_path: Path, log: pa.Table, out: str, *flags: str, names: tuple[str, ...] = ("train", "valid", "test")) -> list[pa.Table]:
    pq.write_table(log, tmp_path / f"{out}.parquet")
    assert data_main(["sequences", str(tmp_path / f"{out}.parquet"), str(tmp_path / out), "--side", "category", *flags]) == 0
    return [pq.read_table(tmp_path / out / f"{name}.parquet") for name in names]


def sorted_events(log: pa.Table) -> dict[str, list[int]]:
    """Each user's items (events) in (time, item) order: the order the command sorts a user's events in."""
    out: dict[str, list[tuple[int, int]]] = {}
    for e in log.to_pylist():
        out.setdefault(e["user"], []).append((e["timestamp"], e["item"]))
    return {u: [i for _, i in sorted(v)] for u, v in out.items()}


@pytest.mark.parametrize("rows", ["per-event", "per-user"])
@pytest.mark.parametrize("split", [["--split", "leave-two-out"], ["--split", "time", "--valid-from", "30", "--eval-from", "50"]])
def test_train_valid_and_test_rows_leak_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str], split: list[str], rows: str) -> None:
    log = event_log(num_users=60, seed=13)
    train, valid, test = parts(tmp_path, log, "out", "--max-len", str(MAX_LEN), "--rows", rows, *split)
    order = sorted_events(log)
    time_of = dict(zip(log.column("item").to_pylist(), log.column("timestamp").to_pylist(), strict=True))

    def events(table: pa.Table) -> tuple[set[int], set[int]]:
        """The events a part's rows hold as candidates, and in their histories."""
        return set(decoded(table.column("item_id"), log, "item")), {h for hist in decoded(table.column("hist_item_id"), log, "item") for h in hist}

    (train_own, train_hist), (valid_own, valid_hist), (test_own, _) = events(train), events(valid), events(test)
    assert not (valid_own | test_own) & (train_own | train_hist)  # no valid/test event in a train row, as candidate or history
    assert not test_own & (valid_own | valid_hist)  # no test event in a valid row
    for table in (train, valid, test):
        if rows == "per-event":
            assert leaks(table, log) == []  # strictly earlier in time
        for item, hist in zip(decoded(table.column("item_id"), log, "item"), decoded(table.column("hist_item_id"), log, "item"), strict=True):
            seq = order[f"u{item // 1000}"]
            before = seq[: seq.index(item)]
            if rows == "per-event":
                before = [h for h in before if time_of[h] < time_of[item]]
            assert hist == before[-MAX_LEN:], item  # valid/test histories hold all the user's earlier events (the last max_len)
    if split[1] == "leave-two-out":
        short = sum(len(seq) < 3 for seq in order.values())
        assert short and f"{short} user(s) have fewer than 3 events: --split leave-two-out gives them no valid or test row" in capsys.readouterr().out
        assert sorted(valid_own) == sorted(seq[-2] for seq in order.values() if len(seq) >= 3)
        assert sorted(test_own) == sorted(seq[-1] for seq in order.values() if len(seq) >= 3)
    else:
        assert all(30 <= time_of[i] < 50 for i in valid_own) and all(time_of[i] >= 50 for i in test_own)
        assert all(time_of[i] < 30 for i in train_own)
    if rows == "per-user":  # one row per user and part, its last event there
        assert len(train_own) == train.num_rows == len({u for u in decoded(train.column("user_id"), log, "user")})


def test_labels_ratings_and_the_stored_schema(tmp_path: Path) -> None:
    log = event_log(seed=3)
    rating = np.arange(log.num_rows) % 5 + 1
    train, held = convert(tmp_path, log.append_column("rating", pa.array(rating)), "--label", "rating", "--label-threshold", "4")
    by_item = dict(zip(log.column("item").to_pylist(), (rating >= 4).astype(int).tolist(), strict=True))
    rows = pa.concat_tables([train, held])
    assert rows.column("label").to_pylist() == [by_item[i] for i in decoded(rows.column("item_id"), log, "item")]
    schema = stored_schema(str(tmp_path / "out" / "train.parquet"))
    assert schema is not None and schema.label == "label"
    tables = {c.name: c.table for c in schema.sparse}
    assert tables["item_id"] == tables["hist_item_id"] == "item" and tables["category"] == tables["hist_category"] == "category"
    (group,) = schema.sequences
    assert group.features == ("hist_item_id", "hist_category") and group.timestamps == "hist_ts" and group.max_len == 50
    unlabelled, _ = convert(tmp_path, log, name="plain.parquet", out="plain")
    assert set(unlabelled.column("label").to_pylist()) == {1}  # without a label every event is a positive


def test_a_csv_log_reads_like_parquet(tmp_path: Path) -> None:
    log = event_log(seed=4)
    text = "user,item,timestamp,category\n" + "".join(f"{r['user']},{r['item']},{r['timestamp']},{r['category']}\n" for r in log.to_pylist())
    (tmp_path / "log.csv").write_text(text)
    assert data_main(["sequences", str(tmp_path / "log.csv"), str(tmp_path / "csv"), "--side", "category"]) == 0
    from_parquet, _ = convert(tmp_path, log)
    assert pq.read_table(tmp_path / "csv" / "train.parquet").equals(from_parquet)


def test_a_csv_log_without_a_header_line_reads_with_column_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Taobao's ``UserBehavior.csv`` has no header line: its first event was taken for the column names, and the fix said
    to name the columns with --user/--item/--time, which cannot name a column that has no name. ``--column-names`` names
    them (the rows are the ones a header gives), and the error says so."""
    log = event_log(seed=4)
    lines = "".join(f"{r['user']},{r['item']},{r['category']},pv,{r['timestamp']}\n" for r in log.to_pylist())
    (tmp_path / "UserBehavior.csv").write_text(lines)
    (tmp_path / "with_header.csv").write_text("user,item,category,behavior,timestamp\n" + lines)
    flags = ["--side", "category"]
    assert data_main(["sequences", str(tmp_path / "UserBehavior.csv"), str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err
    assert "is data, not a header naming the columns: a log without a header line" in err  # its user ids are text (u2)
    assert "Fix: name its 5 columns in file order with --column-names, e.g. --column-names c0,c1,c2,c3,c4" in err
    names = ["--column-names", "user,item,category,behavior,timestamp"]
    assert data_main(["sequences", str(tmp_path / "UserBehavior.csv"), str(tmp_path / "named"), *names, *flags]) == 0
    assert data_main(["sequences", str(tmp_path / "with_header.csv"), str(tmp_path / "header"), *flags]) == 0
    assert pq.read_table(tmp_path / "named" / "train.parquet").equals(pq.read_table(tmp_path / "header" / "train.parquet"))
    assert data_main(["sequences", str(tmp_path / "with_header.csv"), str(tmp_path / "o"), *names, *flags]) == 2
    assert "has a header line (user,item,category,behavior,timestamp), but --column-names reads every line as an event" in \
        capsys.readouterr().err
    assert data_main(["sequences", str(tmp_path / "UserBehavior.csv"), str(tmp_path / "o"), "--column-names", "user,item,timestamp"]) == 2
    assert "splits into 5 field(s) by --delimiter ',', but --column-names names 3 columns" in capsys.readouterr().err


def test_mistakes_name_the_flag_or_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = event_log(seed=5)
    pq.write_table(log, tmp_path / "log.parquet")
    assert data_main(["sequences", str(tmp_path / "log.parquet"), str(tmp_path / "o"), "--item", "movie"]) == 2
    assert "no column(s) ['movie']" in capsys.readouterr().err
    assert data_main(["sequences", str(tmp_path / "log.parquet"), str(tmp_path / "o"), "--split", "time"]) == 2
    assert "--eval-from" in capsys.readouterr().err
    assert data_main(["sequences", str(tmp_path / "log.parquet"), str(tmp_path / "o"), "--split", "time", "--eval-from", "0"]) == 2
    assert "leaves no training rows" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"row \d+: the label 'category' is \d, not 0 or 1.*--label-threshold"):
        log_to_rows(log, LogSpec(label="category"), "log")
    with pytest.raises(DataError, match="the time column 'user' has type string"):
        log_to_rows(log, LogSpec(time="user", user="category"), "log")
    with pytest.raises(ConfigError, match="--max-len must be positive"):
        LogSpec(max_len=0)
    with pytest.raises(ConfigError, match="--eval-from / --valid-from apply to --split time, not --split leave-two-out"):
        LogSpec(split="leave-two-out", valid_from=3)
    with pytest.raises(ConfigError, match="--valid-from 50 must come before --eval-from 40"):
        LogSpec(split="time", valid_from=50, eval_from=40)


def test_din_trains_on_the_produced_files(make_cfg, tmp_path: Path) -> None:
    """The files carry the log's signal to the model: a click follows the item's category (8 of 20 are liked), so DIN
    must rank the held-out events well above chance after 20 steps."""
    rng = np.random.default_rng(0)
    n = 6000
    users, items = rng.integers(0, 200, n), rng.integers(0, 300, n)
    liked = items % 20 < 8
    log = pa.table({"user": users, "item": items, "timestamp": rng.integers(0, 10_000, n), "category": items % 20,
                    "click": (rng.random(n) < np.where(liked, 0.7, 0.15)).astype(np.int8)})
    convert(tmp_path, log, "--label", "click", "--max-len", "10", "--split", "time", "--eval-from", "9000")
    out = tmp_path / "out"
    cfg = make_cfg("model=din", "data=parquet", f"data.path={out}/train.parquet", f"data.eval_path={out}/eval.parquet",
                   "data.num_workers=0", "train.num_steps=20", "train.log_every_steps=10", "train.eval_every_steps=null",
                   "distributed.device=cpu", "distributed.sharding_types=[table_wise]", "checkpoint=none", "data.batch_size=128",
                   "tracking=none", tiny=False)
    auc = run(cfg)
    assert auc > 0.65, f"eval/auc {auc:.3f}: the model did not learn from the produced files"


# -- repeated events ----------------------------------------------------------------------------------------------------
def with_copies(log: pa.Table, seed: int = 0) -> pa.Table:
    """``log`` with repeated events: every user's last event (latest time, then latest line) twice more, and 60 other events
    once more, the copies spread through the log (some before the line they repeat)."""
    last: dict[str, tuple[tuple[int, int], int]] = {}
    for j, e in enumerate(log.to_pylist()):
        if e["user"] not in last or (e["timestamp"], j) > last[e["user"]][0]:
            last[e["user"]] = ((e["timestamp"], j), j)
    rng = np.random.default_rng(seed)
    repeated = [j for _, j in last.values()] * 2 + rng.choice(log.num_rows, 60, replace=False).tolist()
    both = pa.concat_tables([log, log.take(repeated)])
    return both.take(rng.permutation(both.num_rows))


def first_copies(log: pa.Table) -> pa.Table:
    """Naively, the log without its repeated lines: the first of each set of identical lines, in log order."""
    seen, keep = set(), []
    for j, e in enumerate(log.to_pylist()):
        key = tuple(e.values())
        if key not in seen:
            seen.add(key)
            keep.append(j)
    return log.take(keep)


def row_keys(rows: pa.Table) -> list[tuple]:
    """Each output row as a whole (candidate, side, label, time and history), to compare rows between the splits."""
    columns = ["user_id", "item_id", "category", "ts", "label", "hist_item_id", "hist_ts"]
    return [tuple(tuple(v) if isinstance(v, list) else v for v in r.values()) for r in rows.select(columns).to_pylist()]


def test_repeated_events_are_dropped_by_default_counted_and_never_both_eval_and_training(tmp_path: Path,
                                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    log = with_copies(event_log(seed=6))
    unique = first_copies(log)
    copies = log.num_rows - unique.num_rows
    assert copies > 0
    train, held = convert(tmp_path, log, "--max-len", str(MAX_LEN))
    assert f"read {log.num_rows} events from {tmp_path / 'log.parquet'}; {copies} of them exact duplicates of an earlier event " \
           f"(dropped, --duplicates drop)" in capsys.readouterr().out
    # exactly the rows of the log without its copies, so histories hold no copy either
    expected_train, expected_held = convert(tmp_path, unique, "--max-len", str(MAX_LEN), name="unique.parquet", out="unique")
    assert train.equals(expected_train) and held.equals(expected_held)
    assert not set(row_keys(held)) & set(row_keys(train))
    assert leaks(pa.concat_tables([train, held]), log) == []


@pytest.mark.parametrize("split", [["--split", "leave-last-out"], ["--split", "time", "--eval-from", "40"]])
def test_kept_repeats_of_an_eval_event_are_eval_rows_too(tmp_path: Path, capsys: pytest.CaptureFixture[str], split: list[str]) -> None:
    log = with_copies(event_log(seed=7))
    copies = log.num_rows - first_copies(log).num_rows
    train, held = convert(tmp_path, log, "--duplicates", "keep", *split)
    assert f"{copies} of them exact duplicates of an earlier event (kept, --duplicates keep)" in capsys.readouterr().out
    assert train.num_rows + held.num_rows == log.num_rows  # every line is a row
    held_keys = row_keys(held)
    assert len(held_keys) > len(set(held_keys))  # the eval side holds repeated events: the case that could leak
    assert not set(held_keys) & set(row_keys(train))  # ... and none of them is also a training row
    assert leaks(pa.concat_tables([train, held]), log) == []
    if split[1] == "leave-last-out":  # each user's last line (latest time, then largest item) and every copy of it
        lines = [tuple(e.values()) for e in log.to_pylist()]
        last = {line[0]: line for _, line in sorted(((line[2], line[1]), line) for line in lines)}
        users = decoded(held.column("user_id"), log, "user")
        assert {u: users.count(u) for u in users} == {u: lines.count(line) for u, line in last.items()}


def test_duplicates_fail_names_the_first_copy_and_the_line_it_repeats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = with_copies(event_log(seed=8))
    pq.write_table(log, tmp_path / "log.parquet")
    lines = [tuple(e.values()) for e in log.to_pylist()]
    first_copy = next(j for j, line in enumerate(lines) if line in lines[:j])
    copies = log.num_rows - first_copies(log).num_rows
    assert data_main(["sequences", str(tmp_path / "log.parquet"), str(tmp_path / "out"), "--duplicates", "fail"]) == 2
    err = capsys.readouterr().err
    assert (f"Data error: {tmp_path / 'log.parquet'}: {copies} event(s) repeat an earlier one exactly (equal in every column read: "
            f"['user', 'item', 'timestamp']); the first is row {first_copy}, a copy of row {lines.index(lines[first_copy])} ") in err
    assert "Fix: --duplicates drop" in err and not (tmp_path / "out").exists()


# -- empty logs ---------------------------------------------------------------------------------------------------------
def test_an_empty_log_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "zero.csv").write_text("")
    (tmp_path / "header.csv").write_text("user,item,timestamp\n")
    pq.write_table(event_log().slice(0, 0), tmp_path / "none.parquet")
    for name, what in (("zero.csv", "0 bytes"), ("header.csv", "a header line only"), ("none.parquet", "a Parquet file of 0 rows")):
        assert data_main(["sequences", str(tmp_path / name), str(tmp_path / "out")]) == 2
        assert f"Data error: the log {tmp_path / name} is empty (rows: 0, {what}): there are no events" in capsys.readouterr().err
    (tmp_path / "days").mkdir()
    (tmp_path / "days" / "a.csv").write_text("")
    (tmp_path / "days" / "b.csv").write_text("user,item,timestamp\n")
    assert data_main(["sequences", str(tmp_path / "days"), str(tmp_path / "out")]) == 2
    assert (f"the log {tmp_path / 'days' / 'a.csv'} (and 1 more file(s)) is empty (rows: 0, in each file: {tmp_path / 'days' / 'a.csv'}: "
            f"0 bytes; {tmp_path / 'days' / 'b.csv'}: a header line only)") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # an empty file among files with events adds no events, and is no error
    (tmp_path / "days" / "c.csv").write_text("user,item,timestamp\nu1,1,10\nu1,2,20\n")
    assert data_main(["sequences", str(tmp_path / "days"), str(tmp_path / "out")]) == 0
    assert pq.read_table(tmp_path / "out" / "train.parquet").num_rows == 1


# -- the output folder --------------------------------------------------------------------------------------------------
def test_a_used_output_folder_is_refused_unless_overwrite_which_replaces_it_whole(tmp_path: Path,
                                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    log, out = event_log(seed=9), tmp_path / "out"
    (out).mkdir()  # an empty folder is not a used one
    convert(tmp_path, log, "--max-len", "3")
    before = {name: (out / name).read_bytes() for name in ("train.parquet", "eval.parquet")}
    argv = ["sequences", str(tmp_path / "log.parquet"), str(out), "--max-len", "2"]
    assert data_main(argv) == 2
    assert (f"Config error: the output folder {out} already holds an earlier output (['eval.parquet', 'train.parquet', 'vocab', "
            f"'vocab.json']). "
            f"Fix: --overwrite to replace it as a whole, or a new output folder") in capsys.readouterr().err
    assert {name: (out / name).read_bytes() for name in before} == before
    assert data_main([*argv, "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.parquet", "out"]  # nothing staged or set aside is left
    for name in before:  # both files are the new output's
        schema = stored_schema(str(out / name))
        assert schema is not None and schema.sequences[0].max_len == 2, name
    (out / "notes.txt").write_text("mine")
    assert data_main([*argv, "--overwrite"]) == 2
    assert (f"the output folder {out} is not empty: it holds ['eval.parquet', 'notes.txt', 'train.parquet', 'vocab', 'vocab.json'], and "
            f"['notes.txt'] are not files sequences writes (train.parquet, eval.parquet, valid.parquet, test.parquet, vocab.json, vocab/), "
            f"so not even --overwrite replaces them") in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"
    assert data_main(["sequences", str(tmp_path / "log.parquet"), str(out / "notes.txt")]) == 2
    assert f"the output {out / 'notes.txt'} is a file, not a folder" in capsys.readouterr().err
    # under a file: refused before the log is read, not a raw NotADirectoryError when the staging folder is made
    assert data_main(["sequences", str(tmp_path / "log.parquet"), str(out / "notes.txt" / "rows")]) == 2
    assert (f"Config error: the output folder {out / 'notes.txt' / 'rows'} cannot be written: a file is in the place of its "
            f"parent folder {out / 'notes.txt'}. Fix: move or remove {out / 'notes.txt'}, or another output folder") in capsys.readouterr().err


# -- signals ------------------------------------------------------------------------------------------------------------
def test_sigterm_while_writing_leaves_the_earlier_output_and_says_how_to_redo(tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(tmp_path, event_log(seed=10), out="out")  # an earlier output, which --overwrite would replace
    earlier = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}  # the rows and the mapping
    rng = np.random.default_rng(0)
    n = 150_000  # its train.parquet takes about a second to write, in row groups of 500 rows
    pq.write_table(pa.table({"user": rng.integers(0, 3000, n), "item": rng.integers(0, 50_000, n), "timestamp": rng.integers(0, 10**6, n)}),
                   tmp_path / "big.parquet")
    args = ["sequences", "big.parquet", "out", "--row-group-rows", "500", "--overwrite"]
    proc = subprocess.Popen([sys.executable, "-m", "recsys_runner.data", *args], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not glob.glob(str(tmp_path / ".out.staging-*" / "train.parquet")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert proc.poll() is None, f"it ended before it wrote: {proc.communicate()}"
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stdout + stderr
    assert stderr.strip().splitlines()[-1] == (f"Interrupted: stopped by SIGTERM during sequences; nothing was kept (out is as it was "
                                               f"before); redo it with: python -m recsys_runner.data {' '.join(args)}")
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()} == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.parquet", "log.parquet", "out"]  # no staging folder left


def test_a_signal_while_the_output_is_moved_into_place_waits_for_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    held_back = signals.deferred

    @contextlib.contextmanager
    def signalled() -> Iterator[object]:
        with held_back() as late:
            os.kill(os.getpid(), signal.SIGTERM)  # lands while the finished output is being moved into place
            yield late

    monkeypatch.setattr(signals, "deferred", signalled)
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the guard takes a signal only from its default action
    log = event_log(seed=11)
    try:
        pq.write_table(log, tmp_path / "log.parquet")
        assert data_main(["sequences", str(tmp_path / "log.parquet"), str(tmp_path / "out")]) == 143
    finally:
        signal.signal(signal.SIGTERM, before)
    assert capsys.readouterr().err.strip() == (f"Interrupted: stopped by SIGTERM as sequences ended; the output in {tmp_path / 'out'} "
                                               f"was complete and is kept, nothing to redo.")
    assert pq.read_table(tmp_path / "out" / "train.parquet").num_rows + pq.read_table(tmp_path / "out" / "eval.parquet").num_rows == log.num_rows


# -- object stores ------------------------------------------------------------------------------------------------------
def test_a_log_and_an_output_in_an_object_store(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    server = start_moto(tmp_path)
    try:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        store_settings.configure(store_settings.StorageConfig(max_attempts=2, connect_timeout_s=1, request_timeout_s=5))
        bucket = server.bucket("seq")
        log = event_log(seed=12)
        pq.write_table(log, tmp_path / "log.parquet")
        server.put(tmp_path / "log.parquet", f"{bucket}/logs/log.parquet")
        monkeypatch.chdir(tmp_path)
        argv = ["sequences", f"{bucket}/logs/log.parquet", f"{bucket}/rows", "--side", "category"]
        assert data_main(argv) == 0
        fs = server.fs()
        assert sorted(fs.ls("seq/rows")) == ["seq/rows/eval.parquet", "seq/rows/train.parquet", "seq/rows/vocab", "seq/rows/vocab.json"]
        assert sorted(fs.ls("seq/rows/vocab")) == ["seq/rows/vocab/category.txt", "seq/rows/vocab/item.txt", "seq/rows/vocab/user_id.txt"]
        local_train, local_held = convert(tmp_path, log)
        with fs.open("seq/rows/train.parquet", "rb") as f:
            assert pq.read_table(f).equals(local_train)
        assert data_main(argv) == 2
        assert f"the output folder {bucket}/rows already holds an earlier output" in capsys.readouterr().err
        assert data_main([*argv, "--max-len", "2", "--overwrite"]) == 0
        with server.fs().open("seq/rows/eval.parquet", "rb") as f:  # a new client: the first one cached the earlier object
            assert max(len(h) for h in pq.read_table(f).column("hist_item_id").to_pylist()) == 2
        assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("moto")) == ["log.parquet", "out"]  # no local s3:/
    finally:
        store_settings.configure(store_settings.StorageConfig())
        server.stop()
