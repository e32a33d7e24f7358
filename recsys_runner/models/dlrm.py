"""DLRM (Naumov et al., 2019, https://arxiv.org/abs/1906.00091) on TorchRec.

The dense features go through a bottom MLP to a vector of width ``D``; the interaction arch takes
the pairwise dot products of that vector and the ``F`` sparse embeddings, concatenates them with
the dense vector, and the top (over) MLP turns the result into a logit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.features import FeatureSpec, check_embedding_dim
from recsys_runner.models.common import MLP, DenseArch, ModelConfig, SparseArch, check_layer_sizes, projection_sizes


@dataclass(kw_only=True)
class DLRMConfig(ModelConfig):
    """Schema of ``conf/model/dlrm.yaml``."""

    _target_: str = "recsys_runner.models.dlrm.DLRM"
    embedding_dim: int = 16
    """Width ``D`` of every embedding table (a per-feature ``embedding_dim`` in ``data.sparse`` must equal it)."""
    dense_arch_layer_sizes: list[int | None] = field(default_factory=lambda: [64, None])
    """Bottom MLP; must end in ``embedding_dim`` (the interaction dots it with every embedding): a ``null`` entry
    is ``embedding_dim`` (the default ends in one, so ``model.embedding_dim`` alone changes every width)."""
    over_arch_layer_sizes: list[int] = field(default_factory=lambda: [256, 64])
    """Top MLP hidden layers (a final 1-unit layer is added)."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        self.dense_layer_sizes()
        check_layer_sizes("over_arch_layer_sizes", self.over_arch_layer_sizes)

    def dense_layer_sizes(self) -> list[int]:
        """``dense_arch_layer_sizes`` with each ``null`` as ``embedding_dim`` (checked to end in it)."""
        return projection_sizes("dense_arch_layer_sizes", self.dense_arch_layer_sizes, self.embedding_dim, "DLRM",
                                "interaction takes dot products between the dense vector and every embedding")


class DotInteraction(nn.Module):
    """DLRM interaction: ``dense [B, D], sparse [B, F, D] → [B, D + (F+1)F/2]``.

    Concatenates the dense vector with the strictly-upper-triangular pairwise dot products of all
    ``F+1`` vectors.

    Example::

        >>> import torch
        >>> from recsys_runner.models.dlrm import DotInteraction
        >>> interaction = DotInteraction(num_sparse=3)
        >>> interaction(torch.randn(4, 8), torch.randn(4, 3, 8)).shape   # [B, 8 + 4·3/2]: the dense vector, 6 dot products
        torch.Size([4, 14])
    """

    rows: torch.Tensor
    cols: torch.Tensor

    def __init__(self, num_sparse: int) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(num_sparse + 1, num_sparse + 1, offset=1)
        # each its own tensor, not two halves of triu_indices' one storage: torch.export.save of two buffers that are slices
        # of a storage neither covers warned "No complete tensor found in the group!" on every export of a DLRM
        self.register_buffer("rows", rows.clone(), persistent=False)
        self.register_buffer("cols", cols.clone(), persistent=False)

    @staticmethod
    def output_dim(num_sparse: int, embedding_dim: int) -> int:
        return embedding_dim + (num_sparse + 1) * num_sparse // 2

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        vectors = torch.cat([dense.unsqueeze(1), sparse], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))
        return torch.cat([dense, dots[:, self.rows, self.cols]], dim=1)


class DLRM(nn.Module):
    """DLRM: bottom MLP, dot interaction, top MLP; ``(dense [B, N], sparse KJT) → logits [B]``.

    Args:
        config: its hyperparameters (:class:`DLRMConfig`: ``embedding_dim`` ``D``, the bottom MLP ending
            in ``D``, the top MLP's hidden sizes).
        features: the data's feature schema (from the runner).
        dense_device: device of the dense parameters (embeddings start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.dlrm import DLRM, DLRMConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> config = DLRMConfig(embedding_dim=8, dense_arch_layer_sizes=[None], over_arch_layer_sizes=[32])
        >>> model = materialize(DLRM(config, features=data.features))
        >>> model(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
    """

    same_embedding_width: ClassVar[str | None] = (
        "its interaction takes dot products between the dense vector and every embedding, and between every pair of embeddings"
    )
    """Why every table must have one width (see :class:`~recsys_runner.models.common.SparseArch`)."""

    def __init__(self, config: DLRMConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        num_sparse = len(features.sparse)
        self.sparse_arch = SparseArch(features, config.embedding_dim, type(self))
        self.dense_arch = DenseArch(features.num_dense, config.dense_layer_sizes(), device=dense_device)
        self.interaction = DotInteraction(num_sparse).to(dense_device)
        self.over_arch = nn.Sequential(
            MLP(DotInteraction.output_dim(num_sparse, config.embedding_dim), list(config.over_arch_layer_sizes), device=dense_device),
            nn.Linear(config.over_arch_layer_sizes[-1], 1, device=dense_device),
        )

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        interacted = self.interaction(self.dense_arch(dense), self.sparse_arch.fields(self.sparse_arch(sparse)))
        return self.over_arch(interacted).squeeze(1)
