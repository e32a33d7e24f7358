"""DeepFM (Guo et al., 2017, https://arxiv.org/abs/1703.04247) on TorchRec.

The dense features are projected to one more "field" of width ``D`` beside the ``F`` embedded
sparse fields. As in the paper, the logit is the sum of the FM component's two terms and the deep part:

* first order: a linear model, one learned weight per sparse id (its own tables, see
  :class:`~recsys_runner.models.common.LinearArch`) plus a linear term of the raw dense features,
* second order: the factorization-machine term over all ``F+1`` fields,
* deep: an MLP over the concatenated fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.features import FeatureSpec, check_embedding_dim
from recsys_runner.models.common import (
    MLP,
    DenseArch,
    FMInteraction,
    LinearArch,
    ModelConfig,
    SparseArch,
    check_layer_sizes,
    projection_sizes,
)

__all__ = ["DeepFM", "DeepFMConfig", "FMInteraction"]


@dataclass(kw_only=True)
class DeepFMConfig(ModelConfig):
    """Schema of ``conf/model/deepfm.yaml``."""

    _target_: str = "recsys_runner.models.deepfm.DeepFM"
    embedding_dim: int = 16
    """Width ``D`` of every embedding table (and of the projected dense field); a per-feature ``embedding_dim``
    in ``data.sparse`` must equal it."""
    dense_arch_layer_sizes: list[int | None] = field(default_factory=lambda: [64, None])
    """MLP projecting the dense features into a field; must end in ``embedding_dim``: a ``null`` entry is
    ``embedding_dim`` (the default ends in one, so ``model.embedding_dim`` alone changes every width)."""
    deep_layer_sizes: list[int] = field(default_factory=lambda: [256, 128, 64])
    """Hidden layers of the deep head (a final 1-unit layer is added)."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        self.dense_layer_sizes()
        check_layer_sizes("deep_layer_sizes", self.deep_layer_sizes)

    def dense_layer_sizes(self) -> list[int]:
        """``dense_arch_layer_sizes`` with each ``null`` as ``embedding_dim`` (checked to end in it)."""
        return projection_sizes("dense_arch_layer_sizes", self.dense_arch_layer_sizes, self.embedding_dim, "DeepFM",
                                "FM term takes dot products between the dense field and every embedding")


class DeepFM(nn.Module):
    """DeepFM: first-order + FM second-order + deep heads; ``(dense [B, N], sparse KJT) → logits [B]``.

    ``logit = first_order(dense, ids) + fm(fields) + deep(fields)``, where ``first_order`` holds one weight per
    sparse id (tables ``first_order_<table>``, 4 floats summed per id, sharded like the embedding tables; why
    separate tables: :class:`~recsys_runner.models.common.LinearArch`) and a linear term of the dense features.

    Args:
        config: its hyperparameters (:class:`DeepFMConfig`: ``embedding_dim`` ``D``, the dense projection
            MLP ending in ``D``, the deep head's hidden sizes).
        features: the data's feature schema (from the runner).
        dense_device: device of the dense parameters (embeddings start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.deepfm import DeepFM, DeepFMConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> config = DeepFMConfig(embedding_dim=8, dense_arch_layer_sizes=[None], deep_layer_sizes=[32])
        >>> model = materialize(DeepFM(config, features=data.features))
        >>> model(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
    """

    same_embedding_width: ClassVar[str | None] = (
        "its FM term takes dot products between every pair of fields (the projected dense field and each embedding)"
    )
    """Why every table must have one width (see :class:`~recsys_runner.models.common.SparseArch`)."""

    def __init__(self, config: DeepFMConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        num_fields = len(features.sparse) + 1
        self.sparse_arch = SparseArch(features, config.embedding_dim, type(self))
        self.dense_arch = DenseArch(features.num_dense, config.dense_layer_sizes(), device=dense_device)
        self.first_order = LinearArch(features, prefix="first_order_", device=dense_device, zero_init=True)
        self.fm = FMInteraction()
        self.deep = nn.Sequential(
            MLP(num_fields * config.embedding_dim, list(config.deep_layer_sizes), device=dense_device),
            nn.Linear(config.deep_layer_sizes[-1], 1, device=dense_device),
        )

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        fields = torch.cat([self.dense_arch(dense).unsqueeze(1), self.sparse_arch.fields(self.sparse_arch(sparse))], dim=1)
        deep = self.deep(fields.flatten(1)).squeeze(1)
        return self.first_order(dense, sparse) + self.fm(fields) + deep
