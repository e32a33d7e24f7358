"""Embedding tables stored row-wise quantized for serving (``export.quantize``), looked up by plain torch ops: one table
(:class:`QuantizedRows`, a fused group's concatenated tables), an ``EmbeddingCollection``'s (:class:`QuantizedEmbeddings`).

The format is fbgemm's fused row-wise one, the format TorchRec's post-training quantization
(``torchrec.inference.modules.quantize_embeddings`` → ``torchrec.quant.embedding_modules.EmbeddingBagCollection``) stores:
each row's values as unsigned 8- or 4-bit codes (two 4-bit codes a byte, the even column in the low nibble) with an fp16
``scale`` and ``bias`` per row, a value being ``code * scale + bias``; or the row in fp16. The rows are quantized by
fbgemm's own ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`` at export time, and dequantized here by ATen ops only.

Why not TorchRec's quantized modules themselves: they run on CPU and go through ``torch.export`` (non-strict), but the
program then calls ``fbgemm.int_nbit_split_embedding_codegen_lookup_function`` (and ``bounds_check_indices``,
``asynchronous_complete_cumsum``), so loading it needs fbgemm_gpu: the served program and MLflow model would no longer load
with torch alone (docs/export.md). Dequantizing the looked-up rows, then pooling them with ``embedding_bag``, gives the same
values fbgemm's ``FusedNBitRowwiseQuantizedSBHalfToFloat`` gives (``tests/test_export_quantized.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

QUANTIZE = ("none", "fp16", "int8", "int4")
"""``export.quantize``'s values: ``none`` serves the float32 tables as trained."""

BITS = {"int8": 8, "int4": 4}
"""The code width of each row-wise integer kind."""

SCALE_BIAS_BYTES = 4
"""fp16 scale and fp16 bias per row of an integer kind."""


def row_bytes(width: int, kind: str) -> int:
    """The bytes of one stored row of ``width`` values in ``kind`` (``none``: float32)."""
    if kind == "none":
        return 4 * width
    if kind == "fp16":
        return 2 * width
    return (width * BITS[kind] + 7) // 8 + SCALE_BIAS_BYTES


def why_kept_float(width: int, kind: str) -> str | None:
    """Why a table of ``width`` values a row stays float32 under ``kind`` (``None``: it is quantized): a quantized row that
    would not be smaller (a first-order weight, one value a row, is 4 bytes; in int8 with its scale and bias it is 5), or
    an odd width in int4 (two codes a byte)."""
    if kind in BITS and width * BITS[kind] % 8:
        return f"{kind} packs {8 // BITS[kind]} values a byte: a width of {width} does not fill its last byte"
    if row_bytes(width, kind) >= row_bytes(width, "none"):
        return f"a {kind} row of {width} value(s) is {row_bytes(width, kind)} bytes, not smaller than float32's {row_bytes(width, 'none')}"
    return None


class QuantizedRows(nn.Module):
    """``weight [N, D]`` float (or a fused group's tables, ``[N_i, D]`` each, whose rows it stores one table after another)
    stored in ``kind`` (module docstring; ``none``: float32, as it is); called with ids ``[V]`` it returns their rows
    ``[V, D]`` float32, dequantized."""

    codes: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor

    def __init__(self, weight: torch.Tensor | Sequence[torch.Tensor], kind: str) -> None:
        super().__init__()
        if kind not in QUANTIZE:
            raise ValueError(f"no row-wise kind {kind!r}; one of {list(QUANTIZE)}")
        tables = [weight] if isinstance(weight, torch.Tensor) else list(weight)
        self.kind, self.width = kind, int(tables[0].shape[1])
        empty = torch.zeros(0, dtype=torch.float16)
        if kind == "none":  # a single float32 table is kept as it is, not copied
            codes = torch.cat([t.detach().float() for t in tables]) if len(tables) > 1 else tables[0].detach().float().contiguous()
            scale = bias = empty
        else:
            codes, scale, bias = _stored(tables, kind)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    @property
    def nbytes(self) -> int:
        """What the table takes in memory and in the program file: codes, scales and biases."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.bias))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        codes = self.codes.index_select(0, ids)
        if self.kind in ("none", "fp16"):
            return codes.float()
        if self.kind == "int4":  # the even column in the low nibble, the odd one in the high
            codes = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(ids.shape[0], self.width)
        return codes.float() * self.scale.index_select(0, ids).float().unsqueeze(1) + self.bias.index_select(0, ids).float().unsqueeze(1)


CHUNK_ROWS = 65_536
"""Rows converted at a time: quantizing a table needs fbgemm's output for this many rows beside the stored result, not a
float copy of the table or of a fused group (the rows are quantized one by one, so the codes are the same either way)."""


def _stored(tables: list[torch.Tensor], kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, scale, bias)`` of ``tables``' rows one after another in ``kind`` (``fp16``: the rows in float16 and no
    scale or bias), written :data:`CHUNK_ROWS` rows at a time into tensors allocated once at their final size.

    Why: a quantized export's memory is the float model, the quantized tables and this function's scratch; concatenating
    a group's tables in float32 first, then quantizing the whole, then slicing the codes out took three more float-sized
    tensors at once (docs/export.md, "Memory")."""
    rows, width = sum(int(t.shape[0]) for t in tables), int(tables[0].shape[1])
    if kind == "fp16":
        codes = torch.empty(rows, width, dtype=torch.float16)
        scale = bias = torch.zeros(0, dtype=torch.float16)
    else:
        import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm (TorchRec, which training runs, imports it too)

        codes = torch.empty(rows, (width * BITS[kind] + 7) // 8, dtype=torch.uint8)
        scale, bias = torch.empty(rows, dtype=torch.float16), torch.empty(rows, dtype=torch.float16)
    start = 0
    for table in tables:
        table = table.detach()
        for first in range(0, int(table.shape[0]), CHUNK_ROWS):
            chunk = table[first:first + CHUNK_ROWS].float().contiguous()
            end = start + int(chunk.shape[0])
            if kind == "fp16":
                codes[start:end].copy_(chunk)
            else:
                fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(chunk, BITS[kind])
                codes[start:end].copy_(fused[:, :-SCALE_BIAS_BYTES])
                scale_bias = fused[:, -SCALE_BIAS_BYTES:].contiguous().view(torch.float16)
                scale[start:end].copy_(scale_bias[:, 0])
                bias[start:end].copy_(scale_bias[:, 1])
            start = end
    return codes, scale, bias


class QuantizedEmbeddings(nn.Module):
    """An ``EmbeddingCollection`` (a history's tables: one row per event) with its tables stored in ``kind``, a table whose
    width does not gain by it kept float32 (:func:`why_kept_float`): ``KeyedJaggedTensor → {feature: JaggedTensor}``, the
    rows of each feature's ids with its lengths, as the collection returns them."""

    def __init__(self, ec: EmbeddingCollection, kind: str) -> None:
        super().__init__()
        if ec.need_indices():
            raise ValueError("a collection that returns its indices beside the rows is not quantized")
        self.tables = nn.ModuleDict()
        self.feature_tables: dict[str, str] = {}
        """Each feature read, to its table's name (one entry per feature: TorchRec names the output by the feature)."""
        for config in ec.embedding_configs():
            stored = kind if why_kept_float(config.embedding_dim, kind) is None else "none"
            self.tables[config.name] = QuantizedRows(ec.embeddings[config.name].weight, stored)
            self.feature_tables |= {f: config.name for f in config.feature_names}

    def stored(self) -> list[tuple[int, int, bool]]:
        """Each table's ``(width, bytes, quantized)`` as stored: what ``export.quantize`` reports."""
        return [(t.width, t.nbytes, t.kind != "none") for t in (cast(QuantizedRows, m) for m in self.tables.values())]

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        by_key = features.to_dict()
        return {f: JaggedTensor(values=self.tables[t](by_key[f].values().long()), lengths=by_key[f].lengths())
                for f, t in self.feature_tables.items()}
