"""Every model: output shape, a seeded forward pass that is stable across builds, clear config errors.

Models are built as the runner builds them — the composed ``model`` config, validated into its
``ModelConfig``, whose ``build`` is given ``features`` and ``dense_device`` — but without DistributedModelParallel, so the embedding
tables (created on ``meta``) are materialized on CPU by :func:`~recsys_runner.models.common.materialize` (which the other
model tests import from here).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec.datasets.utils import Batch

from recsys_runner.__main__ import run
from recsys_runner.config import GROUPS, validate
from recsys_runner.configurable import config_class, locate_class, make
from recsys_runner.data.base import DataModule
from recsys_runner.data.generated.synthetic import SyntheticData
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.data.generated.synthetic_sequences import SyntheticSequences, SyntheticSequencesConfig
from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec, ManagedCollision, SparseFeature
from recsys_runner.models.common import ModelConfig, materialize
from recsys_runner.models.dcn_v2 import CrossLayer, CrossNetwork, DCNv2, DCNv2Config
from recsys_runner.models.lr import LogisticRegression, LRConfig
from recsys_runner.models.wide_deep import WideArch
from recsys_runner.paths import CONFIG_PATH

MODELS = sorted(p.stem for p in (Path(CONFIG_PATH) / "model").glob("*.yaml"))
CPU = torch.device("cpu")


MULTI_TASK_MODELS = {"mmoe", "ple", "dbmtl", "esmm"}
"""Models with a ``[B]`` output per task (``ctr``, ``cvr``; ESMM adds ``ctcvr``): they are built on data with a label per task."""

OUTPUT_SHAPES = {**{m: (8, 2) for m in MULTI_TASK_MODELS}, "esmm": (8, 3), "dssm": (8, 8), "mind": (8, 8)}
"""Outputs other than logits ``[B]``: the multi-task models' two tasks (stacked), DSSM's query×candidate scores (SASRec's: see
:func:`check_sasrec_output`)."""

UNREAD_PARAMETERS = {"sasrec": ("arch.ebc.",)}
"""Parameters a model builds but never reads: SASRec's state depends on the history alone, so the pooled tables of the
other features (``user_id``) get no gradient."""

SEQUENCE_MODELS = {"din", "bst", "sasrec", "hstu_rank", "mind"}
"""Models that attend over a user's history (``data_needs().sequences``): they are built on generated histories."""


def small_data(name: str = "") -> DataModule:
    """Eight-row batches of the data ``name`` trains on: generated histories for a sequence model, else Criteo-shaped columns."""
    if name == "sasrec":
        return small_sequences(negatives=0.0)  # a next-item model: every candidate is the item that came next
    if name in SEQUENCE_MODELS:
        return small_sequences()
    tasks = ["ctr", "cvr"] if name in MULTI_TASK_MODELS else None
    return SyntheticData(make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50, num_train_rows=64, num_eval_rows=64, tasks=tasks))


def small_sequences(**overrides: object) -> SyntheticSequences:
    """Eight rows of generated histories (up to 6 events, some empty), with event times; ``overrides`` change the config."""
    values: dict[str, object] = {"batch_size": 8, "num_train_rows": 64, "num_eval_rows": 64, "num_users": 40, "num_items": 60,
                                 "num_categories": 6, "max_len": 6, "empty_fraction": 0.2, **overrides}
    return SyntheticSequences(make(SyntheticSequencesConfig, **values))


def as_tensor(out: torch.Tensor | dict[str, torch.Tensor] | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A multi-task model's ``{task: [B]}`` as ``[B, T]``; a next-item model's ``(scores, targets)`` as its scores;
    other outputs unchanged."""
    if isinstance(out, tuple):
        return out[0]
    return torch.stack(list(out.values()), dim=1) if isinstance(out, dict) else out


def check_sasrec_output(out: tuple[torch.Tensor, torch.Tensor], batch: Batch) -> None:
    """SASRec in training mode: ``(logits [P, K], positives [P])``, one row per real position (each event's successor
    and the candidate after the whole history: ``P = Σ lengths + B``); the first ``U`` columns are the distinct
    positive items, numbered densely, and the other ``K - U`` (``K = P`` here, fewer positions than items) hold no item
    and score ``-inf`` (fixed sizes: no device read to count ``U``, models/sasrec.py)."""
    logits, positives = out
    positions = int(batch.sparse_features["hist_item_id"].lengths().sum()) + batch.labels.shape[0]
    distinct = int(positives.unique().numel())
    assert logits.shape == (positions, positions) and positives.shape == (positions,)
    assert int(positives.max()) == distinct - 1
    assert torch.isfinite(logits[:, :distinct]).all() and bool((logits[:, distinct:] == float("-inf")).all())


def build(make_cfg, name: str, *overrides: str, seed: int = 0) -> nn.Module:
    cfg = make_cfg(f"model={name}", "tracking=none", *overrides)
    model_config = validate(cfg).model
    torch.manual_seed(seed)
    return materialize(model_config.build(features=small_data(name).features, dense_device=CPU))


def test_materialize_names_what_only_sharding_builds() -> None:
    """A managed-collision module's mapping starts on ``meta`` too and only DistributedModelParallel rebuilds it:
    :func:`materialize` says so and how to avoid it, rather than leaving a model that fails at its first lookup."""
    managed = SparseFeature("u", 10, managed_collision=ManagedCollision(input_hash_size=1000, eviction_interval=1))
    features = FeatureSpec(dense_names=("d",), sparse=(managed, SparseFeature("v", 10)))
    with pytest.raises(ValueError, match=r"LogisticRegression still has tensors on meta.*linear_t_u\._.*Fix: drop managed_collision"):
        materialize(LogisticRegression(make(LRConfig), features=features))
    plain = materialize(LogisticRegression(make(LRConfig), features=FeatureSpec(dense_names=("d",), sparse=(SparseFeature("v", 10),))))
    assert not any(t.is_meta for t in plain.parameters())


@pytest.mark.parametrize("name", MODELS)
def test_every_model_declares_its_config(name: str) -> None:
    schema = GROUPS["model"][name]
    assert issubclass(schema, ModelConfig) and "_partial_" not in {f.name for f in dataclasses.fields(schema)}
    assert config_class(locate_class(schema()._target_)) is schema


@pytest.mark.parametrize("name", MODELS)
def test_every_model_documents_its_shapes_and_an_example(name: str) -> None:
    """STYLE.md rule 5: the model class's docstring gives its input and output shapes and a runnable example (which
    tests/test_docstring_examples.py runs)."""
    doc = locate_class(GROUPS["model"][name]()._target_).__doc__ or ""
    assert "[B" in doc and "→" in doc, f"{name}: no shape legend (e.g. ``(dense [B, N], sparse KJT) → logits [B]``) in the class docstring"
    assert "Example::" in doc, f"{name}: no Example:: block in the class docstring"


@pytest.mark.parametrize("name", MODELS)
def test_forward_shape_and_seeded_stability(make_cfg, name: str) -> None:
    batch = next(iter(small_data(name).train_batches(0, 0, 1)))
    first, second, other = (build(make_cfg, name, seed=s) for s in (0, 0, 1))

    def forward(model: nn.Module) -> torch.Tensor:
        torch.manual_seed(7)  # the same dropout masks in every call (BST's transformer has dropout)
        return as_tensor(model(batch.dense_features, batch.sparse_features))

    with torch.no_grad():
        out = forward(first)
        if name == "sasrec":
            torch.manual_seed(7)
            check_sasrec_output(first(batch.dense_features, batch.sparse_features), batch)
        else:
            assert out.shape == OUTPUT_SHAPES.get(name, (8,))
        scored = out[out != float("-inf")] if name == "sasrec" else out  # SASRec's empty columns: check_sasrec_output
        assert out.dtype == torch.float32 and torch.isfinite(scored).all()
        assert torch.equal(out, forward(second)), "same seed, different output"
        assert not torch.equal(out, forward(other)), "the seed has no effect"
    logits = forward(first)
    logits.sum().backward()
    unread = UNREAD_PARAMETERS.get(name, ())
    assert all(p.grad is not None for n, p in first.named_parameters() if not n.startswith(unread)), "some parameter gets no gradient"


@pytest.mark.parametrize("overrides", [["model.structure=parallel", "model.low_rank=16"], ["model.low_rank=null"], ["model.num_cross_layers=1", "model.low_rank=4"],
                                       ["model.structure=parallel", "model.low_rank=4", "model.num_experts=3"]])
def test_dcn_v2_variants_build_and_run(make_cfg, overrides: list[str]) -> None:
    model = build(make_cfg, "dcn_v2", "model.embedding_dim=8", *overrides)
    batch = next(iter(small_data().train_batches(0, 0, 1)))
    assert model(batch.dense_features, batch.sparse_features).shape == (8,)


def test_cross_layer_is_the_papers_formula() -> None:
    torch.manual_seed(0)
    x0, x = torch.randn(5, 6), torch.randn(5, 6)
    full = CrossLayer(6)
    assert torch.allclose(full(x0, x), x0 * (x @ full.project.weight.T + full.project.bias) + x)
    low = CrossLayer(6, low_rank=2)
    v, u = low.project[0].weight, low.project[1]
    assert v.shape == (2, 6) and u.weight.shape == (6, 2)
    assert torch.allclose(low(x0, x), x0 * (x @ v.T @ u.weight.T + u.bias) + x)
    net = CrossNetwork(6, num_layers=2)
    assert torch.allclose(net(x0), net.layers[1](x0, net.layers[0](x0, x0)))


def test_dcn_mix_layer_is_the_papers_formula() -> None:
    """``model.num_experts=K``: ``x1 = Σ_i softmax_i(G_i x0) · x0 ⊙ (U_i ReLU(C_i ReLU(V_i x0)) + b) + x0`` (DCN-V2's eqs. 4–5)."""
    data = small_data()
    torch.manual_seed(0)
    model = DCNv2(make(DCNv2Config, embedding_dim=8, num_cross_layers=1, low_rank=4, num_experts=3, deep_layer_sizes=[16]),
                  features=data.features, dense_device=CPU)
    cross, width = model.cross, 3 + 4 * 8
    x0 = torch.randn(5, width)
    u, v, c, b = cross.U_kernels[0], cross.V_kernels[0], cross.C_kernels[0], cross.bias[0].squeeze(1)
    assert u.shape == (3, width, 4) and v.shape == (3, 4, width) and c.shape == (3, 4, 4)
    gates = torch.softmax(torch.cat([g(x0) for g in cross.gates], dim=1), dim=1)  # [5, K]
    experts = [x0 * (torch.relu(torch.relu(x0 @ v[i].T) @ c[i].T) @ u[i].T + b) for i in range(3)]
    expected = sum(gates[:, i : i + 1] * experts[i] for i in range(3)) + x0
    torch.testing.assert_close(cross(x0), expected)


def test_wide_arch_is_linear_in_the_ids() -> None:
    data = small_data()
    wide = materialize(WideArch(data.features, device=CPU))
    batch = next(iter(data.train_batches(0, 0, 1)))
    ids = batch.sparse_features.to_dict()
    expected = wide.dense(batch.dense_features).squeeze(1)
    for f in data.features.sparse:
        expected = expected + wide.ebc.embedding_bags[f"wide_t_{f.name}"].weight[ids[f.name].values()].sum(dim=1)
    assert torch.allclose(wide(batch.dense_features, batch.sparse_features), expected, atol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=dcn_v2", "model.structure=diagonal"], r"model.structure='diagonal' is not a DCNv2 structure. Fix: model.structure=stacked"),
        (["model=dcn_v2", "model.num_cross_layers=0"], "model.num_cross_layers must be at least 1"),
        (["model=dcn_v2", "model.low_rank=0"], "model.low_rank must be positive or null"),
        (["model=dcn_v2", "model.num_experts=4", "model.low_rank=null"],
         r"model.num_experts=4 mixes low-rank experts \(DCN-Mix\), but model.low_rank=null .* Fix: a rank, e.g. model.low_rank=64"),
        (["model=dcn_v2", "model.num_experts=-1"], r"model.num_experts must be 0 \(the plain cross layer\) or more, got -1"),
        (["model=dcn_v2", "model.deep_layer_sizes=[]"], "model.deep_layer_sizes must list at least one layer size"),
        (["model=wide_deep", "model.deep_layer_sizes=[64,0]"], r"model.deep_layer_sizes=\[64, 0\] has a non-positive layer size"),
        (["model=wide_deep", "model.embedding_dim=0"], "model.embedding_dim must be positive"),
        *(([f"model={m}", "model.embedding_dim=6"], r"model.embedding_dim=6 is not a multiple of 4: fbgemm's fused embedding kernels "
           r".* Fix: use a multiple of 4, e.g. model.embedding_dim=8") for m in ("deepfm", "dlrm", "dcn_v2", "wide_deep", "mmoe", "dssm")),
    ],
)
def test_bad_model_configs_say_what_to_fix(make_cfg, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(*overrides, "tracking=none"))


def test_dcn_v2_rank_not_below_the_cross_width_is_refused() -> None:
    # width = 3 dense + 4 sparse × 8 = 35
    with pytest.raises(ConfigError, match=r"model.low_rank=35 is not below the cross input width 35 .* Fix: model.low_rank=null"):
        DCNv2(make(DCNv2Config, embedding_dim=8, num_cross_layers=2, low_rank=35, structure="stacked", deep_layer_sizes=[16]),
              features=small_data().features)


def test_mmoe_gates_mix_experts_per_task(make_cfg) -> None:
    model = build(make_cfg, "mmoe", "model.num_experts=3", "model.expert_layer_sizes=[16]", "model.loss_weights=[1.0,0.5]")
    assert [(t.name, t.column, t.weight) for t in model.tasks] == [("ctr", 0, 1.0), ("cvr", 1, 0.5)]
    x = torch.randn(8, model.gates["ctr"].logits.in_features)
    experts = model.experts(x)
    assert experts.shape == (8, 3, 16)
    weights = torch.softmax(model.gates["cvr"].logits(x), dim=1)
    assert torch.allclose(model.gates["cvr"](x, experts), (weights.unsqueeze(2) * experts).sum(1), atol=1e-6)


def test_dssm_scores_are_scaled_cosines(make_cfg) -> None:
    model = build(make_cfg, "dssm", "model.user_features=[cat_0,int_0]", "model.item_features=[cat_1,cat_2]", "model.temperature=0.5")
    batch = next(iter(small_data("dssm").train_batches(0, 0, 1)))
    user, item = model.user_item(batch.dense_features, batch.sparse_features)
    assert user.shape == item.shape == (8, 32)
    assert torch.allclose(user.norm(dim=1), torch.ones(8)) and torch.allclose(item.norm(dim=1), torch.ones(8))
    assert torch.allclose(model(batch.dense_features, batch.sparse_features), user @ item.t() / 0.5, atol=1e-6)


# --- per-feature embedding widths: each model states what it needs (``same_embedding_width``) ---

MIXED = "data.sparse=[{name: cat_0, num_embeddings: 50, embedding_dim: 8}, {name: cat_1, num_embeddings: 50, embedding_dim: 16}, " \
        "{name: cat_2, num_embeddings: 50}]"
"""Three tables of widths 8, 16 and ``model.embedding_dim=8``."""


def mixed_width_csv(tmp_path: Path) -> Path:
    """A small CSV whose click depends on the ids: ``label`` (and ``ctr``/``cvr``), ``int_0``, ``cat_0..2``."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(50, (512, 3), generator=g)
    dense = torch.randn(512, generator=g)
    click = (torch.rand(512, generator=g) < torch.sigmoid((ids[:, 0] % 5 - 2).float() + dense)).long()
    conversion = click * (ids[:, 1] % 2)
    rows = [f"{int(c)},{int(c)},{int(v)},{float(d):.4f},{int(a)},{int(b)},{int(e)}"
            for c, v, d, (a, b, e) in zip(click, conversion, dense, ids.tolist(), strict=True)]
    path = tmp_path / "mixed.csv"
    path.write_text("label,ctr,cvr,int_0,cat_0,cat_1,cat_2\n" + "\n".join(rows) + "\n")
    return path


def mixed_width_cfg(make_cfg, tmp_path: Path, name: str, *overrides: str):
    labels = ["data.label=null", "data.labels={ctr: ctr, cvr: cvr}"] if name == "mmoe" else ["data.label=label"]
    return make_cfg(f"model={name}", "data=csv", f"data.path={mixed_width_csv(tmp_path)}", "data.eval_fraction=0.25",
                    "data.batch_size=32", *labels, MIXED, "data.dense=[{name: int_0}]", "model.embedding_dim=8",
                    "train.num_steps=4", "train.log_every_steps=2", "train.eval_every_steps=null", "distributed.device=cpu",
                    "optim=adagrad", "tracking=none", *overrides, tiny=False)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("mmoe", []), ("dssm", ["model.user_features=[cat_0,int_0]", "model.item_features=[cat_1,cat_2]", "model.eval_metrics=[inbatch_recall@10]"]), ("wide_deep", []),
     ("dcn_v2", ["model.low_rank=8"])],
)
def test_concatenating_models_train_with_mixed_widths(make_cfg, tmp_path: Path, name: str, overrides: list[str]) -> None:
    cfg = mixed_width_cfg(make_cfg, tmp_path, name, *overrides)
    model = validate(cfg).model.build(features=validate(cfg).data.build().features, dense_device=CPU)
    assert model.sparse_arch.widths == [8, 16, 8] and model.sparse_arch.output_dim == 32
    assert math.isfinite(run(cfg))


@pytest.mark.parametrize(
    ("name", "why"),
    [("deepfm", "its FM term takes dot products between every pair of fields"),
     ("dlrm", "its interaction takes dot products between the dense vector and every embedding")],
)
def test_interaction_models_refuse_mixed_widths_saying_why(make_cfg, tmp_path: Path, name: str, why: str) -> None:
    model = {"deepfm": "DeepFM", "dlrm": "DLRM"}[name]
    cfg = mixed_width_cfg(make_cfg, tmp_path, name, "model.dense_arch_layer_sizes=[8]")
    with pytest.raises(ConfigError, match=rf"{model} needs one embedding width for every feature \(model.embedding_dim=8\): {why}.*"
                                          r"data.sparse sets embedding_dim \{'cat_1': 16\}"):
        run(cfg)


@pytest.mark.parametrize("model", ["lr", "fm"])
def test_baselines_train_on_the_default_data(make_cfg, model: str) -> None:
    auc = run(make_cfg(f"model={model}", "tracking=none", "train.num_steps=20"))
    assert auc > 0.55, auc


def test_dlrm_interaction_exports_without_torch_exports_shared_storage_warning(tmp_path: Path) -> None:
    """DotInteraction's index buffers were the two halves of one triu_indices tensor; ``torch.export.save`` of a model with
    them (every ``export model=dlrm``) warned "No complete tensor found in the group! Returning the first one". Now each
    is its own tensor, and the saved program computes what the module does."""
    import warnings

    from recsys_runner.models.dlrm import DotInteraction

    interaction, dense, sparse = DotInteraction(num_sparse=3), torch.randn(4, 8), torch.randn(4, 3, 8)
    program = torch.export.export(interaction, (dense, sparse))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.export.save(program, str(tmp_path / "dot.pt2"))
    assert [str(w.message) for w in seen if "complete tensor" in str(w.message)] == []
    torch.testing.assert_close(torch.export.load(str(tmp_path / "dot.pt2")).module()(dense, sparse), interaction(dense, sparse))
