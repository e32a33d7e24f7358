"""A next-item model's eval ranks the items predict and the served model may recommend (``candidate_items``: the id
mapping's items), never the item table's OOV rows, under every protocol: full table, exclude-seen, sampled negatives."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.data.sequences.mapping import load_mapping
from recsys_runner.scoring_topk import item_names
from recsys_runner.train.corpus import inner_with
from tests.test_evaluate import compose_entry
from tests.test_sequence_rows import distinct_times_log, run_sequences

WIDTH, OOV_ROWS = 8, 16


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``data sequences`` rows whose item table has 16 OOV rows after the mapping's items."""
    root = tmp_path_factory.mktemp("eval_candidates")
    return run_sequences(root, distinct_times_log(num_users=30, seed=5), "rows", "--max-len", "6", "--oov-buckets", str(OOV_ROWS))


def _oov_rows(sign: float) -> torch.Tensor:
    """The 16 OOV rows' vectors, ``sign × 1e4 × ±e_i``: with ``sign`` 1 one of them outscores every real item for any
    state (raw dot products), so the target of every row; with 0 they are zeros."""
    return sign * 1e4 * torch.cat([torch.eye(WIDTH), -torch.eye(WIDTH)])


@pytest.mark.parametrize("protocol", [[], ["metrics.exclude_seen=true"], ["model.eval_negatives=5", "model.eval_metrics=[hr@3,ndcg@3,mrr]"]],
                         ids=["full_table", "exclude_seen", "sampled"])
def test_eval_ranks_only_the_candidate_items_so_an_oov_row_that_outscores_every_target_changes_nothing(
        rows: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, protocol: list[str]) -> None:
    spec = validate(compose_entry(
        "config", "model=sasrec", f"model.embedding_dim={WIDTH}", "model.normalize=false", "data=parquet",
        f"data.path={rows}/train.parquet", f"data.eval_path={rows}/eval.parquet", "data.batch_size=16", "distributed.device=cpu",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.experiment=eval_candidates", f"checkpoint.dir={tmp_path}/ck", *protocol))
    c = build(spec)
    try:
        evaluator = c.loop.evaluator
        model = inner_with(evaluator.model, "use_candidates")
        items = len(load_mapping(str(rows))["item"])
        assert model.num_items == items + OOV_ROWS
        # the eval's candidates are predict's (and the served model's): one definition, the mapping's items
        assert model.candidates == items == item_names([str(rows / "eval.parquet")], "item", model.num_items, say=False).size
        real: Callable[..., torch.Tensor] = model.item_table

        def evaluate_with_oov(sign: float) -> dict[str, float]:
            def table(sparse: object) -> torch.Tensor:
                out = real(sparse).clone()
                out[items:] = _oov_rows(sign).to(out.dtype)
                return out

            monkeypatch.setattr(model, "item_table", table)
            return evaluator.evaluate()

        outscoring, plain = evaluate_with_oov(1.0), evaluate_with_oov(0.0)
        assert outscoring == plain
        assert 0 < max(v for k, v in plain.items() if k.startswith("eval/hr_at_")) and 0 < plain["eval/mrr"] < 1  # hr@50, or hr@3 of 6
        batch = next(iter(c.loop.data.eval_batches(0, 1)))
        evaluator.model.eval()
        with torch.no_grad():
            _, (_, scores, targets) = evaluator.model(batch)
        evaluator.model.train()
        assert scores.shape[1] == (6 if "model.eval_negatives=5" in protocol else items)
    finally:
        c.close()


def test_an_oov_target_is_a_miss_and_an_oov_history_id_masks_nothing() -> None:
    """Rows encoded with an earlier mapping (``data sequences --vocab``) may hold OOV ids in their history and as their
    target: the candidates' scores ``[B, C]`` have no column for them."""
    from recsys_runner.metrics.retrieval import target_ranks
    from recsys_runner.models.ranking_eval import without_seen

    scores = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    targets = torch.tensor([2, 4])  # row 1's target is OOV row 4 of a table with 3 candidates
    seen = torch.tensor([[0, 5], [1, 4]])  # OOV ids 5 and 4 beside candidates 0 and 1
    masked = without_seen(scores, seen, targets)
    assert masked.tolist() == [[float("-inf"), 2.0, 1.0], [3.0, float("-inf"), 1.0]]
    assert target_ranks(masked, targets).tolist() == [1.0, float("inf")]
