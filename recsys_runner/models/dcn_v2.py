"""DCNv2 (Wang et al., 2021, https://arxiv.org/abs/2008.13535) on TorchRec.

The raw dense features and the ``F`` sparse embeddings are concatenated into one input vector
``x0`` of width ``W = N + F·D`` (``N + ΣD_f`` when features set their own widths). A cross network of ``L`` layers builds explicit feature crosses of
growing degree,

    x_{l+1} = x0 ⊙ (W_l x_l + b_l) + x_l,

with ``W_l`` full (``W × W``) or low-rank (``U_l V_lᵀ``, rank ``r``, the paper's cheaper variant). With
``num_experts`` ``K ≥ 1`` each layer is instead the paper's mixture of low-rank experts (DCN-Mix, its eqs. 4–5),

    x_{l+1} = Σ_i G_i(x_l) · x0 ⊙ (U_{l,i} g(C_{l,i} g(V_{l,i}ᵀ x_l)) + b_l) + x_l,

``G`` a softmax gate over the experts and ``g`` a ReLU in the ``r``-dim space (TorchRec's
:class:`~torchrec.modules.crossnet.LowRankMixtureCrossNet`; ``K = 1``: one expert, no gate, still with ``C`` and ``g``).
A deep network (an MLP) learns implicit interactions. The two combine in one of the paper's two
structures:

* ``stacked``: ``x0 → cross → deep → logit``;
* ``parallel``: ``x0 → cross`` and ``x0 → deep`` side by side, concatenated, ``→ logit``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torchrec.modules.crossnet import LowRankMixtureCrossNet
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import require
from recsys_runner.features import FeatureSpec, check_embedding_dim
from recsys_runner.models.common import MLP, ModelConfig, SparseArch, check_layer_sizes

STRUCTURES = ("stacked", "parallel")
"""How the cross and deep networks combine (see the module docstring)."""


@dataclass(kw_only=True)
class DCNv2Config(ModelConfig):
    """Schema of ``conf/model/dcn_v2.yaml``."""

    _target_: str = "recsys_runner.models.dcn_v2.DCNv2"
    embedding_dim: int = 16
    """Width ``D`` of every embedding table whose feature sets no ``embedding_dim`` of its own in ``data.sparse``
    (this model accepts mixed per-feature widths)."""
    num_cross_layers: int = 3
    """Cross layers ``L``; layer ``l`` adds crosses of degree ``l + 1``."""
    low_rank: int | None = 64
    """Rank ``r`` of each cross layer's ``W = U Vᵀ``; ``null`` for full-rank ``W × W`` matrices.
    Must be below the cross input width ``W = N + F·D`` (a rank that high saves nothing)."""
    num_experts: int = 0
    """``K``: low-rank experts per cross layer, mixed by a softmax gate with a ReLU inside each expert (DCN-Mix, the
    paper's eqs. 4–5; needs ``low_rank``); ``0``: the plain cross layer ``x0 ⊙ (W x + b) + x``."""
    structure: str = "stacked"
    """``stacked`` (cross, then deep) or ``parallel`` (cross and deep side by side)."""
    deep_layer_sizes: list[int] = field(default_factory=lambda: [256, 128])
    """Hidden layers of the deep network (a final 1-unit layer is added)."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        require(
            self.num_cross_layers > 0,
            f"model.num_cross_layers must be at least 1, got {self.num_cross_layers}; for a model without crosses use model=dlrm or model=wide_deep",
        )
        require(
            self.low_rank is None or self.low_rank > 0,
            f"model.low_rank must be positive or null (full rank), got {self.low_rank}",
        )
        require(self.num_experts >= 0, f"model.num_experts must be 0 (the plain cross layer) or more, got {self.num_experts}. "
                                       f"Fix: model.num_experts=0, or e.g. 4 (DCN-Mix)")
        require(self.num_experts == 0 or self.low_rank is not None,
                f"model.num_experts={self.num_experts} mixes low-rank experts (DCN-Mix), but model.low_rank=null asks for full-rank "
                f"matrices. Fix: a rank, e.g. model.low_rank=64, or model.num_experts=0")
        require(
            self.structure in STRUCTURES,
            f"model.structure={self.structure!r} is not a DCNv2 structure. Fix: model.structure=stacked or model.structure=parallel",
        )
        check_layer_sizes("deep_layer_sizes", self.deep_layer_sizes)


class CrossLayer(nn.Module):
    """One cross layer: ``x0 [B, W], x [B, W] → x0 ⊙ (W x + b) + x  [B, W]``.

    Args:
        width: ``W``.
        low_rank: ``r`` to factor ``W = U Vᵀ`` (``U, V`` are ``W × r``); ``None`` for a full matrix.
        device: device of the parameters.

    Example::

        >>> import torch
        >>> from recsys_runner.models.dcn_v2 import CrossLayer
        >>> layer = CrossLayer(width=6, low_rank=2)
        >>> x0 = torch.randn(4, 6)
        >>> layer(x0, x0).shape   # the first layer: x is x0
        torch.Size([4, 6])
    """

    def __init__(self, width: int, low_rank: int | None = None, device: torch.device | None = None) -> None:
        super().__init__()
        if low_rank is None:
            self.project: nn.Module = nn.Linear(width, width, device=device)
        else:
            self.project = nn.Sequential(nn.Linear(width, low_rank, bias=False, device=device), nn.Linear(low_rank, width, device=device))

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.project(x) + x


class CrossNetwork(nn.Module):
    """``L`` stacked cross layers: ``x0 [B, W] → [B, W]`` (crosses up to degree ``L + 1``).

    Example::

        >>> import torch
        >>> from recsys_runner.models.dcn_v2 import CrossNetwork
        >>> CrossNetwork(width=6, num_layers=3)(torch.randn(4, 6)).shape   # x0 [B, W] → [B, W]
        torch.Size([4, 6])
    """

    def __init__(self, width: int, num_layers: int, low_rank: int | None = None, device: torch.device | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CrossLayer(width, low_rank, device) for _ in range(num_layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = layer(x0, x)
        return x


class DCNv2(nn.Module):
    """DCNv2: cross network + deep network over ``[dense, embeddings]``; ``(dense [B, N], sparse KJT) → logits [B]``.

    Args:
        config: its hyperparameters (:class:`DCNv2Config`: ``embedding_dim`` ``D``, ``num_cross_layers`` ``L``,
            ``low_rank`` ``r`` of each cross matrix or ``None`` for full rank, ``num_experts`` ``K`` (DCN-Mix; 0: none),
            ``structure`` ``"stacked"`` or ``"parallel"``, the deep network's hidden sizes).
        features: the data's feature schema (from the runner).
        dense_device: device of the dense parameters (embeddings start on ``meta``).

    Raises:
        ConfigError: ``config.low_rank`` is not below the cross input width ``N + F·D``.

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.dcn_v2 import DCNv2, DCNv2Config
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> model = materialize(DCNv2(DCNv2Config(embedding_dim=8, num_cross_layers=2, low_rank=16, structure="stacked",
        ...                                       deep_layer_sizes=[32]), features=data.features))
        >>> model(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
        >>> mix = materialize(DCNv2(DCNv2Config(embedding_dim=8, num_cross_layers=2, low_rank=8, num_experts=4, deep_layer_sizes=[32]),
        ...                         features=data.features))   # DCN-Mix: 4 low-rank experts per cross layer
        >>> mix(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
    """

    same_embedding_width: ClassVar[str | None] = None
    """None: the cross network reads the flat concatenation ``x0``, so each feature may have its own width."""

    def __init__(self, config: DCNv2Config, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        embedding_dim, low_rank = config.embedding_dim, config.low_rank
        self.sparse_arch = SparseArch(features, embedding_dim, type(self))
        width = features.num_dense + self.sparse_arch.output_dim
        widths = self.sparse_arch.widths
        embedded = (f"{len(widths)} sparse features × model.embedding_dim={embedding_dim}" if set(widths) <= {embedding_dim}
                    else f"the sparse features' embedding widths {widths}")
        require(
            low_rank is None or low_rank < width,
            f"model.low_rank={low_rank} is not below the cross input width {width} (data.num_dense={features.num_dense} + "
            f"{embedded}), so factoring saves nothing. "
            f"Fix: model.low_rank=null (full rank) or a rank below {width}, e.g. {max(1, width // 4)}",
        )
        self.structure = config.structure
        self.cross: nn.Module
        if config.num_experts:  # DCN-Mix
            assert low_rank is not None, "DCNv2Config refuses num_experts without low_rank"
            self.cross = LowRankMixtureCrossNet(width, config.num_cross_layers, config.num_experts, low_rank).to(dense_device)
        else:
            self.cross = CrossNetwork(width, config.num_cross_layers, low_rank, device=dense_device)
        self.deep = MLP(width, list(config.deep_layer_sizes), device=dense_device)
        head_width = config.deep_layer_sizes[-1] + (width if config.structure == "parallel" else 0)
        self.head = nn.Linear(head_width, 1, device=dense_device)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        x0 = torch.cat([dense, self.sparse_arch(sparse)], dim=1)
        if self.structure == "stacked":
            out = self.deep(self.cross(x0))
        else:
            out = torch.cat([self.cross(x0), self.deep(x0)], dim=1)
        return self.head(out).squeeze(1)
