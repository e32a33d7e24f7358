"""Sequence models (DIN, BST): they learn from the history (each beats itself without it on generated histories whose
clicks depend on them), their parts' contracts (masked, unnormalized DIN attention; per-batch padding; empty
histories; time-gap buckets) and clear config errors; models without a history read the same data, mean-pooling it.

Short CPU runs through ``recsys_runner.__main__.run`` on small generated histories (``SEQ``), each a few seconds.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.__main__ import run
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.base import batch_kjt
from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec, SequenceGroup, SparseFeature
from recsys_runner.host_lengths import HostLengthsKJT, longest_row, row_lengths, values_on_host
from recsys_runner.models.bst import BST, BehaviorTransformer, BSTConfig, TimeGapBuckets
from recsys_runner.models.common import materialize
from recsys_runner.models.din import DIN, DINConfig, TargetAttention
from recsys_runner.models.sequence import History, SequenceArch
from tests.test_models import small_data, small_sequences

SEQ = ["data=synthetic_sequences", "data.batch_size=256", "data.num_train_rows=65536", "data.num_eval_rows=4096",
       "data.num_users=2000", "data.num_items=500", "data.num_categories=50", "data.max_len=20",
       "train.num_steps=200", "train.log_every_steps=100", "train.eval_every_steps=null", "distributed.device=cpu",
       "optim=adagrad", "optim.lr=0.05", "tracking=none"]
"""Small generated histories (500 items in 50 categories, up to 20 events) and 200 Adagrad steps: a few seconds a run."""
BST_OPTIM = ["optim/dense=adam", "optim.dense.lr=0.003", "train.num_steps=120", "model.feedforward_dim=64"]
"""BST's transformer learns poorly under Adagrad in a short run: Adam on the dense parts (as TorchEasyRec's examples);
120 steps and a narrower feed-forward keep each run a few seconds."""


def auc(make_cfg, *overrides: str) -> float:
    return run(make_cfg(*SEQ, *overrides, tiny=False))


# --- what the history adds ---


def test_din_beats_itself_without_the_history(make_cfg) -> None:
    """On 200 steps: eval AUC about 0.84 with the history, 0.70 without (the candidate, user and dense columns alone)."""
    with_history, without = auc(make_cfg, "model=din"), auc(make_cfg, "model=din", "model.use_history=false")
    assert with_history > without + 0.05, (with_history, without)
    assert without > 0.55, without  # the ablation still learns what it can see


@pytest.mark.parametrize("position", ["recency", "time_gap"])
def test_bst_beats_itself_without_the_history(make_cfg, position: str) -> None:
    """On 120 steps: eval AUC about 0.78 (recency and time gap) with the history, 0.69 without."""
    with_history = auc(make_cfg, "model=bst", f"model.position={position}", *BST_OPTIM)
    without = auc(make_cfg, "model=bst", f"model.position={position}", "model.use_history=false", *BST_OPTIM)
    assert with_history > without + 0.05, (with_history, without)


# --- DIN's activation unit ---


def history(lengths: Sequence[int], length: int, dim: int = 8, seed: int = 0) -> History:
    """A hand-built :class:`History`: random events, left-aligned, padding filled with noise (it must not matter)."""
    g = torch.Generator().manual_seed(seed)
    lengths_t = torch.tensor(lengths)
    mask = torch.arange(length).unsqueeze(0) < lengths_t.unsqueeze(1)
    return History(values=torch.randn(len(lengths), length, dim, generator=g), mask=mask, lengths=lengths_t)


def with_padding(h: History, extra: int, seed: int = 1) -> History:
    """``h`` with ``extra`` more padded events (noise, masked out)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(h.values.shape[0], extra, h.values.shape[2], generator=g) * 100
    return History(values=torch.cat([h.values, noise], dim=1), lengths=h.lengths,
                   mask=torch.cat([h.mask, torch.zeros(h.mask.shape[0], extra, dtype=torch.bool)], dim=1))


def test_din_attention_ignores_padding_and_is_not_normalized() -> None:
    torch.manual_seed(0)
    unit = TargetAttention(8, [16, 8])
    h = history([4, 2, 0], length=4)
    query = torch.randn(3, 8)
    interest = unit(query, h.values, h.mask)
    padded = with_padding(h, 5)
    assert torch.allclose(unit(query, padded.values, padded.mask), interest, atol=1e-6), "padding changed the interest"
    assert torch.equal(interest[2], torch.zeros(8)), "an empty history has no interest"
    # No softmax: every event repeated twice doubles the interest (a softmax would keep it the same).
    doubled = torch.cat([h.values, h.values], dim=1), torch.cat([h.mask, h.mask], dim=1)
    assert torch.allclose(unit(query, *doubled), 2 * interest, atol=1e-5)
    weights = unit.mlp(torch.cat([query.unsqueeze(1).expand_as(h.values), h.values, query.unsqueeze(1) - h.values,
                                  query.unsqueeze(1) * h.values], dim=2)).squeeze(2) * h.mask
    assert torch.allclose(interest, (weights.unsqueeze(2) * h.values).sum(1), atol=1e-6)
    assert not torch.allclose(weights[:2].sum(1), torch.ones(2)), "weights happen to sum to 1"
    jagged = unit.forward_jagged(query, h.values[h.mask], h.lengths)  # the same on the events as they are
    torch.testing.assert_close(jagged, interest, atol=1e-6, rtol=1e-5)


def test_din_scores_the_same_on_the_jagged_and_the_padded_path() -> None:
    """Same weights, ``attention: jagged`` (the default) against ``padded``: equal logits and gradients, empty histories
    included."""
    data = small_sequences(empty_fraction=0.3)
    batch = next(iter(data.train_batches(0, 0, 1)))
    models = []
    for attention in ("jagged", "padded"):
        torch.manual_seed(0)
        models.append(materialize(make(DINConfig, embedding_dim=8, attention_layer_sizes=[8], deep_layer_sizes=[8],
                                       attention=attention).build(features=data.features, dense_device=torch.device("cpu"))))
    models[1].load_state_dict(models[0].state_dict())
    outputs = [m(batch.dense_features, batch.sparse_features) for m in models]
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-6, rtol=1e-5)
    for out in outputs:
        out.sum().backward()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4, msg=name)
    with pytest.raises(ConfigError, match="model.attention='dense' must be one of"):
        make(DINConfig, attention="dense")


# --- BST's parts ---


def test_bst_transformer_ignores_padding_and_use_history_false_sees_only_the_candidate() -> None:
    torch.manual_seed(0)
    encoder = BehaviorTransformer(8, num_positions=11, num_blocks=2, num_heads=2, feedforward_dim=16, dropout=0.0,
                                  readout="mean").eval()
    h = history([4, 1, 0], length=4)
    candidate = torch.randn(3, 8)
    positions = torch.arange(4).flip(0).expand(3, 4).clamp_max(9)
    out = encoder(candidate, h, positions)
    padded = with_padding(h, 3)
    out_padded = encoder(candidate, padded, torch.cat([positions, torch.zeros(3, 3, dtype=torch.long)], dim=1))
    assert torch.allclose(out, out_padded, atol=1e-5), "padding changed the output"
    alone = encoder(candidate, History(values=torch.zeros(3, 1, 8), mask=torch.zeros(3, 1, dtype=torch.bool),
                                       lengths=torch.zeros(3, dtype=torch.long)), torch.zeros(3, 1, dtype=torch.long))
    assert torch.allclose(out[2], alone[2], atol=1e-5), "an empty history is the candidate token alone"
    assert torch.allclose(encoder(candidate, h, positions, use_history=False), alone, atol=1e-5)
    encoder.readout = "candidate"
    assert encoder(candidate, h, positions).shape == (3, 8)


def test_time_gap_buckets_are_log2_of_the_gap_to_the_newest_event() -> None:
    ts = torch.tensor([[100, 103, 107, 0], [5, 5 + 2**20, 0, 0]])
    buckets = TimeGapBuckets(8)(ts, torch.tensor([3, 2]), ts > 0)
    # gaps [7, 4, 0] → floor(log2(8, 5, 1)) = [3, 2, 0]; 2**20 s caps at bucket 7; padding is 0
    assert buckets.tolist() == [[3, 2, 0, 0], [7, 0, 0, 0]]


# --- SequenceArch ---


def hand_batch(lengths: Sequence[int], seed: int = 0) -> KeyedJaggedTensor:
    """A batch of ``small_sequences()``'s keys with histories of ``lengths`` (ids below 6: every table has them)."""
    g = torch.Generator().manual_seed(seed)
    n, total = len(lengths), sum(lengths)
    one = [1] * n
    values = [torch.randint(6, (n,), generator=g) for _ in range(3)] + [torch.randint(6, (total,), generator=g) for _ in range(2)]
    values.append(torch.arange(total) * 60 + 1_700_000_000)
    parts = [*one, *one, *one, *lengths, *lengths, *lengths]
    keys = ["user_id", "item_id", "category", "hist_item_id", "hist_category", "hist_ts"]
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.tensor(parts, dtype=torch.int32))


def test_sequence_arch_pads_each_batch_to_its_longest_row_not_max_len() -> None:
    data = small_sequences(max_len=50)
    arch = materialize(SequenceArch(data.features, 8, DIN))
    assert isinstance(arch, SequenceArch) and arch.ec is not None
    kjt = hand_batch([3, 1, 0])
    out = arch(kjt)
    h = out.histories["hist"]
    assert h.values.shape == (3, 3, 16) and h.mask.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    assert h.lengths.tolist() == [3, 1, 0] and h.timestamps is not None and h.timestamps.shape == (3, 3)
    items = arch.ec.embeddings["item"].weight
    assert torch.equal(h.values[0, :, :8], items[kjt["hist_item_id"].values()[:3]])
    assert torch.equal(h.values[~h.mask], torch.zeros(5, 16)), "padding is not zero"
    assert torch.equal(out.candidates["item_id"], items[kjt["item_id"].values()])
    assert out.pooled.shape == (3, 3 * 8)  # user_id, item_id, category; the histories are not pooled here


def test_a_batch_carries_its_longest_rows_from_the_host_and_the_arch_pads_to_them() -> None:
    """A data module's batch knows each key's longest row on the host (no device read in the step: tests/test_host_syncs.py),
    through the copies a pipeline and a DataLoader worker make; the arch pads to it exactly as to the lengths' own max."""
    data = small_sequences(max_len=50, empty_fraction=0.3)
    batch = next(iter(data.train_batches(0, 0, 1)))
    sparse = batch.sparse_features
    assert isinstance(sparse, HostLengthsKJT)
    longest = {key: int(sparse[key].lengths().max()) for key in sparse.keys()}
    assert sparse.longest_rows == longest and longest["hist_item_id"] > 1
    for copy in (batch.to(torch.device("cpu")).sparse_features, pickle.loads(pickle.dumps(sparse))):
        assert isinstance(copy, HostLengthsKJT) and copy.longest_rows == longest
        assert torch.equal(copy.lengths(), sparse.lengths()) and copy.length_per_key() == sparse.length_per_key()
        assert {k: v.tolist() for k, v in copy.row_lengths.items()} == {k: sparse[k].lengths().tolist() for k in sparse.keys()}
        on_host = values_on_host(copy, ["hist_item_id", "hist_ts"])
        assert on_host is not None and on_host.T.tolist() == [sparse[k].values().tolist() for k in ("hist_item_id", "hist_ts")]
    arch = materialize(SequenceArch(data.features, 8, DIN))
    plain = KeyedJaggedTensor(keys=sparse.keys(), values=sparse.values(), lengths=sparse.lengths())
    assert longest_row(plain, "hist_item_id") is None and row_lengths(plain, "hist_item_id") is None
    assert values_on_host(plain, ["hist_item_id"]) is None
    carried, read = arch(sparse).histories["hist"], arch(plain).histories["hist"]
    assert carried.values.shape[1] == longest["hist_item_id"] and torch.equal(carried.values, read.values)
    assert torch.equal(carried.mask, read.mask) and torch.equal(carried.timestamps, read.timestamps)
    assert carried.host_lengths is not None and carried.host_lengths.tolist() == carried.lengths.tolist() and read.host_lengths is None


def test_every_empty_history_runs_forward_and_backward() -> None:
    data = small_sequences(empty_fraction=1.0)
    batch = next(iter(data.train_batches(0, 0, 1)))
    assert int(batch.sparse_features["hist_item_id"].lengths().sum()) == 0
    for model in (DIN(make(DINConfig), features=data.features), BST(make(BSTConfig, position="time_gap"), features=data.features)):
        materialize(model)
        logits = model(batch.dense_features, batch.sparse_features)
        assert logits.shape == (8,) and torch.isfinite(logits).all()
        logits.sum().backward()


@pytest.mark.parametrize("model", ["din", "bst"])
def test_sequence_models_train_on_empty_histories(make_cfg, model: str) -> None:
    assert math.isfinite(auc(make_cfg, f"model={model}", "data.empty_fraction=1.0", "train.num_steps=5"))


# --- config errors ---


def histories(candidate_table: str | None = "item", timestamps: str | None = "hist_ts") -> FeatureSpec:
    """A schema with a history ``hist_item_id`` (table ``item``) and a candidate ``item_id`` reading ``candidate_table``."""
    sparse = (SparseFeature("item_id", 60, table=candidate_table), SparseFeature("hist_item_id", 60, table="item"))
    return FeatureSpec(("int_0",), sparse, sequences=(SequenceGroup("hist", ("hist_item_id",), 10, timestamps=timestamps),))


@pytest.mark.parametrize(("config", "name"), [(DINConfig, "DIN"), (BSTConfig, "BST")])
def test_a_sequence_model_on_data_without_histories_says_what_to_do(config: type, name: str) -> None:
    with pytest.raises(ConfigError, match=rf"{name} attends over a user's history, but the data has no sequence group. "
                                          r"Fix: data=synthetic_sequences"):
        make(config).build(features=small_data().features)


def test_din_on_files_without_histories_is_refused_before_training(make_cfg, tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    path.write_text("label,int_0,cat_0\n" + "".join(f"{i % 2},{i * 0.1:.1f},{i % 7}\n" for i in range(64)))
    cfg = make_cfg("model=din", "data=csv", f"data.path={path}", "data.label=label", "data.dense=[{name: int_0}]",
                   "data.sparse=[{name: cat_0, num_embeddings: 10}]", "data.batch_size=16", "data.eval_fraction=0.25",
                   "train.num_steps=2", "distributed.device=cpu", "tracking=none", tiny=False)
    with pytest.raises(ConfigError, match="DIN attends over a user's history, but the data has no sequence group"):
        run(cfg)


@pytest.mark.parametrize(("config", "name"), [(DINConfig, "DIN"), (BSTConfig, "BST")])
def test_a_history_feature_without_a_candidate_is_refused(config: type, name: str) -> None:
    with pytest.raises(ConfigError, match=rf"{name} compares the candidate with each event of data.sequences.hist, but history "
                                          r"feature\(s\) \['hist_item_id'\] share no table with a candidate feature. Fix: give each"):
        make(config).build(features=histories(candidate_table=None))


def test_bst_time_gap_without_event_times_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"model.position=time_gap .* data.sequences.hist has no timestamps. "
                                          r"Fix: model.position=recency"):
        make(BSTConfig, position="time_gap").build(features=histories(timestamps=None))
    make(BSTConfig, position="recency").build(features=histories(timestamps=None))  # recency needs no times


def test_bst_heads_must_divide_the_token_width() -> None:
    # token width: hist_item_id + hist_category, 16 each = 32
    with pytest.raises(ConfigError, match=r"model.num_heads=6 does not divide BST's token width 32 .* Fix: model.num_heads=4"):
        make(BSTConfig, num_heads=6).build(features=small_sequences().features)


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.position=sinusoid"], r"model.position='sinusoid' is not a BST position. Fix: model.position=recency"),
    (["model.readout=max"], r"model.readout='max' is not a BST readout. Fix: model.readout=mean"),
    (["model.num_blocks=0"], r"model.num_blocks must be at least 1, got 0"),
    (["model.dropout=1.0"], r"model.dropout must lie in \[0, 1\)"),
    (["model.embedding_dim=6"], r"model.embedding_dim=6 is not a multiple of 4"),
])
def test_bad_bst_configs_say_what_to_fix(make_cfg, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg("model=bst", "tracking=none", *overrides))


# --- models without a history read the same data ---


def check_mean_pooled(model: nn.Module) -> int:
    """Every EmbeddingBagCollection of ``model`` that reads a history pools it as the mean of its events' rows (an empty
    history: zeros), on :func:`hand_batch` histories of 3, 1 and 0 events; how many (collection, history) pairs. The rows
    are redrawn first: a zero-initialized table (FM's first-order weights, LR's) pools alike whatever the pooling."""
    kjt = hand_batch([3, 1, 0])
    checked = 0
    for ebc in (m for m in model.modules() if isinstance(m, EmbeddingBagCollection)):
        with torch.no_grad():
            for bag in ebc.embedding_bags.values():
                bag.weight.normal_(generator=torch.Generator().manual_seed(0))
        pooled = ebc(kjt).to_dict()
        for config in ebc.embedding_bag_configs():
            for feature in set(config.feature_names) & {"hist_item_id", "hist_category"}:
                rows, ids = ebc.embedding_bags[config.name].weight, kjt[feature].values()
                expected = torch.stack([rows[ids[:3]].mean(0), rows[ids[3:4]].mean(0), torch.zeros(rows.shape[1])])
                assert torch.allclose(pooled[feature], expected, atol=1e-6), f"{config.name} pools {feature} otherwise"
                checked += 1
    return checked


@pytest.mark.parametrize("model", ["deepfm", "dcn_v2", "wide_deep", "dlrm", "lr", "fm"])
def test_models_without_attention_mean_pool_the_histories(make_cfg, model: str) -> None:
    """Their EmbeddingBagCollections pool each history like any multi-hot feature (``pooling: mean``): each collection
    that reads the histories (the embeddings, and the per-id weights of the wide / first-order / linear part) is checked
    on hand-made histories; a short run on generated ones trains."""
    config = validate(make_cfg(f"model={model}", "tracking=none")).model
    built = materialize(config.build(features=small_sequences().features, dense_device=torch.device("cpu")))
    assert check_mean_pooled(built) >= 2, "no collection reads both histories"
    assert math.isfinite(auc(make_cfg, f"model={model}", "train.num_steps=5", "data.num_train_rows=8192"))



def test_a_batch_with_host_facts_crosses_from_a_worker_in_shared_memory_like_its_tensors() -> None:
    """A DataLoader worker sends each batch to the trainer through torch's pickler, which moves tensors to shared memory and
    copies anything else through the pipe: the host lengths and values are kept as the CPU tensors the batch was built
    from, so its host facts add nothing to the pipe (as NumPy arrays they were a second copy of the values, 1.3 MB for
    a Criteo-shaped batch of 4096 rows)."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's shared-memory reductions with ForkingPickler

    keys = [f"c{i}" for i in range(26)]
    sparse = batch_kjt(keys, torch.arange(26 * 4096), torch.ones(26 * 4096, dtype=torch.int32))
    assert isinstance(sparse, HostLengthsKJT) and sparse.host_values is not None
    sent = io.BytesIO()
    ForkingPickler(sent, pickle.HIGHEST_PROTOCOL).dump(sparse)
    assert len(sent.getvalue()) < 16_000, f"{len(sent.getvalue())} bytes through the pipe for {26 * 4096 * 8} of values"
