"""``export.quantize``: the embedding tables served row-wise quantized (int8, int4, fp16), with what it costs on record.

DeepFM is trained for a few steps on a small generated CSV and exported twice, as trained (``none``) and in int8: the int8
export's programs (``model.pt2``, the MLflow model's) stay plain ATen (no fbgemm op: they load with torch alone), their
tables are ~3.2x smaller at width 16 (DeepFM's first-order tables, one value a row, stay float32: an int8 row of one value
with its scale and bias is 5 bytes), and the scores stay within :data:`PROBABILITY_ATOL` of the float model's on the
example batch and through the MLflow model on the training rows. DIN's history tables (an ``EmbeddingCollection``) are
quantized too. The row format is checked against fbgemm's own dequantization and a quantized collection's pooled output
against TorchRec's quantized ``EmbeddingBagCollection``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torchrec.inference.modules import quantize_embeddings
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner import export
from recsys_runner.__main__ import run as train
from recsys_runner.errors import ConfigError
from recsys_runner.serving import mlflow_model
from recsys_runner.serving.fused import FusedEmbeddingBags
from recsys_runner.serving.quantize import check_quantizable
from recsys_runner.serving.quantized_rows import QuantizedEmbeddings, QuantizedRows
from tests.test_evaluate import compose_entry

PROBABILITY_ATOL = 1e-2
"""Row-wise int8 moves a value by at most half its row's step, (max - min) / 255 / 2: the served probabilities stay
within this of the float model's."""

STEPS = 4


def _rows(rng: np.random.Generator, n: int) -> list[str]:
    """``click,user,item,price`` rows whose label follows the user."""
    out = []
    for _ in range(n):
        k = int(rng.integers(50))
        click = int((k % 2 == 0) == (rng.random() < 0.85))
        out.append(f"{click},u{k},{int(rng.integers(40))},{rng.random() * 10:.3f}")
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DeepFM trained on a CSV, exported as trained and with int8 tables."""
    root = tmp_path_factory.mktemp("quantized")
    (root / "train.csv").write_text("\n".join(["click,user,item,price", *_rows(np.random.default_rng(0), 512)]) + "\n")
    data = ["data=csv", f"data.path={root}/train.csv", "data.batch_size=128", "data.sparse=[{name: user}, {name: item}]",
            "data.dense=[{name: price, normalize: zscore}]", "data.label=click", "model=deepfm", "distributed.device=cpu",
            "tracking=none"]
    train(compose_entry("config", *data, f"train.num_steps={STEPS}", f"checkpoint.dir={root}/ck"))
    checkpoint = root / "ck" / f"step_{STEPS:08d}"
    out = {kind: export.run(compose_entry("export", *data, f"load={checkpoint}", f"export.dir={root}/{kind}", f"export.quantize={kind}"))
           for kind in ("none", "int8")}
    return {"root": root, "data": data, "checkpoint": checkpoint, **out}


def _fbgemm_ops(program_file: Path) -> list[str]:
    graph = torch.export.load(str(program_file)).graph
    return sorted({str(n.target) for n in graph.nodes if n.op == "call_function" and "fbgemm" in str(n.target)})


def _tensor_bytes(program_file: Path) -> int:
    """The bytes of every tensor a program holds (its parameters, buffers and constants)."""
    program = torch.export.load(str(program_file))
    tensors = [*program.state_dict.values(), *program.constants.values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def test_int8_tables_are_smaller_and_score_within_the_stated_tolerance(exported: dict[str, Any]) -> None:
    spec = json.loads((exported["int8"] / export.FEATURE_SPEC_FILE).read_text())
    cost = spec["quantize"]
    assert "quantize" not in json.loads((exported["none"] / export.FEATURE_SPEC_FILE).read_text())
    # the user and item tables of width 16 and their first-order tables of width 4 (DeepFM sums 4 floats per id), all int8
    rows = sum(f["num_embeddings"] for f in spec["sparse_features"])
    assert cost["table_bytes_float32"] == rows * (16 + 4) * 4
    assert cost["table_bytes"] == rows * (16 + 4) + rows * (4 + 4)  # a code a value, an fp16 scale and bias a row
    assert cost["kept_float32_widths"] == [] and cost["kept_float32_bytes"] == 0
    assert cost["smaller_by"] == pytest.approx(80 / 28, abs=1e-3)  # ~2.9x here; width 16 alone 3.2x, 64 alone 3.8x
    # the programs: plain ATen, smaller files, scores near the float model's
    assert _fbgemm_ops(exported["int8"] / export.MODEL_FILE) == []
    held = {k: _tensor_bytes(exported[k] / export.MODEL_FILE) for k in ("none", "int8")}  # the program holds the codes, no float copy
    assert held["none"] - held["int8"] == cost["table_bytes_float32"] - cost["table_bytes"]
    example = torch.load(exported["int8"] / export.EXAMPLE_FILE)
    programs = {k: torch.export.load(str(exported[k] / export.MODEL_FILE)).module() for k in ("none", "int8")}
    with torch.no_grad():
        logits = {k: p(*example["inputs"]) for k, p in programs.items()}
    torch.testing.assert_close(logits["int8"], example["outputs"], atol=1e-6, rtol=1e-6)  # the quantized model, traced exactly
    delta = (torch.sigmoid(logits["int8"]) - torch.sigmoid(logits["none"])).abs().max().item()
    assert 0 < delta <= PROBABILITY_ATOL
    measured = cost["example_batch"]
    assert measured["rows"] == len(example["outputs"]) and measured["max_abs_diff_probability"]["output"] == pytest.approx(delta, abs=1e-6)
    assert measured["max_abs_diff"]["output"] == pytest.approx((logits["int8"] - logits["none"]).abs().max().item(), abs=1e-6)
    assert set(measured["auc"]) == {"float32", "int8"} and abs(measured["auc"]["int8"] - measured["auc"]["float32"]) < 0.02
    assert abs(measured["logloss"]["int8"] - measured["logloss"]["float32"]) < 0.01


def test_the_mlflow_model_serves_the_int8_tables(exported: dict[str, Any]) -> None:
    import mlflow.pyfunc

    rows = pd.read_csv(exported["root"] / "train.csv", dtype=str).head(200)
    scores = {k: mlflow.pyfunc.load_model(str(exported[k] / mlflow_model.MODEL_DIR)).predict(rows)["score"].to_numpy()
              for k in ("none", "int8")}
    assert 0 < np.abs(scores["int8"] - scores["none"]).max() <= PROBABILITY_ATOL
    program = exported["int8"] / mlflow_model.MODEL_DIR / "data" / "data" / "model.pt2"
    assert _fbgemm_ops(program) == []
    requirements = (exported["int8"] / mlflow_model.MODEL_DIR / "requirements.txt").read_text()
    assert "fbgemm" not in requirements and "torchrec" not in requirements


def test_an_unknown_kind_names_the_choices(exported: dict[str, Any]) -> None:
    data, checkpoint, root = exported["data"], exported["checkpoint"], exported["root"]
    with pytest.raises(ConfigError, match=r"export.quantize='int3' must be one of \['none', 'fp16', 'int8', 'int4'\]"):
        export.run(compose_entry("export", *data, f"load={checkpoint}", f"export.dir={root}/bad", "export.quantize=int3"))
    assert not (root / "bad").exists()


@pytest.mark.slow
def test_a_model_with_history_tables_serves_them_quantized(tmp_path: Path) -> None:
    """DIN reads its history's tables one row per event (an EmbeddingCollection): they are quantized too."""
    din = ["model=din", "data=synthetic_sequences", "data.batch_size=64", "data.num_train_rows=256", "data.num_eval_rows=64",
           "distributed.device=cpu", "tracking=none"]
    train(compose_entry("config", *din, "train.num_steps=1", f"checkpoint.dir={tmp_path}/ck"))
    out = export.run(compose_entry("export", *din, f"load={tmp_path}/ck", f"export.dir={tmp_path}/out", "export.quantize=int8"))
    cost = json.loads((out / export.FEATURE_SPEC_FILE).read_text())["quantize"]
    assert cost["smaller_by"] == pytest.approx(64 / 20, abs=1e-3) and cost["kept_float32_bytes"] == 0  # every table of width 16
    assert _fbgemm_ops(out / export.MODEL_FILE) == []
    example = torch.load(out / export.EXAMPLE_FILE)
    with torch.no_grad():
        torch.testing.assert_close(torch.export.load(str(out / export.MODEL_FILE)).module()(*example["inputs"]), example["outputs"],
                                   atol=1e-6, rtol=1e-6)
    assert 0 < cost["example_batch"]["max_abs_diff_probability"]["output"] <= PROBABILITY_ATOL


def test_tables_the_path_does_not_cover_are_refused_naming_why() -> None:
    class Indexed(nn.Module):  # a collection that returns its ids beside its rows
        def __init__(self) -> None:
            super().__init__()
            self.ec = EmbeddingCollection(tables=[EmbeddingConfig(name="item_table", embedding_dim=8, num_embeddings=10,
                                                                  feature_names=["item"])], need_indices=True)

    with pytest.raises(ConfigError, match=r"export.quantize=int8: Indexed's tables \['item_table'\] return their ids beside their "
                                          r"rows \(need_indices\), which the quantized serving path does not cover. "
                                          r"Fix: export.quantize=none"):
        check_quantizable(Indexed(), ["item"], "int8")

    class Narrow(nn.Module):  # one value a row: an int8 row with its scale and bias would be larger than float32's
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="w", embedding_dim=1, num_embeddings=10,
                                                                         feature_names=["f"])])

    with pytest.raises(ConfigError, match=r"no table of Narrow would be quantized: a int8 row of 1 value\(s\) is 5 bytes, not "
                                          r"smaller than float32's 4"):
        check_quantizable(Narrow(), ["f"], "int8")


@pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning")  # TorchRec's quantize_embeddings
@pytest.mark.parametrize("kind", ["int8", "int4", "fp16"])
def test_rows_are_fbgemms_format_and_pool_as_torchrecs_quantized_collection(kind: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    rows = QuantizedRows(weight, kind)
    ids = torch.tensor([3, 0, 49, 3, 7])
    if kind == "fp16":
        assert torch.equal(rows(ids), weight.half().float()[ids]) and rows.nbytes == weight.numel() * 2
    else:
        bits = {"int8": 8, "int4": 4}[kind]
        fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(weight, bits)
        expected = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(fused, bits)[ids]
        assert torch.equal(rows(ids), expected) and rows.nbytes == fused.numel()

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50, feature_names=[f"f{i}"]) for i in range(2)]
    ebc = EmbeddingBagCollection(tables=tables)
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([1, 2, 3, 4, 5, 6, 49]), lengths=torch.tensor([1, 2, 0, 4]))

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = ebc

    dtype = {"int8": torch.qint8, "int4": torch.quint4x2, "fp16": torch.float16}[kind]
    reference = quantize_embeddings(Holder(), dtype=dtype, inplace=False).ebc(kjt)
    ours = FusedEmbeddingBags(ebc, ["f0", "f1"], kind)(kjt)
    torch.testing.assert_close(ours.values(), reference.values(), atol=1e-5, rtol=1e-5)

    # a history's collection: each id's row, dequantized, with the feature's lengths
    ec = EmbeddingCollection(tables=[EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50, feature_names=[f"f{i}"])
                                     for i in range(2)])
    unpooled = QuantizedEmbeddings(ec, kind)(kjt)
    for i, feature in enumerate(["f0", "f1"]):
        ids = kjt[feature].values()
        assert torch.equal(unpooled[feature].values(), QuantizedRows(ec.embeddings[f"t{i}"].weight, kind)(ids))
        assert torch.equal(unpooled[feature].lengths(), kjt[feature].lengths())
