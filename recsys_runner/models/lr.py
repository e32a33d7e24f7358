"""Logistic regression: the linear baseline of the zoo.

One learned weight per sparse id (one-hot ids, a multi-hot bag summing or averaging its ids' weights) plus a
linear term of the dense features and a bias: ``logit = Σ_f w_f[id_f] + vᵀ dense + b``. The per-id weights live
in EmbeddingBagCollection tables of their own (``linear_<table>``, sharded like every table; why 4 floats per id:
:class:`~recsys_runner.models.common.LinearArch`). What every other model should beat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.features import FeatureSpec
from recsys_runner.models.common import LinearArch, ModelConfig


@dataclass(kw_only=True)
class LRConfig(ModelConfig):
    """Schema of ``conf/model/lr.yaml``: logistic regression has no hyperparameters of its own (the learning rate is
    ``optim.lr``; the tables' sizes come from the data)."""

    _target_: str = "recsys_runner.models.lr.LogisticRegression"
    zero_init: bool = True
    """Start every id's weight at 0 (the convex problem's usual start), rather than small random values."""


class LogisticRegression(nn.Module):
    """Logistic regression over one-hot ids and dense features: ``(dense [B, N], sparse KJT) → logits [B]``.

    Args:
        config: :class:`LRConfig`.
        features: the data's feature schema (from the runner).
        dense_device: device of the dense weights and bias (the id tables start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.lr import LogisticRegression, LRConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> config = LRConfig()
        >>> model = materialize(LogisticRegression(config, features=data.features))
        >>> model(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
    """

    same_embedding_width: ClassVar[str | None] = None
    """None: its tables are 4-float linear weights; ``embedding_dim`` settings in ``data.sparse`` do not apply."""

    def __init__(self, config: LRConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.linear = LinearArch(features, prefix="linear_", device=dense_device, zero_init=config.zero_init)
        self.bias = nn.Parameter(torch.zeros(1, device=dense_device))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.linear(dense, sparse) + self.bias
