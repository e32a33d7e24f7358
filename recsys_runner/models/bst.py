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

Where this differs from the paper, on purpose: the time gap is measured to the newest event, not to the time of the
request (``t(v_t) - t(v_i)``; the rows carry no request time); the encoder layers are PyTorch's
(``nn.TransformerEncoderLayer``: a ReLU feed-forward network) and the head's MLP uses ReLU, where the paper uses
LeakyReLU; and the outputs are mean-pooled (or the candidate's taken), not concatenated, so that histories of any
length give one width.

The attention runs on the jagged rows by default (``attention: jagged``): each row's ``1 + n_r`` tokens are cut into tiles
of ``attention_block`` and a query tile meets only its own row's tiles (:func:`~recsys_runner.models.jagged.softmax_attention`,
the softmax spanning the whole row), so the work follows the batch's tokens, not its rows times its longest row.
``attention: padded`` runs ``nn.TransformerEncoder`` on the rows padded to the batch's longest (the reference, the same
weights and the same numbers up to float rounding; an exported program always pads, with plain ATen ops).

Shape legend: ``B`` batch, ``L`` longest history in the batch, ``T = L + 1`` tokens (candidate first),
``D_g`` a token's width (the group's features' embeddings concatenated), ``P`` the pooled features' width,
``N`` dense columns; on the jagged path ``E`` the batch's events.

Example::

    python -m recsys_runner model=bst                                   # generated histories (data=synthetic_sequences)
    python -m recsys_runner model=bst model.position=time_gap model.use_history=false   # the ablation
    python -m recsys_runner experiment=bst_taobao                       # the paper's transformer, TorchEasyRec's optimizers
    python -m recsys_runner model=bst model.attention=padded            # the padded reference
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError, require
from recsys_runner.features import DataNeeds, FeatureSpec, SequenceGroup, check_embedding_dim
from recsys_runner.models.common import MLP, ModelConfig, check_layer_sizes, warn_unread
from recsys_runner.models.jagged import Tiles, host_plus, row_starts, softmax_attention, tile
from recsys_runner.models.sequence import History, JaggedHistory, SequenceArch, check_candidates, recency_positions

__all__ = ["ATTENTIONS", "BST", "BSTConfig", "BehaviorTransformer", "TimeGapBuckets"]

torch.fx.wrap("tile")  # leaves of TorchRec's pipeline trace here too (models/jagged.py says why)
torch.fx.wrap("softmax_attention")
torch.fx.wrap("host_plus")

POSITIONS = ("recency", "time_gap")
"""What a token's positional embedding encodes (``model.position``)."""
READOUTS = ("mean", "candidate")
"""How the transformer's outputs become one vector (``model.readout``)."""
ATTENTIONS = ("jagged", "padded")
"""``model.attention``: the transformer on the batch's tokens as they are (tiled), or padded to the longest row."""


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
    attention: str = "jagged"
    """``jagged``: the transformer on the batch's tokens, tiled (:mod:`recsys_runner.models.jagged`); ``padded``: on the
    rows padded to the batch's longest (the reference; the same numbers up to float rounding)."""
    attention_block: int = 16
    """The jagged path's tile: a row's ``1 + n`` tokens pad to a multiple of it; ``[·, block, block]`` scores per pair of
    tiles. 16 fits BST's short histories: on generated ones (up to 20 or 50 events, CPU) a forward and backward took about
    a third of the padded path's time with 16, and with 32 (a row of 6 tokens padded to 32) as long as the padded path
    on histories up to 20."""

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
        require(self.attention in ATTENTIONS, f"model.attention={self.attention!r} is not a BST attention. Fix: "
                f"model.attention=jagged (one of {list(ATTENTIONS)})")
        require(self.attention_block >= 1, f"model.attention_block must be at least 1, got {self.attention_block}. "
                f"Fix: model.attention_block=16")
        warn_unread(self, ["num_time_buckets"], self.position == "time_gap", "model.position=time_gap")

    def data_needs(self) -> DataNeeds:
        """A history to encode: the default generated data becomes ``data=synthetic_sequences``."""
        return DataNeeds(sequences=True)


class TimeGapBuckets(nn.Module):
    """Each event's gap to the newest event of its row as a bucket: ``(timestamps [B, L], lengths [B], mask [B, L]) →
    [B, L]`` int64, ``floor(log2(1 + gap_seconds))`` capped at ``num_buckets - 1`` (0 for the newest event and on padding).

    Example::

        >>> import torch
        >>> from recsys_runner.models.bst import TimeGapBuckets
        >>> timestamps, lengths, mask = torch.tensor([[0, 3, 7]]), torch.tensor([3]), torch.ones(1, 3, dtype=torch.bool)
        >>> TimeGapBuckets(32)(timestamps, lengths, mask)   # gaps [7, 4, 0] seconds → floor(log2(1 + gap))
        tensor([[3, 2, 0]])
    """

    def __init__(self, num_buckets: int) -> None:
        super().__init__()
        self.num_buckets = num_buckets

    def forward(self, timestamps: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        newest = timestamps.gather(1, (lengths.long() - 1).clamp_min(0).unsqueeze(1))
        return self.bucket((newest - timestamps).masked_fill(~mask, 0))

    def forward_jagged(self, timestamps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The same on jagged rows: ``(timestamps [E] (row after row), lengths [B]) → [E]``."""
        newest = (torch.cumsum(lengths.long(), 0) - 1)[event_rows(lengths, timestamps.shape[0])]  # each event's row's newest
        return self.bucket(timestamps[newest] - timestamps)

    def bucket(self, gaps: torch.Tensor) -> torch.Tensor:
        """``floor(log2(1 + gap))`` of gaps in seconds (a negative one counts as 0), capped at ``num_buckets - 1``."""
        buckets = torch.log2(gaps.clamp_min(0).double() + 1).floor().long()
        return buckets.clamp_max(self.num_buckets - 1)


def event_rows(lengths: torch.Tensor, num_events: int) -> torch.Tensor:
    """``[E]``: the row of each of the ``num_events`` events laid out row after row (``lengths [B]``)."""
    rows = torch.arange(lengths.shape[0], device=lengths.device)
    return torch.repeat_interleave(rows, lengths, output_size=num_events)


class BehaviorTransformer(nn.Module):
    """BST's encoder: ``(candidate [B, D_g], history, use_history) → [B, D_g]``.

    Builds the tokens ``[candidate, event_1 … event_L]`` (``[B, T, D_g]``), adds their positional embeddings
    (``position_index``), runs the transformer layers with padding masked out, and reads out the mean over the real
    tokens or the candidate's output. With ``use_history=False`` every event is masked: only the candidate token is seen.
    :meth:`forward_jagged` is the same on jagged rows (the same weights: the layers' own parameters, tiled attention).

    Example::

        >>> import torch
        >>> from recsys_runner.models.bst import BehaviorTransformer
        >>> from recsys_runner.models.sequence import History
        >>> encoder = BehaviorTransformer(dim=32, num_positions=51, num_blocks=1, num_heads=4, feedforward_dim=128,
        ...                               dropout=0.0, readout="mean")
        >>> lengths = torch.tensor([5, 2, 0, 3])
        >>> history = History(values=torch.randn(4, 5, 32), mask=torch.arange(5) < lengths.unsqueeze(1), lengths=lengths)
        >>> positions = torch.arange(5).expand(4, 5)   # [B, L]: each event's positional index
        >>> encoder(torch.randn(4, 32), history, positions, use_history=True).shape   # candidate [B, 32] → [B, 32]
        torch.Size([4, 32])
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

    def forward_jagged(self, candidate: torch.Tensor, events: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                       block: int, host_sizes: np.ndarray | None = None) -> torch.Tensor:
        """The same on jagged rows: ``(candidate [B, D_g], events [E, D_g] (row after row), positions [E], lengths [B]) →
        [B, D_g]``: each row's tokens ``[candidate, its events]`` flat, every layer's attention over its own row only, in
        tiles of ``block`` tokens (no padding to the batch's longest row). ``host_sizes [B]``: each row's tokens
        (``lengths + 1``) on the host, when the batch carries its lengths there: they size the tiles without a device
        read (:class:`~recsys_runner.models.jagged.Tiles`)."""
        batch = candidate.shape[0]
        sizes = lengths.long() + 1  # [B]: each row's tokens, its candidate first
        at_candidate = row_starts(sizes)
        at_event = torch.arange(events.shape[0], device=events.device) + event_rows(lengths, events.shape[0]) + 1
        own = torch.full((batch,), self.candidate_position, dtype=torch.long, device=candidate.device)
        x = candidate.new_zeros(events.shape[0] + batch, candidate.shape[1])
        x = x.index_copy(0, at_event, events + self.positions(positions)).index_copy(0, at_candidate, candidate + self.positions(own))
        tiles = tile(sizes, block, causal=False, host=host_sizes)
        for layer in self.encoder.layers:
            x = encoder_layer_jagged(cast(nn.TransformerEncoderLayer, layer), x, tiles)
        if self.readout == "candidate":
            return x[at_candidate]
        token_rows = event_rows(sizes, x.shape[0])
        return torch.zeros_like(candidate).index_add(0, token_rows, x) / sizes.unsqueeze(1).to(x.dtype)


def encoder_layer_jagged(layer: nn.TransformerEncoderLayer, x: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    """``nn.TransformerEncoderLayer``'s forward (post-norm, BST's) on jagged tokens ``x [N, D]``, with its own weights:
    multi-head self-attention (:func:`~recsys_runner.models.jagged.softmax_attention` on ``tiles``), dropout, residual
    and norm, then the feed-forward network, dropout, residual and norm."""
    attn = layer.self_attn
    heads, width = attn.num_heads, attn.embed_dim
    q, k, v = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).view(-1, 3, heads, width // heads).unbind(1)
    mixed = softmax_attention(q, k, v, tiles, (width // heads) ** -0.5, attn.dropout, layer.training)
    x = layer.norm1(x + layer.dropout1(attn.out_proj(mixed.reshape(-1, width))))
    return layer.norm2(x + layer.dropout2(layer.linear2(layer.dropout(layer.activation(layer.linear1(x))))))


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

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.bst import BSTConfig
        >>> data = make(SyntheticSequencesConfig, batch_size=8, max_len=6).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> model = materialize(make(BSTConfig, embedding_dim=8, num_heads=2).build(features=data.features))
        >>> model(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
    """

    same_embedding_width: ClassVar[str | None] = None
    """None: a token's width follows each table's own width (a history and its candidate share it)."""

    def __init__(self, config: BSTConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.arch = SequenceArch(features, config.embedding_dim, type(self), jagged=config.attention == "jagged")
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
        self.block = config.attention_block
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

    def jagged_positions(self, history: JaggedHistory) -> torch.Tensor:
        """``[E]``: :meth:`positions` of the jagged events (row after row)."""
        if self.position == "time_gap":
            assert history.timestamps is not None, "checked at construction: the group has timestamps"
            return self.time_buckets.forward_jagged(history.timestamps, history.lengths)
        num_events = history.values.shape[0]
        newest = (torch.cumsum(history.lengths, 0) - 1)[event_rows(history.lengths, num_events)]
        return (newest - torch.arange(num_events, device=newest.device)).clamp_max(self.max_position)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        embedded = self.arch(sparse)
        candidate = torch.cat([embedded.candidates[name] for name in self.candidates], dim=1)
        if embedded.jagged:
            history = embedded.jagged[self.group.name]
            events, positions, lengths = history.values.to(candidate.dtype), self.jagged_positions(history), history.lengths
            if not self.use_history:  # only the candidate token, as the padded path's mask
                events, positions, lengths = events[:0], positions[:0], lengths * 0
            sizes = host_plus(history.host_lengths, 1, events=self.use_history)
            encoded = self.transformer.forward_jagged(candidate, events, positions, lengths, self.block, sizes)
        else:
            padded = embedded.histories[self.group.name]
            encoded = self.transformer(candidate, padded, self.positions(padded), use_history=self.use_history)
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

