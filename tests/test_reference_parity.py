"""Parity with TorchRec's reference models: ours, built from its real config, against ``torchrec.models`` with the same
weights, on the same batch (docs/models.md, *Parity with TorchRec's reference models*).

Each test builds ours as the runner does (the composed ``model`` config, validated, ``build``; tables materialized on CPU)
and the reference as TorchRec's DLRM example does (an ``EmbeddingBagCollection`` of one table per feature), copies the
reference's weights into ours by a name map (every parameter on both sides mapped, one to one and of the same shape,
but for the parts only one side has: :func:`load_reference`), and
checks the logits on one batch (dense features, and a ``KeyedJaggedTensor`` with multi-hot and empty bags, one feature
mean-pooled) and the gradient of every mapped parameter after one BCE backward.

* ``dlrm`` is TorchRec's ``DLRM``, whole.
* ``dcn_v2`` (stacked, low rank) is TorchRec's ``DLRM_DCN`` without its bottom MLP: ours crosses the raw dense features,
  as the paper does, where ``DLRM_DCN`` first embeds them to ``D``; the reference is run from its ``inter_arch`` on
  (``N = D`` so that its cross width ``(F+1)·D`` is ours ``N + F·D``). The full-rank cross network is TorchRec's
  ``CrossNet``.
* ``deepfm`` shares with TorchRec's ``SimpleDeepFMNN`` its fields (the dense projection, ReLU on its last layer too, and
  the embeddings) and the deep part's first layer; the rest differs by design, the FM term included: TorchRec's
  ``FactorizationMachine`` multiplies every two numbers of the flattened fields, ours (the paper's) every two fields
  (docs/models.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.crossnet import CrossNet
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.config import validate
from recsys_runner.features import FeatureSpec, SparseFeature
from recsys_runner.models.common import materialize
from recsys_runner.models.dcn_v2 import CrossNetwork

D = 8
"""Embedding width; also the number of dense features, which ``DLRM_DCN``'s cross width needs (see the module docstring)."""
B = 6
TABLES = (("cat_0", 40, "sum"), ("cat_1", 30, "sum"), ("cat_2", 50, "mean"))
"""(feature, rows, pooling): one table ``t_<feature>`` each, sized apart so that a table mapped to another's cannot load."""
FEATURES = FeatureSpec(dense_names=tuple(f"int_{i}" for i in range(D)),
                       sparse=tuple(SparseFeature(name, rows, pooling=pooling) for name, rows, pooling in TABLES))
TOLERANCE = 1e-6
"""Relative and absolute, in float32: the same operations on both sides agree to the last bits (a wrong weight, order,
pooling or activation moves the logits by orders of magnitude more)."""

NameMap = list[tuple[str, str]]
"""``(pattern, replacement)`` rewrites, in order, taking a reference parameter's name to ours."""

TABLE_NAMES: NameMap = [(r"^sparse_arch\.embedding_bag_collection\.", "sparse_arch.ebc.")]
DLRM_NAMES: NameMap = [*TABLE_NAMES, (r"^dense_arch\.model\.", "dense_arch.mlp."), (r"^over_arch\.model\.", "over_arch.")]
"""TorchRec ``DLRM`` → ours: the tables, the bottom MLP, the top MLP (TorchRec's ``OverArch`` = ours ``over_arch``)."""
DLRM_DCN_NAMES: NameMap = [
    *TABLE_NAMES,
    (r"^inter_arch\.crossnet\.V_kernels\.(\d+)$", r"cross.layers.\1.project.0.weight"),   # V [r, W]: x → V x
    (r"^inter_arch\.crossnet\.W_kernels\.(\d+)$", r"cross.layers.\1.project.1.weight"),   # W [W, r]: → W (V x) + b
    (r"^inter_arch\.crossnet\.bias\.(\d+)$", r"cross.layers.\1.project.1.bias"),
    (r"^over_arch\.model\.0\.", "deep."),
    (r"^over_arch\.model\.1\.", "head."),
]
"""TorchRec ``DLRM_DCN`` → ours ``dcn_v2`` (stacked, low rank); its ``dense_arch`` (bottom MLP) has no counterpart."""
DEEPFM_NAMES: NameMap = [
    *TABLE_NAMES,
    (r"^dense_arch\.model\.0\.", "dense_arch.mlp._mlp.0._linear."),   # Linear, ReLU, Linear, ReLU
    (r"^dense_arch\.model\.2\.", "dense_arch.mlp._mlp.1._linear."),
    (r"^inter_arch\.deep_fm\.dense_module\.0\.", "deep.0._mlp.0._linear."),
]
"""TorchRec ``SimpleDeepFMNN`` → ours ``deepfm``, the parts they share; its ``over_arch`` has no counterpart."""


def ours(make_cfg: Callable[..., object], name: str, *overrides: str) -> nn.Module:
    """Our model ``name`` from its composed config (``overrides`` on it), its tables materialized on CPU."""
    cfg = make_cfg(f"model={name}", "tracking=none", f"model.embedding_dim={D}", *overrides)
    return materialize(validate(cfg).model.build(features=FEATURES, dense_device=torch.device("cpu")))  # type: ignore[arg-type]


def reference_tables() -> EmbeddingBagCollection:
    """The tables as TorchRec's DLRM example declares them: one ``EmbeddingBagConfig`` per feature."""
    pooling = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{name}", embedding_dim=D, num_embeddings=rows, feature_names=[name], pooling=pooling[p])
        for name, rows, p in TABLES])


def batch() -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """``(dense [B, D], sparse KJT, labels [B])``: dense values of both signs (a ReLU in the wrong place shows), bags of
    0 to 3 ids (an empty bag in every feature)."""
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(B, D, generator=g)
    lengths = torch.randint(0, 4, (len(TABLES), B), generator=g)
    lengths[:, 0] = 0
    values = torch.cat([torch.randint(0, rows, (int(n),), generator=g) for (_, rows, _), n in zip(TABLES, lengths.sum(1), strict=True)])
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[name for name, _, _ in TABLES], values=values, lengths=lengths.flatten())
    return dense, sparse, torch.randint(0, 2, (B,), generator=g).float()


def load_reference(model: nn.Module, reference: nn.Module, names: NameMap, ours_only: tuple[str, ...] = (),
                   reference_only: tuple[str, ...] = ()) -> dict[str, str]:
    """Load ``reference``'s weights into ``model`` by ``names``; ``{reference name: our name}`` of what was copied.

    Every parameter on either side is mapped, except those under the prefixes ``ours_only`` / ``reference_only`` (the
    parts one side has and the other has not), and each maps to one of the same shape (a trailing 1 aside:
    ``CrossNet``'s bias is ``[W, 1]``), so a wrong map fails here, not as a small difference in the logits.
    """
    ref_state, our_state = reference.state_dict(), model.state_dict()
    mapped: dict[str, str] = {}
    for ref_name in ref_state:
        if reference_only and ref_name.startswith(reference_only):
            continue
        our_name = ref_name
        for pattern, replacement in names:
            our_name = re.sub(pattern, replacement, our_name)
        mapped[ref_name] = our_name
    assert len(set(mapped.values())) == len(mapped), f"two reference parameters map to one of ours: {mapped}"
    expected = {n for n in our_state if not (ours_only and n.startswith(ours_only))}
    assert set(mapped.values()) == expected, (sorted(set(mapped.values()) - expected), sorted(expected - set(mapped.values())))
    for ref_name, our_name in mapped.items():
        value, target = ref_state[ref_name], our_state[our_name]
        assert value.squeeze(-1).shape == target.squeeze(-1).shape, (ref_name, value.shape, our_name, target.shape)
        with torch.no_grad():
            target.copy_(value.view_as(target))
    return mapped


def check_gradients(model: nn.Module, reference: nn.Module, mapped: dict[str, str]) -> None:
    """Every mapped parameter has the same gradient on both sides."""
    ref_params, our_params = dict(reference.named_parameters()), dict(model.named_parameters())
    for ref_name, our_name in mapped.items():
        ref_grad, our_grad = ref_params[ref_name].grad, our_params[our_name].grad
        assert ref_grad is not None and our_grad is not None, (ref_name, our_name)
        assert_equal(our_grad, ref_grad.view_as(our_grad), what=f"{our_name}'s gradient")


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """``actual`` is ``expected`` to :data:`TOLERANCE`."""
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE, atol=TOLERANCE, msg=lambda message: f"{what}: {message}")


def bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def test_dlrm_is_torchrec_dlrm(make_cfg) -> None:
    """``model=dlrm`` is TorchRec's ``DLRM`` with TorchRec's weights: the same logits (ours ``[B]``, TorchRec's
    ``[B, 1]``) and gradients. TorchRec's ``over_arch_layer_sizes`` ends in the 1-unit output layer; ours lists the
    hidden layers and adds it."""
    model = ours(make_cfg, "dlrm", "model.dense_arch_layer_sizes=[16,null]", "model.over_arch_layer_sizes=[32,16]")
    torch.manual_seed(1)
    reference = DLRM(reference_tables(), dense_in_features=D, dense_arch_layer_sizes=[16, D], over_arch_layer_sizes=[32, 16, 1])
    mapped = load_reference(model, reference, DLRM_NAMES)
    dense, sparse, labels = batch()

    logits, ref_logits = model(dense, sparse), reference(dense, sparse).squeeze(1)
    assert_equal(logits, ref_logits)
    bce(logits, labels).backward()
    bce(ref_logits, labels).backward()
    check_gradients(model, reference, mapped)


def test_dcn_v2_stacked_is_torchrec_dlrm_dcn_after_its_bottom_mlp(make_cfg) -> None:
    """``model=dcn_v2`` (stacked, low rank ``r``) is TorchRec's ``DLRM_DCN`` from its interaction on: the same cross
    network ``x0 ⊙ (W (V x) + b) + x`` over ``[dense, embeddings]`` and the same MLP after it (``deep_layer_sizes`` +
    the 1-unit head = TorchRec's ``over_arch_layer_sizes``). ``DLRM_DCN`` embeds the dense features by a bottom MLP
    first, ours crosses them raw (the paper's ``x0``), so the reference's ``dense_arch`` is left out."""
    model = ours(make_cfg, "dcn_v2", "model.structure=stacked", "model.num_cross_layers=2", "model.low_rank=4",
                 "model.num_experts=0", "model.deep_layer_sizes=[32,16]")
    torch.manual_seed(1)
    reference = DLRM_DCN(reference_tables(), dense_in_features=D, dense_arch_layer_sizes=[16, D],
                         over_arch_layer_sizes=[32, 16, 1], dcn_num_layers=2, dcn_low_rank_dim=4)
    mapped = load_reference(model, reference, DLRM_DCN_NAMES, reference_only=("dense_arch.",))
    dense, sparse, labels = batch()

    logits = model(dense, sparse)
    ref_logits = reference.over_arch(reference.inter_arch(dense, reference.sparse_arch(sparse))).squeeze(1)
    assert_equal(logits, ref_logits)
    bce(logits, labels).backward()
    bce(ref_logits, labels).backward()
    check_gradients(model, reference, mapped)


def test_full_rank_cross_network_is_torchrec_crossnet() -> None:
    """``model.low_rank=null``: each layer ``x0 ⊙ (W x + b) + x`` with a full ``W``, TorchRec's ``CrossNet``."""
    torch.manual_seed(0)
    width, layers = 12, 3
    model, reference = CrossNetwork(width, layers, low_rank=None), CrossNet(width, layers)
    with torch.no_grad():
        for i in range(layers):
            reference.bias[i].normal_()  # TorchRec starts them at 0: a mapped-away bias would not show
    names = [(r"^kernels\.(\d+)$", r"layers.\1.project.weight"), (r"^bias\.(\d+)$", r"layers.\1.project.bias")]
    mapped = load_reference(model, reference, names)
    x = torch.randn(B, width)

    out, ref_out = model(x), reference(x)
    assert_equal(out, ref_out)
    out.pow(2).sum().backward()
    ref_out.pow(2).sum().backward()
    check_gradients(model, reference, mapped)


def test_deepfm_shares_simple_deepfm_fields_and_first_deep_layer(make_cfg) -> None:
    """``model=deepfm`` and TorchRec's ``SimpleDeepFMNN`` build the same fields ``[dense projection, embeddings]``
    (``dense_arch_layer_sizes=[H, D]``: Linear, ReLU, Linear, ReLU, as TorchRec's ``DenseArch``) and the same first deep
    layer (Linear + ReLU over the flattened fields, ``deep_layer_sizes[0]`` = ``deep_fm_dimension``); with the same
    weights those agree, values and gradients.

    Their FM terms differ. Ours is the paper's ``Σ_{i<j} <v_i, v_j>`` over the ``F+1`` fields; TorchRec's
    ``FactorizationMachine`` flattens the fields first, so it sums the products of every two of the ``(F+1)·D``
    numbers (across dimensions and within a field too): ours over the flattened fields, each number a field of
    width 1. How the logit is made differs by design too (docs/models.md): ours ``first_order + fm + deep MLP → 1``,
    TorchRec's ``sigmoid(Linear([dense field, deep layer, fm]))``, no first-order term, probabilities out."""
    model = ours(make_cfg, "deepfm", "model.dense_arch_layer_sizes=[16,null]", "model.deep_layer_sizes=[32,16]")
    torch.manual_seed(1)
    reference = SimpleDeepFMNN(num_dense_features=D, embedding_bag_collection=reference_tables(), hidden_layer_size=16,
                               deep_fm_dimension=32)
    mapped = load_reference(model, reference, DEEPFM_NAMES, ours_only=("first_order.", "deep.0._mlp.1.", "deep.1."),
                            reference_only=("over_arch.",))
    dense, sparse, _ = batch()

    fields = torch.cat([model.dense_arch(dense).unsqueeze(1), model.sparse_arch.fields(model.sparse_arch(sparse))], dim=1)
    hidden = model.deep[0]._mlp[0](fields.flatten(1))
    pooled = reference.sparse_arch(sparse)
    ref_fields = [reference.dense_arch(dense), *(pooled[name] for name, _, _ in TABLES)]
    ref_hidden = reference.inter_arch.deep_fm(ref_fields)
    assert_equal(fields.flatten(1), torch.cat(ref_fields, dim=1))
    assert_equal(hidden, ref_hidden)
    hidden.pow(2).sum().backward()
    ref_hidden.pow(2).sum().backward()
    check_gradients(model, reference, mapped)

    pairs = sum((fields[:, i] * fields[:, j]).sum(1) for i in range(len(TABLES) + 1) for j in range(i + 1, len(TABLES) + 1))
    assert_equal(model.fm(fields), pairs)   # the paper's: dot products of distinct fields
    assert_equal(reference.inter_arch.fm(ref_fields).squeeze(1), model.fm(fields.flatten(1).unsqueeze(2)))


@pytest.mark.parametrize("names", [
    [(pattern, replacement) for pattern, replacement in DLRM_NAMES if "over_arch" not in pattern],
    [*DLRM_NAMES, ("t_cat_0", "swap"), ("t_cat_1", "t_cat_0"), ("swap", "t_cat_1")],
], ids=["unmapped", "swapped"])
def test_a_wrong_name_map_is_refused(make_cfg, names: NameMap) -> None:
    """The map is checked whole: a parameter left unmapped, or two tables swapped (their sizes differ), fails at
    loading, so a parity test cannot pass on weights that were never copied."""
    model = ours(make_cfg, "dlrm", "model.dense_arch_layer_sizes=[16,null]", "model.over_arch_layer_sizes=[32,16]")
    reference = DLRM(reference_tables(), dense_in_features=D, dense_arch_layer_sizes=[16, D], over_arch_layer_sizes=[32, 16, 1])
    with pytest.raises(AssertionError):
        load_reference(model, reference, names)
