"""The feature-interaction models of issue 32 (xdeepfm, autoint, masknet, dcn, wukong): each paper's formula on a tiny
input, clear config errors, a learning test (third-order interactions that a factorization machine cannot learn), and
export: the served program scores like the trained model.

The suites over every ``conf/model`` option (test_models, test_model_structure, test_pipelines, test_fused_serving) also
run these models; this file adds what is specific to them, in-process and at tiny sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from torch import nn
from torchmetrics.functional.classification import binary_auroc
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner import export
from recsys_runner.config import GROUPS, validate
from recsys_runner.configurable import make
from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec, SparseFeature
from recsys_runner.models.autoint import AutoInt, AutoIntConfig, InteractingLayer
from recsys_runner.models.common import ModelConfig, materialize
from recsys_runner.models.dcn import DCN, DCNConfig
from recsys_runner.models.fm import FMConfig
from recsys_runner.models.masknet import FieldNorm, MaskBlock, MaskNet
from recsys_runner.models.wukong import FactorizationMachineBlock, Wukong, WukongLayer
from recsys_runner.models.xdeepfm import CIN, CINLayer, XDeepFMConfig
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.serving import program as serving
from tests.conftest import TINY
from tests.test_export import train_and_score
from tests.test_models import CPU, build, small_data

TINY_SIZES = {
    "xdeepfm": ["model.embedding_dim=8", "model.cin_layer_sizes=[8,8]", "model.deep_layer_sizes=[16]"],
    "autoint": ["model.embedding_dim=8", "model.num_layers=2", "model.attention_dim=8", "model.deep_layer_sizes=[16]"],
    "masknet": ["model.embedding_dim=8", "model.block_sizes=[16,16]", "model.reduction_ratio=1", "model.deep_layer_sizes=[16]"],
    "dcn": ["model.embedding_dim=8", "model.num_cross_layers=2", "model.deep_layer_sizes=[16]"],
    "wukong": ["model.embedding_dim=8", "model.dense_arch_layer_sizes=[null]", "model.num_layers=2", "model.num_fmb_fields=3",
               "model.num_lcb_fields=2", "model.fmb_rank=4", "model.fmb_layer_sizes=[16]", "model.deep_layer_sizes=[16]"],
}
"""Overrides that make each model small enough for a test of a few seconds."""


# --- each paper's formula -------------------------------------------------------------------------------------------


def test_cin_layer_is_the_papers_formula() -> None:
    """xDeepFM eq. 6: ``X^k_{h,*} = Σ_{i,j} W^{k,h}_{ij} (X^{k-1}_{i,*} ∘ X⁰_{j,*})`` (here ``D`` first)."""
    torch.manual_seed(0)
    x0, x = torch.randn(2, 5, 4), torch.randn(2, 5, 3)  # [B, D, m], [B, D, H_in]
    layer = CINLayer(num_fields=4, in_maps=3, out_maps=6)
    assert torch.allclose(layer(x0, x), torch.einsum("hij,bdi,bdj->bdh", layer.weight, x, x0), atol=1e-6)

    fields = torch.randn(2, 4, 5)  # [B, m, D]
    whole = CIN(4, [6, 6, 2], split_half=False)
    xs = [fields.transpose(1, 2)]
    for layer in whole.layers:
        xs.append(layer(xs[0], xs[-1]))
    pooled = torch.cat([h.sum(dim=1) for h in xs[1:]], dim=1)  # p⁺: every map of every layer, summed over D
    assert whole.output_dim == 14 and torch.allclose(whole(fields), pooled, atol=1e-5)

    split = CIN(4, [6, 4, 2], split_half=True)  # the authors' code: the first half of each map goes on, the second out
    h1 = split.layers[0](xs[0], xs[0])
    h2 = split.layers[1](xs[0], h1[..., :3])
    h3 = split.layers[2](xs[0], h2[..., :2])
    expected = torch.cat([h1[..., 3:].sum(1), h2[..., 2:].sum(1), h3.sum(1)], dim=1)
    assert split.output_dim == 7 and torch.allclose(split(fields), expected, atol=1e-5)


def test_interacting_layer_is_the_papers_formula() -> None:
    """AutoInt eqs. 5–8, head by head: ``α = softmax_k(⟨W_Q e_m, W_K e_k⟩)``, ``ẽ_m = Σ_k α_{m,k} W_V e_k``, the heads
    concatenated, ``ReLU(ẽ_m + W_Res e_m)``."""
    torch.manual_seed(0)
    e = torch.randn(2, 4, 6)  # [B, m, D]
    layer = InteractingLayer(in_dim=6, attention_dim=3, num_heads=2)
    heads = []
    for h in range(2):
        w_q, w_k, w_v = (w.weight[3 * h:3 * h + 3] for w in (layer.query, layer.key, layer.value))
        psi = torch.einsum("bmd,bkd->bmk", e @ w_q.T, e @ w_k.T)
        alpha = psi.exp() / psi.exp().sum(dim=2, keepdim=True)
        heads.append(alpha @ (e @ w_v.T))
    assert layer.res is not None
    assert torch.allclose(layer(e), torch.relu(torch.cat(heads, dim=2) + e @ layer.res.weight.T), atol=1e-6)
    plain = InteractingLayer(in_dim=6, attention_dim=3, num_heads=2, residual=False)
    assert plain.res is None and (plain(e) >= 0).all()


def test_mask_block_is_the_papers_formula(make_cfg) -> None:
    """MaskNet's instance-guided mask and MaskBlock: ``V_mask = W_d2 ReLU(W_d1 V_emb + β_d1) + β_d2``, ``ReLU(LN(W_i (V_mask ⊙ V_in)))``; the
    fields normalized one by one (``LN_EMB``); serial blocks chained, parallel ones side by side, every mask reading
    ``V_emb``."""
    torch.manual_seed(0)
    v_emb, x = torch.randn(3, 12), torch.randn(3, 8)
    block = MaskBlock(emb_dim=12, in_dim=8, out_dim=5, reduction_ratio=2.0)
    w1, w2 = block.mask[0], block.mask[2]
    assert w1.out_features == 16 and block.hidden.bias is None
    v_mask = (v_emb @ w1.weight.T + w1.bias).relu() @ w2.weight.T + w2.bias
    hidden = (v_mask * x) @ block.hidden.weight.T
    expected = torch.relu(nn.functional.layer_norm(hidden, (5,)) * block.norm.weight + block.norm.bias)
    assert torch.allclose(block(v_emb, x), expected, atol=1e-6)

    fields = torch.randn(3, 4, 6)
    norm = FieldNorm(4, 6)
    nn.init.normal_(norm.weight)
    each = [(f - f.mean(-1, keepdim=True)) / (f.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt() for f in fields.unbind(1)]
    assert torch.allclose(norm(fields), torch.stack(each, dim=1) * norm.weight + norm.bias, atol=1e-5)

    batch = next(iter(small_data().train_batches(0, 0, 1)))
    for structure in ("serial", "parallel"):
        model = build(make_cfg, "masknet", f"model.structure={structure}", *TINY_SIZES["masknet"])
        assert isinstance(model, MaskNet)
        with torch.no_grad():
            fields = model.fields(batch.dense_features, batch.sparse_features)
            v, x = fields.flatten(1), model.field_norm(fields).flatten(1)
            first, second = model.blocks
            top = first(v, x) if structure == "parallel" else second(v, first(v, x))
            if structure == "parallel":
                top = torch.cat([top, second(v, x)], dim=1)
            assert torch.allclose(model(batch.dense_features, batch.sparse_features), model.head(model.deep(top)).squeeze(1))


def test_dcn_cross_layer_is_the_papers_formula(make_cfg) -> None:
    """DCN's cross layer ``x_{l+1} = x0 x_lᵀ w_l + b_l + x_l``, twice, beside the deep network, combined by one unit."""
    model = build(make_cfg, "dcn", *TINY_SIZES["dcn"])
    assert isinstance(model, DCN) and model.deep is not None
    batch = next(iter(small_data().train_batches(0, 0, 1)))
    with torch.no_grad():
        x0 = torch.cat([batch.dense_features, model.sparse_arch(batch.sparse_features)], dim=1)
        x = x0
        for w, b in zip(model.cross.kernels, model.cross.bias, strict=True):  # w, b: [W, 1]
            x = x0 * (x @ w) + b.squeeze(1) + x
        assert torch.allclose(model.cross(x0), x, atol=1e-5)
        logits = model.head(torch.cat([x, model.deep(x0)], dim=1)).squeeze(1)
        assert torch.allclose(model(batch.dense_features, batch.sparse_features), logits, atol=1e-5)


def test_dcn_takes_mixed_embedding_widths() -> None:
    """The paper sizes each feature's embedding on its own; the cross network's width follows the sum."""
    features = FeatureSpec(dense_names=("x",), sparse=(SparseFeature("a", 10, embedding_dim=8), SparseFeature("b", 10, embedding_dim=16)))
    model = materialize(make(DCNConfig, embedding_dim=4, num_cross_layers=2, deep_layer_sizes=[8]).build(features=features, dense_device=CPU))
    assert isinstance(model, DCN) and model.head.in_features == (1 + 8 + 16) + 8
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.ones(4, dtype=torch.long))
    assert model(torch.randn(2, 1), kjt).shape == (2,)


def test_wukong_layer_is_the_papers_formula(make_cfg) -> None:
    """Wukong: ``FMB(X) = reshape(MLP(LN(flatten(X Xᵀ Y))))``, ``LCB(X) = W_L X`` and
    ``X_{i+1} = LN(concat(FMB(X_i), LCB(X_i)) + X_i)``, the residual mapped to the new field count when it changes."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 4)  # [B, n, D]
    fmb = FactorizationMachineBlock(num_fields=5, out_fields=3, embedding_dim=4, rank=2, layer_sizes=[6])
    fm = torch.einsum("bnd,bjd,jk->bnk", x, x, fmb.projection)  # the FM's X Xᵀ Y, [B, n, k]
    expected = fmb.mlp(nn.functional.layer_norm(fm.flatten(1), (10,), fmb.norm.weight, fmb.norm.bias)).view(2, 3, 4)
    assert torch.allclose(fmb(x), expected, atol=1e-5)

    layer = WukongLayer(num_fields=5, embedding_dim=4, fmb_fields=3, lcb_fields=2, rank=2, fmb_layer_sizes=[6])
    assert layer.lcb is not None and isinstance(layer.residual, nn.Identity)  # 3 + 2 fields out: the residual is X itself
    made = torch.cat([layer.fmb(x), torch.einsum("ln,bnd->bld", layer.lcb.weight, x)], dim=1)
    assert torch.allclose(layer(x), nn.functional.layer_norm(made + x, (4,), layer.norm.weight, layer.norm.bias), atol=1e-5)
    wider = WukongLayer(num_fields=5, embedding_dim=4, fmb_fields=3, lcb_fields=3, rank=2, fmb_layer_sizes=[])
    assert wider(x).shape == (2, 6, 4) and not isinstance(wider.residual, nn.Identity)

    model = build(make_cfg, "wukong", *TINY_SIZES["wukong"])
    assert isinstance(model, Wukong) and [m.out_fields for m in model.layers] == [5, 5]
    batch = next(iter(small_data().train_batches(0, 0, 1)))
    with torch.no_grad():
        x0 = torch.cat([model.dense_arch(batch.dense_features).unsqueeze(1),
                        model.sparse_arch.fields(model.sparse_arch(batch.sparse_features))], dim=1)  # the dense field first
        assert x0.shape == (8, 5, 8)
        assert torch.allclose(model(batch.dense_features, batch.sparse_features), model.deep(model.layers(x0).flatten(1)).squeeze(1))


# --- config errors: the key and the fix, before anything is built ---------------------------------------------------


BAD_SIZES = [
    ("xdeepfm", {"cin_layer_sizes": []}, r"model.cin_layer_sizes must list at least one layer size, e.g."),
    ("xdeepfm", {"cin_layer_sizes": [100, 0]}, r"model.cin_layer_sizes=\[100, 0\] has a non-positive layer size. "
                                               r"Fix: .* model.cin_layer_sizes=\[100,1\]"),
    ("xdeepfm", {"embedding_dim": 10}, r"model.embedding_dim=10 is not a multiple of 4.*model.embedding_dim=12"),
    ("autoint", {"num_heads": 0}, r"model.num_heads must be at least 1, got 0. Fix: .* model.num_heads=2"),
    ("autoint", {"attention_dim": -4}, r"model.attention_dim must be at least 1, got -4. Fix: .* model.attention_dim=32"),
    ("autoint", {"deep_layer_sizes": [400, 0]}, r"model.deep_layer_sizes=\[400, 0\] has a non-positive layer size"),
    ("masknet", {"structure": "stacked"}, r"model.structure='stacked' is not a MaskNet structure. Fix: model.structure=parallel"),
    ("masknet", {"block_sizes": []}, r"model.block_sizes must list at least one layer size, e.g."),
    ("masknet", {"reduction_ratio": 0}, r"model.reduction_ratio must be positive, got 0.0. Fix: e.g. model.reduction_ratio=3"),
    ("dcn", {"num_cross_layers": 0}, r"model.num_cross_layers must be at least 1, got 0. Fix: e.g. model.num_cross_layers=6"),
    ("dcn", {"deep_layer_sizes": [1024, -1]}, r"model.deep_layer_sizes=\[1024, -1\] has a non-positive layer size"),
    ("wukong", {"fmb_rank": 0}, r"model.fmb_rank must be at least 1, got 0. Fix: e.g. model.fmb_rank=24"),
    ("wukong", {"num_lcb_fields": -1}, r"model.num_lcb_fields must be at least 0, got -1. Fix: e.g. model.num_lcb_fields=16"),
    ("wukong", {"dense_arch_layer_sizes": [512, 64]}, r"model.dense_arch_layer_sizes ends in 64 but model.embedding_dim=16: "
                                                      r"Wukong's .* Fix: end model.dense_arch_layer_sizes in null"),
]
"""``(model, values, message)``: each model's config refuses ``values``, naming the key and the fix."""


@pytest.mark.parametrize(("name", "values", "message"), BAD_SIZES, ids=[f"{n}-{next(iter(v))}" for n, v, _ in BAD_SIZES])
def test_bad_sizes_name_the_key_and_the_fix(name: str, values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make(GROUPS["model"][name], **values)


def test_a_bad_size_on_the_command_line_stops_validate(make_cfg) -> None:
    """The same checks run in ``validate``, before a process group, data or model exists (one case: the path is shared)."""
    with pytest.raises(ConfigError, match=r"odd sizes \[101\] before its last layer.*Fix: even sizes, e.g. "
                                          r"model.cin_layer_sizes=\[102,50\], or model.cin_split_half=false"):
        validate(make_cfg("model=xdeepfm", "model.cin_layer_sizes=[101,50]", "tracking=none"))
    assert make(XDeepFMConfig, cin_layer_sizes=[101, 51], cin_split_half=False).cin_layer_sizes == [101, 51]


def test_autoint_without_a_dnn_is_plain_autoint() -> None:
    model = make(AutoIntConfig, deep_layer_sizes=[]).build(features=FeatureSpec(dense_names=("x",), sparse=(SparseFeature("a", 10),)),
                                                           dense_device=CPU)
    assert isinstance(model, AutoInt) and model.deep is None


# --- learning: a third-order interaction --------------------------------------------------------------------------------

NUM_IDS, NUM_FIELDS = 16, 5
"""Ids per field, fields (the label reads the first three; the others are noise)."""


def third_order_data(seed: int, rows: int) -> tuple[KeyedJaggedTensor, torch.Tensor, torch.Tensor]:
    """``(ids, labels [rows], true logits [rows])``: one id per field, ``logit = 4 · a_0[id_0] · a_1[id_1] · a_2[id_2]`` with
    per-id effects drawn from ``seed`` (the same world for every call with that seed; the rows from ``seed`` and ``rows``).
    Each field's effects come in pairs ``±v``, so given any one or two ids the third effect is symmetric about 0 and the
    click rate is exactly 1/2: no first- or second-order term carries signal, and a factorization machine's best AUC is 0.5."""
    world = torch.Generator().manual_seed(seed)
    half = torch.randn(3, NUM_IDS // 2, generator=world)
    effects = torch.cat([half, -half], dim=1)
    g = torch.Generator().manual_seed(seed * 1000 + rows)
    ids = torch.randint(NUM_IDS, (rows, NUM_FIELDS), generator=g)
    logit = 4 * effects[0, ids[:, 0]] * effects[1, ids[:, 1]] * effects[2, ids[:, 2]]
    labels = (torch.rand(rows, generator=g) < torch.sigmoid(logit)).float()
    return id_batch(ids), labels, logit


def id_batch(ids: torch.Tensor) -> KeyedJaggedTensor:
    """``ids [rows, F]`` as a KeyedJaggedTensor of one id per feature ``f0 … f{F-1}``."""
    return KeyedJaggedTensor(keys=[f"f{i}" for i in range(ids.shape[1])], values=ids.t().reshape(-1),
                             lengths=torch.ones(ids.numel(), dtype=torch.long))


@contextmanager
def one_thread() -> Iterator[None]:
    """Tiny ops on one thread: on a busy 2-core machine two threads made each step 15x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_on(config: ModelConfig, seed: int, steps: int = 500, batch: int = 256) -> float:
    """Eval AUC of ``config``'s model after ``steps`` Adam steps on :func:`third_order_data` (a plain loop: the architecture
    is what is tested)."""
    features = FeatureSpec(dense_names=(), sparse=tuple(SparseFeature(f"f{i}", NUM_IDS) for i in range(NUM_FIELDS)))
    with one_thread():
        torch.manual_seed(seed)
        model = materialize(config.build(features=features, dense_device=CPU))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        train, labels, _ = third_order_data(seed, steps * batch)
        ids = train.values().view(NUM_FIELDS, -1).t()
        dense = torch.zeros(batch, 0)
        for step in range(steps):
            rows = slice(step * batch, (step + 1) * batch)
            loss = nn.functional.binary_cross_entropy_with_logits(model(dense, id_batch(ids[rows])), labels[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        test, test_labels, _ = third_order_data(seed, 8192)
        with torch.no_grad():
            scores = model(torch.zeros(8192, 0), test)
    return float(binary_auroc(scores, test_labels.long()))


@pytest.mark.parametrize("seed", [1, 2])
def test_xdeepfm_learns_a_third_order_interaction_that_fm_cannot(seed: int) -> None:
    """FM stays at chance; xDeepFM's CIN (its second layer holds third-order terms) gets within 0.03 of the AUC of the true
    logits (0.86 and 0.78 for these seeds)."""
    _, labels, logits = third_order_data(seed, 8192)
    oracle = float(binary_auroc(logits, labels.long()))
    fm = train_on(make(FMConfig, embedding_dim=8), seed)
    xdeepfm = train_on(make(XDeepFMConfig, embedding_dim=8, cin_layer_sizes=[8, 8], deep_layer_sizes=[16]), seed)
    assert fm < 0.56, fm
    assert xdeepfm > fm + 0.2 and xdeepfm > oracle - 0.03, (xdeepfm, fm, oracle)


# --- export: the served program scores like the trained model --------------------------------------------------------

EXPORT = ["data.batch_size=64", "data.num_train_rows=1024", "data.num_eval_rows=256", "data.num_dense=3", "data.num_sparse=4",
          "train.num_steps=2", "train.log_every_steps=2", "train.eval_max_batches=1", "tracking=none"]
"""Two training steps on 7 columns: torch.export's tracing time grows with the features (~10 s for Criteo's 39)."""


@pytest.fixture
def export_cfg() -> Callable[..., DictConfig]:
    """``conf/export.yaml`` composed like the CLI, with the TINY settings."""
    export.register()

    def _make(*overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
            return compose(config_name="export", overrides=[*TINY, *overrides])

    return _make


@pytest.mark.parametrize("name", sorted(TINY_SIZES))
def test_export_scores_like_the_trained_model(make_cfg, export_cfg, tmp_path: Path, name: str) -> None:
    """Two training steps, ``export.run`` in this process, and ``model.pt2`` run on an eval batch the export never saw:
    equal to the trained (sharded) model's logits, restored from the same checkpoint."""
    overrides = [f"model={name}", *TINY_SIZES[name], *EXPORT]
    batch, expected = train_and_score(make_cfg, tmp_path / "ck", *overrides)
    out = export.run(export_cfg(*overrides, f"load={tmp_path / 'ck'}", f"export.dir={tmp_path / 'export'}", "export.mlflow_model=false"))
    program = torch.export.load(str(out / export.MODEL_FILE)).module()
    with torch.no_grad():
        got = program(*serving.serving_inputs(batch))
    assert got.shape == expected.shape == (64,)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
