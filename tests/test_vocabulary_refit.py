"""Fine-tuning on new files with ``data.vocabulary=refit`` (issue 29): the vocabularies are fitted anew on the new
files and every embedding table's trained rows are carried over by id.

The scenario: DeepFM trained on a CSV of users ``u0..u59`` and items ``0..39`` (table-wise tables); new files where
``u0..u19`` and items ``0..19`` are gone, ``u20..u59`` and items ``20..39`` stay, and ``u60..u89`` and items
``40..49`` are new, so ``t_user`` grows and ``t_item`` shrinks. The fine-tune shards ``t_user`` row-wise: a trained
row is read from the table-wise checkpoint and lands at the id's new row in the row-wise shard. For every id in both
vocabularies the new row (embedding and first-order weight) equals the trained one, a new id's row equals a fresh
run's, the OOV rows are carried bucket by bucket, the rows of those tables' optimizer state (Adagrad's sums) go as the
weights', and the run logs one line per table. That ``keep`` (the default) keeps the stored vocabulary is tested in test_stored_encoders.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata

from recsys_runner.__main__ import run as train
from recsys_runner.build import Components, build
from recsys_runner.checkpoint.carried_rows import CarriedRows
from recsys_runner.checkpoint.storage import DcpFileStorage, list_checkpoints
from recsys_runner.checkpoint.weights import load_into
from recsys_runner.config import validate
from recsys_runner.data.encoding.stored import ENCODERS_FILE, from_json
from recsys_runner.data.encoding.vocabulary import Vocabulary, carry_rows, grown
from recsys_runner.data.files.streaming import TabularData
from recsys_runner.data.files.tabular import sizes_not_used
from recsys_runner.data_build import REFIT_FILE
from recsys_runner.errors import ConfigError, DataError
from tests.conftest import REPO, free_port
from tests.test_evaluate import compose_entry
from tests.test_stored_encoders import _rows

TABLES = {"user": "t_user", "item": "t_item"}
COLUMN_WISE_USERS = "+distributed.tables={t_user: {sharding_types: [column_wise]}}"


def _write(path: Path, rng: np.random.Generator, n: int, users: list[str], items: range) -> None:
    """``label,user,item`` rows (:func:`tests.test_stored_encoders._rows`) whose items are ``items``."""
    rows = [r.split(",") for r in _rows(rng, n, users, len(items))]
    path.write_text("\n".join(["label,user,item", *(f"{label},{user},{items[int(item)]}" for label, user, item in rows)]) + "\n")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A short training on the old files, and the new files."""
    root = tmp_path_factory.mktemp("refit")
    rng = np.random.default_rng(0)
    _write(root / "old.csv", rng, 3000, [f"u{k}" for k in range(60)], range(40))
    _write(root / "new.csv", rng, 3000, [f"u{k}" for k in range(20, 90)], range(20, 50))
    data = ["data=csv", "data.batch_size=128", "data.shuffle=false", "data.eval_fraction=0.05", "model=deepfm", "optim=adagrad",
            "optim.sparse.lr=0.1", "distributed.device=cpu", "tracking=none", "train.eval_every_steps=null"]
    train(compose_entry("config", *data, f"data.path={root}/old.csv", "train.num_steps=8", f"checkpoint.dir={root}/ck"))
    (checkpoint,) = list_checkpoints(root / "ck")
    return {"root": root, "data": data, "checkpoint": checkpoint}


def _whole(t: Any) -> torch.Tensor:
    """A tensor of the state dict as one tensor (a ShardedTensor's local shards put together: one rank holds them all)."""
    if not hasattr(t, "local_shards"):
        return t.detach().clone()
    shards = t.local_shards()
    out = torch.zeros(list(t.metadata().size), dtype=shards[0].tensor.dtype)
    for shard in shards:
        out[tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True))] = shard.tensor
    return out


def _built(*overrides: str) -> tuple[dict[str, torch.Tensor], Vocabulary, Vocabulary, Components]:
    """The state (model and optimizer) of a run built with ``overrides`` (nothing trained), and its vocabularies."""
    c = build(validate(compose_entry("config", *overrides)))
    try:
        state = {k: _whole(v) for k, v in c.loop.checkpointer.parts.tensor_state().items()}
        schema, _ = from_json(c.loop.checkpointer.files[ENCODERS_FILE], "test")
    finally:
        c.close()
    return state, schema.vocabularies["user"], schema.vocabularies["item"], c


def _checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Vocabulary]]:
    """The model tensors and optimizer state of a checkpoint, read with the project's DCP storage, and its stored
    vocabularies."""
    storage = DcpFileStorage()
    state = {k: torch.empty(shape) for k, shape in storage.tensor_index(path).items() if k.startswith(("model/", "optim/")) and shape}
    storage.load_tensors(path, state)
    return state, from_json((path / ENCODERS_FILE).read_bytes(), "test")[0].vocabularies


def _sums(state: dict[str, torch.Tensor], table: str) -> str:
    """The key of ``table``'s Adagrad sums: the fused optimizer's ``momentum1`` (a sharded table) or the dense one's ``sum``
    (a data_parallel table, as DeepFM's small first-order tables are planned)."""
    (key,) = [k for k in state if re.fullmatch(rf"optim/(sparse\.\S+\.{table}\.weight/{table}\.momentum1|dense\.\S+\.{table}\.weight/sum)", k)]
    return key


def test_refit_carries_each_trained_row_to_its_ids_new_row(trained: dict[str, Any]) -> None:
    old_state, old_vocab = _checkpoint(trained["checkpoint"])
    fine_tune = [*trained["data"], f"data.path={trained['root']}/new.csv", COLUMN_WISE_USERS, "checkpoint.resume=never"]
    refit, *new_vocab, c = _built(*fine_tune, f"checkpoint.init_from={trained['checkpoint']}", "data.vocabulary=refit")
    fresh, *_ = _built(*fine_tune)  # the same run without init_from: what a fresh row is
    assert c.plan.plan["model.sparse_arch.ebc"]["t_user"].sharding_type == "column_wise"
    for column, new in zip(("user", "item"), new_vocab, strict=True):
        old = old_vocab[column]
        assert (len(old.keys), len(new.keys)) == {"user": (60, 70), "item": (40, 30)}[column]
        shared, new_at, old_at = np.intersect1d(new.keys, old.keys, return_indices=True)
        assert len(shared) == {"user": 40, "item": 20}[column]
        assert not np.array_equal(new.rows[new_at], old.rows[old_at]), "the rows must move for the test to mean anything"
        only_new = np.setdiff1d(np.arange(len(new.keys)), new_at)
        oov_old = np.arange(old.capacity, old.capacity + old.oov_buckets)
        oov_new = np.arange(new.capacity, new.capacity + new.oov_buckets)
        for prefix in ("", "first_order_"):  # the embedding and its first-order weight, both by id
            name = f"{prefix}{TABLES[column]}.weight"
            key = next(k for k in refit if k.startswith("model/") and k.endswith(f".{name}"))
            trained_rows, rows, fresh_rows = old_state[key], refit[key], fresh[key]
            assert rows.shape[0] == new.capacity + new.oov_buckets != trained_rows.shape[0]
            torch.testing.assert_close(rows[new.rows[new_at]], trained_rows[old.rows[old_at]], rtol=0, atol=0)
            torch.testing.assert_close(rows[new.rows[only_new]], fresh_rows[new.rows[only_new]], rtol=0, atol=0)
            torch.testing.assert_close(rows[oov_new], trained_rows[oov_old], rtol=0, atol=0)
            assert not torch.equal(rows[new.rows[new_at]], fresh_rows[new.rows[new_at]])
        sums = [_sums(refit, f"{prefix}{TABLES[column]}") for prefix in ("", "first_order_")]
        assert sums[0].startswith("optim/sparse.") and sums[1].startswith("optim/dense.")  # a fused table and a data_parallel one
        for key in sums:
            trained_sums, carried, started = old_state[key], refit[key], fresh[key]
            torch.testing.assert_close(carried[new.rows[new_at]], trained_sums[old.rows[old_at]], rtol=0, atol=0)
            torch.testing.assert_close(carried[oov_new], trained_sums[oov_old], rtol=0, atol=0)
            assert trained_sums[old.rows[old_at]].any() and not started.any()  # Adagrad's sums start at 0 (fbgemm's, torch's)
            assert not carried[new.rows[only_new]].any()  # a new id's row: the initial value
    dense = next(k for k in refit if k.startswith("model/") and k.endswith("deep.1.weight"))
    torch.testing.assert_close(refit[dense], old_state[dense], rtol=0, atol=0)  # the rest loads as for any init_from


def test_a_refit_fine_tune_trains_logs_its_tables_records_them_and_resumes(trained: dict[str, Any], tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    command = [*trained["data"], f"data.path={trained['root']}/new.csv", "data.vocabulary=refit",
               f"checkpoint.init_from={trained['checkpoint']}", "train.num_steps=2", f"checkpoint.dir={tmp_path}"]
    with caplog.at_level(logging.INFO, logger="recsys_runner"):
        train(compose_entry("config", *command))
    lines = {m.group(1): tuple(int(g) for g in m.groups()[1:]) for r in caplog.records
             if (m := re.match(r"(t_\w+): (\d+) rows carried over, (\d+) new ids start fresh, (\d+) old ids not in the new "
                               r"vocabulary; its OOV rows carried over", r.getMessage()))}
    assert lines == {"t_user": (40, 30, 20), "t_item": (20, 10, 20)}
    (written,) = list_checkpoints(tmp_path)
    record = json.loads((written / REFIT_FILE).read_text())
    assert record["init_from"] == str(trained["checkpoint"])
    assert record["tables"]["t_user"] == {"carried": 40, "new": 30, "dropped": 20, "oov_carried": True}
    assert len(json.loads((written / ENCODERS_FILE).read_text())["vocabularies"]["user"]["keys"]) == 70  # the refitted one

    # The same command again (a relaunch after preemption: checkpoint.resume=auto finds this run's checkpoint) resumes
    # with the vocabulary this run refitted when it started: nothing is fitted again, a warning says refit has no effect.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        c = build(validate(compose_entry("config", *command, "train.num_steps=3")))
    try:
        assert c.loop.state.step == 2 and c.loop.checkpointer.carry is None
        for name in (ENCODERS_FILE, REFIT_FILE):  # what its later checkpoints store
            assert c.loop.checkpointer.files[name] == (written / name).read_bytes()
    finally:
        c.close()
    assert any("data.vocabulary=refit has no effect on a resumed run" in r.getMessage() for r in caplog.records)


def test_refit_is_refused_when_resuming_and_must_be_keep_or_refit(trained: dict[str, Any], tmp_path: Path) -> None:
    new = [*trained["data"], f"data.path={trained['root']}/new.csv", f"checkpoint.dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"data.vocabulary=refit .* checkpoint.resume=.*step_.* continues a run.*Fix: drop "
                                          r"data.vocabulary=refit to resume, or fine-tune on the new files: checkpoint.init_from="):
        build(validate(compose_entry("config", *new, "data.vocabulary=refit", f"checkpoint.resume={trained['checkpoint']}")))
    with pytest.raises(ConfigError, match=r"data.vocabulary='again' must be one of \('keep', 'refit', 'extend'\)"):
        validate(compose_entry("config", *new, "data.vocabulary=again"))


def test_extend_keeps_every_trained_id_at_its_row_and_grows_the_tables_by_the_new_ids(trained: dict[str, Any],
                                                                                     caplog: pytest.LogCaptureFixture,
                                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The daily fine-tune: yesterday's encoders, each vocabulary grown by today's new ids. ``keep`` read them as OOV,
    ``refit`` dropped the ids absent today (their trained rows left behind) and refitted every statistic. One line a
    table says it (there were two: the grown vocabulary's and the carry's). The data module is built once: a first one,
    built only to fit the new files, indexed them and wrote its encoders out to read their vocabularies back."""
    built: list[str] = []
    init = TabularData.__init__

    def counted(self: TabularData, *args: Any, **kwargs: Any) -> None:  # constructs it as ever, counting each one
        built.append(type(self).__name__)
        init(self, *args, **kwargs)

    monkeypatch.setattr(TabularData, "__init__", counted)
    old_state, old_vocab = _checkpoint(trained["checkpoint"])
    fine_tune = [*trained["data"], f"data.path={trained['root']}/new.csv", "checkpoint.resume=never"]
    with caplog.at_level(logging.INFO, logger="recsys_runner"):
        extended, *new_vocab, c = _built(*fine_tune, f"checkpoint.init_from={trained['checkpoint']}", "data.vocabulary=extend")
    assert built == ["CsvData"], built
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("t_user:", "t_item:"))]
    assert said == ["t_item: 40 trained ids keep their rows, 10 new ids get fresh rows (56 -> 66 rows)",
                    "t_user: 60 trained ids keep their rows, 30 new ids get fresh rows (76 -> 106 rows)"], said
    record = json.loads(c.loop.checkpointer.files[REFIT_FILE])
    assert record["mode"] == "extend" and record["tables"]["t_user"] == {"carried": 60, "new": 30, "dropped": 0, "oov_carried": True}
    for column, new in zip(("user", "item"), new_vocab, strict=True):
        old = old_vocab[column]
        assert (len(old.keys), len(new.keys)) == {"user": (60, 90), "item": (40, 50)}[column]
        assert new.capacity == len(new.keys) and new.oov_buckets == old.oov_buckets
        at = np.searchsorted(new.keys, old.keys)
        np.testing.assert_array_equal(new.rows[at], old.rows)  # every trained id keeps its row
        added = np.setdiff1d(np.arange(len(new.keys)), at)
        assert sorted(new.rows[added]) == list(range(len(old.keys), len(new.keys)))  # new ids: the rows after them
        for prefix in ("", "first_order_"):
            name = f"{prefix}{TABLES[column]}.weight"
            key = next(k for k in extended if k.startswith("model/") and k.endswith(f".{name}"))
            rows, trained_rows = extended[key], old_state[key]
            assert rows.shape[0] == new.capacity + new.oov_buckets > trained_rows.shape[0]
            torch.testing.assert_close(rows[:old.capacity], trained_rows[:old.capacity], rtol=0, atol=0)
            torch.testing.assert_close(rows[new.capacity:], trained_rows[old.capacity:], rtol=0, atol=0)  # OOV rows
            started = rows[new.rows[added]]  # fresh: a first-order weight starts at 0, an embedding at none of the trained values
            assert (started == 0).all() if prefix else not torch.isin(started, trained_rows).any()
            # Its optimizer state (Adagrad's sum) goes as its rows: a trained id keeps yesterday's, a new one starts at 0.
            state = _sums(extended, f"{prefix}{TABLES[column]}")
            sums, trained_sums = extended[state], old_state[state]
            torch.testing.assert_close(sums[:old.capacity], trained_sums[:old.capacity], rtol=0, atol=0)
            torch.testing.assert_close(sums[new.capacity:], trained_sums[old.capacity:], rtol=0, atol=0)
            assert trained_sums[:old.capacity].any() and not sums[new.rows[added]].any()


def test_refit_names_a_table_of_a_column_the_new_files_add_as_new(trained: dict[str, Any], tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Day 3 adds a column: refit said its table "has a vocabulary now only (encoding=vocab now)", as if it had changed."""
    lines = (trained["root"] / "new.csv").read_text().splitlines()
    (tmp_path / "day3.csv").write_text("\n".join([f"{lines[0]},device", *(f"{x},d{i % 3}" for i, x in enumerate(lines[1:]))]) + "\n")
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        _, _, _, c = _built(*trained["data"], f"data.path={tmp_path}/day3.csv", "checkpoint.resume=never",
                            f"checkpoint.init_from={trained['checkpoint']}", "data.vocabulary=refit")
    said = [r.getMessage() for r in caplog.records if "t_device" in r.getMessage()]
    assert said[0] == (f"data.vocabulary=refit: t_device is a new table (column device is not in {trained['checkpoint']}), so "
                       f"its rows start fresh"), said
    assert "t_device" not in c.loop.checkpointer.carry.tables


def test_a_table_size_the_stored_encoders_overrule_is_said(trained: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """A fine-tune that raised a table's size (the OOV rate grew) kept the checkpoint's size without a word."""
    fine_tune = [*trained["data"], f"data.path={trained['root']}/new.csv", "checkpoint.resume=never",
                 f"checkpoint.init_from={trained['checkpoint']}", "data.sparse=[{name: user, num_embeddings: 500}, {name: item}]"]
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        *_, c = _built(*fine_tune)
    assert c.loop.checkpointer.carry is None  # keep: the stored sizes
    (line,) = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert line.startswith(f"data.sparse[user].num_embeddings=500 (stored: 76): not used, the encoders stored in {trained['checkpoint']} "
                           f"size the tables (a checkpoint's ids keep their rows). To size them anew on these files, fine-tune "
                           f"with data.vocabulary=refit"), line
    stored = from_json((trained["checkpoint"] / ENCODERS_FILE).read_bytes(), "test")[0]
    assert sizes_not_used(stored, {"user": 50, "item": None}) == {}  # a vocabulary grown past its configured size: expected
    assert sizes_not_used(stored, {"user": 76, "item": 90}) == {"item": (90, 56)}


def test_a_grown_vocabulary_fills_the_rows_it_reserved_before_it_grows() -> None:
    old = Vocabulary.build(np.array([5, 5, 7], dtype=np.uint64), capacity=4, oov_buckets=2)  # rows 2, 3 reserved, unused
    new = Vocabulary.build(np.array([9, 9, 9, 8, 8, 7, 6], dtype=np.uint64), capacity=10, oov_buckets=2)
    vocab, added = grown(old, new)
    assert added == 3 and vocab.capacity == 5 and vocab.oov_buckets == 2
    assert vocab.lookup(np.array([5, 7, 9, 8, 6], dtype=np.uint64)).tolist() == [0, 1, 2, 3, 4]  # old rows; new by frequency


def test_refit_without_any_vocabulary_says_it_has_nothing_to_carry(trained: dict[str, Any], tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    # Hashed columns on both sides (as Parquet written by convert: its ids are encoded already): refit would otherwise
    # do nothing without a word (docs/lifecycle.md's fine-tune on generated Parquet days is such a run).
    hashed = ["data.sparse=[{name: user, num_embeddings: 100, encoding: hash}, {name: item, num_embeddings: 60, encoding: hash}]",
              *trained["data"]]
    train(compose_entry("config", *hashed, f"data.path={trained['root']}/old.csv", "train.num_steps=1",
                        f"checkpoint.dir={tmp_path}/hashed"))
    (checkpoint,) = list_checkpoints(tmp_path / "hashed")
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        c = build(validate(compose_entry("config", *hashed, f"data.path={trained['root']}/new.csv", "data.vocabulary=refit",
                                         f"checkpoint.init_from={checkpoint}", f"checkpoint.dir={tmp_path}/fine_tune")))
    try:
        assert c.loop.checkpointer.carry is not None and not c.loop.checkpointer.carry.tables
    finally:
        c.close()
    assert any(r.getMessage().startswith("data.vocabulary=refit has nothing to carry over: no table has a vocabulary") and
               str(checkpoint) in r.getMessage() for r in caplog.records)


@pytest.fixture
def one_rank() -> Iterator[None]:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("split", ["rows", "columns"])
def test_rows_land_in_each_local_shard_and_other_tables_follow_the_fine_tune_rule(one_rank: None, tmp_path: Path, split: str,
                                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The loader alone, on a ShardedTensor of two local shards split by rows or by columns: ``t_a``'s rows (and its
    first-order ``wide_t_a``'s) go by id, ``t_x_t_a`` is another table and loads as it is, and a resized table without a
    vocabulary (``t_h``) keeps its fresh rows with a warning. The optimizer state goes by id too: ``t_a``'s row-wise sums
    (one a row), ``wide_t_a``'s row-wise sums of a table column-wise sharded in two (TorchRec keeps a block of rows per
    column shard) block by block, its step count as it is; ``t_b``'s, two blocks here and one there, starts fresh, said."""
    old_a, old_x, old_h = torch.arange(20.0).reshape(5, 4), torch.randn(5, 4), torch.randn(7, 4)
    dcp.save({"model/m.t_a.weight": old_a, "model/m.wide_t_a.weight": old_a + 100, "model/m.t_x_t_a.weight": old_x,
              "model/m.t_h.weight": old_h, "model/m.t_b.weight": old_a, "optim/sparse.m.t_a.weight/t_a.momentum1": torch.arange(5.0) + 1,
              "optim/sparse.m.wide_t_a.weight/wide_t_a.momentum1": torch.arange(10.0) + 1, "optim/sparse.m.wide_t_a.weight/step": torch.tensor(7.0),
              "optim/sparse.m.t_b.weight/t_b.momentum1": torch.ones(5)}, checkpoint_id=str(tmp_path))
    old = Vocabulary(np.array([10, 20, 30], dtype=np.uint64), np.array([0, 1, 2]), capacity=3, oov_buckets=2)
    new = Vocabulary(np.array([20, 30, 40, 50], dtype=np.uint64), np.array([1, 0, 2, 3]), capacity=4, oov_buckets=2)
    carry = carry_rows(old, new)
    assert carry.old_rows.tolist() == [2, 1, -1, -1, 3, 4] and (carry.carried, carry.new, carry.dropped) == (2, 2, 1)
    pieces = [(0, 3, 0, 4), (3, 3, 0, 4)] if split == "rows" else [(0, 6, 0, 2), (0, 6, 2, 2)]
    shards = [Shard(torch.full((nr, nc), -1.0), ShardMetadata([r, c], [nr, nc], "rank:0/cpu")) for r, nr, c, nc in pieces]
    ours = {"model/m.t_a.weight": ShardedTensor._init_from_local_shards(shards, [6, 4]), "model/m.wide_t_a.weight": torch.full((6, 4), -1.0),
            "model/m.t_x_t_a.weight": torch.zeros(5, 4), "model/m.t_h.weight": torch.zeros(9, 4), "model/m.t_b.weight": torch.zeros(6, 4),
            "optim/sparse.m.t_a.weight/t_a.momentum1": ShardedTensor._init_from_local_shards(
                [Shard(torch.zeros(n), ShardMetadata([r], [n], "rank:0/cpu")) for r, n in ((0, 2), (2, 4))], [6]),
            "optim/sparse.m.wide_t_a.weight/wide_t_a.momentum1": torch.zeros(12), "optim/sparse.m.wide_t_a.weight/step": torch.tensor(0.0),
            "optim/sparse.m.t_b.weight/t_b.momentum1": torch.zeros(12)}
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        loaded = load_into(DcpFileStorage(), tmp_path, ours, rule="fine_tune",
                           carry=CarriedRows({"t_a": carry, "t_b": carry}, frozenset({"t_a", "t_x_t_a", "t_h", "t_b"})))
    expected = torch.cat([old_a[[2, 1]], torch.full((2, 4), -1.0), old_a[[3, 4]]])
    torch.testing.assert_close(_whole(ours["model/m.t_a.weight"]), expected, rtol=0, atol=0)
    torch.testing.assert_close(ours["model/m.wide_t_a.weight"], torch.where(expected < 0, expected, expected + 100), rtol=0, atol=0)
    torch.testing.assert_close(ours["model/m.t_x_t_a.weight"], old_x, rtol=0, atol=0)
    assert not ours["model/m.t_h.weight"].any()
    assert _whole(ours["optim/sparse.m.t_a.weight/t_a.momentum1"]).tolist() == [3, 2, 0, 0, 4, 5]  # new ids: 0, as fbgemm starts
    assert ours["optim/sparse.m.wide_t_a.weight/wide_t_a.momentum1"].tolist() == [3, 2, 0, 0, 4, 5, 8, 7, 0, 0, 9, 10]
    assert ours["optim/sparse.m.wide_t_a.weight/step"].item() == 7 and not ours["optim/sparse.m.t_b.weight/t_b.momentum1"].any()
    assert set(loaded) == {"model/m.t_a.weight", "model/m.wide_t_a.weight", "model/m.t_x_t_a.weight", "model/m.t_b.weight",
                           "optim/sparse.m.t_a.weight/t_a.momentum1", "optim/sparse.m.wide_t_a.weight/wide_t_a.momentum1",
                           "optim/sparse.m.wide_t_a.weight/step"}
    (fresh,) = [r.getMessage() for r in caplog.records if "optimizer state of" in r.getMessage()]
    assert "optimizer state of 1 carried tables starts fresh" in fresh and "t_b (optim/sparse.m.t_b.weight/t_b.momentum1: 1 " \
           "row-wise blocks there, 2 here)" in fresh, fresh
    assert any("tensors of another shape there keep their fresh values" in r.getMessage() and "model/m.t_h.weight ([9, 4] here, "
               "[7, 4] there)" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_two_ranks_carry_rows_into_shards_spread_over_them(trained: dict[str, Any], tmp_path: Path) -> None:
    """On 2 gloo ranks (``t_user`` column-wise, ``t_item`` table-wise: a rank may hold no shard of a table, and reads the
    trained table collectively all the same). The learning rates are ~0, so the one step the run takes leaves every
    trained row as loaded. Shards split within a table: the loader test above."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", "recsys_runner", *trained["data"], f"data.path={trained['root']}/new.csv", "data.vocabulary=refit",
           f"checkpoint.init_from={trained['checkpoint']}", "optim.sparse.lr=1e-30", "optim.dense.lr=1e-30", "train.num_steps=1",
           "+distributed.tables={t_user: {sharding_types: [column_wise]}, t_item: {sharding_types: [table_wise]}}",
           "distributed.timeout_s=120", f"checkpoint.dir={tmp_path}/ft", f"hydra.run.dir={tmp_path}/run"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 column_wise (fused kernel), 1 table_wise (fused kernel)" in done.stdout + done.stderr
    (written,) = list_checkpoints(tmp_path / "ft")
    (old_state, old_vocab), (state, vocab) = _checkpoint(trained["checkpoint"]), _checkpoint(written)
    for column, table in TABLES.items():
        old, new = old_vocab[column], vocab[column]
        _, new_at, old_at = np.intersect1d(new.keys, old.keys, return_indices=True)
        for prefix in ("", "first_order_"):
            key = next(k for k in state if k.endswith(f".{prefix}{table}.weight"))
            torch.testing.assert_close(state[key][new.rows[new_at]], old_state[key][old.rows[old_at]], rtol=0, atol=0)
            torch.testing.assert_close(state[key][new.capacity:], old_state[key][old.capacity:], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["keep", "extend"])
def test_a_column_the_new_files_add_is_said_not_read_and_one_they_lack_refused(trained: dict[str, Any], tmp_path: Path, mode: str,
                                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Day 3 adds a column: the stored encoders name the columns, so keep and extend read it not, without a word."""
    lines = (trained["root"] / "new.csv").read_text().splitlines()
    (tmp_path / "day3.csv").write_text("\n".join([f"{lines[0]},device", *(f"{x},d{i % 3}" for i, x in enumerate(lines[1:]))]) + "\n")
    fine_tune = [*trained["data"], f"data.path={tmp_path}/day3.csv", "checkpoint.resume=never",
                 f"checkpoint.init_from={trained['checkpoint']}", f"data.vocabulary={mode}"]
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        *_, c = _built(*fine_tune)
    assert "device" not in c.loop.data.features.sparse_names
    (said,) = [r.getMessage() for r in caplog.records if "do not read" in r.getMessage()]
    assert said == (f"data.vocabulary={mode}: data.path={tmp_path}/day3.csv has 1 columns the encoders stored in {trained['checkpoint']} "
                    f"do not read, so they are not read: device (a feature these files add). Fix: data.vocabulary=refit to infer "
                    f"the schema anew and take them in (their tables start fresh, the other tables' rows are carried by id), or "
                    f"data.infer.exclude=[device] to leave them out without this warning"), said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        _built(*fine_tune, "data.infer.exclude=[device]")
    assert not [r for r in caplog.records if "do not read" in r.getMessage()]
    (tmp_path / "no_item.csv").write_text("\n".join(",".join(x.split(",")[:2]) for x in lines) + "\n")
    with pytest.raises(DataError, match=r"no_item.csv' has no column 'item'.*which the model was trained on"):
        _built(*fine_tune[:-4], f"data.path={tmp_path}/no_item.csv", *fine_tune[-3:])
