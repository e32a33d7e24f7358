"""BST (Chen, Zhao, Li, Huang, Ou, 2019, "Behavior Sequence Transformer for E-commerce Recommendation in
Alibaba", https://arxiv.org/abs/1905.06874) on TorchRec.

The user's history events and the candidate form one sequence of tokens: each event's token is its features'
embeddings concatenated (``hist_item_id``, ``hist_category``), the candidate's token the features that share
the history's tables (``item_id``, ``category``), so both live in the same embedding space. A positional
embedding is added to every token: by *recency* (``position: recency``, 0 for the newest event, the candidate
its own index) or, as in the paper, by the *time gap* to the newest event (``position: time_gap``, a learned
vector per log-scale bucket of the gap in seconds; the candidate again its own index). ``num_blocks``
transformer encoder layers (multi-head self-attention + feed-forward, post-norm as in the paper) run over the
real tokens only (padding is masked out of every attention). The transformer's output is read out either as the
mean of every real token's output (``readout: mean``, the default: the variable-length counterpart of the
paper's concatenation of all outputs) or as the candidate token's output (``readout: candidate``). It is
concatenated with every pooled feature and the dense columns, and an MLP gives the logit.

The candidate token is always present, so an empty history is a sequence of one token.

Shape legend: ``B`` batch, ``L`` longest history in the batch, ``T = L + 1`` tokens (candidate first),
``D_g`` a token's width (the group's features' embeddings concatenated), ``P`` the pooled features' width,
``N`` dense columns.

Example::

    python -m recsys_runner model=bst                                   # generated histories (data=synthetic_sequences)
    python -m recsys_runner model=bst model.position=time_gap model.use_history=false   # the ablation
    python -m recsys_runner experiment=bst_taobao                       # the paper's transformer, TorchEasyRec's optimizers
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError, require
from recsys_runner.features import DataNeeds, FeatureSpec, SequenceGroup, check_embedding_dim
from recsys_runner.models.common import MLP, ModelConfig, check_layer_sizes
from recsys_runner.models.sequence import History, SequenceArch, check_candidates, recency_positions

__all__ = ["BST", "BSTConfig", "BehaviorTransformer", "TimeGapBuckets"]

POSITIONS = ("recency", "time_gap")
"""What a token's positional embedding encodes (``model.position``)."""
READOUTS = ("mean", "candidate")
"""How the transformer's outputs become one vector (``model.readout``)."""


@dataclass(kw_only=True)
class BSTConfig(ModelConfig):
    """Schema of ``conf/model/bst.yaml``."""

    _target_: str = "recsys_runner.models.bst.BST"
    embedding_dim: int = 16
    """Width ``D`` of every table whose feature sets none; a token is ``D_g = Σ D_f`` over the group's features."""
    sequence_group: str | None = None
    """The history to encode (a ``data.sequences`` group); ``null``: the data's first group."""
    num_blocks: int = 1
    """Transformer encoder layers (the paper found 1 best)."""
    num_heads: int = 4
    """Attention heads per layer; must divide the token width ``D_g``."""
    feedforward_dim: int | None = None
    """Hidden width of each layer's feed-forward network; ``null``: 4 × ``D_g``."""
    dropout: float = 0.1
    """Dropout in attention and feed-forward (0 to turn it off)."""
    position: str = "recency"
    """``recency``: an embedding per distance from the newest event; ``time_gap``: an embedding per log-scale
    bucket of the seconds between each event and the newest (needs the group's ``timestamps``)."""
    num_time_buckets: int = 32
    """With ``position: time_gap``: buckets ``floor(log2(1 + gap))``, the last one holding every longer gap."""
    readout: str = "mean"
    """``mean``: the mean of every real token's output; ``candidate``: the candidate token's output."""
    deep_layer_sizes: list[int] = field(default_factory=lambda: [200, 80])
    """Hidden layers of the head over ``[transformer output, pooled features, dense]`` (a final 1-unit layer gives the logit)."""
    use_history: bool = True
    """``false``: the same model with every history event masked out (only the candidate token), to measure what the history adds."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        check_layer_sizes("deep_layer_sizes", self.deep_layer_sizes)
        require(self.num_blocks >= 1, f"model.num_blocks must be at least 1, got {self.num_blocks}. Fix: model.num_blocks=1")
        require(self.num_heads >= 1, f"model.num_heads must be at least 1, got {self.num_heads}. Fix: model.num_heads=4")
        require(self.feedforward_dim is None or self.feedforward_dim > 0,
                f"model.feedforward_dim must be positive or null, got {self.feedforward_dim}. Fix: model.feedforward_dim=null")
        require(0 <= self.dropout < 1, f"model.dropout must lie in [0, 1), got {self.dropout}. Fix: model.dropout=0.1")
        require(self.position in POSITIONS, f"model.position={self.position!r} is not a BST position. Fix: model.position=recency "
                f"(one of {list(POSITIONS)})")
        require(self.num_time_buckets >= 1, f"model.num_time_buckets must be at least 1, got {self.num_time_buckets}. "
                f"Fix: model.num_time_buckets=32")
        require(self.readout in READOUTS, f"model.readout={self.readout!r} is not a BST readout. Fix: model.readout=mean "
                f"(one of {list(READOUTS)})")

    def data_needs(self) -> DataNeeds:
        """A history to encode: the default generated data becomes ``data=synthetic_sequences``."""
        return DataNeeds(sequences=True)


class TimeGapBuckets(nn.Module):
    """Each event's gap to the newest event of its row as a bucket: ``(timestamps [B, L], lengths [B], mask [B, L]) →
    [B, L]`` int64, ``floor(log2(1 + gap_seconds))`` capped at ``num_buckets - 1`` (0 for the newest event and on padding).

    Example::

        buckets = TimeGapBuckets(32)(torch.tensor([[0, 3, 7]]), torch.tensor([3]), torch.ones(1, 3, dtype=torch.bool))
        # gaps [7, 4, 0] seconds → tensor([[3, 2, 0]])
    """

    def __init__(self, num_buckets: int) -> None:
        super().__init__()
        self.num_buckets = num_buckets

    def forward(self, timestamps: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        newest = timestamps.gather(1, (lengths.long() - 1).clamp_min(0).unsqueeze(1))
        gaps = (newest - timestamps).clamp_min(0).masked_fill(~mask, 0)
        buckets = torch.log2(gaps.double() + 1).floor().long()
        return buckets.clamp_max(self.num_buckets - 1)


class BehaviorTransformer(nn.Module):
    """BST's encoder: ``(candidate [B, D_g], history, use_history) → [B, D_g]``.

    Builds the tokens ``[candidate, event_1 … event_L]`` (``[B, T, D_g]``), adds their positional embeddings
    (``position_index``), runs the transformer layers with padding masked out, and reads out the mean over the real
    tokens or the candidate's output. With ``use_history=False`` every event is masked: only the candidate token is seen.

    Example::

        encoder = BehaviorTransformer(dim=32, num_positions=51, num_blocks=1, num_heads=4, feedforward_dim=128,
                                      dropout=0.0, readout="mean")
        out = encoder(candidate, history, positions, use_history=True)   # [B, 32]
    """

    def __init__(self, dim: int, num_positions: int, num_blocks: int, num_heads: int, feedforward_dim: int, dropout: float,
                 readout: str, device: torch.device | None = None) -> None:
        super().__init__()
        self.readout = readout
        self.candidate_position = num_positions - 1
        self.positions = nn.Embedding(num_positions, dim, device=device)
        layer = nn.TransformerEncoderLayer(dim, num_heads, dim_feedforward=feedforward_dim, dropout=dropout,
                                           batch_first=True, device=device)
        self.encoder = nn.TransformerEncoder(layer, num_blocks, enable_nested_tensor=False)

    def forward(self, candidate: torch.Tensor, history: History, positions: torch.Tensor, use_history: bool = True) -> torch.Tensor:
        """``positions [B, L]``: each event's positional index (below ``num_positions - 1``, the candidate's)."""
        batch = candidate.shape[0]
        events = history.values + self.positions(positions)
        own = torch.full((batch,), self.candidate_position, dtype=torch.long, device=candidate.device)
        tokens = torch.cat([(candidate + self.positions(own)).unsqueeze(1), events], dim=1)
        real = history.mask if use_history else torch.zeros_like(history.mask)
        real = torch.cat([torch.ones(batch, 1, dtype=torch.bool, device=real.device), real], dim=1)
        out = self.encoder(tokens, src_key_padding_mask=~real)
        if self.readout == "candidate":
            return out[:, 0]
        weights = real.to(out.dtype).unsqueeze(2)
        return (out * weights).sum(dim=1) / weights.sum(dim=1)


class BST(nn.Module):
    """BST: ``(dense [B, N], sparse KJT with a history) → logits [B]``; see the module docstring.

    Args:
        config: its hyperparameters (:class:`BSTConfig`).
        features: the data's schema; it must have a sequence group whose every feature shares a table with a
            candidate feature (``hist_item_id`` ↔ ``item_id``), and event times for ``position: time_gap``.
        dense_device: device of the dense parameters (embedding tables start on ``meta``).

    Raises:
        ConfigError: the data has no sequence group, a history feature has no candidate, ``num_heads`` does not
            divide the token width, or ``position: time_gap`` on a group without timestamps.

    Example::

        model = make(BSTConfig, num_heads=2).build(features=SyntheticSequences(make(SyntheticSequencesConfig)).features)
        logits = model(batch.dense_features, batch.sparse_features)   # [B]
    """

    same_embedding_width: ClassVar[str | None] = None
    """None: a token's width follows each table's own width (a history and its candidate share it)."""

    def __init__(self, config: BSTConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.arch = SequenceArch(features, config.embedding_dim, type(self))
        self.group = features.group(config.sequence_group, model="BST")
        self.candidates = check_candidates(features, self.group, "BST")
        dim = self.arch.group_dims[self.group.name]
        _check_heads(config.num_heads, dim, self.group)
        self.position = config.position
        self.max_position = self.group.max_len - 1
        num_positions = self.group.max_len + 1
        if config.position == "time_gap":
            _check_timestamps(self.group)
            num_positions = config.num_time_buckets + 1
        self.time_buckets = TimeGapBuckets(config.num_time_buckets)
        self.use_history = config.use_history
        self.transformer = BehaviorTransformer(dim, num_positions, config.num_blocks, config.num_heads,
                                               config.feedforward_dim or 4 * dim, config.dropout, config.readout,
                                               device=dense_device)
        width = dim + self.arch.pooled_dim + features.num_dense
        self.head = nn.Sequential(MLP(width, list(config.deep_layer_sizes), device=dense_device),
                                  nn.Linear(config.deep_layer_sizes[-1], 1, device=dense_device))

    def positions(self, history: History) -> torch.Tensor:
        """``[B, L]``: each event's positional index: its recency (capped at ``max_len - 1``) or its time-gap bucket."""
        if self.position == "time_gap":
            assert history.timestamps is not None, "checked at construction: the group has timestamps"
            return self.time_buckets(history.timestamps, history.lengths, history.mask)
        return recency_positions(history.lengths, history.values.shape[1]).clamp_max(self.max_position)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        embedded = self.arch(sparse)
        history = embedded.histories[self.group.name]
        candidate = torch.cat([embedded.candidates[name] for name in self.candidates], dim=1)
        encoded = self.transformer(candidate, history, self.positions(history), use_history=self.use_history)
        return self.head(torch.cat([encoded, embedded.pooled, dense], dim=1)).squeeze(1)


def _check_heads(num_heads: int, dim: int, group: SequenceGroup) -> None:
    """Raise :class:`ConfigError` unless ``num_heads`` divides the token width ``dim``, suggesting the nearest that does."""
    if dim % num_heads:
        divisors = [h for h in range(1, dim + 1) if dim % h == 0]
        nearest = min(divisors, key=lambda h: (abs(h - num_heads), h))
        raise ConfigError(
            f"model.num_heads={num_heads} does not divide BST's token width {dim} (the embeddings of "
            f"data.sequences.{group.name}'s features {list(group.features)}, concatenated): each head attends over "
            f"width/num_heads columns. Fix: model.num_heads={nearest} (any of {divisors})"
        )


def _check_timestamps(group: SequenceGroup) -> None:
    """Raise :class:`ConfigError` for ``position: time_gap`` on a group without event times."""
    if group.timestamps is None:
        raise ConfigError(
            f"model.position=time_gap embeds the time between each event and the newest one, but data.sequences.{group.name} "
            f"has no timestamps. Fix: model.position=recency, or give the data event times (data=synthetic_sequences: "
            f"data.timestamps=true; files: data.sequences.{group.name}.timestamps=<column of event times>)"
        )

