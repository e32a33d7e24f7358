"""Full-corpus evaluation of a two-tower model and the logQ correction (docs/retrieval.md): the chunked ranking equals a
brute-force numpy computation, ``k`` beyond the catalogue is refused, 2 ranks give 1 rank's values, the frequency
estimator follows the paper's update, and logQ-corrected training changes full-corpus recall as it should."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from recsys_runner import evaluate
from recsys_runner.build import build
from recsys_runner.checkpoint.storage import list_checkpoints
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.generated.synthetic import SyntheticData
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.errors import ConfigError
from recsys_runner.metrics.corpus import corpus_ranks
from recsys_runner.metrics.registry import MetricsConfig, metric_entry
from recsys_runner.metrics.retrieval import Ranked, target_ranks
from recsys_runner.models.common import materialize
from recsys_runner.models.dssm import DSSM, DSSMConfig, first_ids
from recsys_runner.models.frequency import FrequencyEstimator
from recsys_runner.models.train_wrapper import TrainWrapper
from recsys_runner.train.corpus import CorpusEval
from tests.conftest import TINY, torchrun
from tests.test_evaluate import compose_entry
from tests.test_export import check_export, export_cfg  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[1]
CORPUS = ["model=dssm", "data=synthetic_retrieval", "model.corpus_chunk_rows=400",
          "model.eval_metrics=[inbatch_recall@10,recall@10,recall@50,ndcg@10,mrr,coverage@50]"]
"""A DSSM run on generated pairs whose catalogue (``data.num_embeddings=1000`` items in TINY) is scored in 3 chunks: on 2 ranks, one rank runs a padding forward."""
NAMES = ["recall@1", "recall@5", "ndcg@5", "mrr", "coverage@3"]


def _metrics(names: list[str], batches: list[Ranked]) -> dict[str, float]:
    out = {}
    for name in names:
        metric = metric_entry(name).factory(MetricsConfig(eval=names, train=[]))
        for ranked in batches:
            metric.update(ranked)
        out[name] = float(metric.compute())
    return out


def _brute_force(scores: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """The metrics of ``NAMES`` from the full score matrix, in numpy: ties count half, a target of -1 is a miss."""
    ranks = []
    for row, t in zip(scores, targets, strict=True):
        ranks.append(math.inf if t < 0 else float((row > row[t]).sum() + 0.5 * ((row == row[t]).sum() - 1)))
    r = np.array(ranks)
    top3 = np.argsort(-scores, axis=1, kind="stable")[:, :3]
    return {"recall@1": float((r < 1).mean()), "recall@5": float((r < 5).mean()),
            "ndcg@5": float(np.where(r < 5, 1 / np.log2(np.minimum(r, 1e9) + 2), 0).mean()),
            "mrr": float((1 / (r + 1)).mean()), "coverage@3": len(np.unique(top3)) / scores.shape[1]}


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 1000])
def test_corpus_metrics_equal_a_brute_force_numpy_computation(chunk_rows: int) -> None:
    g = torch.Generator().manual_seed(3)
    # small integer vectors: every score is exact in float32 and many tie (ties must count as hr@k counts them)
    queries, index = torch.randint(-2, 3, (40, 4), generator=g).float(), torch.randint(-2, 3, (57, 4), generator=g).float()
    targets = torch.randint(0, 57, (40,), generator=g)
    targets[[3, 17]] = -1  # not in the catalogue: a miss
    ranks, top = corpus_ranks(queries, index, targets, 5, chunk_rows)
    full = queries @ index.t()
    known = targets >= 0
    assert torch.equal(ranks[known], target_ranks(full[known], targets[known])) and torch.isinf(ranks[~known]).all()
    expected = _brute_force(full.numpy(), targets.numpy())
    got = _metrics(NAMES, [Ranked(ranks[:25], top[:25], 57), Ranked(ranks[25:], top[25:], 57)])
    assert {k: v for k, v in got.items() if k != "coverage@3"} == pytest.approx({k: v for k, v in expected.items() if k != "coverage@3"})
    # coverage: distinct scores, so the top 3 are one set whatever the tie-breaking
    q2, i2 = torch.randn(40, 8, generator=g), torch.randn(57, 8, generator=g)
    _, top2 = corpus_ranks(q2, i2, targets.clamp_min(0), 3, chunk_rows)
    cover = _metrics(["coverage@3"], [Ranked(torch.zeros(40), top2, 57)])["coverage@3"]
    assert cover == pytest.approx(_brute_force((q2.double() @ i2.double().t()).numpy(), targets.clamp_min(0).numpy())["coverage@3"])


def test_k_beyond_the_catalogue_or_no_catalogue_is_a_config_error(make_cfg) -> None:
    cfg = make_cfg(*CORPUS, "model.eval_metrics=[recall@10,recall@5000]", "tracking=none", "checkpoint=none")
    with pytest.raises(ConfigError, match=r"model.eval_metrics lists \['recall@5000'\], but each eval row ranks its true item among only 1000 "
                                          r"candidates \(the item catalogue's items\)"):
        build(validate(cfg)).close()

    class NoCatalogue:
        def item_table(self) -> None:
            return None

    from recsys_runner.tasks import InBatchSoftmaxTask
    with pytest.raises(ConfigError, match=r"model.eval_metrics lists \['mrr'\].*Fix: give the data its items"):
        CorpusEval.for_run(torch.nn.Linear(1, 1), cast(Any, NoCatalogue()), (InBatchSoftmaxTask(eval_metrics=("mrr",)),), MetricsConfig())


@pytest.mark.slow
def test_two_ranks_full_corpus_eval_equals_one_rank(tmp_path: Path) -> None:
    """torchrun, 2 ranks, tables split column-wise: each rank embeds its share of the catalogue's chunks (3 chunks, 2
    forwards each), gathers the index and ranks its share of the eval queries: 9 batches, 5 on rank 0 and 4 on rank 1,
    which steps with a stand-in, counted nowhere, while rank 0 ranks its last. The checkpoint evaluated on 1 rank gives
    the same in-batch recall, recall, ndcg, mrr and coverage: every eval query counted once on either."""
    uri = f"sqlite:///{tmp_path}/corpus.db"
    args = [*TINY, *CORPUS, "data.num_eval_rows=2304", "train.num_steps=8", "distributed.sharding_types=[column_wise]",
            f"tracking.uri={uri}", "tracking.experiment=corpus2", f"checkpoint.dir={tmp_path}/ck"]
    out = torchrun(*args, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    client = MlflowClient(tracking_uri=uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("corpus2").experiment_id])
    assert mlrun.data.tags["world_size"] == "2"
    (checkpoint,) = list_checkpoints(tmp_path / "ck")
    one = evaluate.run(compose_entry("evaluate", *[a for a in args if not a.startswith(("tracking.", "distributed.sharding"))],
                                     "tracking=none", f"load={checkpoint}"))
    two = {k: v for k, v in mlrun.data.metrics.items() if k.startswith("eval/")}
    assert set(one) == set(two) and 0 < one["eval/recall_at_50"] < 1 and 0 < one["eval/coverage_at_50"] <= 1
    assert one == pytest.approx(two, rel=1e-9)


def test_frequency_estimator_follows_the_papers_update() -> None:
    est = FrequencyEstimator(buckets=8, alpha=0.5)
    est.train()
    for ids in ([1, 2], [1], [1, 3], [1, 2, 2]):
        log_p = est(torch.tensor(ids))
    # id 1 every step: gaps 1, 1, 1 after its first sighting at step 1 (gap 1) → 1; id 2 at steps 1 and 4: 1, then
    # 0.5·1 + 0.5·3 = 2; id 3 first seen at step 3 → 3
    assert est.gap[[1, 2, 3]].tolist() == [1.0, 2.0, 3.0] and int(est.step) == 4
    assert log_p.tolist() == pytest.approx([0.0, -math.log(2), -math.log(2)])
    est.eval()
    assert est(torch.tensor([3])).tolist() == pytest.approx([-math.log(3)]) and int(est.step) == 4  # eval only reads
    assert set(est.state_dict()) == {"step", "last_seen", "gap"}  # checkpointed with the model


# --- the logQ correction: trained on Zipf pairs, ranked against the whole catalogue ---

ZIPF = {"batch_size": 256, "num_dense": 1, "num_sparse": 2, "num_embeddings": 4000, "num_train_rows": 256 * 120,
        "num_eval_rows": 2048, "user_item_clusters": 8, "id_skew": 3.0, "item_features": ["cat_1"]}
"""Generated (user, item) pairs: 400 items with Zipf-like popularity (the catalogue, ``data.item_table()``), users in 8
clusters; one pass of 120 steps of 256 rows trains in a few seconds."""


def _trained_recall(logq: bool, seed: int, steps: int = 120, source: str = "stream", **data_fields: object) -> dict[str, float]:
    """Full-corpus recall@50 of a DSSM trained with or without logQ (``p_c`` from ``source``): over all eval queries, the
    popular head's (the items holding half the traffic) and the tail's."""
    data = SyntheticData(make(SyntheticDataConfig, seed=seed, **{**ZIPF, **data_fields}))
    torch.manual_seed(seed)
    config = make(DSSMConfig, embedding_dim=16, user_features=["cat_0"], item_features=["cat_1"], tower_layer_sizes=[32, 16],
                  logq_correction=logq, logq_alpha=0.05, logq_source=source)
    model = materialize(DSSM(config, features=data.features, dense_device=torch.device("cpu")))
    catalogue = data.item_table()
    assert catalogue is not None
    model.use_catalogue(torch.from_numpy(catalogue.ids), torch.from_numpy(catalogue.popularity))
    wrapper = TrainWrapper(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for batch in list(data.train_batches(0, 0, 1))[:steps]:
        loss, _ = wrapper(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    table = data.item_table()
    assert table is not None
    with torch.no_grad():
        dense, sparse = table.rows(np.arange(len(table)), data.features.kjt_keys, data.features.dense_names)
        index = model.tower("item", dense, sparse)
        ranks, targets = [], []
        for batch in data.eval_batches(0, 1):
            ids = first_ids(batch.sparse_features, "cat_1")
            r, _ = corpus_ranks(model.tower("user", batch.dense_features, batch.sparse_features), index, ids, 1, 128)
            ranks.append(r)
            targets.append(ids)
    rank, target = torch.cat(ranks), torch.cat(targets)
    order = np.argsort(-table.popularity)
    head = torch.from_numpy(order[: int(np.searchsorted(np.cumsum(table.popularity[order]) / table.popularity.sum(), 0.5)) + 1])
    in_head = torch.isin(target, head)
    return {"all": float((rank < 50).double().mean()), "head": float((rank[in_head] < 50).double().mean()),
            "tail": float((rank[~in_head] < 50).double().mean())}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_logq_correction_raises_full_corpus_recall_and_trades_the_tail_for_it(seed: int) -> None:
    """Uncorrected in-batch softmax learns ``log p(i|u) − log p(i)`` (its negatives come ∝ popularity), which ranks a
    user's items by lift: popular items sink, the tail floats up. The correction restores ``log p(i|u)``: full-corpus
    recall@50 roughly doubles (the head's far more), and the tail's recall falls — the trade docs/retrieval.md describes.
    Measured (2 seeds): recall@50 0.15 → 0.31 and 0.13 → 0.33; tail 0.058 → 0.012 and 0.071 → 0.031."""
    plain, corrected = _trained_recall(False, seed), _trained_recall(True, seed)
    assert corrected["all"] > plain["all"] + 0.08, (plain, corrected)
    assert corrected["head"] > plain["head"] + 0.2, (plain, corrected)
    assert corrected["tail"] < plain["tail"], (plain, corrected)


@pytest.mark.slow
def test_export_writes_the_item_index_with_its_ids(make_cfg, export_cfg, tmp_path: Path) -> None:  # noqa: F811
    """``items.pt`` beside the towers: every catalogue item's id and its item-tower vector, listed in feature_spec.json;
    the vectors are what ``item_tower.pt2`` computes for those items."""
    spec, _, _ = check_export(make_cfg, export_cfg, tmp_path, "model=dssm", "data.num_embeddings=300")
    entry = spec["towers"]["items"]
    saved = torch.load(tmp_path / "export" / entry["file"])
    ids, vectors = saved["ids"], saved["vectors"]
    assert entry["file"] == "items.pt" and entry["id_feature"] == "cat_1" and torch.equal(ids, torch.arange(300))
    assert vectors.shape == (300, 32) and torch.allclose(vectors.norm(dim=1), torch.ones(300), atol=1e-5)
    program = torch.export.load(str(tmp_path / "export" / spec["towers"]["item"]["file"])).module()
    keys = [f["name"] for f in spec["towers"]["item"]["sparse_features"]]
    assert keys == ["cat_1"]
    lengths = torch.ones(1, 300, dtype=torch.int64)
    torch.testing.assert_close(program(torch.zeros(300, 0), ids, lengths), vectors, atol=1e-5, rtol=1e-5)


def test_faiss_index_reports_its_recall_against_exact() -> None:
    """``model.index=faiss``: the metrics measure the HNSW search's top k, and ``ann_recall@k`` the share of the exact
    top k it finds (1 for the exact index)."""
    from recsys_runner.train.corpus import hnsw_index, searched

    g = torch.Generator().manual_seed(5)
    index = torch.nn.functional.normalize(torch.randn(3000, 16, generator=g), dim=1)
    targets = torch.randint(0, 3000, (200,), generator=g)
    queries = torch.nn.functional.normalize(torch.randn(200, 16, generator=g) + 2 * index[targets], dim=1)
    ranks, top = corpus_ranks(queries, index, targets, 10, 512)
    approx = searched(hnsw_index(index), queries, targets, top, 3000)
    names = ["recall@10", "ann_recall@10", "coverage@10"]
    exact, ann = _metrics(names, [Ranked(ranks, top, 3000)]), _metrics(names, [approx])
    assert exact["ann_recall@10"] == 1.0 and 0.8 < ann["ann_recall@10"] < 1.0 + 1e-12
    assert ann["recall@10"] <= exact["recall@10"] + 1e-12 and ann["recall@10"] > exact["recall@10"] - 0.1
    hit = torch.isfinite(approx.ranks)
    assert torch.equal(approx.top[hit].gather(1, approx.ranks[hit].long().view(-1, 1)).view(-1), targets[hit])
