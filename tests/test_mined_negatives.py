"""Hard negatives for two-tower training: mined from the previous full-corpus eval's item index (``data.negatives.mined_ratio``,
drawn in the data pipeline, refreshed into running DataLoader workers) and generated per row (``data.hard_negatives``, the
``hard_items`` column that ``data.negatives.hard_column`` reads); both presets train and evaluate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recsys_runner.configurable import make
from recsys_runner.data.catalogue.items import ItemTable
from recsys_runner.data.catalogue.negatives import MinedNegatives, NegativeSampler, NegativesConfig
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec, SparseFeature


def _table(n: int) -> ItemTable:
    ids = np.arange(n) * 3 + 1  # encoded ids are not table rows
    return ItemTable("item", ids, {"item": (ids, np.ones(n, np.int32))}, (), np.zeros((n, 0), np.float32), np.ones(n))


def test_mined_lists_are_the_previous_index_top_scoring_items_never_itself() -> None:
    n, top_k = 300, 7
    index = torch.nn.functional.normalize(torch.randn(n, 8, generator=torch.Generator().manual_seed(0)), dim=1)
    mined = MinedNegatives(n, top_k)
    assert mined.pool(np.arange(n)).size == 0 and int(mined.refreshes) == 0, "nothing mined before the first refresh"
    mined.refresh(index, chunk_rows=64)  # chunks on both sides, the last one short
    scores = index @ index.t()
    scores.fill_diagonal_(float("-inf"))
    expected = scores.topk(top_k, dim=1).indices
    assert int(mined.refreshes) == 1
    assert torch.equal(mined.lists.sort(dim=1).values, expected.sort(dim=1).values)
    assert not (mined.lists == torch.arange(n).view(-1, 1)).any()


def test_sampler_draws_mined_negatives_from_the_batch_positives_lists_never_a_positive() -> None:
    n, k = 200, 64
    table = _table(n)
    spec = FeatureSpec((), (SparseFeature("user", 8), SparseFeature("item", 3 * n + 1)))
    sampler = NegativeSampler(NegativesConfig(num_negatives=k, mined_ratio=0.5, mined_top_k=10), table, spec, seed=0)
    assert sampler.mined is not None
    index = torch.nn.functional.normalize(torch.randn(n, 4, generator=torch.Generator().manual_seed(1)), dim=1)
    rows = np.array([5, 17, 17, 42, 99, 150])
    user = torch.arange(rows.size)
    values = torch.cat([user, torch.from_numpy(table.ids[rows])])
    lengths = torch.ones(2 * rows.size, dtype=torch.int32)
    batch = (torch.zeros(rows.size, 0), values, lengths, torch.ones(rows.size))
    before = sampler.extend(batch, (0,))[1][-k:]
    sampler.mined.refresh(index, chunk_rows=50)
    after = sampler.extend(batch, (0,))[1][-k:]
    drawn, _ = table.index_of(after.numpy())
    listed = sampler.mined.lists[torch.from_numpy(rows)].reshape(-1).numpy()
    mined = drawn[:32]
    assert np.isin(mined, listed).all(), "every mined negative is in the top-k lists of the batch's positives"
    assert not np.isin(mined, rows).any(), "no mined negative is a positive of the batch"
    assert not np.isin(drawn[32:], listed).all() and not torch.equal(before, after)
    scores = (index[torch.from_numpy(rows)] @ index.t())
    for item in mined[:8]:  # each is within the top 10 of some positive under the previous index
        assert any(int((scores[r] > scores[r, item]).sum()) <= 10 for r in range(rows.size))


def _generated(workers: int = 0, **fields):
    fields = {"num_embeddings_per_feature": [64, 200], **fields}
    return make(SyntheticDataConfig, batch_size=32, num_dense=1, num_sparse=2, num_train_rows=32 * 40, num_eval_rows=64,
                user_item_clusters=4, num_workers=workers, **fields).build()


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_refresh_reaches_running_dataloader_workers(start: str) -> None:
    """The mined lists are shared memory: workers forked from the training process share them, and so do workers a
    forkserver starts, to which the lists are pickled (as a handle on the same memory, not a copy)."""
    data = _generated(workers=2, negatives={"num_negatives": 16, "mined_ratio": 0.5, "mined_top_k": 5}, worker_start=start)
    miner = data.negative_miner()
    table = data.item_table()
    assert miner is not None and table is not None
    batches = data.train_batches(0, 0, 1)
    next(batches)  # the workers are running
    miner.refresh(torch.nn.functional.normalize(torch.randn(len(table), 4), dim=1), chunk_rows=64)
    late = list(batches)[10:]  # past what the workers had prefetched before the refresh
    for batch in late:
        items = batch.sparse_features.to_dict()["cat_1"].values()
        positives, _ = table.index_of(items[:32].numpy())
        drawn, _ = table.index_of(items[32:40].numpy())
        assert np.isin(drawn, miner.lists[torch.from_numpy(positives)].numpy()).all()
        assert not np.isin(drawn, positives).any()


def test_mined_negatives_need_a_full_corpus_metric(make_cfg) -> None:
    from recsys_runner.__main__ import run

    cfg = make_cfg("experiment=dssm_mined_negatives", "model.eval_metrics=[inbatch_recall@10]", "checkpoint=none")
    with pytest.raises(ConfigError, match="mined_ratio"):
        run(cfg)


def test_a_run_with_mined_negatives_trains_evaluates_and_refreshes(make_cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    from recsys_runner.__main__ import run

    refreshes, pools = [], []
    store, pool = MinedNegatives.store, MinedNegatives.pool  # every refresh stores its lists whole, on every rank
    monkeypatch.setattr(MinedNegatives, "store", lambda self, *a: (refreshes.append(1), store(self, *a))[1])
    monkeypatch.setattr(MinedNegatives, "pool", lambda self, p: (pools.append(r := pool(self, p)), r)[1])
    cfg = make_cfg("experiment=dssm_mined_negatives", "data.negatives.num_negatives=64", "data.num_workers=0",
                   "checkpoint=none", "train.num_steps=20", "train.eval_every_steps=10", "data.num_eval_rows=1024")
    assert math.isfinite(run(cfg))
    assert len(refreshes) >= 1 and pools[0].size == 0 and pools[-1].size > 0, "batches after a refresh draw mined items"


def test_generated_hard_negatives_are_same_cluster_items_never_the_positive() -> None:
    plain, hard = _generated(), _generated(hard_negatives=6)
    assert hard.features.sparse_names[-1] == "hard_items" and hard.features.sparse[-1].table_name == "t_cat_1"
    for a, b in zip(plain.train_batches(0, 0, 1), hard.train_batches(0, 0, 1), strict=True):
        kjt = b.sparse_features.to_dict()
        assert torch.equal(kjt["cat_1"].values(), a.sparse_features.to_dict()["cat_1"].values()), "the pairs are unchanged"
        user, item = kjt["cat_0"].values(), kjt["cat_1"].values()
        lists = kjt["hard_items"].values().view(-1, 6)
        assert (kjt["hard_items"].lengths() == 6).all() and (lists < 200).all()
        assert (lists % 4 == (user % 4).view(-1, 1)).all(), "in the user's cluster"
        assert not (lists == item.view(-1, 1)).any(), "never the row's positive"
    with pytest.raises(ConfigError, match="hard_negatives"):
        _generated(hard_negatives=2, num_embeddings_per_feature=[64, 6])


def test_the_hard_negatives_preset_trains_and_evaluates(make_cfg) -> None:
    from recsys_runner.__main__ import run

    cfg = make_cfg("experiment=dssm_hard_negatives", "data.negatives.num_negatives=64", "checkpoint=none", "train.num_steps=10",
                   "data.num_eval_rows=1024")
    assert math.isfinite(run(cfg))


def _mine_on_rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from recsys_runner.distributed.env import DistEnv
    from recsys_runner.train.corpus import mine

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        index = torch.nn.functional.normalize(torch.randn(230, 6, generator=torch.Generator().manual_seed(5)), dim=1)
        miner = MinedNegatives(230, 9)
        mine(miner, index, 40, DistEnv(rank, world, rank, world, torch.device("cpu"), "gloo"))  # 6 chunks over 2 ranks
        torch.save(miner.lists.clone(), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_ranks_mine_their_share_and_all_hold_the_one_process_lists(tmp_path) -> None:
    import torch.multiprocessing as mp

    out = str(tmp_path / "lists")
    mp.spawn(_mine_on_rank, args=(2, f"file://{tmp_path}/store", out), nprocs=2)
    alone = MinedNegatives(230, 9)
    alone.refresh(torch.nn.functional.normalize(torch.randn(230, 6, generator=torch.Generator().manual_seed(5)), dim=1), 40)
    for rank in (0, 1):
        assert torch.equal(torch.load(f"{out}.{rank}"), alone.lists), f"rank {rank}'s lists differ from one process's"
