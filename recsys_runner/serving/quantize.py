"""``export.quantize``: the model's embedding tables served row-wise quantized, and what that costs.

:func:`check_quantizable` refuses, before an export writes anything, a model whose tables the quantized path does not
cover; :func:`quantize_tables` gives the model with its pooled tables (``EmbeddingBagCollection``, fused) and its history
tables (``EmbeddingCollection``, one row per event) stored in int8, int4 or fp16 (:mod:`~recsys_runner.serving.fused`,
:mod:`~recsys_runner.serving.quantized_rows`), which export then traces, checks and writes as it does the float model,
the float tables released (:func:`release_float_tables`); :func:`cost` is what it costs — the tables' bytes before and
after, and the scores on the example batch of the float model against the quantized one — for ``feature_spec.json`` and
the log.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from recsys_runner.errors import ConfigError
from recsys_runner.metrics.functional import binary_auc
from recsys_runner.serving.fused import FusedEmbeddingBags, for_serving, fusion_groups
from recsys_runner.serving.quantized_rows import QuantizedEmbeddings, why_kept_float
from recsys_runner.tasks import Task

log = logging.getLogger("recsys_runner")

FORMATS = {
    "int8": "row-wise int8: uint8 codes with an fp16 scale and bias per row (fbgemm's fused 8-bit row-wise format, TorchRec's "
            "quantized EmbeddingBagCollection's), dequantized by ATen ops in the program",
    "int4": "row-wise int4: two 4-bit codes a byte with an fp16 scale and bias per row (fbgemm's fused 4-bit row-wise format), "
            "dequantized by ATen ops in the program",
    "fp16": "each row in float16, pooled in float32",
}


def check_quantizable(model: nn.Module, keys: list[str], kind: str) -> None:
    """Refuse ``export.quantize=kind`` for ``model`` (its batch's sparse ``keys``) unless every embedding table it has is in
    TorchRec's ``EmbeddingBagCollection`` that :mod:`~recsys_runner.serving.fused` fuses or its ``EmbeddingCollection`` (not
    returning its ids: ``need_indices``), and one of them gains by ``kind``.

    Raises:
        ConfigError: naming the tables the path does not cover, and why.
    """
    name = type(model).__name__
    fix = "Fix: export.quantize=none (the float32 tables)"
    other = sorted({type(m).__name__ for m in model.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
                    and type(m) not in (EmbeddingBagCollection, EmbeddingCollection)})
    histories = [m for m in model.modules() if isinstance(m, EmbeddingCollection) and type(m) is EmbeddingCollection]
    indexed = [c.name for m in histories if m.need_indices() for c in m.embedding_configs()]
    if other or indexed:
        raise ConfigError(f"export.quantize={kind}: {name}'s tables "
                          + (f"in {other} (not TorchRec's EmbeddingBagCollection or EmbeddingCollection)" if other else
                             f"{indexed} return their ids beside their rows (need_indices)")
                          + f", which the quantized serving path does not cover. {fix}")
    collections = [m for m in model.modules() if type(m) is EmbeddingBagCollection]
    widths = [c.embedding_dim for m in histories for c in m.embedding_configs()]
    for ebc in collections:
        try:
            groups = fusion_groups(ebc, keys)
        except ValueError as e:
            raise ConfigError(f"export.quantize={kind}: {name}'s tables cannot be served fused, which quantizing them needs: {e}. "
                              f"{fix}") from e
        widths += [width for width, _, _ in groups]
    if not any(why_kept_float(w, kind) is None for w in widths):
        reasons = sorted({str(why_kept_float(w, kind)) for w in widths}) or ["it has no EmbeddingBagCollection or EmbeddingCollection"]
        raise ConfigError(f"export.quantize={kind}: no table of {name} would be quantized: {'; '.join(reasons)}. "
                          f"{fix}" + (", or export.quantize=int8" if kind == "int4" else ""))


def quantize_tables(model: nn.Module, keys: list[str], kind: str) -> nn.Module:
    """A copy of ``model`` (weights loaded, eval mode) whose tables are stored in ``kind``: each ``EmbeddingBagCollection``
    fused (:func:`~recsys_runner.serving.fused.for_serving`); ``model`` is left as it was, the float reference."""
    served = for_serving(model, keys, kind)
    for name, module in list(served.named_modules()):
        if type(module) is EmbeddingCollection:
            parent, _, attribute = name.rpartition(".")
            setattr(served.get_submodule(parent) if parent else served, attribute, QuantizedEmbeddings(module, kind))
    left = [n for n, m in served.named_modules() if type(m) is EmbeddingBagCollection]
    if left:  # check_quantizable ran before the export started; this is its invariant
        raise ConfigError(f"export.quantize={kind}: the collections {left} were not fused: this is a bug; please report it")
    return served.eval()


def release_float_tables(model: nn.Module) -> None:
    """Free the rows of ``model``'s ``EmbeddingBagCollection`` and ``EmbeddingCollection`` tables once
    :func:`quantize_tables` has stored them and their scores are computed: each becomes a ``meta`` tensor of its shape and
    dtype (what :func:`table_bytes` reads; reading its rows is then an error, never a silent zero).

    Why: the float tables are the largest thing an export holds; kept beside the quantized model they would be there while
    the program is traced, saved (``torch.export.save`` holds two copies of a tensor's bytes as it writes it) and checked
    through the MLflow model. A table the quantized model serves in float32 (too narrow to gain) is not lost: the served
    model holds its rows (:func:`~recsys_runner.serving.fused.for_serving`)."""
    for collection in model.modules():
        if type(collection) in (EmbeddingBagCollection, EmbeddingCollection):
            for module in collection.modules():
                for name, table in list(module.named_parameters(recurse=False)):
                    module.register_parameter(name, nn.Parameter(torch.empty_like(table, device="meta"), requires_grad=False))


def table_bytes(model: nn.Module) -> tuple[int, int]:
    """The bytes of the ``EmbeddingBagCollection`` tables of ``model`` as stored, and of those kept float32; a quantized
    model's (:func:`quantize_tables`) as quantized."""
    stored = kept = 0
    for module in model.modules():
        if type(module) in (EmbeddingBagCollection, EmbeddingCollection):
            stored += sum(p.numel() * p.element_size() for p in module.parameters())
        elif isinstance(module, (FusedEmbeddingBags, QuantizedEmbeddings)):
            for _, size, quantized in module.stored():
                stored += size
                kept += 0 if quantized else size
    return stored, kept


def cost(kind: str, float_model: nn.Module, served: nn.Module, before: Any, after: Any, tasks: tuple[Task, ...],
         labels: torch.Tensor | None) -> dict[str, Any]:
    """``feature_spec.json``'s ``quantize``: the tables' bytes in float32 and in ``kind``, and on the example batch the
    largest difference of each output (``before``: the float model's, ``after``: the quantized one's), of each binary
    task's probability, and a binary model's AUC and log loss before and after when the batch has ``labels``; logged."""
    float_bytes, _ = table_bytes(float_model)
    quantized_bytes, kept = table_bytes(served)
    kept_widths = sorted({width for m in served.modules() if isinstance(m, (FusedEmbeddingBags, QuantizedEmbeddings))
                          for width, _, quantized in m.stored() if not quantized})
    named = isinstance(before, dict)
    pairs = {_key(t): (before[t.name], after[t.name]) for t in tasks} if named else {_key(tasks[0]): (before, after)}
    example: dict[str, Any] = {"rows": int(next(iter(pairs.values()))[0].shape[0])}
    example["max_abs_diff"] = {n: float((b.float() - a.float()).abs().max()) for n, (b, a) in pairs.items()}
    binary = [_key(t) for t in tasks if t.kind == "binary"]
    if binary:
        example["max_abs_diff_probability"] = {
            n: float((torch.sigmoid(pairs[n][0].float()) - torch.sigmoid(pairs[n][1].float())).abs().max()) for n in binary}
    if not named and len(binary) == 1 and labels is not None and labels.numel() == example["rows"]:
        target = labels.reshape(-1).float()
        for metric, of in (("auc", lambda x: float(binary_auc(x, target))),
                           ("logloss", lambda x: float(F.binary_cross_entropy_with_logits(x, target)))):
            example[metric] = {"float32": of(before.reshape(-1).float()), kind: of(after.reshape(-1).float())}
    described = {"kind": kind, "format": FORMATS[kind], "table_bytes_float32": float_bytes, "table_bytes": quantized_bytes,
                 "smaller_by": round(float_bytes / max(quantized_bytes, 1), 3), "kept_float32_bytes": kept,
                 "kept_float32_widths": kept_widths, "example_batch": example}
    log.info("quantized the tables to %s: %s -> %s bytes (%.2fx smaller%s); example batch of %d rows: max |diff| of the outputs "
             "%s%s%s", kind, f"{float_bytes:,}", f"{quantized_bytes:,}", described["smaller_by"],
             f", widths {kept_widths} kept float32" if kept_widths else "", example["rows"], _short(example["max_abs_diff"]),
             f", of the probabilities {_short(example['max_abs_diff_probability'])}" if binary else "",
             "".join(f", {m} {_num(example[m]['float32'])} -> {_num(example[m][kind])}" for m in ("auc", "logloss") if m in example))
    return described


def _key(task: Task) -> str:
    """A task's entry in the report: its name (``output`` for a model's one unnamed task)."""
    return task.name or "output"


def _short(values: dict[str, float]) -> str:
    """``0.00312`` for a model's one output, ``ctr 0.00076, cvr 0.0013`` for a multi-task model's."""
    if list(values) == ["output"]:
        return f"{values['output']:.3g}"
    return ", ".join(f"{k} {v:.3g}" for k, v in values.items())


def _num(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.5f}"
