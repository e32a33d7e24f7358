"""``python -m recsys_runner.data sequences``: an interaction log → rows whose histories hold only earlier events.

The leakage test builds a log whose every item names its own event, so a history can be decoded back to events and
checked: never the row's own event, never one at or after its time; a naive per-row reference agrees row by row, and
a deliberately leaky history builder is caught by the same check.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from recsys_runner.__main__ import run
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.data.schema import stored_schema
from recsys_runner.data.sequences.interactions import LogSpec, encode_log, history_bounds, log_to_rows, rows_table
from recsys_runner.errors import ConfigError, DataError

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
    """Raw log values of an id column (ids number the log's values in order of first appearance)."""
    dictionary = pc.dictionary_encode(log.column(column).combine_chunks()).dictionary.to_pylist()
    return [[dictionary[i] for i in v] if isinstance(v, list) else dictionary[v] for v in rows.to_pylist()]


def reference_histories(log: pa.Table, max_len: int) -> dict[int, list[int]]:
    """Naively, per event (by its item): the same user's items strictly earlier in time, in (time, input) order, last max_len."""
    events = log.to_pylist()
    out = {}
    for e in events:
        before = [(f["timestamp"], j, f["item"]) for j, f in enumerate(events) if f["user"] == e["user"] and f["timestamp"] < e["timestamp"]]
        out[e["item"]] = [item for _, _, item in sorted(before)][-max_len:] if max_len else []
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


def convert(tmp_path: Path, log: pa.Table, *flags: str, name: str = "log.parquet") -> tuple[pa.Table, pa.Table]:
    pq.write_table(log, tmp_path / name)
    assert data_main(["sequences", str(tmp_path / name), str(tmp_path / "out"), "--side", "category", *flags]) == 0
    return pq.read_table(tmp_path / "out" / "train.parquet"), pq.read_table(tmp_path / "out" / "eval.parquet")


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
    for j, e in enumerate(log.to_pylist()):  # each user's last event: latest time, then latest in the input
        key = (e["timestamp"], j)
        if e["user"] not in last or key > last[e["user"]][0]:
            last[e["user"]] = (key, e["item"])
    assert sorted(decoded(held.column("item_id"), log, "item")) == sorted(item for _, item in last.values())
    assert train.num_rows == log.num_rows - len(last)


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
    unlabelled, _ = convert(tmp_path, log, name="plain.parquet")
    assert set(unlabelled.column("label").to_pylist()) == {1}  # without a label every event is a positive


def test_a_csv_log_reads_like_parquet(tmp_path: Path) -> None:
    log = event_log(seed=4)
    text = "user,item,timestamp,category\n" + "".join(f"{r['user']},{r['item']},{r['timestamp']},{r['category']}\n" for r in log.to_pylist())
    (tmp_path / "log.csv").write_text(text)
    assert data_main(["sequences", str(tmp_path / "log.csv"), str(tmp_path / "csv"), "--side", "category"]) == 0
    from_parquet, _ = convert(tmp_path, log)
    assert pq.read_table(tmp_path / "csv" / "train.parquet").equals(from_parquet)


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


def test_din_trains_on_the_produced_files(make_cfg, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n = 6000
    users, items = rng.integers(0, 200, n), rng.integers(0, 300, n)
    log = pa.table({"user": users, "item": items, "timestamp": rng.integers(0, 10_000, n), "category": items % 20,
                    "click": (rng.random(n) < 0.4).astype(np.int8)})
    convert(tmp_path, log, "--label", "click", "--max-len", "10", "--split", "time", "--eval-from", "9000")
    out = tmp_path / "out"
    cfg = make_cfg("model=din", "data=parquet", f"data.path={out}/train.parquet", f"data.eval_path={out}/eval.parquet",
                   "data.num_workers=0", "train.num_steps=20", "train.log_every_steps=10", "train.eval_every_steps=null",
                   "distributed.device=cpu", "distributed.sharding_types=[table_wise]", "checkpoint=none", "data.batch_size=128",
                   "tracking=none", tiny=False)
    assert 0.0 <= run(cfg) <= 1.0
