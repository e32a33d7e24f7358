"""Next-item prediction (model=sasrec, block sasrec or hstu): hr@k / ndcg@k exact over the full item table and across
ranks, the next-item task through the TrainWrapper, training that beats the popularity ranking. (The 2-rank run with
the item table sharded column-wise is in tests/test_exclude_seen.py: one launch that checks exclude_seen too.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.__main__ import run
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
from recsys_runner.errors import ConfigError
from recsys_runner.metrics.registry import MetricsConfig, build_eval_metrics, higher_is_better, metric_entry
from recsys_runner.metrics.retrieval import RecallAtK, target_ranks
from recsys_runner.metrics.tasks import eval_metric_keys
from recsys_runner.models.common import materialize
from recsys_runner.models.fixed_sizes import distinct_positives
from recsys_runner.models.sasrec import SASRec, SASRecConfig, _column_vectors
from recsys_runner.models.sequence import History
from recsys_runner.models.train_wrapper import TrainWrapper
from recsys_runner.tasks import NextItemTask
from tests.conftest import free_port
from tests.rank_ranking import RANKING, rank_scores, ranking_values, ranking_worker

SMALL = [
    "model=sasrec", "data=synthetic_sequences", "distributed.device=cpu", "checkpoint=none",
    "data.batch_size=128", "data.num_items=500", "data.num_categories=20", "data.num_users=2000", "data.max_len=20",
    "data.num_train_rows=65536", "data.num_eval_rows=2048", "train.num_steps=150", "train.log_every_steps=50",
    "train.eval_every_steps=null", "model.embedding_dim=32", "optim=adagrad", "optim.lr=0.05",
]
"""A next-item run of ~5-10 s on 2 CPU cores: 500 items, histories of up to 20 events, 150 steps of 128 rows."""


def test_ranks_count_strictly_higher_items_and_half_the_ties() -> None:
    scores = torch.tensor([[0.9, 0.5, 0.7, 0.1],    # target 1: 0.9 and 0.7 above → rank 2
                           [0.3, 0.3, 0.3, 0.3],    # target 0: all tied → 0 above + 3 ties / 2 = 1.5
                           [0.2, 0.8, 0.8, 0.1],    # target 2: 1 tie → 0.5
                           [0.1, 0.2, 0.3, 0.4]])   # target 3: on top → 0
    targets = torch.tensor([1, 0, 2, 3])
    assert target_ranks(scores, targets).tolist() == [2.0, 1.5, 0.5, 0.0]
    metrics = build_eval_metrics(RANKING, torch.device("cpu"))
    metrics.update(scores[:2], targets[:2])
    metrics.update(scores[2:], targets[2:])
    out = {k: float(v) for k, v in metrics.compute().items()}
    ranks = [2.0, 1.5, 0.5, 0.0]
    assert out["hr@1"] == pytest.approx(2 / 4) and out["hr@3"] == pytest.approx(1.0)
    assert out["ndcg@3"] == pytest.approx(sum(1 / math.log2(r + 2) for r in ranks) / 4)
    assert out["ndcg@10"] == out["ndcg@3"]
    assert higher_is_better("eval/hr_at_10") and higher_is_better("eval/ndcg_at_10")
    assert eval_metric_keys(MetricsConfig(), (NextItemTask(),)) == ["eval/hr_at_10", "eval/ndcg_at_10", "eval/hr_at_50"]


def test_a_nan_score_of_the_target_is_a_miss_never_a_hit() -> None:
    """A NaN compares false with everything: counted as it was, a row whose target scored NaN (a diverged model, an
    overflow under reduced precision) had no item above it and -1 ties, rank -0.5: a hit at every k, ndcg 1.71 and mrr 2.
    It is a miss (rank inf), in the full-table ranking, the chunked corpus ranking and the sampled one alike."""
    from recsys_runner.metrics.corpus import corpus_ranks

    nan = float("nan")
    scores = torch.tensor([[nan, 0.5, 0.7, 0.1], [nan, nan, nan, nan], [0.2, nan, 0.8, 0.1]])
    targets = torch.tensor([0, 2, 2])
    assert target_ranks(scores, targets).tolist() == [math.inf, math.inf, 0.0]  # NaN items elsewhere rank nothing
    metrics = build_eval_metrics(MetricsConfig(eval=["hr@1", "ndcg@10", "mrr"], train=[]), torch.device("cpu"))
    metrics.update(scores, targets)
    out = {k: float(v) for k, v in metrics.compute().items()}
    assert out == pytest.approx({"hr@1": 1 / 3, "ndcg@10": 1 / 3, "mrr": 1 / 3})
    queries = torch.tensor([[nan, 1.0], [1.0, 0.0]])
    index = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    for chunk_rows in (1, 2, 3):
        ranks, _ = corpus_ranks(queries, index, torch.tensor([1, 0]), 2, chunk_rows)
        assert ranks.tolist() == [math.inf, 0.0]
    in_batch = RecallAtK(1)
    in_batch.update(scores[:, :3], torch.tensor([0, 1, 2]))
    assert float(in_batch.compute()) == pytest.approx(1 / 3)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"eval": ["hr@10", "auc"]}, "mixes pointwise metrics"),
    ({"eval": ["ndcg@0"]}, r"needs k >= 1, e.g. ndcg@10"),
    ({"eval": ["hr"]}, r"unknown metric 'hr'.*hr@<k>, ndcg@<k>"),
])
def test_ranking_metric_config_errors(kwargs: dict[str, list[str]], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MetricsConfig(**kwargs)
    assert metric_entry("ndcg@5").inputs == "ranking"


@pytest.mark.slow
def test_two_ranks_ranking_metrics_equal_one_process_over_both_halves(tmp_path: Path) -> None:
    mp.spawn(ranking_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    reference = ranking_values([rank_scores(0), rank_scores(1)])
    alone = [ranking_values([rank_scores(r)]) for r in range(2)]
    for r in range(2):
        values = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert values == pytest.approx(reference, rel=1e-12)
    assert (alone[0]["ndcg@3"] + alone[1]["ndcg@3"]) / 2 != pytest.approx(reference["ndcg@3"], rel=1e-6), "uneven shares"


def test_train_wrapper_takes_the_models_targets_and_eval_scores_the_whole_table() -> None:
    data = make(SyntheticSequencesConfig, batch_size=16, num_items=60, num_categories=4, num_users=30, max_len=6,
                num_train_rows=64, num_eval_rows=64).for_model(SASRecConfig().data_needs()).build()
    torch.manual_seed(0)
    model = SASRec(make(SASRecConfig, embedding_dim=8, block="hstu"), features=data.features)
    model.arch.to_empty(device=torch.device("cpu"))
    for p in model.arch.parameters():
        torch.nn.init.normal_(p, std=0.1)
    wrapper = TrainWrapper(model, features=data.features)
    batch = data.batch(0, 0)
    loss, (_, logits, positives) = wrapper(batch)
    lengths = batch.sparse_features["hist_item_id"].lengths()
    assert logits.shape[0] == int(lengths.sum()) + 16, "one position per event plus the start token, per row"
    distinct = int(positives.max()) + 1
    assert logits.shape[1] == min(logits.shape[0], 60) and torch.isfinite(loss), "K = min(P, N) columns, a bound known on the host"
    assert torch.isfinite(logits[:, :distinct]).all() and torch.isneginf(logits[:, distinct:]).all(), "no item past the distinct ones"
    wrapper.eval()
    with torch.no_grad():
        _, (_, scores, targets) = wrapper(batch)
    assert scores.shape == (16, 60) and torch.equal(targets, batch.sparse_features["item_id"].values())
    table = model._table
    assert table is not None and table.shape == (60, 8)
    expected = model.arch.ec.embeddings["item"].weight  # type: ignore[union-attr,index]
    assert torch.equal(table, expected), "ids 0..N-1 looked up through the model's own table"
    wrapper.train()
    assert model._table is None


def _unique_logits(model: SASRec, states: torch.Tensor, history: History, candidate: torch.Tensor,
                   sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled softmax as it was computed before it took fixed sizes: the real positions by a boolean mask, the
    candidates by ``torch.unique`` (each a device-to-host sync on a GPU)."""
    length = history.mask.shape[1]
    positions = torch.arange(length + 1).unsqueeze(0)
    last, valid = positions == history.lengths.unsqueeze(1), positions <= history.lengths.unsqueeze(1)
    ids = sparse["hist_item_id"].to_padded_dense(desired_length=length, padding_value=0)
    ids = torch.where(last, sparse["item_id"].values().unsqueeze(1), F.pad(ids, (0, 1)))[valid]
    vectors = history.values[..., : model.dim]
    vectors = torch.where(last.unsqueeze(2), candidate.unsqueeze(1), F.pad(vectors, (0, 0, 0, 1)))[valid]
    distinct, positives, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    first = torch.full_like(distinct, ids.shape[0]).scatter_reduce(0, positives, torch.arange(ids.shape[0]), reduce="amin")
    return model.score(states[valid], vectors[first], shift=torch.log(counts.to(states.dtype) / ids.shape[0])), positives


@pytest.mark.parametrize("num_items", [60, 5000])
def test_the_fixed_size_sampled_softmax_is_the_unique_one(num_items: int) -> None:
    """Same states: the same positives and, on the distinct items' columns, the same logits, bit for bit; the columns past
    them are -inf, so the loss is the same (60 items: fewer than the positions, the bound K = N; 5000: K = P)."""
    data = make(SyntheticSequencesConfig, batch_size=32, num_items=num_items, num_categories=4, num_users=30, max_len=12,
                num_train_rows=64, num_eval_rows=64, empty_fraction=0.2).for_model(SASRecConfig().data_needs()).build()
    torch.manual_seed(0)
    model = materialize(SASRec(make(SASRecConfig, embedding_dim=8, dropout=0.0), features=data.features))
    assert isinstance(model, SASRec)
    sparse = data.batch(0, 0).sparse_features
    embedded = model.arch(sparse)
    history = embedded.histories["hist"]
    states = model.encode(history)
    logits, positives = model.sampled_logits(states, history, embedded.candidates["item_id"], sparse)
    expected, expected_positives = _unique_logits(model, states, history, embedded.candidates["item_id"], sparse)
    distinct = expected.shape[1]
    assert logits.shape == (expected.shape[0], min(expected.shape[0], num_items)) and torch.equal(positives, expected_positives)
    assert torch.equal(logits[:, :distinct], expected) and torch.isneginf(logits[:, distinct:]).all()
    assert F.cross_entropy(logits, positives).item() == pytest.approx(F.cross_entropy(expected, positives).item(), rel=1e-6)
    ids = torch.tensor([7, 3, 7, 7, 0, 3])
    slots, counts, first = distinct_positives(ids, 100)
    assert slots.tolist() == [2, 1, 2, 2, 0, 1] and counts.tolist() == [1, 2, 3, 0, 0, 0] and first.tolist() == [4, 1, 0, 5, 5, 5]


def test_the_sampled_logits_shift_and_columns_are_the_plain_ones() -> None:
    """``score`` with a ``shift`` (one ``addmm``) is the plain scores less the shift, to float rounding, ``-inf`` where
    the shift is ``+inf``; the columns' vectors read for their positions alone are the padded targets' rows, exactly."""
    torch.manual_seed(0)
    data = make(SyntheticSequencesConfig, batch_size=16, num_items=40, num_categories=4, num_users=30, max_len=12,
                num_train_rows=32, num_eval_rows=32, empty_fraction=0.2).for_model(SASRecConfig().data_needs()).build()
    model = materialize(SASRec(make(SASRecConfig, embedding_dim=8, dropout=0.0), features=data.features))
    assert isinstance(model, SASRec)
    states, items = torch.randn(20, 8), torch.randn(6, 8)
    shift = torch.tensor([0.5, -1.0, float("inf"), 0.0, 2.0, float("inf")])
    shifted, plain = model.score(states, items, shift=shift), model.score(states, items) - shift
    assert torch.isneginf(shifted[:, [2, 5]]).all()
    torch.testing.assert_close(shifted[:, [0, 1, 3, 4]], plain[:, [0, 1, 3, 4]], rtol=1e-6, atol=1e-5)
    events, lengths, candidate = torch.randn(5, 7, 3), torch.tensor([0, 7, 3, 1, 5]), torch.randn(5, 3)
    last = torch.arange(8).unsqueeze(0) == lengths.unsqueeze(1)
    targets = torch.where(last.unsqueeze(2), candidate.unsqueeze(1), F.pad(events, (0, 0, 0, 1))).flatten(0, 1)
    at = torch.tensor([0, 8, 15, 17, 19, 24, 25, 33, 37, 37])  # every row's last position, some events, a repeat
    assert torch.equal(_column_vectors(events, lengths, candidate, at), targets[at])


def test_sasrec_config_errors_name_the_key_and_the_fix(make_cfg) -> None:
    from recsys_runner.build import build

    with pytest.raises(ConfigError, match=r"model.item_feature='user_id' is not a feature of data.sequences.hist .*Fix:"):
        build(validate(make_cfg(*SMALL, "tracking=none", "model.item_feature=user_id", tiny=False))).close()
    criteo_shaped = make(SyntheticDataConfig, num_dense=2, num_sparse=3, num_embeddings=50).build().features
    with pytest.raises(ConfigError, match=r"SASRec attends over a user's history, but the data has no sequence group. Fix:"):
        SASRec(SASRecConfig(), features=criteo_shaped)
    with pytest.raises(ConfigError, match=r"model.num_heads=3 must divide model.embedding_dim=16"):
        make(SASRecConfig, embedding_dim=16, num_heads=3)
    with pytest.raises(ConfigError, match=r"model.block='gru' must be one of \['sasrec', 'hstu'\]"):
        make(SASRecConfig, block="gru")


def popularity_hr_at_10(cfg: DictConfig) -> float:
    """HR@10 of ranking every item by how often it occurred in the run's training rows (history events and next items),
    on the run's eval rows, with the same tie rule as the model's metric."""
    spec = validate(cfg)
    data = spec.data.for_model(spec.model.data_needs()).build()
    num_items = int(cfg.data.num_items)
    counts = torch.zeros(num_items, dtype=torch.float64)
    for batch in list(data.train_batches(0, 0, 1))[: int(cfg.train.num_steps)]:
        for key in ("item_id", "hist_item_id"):
            counts += torch.bincount(batch.sparse_features[key].values(), minlength=num_items).double()
    hits = rows = 0.0
    for batch in data.eval_batches(0, 1):
        targets = batch.sparse_features["item_id"].values()
        hits += float((target_ranks(counts.expand(targets.shape[0], -1), targets) < 10).sum())
        rows += targets.shape[0]
    return hits / rows


@pytest.mark.parametrize("block", ["sasrec", "hstu"])
def test_sasrec_beats_the_popularity_ranking(make_cfg, mlflow_uri: str, block: str) -> None:
    cfg = make_cfg(*SMALL, f"model.block={block}", tiny=False)
    objective = run(cfg)
    client = MlflowClient(tracking_uri=mlflow_uri)
    (logged,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    metrics = logged.data.metrics
    assert {"eval/hr_at_10", "eval/ndcg_at_10", "eval/hr_at_50", "train/loss"} <= set(metrics)
    assert objective == pytest.approx(metrics["eval/hr_at_10"])
    popularity = popularity_hr_at_10(cfg)
    print(f"{block}: eval/hr_at_10={objective:.4f} popularity={popularity:.4f} eval/ndcg_at_10={metrics['eval/ndcg_at_10']:.4f}")
    assert objective > popularity + 0.3, (objective, popularity)
    assert metrics["eval/hr_at_50"] >= metrics["eval/hr_at_10"] >= metrics["eval/ndcg_at_10"] > 0
