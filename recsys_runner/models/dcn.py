"""DCN (Wang, Fu, Fu, Wang, 2017, "Deep & Cross Network for Ad Click Predictions", https://arxiv.org/abs/1708.05123) on TorchRec.

Shape legend: ``B`` batch size, ``N`` dense features, ``F`` sparse features, ``D_f`` feature ``f``'s embedding width,
``W = N + ΣD_f`` the stacked input's width, ``L`` cross layers.

The raw dense features and the sparse features' pooled embeddings are stacked into one vector ``x0 [B, W]`` (each
feature may have its own width). The cross network applies ``L`` vector cross layers (the paper's cross layer),

    x_{l+1} = x0 x_lᵀ w_l + b_l + x_l = x0 · (x_l · w_l) + b_l + x_l,

each with a weight vector ``w_l`` and a bias ``b_l`` of width ``W`` (TorchRec's
:class:`~torchrec.modules.crossnet.VectorCrossNet`), so layer ``l`` holds feature crosses up to degree ``l + 1`` at
``O(W)`` parameters per layer. Beside it a deep network (an MLP) reads ``x0``; the combination layer concatenates both
outputs and gives the logit through one linear unit. DCN-V2 (``model=dcn_v2``) replaces ``w_l`` by a matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torchrec.modules.crossnet import VectorCrossNet
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import require
from recsys_runner.features import FeatureSpec, check_embedding_dim
from recsys_runner.models.common import MLP, ModelConfig, SparseArch, check_layer_sizes


@dataclass(kw_only=True)
class DCNConfig(ModelConfig):
    """Schema of ``conf/model/dcn.yaml``. Defaults: the best setting the paper reports on Criteo (6 cross layers, a deep
    network of 2 layers of 1024); embeddings 16 wide (the paper sizes each feature's by ``6 · cardinality^¼``, which
    ``data.sparse`` can set feature by feature)."""

    _target_: str = "recsys_runner.models.dcn.DCN"
    embedding_dim: int = 16
    """Width ``D`` of every embedding table whose feature sets no ``embedding_dim`` of its own in ``data.sparse``
    (this model accepts mixed per-feature widths)."""
    num_cross_layers: int = 6
    """Cross layers ``L``; layer ``l`` adds crosses of degree ``l + 1``."""
    deep_layer_sizes: list[int] = field(default_factory=lambda: [1024, 1024])
    """Hidden layers of the deep network; ``[]``: the cross network alone."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        require(self.num_cross_layers > 0,
                f"model.num_cross_layers must be at least 1, got {self.num_cross_layers}. Fix: e.g. model.num_cross_layers=6 "
                f"(the paper's Criteo setting); for a model without crosses use model=wide_deep")
        check_layer_sizes("deep_layer_sizes", self.deep_layer_sizes, allow_empty=True)


class DCN(nn.Module):
    """DCN: vector cross network + deep network over ``[dense, embeddings]``, combined; ``(dense [B, N], sparse KJT) →
    logits [B]``.

    Args:
        config: its hyperparameters (:class:`DCNConfig`: ``embedding_dim`` ``D``, ``num_cross_layers`` ``L``, the deep
            network's hidden sizes).
        features: the data's feature schema (from the runner).
        dense_device: device of the dense parameters (embeddings start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.dcn import DCN, DCNConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> config = DCNConfig(embedding_dim=8, num_cross_layers=2, deep_layer_sizes=[32])
        >>> model = materialize(DCN(config, features=data.features))
        >>> model(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
    """

    same_embedding_width: ClassVar[str | None] = None
    """None: the cross network reads the flat concatenation ``x0``, so each feature may have its own width."""

    def __init__(self, config: DCNConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.sparse_arch = SparseArch(features, config.embedding_dim, type(self))
        width = features.num_dense + self.sparse_arch.output_dim
        self.cross = VectorCrossNet(width, config.num_cross_layers).to(dense_device)
        deep = list(config.deep_layer_sizes)
        self.deep = MLP(width, deep, device=dense_device) if deep else None
        self.head = nn.Linear(width + (deep[-1] if deep else 0), 1, device=dense_device)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        x0 = torch.cat([dense, self.sparse_arch(sparse)], dim=1)
        out = self.cross(x0) if self.deep is None else torch.cat([self.cross(x0), self.deep(x0)], dim=1)
        return self.head(out).squeeze(1)
