"""``sequences --rows per-user``, ``--split leave-two-out`` / a valid window, and the id mapping (``vocab/``, ``--vocab``).

Per-user rows hold each user's whole sequence (its last event the candidate) and equal the per-event row of that
event; SASRec's loss for that position is the same on both; token budgets cut per-user rows; a model that scores one
candidate per row refuses them. Ids number sorted raw values, so a shuffled log gives identical rows and vocab files;
a second log encoded with ``--vocab`` keeps known ids, sends unseen ones to the OOV row and says how many.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.data.files.tabular import ParquetData
from recsys_runner.data.files.tabular_config import ParquetDataConfig
from recsys_runner.data.schema_files import stored_schema
from recsys_runner.data.sequences.mapping import load_mapping, mapping_folder, raw_ids
from recsys_runner.data.sequences.splits import rows_kind
from recsys_runner.errors import ConfigError
from recsys_runner.models.sasrec import SASRec, SASRecConfig
from recsys_runner.models.train_wrapper import TrainWrapper


def distinct_times_log(num_users: int = 30, seed: int = 0) -> pa.Table:
    """Shuffled events with text user ids and distinct times per user (no ties: per-event and per-user histories agree)."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(num_users):
        k = int(rng.integers(1, 15))
        times = rng.choice(1000, k, replace=False)
        rows += [(f"user-{u:03d}", int(rng.integers(0, 200)) * 7 + 3, int(t)) for t in times]
    order = rng.permutation(len(rows))
    users, items, times = zip(*[rows[i] for i in order], strict=True)
    return pa.table({"user": list(users), "item": list(items), "timestamp": list(times)})


def run_sequences(tmp_path: Path, log: pa.Table, out: str, *flags: str, name: str = "log.parquet") -> Path:
    pq.write_table(log, tmp_path / name)
    assert data_main(["sequences", str(tmp_path / name), str(tmp_path / out), *flags]) == 0
    return tmp_path / out


def test_per_user_rows_hold_each_users_sequence_and_equal_its_last_per_event_row(tmp_path: Path) -> None:
    log = distinct_times_log()
    per_user = run_sequences(tmp_path, log, "users", "--rows", "per-user", "--max-len", "6")
    per_event = run_sequences(tmp_path, log, "events", "--max-len", "6")
    users = pq.read_table(per_user / "train.parquet")
    events = pq.read_table(per_event / "train.parquet")
    assert rows_kind(str(per_user / "train.parquet")) == "per-user" and rows_kind(str(per_event / "train.parquet")) == "per-event"
    mapping = load_mapping(str(per_user))
    by_user: dict[str, list[tuple[int, int]]] = {}
    for e in log.to_pylist():
        by_user.setdefault(e["user"], []).append((e["timestamp"], e["item"]))
    trained = {u: sorted(v)[:-1] for u, v in by_user.items() if len(v) > 1}  # leave-last-out: the last one is eval
    assert sorted(raw_ids(mapping, "user_id", users.column("user_id").to_numpy())) == sorted(trained)  # one row per user
    for row in users.to_pylist():
        seq = trained[raw_ids(mapping, "user_id", [row["user_id"]])[0]]
        assert raw_ids(mapping, "item", [row["item_id"]]) == [seq[-1][1]] and row["ts"] == seq[-1][0]  # the candidate: its last event
        assert raw_ids(mapping, "item", row["hist_item_id"]) == [i for _, i in seq[:-1]][-6:]  # the events before, the last max_len
        assert row["hist_ts"] == [t for t, _ in seq[:-1]][-6:]
    # the same row as the per-event row of the user's last training event
    last = {(r["user_id"], r["item_id"], r["ts"]) for r in users.to_pylist()}
    keep = [(r["user_id"], r["item_id"], r["ts"]) in last for r in events.to_pylist()]
    assert events.filter(pa.array(keep)).to_pylist() == users.to_pylist()
    assert sum(len(h) for h in users.column("hist_item_id").to_pylist()) < sum(len(h) for h in events.column("hist_item_id").to_pylist())


def _rows_data(path: Path, **kw: object) -> ParquetData:
    return ParquetData(make(ParquetDataConfig, path=str(path), eval_path=str(path), num_workers=0, shuffle=False, drop_remainder=False,
                            **kw))


def test_sasrec_loss_of_the_last_position_is_the_same_on_per_user_and_per_event_rows(tmp_path: Path) -> None:
    log = distinct_times_log(seed=1)
    per_user = run_sequences(tmp_path, log, "users", "--rows", "per-user", "--max-len", "8")
    per_event = run_sequences(tmp_path, log, "events", "--max-len", "8")
    users = pq.read_table(per_user / "train.parquet")
    events = pq.read_table(per_event / "train.parquet")
    last = {(r["user_id"], r["item_id"], r["ts"]) for r in users.to_pylist()}
    chosen = events.filter(pa.array([(r["user_id"], r["item_id"], r["ts"]) in last for r in events.to_pylist()]))
    pq.write_table(chosen, tmp_path / "last_events.parquet")  # its metadata (the schema) kept
    losses = []
    for path in (per_user / "train.parquet", tmp_path / "last_events.parquet"):
        data = _rows_data(path, batch_size=users.num_rows)
        torch.manual_seed(0)
        model = SASRec(make(SASRecConfig, embedding_dim=8, dropout=0.0), features=data.features)
        model.arch.to_empty(device=torch.device("cpu"))
        for p in model.arch.parameters():
            torch.nn.init.normal_(p, std=0.1)
        wrapper = TrainWrapper(model, features=data.features)
        (batch,) = list(data.train_batches(0, 0, 1))
        _, (_, logits, positives) = wrapper(batch)
        per_position = F.cross_entropy(logits, positives, reduction="none")  # the model averages these over positions
        ends = torch.cumsum(batch.sparse_features["hist_item_id"].lengths() + 1, 0) - 1  # each row's last position
        losses.append(per_position[ends])
        # SASRec trains on every position of a row: one per event plus the start token
        assert logits.shape[0] == int(batch.sparse_features["hist_item_id"].lengths().sum()) + users.num_rows
    torch.testing.assert_close(losses[0], losses[1])


def test_token_budgets_cut_per_user_rows(tmp_path: Path) -> None:
    out = run_sequences(tmp_path, distinct_times_log(num_users=60, seed=2), "users", "--rows", "per-user", "--max-len", "10")
    total = pq.read_table(out / "train.parquet").num_rows
    data = _rows_data(out / "train.parquet", batch_tokens=24, group_by_length=False)
    batches = list(data.train_batches(0, 0, 1))
    costs = [int(b.sparse_features["hist_item_id"].lengths().sum()) + len(b.labels) for b in batches]
    assert max(costs) <= 24 and sum(len(b.labels) for b in batches) == total and len(batches) > 1


def test_a_model_that_scores_one_candidate_per_row_refuses_per_user_rows(make_cfg, tmp_path: Path) -> None:
    out = run_sequences(tmp_path, distinct_times_log(), "users", "--rows", "per-user", "--split", "leave-two-out")
    files = ["data=parquet", f"data.path={out}/train.parquet", f"data.eval_path={out}/valid.parquet"]
    for model in ("din", "bst", "deepfm"):
        with pytest.raises(ConfigError, match=r"data.path: .*train.parquet holds per-user rows .*Fix: write the rows with --rows per-event"):
            validate(make_cfg(f"model={model}", *files, tiny=False))
    validate(make_cfg("model=sasrec", *files, tiny=False))
    validate(make_cfg("model=sasrec", "model.block=hstu", *files, tiny=False))


def test_a_shuffled_log_gives_identical_rows_and_vocab_files(tmp_path: Path) -> None:
    log = distinct_times_log(seed=3).append_column("category", pa.array([f"c{i % 5}" for i in range(distinct_times_log(seed=3).num_rows)]))
    shuffled = log.take(np.random.default_rng(9).permutation(log.num_rows))
    for rows in ("per-event", "per-user"):
        a = run_sequences(tmp_path, log, f"a-{rows}", "--rows", rows, "--side", "category", "--split", "leave-two-out", name="a.parquet")
        b = run_sequences(tmp_path, shuffled, f"b-{rows}", "--rows", rows, "--side", "category", "--split", "leave-two-out", name="b.parquet")
        for name in ("train.parquet", "valid.parquet", "test.parquet", "vocab.json", "vocab/user_id.txt", "vocab/item.txt", "vocab/category.txt"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), (rows, name)
    index = json.loads((a / "vocab.json").read_text())
    assert index["oov_buckets"] == 1 and index["tables"]["item"]["columns"] == ["item_id", "hist_item_id"]
    items = (a / "vocab" / "item.txt").read_text().split()
    assert [int(v) for v in items] == sorted({int(v) for v in items}) == sorted(set(log.column("item").to_pylist()))  # sorted raw values
    schema = stored_schema(str(a / "train.parquet"))
    assert schema is not None and {c.name: c.num_embeddings for c in schema.sparse}["item_id"] == len(items) + 1  # ids + the OOV row
    assert mapping_folder(str(a / "test.parquet")) == str(a)


def test_vocab_encodes_a_new_log_with_the_earlier_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first_log = distinct_times_log(seed=4)
    first = run_sequences(tmp_path, first_log, "first", name="first.parquet")
    mapping = load_mapping(str(first))
    known_items = set(first_log.column("item").to_pylist())
    a, b = sorted(known_items)[:2]
    second_log = pa.table({"user": ["user-000", "user-000", "user-000", "someone-new", "someone-new"],
                           "item": [a, 999_999, b, a, 888_888], "timestamp": [5000, 5001, 5002, 5000, 5003]})
    capsys.readouterr()
    second = run_sequences(tmp_path, second_log, "second", "--vocab", str(first), name="second.parquet")
    out = capsys.readouterr().out
    assert f"--vocab {first}: 2 item id(s) of this log are not in its mapping (each reads an OOV row)" in out
    assert f"--vocab {first}: 1 user_id id(s) of this log are not in its mapping" in out
    rows = pa.concat_tables([pq.read_table(second / "train.parquet"), pq.read_table(second / "eval.parquet")])
    capacity = len(mapping["item"])
    for row in rows.to_pylist():
        item = raw_ids(mapping, "item", [row["item_id"]])[0]
        if row["item_id"] < capacity:
            assert item in (a, b)  # a known raw id keeps the earlier id
        else:
            assert row["item_id"] == capacity and item is None  # the OOV row (one bucket): no raw value
    assert {c.name: c.num_embeddings for c in stored_schema(str(second / "train.parquet")).sparse} == \
        {c.name: c.num_embeddings for c in stored_schema(str(first / "train.parquet")).sparse}  # the earlier tables' sizes
    assert (second / "vocab" / "item.txt").read_bytes() == (first / "vocab" / "item.txt").read_bytes()  # the mapping its ids follow
    # not an earlier output, or a malformed one: named
    (tmp_path / "plain").mkdir()
    assert data_main(["sequences", str(tmp_path / "second.parquet"), str(tmp_path / "x"), "--vocab", str(tmp_path / "plain")]) == 2
    assert f"--vocab={tmp_path / 'plain'} is not an earlier output of sequences: it has no vocab.json" in capsys.readouterr().err
    assert data_main(["sequences", str(tmp_path / "second.parquet"), str(tmp_path / "x"), "--vocab", str(tmp_path / "second.parquet")]) == 2
    assert f"--vocab={tmp_path / 'second.parquet'} is a file, not an earlier output folder of sequences" in capsys.readouterr().err
    (tmp_path / "plain" / "vocab.json").write_text('{"format": 7}')
    assert data_main(["sequences", str(tmp_path / "second.parquet"), str(tmp_path / "x"), "--vocab", str(tmp_path / "plain")]) == 2
    assert "vocab.json is not in the form sequences writes" in capsys.readouterr().err
    assert data_main(["sequences", str(tmp_path / "second.parquet"), str(tmp_path / "x"), "--vocab", str(first), "--oov-buckets", "4"]) == 2
    assert "--oov-buckets 4 with --vocab" in capsys.readouterr().err
