"""Wukong (Zhang et al., 2024, "Wukong: Towards a Scaling Law for Large-Scale Recommendation", https://arxiv.org/abs/2403.02545) on TorchRec.

Shape legend: ``B`` batch size, ``N`` dense features, ``F`` sparse features, ``D`` embedding dim, ``n_i`` fields
entering layer ``i`` (``n_0 = F + 1``), ``n_F``/``n_L`` fields made by each layer's FMB/LCB, ``k`` the FM's rank.

The dense features become one field of width ``D`` (an MLP, :class:`~recsys_runner.models.common.DenseArch`) beside
the ``F`` pooled embeddings: ``X_0 [B, n_0, D]``. An interaction stack of ``l`` identical layers follows, each

    X_{i+1} = LN(concat(FMB(X_i), LCB(X_i)) + X_i),

* FMB, the factorization machine block: ``reshape(MLP(LN(flatten(X Xᵀ Y))))``, the pairwise dot products of the fields
  compressed by a learned ``Y [n_i, k]`` (the paper's optimized FM, ``X (Xᵀ Y)``: ``[B, n_i, k]``) and turned into
  ``n_F`` new fields by an MLP;
* LCB, the linear compression block: ``W_L X``, ``n_L`` linear recombinations of the fields (no new interactions);
* the residual ``X_i`` goes through a linear map of the field axis when ``n_i ≠ n_F + n_L`` (the first layer), and
  the layer norm is over ``D``.

Stacking doubles the highest interaction order per layer (a binary-exponentiation ladder): layer ``i`` holds orders up
to ``2^i``. The last layer's fields, flattened, go through an MLP to the logit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import require
from recsys_runner.features import FeatureSpec, check_embedding_dim
from recsys_runner.models.common import MLP, DenseArch, ModelConfig, SparseArch, check_layer_sizes, projection_sizes


@dataclass(kw_only=True)
class WukongConfig(ModelConfig):
    """Schema of ``conf/model/wukong.yaml``. Defaults: TorchEasyRec's Criteo example (``examples/wukong_criteo.config``:
    2 layers of 16 FMB and 16 LCB fields, FM rank 24, an FMB MLP of 512, a final MLP of 512, 64, fields 16 wide, a dense
    MLP of 512, 256 then ``D``)."""

    _target_: str = "recsys_runner.models.wukong.Wukong"
    embedding_dim: int = 16
    """Width ``D`` of every field: each embedding table and the projected dense field; a per-feature ``embedding_dim``
    in ``data.sparse`` must equal it."""
    dense_arch_layer_sizes: list[int | None] = field(default_factory=lambda: [512, 256, None])
    """MLP turning the dense features into one field; must end in ``embedding_dim``: a ``null`` entry is
    ``embedding_dim``."""
    num_layers: int = 2
    """Wukong layers ``l`` in the interaction stack."""
    num_fmb_fields: int = 16
    """``n_F``: fields each layer's FMB makes."""
    num_lcb_fields: int = 16
    """``n_L``: fields each layer's LCB makes (0: no LCB, the paper's ablation)."""
    fmb_rank: int = 24
    """``k``: the FM's compression rank (``X Xᵀ Y`` with ``Y [n_i, k]``)."""
    fmb_layer_sizes: list[int] = field(default_factory=lambda: [512])
    """Hidden layers of each FMB's MLP (a final layer of ``n_F · D`` units is added); ``[]``: that layer alone."""
    deep_layer_sizes: list[int] = field(default_factory=lambda: [512, 64])
    """Hidden layers of the final MLP over the last layer's flattened fields (a final 1-unit layer is added)."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        self.dense_layer_sizes()
        for key, published, least in (("num_layers", 2, 1), ("num_fmb_fields", 16, 1), ("num_lcb_fields", 16, 0), ("fmb_rank", 24, 1)):
            value = getattr(self, key)
            require(value >= least, f"model.{key} must be at least {least}, got {value}. Fix: e.g. model.{key}={published} "
                                    f"(the Criteo setting)")
        check_layer_sizes("fmb_layer_sizes", self.fmb_layer_sizes, allow_empty=True)
        check_layer_sizes("deep_layer_sizes", self.deep_layer_sizes, allow_empty=True)

    def dense_layer_sizes(self) -> list[int]:
        """``dense_arch_layer_sizes`` with each ``null`` as ``embedding_dim`` (checked to end in it)."""
        return projection_sizes("dense_arch_layer_sizes", self.dense_arch_layer_sizes, self.embedding_dim, "Wukong",
                                "dense features become one more field beside the embeddings, and its FM takes dot products between fields")


class FactorizationMachineBlock(nn.Module):
    """FMB: ``X [B, n, D] → [B, n_F, D]``, ``reshape(MLP(LN(flatten(X (Xᵀ Y)))))``.

    Args:
        num_fields: ``n``.
        out_fields: ``n_F``.
        embedding_dim: ``D``.
        rank: ``k``, the columns of ``Y [n, k]``.
        layer_sizes: the MLP's hidden layers (then ``n_F · D`` units, no activation).
        device: device of the weights.

    Example::

        >>> import torch
        >>> from recsys_runner.models.wukong import FactorizationMachineBlock
        >>> fmb = FactorizationMachineBlock(num_fields=27, out_fields=16, embedding_dim=16, rank=8, layer_sizes=[64])
        >>> fmb(torch.randn(4, 27, 16)).shape   # X [B, n, D] → [B, n_F, D]
        torch.Size([4, 16, 16])
    """

    def __init__(self, num_fields: int, out_fields: int, embedding_dim: int, rank: int, layer_sizes: list[int],
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.projection = nn.Parameter(torch.empty(num_fields, rank, device=device))
        """``Y [n, k]``."""
        nn.init.xavier_uniform_(self.projection)
        self.norm = nn.LayerNorm(num_fields * rank, device=device)
        hidden = MLP(num_fields * rank, layer_sizes, device=device) if layer_sizes else nn.Identity()
        last = layer_sizes[-1] if layer_sizes else num_fields * rank
        self.mlp = nn.Sequential(hidden, nn.Linear(last, out_fields * embedding_dim, device=device))
        self.out_shape = (out_fields, embedding_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fm = x @ (x.transpose(1, 2) @ self.projection)  # [B, n, k]: X Xᵀ Y without the [B, n, n] matrix
        return self.mlp(self.norm(fm.flatten(1))).unflatten(1, self.out_shape)


class FieldMix(nn.Module):
    """A linear map of the field axis, ``X [B, n, D] → W X [B, n_out, D]`` with ``W [n_out, n]`` and no bias: the LCB, and
    the residual's projection when a layer changes the number of fields.

    Example::

        >>> import torch
        >>> from recsys_runner.models.wukong import FieldMix
        >>> FieldMix(num_fields=27, out_fields=16)(torch.randn(4, 27, 8)).shape   # X [B, n, D] → [B, n_out, D]
        torch.Size([4, 16, 8])
    """

    def __init__(self, num_fields: int, out_fields: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_fields, num_fields, device=device))
        nn.init.xavier_uniform_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("on,bnd->bod", self.weight, x)


class WukongLayer(nn.Module):
    """One Wukong layer: ``X [B, n, D] → LN(concat(FMB(X), LCB(X)) + residual(X))  [B, n_F + n_L, D]``.

    Args:
        num_fields: ``n``.
        embedding_dim: ``D``.
        fmb_fields: ``n_F``.
        lcb_fields: ``n_L`` (0: no LCB).
        rank: the FMB's ``k``.
        fmb_layer_sizes: the FMB MLP's hidden layers.
        device: device of the weights.

    Example::

        >>> import torch
        >>> from recsys_runner.models.wukong import WukongLayer
        >>> layer = WukongLayer(num_fields=27, embedding_dim=16, fmb_fields=16, lcb_fields=8, rank=8, fmb_layer_sizes=[64])
        >>> layer(torch.randn(4, 27, 16)).shape   # [B, n_F + n_L, D]
        torch.Size([4, 24, 16])
    """

    def __init__(self, num_fields: int, embedding_dim: int, fmb_fields: int, lcb_fields: int, rank: int,
                 fmb_layer_sizes: list[int], device: torch.device | None = None) -> None:
        super().__init__()
        self.fmb = FactorizationMachineBlock(num_fields, fmb_fields, embedding_dim, rank, fmb_layer_sizes, device)
        self.lcb = FieldMix(num_fields, lcb_fields, device) if lcb_fields else None
        self.out_fields = fmb_fields + lcb_fields
        self.residual = FieldMix(num_fields, self.out_fields, device) if num_fields != self.out_fields else nn.Identity()
        self.norm = nn.LayerNorm(embedding_dim, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        made = self.fmb(x) if self.lcb is None else torch.cat([self.fmb(x), self.lcb(x)], dim=1)
        return self.norm(made + self.residual(x))


class Wukong(nn.Module):
    """Wukong: a stack of FMB + LCB layers over the fields, then an MLP; ``(dense [B, N], sparse KJT) → logits [B]``.

    Args:
        config: its hyperparameters (:class:`WukongConfig`: ``embedding_dim`` ``D``, the dense MLP ending in ``D``, the
            layers, ``n_F``, ``n_L``, the FM rank ``k``, the FMB and final MLPs' hidden sizes).
        features: the data's feature schema (from the runner).
        dense_device: device of the dense parameters (tables start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.wukong import Wukong, WukongConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> config = WukongConfig(embedding_dim=8, dense_arch_layer_sizes=[None], num_layers=2, num_fmb_fields=4,
        ...                       num_lcb_fields=4, fmb_rank=4, fmb_layer_sizes=[32], deep_layer_sizes=[32])
        >>> model = materialize(Wukong(config, features=data.features))
        >>> model(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
    """

    same_embedding_width: ClassVar[str | None] = (
        "its FM block takes dot products between every pair of fields (the projected dense field and each embedding)"
    )
    """Why every table must have one width (see :class:`~recsys_runner.models.common.SparseArch`)."""

    def __init__(self, config: WukongConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        embedding_dim = config.embedding_dim
        self.sparse_arch = SparseArch(features, embedding_dim, type(self))
        self.dense_arch = DenseArch(features.num_dense, config.dense_layer_sizes(), device=dense_device)
        layers, fields = [], len(features.sparse) + 1
        for _ in range(config.num_layers):
            layers.append(WukongLayer(fields, embedding_dim, config.num_fmb_fields, config.num_lcb_fields, config.fmb_rank,
                                      list(config.fmb_layer_sizes), dense_device))
            fields = layers[-1].out_fields
        self.layers = nn.Sequential(*layers)
        deep = list(config.deep_layer_sizes)
        self.deep = nn.Sequential(MLP(fields * embedding_dim, deep, device=dense_device) if deep else nn.Identity(),
                                  nn.Linear(deep[-1] if deep else fields * embedding_dim, 1, device=dense_device))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        x0 = torch.cat([self.dense_arch(dense).unsqueeze(1), self.sparse_arch.fields(self.sparse_arch(sparse))], dim=1)
        return self.deep(self.layers(x0).flatten(1)).squeeze(1)
