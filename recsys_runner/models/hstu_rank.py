"""HSTU ranking (Zhai et al., 2024, "Actions Speak Louder than Words: Trillion-Parameter Sequential Transducers for
Generative Recommendations", https://arxiv.org/abs/2402.17152, the DLRM-HSTU ranking model; TorchEasyRec's
``dlrm_hstu``) on TorchRec.

The user's history and the candidate form one sequence: each event's token is its features' embeddings (the group's
history features, e.g. ``hist_item_id`` and ``hist_category``) projected to the model width, and the candidate's
token the features that share the history's tables (``item_id``, ``category``), projected the same way, appended after
the newest event. A learned position embedding by recency (1 for the newest event, 0 for the candidate) is added, and
``num_layers`` HSTU layers (:class:`~recsys_runner.models.hstu.HSTUBlock`: pointwise SiLU attention, the relative
position and time-gap bias, U-gating) run causally over it, so the candidate's output has read the whole history in
order. Its output, with every pooled feature and the dense columns, feeds one head per task (``model.tasks``; none:
the data's one label).

The attention runs on the jagged rows (``attention: jagged``, :mod:`recsys_runner.models.jagged`): its cost follows the
batch's tokens, not its rows times its longest row. ``attention: padded`` runs the same layers on the padded block
(the reference the jagged path is tested against; an exported program always pads, with plain ATen ops).

Event times (``data.sequences.<group>.timestamps``): an event's key time is its own, its query time the next event's;
the candidate's, the newest event's (the rows carry no time of their own for the candidate).

Where this differs from the paper's DLRM-HSTU: the paper interleaves item and action tokens (``Φ_0, a_0, Φ_1, a_1, …``)
and reads the output at each candidate item; here an event is one token, so an action (a click, a rating, a watch
time bucket) enters as another feature of the group, embedded and projected with the event's item, and the
candidate is one token after the history. Several candidates of one user are scored in one pass
(:func:`candidate_sequences`), each seeing the history and itself, not the others.

Shape legend: ``B`` batch, ``L`` longest history in the batch, ``T`` events of the batch, ``D`` model width,
``D_g`` an event's width (its features' embeddings concatenated), ``P`` the pooled features' width, ``N`` dense columns.

Example::

    python -m recsys_runner model=hstu_rank                              # generated histories (data=synthetic_sequences)
    python -m recsys_runner model=hstu_rank model.attention=padded       # the padded reference
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import require
from recsys_runner.features import DataNeeds, FeatureSpec, check_embedding_dim
from recsys_runner.host_lengths import values_on_host
from recsys_runner.models.common import check_layer_sizes, require_count
from recsys_runner.models.hstu import HSTUBlock
from recsys_runner.models.jagged import row_starts, tile
from recsys_runner.models.jagged_kernels import check_kernel
from recsys_runner.models.multitask import MultiTaskConfig, Tower
from recsys_runner.models.sequence import History, JaggedHistory, SequenceArch, check_candidates, recency_positions

__all__ = ["ATTENTIONS", "HSTURank", "HSTURankConfig"]

torch.fx.wrap("tile")  # a leaf of TorchRec's pipeline trace here too (models/jagged.py says why)


@dataclass(frozen=True)
class SequencePlan:
    """Where a batch's tokens go in its flat sequences (:func:`candidate_sequences`): ``kept [T_kept]`` the events kept
    (a group's first row's: their indices among the batch's ``T``), ``at_event [T_kept]`` and ``recency [T_kept]`` their
    places and recencies (1 for the newest), ``at_candidate [B]`` each row's candidate's place, ``lengths [G]`` the
    sequences' lengths (``host_lengths``: the same on the host, when the batch carries its ids there), ``last [N]`` each
    token's sequence's last place, ``positions [N]`` each token's position for the relative bias (an event its index,
    every candidate the history's length: where it would stand alone)."""

    kept: torch.Tensor
    at_event: torch.Tensor
    recency: torch.Tensor
    at_candidate: torch.Tensor
    lengths: torch.Tensor
    last: torch.Tensor
    positions: torch.Tensor
    host_lengths: np.ndarray | None = None


def _starts_group(lengths: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``[B]``: whether each row starts a sequence (row 0, or a history other than the previous row's): ``lengths [B]``
    and ``ids [T, F]`` on the host, the comparison :func:`candidate_sequences` makes on the device."""
    num_events = ids.shape[0]
    starts = np.cumsum(lengths) - lengths
    event_row = np.repeat(np.arange(lengths.shape[0]), lengths)
    event_pos = np.arange(num_events) - starts[event_row]
    previous = np.clip(starts[np.maximum(event_row - 1, 0)] + event_pos, 0, max(num_events - 1, 0))
    differs = (ids != ids[previous]).any(axis=1)
    row_differs = np.bincount(event_row[differs], minlength=lengths.shape[0]) > 0
    return np.concatenate([[True], (lengths[1:] != lengths[:-1]) | row_differs[1:]])


def host_sequence_lengths(lengths: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``[G]``: :func:`candidate_sequences`' sequence lengths (a group's history, then its rows' candidates), counted on
    the host from the rows' ``lengths [B]`` and the events' ``ids [T, F]`` as the batch's builder had them."""
    lengths = lengths.astype(np.int64)
    new = _starts_group(lengths, ids)
    group = np.cumsum(new) - 1
    return lengths[new] + np.bincount(group, minlength=int(new.sum()))


@torch.fx.wrap
def candidate_sequences(lengths: torch.Tensor, ids: torch.Tensor, host_lengths: np.ndarray | None = None) -> SequencePlan:
    """One sequence per run of consecutive rows with the same history (``lengths [B]``, events' ``ids [T, F]``, times
    included): that history once, then every row's candidate, in row order. Impressions of one user grouped together
    (several candidates per user) are then scored in one pass; rows of different histories give one sequence each. The
    candidates see the history and not each other, so a row's score is the same either way. ``host_lengths``: the
    sequences' lengths counted on the host (:func:`host_sequence_lengths`), which size every tensor here; ``None``: the
    sequences and their events are counted on the device (one device-to-host read). A leaf of TorchRec's pipeline
    trace: the group counts are data."""
    lengths = lengths.long()
    batch = lengths.shape[0]
    rows = torch.arange(batch, device=lengths.device)
    num_events = ids.shape[0]
    starts = row_starts(lengths)
    event_row = torch.repeat_interleave(rows, lengths, output_size=num_events)
    event_pos = torch.arange(num_events, device=lengths.device) - starts[event_row]
    previous = (starts[(event_row - 1).clamp_min(0)] + event_pos).clamp(0, max(num_events - 1, 0))
    differs = (ids != ids[previous]).any(dim=1) if num_events else torch.zeros(0, dtype=torch.bool, device=lengths.device)
    row_differs = torch.zeros_like(rows).index_add(0, event_row, differs.long()) > 0
    same = F.pad((lengths[1:] == lengths[:-1]) & ~row_differs[1:], (1, 0))  # row 0 starts a sequence
    new = ~same
    if host_lengths is not None:
        num_groups, num_tokens = host_lengths.shape[0], int(host_lengths.sum())
    else:
        num_groups, num_kept = torch.stack([new.sum(), (lengths * new).sum()]).tolist()
        num_tokens = num_kept + batch
    group = torch.cumsum(new.long(), 0) - 1  # [B]
    rows_per_group = torch.zeros(num_groups, dtype=torch.long, device=lengths.device).index_add(0, group, torch.ones_like(rows))
    leader = row_starts(rows_per_group)  # [G]: each sequence's first row (the groups are runs of rows)
    history = lengths[leader]
    sizes = history + rows_per_group
    seq_start = row_starts(sizes)
    num_kept = num_tokens - batch
    kept_group = torch.repeat_interleave(torch.arange(num_groups, device=lengths.device), history, output_size=num_kept)
    kept_pos = torch.arange(num_kept, device=lengths.device) - row_starts(history)[kept_group]  # each kept event's place in its row
    kept = starts[leader[kept_group]] + kept_pos
    at_event = seq_start[kept_group] + kept_pos
    at_candidate = seq_start[group] + history[group] + rows - leader[group]
    last = torch.repeat_interleave(seq_start + sizes - 1, sizes, output_size=num_tokens)
    positions = torch.zeros(num_tokens, dtype=torch.long, device=lengths.device).index_copy(0, at_event, kept_pos)
    return SequencePlan(kept=kept, at_event=at_event, recency=history[kept_group] - kept_pos,
                        at_candidate=at_candidate, lengths=sizes, last=last,
                        positions=positions.index_copy(0, at_candidate, lengths), host_lengths=host_lengths)


@torch.fx.wrap
def host_plan_lengths(sparse: KeyedJaggedTensor, lengths: np.ndarray | None, keys: list[str]) -> np.ndarray | None:
    """:func:`host_sequence_lengths` of the history's keys ``keys`` (its features, then its times) when ``sparse``
    carries its lengths and values on the host (every data module's batch); else ``None``. A leaf of TorchRec's pipeline
    trace: it reads host arrays, no tensor."""
    ids = values_on_host(sparse, keys)
    return None if lengths is None or ids is None else host_sequence_lengths(lengths, ids)

ATTENTIONS = ("jagged", "padded")
"""``model.attention``: the HSTU layers on the jagged rows, or on the rows padded to the batch's longest."""


@dataclass(kw_only=True)
class HSTURankConfig(MultiTaskConfig):
    """Schema of ``conf/model/hstu_rank.yaml``."""

    _target_: str = "recsys_runner.models.hstu_rank.HSTURank"
    tasks: list[str] = field(default_factory=list)
    """Task names, each with a label of the same name in the data, a head each (``task_specs``, ``loss_weights`` as for
    every multi-task model: docs/multitask.md); ``[]``: the data's one label, one head."""
    embedding_dim: int = 32
    """Width of every table whose feature sets none; the model width ``D`` is the candidate item's table width."""
    sequence_group: str | None = None
    """The history to read (a ``data.sequences`` group); ``null``: the data's first group."""
    num_layers: int = 2
    """HSTU layers."""
    num_heads: int = 2
    """Attention heads; each has ``D / num_heads`` dims of Q, K, V and U."""
    dropout: float = 0.1
    """Dropout on the token embeddings and before each layer's output projection."""
    time_buckets: int = 128
    """Log-scale time-gap buckets of the relative bias when the history has event times (``0``: positions only)."""
    attention: str = "jagged"
    """``jagged``: the layers on the batch's tokens, tiled (:mod:`recsys_runner.models.jagged`); ``padded``: on the
    rows padded to the batch's longest (the reference)."""
    attention_block: int = 32
    """The jagged path's tile: a row pads to a multiple of it; ``[·, block, block]`` scores per pair of tiles."""
    attention_kernel: str = "auto"
    """What the jagged attention runs on: ``auto`` (fbgemm's on CUDA once a probe there matched the tiles, else the tiles),
    ``tiles`` (PyTorch ops, :mod:`recsys_runner.models.jagged`) or ``fbgemm`` (fbgemm's jagged products: Triton kernels on
    CUDA, per-row loops on the CPU; :mod:`recsys_runner.models.jagged_kernels`)."""
    deep_layer_sizes: list[int] = field(default_factory=lambda: [64])
    """Hidden layers of each task's head over ``[candidate output, pooled features, dense]``."""

    def __post_init__(self) -> None:
        if self.tasks:
            super().__post_init__()
        else:
            require(self.loss_weights is None and self.task_kinds is None and not self.task_specs,
                    "model.loss_weights, model.task_kinds and model.task_specs describe tasks, but model.tasks=[] (the "
                    "data's one label). Fix: name the tasks, e.g. model.tasks=[ctr,cvr], or drop those keys")
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        for key, least in (("num_layers", 1), ("num_heads", 1), ("attention_block", 1), ("time_buckets", 0)):
            require_count(self, key, least)
        require(0 <= self.dropout < 1, f"model.dropout must lie in [0, 1), got {self.dropout}. Fix: e.g. model.dropout=0.1")
        require(self.attention in ATTENTIONS, f"model.attention={self.attention!r} must be one of {list(ATTENTIONS)}")
        check_kernel(self.attention_kernel, self.attention == "jagged", "model.attention=padded")
        check_layer_sizes("deep_layer_sizes", self.deep_layer_sizes)

    def data_needs(self) -> DataNeeds:
        """A history to read (the default generated data becomes ``data=synthetic_sequences``), and a label per task."""
        return replace(super().data_needs() if self.tasks else DataNeeds(), sequences=True)


class HSTURank(nn.Module):
    """HSTU ranking: ``(dense [B, N], sparse KJT with a history) → logits [B]`` (or ``{task: logits [B]}`` with
    ``model.tasks``); see the module docstring.

    Args:
        config: its hyperparameters (:class:`HSTURankConfig`).
        features: the data's schema; a sequence group whose every feature shares its table with a candidate feature
            (``hist_item_id`` ↔ ``item_id``).
        dense_device: device of the dense parameters (embedding tables start on ``meta``).

    Raises:
        ConfigError: no sequence group, a history feature without a candidate, heads that do not divide the width.

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.hstu_rank import HSTURank, HSTURankConfig
        >>> data = make(SyntheticSequencesConfig, batch_size=8, max_len=6).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> model = materialize(HSTURank(make(HSTURankConfig, embedding_dim=8, num_heads=2, deep_layer_sizes=[16]),
        ...                                features=data.features))
        >>> model(batch.dense_features, batch.sparse_features).shape   # with tasks=["ctr", "cvr"]: {"ctr": [8], "cvr": [8]}
        torch.Size([8])
    """

    same_embedding_width: ClassVar[str | None] = None
    """None: events and the candidate are projected to the model width, so features may have their own widths."""

    def __init__(self, config: HSTURankConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.jagged_attention = config.attention == "jagged"
        self.arch = SequenceArch(features, config.embedding_dim, type(self), jagged=self.jagged_attention)
        self.group = features.group(config.sequence_group, model="hstu_rank")
        self.history_keys = [*self.group.features, *([self.group.timestamps] if self.group.timestamps is not None else [])]
        """The keys whose values tell rows' histories apart (the history's features, then its times): the columns of
        :func:`candidate_sequences`' ``ids``."""
        self.candidates = check_candidates(features, self.group, "hstu_rank")
        widths = dict(zip(features.sparse_names, features.embedding_dims(config.embedding_dim), strict=True))
        dim = widths[self.candidates[0]]
        require(dim % config.num_heads == 0, f"model.num_heads={config.num_heads} must divide the model width {dim} (the "
                f"candidate {self.candidates[0]}'s table width). Fix: model.num_heads=1, or another model.embedding_dim")
        self.dim, self.block, self.max_len = dim, config.attention_block, self.group.max_len + 1
        self.project = nn.Linear(self.arch.group_dims[self.group.name], dim, device=dense_device)
        self.positions = nn.Embedding(self.max_len + 1, dim, device=dense_device)
        nn.init.normal_(self.positions.weight, 0, 0.02)
        self.dropout = nn.Dropout(config.dropout)
        buckets = config.time_buckets if self.group.timestamps is not None else 0
        self.timed = buckets > 0
        """Whether the layers' bias has a time term (the history has event times and ``time_buckets > 0``)."""
        self.layers: nn.ModuleList = nn.ModuleList(HSTUBlock(dim, config.num_heads, self.max_len, config.dropout, buckets, device=dense_device,
                                                                         kernel=config.attention_kernel)
                                    for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(dim, device=dense_device)
        width = dim + self.arch.pooled_dim + features.num_dense
        if config.tasks:
            self.tasks = config.resolve_tasks(features)
            outputs = {t.name: t.output_width for t in self.tasks}
            self.heads = nn.ModuleDict({name: Tower(width, list(config.deep_layer_sizes), device=dense_device, out_width=outputs[name])
                                        for name in config.tasks})
        else:
            self.heads = nn.ModuleDict({"label": Tower(width, list(config.deep_layer_sizes), device=dense_device)})
        self.named = bool(config.tasks)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor | dict[str, torch.Tensor]:
        embedded = self.arch(sparse)
        candidate = self.project(torch.cat([embedded.candidates[name] for name in self.candidates], dim=1))
        if embedded.jagged:
            state = self._jagged(embedded.jagged[self.group.name], candidate, sparse)
        else:
            state = self._padded(embedded.histories[self.group.name], candidate)
        x = torch.cat([state, embedded.pooled, dense], dim=1)
        if self.named:
            return {name: head(x) for name, head in self.heads.items()}
        return self.heads["label"](x)

    def _tokens(self, x: torch.Tensor, recency: torch.Tensor) -> torch.Tensor:
        """Tokens scaled and given their recency embedding (``recency`` clamped to the table), then dropout."""
        return self.dropout(x * math.sqrt(self.dim) + self.positions(recency.clamp_max(self.max_len)))

    def _jagged(self, history: JaggedHistory, candidate: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """The candidate's output ``[B, D]``, the layers tiled over one flat sequence per user: consecutive rows that share
        a history (:func:`candidate_sequences`) read it once, each with its candidate after it."""
        ids = history.ids if history.timestamps is None else torch.cat([history.ids, history.timestamps.unsqueeze(1)], dim=1)
        plan = candidate_sequences(history.lengths, ids, host_plan_lengths(sparse, history.host_lengths, self.history_keys))
        events = self.project(history.values[plan.kept])
        num_tokens = events.shape[0] + candidate.shape[0]
        x = events.new_zeros(num_tokens, self.dim).index_copy(0, plan.at_event, events).index_copy(0, plan.at_candidate, candidate)
        recency = torch.zeros(num_tokens, dtype=torch.long, device=x.device).index_copy(0, plan.at_event, plan.recency)
        is_candidate = torch.zeros(num_tokens, dtype=torch.bool, device=x.device).index_fill(0, plan.at_candidate, True)
        times = None
        if history.timestamps is not None and self.timed:
            lengths = history.lengths
            # The newest event's time per row (0 for an empty history): index s + l of the times shifted by one.
            newest = F.pad(history.timestamps, (1, 0))[row_starts(lengths) + lengths] * (lengths > 0).long()
            key = torch.zeros_like(recency).index_copy(0, plan.at_event, history.timestamps[plan.kept])
            key = key.index_copy(0, plan.at_candidate, newest)
            following = torch.minimum(torch.arange(1, num_tokens + 1, device=x.device), plan.last)
            times = (key[following], key)
        tiles = tile(plan.lengths, self.block, host=plan.host_lengths)
        x = self._tokens(x, recency)
        for layer in self.layers:
            x = cast(HSTUBlock, layer).forward_jagged(x, tiles, times, is_candidate, plan.positions)
        return self.norm(x)[plan.at_candidate]

    def _padded(self, history: History, candidate: torch.Tensor) -> torch.Tensor:
        """The candidate's output ``[B, D]``, the history and the candidate padded to ``[B, L + 1, D]``."""
        lengths = history.lengths
        b, length = history.mask.shape
        rows = torch.arange(b, device=lengths.device)
        at_candidate = torch.arange(length + 1, device=lengths.device).unsqueeze(0) == lengths.unsqueeze(1)  # [B, L + 1]
        events = F.pad(self.project(history.values), (0, 0, 0, 1))
        x = torch.where(at_candidate.unsqueeze(2), candidate.unsqueeze(1).to(events.dtype), events)
        mask = torch.arange(length + 1, device=lengths.device).unsqueeze(0) <= lengths.unsqueeze(1)
        recency = (recency_positions(lengths, length + 1) + 1) * (~at_candidate).long()
        times = None
        if history.timestamps is not None and self.timed:
            newest = history.timestamps[rows, (lengths - 1).clamp_min(0)] * (lengths > 0).long()
            key = torch.where(at_candidate, newest.unsqueeze(1), F.pad(history.timestamps, (0, 1)))
            query = torch.where(at_candidate, newest.unsqueeze(1), torch.cat([key[:, 1:], key[:, -1:]], dim=1))
            times = (query, key)
        x = self._tokens(x, recency) * mask.unsqueeze(2).to(x.dtype)
        for layer in self.layers:
            x = layer(x, mask, times, at_candidate)
        return self.norm(x)[rows, lengths]
