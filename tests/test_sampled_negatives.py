"""model.eval_negatives=N: each eval row's true item ranked against N items sampled uniformly from the item table less the
row's history and target, with a fixed seed: deterministic, the same whatever the batching, never a seen item."""

from __future__ import annotations

import pytest
import torch

from recsys_runner.configurable import make
from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
from recsys_runner.errors import ConfigError
from recsys_runner.metrics.registry import MetricsConfig, build_eval_metrics
from recsys_runner.models.common import TrainWrapper
from recsys_runner.models.ranking_eval import sampled_negatives, seen_ids
from recsys_runner.models.sasrec import SASRec, SASRecConfig

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
