"""MaskNet (Wang, She, Zhang, 2021, "MaskNet: Introducing Feature-Wise Multiplication to CTR Ranking Models by Instance-Guided Mask", https://arxiv.org/abs/2102.07619) on TorchRec.

Shape legend: ``B`` batch size, ``N`` dense features, ``F`` sparse features, ``m = N + F`` fields, ``D`` embedding
dim, ``W = m·D`` the flattened fields' width.

Every input is a field of width ``D`` (:class:`~recsys_runner.models.common.FieldArch`: a dense feature's field is
its value times a learned vector, as the paper embeds numbers), flattened into ``V_emb [B, W]``. An instance-guided
mask is a two-layer MLP of ``V_emb`` (a wide aggregation layer, ReLU, a projection to the width it masks), so every row
scales the vector it masks by its own weights. A MaskBlock multiplies its input by such a mask and runs a feed-forward
layer with layer norm: ``ReLU(LN(W · (V_mask ⊙ V_in)))``. The first block's input is the layer-normalized fields
(``LN_EMB``: each field normalized on its own); in ``serial`` MaskNet (SerMaskNet) each later block masks the previous
block's output, in ``parallel`` MaskNet (ParaMaskNet) every block reads the fields and their outputs are concatenated.
Every mask reads ``V_emb``. A deep MLP and one linear unit give the logit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import require
from recsys_runner.features import FeatureSpec, check_embedding_dim
from recsys_runner.models.common import MLP, FieldArch, ModelConfig, check_layer_sizes

STRUCTURES = ("serial", "parallel")
"""How the MaskBlocks combine (see the module docstring)."""


@dataclass(kw_only=True)
class MaskNetConfig(ModelConfig):
    """Schema of ``conf/model/masknet.yaml``. Defaults: TorchEasyRec's Criteo example (``examples/masknet_criteo.config``:
    ParaMaskNet of 3 blocks of 512, reduction ratio 3, a top MLP of 256, 128, 64, every field 16 wide)."""

    _target_: str = "recsys_runner.models.masknet.MaskNet"
    embedding_dim: int = 16
    """Width ``D`` of every field: each embedding table and each dense feature's vector; a per-feature
    ``embedding_dim`` in ``data.sparse`` must equal it."""
    structure: str = "parallel"
    """``parallel`` (ParaMaskNet: every block reads the fields, outputs concatenated) or ``serial`` (SerMaskNet: each
    block masks the previous block's output)."""
    block_sizes: list[int] = field(default_factory=lambda: [512, 512, 512])
    """Output width of each MaskBlock's feed-forward layer, one entry per block (in order, for ``serial``)."""
    reduction_ratio: float = 3.0
    """Width of each mask's aggregation layer over the width of the vector it masks (the paper's ``r``, as TorchEasyRec
    and FuxiCTR define it: aggregation width = ratio × masked width)."""
    deep_layer_sizes: list[int] = field(default_factory=lambda: [256, 128, 64])
    """Hidden layers of the MLP over the blocks' output (a final 1-unit layer is added); ``[]``: the blocks' output goes
    straight to that unit, as in the paper's SerMaskNet."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        require(self.structure in STRUCTURES,
                f"model.structure={self.structure!r} is not a MaskNet structure. Fix: model.structure=parallel or model.structure=serial")
        check_layer_sizes("block_sizes", self.block_sizes)
        require(self.reduction_ratio > 0, f"model.reduction_ratio must be positive, got {self.reduction_ratio}. Fix: e.g. "
                                          f"model.reduction_ratio=3 (each mask's aggregation layer 3x the width it masks)")
        check_layer_sizes("deep_layer_sizes", self.deep_layer_sizes, allow_empty=True)


class FieldNorm(nn.Module):
    """``LN_EMB``: each field layer-normalized over its own ``D`` values, with a gain and bias per field:
    ``[B, m, D] → [B, m, D]``.

    Example::

        >>> import torch
        >>> from recsys_runner.models.masknet import FieldNorm
        >>> FieldNorm(num_fields=5, embedding_dim=8)(torch.randn(4, 5, 8)).shape
        torch.Size([4, 5, 8])
    """

    def __init__(self, num_fields: int, embedding_dim: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_fields, embedding_dim, device=device))
        self.bias = nn.Parameter(torch.zeros(num_fields, embedding_dim, device=device))

    def forward(self, fields: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(fields, fields.shape[-1:]) * self.weight + self.bias


class MaskBlock(nn.Module):
    """One MaskBlock: ``(v_emb [B, W], x [B, in_dim]) → ReLU(LN(W_h (mask(v_emb) ⊙ x)))  [B, out_dim]``, where
    ``mask(v) = W_2 ReLU(W_1 v + b_1) + b_2`` is the instance-guided mask (aggregation layer ``reduction_ratio × in_dim``
    wide, projection ``in_dim`` wide) and ``W_h`` has no bias (the layer norm's bias takes its place).

    Args:
        emb_dim: ``W``, the width of ``v_emb`` (what every mask reads).
        in_dim: width of the masked input ``x`` (``W`` when it is the fields, else the previous block's output).
        out_dim: the block's output width.
        reduction_ratio: aggregation width over ``in_dim`` (rounded).
        device: device of the weights.

    Raises:
        ConfigError: a ratio whose aggregation layer rounds to no unit (it was made 1 wide, silently).

    Example::

        >>> import torch
        >>> from recsys_runner.models.masknet import MaskBlock
        >>> block = MaskBlock(emb_dim=64, in_dim=64, out_dim=32, reduction_ratio=2.0)
        >>> block(torch.randn(4, 64), torch.randn(4, 64)).shape   # v_emb [B, 64], the normalized fields [B, 64] → [B, 32]
        torch.Size([4, 32])
    """

    def __init__(self, emb_dim: int, in_dim: int, out_dim: int, reduction_ratio: float, device: torch.device | None = None) -> None:
        super().__init__()
        aggregation = round(reduction_ratio * in_dim)
        require(aggregation >= 1, f"model.reduction_ratio={reduction_ratio} makes the aggregation layer of the mask over a {in_dim}-wide "
                f"vector {reduction_ratio * in_dim:.3g} units wide, which rounds to none. Fix: model.reduction_ratio="
                f"{1 / in_dim:.2g} or more (one unit), e.g. model.reduction_ratio=3")
        self.mask = nn.Sequential(nn.Linear(emb_dim, aggregation, device=device), nn.ReLU(),
                                  nn.Linear(aggregation, in_dim, device=device))
        self.hidden = nn.Linear(in_dim, out_dim, bias=False, device=device)
        self.norm = nn.LayerNorm(out_dim, device=device)

    def forward(self, v_emb: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.hidden(self.mask(v_emb) * x)))


class MaskNet(nn.Module):
    """MaskNet: MaskBlocks (serial or parallel) + MLP over the fields; ``(dense [B, N], sparse KJT) → logits [B]``.

    Args:
        config: its hyperparameters (:class:`MaskNetConfig`: ``embedding_dim`` ``D``, ``structure``, the blocks' widths,
            the masks' reduction ratio, the MLP's hidden sizes).
        features: the data's feature schema (from the runner).
        dense_device: device of the dense parameters (tables start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.masknet import MaskNet, MaskNetConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> config = MaskNetConfig(embedding_dim=8, structure="serial", block_sizes=[32, 16], reduction_ratio=1.0,
        ...                        deep_layer_sizes=[])
        >>> model = materialize(MaskNet(config, features=data.features))
        >>> model(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
    """

    same_embedding_width: ClassVar[str | None] = (
        "its embedding layer normalizes every field (each dense feature's vector and each embedding) as one [N + F, D] block"
    )
    """Why every table must have one width (see :class:`~recsys_runner.models.common.SparseArch`)."""

    def __init__(self, config: MaskNetConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.fields = FieldArch(features, config.embedding_dim, type(self), device=dense_device)
        width = self.fields.num_fields * config.embedding_dim
        self.field_norm = FieldNorm(self.fields.num_fields, config.embedding_dim, device=dense_device)
        sizes = list(config.block_sizes)
        self.serial = config.structure == "serial"
        inputs = [width, *sizes[:-1]] if self.serial else [width] * len(sizes)
        self.blocks = nn.ModuleList(MaskBlock(width, a, b, config.reduction_ratio, dense_device) for a, b in zip(inputs, sizes, strict=True))
        out_width = sizes[-1] if self.serial else sum(sizes)
        deep = list(config.deep_layer_sizes)
        self.deep = MLP(out_width, deep, device=dense_device) if deep else nn.Identity()
        self.head = nn.Linear(deep[-1] if deep else out_width, 1, device=dense_device)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        fields = self.fields(dense, sparse)
        v_emb = fields.flatten(1)
        x = self.field_norm(fields).flatten(1)
        if self.serial:
            for block in self.blocks:
                x = block(v_emb, x)
        else:
            x = torch.cat([block(v_emb, x) for block in self.blocks], dim=1)
        return self.head(self.deep(x)).squeeze(1)
