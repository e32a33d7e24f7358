"""What an export holds of the tables (docs/export.md, "Memory"): the served copy shares the model's tables instead of
copying them, a fused float32 group holds its tables once (the model reads its rows there), quantizing goes table by
table in row chunks into the stored tensors and stores what quantizing the whole concatenation stores, and the float
tables are released once quantized. The peak itself is measured by ``python -m recsys_runner.bench.export_memory``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.serving import quantized_rows
from recsys_runner.serving.fused import FusedEmbeddingBags, for_serving
from recsys_runner.serving.quantize import quantize_tables, release_float_tables, table_bytes
from recsys_runner.serving.quantized_rows import QuantizedEmbeddings, QuantizedRows

KEYS = ["a", "b", "c"]


class Tables(nn.Module):
    """Two pooled tables of width 8 (one fused group), one of width 4, a history table, and a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="t_a", embedding_dim=8, num_embeddings=23, feature_names=["a"]),
            EmbeddingBagConfig(name="t_b", embedding_dim=8, num_embeddings=17, feature_names=["b"]),
            EmbeddingBagConfig(name="t_c", embedding_dim=4, num_embeddings=9, feature_names=["c"])])
        self.ec = EmbeddingCollection(tables=[EmbeddingConfig(name="h", embedding_dim=8, num_embeddings=31, feature_names=["c"])])
        self.dense = nn.Linear(4, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return torch.cat([self.ebc(kjt).values().sum(dim=1), self.ec(kjt)["c"].values().sum(dim=1), self.dense.weight.sum(dim=1)])


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=KEYS, values=torch.tensor([1, 22, 3, 16, 0, 8, 2, 5]), lengths=torch.tensor([2, 1, 1, 1, 2, 1]))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_the_served_copy_shares_the_tables_and_a_float_group_holds_them_once() -> None:
    model = Tables().eval().requires_grad_(False)
    want = model(_kjt())
    served = for_serving(model, KEYS)
    fused = next(m for m in served.modules() if isinstance(m, FusedEmbeddingBags))
    wide = next(g for g in fused.groups if g.weight.shape[1] == 8)
    assert wide.weight.shape[0] == 23 + 17
    for name in ("t_a", "t_b"):  # the model's rows are the fused table's: one copy in memory
        assert _storage(model.ebc.embedding_bags[name].weight) == _storage(wide.weight)
    assert served.ec.embeddings["h"].weight is model.ec.embeddings["h"].weight  # shared, not copied
    assert served.dense.weight is not model.dense.weight  # what is not a table is copied as before
    assert torch.equal(model(_kjt()), want) and torch.equal(served(_kjt()), want)  # and nobody's scores moved


@pytest.mark.parametrize("kind", ["int8", "int4", "fp16"])
def test_quantizing_in_chunks_stores_what_quantizing_the_concatenation_stores(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantized_rows, "CHUNK_ROWS", 7)  # 7 rows at a time: each table (23 and 17 rows) ends inside a chunk
    torch.manual_seed(1)
    tables = [torch.randn(23, 8) * 3, torch.randn(17, 8)]
    rows = QuantizedRows(tables, kind)
    whole = torch.cat(tables)
    if kind == "fp16":
        assert torch.equal(rows.codes, whole.half()) and rows.scale.numel() == rows.bias.numel() == 0
        return
    stored = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(whole, quantized_rows.BITS[kind])
    assert torch.equal(rows.codes, stored[:, :-4])
    scale_bias = stored[:, -4:].contiguous().view(torch.float16)
    assert torch.equal(rows.scale, scale_bias[:, 0]) and torch.equal(rows.bias, scale_bias[:, 1])


def test_released_float_tables_are_gone_but_counted_and_the_quantized_model_still_scores() -> None:
    model = Tables().eval().requires_grad_(False)
    served = quantize_tables(model, KEYS, "int8")
    want, counted = served(_kjt()), table_bytes(model)
    again = for_serving(served, KEYS)  # what export traces: the quantized rows shared, not copied
    first, second = (next(m for m in s.modules() if isinstance(m, QuantizedEmbeddings)) for s in (served, again))
    assert _storage(first.tables["h"].codes) == _storage(second.tables["h"].codes)
    release_float_tables(model)
    assert all(t.is_meta for m in (model.ebc, model.ec) for t in m.parameters()) and not model.dense.weight.is_meta
    assert table_bytes(model) == counted  # what feature_spec.json's table_bytes_float32 reads
    assert torch.equal(served(_kjt()), want)
