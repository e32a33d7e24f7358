"""The served program's fused embedding bags (:mod:`recsys_runner.serving.fused`) pool exactly as TorchRec's
``EmbeddingBagCollection``: on a collection with every kind of table (widths, sum and mean, a table read by two
features, a batch key no table reads, per-id weights), in every model of the zoo, and in DeepFM's exported program,
whose lookups fall from one per table to one per group."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.serving.fused import FusedEmbeddingBags, for_serving
from recsys_runner.serving.program import ServingModule, export_program
from tests.test_models import MODELS, as_tensor, build, small_data


def _kjt(keys: list[str], rows: int, high: int, weighted: bool, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * rows,), generator=g)
    values = torch.randint(0, high, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.shape[0], generator=g) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


@pytest.mark.parametrize("weighted", [False, True])
def test_fused_bags_equal_the_collection_on_every_kind_of_table(weighted: bool) -> None:
    torch.manual_seed(0)
    mean = PoolingType.SUM if weighted else PoolingType.MEAN  # weights pool by sum only (torch's embedding_bag)
    tables = [
        EmbeddingBagConfig(name="t_a", embedding_dim=4, num_embeddings=11, feature_names=["a"]),
        EmbeddingBagConfig(name="t_wide", embedding_dim=8, num_embeddings=7, feature_names=["c"]),
        EmbeddingBagConfig(name="t_shared", embedding_dim=4, num_embeddings=13, feature_names=["d", "b"]),  # two features, out of order
        EmbeddingBagConfig(name="t_mean", embedding_dim=4, num_embeddings=5, feature_names=["e"], pooling=mean),
    ]
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted)
    keys = ["a", "b", "unread", "c", "d", "e"]  # "unread": a batch key no table reads (e.g. a history's event times)
    fused = FusedEmbeddingBags(ebc, keys)
    assert len(fused.groups) == (2 if weighted else 3)
    for seed in range(3):
        kjt = _kjt(keys, rows=5, high=5, weighted=weighted, seed=seed)
        want, got = ebc(kjt), fused(kjt)
        assert got.keys() == want.keys() and got.length_per_key() == want.length_per_key()
        torch.testing.assert_close(got.values(), want.values(), rtol=0, atol=1e-6)


def test_a_feature_outside_the_batch_keys_is_not_fused() -> None:
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=5, feature_names=["x"])])
    with pytest.raises(ValueError, match="'x' is not among the batch's keys"):
        FusedEmbeddingBags(ebc, ["y"])


@pytest.mark.parametrize("name", MODELS)
def test_every_model_scores_the_same_with_its_bags_fused(make_cfg, name: str) -> None:
    batch = next(iter(small_data(name).eval_batches(0, 1)))
    model = build(make_cfg, name).eval()
    served = for_serving(model, list(batch.sparse_features.keys()))
    replaced = [m for m in served.modules() if isinstance(m, FusedEmbeddingBags)]
    assert replaced or not any(isinstance(m, EmbeddingBagCollection) for m in model.modules())
    assert not any(isinstance(m, FusedEmbeddingBags) for m in model.modules()), "the model itself was changed"
    with torch.no_grad():
        want = as_tensor(model(batch.dense_features, batch.sparse_features))
        got = as_tensor(served(batch.dense_features, batch.sparse_features))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_deepfms_program_looks_up_once_per_group_and_scores_as_the_eager_model(make_cfg) -> None:
    batch = next(iter(small_data("deepfm").eval_batches(0, 1)))
    model = build(make_cfg, "deepfm").eval()
    keys = list(batch.sparse_features.keys())
    serving = ServingModule(model, keys)

    def lookups(program: torch.export.ExportedProgram) -> int:
        return sum(1 for n in program.graph.nodes if n.op == "call_function" and "embedding_bag" in str(n.target))

    with torch.no_grad():
        unfused = torch.export.export(serving, serving.inputs(batch), strict=False)
    program = export_program(serving, batch)  # what export writes
    assert lookups(unfused) == 2 * len(keys)  # the deep and the first-order table of each feature
    assert lookups(program) == 2  # one per width: 8 (deep) and 1 (first order)
    narrows = sum(1 for n in program.graph.nodes if n.op == "call_function" and "narrow" in str(n.target))
    assert narrows == 0, "the model slices the fused values per feature (models/lookup.concatenated_lookup takes them whole)"
    assert not any(isinstance(m, FusedEmbeddingBags) for m in serving.modules()), "export_program changed the module it was given"
    with torch.no_grad():
        torch.testing.assert_close(program.module()(*serving.inputs(batch)), serving(*serving.inputs(batch)), rtol=1e-6, atol=1e-6)
