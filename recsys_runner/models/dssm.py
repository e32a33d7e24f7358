"""DSSM (Huang et al., 2013, "Learning Deep Structured Semantic Models for Web Search using
Clickthrough Data", https://dl.acm.org/doi/10.1145/2505515.2505665): a two-tower retrieval model.

The features are split into a user (query) group and an item (candidate) group, from config. Each
tower embeds its group, runs an MLP and outputs an (optionally L2-normalized) vector; the score of a
(user, item) pair is their dot product divided by a temperature. Training uses the in-batch softmax
(Yi et al. 2019): every row is a positive (user, item) pair, and the other rows' items in the batch
are its negatives. Eval computes ``recall@k`` over the same in-batch candidates.

Shape legend: ``B`` batch, ``D`` embedding dim, ``O`` tower output width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError, require
from recsys_runner.features import DataNeeds, FeatureSpec, check_embedding_dim
from recsys_runner.models.common import MLP, ModelConfig, SparseArch, check_layer_sizes
from recsys_runner.tasks import InBatchSoftmaxTask


@dataclass(kw_only=True)
class DSSMConfig(ModelConfig):
    """Schema of ``conf/model/dssm.yaml``."""

    _target_: str = "recsys_runner.models.dssm.DSSM"
    embedding_dim: int = 16
    """Width ``D`` of every embedding table whose feature sets no ``embedding_dim`` of its own in ``data.sparse``
    (this model accepts mixed per-feature widths)."""
    user_features: list[str] = field(default_factory=lambda: ["cat_0"])
    """The user (query) tower's features: sparse or dense feature names of the data."""
    item_features: list[str] = field(default_factory=lambda: ["cat_1"])
    """The item (candidate) tower's features; none may also be a user feature."""
    tower_layer_sizes: list[int] = field(default_factory=lambda: [64, 32])
    """Layers of both towers; the last is the output width ``O`` of the user and item vectors."""
    temperature: float = 0.05
    """Scores are ``<u, v> / temperature``; small values sharpen the in-batch softmax."""
    normalize: bool = True
    """L2-normalize both tower outputs (cosine similarity)."""
    eval_metrics: list[str] = field(default_factory=lambda: ["recall@1", "recall@10", "recall@50"])
    """Retrieval metrics over in-batch candidates, logged as ``eval/<name>`` (``metrics.eval`` does not apply);
    only ``recall@<k>`` applies (checked with the task's metrics before the first step)."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        require(len(self.user_features) > 0, "model.user_features is empty; list the user tower's features, e.g. [user_id]")
        require(len(self.item_features) > 0, "model.item_features is empty; list the item tower's features, e.g. [item_id]")
        both = sorted(set(self.user_features) & set(self.item_features))
        require(not both, f"features {both} are in both model.user_features and model.item_features; each belongs to one tower")
        check_layer_sizes("tower_layer_sizes", self.tower_layer_sizes)
        require(self.temperature > 0, f"model.temperature must be positive, got {self.temperature}")

    def data_needs(self) -> DataNeeds:
        """(user, item) pairs over the two towers' features: generated data (``data=synthetic``) links them."""
        return DataNeeds(user_features=tuple(self.user_features), item_features=tuple(self.item_features))


def check_group(features: FeatureSpec, key: str, names: list[str]) -> None:
    """Raise :class:`ConfigError` listing the valid names when ``names`` has one the data lacks."""
    valid = [*features.sparse_names, *features.dense_names]
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ConfigError(f"{key} has {unknown}, which the data does not have. Valid feature names: {', '.join(valid)}")


class Tower(nn.Module):
    """One side of the two towers: its features' embeddings and dense columns → a vector.

    ``(embedded [B, ΣD_f], dense [B, N]) → [B, O]``: the tower's columns of both (``sparse_columns``
    from :meth:`SparseArch.columns`, ``dense_index``), through an MLP (ReLU between layers, none after
    the last), L2-normalized when ``normalize``.
    """

    def __init__(self, sparse_columns: list[int], dense_index: list[int], layer_sizes: list[int],
                 normalize: bool, device: torch.device | None = None) -> None:
        super().__init__()
        self.sparse_columns, self.dense_index, self.normalize = sparse_columns, dense_index, normalize
        in_features = len(sparse_columns) + len(dense_index)
        self.hidden = MLP(in_features, layer_sizes[:-1], device=device) if len(layer_sizes) > 1 else nn.Identity()
        self.out = nn.Linear(layer_sizes[-2] if len(layer_sizes) > 1 else in_features, layer_sizes[-1], device=device)

    def forward(self, embedded: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x = torch.cat([embedded[:, self.sparse_columns], dense[:, self.dense_index]], dim=1)
        v = self.out(self.hidden(x))
        return F.normalize(v, dim=1) if self.normalize else v


class DSSM(nn.Module):
    """Two towers; ``(dense [B, N], sparse KJT) → scores [B, B]``, ``scores[q, c] = <user_q, item_c> / τ``.

    Row ``q``'s positive is candidate ``q`` (the diagonal); its ``tasks`` is one
    :class:`~recsys_runner.tasks.InBatchSoftmaxTask`, so the TrainWrapper applies the in-batch softmax loss
    and eval computes ``recall@k``.

    Args:
        config: its hyperparameters (:class:`DSSMConfig`: ``embedding_dim`` ``D``, the towers' feature names
            ``user_features`` / ``item_features`` (sparse or dense), ``tower_layer_sizes`` ending in ``O``,
            ``temperature``, ``normalize``, ``eval_metrics``).
        features: the data's feature schema; the groups are checked against it.
        dense_device: device of the dense parameters (embeddings start on ``meta``).

    Example::

        data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        model = DSSM(DSSMConfig(embedding_dim=8, user_features=["cat_0", "int_0"], item_features=["cat_1"],
                                tower_layer_sizes=[16, 8]), features=data.features)
        model.user_item(batch.dense_features, batch.sparse_features)   # ([8, 8], [8, 8])
        model(batch.dense_features, batch.sparse_features)             # [8, 8]
    """

    same_embedding_width: ClassVar[str | None] = None
    """None: each tower concatenates its features' embeddings, so each feature may have its own width."""

    def __init__(self, config: DSSMConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        check_group(features, "model.user_features", list(config.user_features))
        check_group(features, "model.item_features", list(config.item_features))
        self.tasks = (InBatchSoftmaxTask(eval_metrics=tuple(config.eval_metrics) if config.eval_metrics else None),)
        self.temperature = config.temperature
        self.sparse_arch = SparseArch(features, config.embedding_dim, type(self))

        def tower(names: list[str]) -> Tower:
            sparse = self.sparse_arch.columns([n for n in names if n in features.sparse_names])
            dense = [features.dense_names.index(n) for n in names if n in features.dense_names]
            return Tower(sparse, dense, list(config.tower_layer_sizes), config.normalize, device=dense_device)

        self.user_tower, self.item_tower = tower(list(config.user_features)), tower(list(config.item_features))
        self.tower_features = {"user": list(config.user_features), "item": list(config.item_features)}
        """Each tower's features (data columns, sparse or dense), by tower name: what :meth:`tower` reads."""

    def tower(self, name: str, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Tower ``name``'s (``user`` or ``item``) vectors ``[B, O]``; it reads only its own features of the batch.

        Serving uses the towers apart: user vectors at request time, item vectors computed once into an index
        (``python -m recsys_runner.export`` writes each as its own program)."""
        return getattr(self, f"{name}_tower")(self.sparse_arch(sparse), dense)

    def user_item(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The user and item vectors: ``([B, O], [B, O])`` (e.g. to export the item index)."""
        embedded = self.sparse_arch(sparse)
        return self.user_tower(embedded, dense), self.item_tower(embedded, dense)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        user, item = self.user_item(dense, sparse)
        return user @ item.t() / self.temperature
