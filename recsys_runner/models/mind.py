"""MIND (Li et al., 2019, "Multi-Interest Network with Dynamic Routing for Recommendation at Tmall",
https://arxiv.org/abs/1904.08030): two-tower retrieval whose user is ``K`` vectors, one per interest.

One vector per user must sit between the user's interests (a user of shoes and of cameras gets a vector pointing at
neither); MIND gives the user ``K`` and lets each retrieve on its own. Its user tower:

* **behaviour-to-interest routing** (:class:`InterestCapsules`): the history's events ``e_i`` (the item id embeddings,
  read from the item tower's own table, as DIN reads them) are routed into ``K`` interest capsules: each event is mapped by
  one *shared* bilinear matrix ``S`` (``ê_i = S e_i``), its coupling to the interests is ``w_ij = softmax_j(b_ij)`` (a
  softmax over the *interests*), ``u_j = squash(Σ_i w_ij ê_i)``, and ``b_ij += u_jᵀ ê_i``, ``routing_iters`` times. The
  routing logits start from fixed random values, not trained (the paper: with one shared ``S``, logits starting equal
  would give ``K`` equal capsules). With ``dynamic_interests`` a user with ``n`` events has ``max(1, min(K, ⌊log2 n⌋))``
  interests (the paper's ``K'_u``);
* each capsule concatenated with the user's profile (the other user features, pooled, and dense columns) goes through
  the tower MLP: ``[B, K, O]``, L2-normalized with ``normalize``.

The item tower is DSSM's (:class:`~recsys_runner.models.dssm.Tower`). Training: **label-aware attention** picks one user
vector per row from its target item ``e``: ``v = Σ_k a_k v_k``, ``a = softmax_k(p · <v_k, e>)`` (``pow_p`` is ``p``;
see :class:`LabelAwareAttention` for why ``p`` multiplies rather than raises), then DSSM's in-batch softmax with logQ
over the batch's items. Evaluation and serving: a candidate's score is its **best interest**, ``max_k <v_k, e> / τ``
(:func:`~recsys_runner.models.dssm.tower_scores`), in the in-batch metrics, the full-corpus metrics and the exported
towers alike.

Shape legend: ``B`` batch, ``Q`` query rows (``B`` less ``K_s`` sampled item rows in training), ``L`` longest history
in the batch, ``D_h`` an event's width (the listed history features' embeddings concatenated), ``K`` interests,
``P`` the profile's width, ``O`` tower output width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError, require
from recsys_runner.features import DataNeeds, FeatureSpec, SequenceGroup
from recsys_runner.models.dssm import DSSMConfig, InBatchRetrieval, Tower, tower_scores
from recsys_runner.models.sequence import SequenceArch

__all__ = ["MIND", "InterestCapsules", "LabelAwareAttention", "MINDConfig", "first_rows", "interest_counts", "squash"]

ROUTING_LOGITS_STD = 1.0
"""Standard deviation ``σ`` of the fixed random routing logits ``b_ij ~ N(0, σ²)`` (the paper's initialisation)."""


@dataclass(kw_only=True)
class MINDConfig(DSSMConfig):
    """Schema of ``conf/model/mind.yaml``: DSSM's keys (the towers, temperature, logQ, corpus evaluation) and the
    multi-interest ones."""

    _target_: str = "recsys_runner.models.mind.MIND"
    user_features: list[str] = field(default_factory=lambda: ["hist_item_id", "hist_category"])
    """The user tower's features: the history features to route (list columns of one ``data.sequences`` group, the
    first of them sharing the item id's table), and any profile features (other sparse or dense columns, pooled and
    concatenated to every interest)."""
    item_features: list[str] = field(default_factory=lambda: ["item_id", "category"])
    """The item tower's features; the first sparse one is the item id, whose table the history reads."""
    eval_metrics: list[str] = field(default_factory=lambda: ["inbatch_recall@10", "recall@10", "recall@50", "ndcg@10"])
    """As DSSM's; the full-corpus ones (``recall@<k>`` …) score each catalogue item by the user's best interest."""
    num_interests: int = 4
    """``K``: interest capsules (user vectors) per user."""
    routing_iters: int = 3
    """Dynamic routing iterations (the paper's ``r``, 3)."""
    dynamic_interests: bool = False
    """The paper's ``K'_u = max(1, min(K, ⌊log2 n⌋))`` interests for a user with ``n`` events (the others masked);
    ``false``: every user has ``K``."""
    pow_p: float = 20.0
    """Label-aware attention's sharpness ``p``: weights ``softmax_k(p · <v_k, e>)`` over the interests of a training row;
    0: their mean, large: the interest closest to the target alone (hard attention). On cosines (``normalize``) 20 is
    about as sharp as the scores' ``1 / temperature``; 1 leaves the weights near the mean, and MIND then learned less
    than DSSM in the learning test (``tests/test_mind.py``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.num_interests >= 1, f"model.num_interests must be at least 1 (interest vectors per user), got "
                f"{self.num_interests}. Fix: e.g. model.num_interests=4")
        require(self.routing_iters >= 1, f"model.routing_iters must be at least 1 (dynamic routing iterations), got "
                f"{self.routing_iters}. Fix: e.g. model.routing_iters=3")
        require(self.pow_p >= 0, f"model.pow_p must be >= 0 (label-aware attention's sharpness; 0: the interests' mean), got "
                f"{self.pow_p}. Fix: e.g. model.pow_p=20")
        require(self.index == "exact", f"model.index={self.index} searches one vector per query in an HNSW graph; a MIND user "
                f"has model.num_interests={self.num_interests}, scored by the best of them. Fix: model.index=exact")

    def data_needs(self) -> DataNeeds:
        """Histories (the default generated data becomes ``data=synthetic_sequences``) whose rows are (user, item) pairs."""
        return DataNeeds(user_features=tuple(self.user_features), item_features=tuple(self.item_features), sequences=True)


def squash(z: torch.Tensor) -> torch.Tensor:
    """The capsule non-linearity over the last dim: ``|z|² / (1 + |z|²) · z / |z|`` (length in [0, 1), direction kept).

    Computed in float32 and returned in ``z``'s dtype: under ``precision=fp16`` autocast ``z`` is float16, whose ``1e-9``
    is 0, so an inactive interest's zero capsule gave ``0 / sqrt(0)`` = NaN and a NaN loss at the first step (and a
    ``|z|²`` above 65504 would overflow)."""
    wide = z.float()
    squared = (wide * wide).sum(dim=-1, keepdim=True)
    return (wide * (squared / (1 + squared) / torch.sqrt(squared + 1e-9))).to(z.dtype)


def interest_counts(lengths: torch.Tensor, num_interests: int, dynamic: bool) -> torch.Tensor:
    """Each user's number of interests ``[B]``: ``K``, or with ``dynamic`` the paper's ``max(1, min(K, ⌊log2 n⌋))``."""
    if not dynamic:
        return torch.full_like(lengths, num_interests)
    return torch.log2(lengths.clamp_min(1).float()).floor().long().clamp(1, num_interests)


class InterestCapsules(nn.Module):
    """Behaviour-to-interest dynamic routing: ``(events [B, L, D_h], mask [B, L], active [B, K]) → capsules [B, K, D_h]``.

    ``ê_i = S e_i`` with one shared ``S`` (``bilinear``); ``routing_iters`` times: ``w_ij = softmax_j(b_ij)`` over the active
    interests ``j`` (an inactive one gets 0), zero for padded events ``i``; ``z_j = Σ_i w_ij ê_i``, ``u_j = squash(z_j)``; then
    ``b_ij += <u_j, ê_i>``. ``b`` starts from ``routing_logits [max_len, K]``: random ``N(0, σ²)``, a buffer (saved with the
    weights, never trained), row ``i`` for the history's ``i``-th event (oldest first), so padding changes nothing.
    A row without events has zero capsules.

    Example::

        >>> import torch
        >>> from recsys_runner.models.mind import InterestCapsules
        >>> routing = InterestCapsules(dim=8, num_interests=3, routing_iters=3, max_len=6)
        >>> mask = torch.arange(6) < torch.tensor([[6], [2], [0], [4]])   # [B, L]: each row's real events, left-aligned
        >>> capsules = routing(torch.randn(4, 6, 8), mask, torch.ones(4, 3, dtype=torch.bool))   # every interest active
        >>> capsules.shape, bool((capsules[2] == 0).all())   # the row without events: zero capsules
        (torch.Size([4, 3, 8]), True)
    """

    routing_logits: torch.Tensor

    def __init__(self, dim: int, num_interests: int, routing_iters: int, max_len: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.num_interests, self.routing_iters, self.max_len = num_interests, routing_iters, max_len
        self.bilinear = nn.Linear(dim, dim, bias=False, device=device)
        self.register_buffer("routing_logits", torch.randn(max_len, num_interests, device=device) * ROUTING_LOGITS_STD)

    def forward(self, events: torch.Tensor, mask: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        mapped = self.bilinear(events)                                           # ê: [B, L, D_h]
        logits = first_rows(self.routing_logits, events).unsqueeze(0) + torch.zeros_like(mapped[..., :1])   # b: [B, L, K]
        inactive = ~active.unsqueeze(1)                                          # [B, 1, K]
        real = mask.unsqueeze(2).to(mapped.dtype)                                # [B, L, 1]
        capsules = mapped.new_zeros(mapped.shape[0], self.num_interests, mapped.shape[2])
        for step in range(self.routing_iters):
            coupling = torch.softmax(logits.masked_fill(inactive, float("-inf")), dim=2) * real   # w: [B, L, K]
            capsules = squash(torch.einsum("blk,bld->bkd", coupling, mapped))                    # u: [B, K, D_h]
            if step + 1 < self.routing_iters:
                logits = logits + torch.einsum("bkd,bld->blk", capsules, mapped)
        return capsules


@torch.fx.wrap
def first_rows(table: torch.Tensor, events: torch.Tensor) -> torch.Tensor:
    """``table``'s first ``L`` rows for ``events [B, L, …]``: one opaque call in a torch.fx trace (TorchRec's pipeline traces
    the model), and under ``torch.export`` ``L`` (a size symbol) is declared at most the table's length."""
    length = events.shape[1]
    torch._check(length <= table.shape[0])
    return table[:length]


class LabelAwareAttention(nn.Module):
    """``(interests [Q, K, O], target [Q, O], active [Q, K]) → user [Q, O]``: ``Σ_k a_k v_k``, ``a = softmax_k(p · <v_k, e>)``
    over the active interests.

    The paper writes ``softmax(pow(V_uᵀ e, p))``: ``p = 0`` the mean of the interests, ``p → ∞`` the one closest to the
    target (hard attention). A real power is undefined for a negative dot product, and for cosines (``|s| < 1``) its
    ``p → ∞`` limit is the mean again, not the maximum; ``softmax_k(p · s_k)``, i.e. weights ``∝ (exp s_k)^p``, keeps the
    paper's three regimes for any score: the mean at 0, a softmax at 1, the argmax as ``p → ∞``.

    Example::

        >>> import torch
        >>> from recsys_runner.models.mind import LabelAwareAttention
        >>> attention = LabelAwareAttention(pow_p=1.0)
        >>> attention(torch.randn(4, 3, 8), torch.randn(4, 8), torch.ones(4, 3, dtype=torch.bool)).shape   # interests, target
        torch.Size([4, 8])
    """

    def __init__(self, pow_p: float) -> None:
        super().__init__()
        self.pow_p = pow_p

    def forward(self, interests: torch.Tensor, target: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        similarity = torch.einsum("qko,qo->qk", interests, target) * self.pow_p
        weights = torch.softmax(similarity.masked_fill(~active, float("-inf")), dim=1)
        return torch.einsum("qk,qko->qo", weights, interests)


class MIND(InBatchRetrieval):
    """MIND: ``(dense [B, n], sparse KJT with a history) → scores [Q, B]``; see the module docstring.

    Training: ``<v_q, item_c> / τ`` (less ``log p_c`` with logQ), ``v_q`` row ``q``'s interests attended by its own item;
    eval: ``max_k <v_qk, item_c> / τ``. :meth:`tower` gives the user's interests ``[B, K, O]`` (a user with fewer active
    interests, ``dynamic_interests``, repeats its first in the others, which changes no maximum) or the items ``[B, O]``.

    Args:
        config: its hyperparameters (:class:`MINDConfig`).
        features: the data's schema: a sequence group holding the history features of ``user_features``, the first of
            them sharing its table with the item tower's id feature.
        dense_device: device of the dense parameters (embedding tables start on ``meta``).

    Raises:
        ConfigError: no history feature among ``user_features``, history features of two groups, or a history that does
            not read the item id's table.

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.mind import MIND, MINDConfig
        >>> data = make(SyntheticSequencesConfig, batch_size=8, max_len=6).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> model = materialize(MIND(make(MINDConfig, embedding_dim=8, tower_layer_sizes=[16, 8], num_interests=3),
        ...                            features=data.features))
        >>> model.tower("user", batch.dense_features, batch.sparse_features).shape   # 3 interests per user
        torch.Size([8, 3, 8])
        >>> model(batch.dense_features, batch.sparse_features).shape   # every user against every item of the batch
        torch.Size([8, 8])
    """

    same_embedding_width: ClassVar[str | None] = None
    """None: the towers concatenate their features' embeddings (a history and its candidate share a table, so a width)."""

    def __init__(self, config: MINDConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__(config, features=features, dense_device=dense_device)
        self.group, self.history = _history(config, features)
        self.arch = SequenceArch(features, config.embedding_dim, type(self))
        widths = self.arch.widths
        starts = {f: sum(widths[g] for g in self.group.features[:i]) for i, f in enumerate(self.group.features)}
        self.history_columns = [c for f in self.history for c in range(starts[f], starts[f] + widths[f])]
        """The columns of the group's :attr:`History.values` that hold the listed history features."""
        pooled = {n: sum(widths[m] for m in self.arch.pooled_names[:i]) for i, n in enumerate(self.arch.pooled_names)}

        def columns(names: list[str]) -> list[int]:
            return [c for n in names if n in pooled for c in range(pooled[n], pooled[n] + widths[n])]

        def dense_of(names: list[str]) -> list[int]:
            return [features.dense_names.index(n) for n in names if n in features.dense_names]

        profile = [n for n in config.user_features if n not in self.history]
        self.profile_columns, self.profile_dense = columns(profile), dense_of(profile)
        dim = len(self.history_columns)
        self.num_interests, self.dynamic_interests = config.num_interests, config.dynamic_interests
        self.capsules = InterestCapsules(dim, config.num_interests, config.routing_iters, self.group.max_len, device=dense_device)
        sizes = list(config.tower_layer_sizes)
        # the user MLP reads [capsule, profile sparse, profile dense] per interest: a Tower over those columns
        profile_width = len(self.profile_columns)
        self.user_tower = Tower(list(range(dim + profile_width)), list(range(len(self.profile_dense))), sizes, config.normalize,
                                device=dense_device)
        self.item_tower = Tower(columns(list(config.item_features)), dense_of(list(config.item_features)), sizes, config.normalize,
                                device=dense_device)
        self.attention = LabelAwareAttention(config.pow_p)
        self.normalize = config.normalize

    def interests(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(interests [B, K, O], active [B, K], items [B, O])``: every row's user interests (unrepeated) and which of them
        it has, and its item vector."""
        embedded = self.arch(sparse)
        history = embedded.histories[self.group.name]
        active = torch.arange(self.num_interests, device=history.lengths.device).unsqueeze(0) < \
            interest_counts(history.lengths, self.num_interests, self.dynamic_interests).unsqueeze(1)
        capsules = self.capsules(history.values[..., self.history_columns], history.mask, active)   # [B, K, D_h]
        rows, k = capsules.shape[0], self.num_interests
        profile = embedded.pooled[:, self.profile_columns].unsqueeze(1).expand(-1, k, -1)
        inputs = torch.cat([capsules, profile], dim=2).reshape(rows * k, -1)
        profile_dense = dense[:, self.profile_dense].unsqueeze(1).expand(-1, k, -1).reshape(rows * k, -1)
        interests = self.user_tower(inputs, profile_dense).view(rows, k, -1)
        return interests, active, self.item_tower(embedded.pooled, dense)

    def tower(self, name: str, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """The ``user`` tower's interests ``[B, K, O]`` (inactive ones repeat the first) or the ``item`` tower's vectors
        ``[B, O]``; each reads only its own features of the batch (the export writes each as its own program)."""
        interests, active, items = self.interests(dense, sparse)
        if name == "item":
            return items
        return torch.where(active.unsqueeze(2), interests, interests[:, :1])

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        interests, active, items = self.interests(dense, sparse)
        queries = self.num_queries(items.shape[0])
        interests, active = interests[:queries], active[:queries]  # the sampled rows have no user side
        if not self.training:
            return self.corrected(tower_scores(torch.where(active.unsqueeze(2), interests, interests[:, :1]), items) / self.temperature,
                                  sparse)
        user = self.attention(interests, items[:queries], active)
        if self.normalize:  # a mix of unit vectors is shorter: scored as a cosine, as each interest is in eval
            user = F.normalize(user, dim=1)
        return self.corrected(user @ items.t() / self.temperature, sparse)


def _history(config: MINDConfig, features: FeatureSpec) -> tuple[SequenceGroup, list[str]]:
    """The sequence group and the history features of ``model.user_features`` that MIND routes.

    Raises:
        ConfigError: none listed, history features among the item features, two groups' features listed, or the first
            not reading the item id's table.
    """
    groups = {f: g for g in features.sequences for f in g.features}
    history = [n for n in config.user_features if n in groups]
    if not history:
        valid = sorted(groups) or "none: the data has no data.sequences group"
        raise ConfigError(f"MIND routes the user's behaviour history into interests, but model.user_features="
                          f"{list(config.user_features)} lists no history feature (a list column of a data.sequences group; the "
                          f"data's: {valid}). Fix: add the history of item ids, e.g. model.user_features=[hist_item_id,"
                          f"{','.join(config.user_features)}]" if groups else
                          "MIND routes the user's behaviour history into interests, but the data has no history (no "
                          "data.sequences group). Fix: data=synthetic_sequences, or declare the history columns in "
                          "data.sequences (docs/sequences.md)")
    in_items = [n for n in config.item_features if n in groups]
    if in_items:
        raise ConfigError(f"model.item_features lists history features {in_items}; an item is its own features (its id, category, "
                          f"…), the history is the user's. Fix: move them to model.user_features, e.g. model.item_features="
                          f"[{','.join(n for n in config.item_features if n not in groups) or 'item_id'}]")
    both = sorted({groups[n].name for n in history})
    if len(both) > 1:
        raise ConfigError(f"model.user_features lists history features of the groups {both}; MIND routes one history. Fix: "
                          f"keep the features of one group")
    tables = {f.name: f.table_name for f in features.sparse}
    item_id = next((n for n in config.item_features if n in tables), None)
    if item_id is None or tables[history[0]] != tables[item_id]:
        raise ConfigError(f"MIND reads the history's items through the item tower's own embedding table, but history feature "
                          f"{history[0]!r} (table {tables[history[0]]!r}) shares no table with the item id "
                          f"{item_id!r}{f' (table {tables[item_id]!r})' if item_id else ' (model.item_features has no sparse feature)'}"
                          f". Fix: give both the same table in data.sparse (e.g. {history[0]} and item_id with table: item), and "
                          f"list the history of item ids first in model.user_features")
    return groups[history[0]], history
