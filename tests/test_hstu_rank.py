"""``hstu_rank`` (issue 32) and the jagged attention it runs on (as do ``sasrec``'s HSTU blocks): the tiles cover every row; the jagged HSTU layer equals
the padded one (values and gradients, with time biases and candidates); each candidate sees the history and not the other
candidates; the model scores the same on either path, a row alone as in a batch; multi-task heads; clear config errors;
and a learning test on long histories whose label only their order shows, where DIN stays at chance.

The suites over every ``conf/model`` option (test_models, test_model_structure, test_pipelines, test_default_data_models)
also run it; the export test below checks that the served MLflow model (its program the padded path, ATen ops only)
scores raw rows with histories as ``predict`` does from the trained (jagged) model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from torch import nn
from torchmetrics.functional.classification import binary_auroc
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec, SequenceGroup, SparseFeature
from recsys_runner.models import hstu_rank
from recsys_runner.models.common import ModelConfig, materialize
from recsys_runner.models.din import DINConfig
from recsys_runner.models.hstu import HSTUBlock
from recsys_runner.models.hstu_rank import HSTURankConfig
from recsys_runner.models.jagged import tile
from recsys_runner.models.sasrec import SASRecConfig
from tests.test_interaction_models import one_thread
from tests.test_mlflow_model import ATOL, _scores, _trained
from tests.test_models import CPU, small_sequences
from tests.test_sequence_files import columns, histories, write_csv

# --- the tiling -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [1, 3, 8])
def test_tiles_hold_every_token_once_and_pair_each_tile_with_its_rows_earlier_tiles(block: int) -> None:
    lengths = torch.tensor([5, 0, 1, 17, 8])
    tiles = tile(lengths, block)
    num_tiles = int(((lengths + block - 1) // block).sum())
    assert tiles.positions.shape == (num_tiles, block)
    assert sorted(tiles.slots.tolist()) == sorted(set(tiles.slots.tolist())) and len(tiles.slots) == int(lengths.sum())
    flat_positions = tiles.positions.flatten()[tiles.slots]
    assert flat_positions.tolist() == [p for n in lengths.tolist() for p in range(n)]  # each token at its own place
    assert int((tiles.positions >= 0).sum()) == int(lengths.sum())  # the other slots are padding
    per_row = [(n + block - 1) // block for n in lengths.tolist()]
    assert len(tiles.pair_query) == sum(k * (k + 1) // 2 for k in per_row)
    first = torch.tensor([0, *per_row]).cumsum(0)[:-1]
    row = torch.repeat_interleave(torch.arange(len(per_row)), torch.tensor(per_row))
    assert (row[tiles.pair_query] == row[tiles.pair_key]).all() and (tiles.pair_key <= tiles.pair_query).all()
    assert (tiles.pair_key >= first[row[tiles.pair_query]]).all()
    whole = tile(lengths, block, causal=False)
    assert len(whole.pair_query) == sum(k * k for k in per_row)


# --- the jagged HSTU layer against the padded one -------------------------------------------------------------------


def padded_block(lengths: list[int], dim: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor],
                                                                            torch.Tensor]:
    """``(x [B, L, D], mask, (query times, key times) [B, L], candidates [B, L])``: noise in the padding (it must not
    matter), a few real positions flagged as candidates."""
    g = torch.Generator().manual_seed(seed)
    length = max(lengths)
    mask = torch.arange(length).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    times = tuple(torch.randint(1, 10**5, (len(lengths), length), generator=g).cumsum(1) for _ in range(2))
    candidates = (torch.rand(len(lengths), length, generator=g) < 0.3) & mask
    return torch.randn(len(lengths), length, dim, generator=g), mask, (times[0], times[1]), candidates


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("with_candidates", [False, True])
def test_the_jagged_layer_equals_the_padded_one(timed: bool, with_candidates: bool) -> None:
    torch.manual_seed(0)
    lengths = [5, 0, 1, 17, 8, 33]
    layer = HSTUBlock(8, num_heads=2, max_len=40, dropout=0.0, time_buckets=16 if timed else 0)
    x, mask, times, candidates = padded_block(lengths)
    x.requires_grad_()
    padded = layer(x, mask, times if timed else None, candidates if with_candidates else None)
    (padded[mask] ** 2).sum().backward()
    expected_grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    for block in (1, 4, 32):
        flat = x.detach()[mask].requires_grad_()
        got = layer.forward_jagged(flat, tile(torch.tensor(lengths), block), (times[0][mask], times[1][mask]) if timed else None,
                                   candidates[mask] if with_candidates else None)
        torch.testing.assert_close(got, padded[mask], atol=1e-5, rtol=1e-5)
        (got ** 2).sum().backward()
        torch.testing.assert_close(flat.grad, x.grad[mask], atol=1e-5, rtol=1e-4)
        for p, expected in zip(layer.parameters(), expected_grads, strict=True):
            torch.testing.assert_close(p.grad, expected, atol=1e-5, rtol=1e-4)
        layer.zero_grad()


def test_each_candidate_sees_the_history_and_not_the_other_candidates() -> None:
    """Changing one candidate token changes its own output only: the history before it and the other candidates of its
    row are not moved (each candidate attends to the history and itself)."""
    torch.manual_seed(0)
    layer = HSTUBlock(8, num_heads=2, max_len=16, dropout=0.0, time_buckets=0)
    x = torch.randn(12, 8)  # one row: 9 events then 3 candidates
    candidates = torch.tensor([False] * 9 + [True] * 3)
    tiles = tile(torch.tensor([12]), 4)
    before = layer.forward_jagged(x, tiles, None, candidates)
    moved = x.clone()
    moved[10] += 3 * torch.randn(8)  # not a constant shift: LayerNorm would remove it
    after = layer.forward_jagged(moved, tiles, None, candidates)
    changed = (after - before).abs().amax(dim=1) > 1e-6
    assert changed.tolist() == [False] * 10 + [True, False]
    plain = layer.forward_jagged(moved, tiles)  # without the flags the later candidate reads the earlier one
    assert (plain[11] - layer.forward_jagged(x, tiles)[11]).abs().max() > 1e-4


# --- the model ------------------------------------------------------------------------------------------------------


def tiny(**values: object) -> HSTURankConfig:
    return make(HSTURankConfig, **{"embedding_dim": 8, "num_heads": 2, "num_layers": 2, "dropout": 0.0, "deep_layer_sizes": [16],
                                   "attention_block": 4, **values})


def build_model(config: ModelConfig, features: FeatureSpec, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return materialize(config.build(features=features, dense_device=CPU))


def test_the_model_scores_the_same_on_the_jagged_and_the_padded_path() -> None:
    """Same weights, ``attention: jagged`` against ``padded``: equal logits and gradients, on generated histories with
    event times and empty histories."""
    data = small_sequences(empty_fraction=0.3, max_len=9)
    batch = next(iter(data.train_batches(0, 0, 1)))
    assert (batch.sparse_features.to_dict()["hist_item_id"].lengths() == 0).any()
    assert_paths_agree(build_model(tiny(attention="jagged"), data.features), build_model(tiny(attention="padded"), data.features), batch)


def assert_paths_agree(jagged: nn.Module, padded: nn.Module, batch: Any) -> None:
    """``padded`` given ``jagged``'s weights scores ``batch`` alike (1e-5) and gets the same gradient in every parameter."""
    padded.load_state_dict(jagged.state_dict())
    outputs = [m(batch.dense_features, batch.sparse_features) for m in (jagged, padded)]
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
    for out in outputs:
        out.sum().backward()
    for (name, a), b in zip(jagged.named_parameters(), padded.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_sasrec_with_hstu_blocks_scores_the_same_on_jagged_and_padded_rows() -> None:
    """``model=sasrec model.block=hstu``: the blocks on the jagged positions (``attention_block: 4``) against the padded
    rows (``0``): the same training logits and targets, the same eval scores, with event times and empty histories."""
    data = small_sequences(negatives=0.0, empty_fraction=0.3, max_len=9)
    batch = next(iter(data.train_batches(0, 0, 1)))
    models = [build_model(make(SASRecConfig, embedding_dim=8, block="hstu", dropout=0.0, attention_block=size), data.features)
              for size in (4, 0)]
    models[1].load_state_dict(models[0].state_dict())
    for mode in ("train", "eval"):
        (logits, targets), (expected, expected_targets) = (m.train(mode == "train")(batch.dense_features, batch.sparse_features)
                                                            for m in models)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)  # cosine / temperature 0.05: 20x the states' error
        assert torch.equal(targets, expected_targets)


def test_sasrec_hstu_input_dropout_runs_on_the_real_positions_only() -> None:
    """On the jagged positions (``attention_block > 0``) the input dropout draws for the ``P`` real positions alone, not
    the padded ``[B, L + 1, D]`` (~3x less work for it at max_len 200, where 85% of positions are padding): each real
    element is still dropped with probability ``model.dropout``, the survivors scaled by ``1 / (1 - p)``."""
    data = small_sequences(negatives=0.0, empty_fraction=0.3, max_len=9)
    batch = next(iter(data.train_batches(0, 0, 1)))
    model = build_model(make(SASRecConfig, embedding_dim=8, block="hstu", dropout=0.5, attention_block=4), data.features).train()
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    model.dropout.register_forward_hook(lambda _, given, out: seen.append((given[0], out)))
    model(batch.dense_features, batch.sparse_features)
    (given, out), = seen
    history = batch.sparse_features["hist_item_id"]
    assert given.shape == (int(history.lengths().sum()) + len(history.lengths()), 8), "one row per event plus the start token"
    kept = out != 0
    torch.testing.assert_close(out[kept], given[kept] * 2)
    assert 0.4 < (~kept).float().mean().item() < 0.6


@pytest.mark.parametrize("attention", ["jagged", "padded"])
def test_a_row_scores_the_same_alone_as_in_its_batch(attention: str) -> None:
    """No row reads another: the padded path pads to the batch's longest row, the jagged one tiles each row alone."""
    data = small_sequences(max_len=9)
    batch = next(iter(data.train_batches(0, 0, 1)))
    model = build_model(tiny(attention=attention), data.features).eval()
    whole = model(batch.dense_features, batch.sparse_features)
    per_row = batch.sparse_features.to_dict()
    for row in range(len(whole)):
        alone = KeyedJaggedTensor.from_jt_dict({k: jt_row(jt, row) for k, jt in per_row.items()})
        torch.testing.assert_close(model(batch.dense_features[row: row + 1], alone), whole[row: row + 1], atol=1e-5, rtol=1e-5)


def jt_row(jt: JaggedTensor, row: int) -> JaggedTensor:
    """Row ``row`` of a JaggedTensor, as a one-row JaggedTensor."""
    offsets = jt.offsets()
    return JaggedTensor(values=jt.values()[offsets[row]: offsets[row + 1]], lengths=jt.lengths()[row: row + 1])


def test_named_tasks_get_a_head_each() -> None:
    data = small_sequences()
    features = FeatureSpec(data.features.dense_names, data.features.sparse, ("ctr", "cvr"), sequences=data.features.sequences)
    model = build_model(tiny(tasks=["ctr", "cvr"], loss_weights=[1.0, 0.5]), features)
    batch = next(iter(data.train_batches(0, 0, 1)))
    out = model(batch.dense_features, batch.sparse_features)
    assert sorted(out) == ["ctr", "cvr"] and all(v.shape == (8,) for v in out.values())
    assert [t.weight for t in model.tasks] == [1.0, 0.5]


@pytest.mark.parametrize(("values", "message"), [
    ({"attention": "flash"}, "model.attention='flash' must be one of ['jagged', 'padded']"),
    ({"loss_weights": [1.0]}, "model.tasks=[] (the data's one label)"),
    ({"num_layers": 0}, "model.num_layers must be positive"),
    ({"attention_block": 0}, "model.attention_block must be positive"),
])
def test_bad_settings_name_the_key(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        tiny(**values)


def test_heads_that_do_not_divide_the_width_and_data_without_a_history_are_refused() -> None:
    data = small_sequences()
    with pytest.raises(ConfigError, match="model.num_heads=3 must divide the model width 8"):
        tiny(num_heads=3).build(features=data.features, dense_device=CPU)
    flat = FeatureSpec(("d0",), (SparseFeature("item_id", 10),))
    with pytest.raises(ConfigError, match="sequence"):
        tiny().build(features=flat, dense_device=CPU)


def test_a_bad_attention_on_the_command_line_stops_validate(make_cfg) -> None:
    with pytest.raises(ConfigError, match="model.attention='dense'"):
        validate(make_cfg("model=hstu_rank", "model.attention=dense"))


# --- learning: a label that only the history's order shows ----------------------------------------------------------

ITEMS_PER_CATEGORY, NUM_CATEGORIES, MAX_LEN = 1, 16, 128
"""The order world's catalogue (32 items in 8 categories) and its longest history."""


def order_features() -> FeatureSpec:
    items = ITEMS_PER_CATEGORY * NUM_CATEGORIES
    sparse = (SparseFeature("item_id", items, table="item"), SparseFeature("hist_item_id", items, table="item"))
    return FeatureSpec((), sparse, "label", sequences=(SequenceGroup("history", ("hist_item_id",), MAX_LEN),))


def order_batch(g: torch.Generator, rows: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """``rows`` histories of 100-128 events: items of a category ``A`` for the first half, then of a category ``B``; the
    candidate an item of ``A`` or ``B``; clicked (95 % of the time) when it is of ``B``, the one the user moved to. Both
    categories hold half of every history, so a model that reads the history as a set sees no signal; only the order
    tells which came last."""
    lengths = torch.randint(100, MAX_LEN + 1, (rows,), generator=g)
    pair = torch.stack([torch.randperm(NUM_CATEGORIES, generator=g)[:2] for _ in range(rows)])  # [rows, 2]: A, B
    switch = lengths // 2
    position = torch.arange(MAX_LEN).unsqueeze(0)
    category = torch.where(position < switch.unsqueeze(1), pair[:, :1], pair[:, 1:])
    events = category * ITEMS_PER_CATEGORY + torch.randint(ITEMS_PER_CATEGORY, (rows, MAX_LEN), generator=g)
    recent = torch.rand(rows, generator=g) < 0.5
    candidate = pair[torch.arange(rows), recent.long()] * ITEMS_PER_CATEGORY + torch.randint(ITEMS_PER_CATEGORY, (rows,), generator=g)
    labels = torch.where(recent, torch.rand(rows, generator=g) < 0.95, torch.rand(rows, generator=g) < 0.05).float()
    mask = position < lengths.unsqueeze(1)
    kjt = KeyedJaggedTensor(keys=["item_id", "hist_item_id"], values=torch.cat([candidate, events[mask]]),
                            lengths=torch.cat([torch.ones(rows, dtype=torch.long), lengths]))
    return kjt, labels


LEARNING_RATE = 0.005
"""Adam's rate in :func:`order_auc`."""


def order_auc(config: ModelConfig, seed: int, steps: int = 250, rows: int = 48) -> float:
    """Eval AUC of ``config``'s model after ``steps`` Adam steps on :func:`order_batch` rows (a plain loop: the
    architecture is what is tested), on 1,024 new rows."""
    with one_thread():
        model = build_model(config, order_features(), seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            ids, labels = order_batch(g, rows)
            loss = nn.functional.binary_cross_entropy_with_logits(model(torch.zeros(rows, 0), ids), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        ids, labels = order_batch(torch.Generator().manual_seed(seed + 1000), 1024)
        with torch.no_grad():
            scores = model.eval()(torch.zeros(1024, 0), ids)
    return float(binary_auroc(scores, labels.long()))


@pytest.mark.parametrize("seed", [1, 2])
def test_hstu_rank_reads_the_order_of_long_histories_that_din_cannot(seed: int) -> None:
    """DIN stays at chance (it pools the history as a set, and both categories hold half of it); hstu_rank, with
    positions, learns which category came last (AUC 0.92-0.95 after 250-300 steps here, where the label's noise caps it at
    0.95; the learning comes in a sudden transition, which at 150 steps one seed had not reached yet)."""
    din = order_auc(make(DINConfig, embedding_dim=16, attention_layer_sizes=[32], deep_layer_sizes=[32]), seed)
    hstu = order_auc(tiny(num_layers=2, embedding_dim=16, num_heads=1, deep_layer_sizes=[32], attention_block=32), seed)
    assert din < 0.56, din
    assert hstu > din + 0.25, (hstu, din)


def test_rows_that_share_a_history_are_scored_in_one_sequence_each_as_alone() -> None:
    """Impressions grouped by user (consecutive rows with the same history, each its own candidate) become one sequence:
    the history once, then every candidate. Each row scores as on the padded path, one row one sequence."""
    data = small_sequences(max_len=9, empty_fraction=0.0)
    batch = next(iter(data.train_batches(0, 0, 1)))
    by_key = batch.sparse_features.to_dict()
    order = torch.tensor([0, 0, 0, 1, 2, 2, 3, 0])  # rows 0-2 and 4-5 share a history; the last row repeats row 0's apart
    grouped = {k: jt_row_cat(jt, order) for k, jt in by_key.items()}
    candidates = torch.arange(8) % 5  # a different candidate on every row
    grouped["item_id"] = JaggedTensor(values=candidates, lengths=torch.ones(8, dtype=torch.long))
    kjt = KeyedJaggedTensor.from_jt_dict(grouped)
    plan_lengths = hstu_rank.candidate_sequences(grouped["hist_item_id"].lengths(),
                                                 torch.stack([grouped["hist_item_id"].values(), grouped["hist_category"].values(),
                                                              grouped["hist_ts"].values()], dim=1)).lengths
    history = grouped["hist_item_id"].lengths()
    assert plan_lengths.tolist() == [int(history[0]) + 3, int(history[3]) + 1, int(history[4]) + 2, int(history[6]) + 1,
                                     int(history[7]) + 1]
    jagged = build_model(tiny(attention="jagged"), data.features).eval()
    padded = build_model(tiny(attention="padded"), data.features).eval()
    padded.load_state_dict(jagged.state_dict())
    dense = batch.dense_features[order]
    torch.testing.assert_close(jagged(dense, kjt), padded(dense, kjt), atol=1e-5, rtol=1e-5)


def test_the_sequences_of_rows_that_share_a_history_are_counted_on_the_host_as_on_the_device() -> None:
    """:func:`host_sequence_lengths` (the rows' lengths and ids as a data module's batch carries them on the host) gives
    the sequences :func:`candidate_sequences` finds on the device, and the plan it sizes is the same tensors as the plan
    sized by a device read (grouped rows, a repeat apart, an empty history)."""
    data = small_sequences(max_len=9, empty_fraction=0.3)
    by_key = next(iter(data.train_batches(0, 0, 1))).sparse_features.to_dict()
    order = torch.tensor([0, 0, 0, 1, 2, 2, 3, 0, 4, 5, 5, 6, 7])
    grouped = {k: jt_row_cat(by_key[k], order) for k in ("hist_item_id", "hist_category", "hist_ts")}
    lengths = grouped["hist_item_id"].lengths()
    ids = torch.stack([grouped[k].values().long() for k in ("hist_item_id", "hist_category", "hist_ts")], dim=1)
    host = hstu_rank.host_sequence_lengths(lengths.numpy(), ids.numpy())
    read, sized = hstu_rank.candidate_sequences(lengths, ids), hstu_rank.candidate_sequences(lengths, ids, host)
    assert host.tolist() == read.lengths.tolist() and len(host) < len(order)
    assert (lengths == 0).any(), "an empty history among the rows"
    for name in ("kept", "at_event", "recency", "at_candidate", "lengths", "last", "positions"):
        assert torch.equal(getattr(read, name), getattr(sized, name)), name


def jt_row_cat(jt: JaggedTensor, rows: torch.Tensor) -> JaggedTensor:
    """Rows ``rows`` of a JaggedTensor, in that order (repeats allowed)."""
    picked = [jt_row(jt, int(r)) for r in rows]
    return JaggedTensor(values=torch.cat([p.values() for p in picked]), lengths=torch.cat([p.lengths() for p in picked]))


def test_generated_impressions_grouped_by_user_share_one_sequence() -> None:
    """``data.candidates_per_user=3``: rows come in threes with one user's history; the model reads each history once
    (3 sequences for 8 rows) and scores every row as the padded path does."""
    data = small_sequences(candidates_per_user=3, empty_fraction=0.0)
    batch = next(iter(data.train_batches(0, 0, 1)))
    history = batch.sparse_features.to_dict()["hist_item_id"]
    ids = torch.stack([history.values(), batch.sparse_features.to_dict()["hist_category"].values(),
                       batch.sparse_features.to_dict()["hist_ts"].values()], dim=1)
    assert len(hstu_rank.candidate_sequences(history.lengths(), ids).lengths) == 3
    jagged = build_model(tiny(attention="jagged"), data.features).eval()
    padded = build_model(tiny(attention="padded"), data.features).eval()
    padded.load_state_dict(jagged.state_dict())
    torch.testing.assert_close(jagged(batch.dense_features, batch.sparse_features), padded(batch.dense_features, batch.sparse_features),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="data.candidates_per_user=2 groups rows by user, which token batches"):
        small_sequences(candidates_per_user=2, batch_tokens=64)


# --- export: the served MLflow model (its program pads, the trained model tiled) -------------------------------------


def test_the_served_mlflow_model_scores_raw_history_rows_as_predict_does(tmp_path: Path) -> None:
    """hstu_rank trained (on the jagged path) on a CSV whose history cells hold ``|``-separated events and their times,
    exported; ``mlflow.pyfunc.load_model(dir).predict`` on the CSV's raw rows read as text (items never seen in training
    among the candidates and the histories, empty histories) gives the scores ``predict`` writes from the checkpoint.
    The served program is ``model.pt2`` (the padded path, ATen ops only), so this is also the program against the
    trained model on rows the export never saw."""
    write_csv(tmp_path / "train.csv", histories(0, 600))
    scored = histories(1, 120)
    for r, row in enumerate(scored[:40]):
        row["item"] = f"new{r}"
        if row["hist_item"]:
            row["hist_item"] = [*row["hist_item"][:-1], f"gone{r}"]
    write_csv(tmp_path / "score.csv", scored)
    (tmp_path / "schema.yaml").write_text(yaml.safe_dump(columns("|", max_len=8)))  # every event kept (histories() has <= 6)
    data = ["data=csv", f"data.path={tmp_path}/train.csv", f"data.schema={tmp_path}/schema.yaml", "data.batch_size=64", "model=hstu_rank",
            "model.embedding_dim=8", "model.num_layers=1", "model.deep_layer_sizes=[16]", "distributed.device=cpu", "tracking=none"]
    with one_thread():
        trained = _trained(tmp_path, data, 10)
        reference = _scores(data, trained["checkpoint"], tmp_path / "score.csv", tmp_path / "predicted")["score"].to_numpy()
    served_dir = trained["model"] / "data" / "data"
    assert {"hist_item", "hist_category", "hist_ts"} <= set(json.loads((served_dir / "serving.json").read_text())["input_columns"])
    # what the served model runs: torch.export's program of plain ATen ops (no fbgemm or TorchRec op to load), beside the
    # standalone loader test_mlflow_model runs where recsys_runner, TorchRec and fbgemm_gpu cannot be imported
    program = torch.export.load(str(served_dir / "model.pt2"))
    namespaces = {n.target.namespace for n in program.graph.nodes if isinstance(n.target, torch._ops.OpOverload)}
    assert namespaces == {"aten"}, namespaces
    served = mlflow.pyfunc.load_model(str(trained["model"])).predict(pd.read_csv(tmp_path / "score.csv", dtype=str))["score"].to_numpy()
    assert len(served) == len(scored) and reference.std() > 1e-4
    np.testing.assert_allclose(served, reference, atol=ATOL)
