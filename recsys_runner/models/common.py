"""Parts shared by every model, in TorchRec's style: small modules with a shape legend.

Shape legend: ``B`` batch size, ``F`` number of sparse features, ``D`` embedding dim,
``N`` number of dense features.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import require
from recsys_runner.features import FeatureSpec

__all__ = ["MLP", "SparseArch", "DenseArch", "TrainWrapper", "check_layer_sizes"]


def check_layer_sizes(name: str, sizes: list[int]) -> None:
    """Validate an MLP's layer sizes from config (non-empty, all positive)."""
    require(len(sizes) > 0, f"model.{name} must list at least one layer size, e.g. model.{name}=[64,16]")
    require(all(s > 0 for s in sizes), f"model.{name}={sizes} has a non-positive layer size")


class SparseArch(nn.Module):
    """Embeds every sparse feature: ``KeyedJaggedTensor → [B, F, D]``.

    The EmbeddingBagCollection is created on ``meta``: no memory is spent until
    DistributedModelParallel materializes each shard on the rank that owns it.

    Args:
        features: the data's feature schema; one table ``t_<feature>`` per sparse feature.
        embedding_dim: ``D``, shared by all tables so the interaction arches can combine them.
    """

    def __init__(self, features: FeatureSpec, embedding_dim: int) -> None:
        super().__init__()
        features.require_uniform_dim(embedding_dim, "DeepFM/DLRM (their interaction arches)")
        self.ebc = EmbeddingBagCollection(
            tables=features.embedding_tables(embedding_dim), device=torch.device("meta")
        )
        self.feature_names = features.sparse_names

    def forward(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(sparse).to_dict()
        return torch.stack([pooled[name] for name in self.feature_names], dim=1)


class DenseArch(nn.Module):
    """MLP over the dense features: ``[B, N] → [B, layer_sizes[-1]]``."""

    def __init__(self, in_features: int, layer_sizes: list[int], device: torch.device | None = None) -> None:
        super().__init__()
        self.mlp = MLP(in_features, layer_sizes, bias=True, activation="relu", device=device)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(dense)


class TrainWrapper(nn.Module):
    """Adapts a ``(dense, sparse) → logits`` model to TorchRec's train pipelines.

    A TrainPipeline calls ``model(batch)`` and expects ``(loss, output)``; this wrapper computes the
    binary cross-entropy loss and returns detached ``(loss, logits, labels)`` for metrics. The dense
    forward runs under the precision policy's autocast; the loss is always computed in float32.
    """

    def __init__(self, model: nn.Module, autocast: torch.autocast | None = None) -> None:
        super().__init__()
        self.model = model
        self._autocast_args = None if autocast is None else (autocast.device, autocast.fast_dtype)
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if self._autocast_args is None:
            logits = self.model(batch.dense_features, batch.sparse_features)
        else:
            device, dtype = self._autocast_args
            with torch.autocast(device_type=device, dtype=dtype):
                logits = self.model(batch.dense_features, batch.sparse_features)
        logits = logits.float()
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())
