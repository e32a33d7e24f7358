"""DeepFM (Guo et al., 2017, https://arxiv.org/abs/1703.04247) on TorchRec.

The dense features are projected to one more "field" of width ``D`` beside the ``F`` embedded
sparse fields. Three heads share those ``F+1`` fields and their logits are summed:

* wide: a linear model of the raw dense features,
* FM: the second-order factorization-machine term over all fields,
* deep: an MLP over the concatenated fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import require
from recsys_runner.features import FeatureSpec, check_embedding_dim
from recsys_runner.models.common import MLP, DenseArch, ModelConfig, SparseArch, check_layer_sizes


@dataclass(kw_only=True)
class DeepFMConfig(ModelConfig):
    """Schema of ``conf/model/deepfm.yaml``."""

    _target_: str = "recsys_runner.models.deepfm.DeepFM"
    embedding_dim: int = 16
    """Width ``D`` of every embedding table (and of the projected dense field); a per-feature ``embedding_dim``
    in ``data.sparse`` must equal it."""
    dense_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 16])
    """MLP projecting the dense features into a field; must end in ``embedding_dim``."""
    deep_layer_sizes: list[int] = field(default_factory=lambda: [256, 128, 64])
    """Hidden layers of the deep head (a final 1-unit layer is added)."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        check_layer_sizes("dense_arch_layer_sizes", self.dense_arch_layer_sizes)
        check_layer_sizes("deep_layer_sizes", self.deep_layer_sizes)
        require(
            self.dense_arch_layer_sizes[-1] == self.embedding_dim,
            f"model.dense_arch_layer_sizes ends in {self.dense_arch_layer_sizes[-1]} but model.embedding_dim="
            f"{self.embedding_dim}: DeepFM's FM term takes dot products between the dense field and every "
            f"embedding, so they must have the same width. Fix: make the last entry of "
            f"model.dense_arch_layer_sizes equal model.embedding_dim.",
        )


class FMInteraction(nn.Module):
    """Second-order FM term: ``[B, F+1, D] → [B]``, ``½ Σ_d ((Σ_f v)² − Σ_f v²)``."""

    def forward(self, fields: torch.Tensor) -> torch.Tensor:
        square_of_sum = fields.sum(dim=1).pow(2)
        sum_of_square = fields.pow(2).sum(dim=1)
        return 0.5 * (square_of_sum - sum_of_square).sum(dim=1)


class DeepFM(nn.Module):
    """DeepFM: wide + FM + deep heads over shared fields; ``(dense [B, N], sparse KJT) → logits [B]``.

    Args:
        config: its hyperparameters (:class:`DeepFMConfig`: ``embedding_dim`` ``D``, the dense projection
            MLP ending in ``D``, the deep head's hidden sizes).
        features: the data's feature schema (from the runner).
        dense_device: device of the dense parameters (embeddings start on ``meta``).

    Example::

        model = DeepFM(DeepFMConfig(embedding_dim=8, dense_arch_layer_sizes=[8], deep_layer_sizes=[32]),
                       features=data.features)
    """

    same_embedding_width: ClassVar[str | None] = (
        "its FM term takes dot products between every pair of fields (the projected dense field and each embedding)"
    )
    """Why every table must have one width (see :class:`~recsys_runner.models.common.SparseArch`)."""

    def __init__(self, config: DeepFMConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        num_fields = len(features.sparse) + 1
        self.sparse_arch = SparseArch(features, config.embedding_dim, type(self))
        self.dense_arch = DenseArch(features.num_dense, list(config.dense_arch_layer_sizes), device=dense_device)
        self.wide = nn.Linear(features.num_dense, 1, device=dense_device)
        self.fm = FMInteraction()
        self.deep = nn.Sequential(
            MLP(num_fields * config.embedding_dim, list(config.deep_layer_sizes), device=dense_device),
            nn.Linear(config.deep_layer_sizes[-1], 1, device=dense_device),
        )

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        fields = torch.cat([self.dense_arch(dense).unsqueeze(1), self.sparse_arch.fields(self.sparse_arch(sparse))], dim=1)
        deep = self.deep(fields.flatten(1)).squeeze(1)
        return self.wide(dense).squeeze(1) + self.fm(fields) + deep
