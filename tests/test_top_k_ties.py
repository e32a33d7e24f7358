"""Exactly tied scores in a chunked top k: the lowest item rows make the list, in row order, whatever the chunk size
(``metrics/top_k.py``), for ``predict``'s top-k (``scoring_topk.exact_top_k``), the corpus eval's top rows
(``corpus_ranks``) and the served model's (``served_topk.top_k``)."""

from __future__ import annotations

import pytest
import torch

from recsys_runner.metrics.corpus import corpus_ranks
from recsys_runner.scoring_topk import exact_top_k
from recsys_runner.serving import served_topk

CHUNKS = (1, 2, 3, 5, 7, 8, 13, 20, 64)


def test_tied_items_make_the_same_list_in_the_same_order_whatever_the_chunk() -> None:
    queries = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    index = torch.zeros(20, 2)
    index[:, 0] = 1.0  # query 0: all 20 items tie
    index[[17, 2, 9, 4, 12, 6, 15], 1] = 1.0  # query 1: seven tie at 1 (a tie across the 5th place), thirteen at 0
    # query 2: items 17, 2, 9, 4, 12, 6, 15 score 2, the others 1: the same cut one level up
    expected = [[0, 1, 2, 3, 4], [2, 4, 6, 9, 12], [2, 4, 6, 9, 12]]
    for chunk in CHUNKS:
        rows, scores, _ = exact_top_k(queries, index, 5, chunk, None)
        assert rows.tolist() == expected, f"predict's top 5 with chunks of {chunk}"
        _, top = corpus_ranks(queries, index, torch.zeros(3, dtype=torch.long), 5, chunk)
        assert top.tolist() == expected, f"the corpus eval's top rows with chunks of {chunk}"
    assert scores.tolist() == [[1.0] * 5, [1.0] * 5, [2.0] * 5]


def test_ties_inside_the_list_come_in_row_order_after_the_higher_scores() -> None:
    queries = torch.tensor([[1.0]])
    index = torch.tensor([[0.5], [2.0], [0.5], [1.0], [0.5], [2.0], [0.5], [0.5]])
    for chunk in CHUNKS:
        rows, scores, _ = exact_top_k(queries, index, 6, chunk, None)
        assert rows.tolist() == [[1, 5, 3, 0, 2, 4]], chunk
        assert scores.tolist() == [[2.0, 2.0, 1.0, 0.5, 0.5, 0.5]]


def test_nan_scores_rank_first_and_tie_by_row() -> None:
    queries = torch.tensor([[1.0]])
    index = torch.tensor([[1.0], [float("nan")], [3.0], [float("nan")], [3.0], [float("nan")]])
    for chunk in CHUNKS:
        rows, _, _ = exact_top_k(queries, index, 4, chunk, None)
        assert rows.tolist() == [[1, 3, 5, 2]], chunk


@pytest.mark.parametrize("chunk", CHUNKS)
def test_the_served_model_breaks_ties_as_predict_does(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(served_topk, "CHUNK_ROWS", chunk)
    queries = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    index = torch.zeros(20, 2)
    index[:, 0] = 1.0
    index[[17, 2, 9, 4, 12, 6, 15], 1] = 1.0
    seen = torch.tensor([[1, 3], [9, -1]])  # left out, so the next tied rows fill the list
    rows, _, keep = served_topk.top_k(queries, index, 5, seen)
    assert bool(keep.all())
    assert rows.tolist() == [[0, 2, 4, 5, 6], [2, 4, 6, 12, 15]]
    assert rows.tolist() == exact_top_k(queries, index, 5, chunk, seen)[0].tolist()
