"""A ranking metric's ``k`` must stay below the candidates each eval row ranks among: with ``k`` at least their count
every candidate is in the top ``k``, and ``hr@k`` or ``recall@k`` is a perfect 1.0 whatever the model. Every path that
ranks refuses it when the run is built, before training: a next-item model's item table (SASRec and HSTU blocks), its
sampled negatives, a two-tower model's catalogue and its sampled negatives, and in-batch candidates (an eval batch)."""

from __future__ import annotations

import pytest

from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.errors import ConfigError
from recsys_runner.metrics.corpus import check_k_below

SEQUENCES = ["model=sasrec", "data=synthetic_sequences", "data.num_items=60", "data.num_categories=4", "data.num_users=40",
             "data.max_len=8", "data.batch_size=32", "data.num_train_rows=256", "data.num_eval_rows=64", "model.embedding_dim=8"]
"""A next-item run over a table of 60 items."""
CATALOGUE = ["model=dssm", "data=synthetic_retrieval", "data.num_embeddings=1000", "data.batch_size=64", "data.num_train_rows=256",
             "data.num_eval_rows=128"]
"""A two-tower run whose catalogue has 1000 items."""


@pytest.mark.parametrize(("overrides", "message"), [
    pytest.param([*SEQUENCES, "model.eval_metrics=[hr@10,hr@60,ndcg@100]"],
                 r"model.eval_metrics lists \['hr@60', 'ndcg@100'\], but each eval row ranks its true item among only 60 "
                 r"candidates \(the item table's items\): a top k of k=60 >= 60 holds every one of them, so hr@60 is a perfect "
                 r"score whatever the model. Fix: k < 60, e.g. hr@10, or a larger item table", id="sasrec-table"),
    pytest.param([*SEQUENCES, "model.block=hstu", "model.eval_metrics=[ndcg@60]"], r"ndcg@60.*among only 60 candidates",
                 id="hstu-table"),
    pytest.param([*SEQUENCES, "model.eval_negatives=20", "model.eval_metrics=[hr@10,hr@50]"],
                 r"model.eval_metrics lists \['hr@50'\], but each eval row ranks its true item among only 21 candidates "
                 r"\(model.eval_negatives=20 sampled items and the true one\).*Fix: k < 21, e.g. hr@10, or "
                 r"model.eval_negatives=50", id="sasrec-negatives"),
    pytest.param([*CATALOGUE, "model.eval_metrics=[recall@10,recall@5000]"],
                 r"model.eval_metrics lists \['recall@5000'\], but each eval row ranks its true item among only 1000 "
                 r"candidates \(the item catalogue's items\)", id="dssm-catalogue"),
    pytest.param([*CATALOGUE, "model.eval_negatives=20", "model.eval_metrics=[recall@10,ndcg@50,mrr]"],
                 r"model.eval_metrics lists \['ndcg@50'\], but each eval row ranks its true item among only 21 candidates "
                 r"\(model.eval_negatives=20 sampled catalogue items and its own\).*or model.eval_negatives=50",
                 id="dssm-negatives"),
    pytest.param([*CATALOGUE, "data.batch_size=32"],  # dssm's default metrics: inbatch_recall@1, @10, @50
                 r"model.eval_metrics lists \['inbatch_recall@50'\], but each eval row ranks its true item among only 32 "
                 r"candidates \(in-batch: the rows of an eval batch, data.batch_size.*Fix: k < 32, e.g. inbatch_recall@10, "
                 r"or data.batch_size>50", id="dssm-in-batch"),
])
def test_k_not_below_the_candidates_is_refused_when_the_run_is_built(make_cfg, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(validate(make_cfg(*overrides, "distributed.device=cpu", "tracking=none", "checkpoint=none", tiny=False))).close()


def test_k_below_the_candidates_passes_and_names_without_k_are_left_alone() -> None:
    check_k_below(["hr@9", "mrr", "ndcg@1"], 10, "metrics.eval", "the item table's items", "a larger item table")
    with pytest.raises(ConfigError, match=r"lists \['coverage@10'\].*among only 10 candidates.*Fix: k < 10, e.g. coverage@9"):
        check_k_below(["mrr", "coverage@10"], 10, "metrics.eval", "the item table's items", "a larger item table")
