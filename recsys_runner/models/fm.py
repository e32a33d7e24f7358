"""Factorization machine (Rendle, 2010, https://www.csie.ntu.edu.tw/~b97053/paper/Rendle2010FM.pdf): the
second-order baseline of the zoo.

``logit = b + Σ_f w_f[id_f] + uᵀ dense + Σ_{i<j} ⟨v_i, v_j⟩``: a linear model (one weight per id and per dense
feature, :class:`~recsys_runner.models.common.LinearArch`) plus the dot products of every pair of fields, where a
sparse feature's field is its id's embedding (``D`` wide, pooled over a multi-hot bag) and a dense feature's field
is its value times a learned vector (:class:`~recsys_runner.models.common.DenseFields`), computed in ``O(F·D)``
(:class:`~recsys_runner.models.common.FMInteraction`). DeepFM is this plus a deep head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.features import FeatureSpec, check_embedding_dim
from recsys_runner.models.common import DenseFields, FMInteraction, LinearArch, ModelConfig, SparseArch


@dataclass(kw_only=True)
class FMConfig(ModelConfig):
    """Schema of ``conf/model/fm.yaml``."""

    _target_: str = "recsys_runner.models.fm.FactorizationMachine"
    embedding_dim: int = 16
    """Width ``D`` of every factor (embedding table and dense feature vector); a per-feature ``embedding_dim`` in
    ``data.sparse`` must equal it."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)


class FactorizationMachine(nn.Module):
    """A second-order factorization machine: ``(dense [B, N], sparse KJT) → logits [B]``.

    Args:
        config: :class:`FMConfig` (``embedding_dim`` ``D``).
        features: the data's feature schema (from the runner).
        dense_device: device of the dense parameters (tables start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.fm import FactorizationMachine, FMConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> config = FMConfig(embedding_dim=8)
        >>> model = materialize(FactorizationMachine(config, features=data.features))
        >>> model(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
    """

    same_embedding_width: ClassVar[str | None] = "its pairwise term takes dot products between every pair of fields"
    """Why every table must have one width (see :class:`~recsys_runner.models.common.SparseArch`)."""

    def __init__(self, config: FMConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.linear = LinearArch(features, prefix="linear_", device=dense_device, zero_init=True)
        self.bias = nn.Parameter(torch.zeros(1, device=dense_device))
        self.sparse_arch = SparseArch(features, config.embedding_dim, type(self))
        self.dense_fields = DenseFields(features.num_dense, config.embedding_dim, device=dense_device) if features.num_dense else None
        self.fm = FMInteraction()

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        fields = self.sparse_arch.fields(self.sparse_arch(sparse))
        if self.dense_fields is not None:
            fields = torch.cat([self.dense_fields(dense), fields], dim=1)
        return self.linear(dense, sparse) + self.fm(fields) + self.bias
