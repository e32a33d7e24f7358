"""What every sequence model shares: jagged histories embedded unpooled, padded per batch only where needed.

A batch's ``KeyedJaggedTensor`` carries each history feature (``hist_item_id``, ``hist_category``) as a jagged
list per row, oldest event first (:class:`~recsys_runner.features.SequenceGroup`). :class:`SequenceArch` embeds
the tables that histories read with TorchRec's ``EmbeddingCollection`` (one vector per event, sharded by
DistributedModelParallel like every table) and every other table with an ``EmbeddingBagCollection`` (pooled).
A feature that shares its table with a history (the candidate ``item_id`` beside ``hist_item_id``) is looked up
in the same unpooled table, so the candidate and the events it is compared with use the same rows.

A model that needs a dense block (attention) gets :class:`History`: the events padded to the longest row *of
this batch*, never to ``max_len``, with a mask. A model whose attention runs on jagged rows
(:mod:`recsys_runner.models.jagged`) asks for ``jagged=True`` and gets :class:`JaggedHistory`, the events flat with
their row lengths, nothing padded. Shape legend: ``B`` batch, ``L`` longest history in the batch, ``T`` events of the
batch, ``D`` embedding width, ``P`` width of the pooled features.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec, SequenceGroup
from recsys_runner.host_lengths import longest_row, row_lengths
from recsys_runner.models.common import embedding_width_rule
from recsys_runner.models.lookup import managed_feature_names, pooled_collections, pooled_lookup

__all__ = ["History", "JaggedHistory", "SequenceArch", "SequenceEmbeddings", "check_candidates", "longest", "longest_of", "padded", "recency_positions"]


@dataclass
class History:
    """One sequence group of a batch as a dense block: ``values [B, L, D_g]`` (the group's features' embeddings
    concatenated per event, ``D_g = Σ D_f``), ``mask [B, L]`` (True on real events, False on padding, events
    left-aligned, oldest first), ``lengths [B]``, and ``timestamps [B, L]`` (int64, 0 on padding) when the data has
    event times; ``host_lengths [B]``: the same lengths on the host when the batch carries them
    (:func:`~recsys_runner.host_lengths.row_lengths`), which size a jagged path's tensors without a device read."""

    values: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    timestamps: torch.Tensor | None = None
    host_lengths: np.ndarray | None = None


@dataclass
class JaggedHistory:
    """One sequence group of a batch, unpadded: ``values [T, D_g]`` (every row's events, oldest first, row after row),
    ``ids [T, F_g]`` (the events' ids, a column per feature of the group), ``lengths [B]``, and ``timestamps [T]``
    (int64) when the data has event times; ``host_lengths [B]`` as :class:`History`'s."""

    values: torch.Tensor
    ids: torch.Tensor
    lengths: torch.Tensor
    timestamps: torch.Tensor | None = None
    host_lengths: np.ndarray | None = None


@dataclass
class SequenceEmbeddings:
    """What :class:`SequenceArch` returns: the pooled features ``[B, P]`` (every non-history feature, in
    ``features.sparse`` order), each history group as a :class:`History`, and each candidate's own vector
    ``[B, D_f]`` by feature name (also part of ``pooled``)."""

    pooled: torch.Tensor
    histories: dict[str, History]
    candidates: dict[str, torch.Tensor]
    jagged: dict[str, JaggedHistory] = field(default_factory=dict)
    """Each history group unpadded, instead of ``histories``, for an arch built with ``jagged=True``."""


# Leaves of a torch.fx trace (TorchRec's TrainPipelineSparseDist traces the model to find its lookups): their row
# lengths decide shapes, which a symbolic trace cannot follow; a traced call records them as one opaque node each.
@torch.fx.wrap
def padded(jagged: JaggedTensor, length: int) -> torch.Tensor:
    """``jagged``'s rows as ``[B, length, D]`` (``[B, length]`` for ids), zero past each row's end.

    Training and evaluation use fbgemm's ``jagged_to_padded_dense`` (30x faster on CPU than the ATen ops below);
    under ``torch.export`` the same result comes from plain ATen ops, so that the exported program loads with
    torch alone (``recsys_runner.serving.program``: no fbgemm op may be in its graph).
    """
    if not torch.compiler.is_exporting():
        return jagged.to_padded_dense(desired_length=length)
    values, lengths = jagged.values(), jagged.lengths().long()
    batch = lengths.shape[0]
    rows = torch.repeat_interleave(torch.arange(batch, device=lengths.device), lengths, output_size=values.shape[0])
    starts = torch.cumsum(lengths, 0) - lengths
    flat = torch.arange(values.shape[0], device=lengths.device) - starts[rows] + rows * length
    out = values.new_zeros((batch * length, *values.shape[1:]))
    return out.index_copy(0, flat, values).view(batch, length, *values.shape[1:])


torch.fx.wrap("row_lengths")  # a leaf too: it reads the batch's host-side lengths, no tensor


@torch.fx.wrap
def longest(lengths: torch.Tensor) -> int:
    """The longest row of ``lengths`` (at least 1, so that a batch of empty histories still has a block): a plain
    ``int`` when run eagerly, a size symbol under ``torch.export`` (so the exported program pads per call too).

    Read from the lengths where they are: on a GPU, a device-to-host sync. A batch built by a data module says it
    without one (:func:`longest_of`)."""
    length = lengths.max().clamp_min(1).item() if lengths.numel() else 1
    torch._check(length >= 1)
    return cast(int, length)


@torch.fx.wrap
def longest_of(sparse: KeyedJaggedTensor, key: str, lengths: torch.Tensor) -> int:
    """The longest row of feature ``key`` (at least 1), whose rows' lengths are ``lengths``: as the batch's builder
    counted it on the host when ``sparse`` carries it (:class:`~recsys_runner.host_lengths.HostLengthsKJT`, every
    data module's batch), so that a step reads no device value for it; else :func:`longest` of ``lengths``."""
    known = longest_row(sparse, key)
    return max(known, 1) if known is not None else longest(lengths)


def recency_positions(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, length]``: each event's distance from the newest event of its row (0 for the newest), 0 on padding.

    Why from the newest end: histories of different lengths then agree on what position 0 means ("the last
    thing the user did"), which is what positional embeddings should learn.
    """
    index = torch.arange(length, device=lengths.device).unsqueeze(0)
    return (lengths.unsqueeze(1) - 1 - index).clamp_min(0)


class SequenceArch(nn.Module):
    """Embeds a batch with histories: ``KeyedJaggedTensor → SequenceEmbeddings``.

    Args:
        features: the data's schema; ``features.sequences`` must name at least one group when
            ``required`` (a model that attends over a history).
        embedding_dim: the width of every table whose features set none.
        model: the model class that owns this arch (its ``same_embedding_width`` and name).
        required: raise unless the data has a sequence group.
        jagged: give the histories unpadded (:attr:`SequenceEmbeddings.jagged`) instead of padded; exporting
            (``torch.export``) still pads them, for the program's plain ATen ops.

    Raises:
        ConfigError: no sequence group while ``required``; the model needs one width and a feature sets another; a
            history's table asks for managed collision (only pooled tables take it).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.din import DIN
        >>> from recsys_runner.models.sequence import SequenceArch
        >>> data = make(SyntheticSequencesConfig, batch_size=8, max_len=6).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> embedded = materialize(SequenceArch(data.features, embedding_dim=8, model=DIN))(batch.sparse_features)
        >>> embedded.pooled.shape   # [B, P]: user_id, item_id and category pooled, 8 wide each
        torch.Size([8, 24])
        >>> {group: history.values.shape for group, history in embedded.histories.items()}   # [B, L, D_g]: 2 features per event
        {'hist': torch.Size([8, 6, 16])}
    """

    def __init__(self, features: FeatureSpec, embedding_dim: int, model: type[nn.Module], required: bool = True,
                 jagged: bool = False) -> None:
        super().__init__()
        self.jagged = jagged
        if required:
            features.group(model=model.__name__)
        reason = embedding_width_rule(model)
        if reason is not None:
            features.require_uniform_dim(embedding_dim, model.__name__, reason)
        self.groups: tuple[SequenceGroup, ...] = features.sequences
        widths = dict(zip(features.sparse_names, features.embedding_dims(embedding_dim), strict=True))
        unpooled = features.sequence_table_names
        sequence = features.sequence_tables(embedding_dim)
        self.ec = EmbeddingCollection(tables=sequence, device=torch.device("meta")) if sequence else None
        managed = features.managed_tables()
        if unpooled & set(managed):
            raise ConfigError(f"{model.__name__} embeds the history tables {sorted(unpooled & set(managed))} unpooled, one vector per "
                              f"event, which managed collision does not cover here. Fix: drop managed_collision from the "
                              f"history columns and their candidates (keep it on the other sparse columns)")
        bags = features.embedding_tables(embedding_dim, skip_sequence_tables=True)
        self.ebc, self.mc_ebc = pooled_collections(bags, managed, features.weighted)
        self.weighted_names = features.weighted_names
        histories = set(features.sequence_names)
        self.pooled_names = [f.name for f in features.sparse if f.name not in histories]
        """The non-history features, in ``features.sparse`` order: the columns of ``pooled``."""
        self.candidate_names = [f.name for f in features.sparse if f.table_name in unpooled and f.name not in histories]
        """Non-history features read from an unpooled table (a history's candidate): pooled here by summing."""
        self.bag_names = [n for n in self.pooled_names if n not in self.candidate_names]
        """The pooled features looked up in the embedding-bag collections."""
        self.managed_names = managed_feature_names(features)
        self.widths = {name: widths[name] for name in [*self.pooled_names, *histories]}
        self.pooled_dim = sum(self.widths[n] for n in self.pooled_names)
        """``P``: the width of ``pooled``."""
        self.group_dims = {g.name: sum(widths[f] for f in g.features) for g in self.groups}
        """``D_g`` of each group: the width of its :attr:`History.values`."""

    def forward(self, sparse: KeyedJaggedTensor) -> SequenceEmbeddings:
        unpooled = self.ec(sparse) if self.ec is not None else {}
        bags = pooled_lookup(self.ebc, self.mc_ebc, sparse, self.bag_names, self.managed_names, self.weighted_names)
        candidates = {name: self._pool(unpooled[name], longest_of(sparse, name, unpooled[name].lengths())) for name in self.candidate_names}
        pieces = [candidates[n] if n in candidates else bags[n] for n in self.pooled_names]
        pooled = torch.cat(pieces, dim=1) if pieces else torch.zeros(sparse.stride(), 0, device=sparse.values().device)
        if self.jagged and not torch.compiler.is_exporting():
            jagged = {g.name: self._jagged(g, unpooled, sparse) for g in self.groups}
            return SequenceEmbeddings(pooled=pooled, histories={}, candidates=candidates, jagged=jagged)
        histories = {g.name: self._history(g, unpooled, sparse) for g in self.groups}
        return SequenceEmbeddings(pooled=pooled, histories=histories, candidates=candidates)

    @staticmethod
    def _pool(jagged: JaggedTensor, length: int) -> torch.Tensor:
        """A candidate's vector ``[B, D]``: the sum of its row's embeddings (its one id's, for a single-valued column);
        ``length`` is its longest row."""
        return padded(jagged, length).sum(dim=1)

    def _history(self, group: SequenceGroup, unpooled: dict[str, JaggedTensor], sparse: KeyedJaggedTensor) -> History:
        """Group ``group`` padded to the longest row of this batch (at least 1, so an all-empty batch still has a block)."""
        first = unpooled[group.features[0]]
        lengths = first.lengths()
        length = longest_of(sparse, group.features[0], lengths)
        values = torch.cat([padded(unpooled[f], length) for f in group.features], dim=2)
        mask = torch.arange(length, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)
        timestamps = None
        if group.timestamps is not None:
            timestamps = padded(sparse.to_dict()[group.timestamps], length)
        return History(values=values, mask=mask, lengths=lengths.long(), timestamps=timestamps,
                       host_lengths=row_lengths(sparse, group.features[0]))


    @staticmethod
    def _jagged(group: SequenceGroup, unpooled: dict[str, JaggedTensor], sparse: KeyedJaggedTensor) -> JaggedHistory:
        """Group ``group``'s events flat: its features' embeddings side by side (they share the rows' lengths)."""
        values = torch.cat([unpooled[f].values() for f in group.features], dim=1)
        by_key = sparse.to_dict()
        ids = torch.stack([by_key[f].values().long() for f in group.features], dim=1)
        timestamps = by_key[group.timestamps].values().long() if group.timestamps is not None else None
        return JaggedHistory(values=values, ids=ids, lengths=unpooled[group.features[0]].lengths().long(), timestamps=timestamps,
                             host_lengths=row_lengths(sparse, group.features[0]))


def check_candidates(features: FeatureSpec, group: SequenceGroup, model: str) -> list[str]:
    """The candidate feature of each of ``group``'s features (:meth:`FeatureSpec.candidate_of`), for a model that
    compares the candidate with each event.

    Raises:
        ConfigError: a history feature has no candidate sharing its table, naming it and the fix.
    """
    candidates = [features.candidate_of(f) for f in group.features]
    missing = [f for f, c in zip(group.features, candidates, strict=True) if c is None]
    if missing:
        raise ConfigError(
            f"{model} compares the candidate with each event of data.sequences.{group.name}, but history feature(s) {missing} "
            f"share no table with a candidate feature. Fix: give each history column and its candidate column the same "
            f"table (e.g. data.sparse entries hist_item_id and item_id both with table: item)"
        )
    return [c for c in candidates if c is not None]
