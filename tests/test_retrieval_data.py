"""The item catalogue and sampled negatives of two-tower training: item tables from files and generated, negatives appended
to training batches (K per batch, popularity ** alpha, reproducible, the same with and without workers, per rank)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys_runner.configurable import make
from recsys_runner.data.catalogue.items import ItemTable
from recsys_runner.data.catalogue.negatives import LABEL_PAD, NegativeSampler, NegativesConfig
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.features import FeatureSpec, SparseFeature
from recsys_runner.train.candidates import catalogue_candidates, check_eval_items

ITEMS = 40
SPARSE = [{"name": "user_id", "num_embeddings": 64, "encoding": "mod"},
          {"name": "item_id", "num_embeddings": 997, "encoding": "hash", "table": "item"},
          {"name": "cate", "num_embeddings": 8},
          {"name": "hard", "num_embeddings": 997, "encoding": "hash", "table": "item"}]


def _rows(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    item = rng.integers(0, ITEMS, n)
    hard = [[f"i{(i + 1) % ITEMS}", f"i{(i + 2) % ITEMS}"] for i in item]
    return pa.table({"label": np.ones(n, np.int64), "user_id": rng.integers(0, 64, n), "item_id": [f"i{i}" for i in item],
                     "cate": item % 8, "price": item * 0.5, "hard": hard})


def _items(ids: list[int] | None = None) -> pa.Table:
    ids = list(range(ITEMS)) if ids is None else ids
    return pa.table({"item_id": [f"i{i}" for i in ids], "cate": [i % 8 for i in ids], "price": [i * 0.5 for i in ids],
                     "count": [float(ITEMS - i) for i in ids]})


@pytest.fixture
def files(tmp_path: Path) -> Path:
    pq.write_table(_rows(600, 1), tmp_path / "train.parquet", row_group_size=200)
    pq.write_table(_rows(200, 2), tmp_path / "eval.parquet")
    pq.write_table(_items(), tmp_path / "items.parquet")
    return tmp_path


def _parquet(root: Path, items: dict | None = None, **fields):
    items = {"path": str(root / "items.parquet"), "id": "item_id", "features": ["cate", "price"], "popularity": "count", **(items or {})}
    return make(ParquetDataConfig, path=str(root / "train.parquet"), eval_path=str(root / "eval.parquet"), label="label",
                sparse=SPARSE, dense=[{"name": "price"}], items=items, batch_size=32, **{"num_workers": 0, **fields}).build()


def test_item_table_from_parquet_encodes_as_the_training_rows(files: Path) -> None:
    data = _parquet(files)
    table = data.item_table()
    assert table is not None and len(table) == ITEMS and table.id_feature == "item_id"
    batch = next(iter(data.train_batches(0, 0, 1)))
    rows = batch.sparse_features.to_dict()
    index, found = table.index_of(rows["item_id"].values().numpy())
    assert found.all(), "every training item id is a table id"
    assert (table.features["cate"][0][index] == rows["cate"].values().numpy()).all()
    assert np.allclose(table.dense[index, 0], batch.dense_features[:, 0].numpy())
    assert table.popularity[index].min() >= 1 and table.popularity.max() == ITEMS, "the popularity column"
    dense, kjt = table.rows(np.array([3, 5]), data.features.kjt_keys, data.features.dense_names)
    assert kjt.to_dict()["user_id"].lengths().tolist() == [0, 0] and dense.shape == (2, 1)


def test_popularity_is_counted_in_the_training_files_without_a_column(files: Path) -> None:
    table = _parquet(files).item_table()
    counted = _parquet(files, {"popularity": None}).item_table()
    assert table is not None and counted is not None
    assert counted.popularity.sum() == 600 and not np.allclose(counted.popularity, table.popularity)


def test_item_table_from_csv(tmp_path: Path) -> None:
    rows = _rows(300, 3).drop_columns(["hard"]).to_pandas()
    rows.to_csv(tmp_path / "train.csv", index=False)
    _items().to_pandas().to_csv(tmp_path / "items.csv", index=False)
    data = make(CsvDataConfig, path=str(tmp_path / "train.csv"), label="label", sparse=SPARSE[:3], dense=[{"name": "price"}],
                items={"path": str(tmp_path / "items.csv"), "id": "item_id", "features": ["cate"]}, batch_size=16, num_workers=0).build()
    table = data.item_table()
    assert table is not None and len(table) == ITEMS
    kjt = next(iter(data.train_batches(0, 0, 1))).sparse_features.to_dict()
    index, found = table.index_of(kjt["item_id"].values().numpy())
    assert found.all() and (table.features["cate"][0][index] == kjt["cate"].values().numpy()).all()


def test_item_file_errors_name_the_file_and_column(files: Path) -> None:
    pq.write_table(_items([*range(ITEMS), 7]), files / "dupes.parquet")
    with pytest.raises(DataError, match=r"dupes\.parquet.*'i7'.*'item_id' 2 times"):
        _parquet(files, {"path": str(files / "dupes.parquet")})
    with pytest.raises(DataError, match=r"items\.parquet.*no column 'brand'"):
        _parquet_with_brand(files)
    pq.write_table(_items(list(range(ITEMS - 1))), files / "short.parquet")
    short = _parquet(files, {"path": str(files / "short.parquet")})  # the eval rows are checked when a full-corpus eval is built
    table = short.item_table()
    assert table is not None
    with pytest.raises(DataError, match=r"eval row .*eval\.parquet.*'i39'.*column 'item_id'.*short\.parquet"):
        check_eval_items(catalogue_candidates(table, short, []), short)
    with pytest.raises(ConfigError, match=r"data\.items\.features has \['brand'\]"):
        _parquet(files, {"features": ["brand"]})


def _parquet_with_brand(root: Path):
    """A config whose item feature ``brand`` is a training column the items file lacks."""
    sparse = [*SPARSE, {"name": "brand", "num_embeddings": 4}]
    pq.write_table(_rows(600, 1).append_column("brand", pa.array(np.zeros(600, np.int64))), root / "train.parquet")
    pq.write_table(_rows(200, 2).append_column("brand", pa.array(np.zeros(200, np.int64))), root / "eval.parquet")
    items = {"path": str(root / "items.parquet"), "id": "item_id", "features": ["cate", "brand"]}
    return make(ParquetDataConfig, path=str(root / "train.parquet"), eval_path=str(root / "eval.parquet"), label="label",
                sparse=sparse, items=items, batch_size=32, num_workers=0).build()


def test_negatives_without_items_or_beyond_the_table_are_config_errors(files: Path) -> None:
    with pytest.raises(ConfigError, match=r"data\.items\.path is null"):
        make(ParquetDataConfig, path=str(files / "train.parquet"), negatives={"num_negatives": 8})
    with pytest.raises(ConfigError, match=rf"num_negatives=41 is larger than the item table \({ITEMS} items\)"):
        _parquet(files, negatives={"num_negatives": 41})
    with pytest.raises(ConfigError, match=r"larger than the item table \(50 items\)"):
        _synthetic(num_negatives=51)


def test_file_batches_get_k_sampled_item_rows_and_hard_negatives(files: Path) -> None:
    data = _parquet(files, negatives={"num_negatives": 8, "hard_column": "hard", "hard_ratio": 0.5})
    table = data.item_table()
    assert data.features.sampled_items == 8 and table is not None
    batch = next(iter(data.train_batches(0, 0, 1)))
    rows = batch.sparse_features.to_dict()
    assert batch.labels.shape == (40,) and (batch.labels[32:] == LABEL_PAD).all()
    assert rows["user_id"].lengths()[32:].sum() == 0 and (rows["item_id"].lengths()[32:] == 1).all()
    sampled = rows["item_id"].values()[32:].numpy()
    index, found = table.index_of(sampled)
    assert found.all() and (table.features["cate"][0][index] == rows["cate"].values()[32:].numpy()).all()
    hard = set(rows["hard"].values()[:64].tolist())
    assert set(sampled[:4].tolist()) <= hard, "hard_ratio 0.5: the first 4 of 8 come from the batch's hard lists"
    assert sum(len(b.labels) for b in data.eval_batches(0, 1)) == 200, "eval batches carry no sampled rows"
    again = next(iter(_parquet(files, negatives={"num_negatives": 8, "hard_column": "hard", "hard_ratio": 0.5}).train_batches(0, 0, 1)))
    assert torch.equal(again.sparse_features.values(), batch.sparse_features.values()), "reproducible from the seed"


def test_file_negatives_are_drawn_in_the_workers_reproducibly(files: Path) -> None:
    def batches() -> list:
        data = _parquet(files, negatives={"num_negatives": 8, "distribution": "popularity"}, num_workers=2)
        return list(data.train_batches(0, 0, 1))

    first, second = batches(), batches()
    assert len(first) == 2 * (300 // 32) and all(b.labels.shape[0] == 40 for b in first), "2 worker shards of 300 rows"
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert (first[0].sparse_features.to_dict()["user_id"].lengths()[32:] == 0).all()


def _synthetic(num_negatives: int = 16, workers: int = 0, **negatives):
    return make(SyntheticDataConfig, batch_size=32, num_dense=2, num_sparse=3, num_embeddings_per_feature=[64, 50, 12],
                num_train_rows=32 * 8, num_eval_rows=64, user_item_clusters=4, item_features=["cat_1", "cat_2"],
                negatives={"num_negatives": num_negatives, **negatives}, num_workers=workers).build()


def test_generated_catalogue_is_consistent_per_item() -> None:
    data = _synthetic(num_negatives=0)
    table = data.item_table()
    assert table is not None and len(table) == 50 and math.isclose(table.popularity.sum(), 1.0)
    counts = np.zeros(50)
    for batch in data.train_batches(0, 0, 1):
        kjt = batch.sparse_features.to_dict()
        user, item, cat = (kjt[k].values().numpy() for k in ("cat_0", "cat_1", "cat_2"))
        assert (item % 4 == user % 4).all(), "the pairs stay in the user's cluster"
        assert (table.features["cat_2"][0][item] == cat).all(), "an item id determines its other item features"
        assert (cat % 4 == item % 4).all()
        counts += np.bincount(item, minlength=50)
    assert np.corrcoef(counts, table.popularity)[0, 1] > 0.9, "the popularity is the generator's item frequency"


def test_generated_batches_get_k_sampled_rows_the_same_with_workers_and_per_rank() -> None:
    plain = list(_synthetic(distribution="popularity").train_batches(0, 0, 2))
    workers = list(_synthetic(distribution="popularity", workers=2).train_batches(0, 0, 2))
    other_rank = list(_synthetic(distribution="popularity").train_batches(0, 1, 2))
    assert all(b.labels.shape[0] == 48 and b.dense_features.shape[0] == 48 for b in plain)
    for a, b in zip(plain, workers, strict=True):
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    mine = [b.sparse_features.to_dict()["cat_1"].values()[32:] for b in plain]
    theirs = [b.sparse_features.to_dict()["cat_1"].values()[32:] for b in other_rank]
    assert all(not torch.equal(x, y) for x, y in zip(mine, theirs, strict=True)), "ranks draw their own negatives"
    again = list(_synthetic(distribution="popularity").train_batches(0, 0, 2))
    assert all(torch.equal(a.sparse_features.values(), b.sparse_features.values()) for a, b in zip(plain, again, strict=True))


@pytest.mark.parametrize(("distribution", "alpha"), [("popularity", 0.75), ("popularity", 1.0), ("uniform", 0.75)])
def test_sampled_frequencies_follow_popularity_to_the_alpha(distribution: str, alpha: float) -> None:
    n = 20
    popularity = 1.0 / np.arange(1, n + 1) ** 1.1  # Zipf
    table = ItemTable("item", np.arange(n), {"item": (np.arange(n), np.ones(n, np.int32))}, (), np.zeros((n, 0), np.float32), popularity)
    spec = FeatureSpec((), (SparseFeature("user", 4), SparseFeature("item", n)))
    sampler = NegativeSampler(NegativesConfig(num_negatives=256, distribution=distribution, alpha=alpha), table, spec, seed=3)
    counts = np.bincount(np.concatenate([sampler.draw((0, b)) for b in range(200)]), minlength=n)
    weights = popularity**alpha if distribution == "popularity" else np.ones(n)
    expected = counts.sum() * weights / weights.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 45.3, f"chi-square {chi2:.1f} over {n - 1} degrees of freedom (p < 0.001 above 45.3)"


def test_dssm_trains_with_sampled_negatives(make_cfg) -> None:
    from mlflow.tracking import MlflowClient

    from recsys_runner.__main__ import run

    cfg = make_cfg("experiment=dssm_negatives", "data.negatives.num_negatives=64", "checkpoint=none",
                   "train.num_steps=20")
    run(cfg)
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    recall = mlrun.data.metrics["eval/recall_at_10"]  # the positive among the whole catalogue: every id of the item column
    random = 10 / cfg.data.num_embeddings
    assert recall > 5 * random, f"recall@10 {recall:.3f} over the catalogue; random is {random:.3f}"


def test_negatives_bench_runs(tmp_path: Path) -> None:
    from recsys_runner.bench.retrieval import main

    result = main(["--quick", "--batch-size", "64", "--json", str(tmp_path / "b.json"), "distributed.device=cpu",
                   "data.num_embeddings=1000", "model.tower_layer_sizes=[16,8]"])
    assert sorted(result["regimes"]) == ["h_negatives_step", "h_sampler_share"]
    assert result["regimes"]["h_negatives_step"]["runner_samples_per_s"] > 0 and (tmp_path / "b.json").exists()


# --- accidental hits: a candidate that is the query's own item again is not a negative ---


def _dssm_on(data, **values: object):
    from recsys_runner.models.dssm import DSSM, DSSMConfig
    from tests.test_models import materialize

    torch.manual_seed(0)
    config = make(DSSMConfig, **{"embedding_dim": 8, "user_features": ["cat_0"], "item_features": ["cat_1", "cat_2"],
                                 "tower_layer_sizes": [16, 8], **values})
    return materialize(DSSM(config, features=data.features, dense_device=torch.device("cpu")))


def _without_hits(scores: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """numpy: ``scores [Q, C]`` with every ``c != q`` whose item is query ``q``'s own at ``-inf``."""
    out = scores.copy()
    for q in range(scores.shape[0]):
        for c in range(scores.shape[1]):
            if c != q and ids[c] == ids[q]:
                out[q, c] = -np.inf
    return out


@pytest.mark.parametrize(("logq", "remove"), [(False, True), (True, True), (True, False), (False, False)])
def test_dssm_training_logits_leave_out_every_other_copy_of_the_querys_own_item(logq: bool, remove: bool) -> None:
    """Generated batches repeat popular items (and sampled rows draw a batch's positives). With
    ``model.remove_accidental_hits=true`` the training logits equal the plain scores (less logQ) with every other copy
    of the query's own item at -inf, its own candidate kept; with ``false`` (the default) they are the plain scores."""
    from recsys_runner.models.dssm import first_ids

    data = _synthetic(num_negatives=16)
    model = _dssm_on(data, logq_correction=logq, remove_accidental_hits=remove)
    model.train()
    batch = next(iter(data.train_batches(0, 0, 1)))
    dense, sparse = batch.dense_features, batch.sparse_features
    ids = first_ids(sparse, "cat_1").numpy()
    queries = 32
    repeated = sum(int((ids[:queries] == ids[q]).sum()) > 1 for q in range(queries))
    drawn = sum(bool(np.isin(ids[q], ids[queries:])) for q in range(queries))
    assert repeated > 0 and drawn > 0, "the batch repeats positives and its sampled rows draw some"
    with torch.no_grad():
        got = model(dense, sparse).numpy()
        user, item = model.tower("user", dense, sparse), model.tower("item", dense, sparse)
    plain = (user[:queries] @ item.t() / model.temperature).numpy()
    shift = np.zeros(len(ids))
    if logq:  # the estimator has counted this batch: log p_c of each candidate, as the model subtracts it
        shift = -model.logq.gap.index_select(0, torch.as_tensor(ids) % model.logq.gap.shape[0]).clamp_min(1.0).log().numpy()
    want = (_without_hits(plain, ids) if remove else plain) - shift
    np.testing.assert_allclose(np.where(np.isfinite(want), 0, 1), np.where(np.isfinite(got), 0, 1))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.diag(got)).all(), "each query's own candidate stays"


def test_dssm_inbatch_recall_does_not_count_a_copy_of_the_positive_against_it() -> None:
    """In eval, a batch's rows that share an item score it identically; ``inbatch_recall@k`` counts every candidate scoring
    at least as high as the positive, so each copy cost its rows a place (a row whose item appears 4 times could never
    reach recall@1). The evaluation's scores leave the copies out, so the recall is the numpy recall over the other
    items; an exported model's scores (no evaluation) stay every pair's."""
    from recsys_runner.metrics.registry import MetricsConfig
    from recsys_runner.metrics.retrieval import RecallAtK
    from recsys_runner.models.dssm import first_ids
    from recsys_runner.train.corpus import use_ranking_protocol

    data = _synthetic(num_negatives=0)
    model = _dssm_on(data)
    model.eval()
    use_ranking_protocol(model, data, MetricsConfig(eval=[], train=[]), two_tower=False)  # what the evaluation does
    batch = next(iter(data.eval_batches(0, 1)))
    ids = first_ids(batch.sparse_features, "cat_1").numpy()
    assert len(set(ids.tolist())) < len(ids), "the eval batch repeats items"
    with torch.no_grad():
        scores = model(batch.dense_features, batch.sparse_features)
        user = model.tower("user", batch.dense_features, batch.sparse_features)
        item = model.tower("item", batch.dense_features, batch.sparse_features)
    plain = (user @ item.t() / model.temperature).numpy()
    for k in range(1, len(ids) + 1):  # every k: each row's rank, not only whether it is on top
        metric = RecallAtK(k)
        metric.update(scores, torch.arange(len(ids)))
        kept = _without_hits(plain, ids)
        ranks = np.array([(np.delete(kept[q], q) >= kept[q, q]).sum() for q in range(len(ids))])
        assert float(metric.compute()) == pytest.approx(float((ranks < k).mean()))
    model.in_batch_ranking = False
    with torch.no_grad():
        np.testing.assert_allclose(model(batch.dense_features, batch.sparse_features).numpy(), plain, rtol=1e-5, atol=1e-5)


def test_item_features_are_cut_to_max_values_as_the_training_rows_and_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A multi-hot item feature with ``max_values``: the catalogue's lists are cut as the training rows' are (the item tower
    sees an item as in training), and the rows cut are said in one line, not silently."""
    rows = _rows(200, 4).drop_columns(["hard"])
    tags = [[int(i) % 8] * (1 + int(i) % 4) for i in range(200)]
    pq.write_table(rows.append_column("tags", pa.array(tags, pa.list_(pa.int64()))), tmp_path / "train.parquet")
    items = _items()
    pq.write_table(items.append_column("tags", pa.array([[i % 8] * (1 + i % 4) for i in range(ITEMS)], pa.list_(pa.int64()))),
                   tmp_path / "items.parquet")
    sparse = [*SPARSE[:3], {"name": "tags", "num_embeddings": 8, "max_values": 2}]
    with caplog.at_level("INFO"):
        data = make(ParquetDataConfig, path=str(tmp_path / "train.parquet"), label="label", sparse=sparse, batch_size=32,
                    num_workers=0, items={"path": str(tmp_path / "items.parquet"), "id": "item_id", "features": ["tags"]}).build()
        table = data.item_table()
    assert table is not None
    assert table.features["tags"][1].tolist() == [min(1 + i % 4, 2) for i in range(ITEMS)]
    said = [r.getMessage() for r in caplog.records if "max_values" in r.getMessage()]
    assert len(said) == 1 and "data.sparse[tags] in 20 rows (max_values=2, the longest list 4)" in said[0], said
