"""AutoInt (Song et al., 2019, "AutoInt: Automatic Feature Interaction Learning via Self-Attentive Neural Networks", https://arxiv.org/abs/1810.11921) on TorchRec.

Shape legend: ``B`` batch size, ``N`` dense features, ``F`` sparse features, ``m = N + F`` fields, ``D`` embedding
dim, ``H`` heads, ``d'`` attention width per head.

Every input is a field of width ``D`` (:class:`~recsys_runner.models.common.FieldArch`: a dense feature's field is
its value times a learned vector, as the paper embeds numbers), ``[B, m, D]``. A stack of interacting layers lets each field
attend to every other: per head ``h``, ``α_{m,k} = softmax_k(⟨W_Q e_m, W_K e_k⟩)`` and ``ẽ_m = Σ_k α_{m,k} W_V e_k``
(eqs. 5–6), the heads concatenated (eq. 7), then ``ReLU(ẽ_m + W_Res e_m)`` (eq. 8, the residual); stacked layers
combine fields of higher orders. The last layer's fields, flattened ``[B, m·H·d']``, give the logit through one linear unit.
AutoInt+ adds a deep MLP over the flattened embeddings, whose logit is added.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import require
from recsys_runner.features import FeatureSpec, check_embedding_dim
from recsys_runner.models.common import MLP, FieldArch, ModelConfig, check_layer_sizes


@dataclass(kw_only=True)
class AutoIntConfig(ModelConfig):
    """Schema of ``conf/model/autoint.yaml``. Defaults: the authors' Criteo run (github.com/shichence/AutoInt, test_code.sh
    and train.py: fields 16 wide, 3 layers of 2 heads of 32, residual; AutoInt+'s DNN of 2 × 400)."""

    _target_: str = "recsys_runner.models.autoint.AutoInt"
    embedding_dim: int = 16
    """Width ``D`` of every field: each embedding table and each dense feature's vector; a per-feature
    ``embedding_dim`` in ``data.sparse`` must equal it."""
    num_layers: int = 3
    """Interacting layers (stacked: each attends over the previous one's fields)."""
    num_heads: int = 2
    """Attention heads ``H`` per layer."""
    attention_dim: int = 32
    """Width ``d'`` of each head's queries, keys and values; a layer's output fields are ``H·d'`` wide."""
    residual: bool = True
    """Add each field's own projection ``W_Res e_m`` before the ReLU (eq. 8)."""
    deep_layer_sizes: list[int] = field(default_factory=lambda: [400, 400])
    """AutoInt+: hidden layers of a deep MLP over the flattened fields, whose logit is added; ``[]`` for AutoInt alone."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        for key, published in (("num_layers", 3), ("num_heads", 2), ("attention_dim", 32)):
            value = getattr(self, key)
            require(value > 0, f"model.{key} must be at least 1, got {value}. Fix: a positive count, e.g. model.{key}={published} "
                               f"(the authors' Criteo setting)")
        check_layer_sizes("deep_layer_sizes", self.deep_layer_sizes, allow_empty=True)


class InteractingLayer(nn.Module):
    """One interacting layer: ``fields [B, m, D_in] → [B, m, H·d']``, multi-head self-attention over the fields with
    unscaled dot products (eqs. 5–7), plus the residual projection, then ReLU (eq. 8).

    Args:
        in_dim: ``D_in`` (``D`` for the first layer, ``H·d'`` after).
        attention_dim: ``d'`` per head.
        num_heads: ``H``.
        residual: add ``W_Res e_m`` before the ReLU.
        device: device of the weights.

    Example::

        >>> import torch
        >>> from recsys_runner.models.autoint import InteractingLayer
        >>> layer = InteractingLayer(in_dim=16, attention_dim=32, num_heads=2)
        >>> layer(torch.randn(4, 5, 16)).shape   # fields [B, m, 16] → [B, m, 2 × 32]
        torch.Size([4, 5, 64])
    """

    def __init__(self, in_dim: int, attention_dim: int, num_heads: int, residual: bool = True,
                 device: torch.device | None = None) -> None:
        super().__init__()
        width = attention_dim * num_heads
        self.num_heads = num_heads
        self.query = nn.Linear(in_dim, width, bias=False, device=device)
        self.key = nn.Linear(in_dim, width, bias=False, device=device)
        self.value = nn.Linear(in_dim, width, bias=False, device=device)
        self.res = nn.Linear(in_dim, width, bias=False, device=device) if residual else None

    def forward(self, fields: torch.Tensor) -> torch.Tensor:
        def heads(x: torch.Tensor) -> torch.Tensor:  # [B, m, H·d'] → [B, H, m, d']
            return x.unflatten(2, (self.num_heads, -1)).transpose(1, 2)

        q, k, v = heads(self.query(fields)), heads(self.key(fields)), heads(self.value(fields))
        attended = (torch.softmax(q @ k.transpose(2, 3), dim=3) @ v).transpose(1, 2).flatten(2)  # [B, m, H·d']
        return torch.relu(attended if self.res is None else attended + self.res(fields))


class AutoInt(nn.Module):
    """AutoInt (with ``deep_layer_sizes``: AutoInt+): self-attention over the fields; ``(dense [B, N], sparse KJT) →
    logits [B]``.

    Args:
        config: its hyperparameters (:class:`AutoIntConfig`: ``embedding_dim`` ``D``, the interacting layers, heads and
            head width, the residual, the optional DNN's hidden sizes).
        features: the data's feature schema (from the runner).
        dense_device: device of the dense parameters (tables start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.autoint import AutoInt, AutoIntConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> config = AutoIntConfig(embedding_dim=8, num_layers=2, num_heads=2, attention_dim=8, deep_layer_sizes=[])
        >>> model = materialize(AutoInt(config, features=data.features))
        >>> model(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
    """

    same_embedding_width: ClassVar[str | None] = "its attention takes dot products between every pair of fields"
    """Why every table must have one width (see :class:`~recsys_runner.models.common.SparseArch`)."""

    def __init__(self, config: AutoIntConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.fields = FieldArch(features, config.embedding_dim, type(self), device=dense_device)
        num_fields, width = self.fields.num_fields, config.attention_dim * config.num_heads
        in_dims = [config.embedding_dim] + [width] * (config.num_layers - 1)
        self.layers = nn.Sequential(*(InteractingLayer(d, config.attention_dim, config.num_heads, config.residual, dense_device)
                                      for d in in_dims))
        self.out = nn.Linear(num_fields * width, 1, device=dense_device)
        sizes = list(config.deep_layer_sizes)
        self.deep = (nn.Sequential(MLP(num_fields * config.embedding_dim, sizes, device=dense_device),
                                   nn.Linear(sizes[-1], 1, device=dense_device)) if sizes else None)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        fields = self.fields(dense, sparse)
        logit = self.out(self.layers(fields).flatten(1)).squeeze(1)
        return logit if self.deep is None else logit + self.deep(fields.flatten(1)).squeeze(1)
