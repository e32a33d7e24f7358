"""DIN (Zhou et al., 2018, "Deep Interest Network for Click-Through Rate Prediction",
https://arxiv.org/abs/1706.06978) on TorchRec.

The user's history is attended to by the candidate: for each event ``k`` of the history and the candidate
``q`` (the features sharing the history's tables, e.g. ``item_id`` and ``category`` for ``hist_item_id`` and
``hist_category``), a small MLP over ``[q, k, q - k, q * k]`` gives a weight; as in the paper the weights are
*not* normalized by a softmax (the sum keeps how strongly the history speaks for the candidate), and padding
gets weight 0. The weighted sum of the events (the user's interest *in this candidate*) is concatenated with
every pooled feature and the dense columns, and an MLP gives the logit.

Where this differs from the paper, on purpose: the activation unit reads ``[q, k, q - k, q * k]`` (the authors' released
code) rather than the paper's figure's ``[q, k, outer product]``, and every MLP uses ReLU rather than PReLU/Dice; the
paper's mini-batch aware regularization is not used (the optimizers' weight decay, if any, applies instead).

The attention runs on the jagged events by default (``attention: jagged``): the MLP reads each real event once and the
weighted sum is a per-row segment sum, so nothing is padded to the batch's longest history; ``attention: padded`` pads
(the reference; an exported program always pads, with plain ATen ops).

Shape legend: ``B`` batch, ``L`` longest history in the batch, ``T`` events of the batch, ``D_g`` an event's width (its
features' embeddings concatenated), ``P`` the pooled features' width, ``N`` dense columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import require
from recsys_runner.features import DataNeeds, FeatureSpec, check_embedding_dim
from recsys_runner.models.common import MLP, ModelConfig, check_layer_sizes, warn_unread
from recsys_runner.models.sequence import SequenceArch, check_candidates

__all__ = ["ATTENTIONS", "DIN", "DINConfig", "TargetAttention"]

ATTENTIONS = ("jagged", "padded")
"""``model.attention``: DIN's attention on the batch's events as they are, or padded to the longest history."""


@dataclass(kw_only=True)
class DINConfig(ModelConfig):
    """Schema of ``conf/model/din.yaml``."""

    _target_: str = "recsys_runner.models.din.DIN"
    embedding_dim: int = 16
    """Width ``D`` of every table whose feature sets none."""
    sequence_group: str | None = None
    """The history to attend over (a ``data.sequences`` group); ``null``: the data's first group."""
    attention_layer_sizes: list[int] = field(default_factory=lambda: [64, 32])
    """Hidden layers of the attention MLP over ``[q, k, q-k, q*k]`` (a final 1-unit layer gives the weight)."""
    deep_layer_sizes: list[int] = field(default_factory=lambda: [200, 80])
    """Hidden layers of the head over ``[interest, pooled features, dense]`` (a final 1-unit layer gives the logit)."""
    use_history: bool = True
    """``false``: the same model with the history ignored (the interest vector is 0), to measure what it adds."""
    attention: str = "jagged"
    """``jagged``: the attention on the batch's events as they are (a segment sum per row); ``padded``: on the events
    padded to the batch's longest history (the reference; the same numbers up to float rounding)."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        require(self.attention in ATTENTIONS, f"model.attention={self.attention!r} must be one of {list(ATTENTIONS)}")
        check_layer_sizes("attention_layer_sizes", self.attention_layer_sizes)
        warn_unread(self, ["attention_layer_sizes"], self.use_history, "model.use_history=true")
        check_layer_sizes("deep_layer_sizes", self.deep_layer_sizes)

    def data_needs(self) -> DataNeeds:
        """A history to attend over: the default generated data becomes ``data=synthetic_sequences``."""
        return DataNeeds(sequences=True)


class TargetAttention(nn.Module):
    """DIN's activation unit: ``(query [B, D], keys [B, L, D], mask [B, L]) → interest [B, D]``.

    ``w_l = MLP([q, k_l, q - k_l, q * k_l])``, ``interest = Σ_l w_l · k_l`` over the real events (no softmax).

    Args:
        dim: ``D``, the width of the query and of every event.
        layer_sizes: the MLP's hidden layers (then one unit: the weight).
        device: device of the MLP.

    Example::

        >>> import torch
        >>> from recsys_runner.models.din import TargetAttention
        >>> attention = TargetAttention(dim=8, layer_sizes=[16])
        >>> mask = torch.arange(5) < torch.tensor([[5], [2], [0], [3]])   # [B, L]: each row's real events, left-aligned
        >>> attention(torch.randn(4, 8), torch.randn(4, 5, 8), mask).shape   # query [B, D], keys [B, L, D] → interest [B, D]
        torch.Size([4, 8])
    """

    def __init__(self, dim: int, layer_sizes: list[int], device: torch.device | None = None) -> None:
        super().__init__()
        self.mlp = nn.Sequential(MLP(4 * dim, layer_sizes, device=device), nn.Linear(layer_sizes[-1], 1, device=device))

    def forward(self, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = query.unsqueeze(1).expand_as(keys)
        weights = self.mlp(torch.cat([q, keys, q - keys, q * keys], dim=2)).squeeze(2)
        weights = weights * mask.to(weights.dtype)
        return torch.bmm(weights.unsqueeze(1), keys).squeeze(1)

    def forward_jagged(self, query: torch.Tensor, events: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The same on jagged rows: ``(query [B, D], events [T, D] (row after row), lengths [B]) → interest [B, D]``."""
        rows = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths, output_size=events.shape[0])
        q = query[rows]
        weights = self.mlp(torch.cat([q, events, q - events, q * events], dim=1))  # [T, 1]
        return torch.zeros_like(query).index_add(0, rows, weights * events)


class DIN(nn.Module):
    """DIN: ``(dense [B, N], sparse KJT with a history) → logits [B]``; see the module docstring.

    Args:
        config: its hyperparameters (:class:`DINConfig`).
        features: the data's schema; it must have a sequence group whose every feature shares a table with a
            candidate feature (``hist_item_id`` ↔ ``item_id``).
        dense_device: device of the dense parameters (embedding tables start on ``meta``).

    Raises:
        ConfigError: the data has no sequence group, or a history feature has no candidate.

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.din import DIN, DINConfig
        >>> data = make(SyntheticSequencesConfig, batch_size=8, max_len=6).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> model = materialize(DIN(make(DINConfig, embedding_dim=8, attention_layer_sizes=[16], deep_layer_sizes=[16]),
        ...                           features=data.features))
        >>> model(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
    """

    same_embedding_width: ClassVar[str | None] = None
    """None: the event and candidate widths follow each table's own width (a history and its candidate share it)."""

    def __init__(self, config: DINConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.arch = SequenceArch(features, config.embedding_dim, type(self), jagged=config.attention == "jagged")
        self.group = features.group(config.sequence_group, model="DIN")
        self.candidates = check_candidates(features, self.group, "DIN")
        dim = self.arch.group_dims[self.group.name]
        self.use_history = config.use_history
        self.attention = TargetAttention(dim, list(config.attention_layer_sizes), device=dense_device)
        width = dim + self.arch.pooled_dim + features.num_dense
        self.head = nn.Sequential(MLP(width, list(config.deep_layer_sizes), device=dense_device),
                                  nn.Linear(config.deep_layer_sizes[-1], 1, device=dense_device))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        embedded = self.arch(sparse)
        query = torch.cat([embedded.candidates[name] for name in self.candidates], dim=1)
        if embedded.jagged:
            events = embedded.jagged[self.group.name]
            interest = self.attention.forward_jagged(query, events.values.to(query.dtype), events.lengths)
        else:
            history = embedded.histories[self.group.name]
            interest = self.attention(query, history.values, history.mask)
        if not self.use_history:  # multiplied, not skipped: every parameter stays in the graph (DDP expects it)
            interest = interest * 0.0
        return self.head(torch.cat([interest, embedded.pooled, dense], dim=1)).squeeze(1)
