"""Managed-collision embeddings: raw ids that never stop arriving, mapped to a table's slots by TorchRec's MCH module.

A run with 10x more distinct ids than slots trains, evicts, checkpoints and resumes to the same losses and eval
metrics as an uninterrupted run; a 2-rank checkpoint restores on 1 rank to the same mapping and the 2-rank run's eval
(slow: an id without a slot read its row-wise shard's fallback there, one rank has one fallback, so the test looks up
as 2 ranks did); unknown ids read the fallback slot and are counted; impossible settings are refused with the key and
the fix.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from torchrec.sparse.jagged_tensor import JaggedTensor

import recsys_runner.__main__ as entry
from recsys_runner import evaluate
from recsys_runner.build import build
from recsys_runner.checkpoint.storage import DcpFileStorage, list_checkpoints
from recsys_runner.config import register_configs, validate
from recsys_runner.configurable import make
from recsys_runner.data.encoding.sparse_ids import raw_text
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.data.schema import SparseColumn
from recsys_runner.distributed.planner import _managed_types
from recsys_runner.errors import CheckpointError, ConfigError
from recsys_runner.features import FeatureSpec, ManagedCollision, SequenceGroup, SparseFeature
from recsys_runner.models.collision import CountedMCH, collision_counters, collision_rates, managed_collision_module
from recsys_runner.models.sequence import SequenceArch
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.train.loop import train
from recsys_runner.train.signals import Interrupted
from tests.conftest import TINY, run_in_process, torchrun
from tests.test_checkpoint_reshard import _saved
from tests.test_evaluate import compose_entry

STEPS, SLICE, SLOTS = 12, 4, 100
MANAGED = "data.managed_collision={features: [cat_0, cat_1], input_hash_size: 1000000, eviction_interval: 2}"
"""cat_0 and cat_1 draw 1000 distinct raw ids (10x their 100 slots); a checkpoint every SLICE steps falls on an
eviction step, so no id seen since the last admission is lost by a resume."""


def _overrides(tmp_path: Path, experiment: str) -> list[str]:
    return [*[a for a in TINY if not a.startswith(("train.", "data.num_embeddings"))], f"data.num_embeddings={SLOTS}",
            MANAGED, f"train.num_steps={STEPS}", "train.log_every_steps=1", "train.eval_every_steps=null",
            "train.eval_max_batches=4", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"tracking.experiment={experiment}",
            f"checkpoint.dir={tmp_path}/{experiment}", "checkpoint.keep_last=null"]


def _run(*overrides: str) -> float:
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return entry.run(cfg)


def _history(tmp_path: Path, experiment: str) -> tuple[dict[str, list[tuple[int, float]]], dict[str, float]]:
    """The run's train/loss and mc/… histories (step, value), and its last metrics."""
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    keys = [k for k in run.data.metrics if k == "train/loss" or k.startswith("mc/")]
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)) for k in keys}, run.data.metrics


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """One uninterrupted run: its directory and objective (eval AUC)."""
    tmp = tmp_path_factory.mktemp("mc_straight")
    return tmp, _run(*_overrides(tmp, "straight"))


def test_run_evicts_and_logs_collision_metrics(straight: tuple[Path, float]) -> None:
    tmp, auc = straight
    history, last = _history(tmp, "straight")
    assert auc > 0.55
    for table in ("t_cat_0", "t_cat_1", "first_order_t_cat_0"):
        assert sum(v for _, v in history[f"mc/{table}/evictions"]) > 0, table
        assert last[f"mc/{table}/slots_used"] == SLOTS - 1  # every slot but the fallback holds an id
        assert 0 < last[f"mc/{table}/fallback_rate"] < 1
    assert not any(k.startswith("mc/t_cat_2/") for k in history)  # plain tables stay plain


def test_resume_gives_the_same_losses_and_eval(straight: tuple[Path, float], tmp_path: Path) -> None:
    args = _overrides(tmp_path, "sliced")
    with pytest.raises(Interrupted):
        _run(*args, f"train.stop_after_steps={SLICE}")
    (ckpt,) = list_checkpoints(tmp_path / "sliced")
    index = DcpFileStorage().tensor_index(ckpt)
    assert any("_mch_sorted_raw_ids" in k and "t_cat_0" in k for k in index), sorted(index)[:10]
    assert any("_mch_counts" in k for k in index)
    auc = _run(*args)
    resumed, _ = _history(tmp_path, "sliced")
    reference, _ = _history(straight[0], "straight")
    assert [s for s, _ in resumed["train/loss"]] == list(range(1, STEPS + 1))
    assert [v for _, v in resumed["train/loss"]] == pytest.approx([v for _, v in reference["train/loss"]], rel=1e-5, abs=1e-6)
    assert auc == pytest.approx(straight[1], rel=1e-6)
    # python -m recsys_runner.evaluate on the resumed run's last checkpoint: the restored mapping gives the same metrics
    final = list_checkpoints(tmp_path / "sliced")[-1]
    evaluated = run_in_process([sys.executable, "-m", "recsys_runner.evaluate", *[a for a in args if not a.startswith("tracking.")],
                                "tracking=none", f"load={final}", f"hydra.run.dir={tmp_path}/evaluate"], tmp_path)  # as -m runs it
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    (line,) = [x for x in (evaluated.stdout + evaluated.stderr).splitlines() if "] - evaluate " in x and "eval/auc=" in x]
    assert float(line.split("eval/auc=")[1].split()[0]) == pytest.approx(auc, abs=1e-6)


def test_resume_refuses_another_id_space(tmp_path: Path) -> None:
    args = _overrides(tmp_path, "changed")
    with pytest.raises(Interrupted):
        _run(*args, f"train.stop_after_steps={SLICE}")
    smaller = [MANAGED.replace("1000000", "1000, distinct_ids: 1000") if a == MANAGED else a for a in args]
    with pytest.raises(CheckpointError, match=r"'t_cat_0' maps raw ids up to \d+, outside this config's input_hash_size=1000"):
        _run(*smaller)


def test_resume_refuses_other_slots(tmp_path: Path) -> None:
    args = _overrides(tmp_path, "resized")
    with pytest.raises(Interrupted):
        _run(*args, f"train.stop_after_steps={SLICE}")
    resized = [a for a in args if not a.startswith("data.num_embeddings")]
    with pytest.raises(CheckpointError, match=r"t_cat_0\._mch_\w+ is \[100\] there, \[50\] here.*slots"):
        _run(*resized, f"data.num_embeddings_per_feature=[50,{','.join(['100'] * 25)}]")


def test_unknown_ids_read_the_fallback_slot_and_are_counted() -> None:
    table = SparseFeature("u", 10, managed_collision=ManagedCollision(input_hash_size=1000, eviction_interval=1))
    features = FeatureSpec(dense_names=(), sparse=(table,))
    (config,) = features.embedding_tables(8)
    module = managed_collision_module(config, features.managed_tables()["t_u"], torch.device("cpu"))
    assert isinstance(module, CountedMCH)
    seen = torch.tensor([5, 7, 5, 900])
    module.train()
    module({"t_u": JaggedTensor(values=seen, lengths=torch.tensor([4]))})  # admitted at once: eviction_interval 1
    module.eval()
    out = module({"t_u": JaggedTensor(values=torch.tensor([5, 123, 456]), lengths=torch.tensor([3]))})["t_u"].values()
    assert out[0] != 9 and out[1:].tolist() == [9, 9]  # the last slot is the fallback
    counts = collision_rates(collision_counters(torch.nn.ModuleDict({"m": module})))
    assert counts["mc/t_u/eval_fallback_lookups"] == 2 and counts["mc/t_u/eval_fallback_rate"] == pytest.approx(2 / 3)
    assert counts["mc/t_u/slots_used"] == 3


def test_a_mapping_saved_by_two_shards_keeps_their_fallbacks_on_one() -> None:
    """A 2-rank mapping loaded into 1 module (10 slots: shard 0 held slots 0-4 and raw ids below 500, shard 1 slots 5-9
    and the ids above): an id without a slot reads its saved shard's fallback (4 or 9), as it did on 2 ranks, until an
    admission gives slot 4 an id; then the lower block reads the module's own fallback, 9."""
    table = SparseFeature("u", 10, managed_collision=ManagedCollision(input_hash_size=1000, eviction_interval=1))
    features = FeatureSpec(dense_names=(), sparse=(table,))
    (config,) = features.embedding_tables(8)
    module = managed_collision_module(config, features.managed_tables()["t_u"], torch.device("cpu"))
    assert isinstance(module, CountedMCH)
    empty = torch.iinfo(torch.int64).max
    with torch.no_grad():  # the two shards' sorted blocks, re-sorted as a checkpoint load leaves them
        module._output_segments_tensor[:3] = torch.tensor([0, 5, 10])
        module._mch_sorted_raw_ids.copy_(torch.tensor([5, 7, 900, *[empty] * 7]))
        module._mch_remapped_ids_mapping.copy_(torch.tensor([0, 1, 5, 2, 3, 4, 6, 7, 8, 9]))
    module.check_restored("t_u")
    module.eval()

    def lookup(*ids: int) -> list[int]:
        return module({"t_u": JaggedTensor(values=torch.tensor(ids), lengths=torch.tensor([len(ids)]))})["t_u"].values().tolist()

    assert lookup(5, 7, 900, 123, 499, 500, 999) == [0, 1, 5, 4, 4, 9, 9]
    counts = collision_counters(torch.nn.ModuleDict({"m": module}))
    assert counts["mc/t_u/eval_fallback_lookups"] == 4  # every id without a slot, whichever fallback it reads
    module.train()
    for _ in range(3):  # six new ids of the lower block fill the six free slots, the old fallback 4 among them
        module({"t_u": JaggedTensor(values=torch.tensor([11, 12, 13, 14, 15, 16] * 4), lengths=torch.tensor([24]))})
    held = module._mch_remapped_ids_mapping[module._mch_sorted_raw_ids != empty]
    assert 4 in held.tolist()
    module.eval()
    assert lookup(123, 900, 999) == [9, 5, 9]


def test_raw_encoding_of_text_and_integers() -> None:
    col = SparseColumn(name="u", num_embeddings=10, managed_collision={"input_hash_size": 1000})
    assert col.encoding == "raw"
    ids, wrong = raw_text(pa.array(["12", "abc", "12", "abc"]), col)
    assert wrong is None and ids[0] == 12 and ids[1] == ids[3] and 0 <= ids[1] < 1000
    assert col.feature().managed_collision == ManagedCollision(input_hash_size=1000)


@pytest.mark.parametrize(("values", "message"), [
    (dict(num_embeddings=10, encoding="hash", managed_collision={}), r"data.sparse\[u\].encoding='hash'.*Fix: data.sparse\[u\].encoding=raw"),
    (dict(managed_collision={}), r"needs data.sparse\[u\].num_embeddings"),
    (dict(num_embeddings=10, encoding="raw"), r"encoding=raw passes raw ids"),
    (dict(num_embeddings=1, managed_collision={}), r"at least 2 slots"),
    (dict(num_embeddings=10, managed_collision={"eviction_policy": "fifo"}), r"eviction_policy='fifo' must be one of"),
    (dict(num_embeddings=10, managed_collision={"eviction_interval": 0}), r"eviction_interval=0"),
    (dict(num_embeddings=10, managed_collision={"decay_exponent": 2.0}), r"decay_exponent is set but eviction_policy=lfu"),
    (dict(num_embeddings=10, managed_collision={"ttl": 5}), r"unknown key\(s\) \['ttl'\]"),
])
def test_impossible_column_settings_are_refused(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SparseColumn(name="u", **values)


def test_impossible_synthetic_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"data.managed_collision.features=\['cat_99'\] must name sparse columns"):
        make(SyntheticDataConfig, managed_collision={"features": ["cat_99"]})
    with pytest.raises(ConfigError, match=r"distinct_ids=5000 exceeds input_hash_size=100"):
        make(SyntheticDataConfig, managed_collision={"input_hash_size": 100, "distinct_ids": 5000})
    with pytest.raises(ConfigError, match=r"exclude it. Fix: \+distributed.tables.t_cat_0.sharding_types=\[row_wise\]"):
        _managed_types("t_cat_0", ["table_wise"])


def test_history_tables_refuse_managed_collision() -> None:
    mc = ManagedCollision(input_hash_size=1000)
    features = FeatureSpec(dense_names=(), sparse=(SparseFeature("item", 10, table="item", managed_collision=mc),
                                                   SparseFeature("hist", 10, table="item", managed_collision=mc)),
                           sequences=(SequenceGroup("h", ("hist",), 5),))
    with pytest.raises(ConfigError, match=r"history tables \['item'\] unpooled.*Fix: drop managed_collision"):
        SequenceArch(features, 8, torch.nn.Module)


def _torchrun(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return torchrun("distributed.timeout_s=120", f"hydra.run.dir={tmp_path}/run2", *overrides, cwd=tmp_path, timeout=400)


@pytest.mark.slow
def test_two_rank_mapping_resumes_on_one_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-rank checkpoint (row-wise shards of the mapping) restored on 1 rank: the same (id, slot) pairs, re-sorted;
    the resumed run logs every step; and ``evaluate`` of the checkpoint on 1 rank gives the 2-rank run's eval log loss
    and AUC at the slice (each rank evaluated 4 batches: the first 8 of the eval split, which 1 rank reads): an id without
    a slot reads its 2-rank shard's fallback row there too (``CountedMCH``; with the one fallback of 1 rank the eval
    differed, AUC 0.55668 against 0.55736). The 1-rank losses after the resume have no 2-rank counterpart (other batches
    per step) short of a second 2-rank launch."""
    args = [*(a for a in _overrides(tmp_path, "mc_2to1") if not a.startswith("train.eval_every_steps")), f"train.eval_every_steps={SLICE}"]
    out = _torchrun(tmp_path, *args, f"train.stop_after_steps={SLICE}")
    assert out.returncode == 0, out.stderr[-4000:]
    (ckpt,) = list_checkpoints(tmp_path / "mc_2to1")
    saved = _saved(ckpt)
    key = next(k for k in saved if k.endswith("t_cat_0._mch_sorted_raw_ids"))
    mapping = key.replace("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping")
    pairs = {(int(r), int(s)) for r, s in zip(saved[key], saved[mapping], strict=True) if r != torch.iinfo(torch.int64).max}
    assert len(pairs) > SLOTS // 2  # both shards admitted ids
    restored: dict[str, torch.Tensor] = {}
    real_train = entry.train

    def check_then_train(loop):  # right after build() restored the 2-rank checkpoint onto 1 rank
        state = loop.checkpointer._tensor_state()
        restored.update({k: state[k].local_tensor().clone() if hasattr(state[k], "local_tensor") else state[k].clone()
                         for k in (key, mapping)})
        return real_train(loop)

    monkeypatch.setattr(entry, "train", check_then_train)
    _run(*args)
    ids = restored[key]
    assert torch.equal(ids, ids.sort().values)  # re-sorted after loading two shards' sorted blocks
    assert {(int(r), int(s)) for r, s in zip(ids, restored[mapping], strict=True) if r != torch.iinfo(torch.int64).max} == pairs
    history, _ = _history(tmp_path, "mc_2to1")
    assert [s for s, _ in history["train/loss"]] == list(range(1, STEPS + 1))
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("mc_2to1").experiment_id])
    two = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}[SLICE] for k in ("eval/auc", "eval/logloss")}
    one = evaluate.run(compose_entry("evaluate", *[a for a in args if not a.startswith(("tracking.", "train.eval_max_batches"))],
                                     "tracking=none", f"load={ckpt}", "train.eval_max_batches=8"))
    assert {k: one[k] for k in two} == pytest.approx(two, rel=1e-6), (one, two)


def test_file_column_with_text_ids_trains(tmp_path: Path) -> None:
    """Text ids (``u<n>``: 400 users, more slots than users, an admission every step) each get a slot of their own, in
    both of wide_deep's managed tables, and the click (a function of the user alone) is learned from them. The item
    column tells nothing of the click (the users of one item split about 1:2 like all users), so with every user in
    one slot the eval AUC stays near 0.5 (±0.03 on its ~410 rows): measured 0.54 when no id was admitted; 1.00 here."""
    rows, slots = 4096, 512
    g = torch.Generator().manual_seed(0)
    users = torch.randint(0, 400, (rows,), generator=g)
    pq.write_table(pa.table({"label": (users % 3 == 0).to(torch.int8).numpy(), "user": [f"u{u}" for u in users.tolist()],
                             "item": (users * 7 % 50).numpy()}), tmp_path / "train.parquet")
    column = (f"{{name: user, num_embeddings: {slots}, managed_collision: {{input_hash_size: 1000000, "
              f"eviction_policy: distance_lfu, eviction_interval: 1}}}}")
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "data=parquet", f"data.path={tmp_path}/train.parquet", "data.eval_fraction=0.1", "data.batch_size=256", "data.label=label",
            f"data.sparse=[{column}, {{name: item, num_embeddings: 50}}]", "data.dense=[]", "model=wide_deep", "train.num_steps=10",
            "train.eval_max_batches=2", "distributed.device=cpu", "tracking=none", "checkpoint=none"])
    raw, _ = raw_text(pa.array([f"u{u}" for u in range(400)]), SparseColumn(name="user", num_embeddings=slots,
                                                                            managed_collision={"input_hash_size": 1000000}))
    raw_ids = torch.from_numpy(raw)
    assert raw_ids.unique().numel() == 400, "the users' text ids hash apart"
    c = build(validate(cfg))
    try:
        final = train(c.loop)
        tables = {str(m._name): m for m in c.loop.evaluator.model.modules() if isinstance(m, CountedMCH)}
        assert sorted(tables) == ["t_user", "wide_t_user"], sorted(tables)
        for name, module in tables.items():
            held = module._mch_sorted_raw_ids != torch.iinfo(torch.int64).max
            assert int(held.sum()) > 390 and bool(torch.isin(module._mch_sorted_raw_ids[held], raw_ids).all()), name
            module.eval()
            looked_up = module({name: JaggedTensor(values=raw_ids, lengths=torch.tensor([400]))})[name].values()
            admitted = torch.isin(raw_ids, module._mch_sorted_raw_ids[held])
            fallback = module._output_global_offset + module._zch_size - 1
            slots_of = looked_up[admitted]
            assert slots_of.unique().numel() == slots_of.numel() == int(held.sum()), f"{name}: distinct ids share slots"
            assert not bool((slots_of == fallback).any()) and bool((looked_up[~admitted] == fallback).all()), name
    finally:
        c.close()
    assert final["eval/auc"] > 0.9, final


def test_collision_bench_reports_lookup_and_eviction_apart(tmp_path: Path) -> None:
    """``bench/collision.py`` splits what managed collision adds to a step into the lookups (the round less its timed
    evictions) and the evictions amortized over ``eviction_interval``; every path has an eviction's cost (forced when
    none fell in its rounds). Each share is checked against the clock it comes from (the round's wall time, its timed
    evictions and their count, the module calls), as the JSON records them: their sum is the total by definition."""
    from recsys_runner.bench.collision import TABLES, main

    result = main(["--quick", "--json", str(tmp_path / "c.json"), "distributed.device=cpu"])
    assert (tmp_path / "c.json").exists() and sorted(result["rounds"]) == ["every_10", "plain"]
    added, lookup, eviction = result["added_step"]["every_10"], result["lookup_added"]["every_10"], result["eviction_added"]["every_10"]
    assert added == pytest.approx(lookup + eviction) and eviction > 0 and result["eviction_ms"]["every_10"] > 0
    assert result["mch_calls_added"]["every_10"] > 0
    steps = result["steps_per_round"]
    ((plain, *_),) = result["round_seconds"]["plain"]  # --quick: one round
    ((wall, evicting, evictions, calls),) = result["round_seconds"]["every_10"]
    assert evictions == steps // 10 * 2 * TABLES, "every table (DeepFM: 2 per feature) evicted every 10 steps, each timed"
    assert 0 < evicting < wall and 0 < calls < wall - evicting
    assert lookup == pytest.approx((wall - evicting) / plain - 1, rel=1e-9)
    assert result["mch_calls_added"]["every_10"] == pytest.approx(calls / plain, rel=1e-9)
    one_eviction_ms = 1000 * evicting / (evictions / (2 * TABLES))  # of every table once
    assert result["eviction_ms"]["every_10"] == pytest.approx(one_eviction_ms, rel=1e-9)
    assert eviction == pytest.approx(one_eviction_ms / 10 / (1000 * plain / steps), rel=1e-9)
