"""model.eval_negatives=N: each eval row's true item ranked against N items sampled uniformly from the item table less the
row's history and target, with a fixed seed: deterministic, the same whatever the batching, never a seen item. For a
two-tower model (dssm) the same over its catalogue, less the query's history features and ``data.items.seen``: the
metrics equal numpy's ranking of its towers' vectors over the drawn items, and an N above the unseen items is refused
when the run is built, naming the largest N that fits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recsys_runner import evaluate
from recsys_runner.configurable import make
from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
from recsys_runner.errors import ConfigError
from recsys_runner.metrics.registry import MetricsConfig, build_eval_metrics
from recsys_runner.models.dssm import DSSMConfig
from recsys_runner.models.ranking_eval import distinct_seen, sampled_negatives, seen_ids
from recsys_runner.models.sasrec import SASRec, SASRecConfig
from recsys_runner.models.train_wrapper import TrainWrapper
from recsys_runner.train.corpus import sampled_ranks
from tests.test_evaluate import compose_entry
from tests.test_exclude_seen import NUM_ITEMS, as_tower_keys, brute_force, tower_rows, train_two_tower

NAMES = ["hr@1", "hr@10", "ndcg@10", "mrr"]


def test_negatives_are_distinct_unseen_and_a_function_of_the_row_alone() -> None:
    g = torch.Generator().manual_seed(1)
    history, lengths = torch.randint(0, 50, (64, 10), generator=g), torch.randint(0, 11, (64,), generator=g)
    targets = torch.randint(0, 50, (64,), generator=g)
    seen = seen_ids(history, lengths, targets)
    negatives = sampled_negatives(seen, targets, 50, 30)
    assert negatives.shape == (64, 30) and int(negatives.min()) >= 0 and int(negatives.max()) < 50
    for row in range(64):
        picked = set(negatives[row].tolist())
        assert len(picked) == 30, "without replacement"
        assert not picked & (set(history[row, : lengths[row]].tolist()) | {int(targets[row])}), "never a seen item"
    assert torch.equal(sampled_negatives(seen, targets, 50, 30), negatives), "deterministic"
    assert torch.equal(sampled_negatives(seen[40:], targets[40:], 50, 30), negatives[40:]), "whatever the batch around it"
    assert not torch.equal(sampled_negatives(seen, targets, 50, 30, seed=1), negatives), "the seed matters"
    wider = seen_ids(torch.cat([history, torch.zeros(64, 5, dtype=torch.long)], dim=1), lengths, targets)
    assert torch.equal(sampled_negatives(wider, targets, 50, 30), negatives), "whatever the batch's longest history"


def test_negatives_are_uniform_over_the_unseen_items() -> None:
    targets = torch.arange(4000) % 7  # only the target is seen
    seen = targets.view(-1, 1).clone()
    negatives = sampled_negatives(seen, targets + 1000 * (torch.arange(4000) // 7), 20, 5)  # distinct rows, distinct keys
    counts = torch.bincount(negatives.flatten(), minlength=20).double()
    assert counts.sum() == 20000 and float(counts.std() / counts.mean()) < 0.1, counts


def _model_and_data(batch_size: int, eval_negatives: int) -> tuple[TrainWrapper, object]:
    data = make(SyntheticSequencesConfig, batch_size=batch_size, num_items=120, num_categories=4, num_users=40, max_len=12,
                num_train_rows=96, num_eval_rows=96).for_model(SASRecConfig().data_needs()).build()
    torch.manual_seed(0)
    model = SASRec(make(SASRecConfig, embedding_dim=8, eval_negatives=eval_negatives), features=data.features)
    model.arch.to_empty(device=torch.device("cpu"))
    torch.manual_seed(0)
    for p in model.arch.parameters():
        torch.nn.init.normal_(p, std=0.3)
    wrapper = TrainWrapper(model, features=data.features)
    wrapper.eval()
    return wrapper, data


def _values(wrapper: TrainWrapper, data: object) -> dict[str, float]:
    metrics = build_eval_metrics(MetricsConfig(eval=NAMES, train=[]), torch.device("cpu"))
    with torch.no_grad():
        for batch in data.eval_batches(0, 1):  # type: ignore[attr-defined]
            _, (_, scores, targets) = wrapper(batch)
            assert scores.shape[1] == 1 + 20 and not bool(targets.any()), "column 0 is the true item"
            metrics.update(scores, targets)
    return {k: float(v) for k, v in metrics.compute().items()}


def test_sampled_metrics_are_deterministic() -> None:
    wrapper, data = _model_and_data(32, 20)
    first = _values(wrapper, data)
    torch.manual_seed(12345)  # the draw reads no global generator
    torch.rand(7)
    assert _values(wrapper, data) == first, "the same metric twice"
    other, other_data = _model_and_data(32, 20)
    assert _values(other, other_data) == first, "a model built again: the same negatives"
    assert 0 < first["hr@10"] < 1 and first["hr@1"] <= first["hr@10"]


def test_sampled_scores_are_the_models_scores_of_those_items() -> None:
    wrapper, data = _model_and_data(32, 20)
    model = wrapper.model
    assert isinstance(model, SASRec)
    batch = next(iter(data.eval_batches(0, 1)))  # type: ignore[attr-defined]
    with torch.no_grad():
        _, (_, sampled, _) = wrapper(batch)
        model.eval_negatives = 0
        _, (_, full, targets) = wrapper(batch)
    history = batch.sparse_features["hist_item_id"]
    seen = seen_ids(history.to_padded_dense(desired_length=12, padding_value=-1), history.lengths(), targets)
    items = torch.cat([targets.view(-1, 1), sampled_negatives(seen, targets, 120, 20)], dim=1)
    assert torch.allclose(sampled, full.gather(1, items), atol=1e-4)


def test_more_negatives_than_unseen_items_is_a_config_error() -> None:
    data = make(SyntheticSequencesConfig, batch_size=8, num_items=60, num_categories=4, num_users=20, max_len=12,
                num_train_rows=64, num_eval_rows=64).for_model(SASRecConfig().data_needs()).build()
    with pytest.raises(ConfigError, match=r"model.eval_negatives=48 .*leaving 47 to sample from. Fix: model.eval_negatives<=47"):
        SASRec(make(SASRecConfig, embedding_dim=8, eval_negatives=48), features=data.features)
    with pytest.raises(ConfigError, match=r"coverage@<k> counts items of the whole table"):
        make(SASRecConfig, eval_negatives=10, eval_metrics=["hr@10", "coverage@10"])


def test_the_seen_set_not_its_listing_decides_the_draw() -> None:
    """A two-tower query's seen items come from several features: the same set, listed in another order, repeated, with
    the target among them or wider padding, draws the same negatives."""
    targets = torch.tensor([3, 7])
    seen = torch.tensor([[5, 9, 1, -1], [2, 2, 8, 7]])
    relisted = torch.tensor([[1, -1, 5, 9, 9, 3], [8, 7, 2, -1, -1, -1]])
    first, second = distinct_seen(seen, targets), distinct_seen(relisted, targets)
    assert first.tolist() == [[1, 5, 9, 3], [2, 8, 7, 7]]
    assert torch.equal(sampled_negatives(first, targets, 40, 12), sampled_negatives(second, targets, 40, 12))
    negatives = sampled_negatives(first, targets, 40, 12)
    assert not set(negatives[0].tolist()) & {1, 5, 9, 3} and not set(negatives[1].tolist()) & {2, 8, 7}


@pytest.mark.parametrize("chunk_rows", [1, 13, 1000])
def test_sampled_ranks_count_the_drawn_items_above_the_target(chunk_rows: int) -> None:
    """The corpus pass's sampled ranking, in blocks of queries: the target's rank among its drawn rows (ties half), ``inf``
    for a target outside the catalogue; a query with too few unseen rows is a ConfigError naming the largest N."""
    g = torch.Generator().manual_seed(2)
    queries, index = torch.randint(-2, 3, (25, 4), generator=g).float(), torch.randint(-2, 3, (40, 4), generator=g).float()
    targets = torch.randint(0, 40, (25,), generator=g)
    targets[4] = -1
    seen = torch.randint(-1, 40, (25, 6), generator=g)
    ranked = sampled_ranks(queries, index, targets, seen, 20, 5, chunk_rows, ["hist"])
    drawn = sampled_negatives(distinct_seen(seen, targets), targets, 40, 20)
    for q in range(25):
        if q == 4:
            assert ranked.ranks[q] == float("inf")
            continue
        row = (index[torch.cat([targets[q:q + 1], drawn[q]])] @ queries[q]).numpy()
        assert float(ranked.ranks[q]) == float((row[1:] > row[0]).sum() + 0.5 * (row[1:] == row[0]).sum())
    assert ranked.top.shape == (25, 5) and ranked.num_items == 40
    crowded = torch.arange(30).repeat(25, 1)  # every query has seen rows 0-29: 9 left besides its own (or 10 without one)
    with pytest.raises(ConfigError, match=r"an eval query has seen 30 of them besides its own item \(hist\), leaving 9 to draw "
                                          r"from. Fix: model.eval_negatives<=9"):
        sampled_ranks(queries, index, (targets % 10) + 30, crowded, 10, 5, chunk_rows, ["hist"])


def test_two_tower_eval_negatives_config_errors_name_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"model.eval_negatives must be >= 0 .*Fix: model.eval_negatives=0"):
        make(DSSMConfig, eval_negatives=-1)
    with pytest.raises(ConfigError, match=r"lists only in-batch ones, which it does not change. Fix: add recall@<k>"):
        make(DSSMConfig, eval_negatives=10)
    with pytest.raises(ConfigError, match=r"coverage@<k> counts catalogue items .*Fix: remove coverage@<k>"):
        make(DSSMConfig, eval_negatives=10, eval_metrics=["recall@10", "coverage@10"])
    with pytest.raises(ConfigError, match=r"model.index=faiss ranks an approximate search's top k .*Fix: model.index=exact"):
        make(DSSMConfig, eval_negatives=10, eval_metrics=["recall@10"], index="faiss")


@pytest.fixture(scope="module")
def two_tower(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path, tuple[np.ndarray, ...], int]:
    """dssm trained a few steps on tests/test_exclude_seen.py's generated files (a history feature and data.items.seen):
    its overrides, checkpoint, :func:`tower_rows` and the most items an eval query has seen besides its own."""
    overrides, checkpoint = train_two_tower(tmp_path_factory.mktemp("two_tower_sampled"))
    queries, items, targets, seen = tower_rows(overrides, checkpoint)
    most = max(len(set(s.tolist()) - {int(t)}) for t, s in zip(targets, seen, strict=True))
    return overrides, checkpoint, (queries, items, targets, seen), most


def test_two_tower_sampled_metrics_equal_numpy_over_the_drawn_unseen_items(two_tower) -> None:
    """N = the most that every query leaves: the query with the most seen items draws every item it has not seen. The
    values (eval batches of 32) equal numpy's ranking over the items drawn for all queries in one batch, and never a
    seen item is drawn."""
    overrides, checkpoint, (queries, items, targets, seen), most = two_tower
    n = NUM_ITEMS - 1 - most
    got = evaluate.run(compose_entry("evaluate", *overrides, f"load={checkpoint}", f"model.eval_negatives={n}"))

    padded = torch.full((len(seen), max(len(s) for s in seen)), -1, dtype=torch.long)
    for r, s in enumerate(seen):
        padded[r, : len(s)] = torch.from_numpy(s)
    target = torch.from_numpy(targets)
    drawn = sampled_negatives(distinct_seen(padded, target), target, NUM_ITEMS, n).numpy()  # all queries in one batch
    for t, s, row in zip(targets, seen, drawn, strict=True):
        assert len(set(row.tolist())) == n and not set(row.tolist()) & ({int(t)} | set(s.tolist())), "unseen, distinct"
    candidates = np.concatenate([targets[:, None], drawn], axis=1)
    scores = np.einsum("qo,qco->qc", queries, items[candidates])
    expected = as_tower_keys(brute_force(scores, np.zeros(len(targets), np.int64), [np.zeros(0, np.int64)] * len(targets)))
    assert got == pytest.approx(expected, rel=1e-12)
    assert got["eval/recall_at_10"] > 0


def test_two_tower_more_negatives_than_unseen_items_is_refused_when_built(two_tower) -> None:
    overrides, checkpoint, _, most = two_tower
    free = NUM_ITEMS - 1 - most
    with pytest.raises(ConfigError, match=rf"model.eval_negatives={free + 1} ranks each eval query's item against {free + 1} "
                                          rf"catalogue items it has not seen, but the catalogue has {NUM_ITEMS} items and an eval "
                                          rf"query has seen {most} of them besides its own item \(hist, seen\), leaving {free} "
                                          rf"to draw from. Fix: model.eval_negatives<={free}"):
        evaluate.run(compose_entry("evaluate", *overrides, f"load={checkpoint}", f"model.eval_negatives={free + 1}"))
