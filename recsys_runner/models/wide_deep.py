"""Wide & Deep (Cheng et al., 2016, https://arxiv.org/abs/1606.07792) on TorchRec.

Two heads trained jointly, their logits summed:

* wide: a linear model — one learned weight per sparse id (a table of its own, pooled per feature)
  plus a linear term of the dense features. It memorizes: frequent ids and, when the data provides
  them as sparse features, the paper's cross-product transformations (hashed feature crosses);
* deep: an MLP over the concatenated dense features and sparse embeddings (``D`` wide, or each
  feature's own width). It
  generalizes to id combinations never seen together.

Where this differs from the paper: both heads are trained by the run's optimizers (``optim.sparse`` for the wide
tables, as for the embeddings), where the paper trains the wide part with FTRL and L1 regularization; the wide weights
start from TorchRec's small random init, not 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.features import FeatureSpec, check_embedding_dim
from recsys_runner.models.common import LINEAR_ROW_WIDTH, MLP, LinearArch, ModelConfig, SparseArch, check_layer_sizes

WIDE_ROW_WIDTH = LINEAR_ROW_WIDTH
"""Floats per id in the wide tables (:data:`~recsys_runner.models.common.LINEAR_ROW_WIDTH`)."""


@dataclass(kw_only=True)
class WideDeepConfig(ModelConfig):
    """Schema of ``conf/model/wide_deep.yaml``."""

    _target_: str = "recsys_runner.models.wide_deep.WideDeep"
    embedding_dim: int = 16
    """Width ``D`` of every embedding table whose feature sets no ``embedding_dim`` of its own in ``data.sparse``
    (this model accepts mixed per-feature widths)."""
    deep_layer_sizes: list[int] = field(default_factory=lambda: [256, 128, 64])
    """Hidden layers of the deep head (a final 1-unit layer is added)."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        check_layer_sizes("deep_layer_sizes", self.deep_layer_sizes)


class WideArch(LinearArch):
    """The wide (linear) head: ``(dense [B, N], sparse KJT) → [B]``, a :class:`~recsys_runner.models.common.LinearArch`
    whose tables are named ``wide_<table>``."""

    def __init__(self, features: FeatureSpec, device: torch.device | None = None) -> None:
        super().__init__(features, prefix="wide_", device=device)


class DeepArch(nn.Module):
    """The deep head: ``dense [B, N], embeddings [B, ΣD_f] → [B]`` via an MLP and a 1-unit layer.

    Example::

        >>> import torch
        >>> from recsys_runner.models.wide_deep import DeepArch
        >>> DeepArch(in_features=3 + 32, layer_sizes=[16])(torch.randn(4, 3), torch.randn(4, 32)).shape   # dense, embeddings → [B]
        torch.Size([4])
    """

    def __init__(self, in_features: int, layer_sizes: list[int], device: torch.device | None = None) -> None:
        super().__init__()
        self.mlp = nn.Sequential(MLP(in_features, layer_sizes, device=device), nn.Linear(layer_sizes[-1], 1, device=device))

    def forward(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([dense, embeddings], dim=1)).squeeze(1)


class WideDeep(nn.Module):
    """Wide & Deep: a linear head plus an MLP head; ``(dense [B, N], sparse KJT) → logits [B]``.

    Args:
        config: its hyperparameters (:class:`WideDeepConfig`: ``embedding_dim`` ``D`` of the deep head's
            embeddings, the deep head's hidden sizes).
        features: the data's feature schema (from the runner).
        dense_device: device of the dense parameters (embeddings start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.wide_deep import WideDeep, WideDeepConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> config = WideDeepConfig(embedding_dim=8, deep_layer_sizes=[32])
        >>> model = materialize(WideDeep(config, features=data.features))
        >>> model(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
    """

    same_embedding_width: ClassVar[str | None] = None
    """None: the deep head concatenates the embeddings, so each feature may have its own width."""

    def __init__(self, config: WideDeepConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.wide = WideArch(features, device=dense_device)
        self.sparse_arch = SparseArch(features, config.embedding_dim, type(self))
        self.deep = DeepArch(features.num_dense + self.sparse_arch.output_dim, list(config.deep_layer_sizes), device=dense_device)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.wide(dense, sparse) + self.deep(dense, self.sparse_arch(sparse))
