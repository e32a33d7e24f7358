"""Per-task labels on generated histories (``data=synthetic_sequences data.tasks=[ctr,cvr]``, or the tasks of a multi-task
model over histories): ``data=synthetic``'s funnel, with the later tasks scored from the history, learnable by a model
that reads it, deterministic per seed; without tasks the batches are those from before tasks existed, bit for bit."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from recsys_runner.__main__ import run
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.generated.synthetic import SyntheticData
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.data.generated.synthetic_sequences import SyntheticSequences, SyntheticSequencesConfig
from recsys_runner.errors import ConfigError
from tests.test_checkpoint import history

SMALL = {"batch_size": 16, "num_train_rows": 64, "num_eval_rows": 32, "num_users": 40, "num_items": 60, "num_categories": 6,
         "max_len": 7, "empty_fraction": 0.2}
"""Histories as small as a checksum needs (every train and eval batch of them is hashed)."""


def digest(data: SyntheticSequences | SyntheticData) -> str:
    """The first 16 hex digits of SHA-256 over every train (epoch 1) and eval batch's dense, ids, lengths and labels, less
    the label columns :func:`computed_labels` returns (those are checked to a tolerance instead)."""
    h = hashlib.sha256()
    for b in [*data.train_batches(1, 0, 1), *data.eval_batches(0, 1)]:
        labels = b.labels[:, [c for c in range(b.labels.shape[1]) if c not in computed_columns(data)]] if b.labels.dim() == 2 else b.labels
        parts = (b.dense_features, b.sparse_features.values(), b.sparse_features.lengths(), labels)
        for t in parts if isinstance(data, SyntheticSequences) else (parts[0], parts[1], parts[3]):
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def computed_columns(data: SyntheticSequences | SyntheticData) -> list[int]:
    """The label columns computed in floating point (``regression`` tasks: ``softplus`` of a score), whose last bits depend
    on the CPU's vector kernels (AVX2, AVX-512 or none give different ``softplus`` roundings): not hashed bit for bit."""
    kinds = data.config.label_kinds or {}
    return [i for i, t in enumerate(data.config.tasks or []) if kinds.get(t) == "regression"]


def computed_labels(data: SyntheticData) -> torch.Tensor:
    """Every train (epoch 1) and eval batch's :func:`computed_columns`, stacked ``[rows, columns]`` in float64."""
    batches = [*data.train_batches(1, 0, 1), *data.eval_batches(0, 1)]
    return torch.cat([b.labels[:, computed_columns(data)] for b in batches]).double()


@pytest.mark.parametrize(("values", "expected"), [
    ({}, "21d6a7a4309f4bd9"),
    ({"candidates_per_user": 3}, "a4c1ead013de800d"),
    ({"batch_tokens": 40}, "bb8a847e5c73188f"),
    ({"batch_tokens": 40, "group_by_length": False}, "34ab705dda09fad1"),
    ({"timestamps": False, "negatives": 0.0}, "72f965afc6af7732"),
])
def test_histories_without_tasks_are_the_batches_from_before_tasks(values: dict[str, Any], expected: str) -> None:
    """Checksums computed on the code before ``data.tasks`` came to histories: one label's batches are unchanged."""
    assert digest(SyntheticSequences(make(SyntheticSequencesConfig, **(SMALL | values)))) == expected


@pytest.mark.parametrize(("values", "expected", "computed"), [
    ({"tasks": ["ctr", "cvr", "buy"], "label_kinds": {"buy": "regression"}, "conversion_conflict": 0.5}, "fcadd434f6268dc1",
     (554.60666, [0.06988052, 1.0763785, 3.4017754])),
    ({"tasks": ["ctr", "cat"], "label_kinds": {"cat": "multiclass"}, "label_classes": {"cat": 4}}, "cf3ba89c4588cfda", None),
    ({"tasks": ["ctr", "cvr"], "selection_bias": 4.0, "conversion_truth": "cvr_all"}, "a20904c5cdd65c09", None),
])
def test_the_shared_label_code_leaves_synthetic_labels_as_they_were(values: dict[str, Any], expected: str,
                                                                   computed: tuple[float, list[float]] | None) -> None:
    """``data=synthetic``'s funnel now draws through the code histories share: its batches are those from before (bit for
    bit, but for a regression label's ``softplus``, whose last bits vary with the CPU: its sum and first rows to 1e-6)."""
    config = make(SyntheticDataConfig, batch_size=64, num_dense=4, num_sparse=5, num_embeddings=100, num_train_rows=256,
                  num_eval_rows=128, num_workers=0, **values)
    data = SyntheticData(config)
    assert digest(data) == expected
    if computed is not None:
        total, first = computed
        assert computed_labels(data).sum().item() == pytest.approx(total, rel=1e-6)
        assert computed_labels(data)[:3, 0].tolist() == pytest.approx(first, rel=1e-6)


def sequences(**values: Any) -> SyntheticSequences:
    return SyntheticSequences(make(SyntheticSequencesConfig, **{"batch_size": 1024, "num_train_rows": 1024, "num_eval_rows": 1024,
                                                                "num_items": 2000, "num_users": 5000, "max_len": 20, **values}))


def test_each_task_gets_a_label_from_the_history_deterministic_per_seed() -> None:
    """The click is the one-label click; each later task converts only clicked rows, from a score of its own; a
    ``regression`` task is an amount, a ``multiclass`` one a class; equal seeds, equal labels."""
    data = sequences(tasks=["ctr", "cvr", "buy"])
    batch = data.batch(1, 0)
    assert data.features.label_names == ("ctr", "cvr", "buy") and batch.labels.shape == (1024, 3)
    click, cvr, buy = batch.labels.unbind(1)
    assert torch.equal(click, sequences().batch(1, 0).labels)  # the later tasks draw after the click
    for label in (cvr, buy):
        assert bool((label <= click).all()) and 0.05 < float(label[click == 1].mean()) < 0.95  # the funnel
    assert not torch.equal(cvr, buy)  # each later task its own world
    assert torch.equal(sequences(tasks=["ctr", "cvr", "buy"]).batch(1, 0).labels, batch.labels)
    assert not torch.equal(sequences(tasks=["ctr", "cvr", "buy"], seed=1).batch(1, 0).labels, batch.labels)
    kinds = sequences(tasks=["ctr", "watch", "cat"], label_kinds={"watch": "regression", "cat": "multiclass"}, label_classes={"cat": 3})
    _, watch, cat = kinds.batch(1, 0).labels.unbind(1)
    assert bool((watch > 0).all()) and len(watch.unique()) > 500 and set(cat.unique().tolist()) == {0.0, 1.0, 2.0}


def test_the_conversion_score_ranks_clicked_rows_by_their_history() -> None:
    """Over clicked rows, the conversion's own score (history share, successor, repeat, item appeal) ranks its labels far
    above chance: a model that reads the history has something to learn beyond the click."""
    data = sequences(tasks=["ctr", "cvr"])
    world, g = data._world, torch.Generator().manual_seed(3)
    rows = world.rows(2048, 0.5, g)
    n, longest = rows.item.shape[0], int(rows.lengths.max())
    events = torch.zeros(n, longest + 1, dtype=torch.long)
    mask = torch.arange(longest + 1).unsqueeze(0) < rows.lengths.unsqueeze(1)
    events[mask] = rows.hist_items
    share, follows = world._signals(rows.item, events, rows.lengths, mask)
    score = world.conversions[0].score(rows.item, share, follows, events, mask, rows.dense)
    clicked = rows.labels[:, 0] == 1
    assert float(binary_auroc(score[clicked], rows.labels[clicked, 1].long())) > 0.7


LEARN = ["model=hstu_rank", "data=synthetic_sequences", "data.num_items=2000", "data.num_users=5000", "data.max_len=20",
         "data.batch_size=256", "data.num_train_rows=32768", "data.num_eval_rows=2048", "train.num_steps=30",
         "train.log_every_steps=10", "train.eval_every_steps=null", "distributed.device=cpu", "checkpoint=none",
         "model.embedding_dim=16", "model.num_layers=1", "model.deep_layer_sizes=[32]"]


def test_hstu_rank_learns_each_task_of_generated_histories_and_logs_it(make_cfg, mlflow_uri: str) -> None:
    """``model=hstu_rank data=synthetic_sequences data.tasks=[ctr,cvr] model.tasks=[ctr,cvr]``: 40 CPU steps beat AUC 0.6
    on each task, and the MLflow run holds each task's eval metrics."""
    run(make_cfg(*LEARN, "data.tasks=[ctr,cvr]", "model.tasks=[ctr,cvr]", "tracking.experiment=seq_tasks", tiny=False))
    for task in ("ctr", "cvr"):
        (auc,) = history(mlflow_uri, "seq_tasks", f"eval/{task}/auc").values()
        assert auc > 0.6, (task, auc)


def test_the_model_s_tasks_and_data_synthetic_s_label_fields_reach_the_histories(make_cfg) -> None:
    """``data.tasks: null`` follows the model's tasks and kinds, on ``data=synthetic_sequences`` and on the default data
    (which becomes histories for a model over them, keeping its label fields)."""
    served = validate(make_cfg("model=hstu_rank", "data=synthetic_sequences", "model.tasks=[ctr,watch]",
                               "model.task_kinds=[binary,regression]", "tracking=none", tiny=False)).served_data
    assert isinstance(served, SyntheticSequencesConfig)
    assert (served.tasks, served.label_kinds) == (["ctr", "watch"], {"watch": "regression"})
    served = validate(make_cfg("model=hstu_rank", "model.tasks=[ctr,cvr]", "data.tasks=[ctr,cvr,buy]", "data.conversion_bias=-1",
                               "tracking=none", tiny=False)).served_data
    assert isinstance(served, SyntheticSequencesConfig) and (served.tasks, served.conversion_bias) == (["ctr", "cvr", "buy"], -1.0)


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.label_kinds={ctr: regression}"], r"data.label_kinds=\{'ctr': 'regression'\} is set but data.tasks is null.*Fix:"),
    (["data.tasks=[ctr]", "data.label_kinds={cvr: regression}"], r"data.label_kinds names \['cvr'\], which are not in data.tasks"),
    (["data.tasks=[ctr]", "data.selection_bias=2"], r"data.selection_bias reads the funnel's first conversion, but data.tasks=\['ctr'\]"),
    (["data.tasks=[ctr,ctr]"], r"data.tasks=\['ctr', 'ctr'\] must list distinct task names"),
    (["data.conversion_truth=cvr_all"], r"data.selection_bias / data.conversion_truth read the funnel's first conversion, but the "
                                        r"data has labels \['label'\]. Fix: data.tasks=\[ctr,cvr\]"),
    (["data.tasks=[ctr]", "model.tasks=[ctr,cvr]"], r"task\(s\) \['cvr'\] have no label column.*data.tasks=\[...\] for "
                                                    r"data=synthetic and data=synthetic_sequences"),
])
def test_label_mistakes_on_histories_read_as_on_synthetic(make_cfg, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        spec = validate(make_cfg("model=hstu_rank", "data=synthetic_sequences", *overrides, "tracking=none", tiny=False))
        features = spec.served_data.build(device="cpu").features
        spec.model.build(features=features, dense_device=torch.device("cpu"))
