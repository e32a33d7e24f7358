"""BST's jagged attention (issue 32): the tiled softmax attention (``models/jagged.softmax_attention``) equals a padded
masked softmax, values and gradients, for any tile size, causal or not; BST scores the same on ``attention: jagged`` and
``padded`` (its positions by recency or time gap, both readouts, the ablation, empty histories), values and gradients;
a row scores the same alone as in its batch; ``padded_reference`` puts BST on its padded path (what export compares
with); a bad ``model.attention`` says what to fix.

The suites over every ``conf/model`` option (test_models, test_pipelines) run the default (jagged) BST too, and
test_sequence_runner exports it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.configurable import make
from recsys_runner.errors import ConfigError
from recsys_runner.models.bst import BST, BSTConfig
from recsys_runner.models.jagged import host_plus, padded_reference, softmax_attention, tile
from tests.test_hstu_rank import assert_paths_agree, build_model, jt_row
from tests.test_models import small_sequences


@pytest.mark.parametrize("causal", [True, False])
def test_a_tile_plan_sized_on_the_host_is_the_plan_read_from_the_lengths(causal: bool) -> None:
    """The batch's lengths on the host (a data module's batch carries them) size the plan without a device read: the same
    counts and the same tensors as the plan sized by reading the lengths (empty rows, exact and partial tiles)."""
    lengths = np.array([0, 3, 4, 9, 1, 0, 8], dtype=np.int32)
    read = tile(torch.from_numpy(lengths), 4, causal=causal)
    sized = tile(torch.from_numpy(lengths), 4, causal=causal, host=lengths)
    assert read.counts == sized.counts == (0 + 1 + 1 + 3 + 1 + 0 + 2, 25, 12 if causal else 16)
    for name in ("slots", "positions", "pair_query", "pair_key"):
        assert torch.equal(getattr(read, name), getattr(sized, name)), name
    assert host_plus(None, 1) is None and host_plus(lengths, 1, events=False).tolist() == [1] * 7


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_softmax_attention_equals_the_padded_masked_softmax(causal: bool) -> None:
    """Rows of 1-33 tokens against ``scaled_dot_product_attention`` on the padded block (noise in the padding): the softmax
    spans every key tile of a row, for tiles of 1, 4 and 32 tokens."""
    torch.manual_seed(0)
    lengths, heads, width = [5, 1, 17, 8, 33, 2], 2, 4
    longest = max(lengths)
    mask = torch.arange(longest).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    q, k, v = (torch.randn(len(lengths), longest, heads, width, requires_grad=True) for _ in range(3))
    allowed = mask[:, None, None, :] & (torch.ones(longest, longest, dtype=torch.bool).tril() if causal else True)
    padded = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=allowed).transpose(1, 2)
    expected = torch.autograd.grad((padded[mask] ** 2).sum(), (q, k, v))
    for block in (1, 4, 32):
        got = softmax_attention(q[mask], k[mask], v[mask], tile(torch.tensor(lengths), block, causal=causal), width ** -0.5)
        torch.testing.assert_close(got, padded[mask], atol=1e-6, rtol=1e-5)
        for grad, want in zip(torch.autograd.grad((got ** 2).sum(), (q, k, v)), expected, strict=True):
            torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-4)


def tiny(**values: object) -> BSTConfig:
    return make(BSTConfig, **{"embedding_dim": 8, "num_heads": 2, "num_blocks": 2, "feedforward_dim": 16, "dropout": 0.0,
                              "deep_layer_sizes": [16], "attention_block": 4, **values})


@pytest.mark.parametrize("values", [{"position": "recency", "readout": "mean"}, {"position": "time_gap", "readout": "candidate"},
                                    {"use_history": False}])
def test_bst_scores_the_same_on_the_jagged_and_the_padded_path(values: dict[str, object]) -> None:
    """Same weights, in training mode (dropout 0): equal logits and gradients, on histories of up to 9 events (rows of 10
    tokens: 3 tiles of 4) with event times and empty histories."""
    data = small_sequences(empty_fraction=0.3, max_len=9)
    batch = next(iter(data.train_batches(0, 0, 1)))
    assert (batch.sparse_features["hist_item_id"].lengths() == 0).any()
    assert_paths_agree(build_model(tiny(attention="jagged", **values), data.features),
                       build_model(tiny(attention="padded", **values), data.features), batch)


def test_a_row_scores_the_same_alone_as_in_its_batch_and_padded_reference_pads_bst() -> None:
    """No row reads another on the jagged path; ``padded_reference`` (export's reference) runs the padded path, the same
    scores up to float rounding, and puts the jagged one back after."""
    data = small_sequences(max_len=9)
    batch = next(iter(data.train_batches(0, 0, 1)))
    model = build_model(tiny(), data.features).eval()
    assert isinstance(model, BST) and model.arch.jagged
    whole = model(batch.dense_features, batch.sparse_features)
    per_row = batch.sparse_features.to_dict()
    for row in range(len(whole)):
        alone = KeyedJaggedTensor.from_jt_dict({k: jt_row(jt, row) for k, jt in per_row.items()})
        torch.testing.assert_close(model(batch.dense_features[row: row + 1], alone), whole[row: row + 1], atol=1e-5, rtol=1e-5)
    with padded_reference(model):
        assert not model.arch.jagged and model.arch(batch.sparse_features).histories
        torch.testing.assert_close(model(batch.dense_features, batch.sparse_features), whole, atol=1e-5, rtol=1e-5)
    assert model.arch.jagged


@pytest.mark.parametrize(("values", "message"), [
    ({"attention": "flash"}, r"model.attention='flash' is not a BST attention. Fix: model.attention=jagged \(one of \['jagged', 'padded'\]\)"),
    ({"attention_block": 0}, r"model.attention_block must be at least 1, got 0"),
])
def test_bad_bst_attention_settings_say_what_to_fix(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny(**values)
