"""SASRec (Kang & McAuley, 2018, "Self-Attentive Sequential Recommendation", https://arxiv.org/abs/1808.09781): a
next-item model, with HSTU's block as an option (``block: hstu``, :mod:`recsys_runner.models.hstu`).

A row's history (oldest first) is prefixed with a learned start token and read by causally masked self-attention
blocks, so position ``t`` holds the user's state after ``t`` events and predicts event ``t + 1``; the state after the
whole history predicts the row's candidate ``item_id``, which a next-item model's data makes the true next item
(``DataNeeds(next_item=True)``). Inputs are each event's features (``hist_item_id``, ``hist_category``) projected to
the item table's width ``D``, scaled by ``√D``, plus a learned embedding of the event's distance from the newest
event; a state scores an item by the dot product with the item's own embedding (the same table, as in the paper),
of both L2-normalized when ``normalize``, divided by ``temperature``.

* Training (:meth:`SASRec.sampled_logits`): a sampled softmax over the batch's items. Every real position's positive
  is its next item; its negatives are the other positions' positives (each distinct item once), with the logQ
  correction ``- ln(count / P)`` of the in-batch frequency when ``logq_correction``. This departs from the paper on
  purpose: SASRec was trained with a binary cross-entropy of each positive against one uniformly sampled negative
  and raw dot products; this trains as HSTU's next-item experiments do, a softmax over many negatives, on cosines
  with a temperature (``normalize``; ``false`` for raw dot products). The start token and the recency (rather than
  absolute) positions are this implementation's too.
* Evaluation (:meth:`SASRec.full_scores`): the state after the whole history against every candidate item of the
  table (the ``C`` items predict may recommend, never the OOV rows: :meth:`SASRec.use_candidates`), ``[B, C]``, for
  ``hr@<k>``/``ndcg@<k>``. The table is read through the model's own (sharded) EmbeddingCollection,
  once per evaluation (kept while the model is in eval mode): every rank looks up ids ``0 … N-1`` at its first eval
  batch, so the collective is the same on every rank. An eval batch holds ``B × C`` scores (and the table ``N × D``):
  for tables of millions of items, lower ``data.batch_size`` for eval or cap it with ``train.eval_max_batches``.

Shape legend: ``B`` batch, ``L`` longest history in the batch (``L + 1`` positions with the start token), ``D`` the
item table's width (the model's width), ``D_g`` an event's width (its features' embeddings concatenated), ``H``
heads, ``P`` real positions of the batch, ``U`` distinct positives among them, ``N`` items in the table, ``K = min(P, N)``
the columns of the training logits (a bound of ``U`` known on the host), ``C`` of the ``N`` items candidates (those that
may be recommended).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError, require
from recsys_runner.features import DataNeeds, FeatureSpec, SequenceGroup, check_embedding_dim
from recsys_runner.models.common import ModelConfig, check_eval_metrics, require_count, warn_unread
from recsys_runner.models.fixed_sizes import distinct_positives, flat_positions, real_positions
from recsys_runner.models.hstu import HSTUBlock, query_and_key_times
from recsys_runner.models.jagged import host_plus, take, tile
from recsys_runner.models.jagged_kernels import check_kernel
from recsys_runner.models.ranking_eval import sampled_negatives, seen_ids, without_seen
from recsys_runner.models.sequence import History, SequenceArch, padded, recency_positions
from recsys_runner.tasks import NextItemTask

__all__ = ["BLOCKS", "SASRec", "SASRecBlock", "SASRecConfig"]

torch.fx.wrap("padded")  # a leaf of TorchRec's pipeline trace here too (models/sequence.py says why)
torch.fx.wrap("tile")  # and the jagged tiling (models/jagged.py says why)
torch.fx.wrap("host_plus")
torch.fx.wrap("real_positions")  # and the sampled softmax's host-sized helpers (models/fixed_sizes.py says why)
torch.fx.wrap("distinct_positives")

BLOCKS = ("sasrec", "hstu")
"""``model.block`` options: SASRec's softmax self-attention + feed-forward, or HSTU's pointwise gated attention."""
NOT_A_CANDIDATE = -100
"""The target index :meth:`SASRec.full_scores` gives an eval row whose true item is no candidate (an OOV row: eval rows
encoded with ``data sequences --vocab`` hold items the earlier mapping has not seen): ``F.cross_entropy``'s
``ignore_index``, so the eval loss leaves the row out (no column of the scores holds its item, and an index past them
stopped the eval inside torch), and :func:`~recsys_runner.metrics.retrieval.target_ranks` counts it a miss."""


@dataclass(kw_only=True)
class SASRecConfig(ModelConfig):
    """Schema of ``conf/model/sasrec.yaml``."""

    _target_: str = "recsys_runner.models.sasrec.SASRec"
    embedding_dim: int = 64
    """Width ``D`` of every table whose feature sets none; the item table's width is the model's width."""
    sequence_group: str | None = None
    """The history to read (a ``data.sequences`` group); ``null``: the data's first group."""
    item_feature: str | None = None
    """The history feature holding item ids (its candidate, e.g. ``item_id``, is the next item); ``null``: the
    group's first feature."""
    block: str = "sasrec"
    """``sasrec``: causal softmax self-attention and a feed-forward layer per block; ``hstu``: HSTU's pointwise SiLU
    attention with a relative position (and time) bias, gated by ``U`` (Zhai et al. 2024)."""
    num_blocks: int = 2
    """Attention blocks stacked."""
    num_heads: int = 1
    """Attention heads; must divide the item table's width."""
    dropout: float = 0.2
    """Dropout on the inputs and inside every block."""
    temperature: float = 0.05
    """Scores are ``<state, item> / temperature``."""
    normalize: bool = True
    """L2-normalize the states and the item embeddings (cosine scores)."""
    logq_correction: bool = True
    """Subtract ``ln`` of each in-batch item's frequency from its training logits (Yi et al. 2019), so popular items
    are not over-penalized as negatives."""
    time_buckets: int = 128
    """``block: hstu``: log-scale time-gap buckets of the relative bias when the history has event times (``0``: no
    time bias)."""
    attention_block: int = 32
    """``block: hstu``: its attention runs on the jagged rows, cut into tiles of this many positions
    (:mod:`recsys_runner.models.jagged`: the work follows the batch's positions, not its rows × its longest row, which
    per-user rows of long-tailed lengths need); ``0``: on the rows padded to the batch's longest (the reference). The
    ``sasrec`` block's softmax attention always runs padded."""
    attention_kernel: str = "auto"
    """``block: hstu``: what its jagged attention runs on: ``auto`` (fbgemm's on CUDA once a probe there matched the
    tiles, else the tiles), ``tiles`` (PyTorch ops) or ``fbgemm`` (fbgemm's jagged products: Triton kernels on CUDA;
    :mod:`recsys_runner.models.jagged_kernels`)."""
    eval_metrics: list[str] = field(default_factory=lambda: ["hr@10", "ndcg@10", "hr@50", "mrr"])
    """Ranking metrics of the true next item, logged as ``eval/hr_at_10`` …: ``hr@<k>``, ``ndcg@<k>``, ``mrr``,
    ``coverage@<k>`` (not with ``eval_negatives``). Over the whole item table, less each row's seen items with
    ``metrics.exclude_seen``, or against ``eval_negatives`` sampled items (docs/metrics.md, "Protocols")."""
    eval_negatives: int = 0
    """``0``: rank the true item against the whole item table. ``N > 0``: against ``N`` items drawn uniformly, without
    replacement, from the item table less the row's seen items (history and target), with a fixed seed: the same
    negatives for every model and run on the same eval rows (the SASRec paper's protocol with ``N = 100``)."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        require(self.block in BLOCKS, f"model.block={self.block!r} must be one of {list(BLOCKS)}, e.g. model.block=hstu")
        for key, least, note in (("num_blocks", 1, ""), ("num_heads", 1, ""), ("time_buckets", 0, ""), ("attention_block", 0, " (0: padded)"),
                                 ("eval_negatives", 0, " (0: the whole item table)")):
            require_count(self, key, least, note)
        require(self.embedding_dim % self.num_heads == 0, f"model.num_heads={self.num_heads} must divide model.embedding_dim="
                f"{self.embedding_dim} (each head takes an equal share). Fix: model.num_heads=1, or a divisor of it")
        require(0 <= self.dropout < 1, f"model.dropout must lie in [0, 1), got {self.dropout}. Fix: e.g. model.dropout=0.2")
        require(self.temperature > 0, f"model.temperature must be positive, got {self.temperature}. Fix: e.g. model.temperature=0.05")
        check_kernel(self.attention_kernel, self.block == "hstu" and self.attention_block > 0,
                     f"model.block={self.block}" if self.block != "hstu" else "model.attention_block=0")
        warn_unread(self, ["time_buckets"], self.block == "hstu", "model.block=hstu")
        check_eval_metrics(self.eval_metrics, self.eval_negatives, "items of the whole table", "hr@10,ndcg@10")

    def data_needs(self) -> DataNeeds:
        """Histories whose rows' candidates are the true next items: generated data has no sampled negatives."""
        return DataNeeds(sequences=True, next_item=True)


class SASRecBlock(nn.Module):
    """One pre-norm SASRec block: ``(x [B, L, D], mask [B, L], times) → [B, L, D]``.

    ``x + Dropout(CausalSelfAttention(LN(x)))``, then ``+ Dropout(FFN(LN(·)))`` with a ReLU feed-forward of width
    ``D``; position ``i`` attends to positions ``j <= i`` (padding lies after every real position, so causality keeps
    it out of the real positions' states). ``times`` is ignored (SASRec has no time bias).

    Example::

        >>> import torch
        >>> from recsys_runner.models.sasrec import SASRecBlock
        >>> block = SASRecBlock(dim=16, num_heads=2, dropout=0.0)
        >>> mask = torch.arange(10) < torch.tensor([[10], [4], [1], [7]])   # [B, L]: each row's real positions, left-aligned
        >>> block(torch.randn(4, 10, 16), mask).shape
        torch.Size([4, 10, 16])
    """

    def __init__(self, dim: int, num_heads: int, dropout: float, device: torch.device | None = None) -> None:
        super().__init__()
        self.num_heads, self.dropout_p = num_heads, dropout
        self.norm_attention = nn.LayerNorm(dim, device=device)
        self.qkv = nn.Linear(dim, 3 * dim, device=device)
        self.out = nn.Linear(dim, dim, device=device)
        self.norm_ffn = nn.LayerNorm(dim, device=device)
        self.ffn = nn.Sequential(nn.Linear(dim, dim, device=device), nn.ReLU(), nn.Dropout(dropout), nn.Linear(dim, dim, device=device))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, times: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b, length, dim = x.shape
        q, k, v = (t.reshape(b, length, self.num_heads, dim // self.num_heads).transpose(1, 2)
                   for t in self.qkv(self.norm_attention(x)).split(dim, dim=2))
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout_p if self.training else 0.0)
        x = x + self.dropout(self.out(mixed.transpose(1, 2).reshape(b, length, dim)))
        return x + self.dropout(self.ffn(self.norm_ffn(x)))


class SASRec(nn.Module):
    """SASRec / HSTU next-item model: ``(dense [B, N_dense], sparse KJT with a history) → (scores, targets)``.

    In training ``(logits [P, K], positives [P])`` (:meth:`sampled_logits`), in eval mode ``(scores [B, N],
    true item ids [B])`` (:meth:`full_scores`); its task is :class:`~recsys_runner.tasks.NextItemTask`. Dense
    columns and the other features are not read (the state depends on the history alone).

    Args:
        config: its hyperparameters (:class:`SASRecConfig`).
        features: the data's schema: a sequence group with an item feature that shares its table with a candidate
            feature (``hist_item_id`` ↔ ``item_id``).
        dense_device: device of the dense parameters (embedding tables start on ``meta``).

    Raises:
        ConfigError: no sequence group, no such ``model.item_feature`` in it, no candidate for it, or heads that do
            not divide the item table's width.

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.sasrec import SASRec, SASRecConfig
        >>> data = make(SyntheticSequencesConfig, batch_size=8, max_len=6, num_items=100, negatives=0.0).build()   # candidates: the next items
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> model = materialize(SASRec(make(SASRecConfig, embedding_dim=8, num_blocks=1, block="hstu", num_heads=2),
        ...                              features=data.features))
        >>> logits, positives = model(batch.dense_features, batch.sparse_features)   # training: [P, K], [P]
        >>> positions = int(batch.sparse_features["hist_item_id"].lengths().sum()) + 8   # each event's successor, then the candidate
        >>> logits.shape[0] == positives.shape[0] == positions
        True
        >>> scores, items = model.eval()(batch.dense_features, batch.sparse_features)   # eval: every item's score, the true item
        >>> scores.shape, items.shape   # [B, N] over the N = 100 items, [B]
        (torch.Size([8, 100]), torch.Size([8]))
    """

    same_embedding_width: ClassVar[str | None] = None
    """None: events are projected to the item table's width, so features may have their own widths."""

    def __init__(self, config: SASRecConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.arch = SequenceArch(features, config.embedding_dim, type(self))
        self.group = features.group(config.sequence_group, model="SASRec")
        self.item_feature, self.candidate = _item_and_candidate(features, self.group, config.item_feature)
        widths = dict(zip(features.sparse_names, features.embedding_dims(config.embedding_dim), strict=True))
        dim = widths[self.item_feature]
        require(dim % config.num_heads == 0, f"model.num_heads={config.num_heads} must divide the item table's width {dim} "
                f"(data.sparse {self.item_feature}'s embedding_dim, else model.embedding_dim). Fix: model.num_heads=1")
        self.item_offset = sum(widths[f] for f in self.group.features[: self.group.features.index(self.item_feature)])
        """Where the item feature's embedding starts among an event's ``D_g`` columns."""
        self.dim, self.num_items = dim, next(f.num_embeddings for f in features.sparse if f.name == self.item_feature)
        self.temperature, self.normalize, self.logq = config.temperature, config.normalize, config.logq_correction
        self.tasks = (NextItemTask(eval_metrics=tuple(config.eval_metrics) if config.eval_metrics else None, num_items=self.num_items,
                                   eval_negatives=config.eval_negatives),)
        self.eval_negatives = config.eval_negatives
        _check_eval_negatives(config.eval_negatives, self.num_items, self.group, self.item_feature)
        self.candidates = self.num_items
        """The items eval ranks: ids ``0 … candidates-1``, those that may be recommended (:meth:`use_candidates`); the
        whole table until the evaluation says."""
        self.exclude_seen = False
        """Whether eval scores put each row's history items at ``-inf`` (except its target): ``metrics.exclude_seen``,
        set by the evaluation that reads them (:func:`recsys_runner.train.corpus.use_ranking_protocol`)."""
        self.protocol_rows: KeyedJaggedTensor | None = None
        """The eval batch's own features, whose history the protocol (the mask, ``eval_negatives``) reads instead of the
        input's: the permutation importance's shuffled input (:mod:`recsys_runner.importance`); set by the evaluator."""
        event_dim = self.arch.group_dims[self.group.name]
        self.project = nn.Linear(event_dim, dim, device=dense_device) if event_dim != dim else nn.Identity()
        self.start = nn.Parameter(torch.empty(dim, device=dense_device).normal_(0, 0.02))
        self.positions = nn.Embedding(self.group.max_len + 1, dim, device=dense_device)
        nn.init.normal_(self.positions.weight, 0, 0.02)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(self._block(config, dim, dense_device) for _ in range(config.num_blocks))
        self.tile_size = config.attention_block if config.block == "hstu" else 0
        """The HSTU blocks' jagged tile (``model.attention_block``); 0: the blocks run on the padded rows."""
        self.norm = nn.LayerNorm(dim, device=dense_device)
        self._table: torch.Tensor | None = None

    def _block(self, config: SASRecConfig, dim: int, device: torch.device | None) -> nn.Module:
        """One attention block of ``config.block``: a :class:`SASRecBlock` or an :class:`~recsys_runner.models.hstu.HSTUBlock`
        (with the time bias when the history has event times)."""
        if config.block == "hstu":
            buckets = config.time_buckets if self.group.timestamps is not None else 0
            return HSTUBlock(dim, config.num_heads, self.group.max_len + 1, config.dropout, buckets, device=device,
                             kernel=config.attention_kernel)
        return SASRecBlock(dim, config.num_heads, config.dropout, device=device)

    def train(self, mode: bool = True) -> SASRec:
        """Switch mode; the item table read for evaluation is dropped (it is read again at the next eval batch)."""
        self._table = None
        return super().train(mode)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        embedded = self.arch(sparse)
        history = embedded.histories[self.group.name]
        # The batch carries the history's event times but not the candidate's (FeatureSpec has no key for a row's
        # ``ts``), so the last position's query time is its newest event's (query_and_key_times says the rest).
        states = self.encode(history)
        if self.training:
            return self.sampled_logits(states, history, embedded.candidates[self.candidate], sparse)
        return self.full_scores(states, history.lengths, sparse)

    def encode(self, history: History, next_times: torch.Tensor | None = None) -> torch.Tensor:
        """The user state at every position, ``[B, L + 1, D]``: position 0 is the start token, position ``t`` has
        seen events ``1 … t``; positions past ``lengths`` are padding.

        With event times (``history.timestamps``) the blocks get each position's query and key times
        (:func:`~recsys_runner.models.hstu.query_and_key_times`); ``next_times [B]`` is the time of each row's candidate (the last position's
        query time), ``None``: the newest event's time stands in for it. Without event times: positions only.
        """
        b, length, _ = history.values.shape
        events = self.project(history.values)
        x = torch.cat([self.start.to(events.dtype).expand(b, 1, self.dim), events], dim=1) * math.sqrt(self.dim)
        lengths = history.lengths + 1
        x = x + self.positions(recency_positions(lengths, length + 1).clamp_max(self.group.max_len))
        mask = torch.arange(length + 1, device=x.device).unsqueeze(0) < lengths.unsqueeze(1)
        times = None if history.timestamps is None else query_and_key_times(history.timestamps, history.lengths, next_times)
        if self.tile_size and not torch.compiler.is_exporting():  # HSTU on the real positions only (an export pads)
            # The real positions gathered by an index of the tiles' token count (known on the host when the batch
            # carries its lengths there), in the order a mask would select them: a mask sizes them by a device read.
            tiles = tile(lengths, self.tile_size, host=host_plus(history.host_lengths, 1))
            index = flat_positions(lengths, length + 1, tiles.counts.tokens)  # [P] into the [B * (L + 1)] positions
            # dropout on the real positions only: each element is dropped alike (independently, with model.dropout),
            # and the padding, which the mask zeroed and the gather leaves out, costs no dropout pass nor mask product
            flat = self.dropout(take(x.flatten(0, 1), index))
            flat_times = None if times is None else (times[0].flatten()[index], times[1].flatten()[index])
            for block in self.blocks:
                flat = cast(HSTUBlock, block).forward_jagged(flat, tiles, flat_times)
            return self.norm(torch.zeros_like(x).flatten(0, 1).index_copy(0, index, flat).view_as(x))
        x = self.dropout(x) * mask.unsqueeze(2).to(x.dtype)
        for block in self.blocks:
            x = block(x, mask, times)
        return self.norm(x)

    def score(self, states: torch.Tensor, items: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        """``states [S, D]`` × ``items [I, D]`` → ``[S, I]``: (cosine when ``normalize``) dot products / temperature, less
        ``shift [I]`` per item when given: one ``addmm``, the scale and the shift applied as the product is written, not
        two more passes over ``[S, I]`` forward and one backward (the training logits' ``[P, K]`` are the step's largest
        tensor)."""
        if self.normalize:
            states, items = F.normalize(states, dim=1), F.normalize(items.to(states.dtype), dim=1)
        if shift is None:
            return states @ items.to(states.dtype).t() / self.temperature
        return torch.addmm(-shift.to(states.dtype).unsqueeze(0), states, items.to(states.dtype).t(), alpha=1 / self.temperature)

    def sampled_logits(self, states: torch.Tensor, history: History, candidate: torch.Tensor,
                       sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In-batch sampled softmax: ``(logits [P, K], positives [P])`` over the batch's real positions.

        Position ``t`` of a row (``0 … length``) has positive event ``t + 1`` of its history, the last one the row's
        candidate (the true next item); the ``U`` distinct positives of the batch, in ascending id order, are the first
        ``U`` columns, each read once from its embedding, ``- ln(count / P)`` added per item when ``logq_correction``;
        the other ``K - U`` columns hold no item and score ``-inf``, which a softmax gives no weight (the loss is
        :func:`torch.unique`'s over ``U`` columns, to float rounding).

        Why the fixed sizes: ``P`` is known on the host (the batch's per-key event counts, which TorchRec keeps there),
        and ``K = min(P, N)`` bounds ``U`` without counting it. Selecting the real positions by a mask, or the distinct
        positives by ``torch.unique``, sizes a tensor by device values: a device-to-host sync in every step. The cost is
        ``K - U`` extra columns of scores.
        """
        b, length = history.mask.shape
        last = torch.arange(length + 1, device=states.device).unsqueeze(0) == history.lengths.unsqueeze(1)  # [B, L + 1]
        count = real_positions(sparse, self.item_feature, history.lengths)
        index = flat_positions(history.lengths + 1, length + 1, count)  # [P] into the [B * (L + 1)] positions
        ids = sparse[self.item_feature].to_padded_dense(desired_length=length, padding_value=0)
        ids = torch.where(last, self._candidate_ids(sparse).unsqueeze(1), F.pad(ids, (0, 1))).flatten()[index]
        positives, counts, first = distinct_positives(ids, self.num_items)
        # Each item's logQ (or 0) subtracted, +inf for the empty slots, as the [P, K] logits are written (score).
        empty = torch.full_like(counts, 0, dtype=states.dtype).masked_fill(counts == 0, float("inf"))
        if self.logq:
            empty = torch.where(counts > 0, torch.log(counts.to(states.dtype) / count), empty)
        vectors = _column_vectors(history.values[..., self.item_offset: self.item_offset + self.dim], history.lengths, candidate,
                                  index[first])
        return self.score(take(states.flatten(0, 1), index), vectors, shift=empty), positives

    def full_scores(self, states: torch.Tensor, lengths: torch.Tensor, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores [B, C], true item ids [B])``: the state after each row's whole history against every candidate item
        (ids ``0 … C-1``, :attr:`candidates`; a true item past them is no candidate, a miss: its index :data:`NOT_A_CANDIDATE`);
        with :attr:`exclude_seen` the row's history items (:attr:`protocol_rows`' when set) score ``-inf`` except its true
        item. With ``eval_negatives`` ``n`` instead ``(scores [B, 1 + n], zeros [B])``: column 0 the true item, then ``n``
        sampled unseen candidates (:func:`~recsys_runner.models.ranking_eval.sampled_negatives`; :data:`NOT_A_CANDIDATE`
        instead of 0 for a true item that is no candidate). An exported program scores the whole table."""
        user = states[torch.arange(states.shape[0], device=states.device), lengths]
        targets, table = self._candidate_ids(sparse), self.item_table(sparse)
        if torch.compiler.is_exporting():
            return self.score(user, table), targets
        at = torch.where(targets < self.candidates, targets.long(), NOT_A_CANDIDATE)
        if not (self.exclude_seen or self.eval_negatives):
            return self.score(user, table[: self.candidates]), at
        jagged = (self.protocol_rows if self.protocol_rows is not None else sparse)[self.item_feature]
        history = jagged.to_padded_dense(desired_length=max(int(jagged.lengths().max()) if lengths.numel() else 0, 1), padding_value=-1)
        seen = seen_ids(history, jagged.lengths(), targets)
        if self.eval_negatives:
            negatives = sampled_negatives(seen, targets, self.candidates, self.eval_negatives)
            items = torch.cat([targets.long().view(-1, 1), negatives], dim=1)
            vectors, states_ = table[items].to(user.dtype), user.unsqueeze(1)
            if self.normalize:
                vectors, states_ = F.normalize(vectors, dim=2), F.normalize(states_, dim=2)
            return (states_ * vectors).sum(dim=2) / self.temperature, torch.where(targets < self.candidates, 0, NOT_A_CANDIDATE)
        return without_seen(self.score(user, table[: self.candidates]), seen, targets), at

    def use_candidates(self, count: int) -> None:
        """Rank eval rows against ids ``0 … count-1`` only: the items that may be recommended
        (:func:`~recsys_runner.data.sequences.mapping.candidate_items`, set by the evaluation: :func:`recsys_runner.train.corpus.use_ranking_protocol`).

        Raises:
            ConfigError: ``model.eval_negatives`` above the candidates a row leaves unseen.
        """
        assert 0 < count <= self.num_items, f"{count} candidate items of a table of {self.num_items}"
        if self.eval_negatives:
            _check_eval_negatives(self.eval_negatives, count, self.group, self.item_feature)
        self.candidates = count

    def item_table(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Every item's embedding ``[N, D]``, looked up (ids ``0 … N-1`` as the candidate feature of a batch with
        ``sparse``'s keys) through the model's EmbeddingCollection, sharded or not; kept while in eval mode."""
        if self._table is not None and not self.training:
            return self._table
        keys, device = sparse.keys(), sparse.values().device
        lengths = torch.zeros(len(keys), self.num_items, dtype=torch.int32, device=device)
        lengths[keys.index(self.candidate)] = 1
        ids = torch.arange(self.num_items, dtype=sparse.values().dtype, device=device)
        assert self.arch.ec is not None, "SequenceArch has an EmbeddingCollection for a model with a history"
        table = self.arch.ec(KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths.flatten()))[self.candidate].values()
        if not self.training and not torch.compiler.is_exporting():  # a traced table must not outlive the trace
            self._table = table
        return table

    def _candidate_ids(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Each row's candidate item id ``[B]`` (its first id; the candidate has one per row)."""
        return padded(sparse.to_dict()[self.candidate], 1)[:, 0]


def _column_vectors(events: torch.Tensor, lengths: torch.Tensor, candidate: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``[K, D]``: the item vector at each of the flat positions ``at [K]`` of the ``[B, L + 1]`` targets, where position
    ``t < lengths[b]`` of row ``b`` is its event ``t`` (``events [B, L, D]``) and ``t = lengths[b]`` its ``candidate
    [B, D]``. Read from the events and the candidates for the ``K`` columns alone: the ``[B, L + 1, D]`` targets (a pad, a
    ``where`` and their backward, over every padded slot) are never built."""
    b, length, _ = events.shape
    row, t = torch.div(at, length + 1, rounding_mode="floor"), at % (length + 1)
    table = torch.cat([events.flatten(0, 1), candidate.to(events.dtype)])  # [B · L + B, D]: the events, then the candidates
    return take(table, torch.where(t == lengths[row], b * length + row, row * length + t))


def _check_eval_negatives(n: int, num_items: int, group: SequenceGroup, item_feature: str) -> None:
    """Raise :class:`ConfigError` unless every eval row has ``n`` unseen items: ``num_items`` less its history (at most
    ``max_len``) and its target."""
    free = num_items - group.max_len - 1
    if n > free:
        raise ConfigError(f"model.eval_negatives={n} sampled negatives per eval row, but a row may have seen {group.max_len + 1} of "
                          f"the {num_items} items ({item_feature}: data.sequences.{group.name}.max_len={group.max_len} history items "
                          f"and its target), leaving {max(free, 0)} to sample from. Fix: model.eval_negatives<={max(free, 0)} "
                          f"(e.g. 100, the SASRec paper's), or 0 to rank against the whole item table")


def _item_and_candidate(features: FeatureSpec, group: SequenceGroup, item_feature: str | None) -> tuple[str, str]:
    """The group's item feature (``model.item_feature``, else its first) and its candidate feature.

    Raises:
        ConfigError: ``item_feature`` is not in the group, or no non-history feature shares its table.
    """
    item = item_feature or group.features[0]
    if item not in group.features:
        raise ConfigError(f"model.item_feature={item!r} is not a feature of data.sequences.{group.name} "
                          f"({list(group.features)}). Fix: model.item_feature=<one of them>, or null for the first")
    candidate = features.candidate_of(item)
    if candidate is None:
        raise ConfigError(f"SASRec predicts the next {item} of data.sequences.{group.name}, but no non-history feature shares "
                          f"its table to hold the true next item. Fix: give the history column and the next-item column the "
                          f"same table (e.g. data.sparse entries hist_item_id and item_id both with table: item)")
    return item, candidate
