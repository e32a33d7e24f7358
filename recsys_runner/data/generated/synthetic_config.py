"""The config of ``data=synthetic`` (:class:`SyntheticDataConfig`, the schema of ``conf/data/synthetic.yaml``): its fields'
defaults and documentation, the checks of each combination, and :meth:`SyntheticDataConfig.for_model`, which fills the
fields left ``null`` from the model's declared needs (its tasks and their kinds; a two-tower model's (user, item) pairs;
``data=synthetic_sequences`` for a model over histories). What the data is and how it is generated is
:mod:`recsys_runner.data.generated.synthetic`, which its ``_target_`` names."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any

from recsys_runner.data.base import DataConfig
from recsys_runner.data.catalogue.negatives import NegativesConfig
from recsys_runner.data.collision import SyntheticCollisionConfig, collision_config
from recsys_runner.data.generated.synthetic_labels import SyntheticLabelsConfig
from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
from recsys_runner.errors import require
from recsys_runner.features import DataNeeds

log = logging.getLogger(__name__)
PAIR_CLUSTERS = 16
"""``K`` of the (user, item) pairs drawn for a two-tower model when ``user_item_clusters`` is null."""
DEFAULT_NUM_STEPS = 1000
"""Optimizer steps a run on generated data takes when neither ``train.num_steps`` nor ``train.num_epochs`` is set."""


@dataclass(kw_only=True)
class SyntheticDataConfig(SyntheticLabelsConfig):
    """Schema of ``conf/data/synthetic.yaml``; its label fields (``tasks``, ``label_kinds`` …) are
    :class:`~recsys_runner.data.generated.synthetic_labels.SyntheticLabelsConfig`'s, which generated histories share."""

    _target_: str = "recsys_runner.data.generated.synthetic.SyntheticData"
    num_dense: int = 13
    """Dense (float) columns, ``int_0 …``; Criteo has 13."""
    num_sparse: int = 26
    """Single-id categorical columns, ``cat_0 …``; Criteo has 26."""
    num_embeddings: int = 10_000
    """Id-space size of every categorical column (the embedding table's row count)."""
    num_embeddings_per_feature: list[int] | None = None
    """Per-column id-space sizes; overrides ``num_embeddings`` when set (length ``num_sparse``)."""
    num_train_rows: int = 1_048_576
    """Rows in one training epoch (all ranks together)."""
    num_eval_rows: int = 65_536
    """Rows in the evaluation split (all ranks together), generated in whole batches of ``batch_size``: the same
    ``num_eval_rows // batch_size`` batches on any number of ranks."""
    id_skew: float = 3.0
    """Popularity skew of ids: ``id = floor(n · u**id_skew)``; 1.0 is uniform, larger is heavier-headed."""
    seed: int = 0
    """Seed of the hidden world and of every batch; equal seeds give identical data."""
    label_noise: float = 1.0
    """Scale of the click score; smaller means noisier labels and a lower attainable AUC."""
    user_item_clusters: int | None = None
    """``K``: draw each item feature's id in the user feature's cluster (``id mod K``), so (user, item) pairs
    are learnable for retrieval. ``null``: 16 for a two-tower model (``model=dssm``), else independent columns."""
    user_feature: str | None = None
    """The pairs' user column; ``null``: the first sparse feature of the model's user tower, else ``cat_0``."""
    item_features: list[str] | None = None
    """The pairs' item columns, each drawn in the user's cluster; ``null``: the sparse features of the
    model's item tower, else ``[cat_1]``."""
    negatives: NegativesConfig = field(default_factory=NegativesConfig)
    """Catalogue items appended to every training batch as shared negatives (``num_negatives``, ``distribution``, ``alpha``;
    docs/retrieval.md), drawn from the generated item table of the (user, item) pairs. ``num_negatives: 0``: in-batch only."""
    hard_negatives: int = 0
    """Per row, this many hard negative item ids in a list column ``hard_items`` (sharing the item column's table): items
    the row's user's cluster draws as it draws positives (the generator's latent factor: what the user was likely shown),
    never the row's positive, for ``data.negatives.hard_column=hard_items``. Needs (user, item) pairs; 0: no column."""
    managed_collision: Any = None
    """Managed-collision tables (docs/data.md, ``SyntheticCollisionConfig``): ``{features: [cat_0], distinct_ids: …, eviction_policy: lfu, …}`` gives
    those columns raw ids drawn from ``distinct_ids`` (default 10× their slots), mapped to ``num_embeddings`` slots by
    the model's managed-collision module. ``null``: every column is an id in its table."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # the column counts first: the checks below name the columns they make (cat_0 …)
        require(self.num_dense >= 0, f"data.num_dense must be >= 0, got {self.num_dense}")
        require(self.num_sparse > 0, f"data.num_sparse must be positive, got {self.num_sparse}: the models need at least one embedding table")
        if self.user_item_clusters is not None:
            require(self.user_item_clusters > 0, f"data.user_item_clusters must be positive or null, got {self.user_item_clusters}")
            require(self.num_sparse >= 2, "data.user_item_clusters needs data.num_sparse >= 2 (cat_0 is the user, cat_1 the item)")
        sparse = sparse_names(self.num_sparse)
        pair = [self.user_feature] if self.user_feature is not None else []
        strangers = [n for n in [*pair, *(self.item_features or [])] if n not in sparse]
        require(not strangers, f"data.user_feature/item_features name {strangers}, which are not sparse columns of the synthetic "
                f"data ({sparse[0]} … {sparse[-1]}). Fix: name cat_<i> columns, or leave them null to follow the model")
        user, items = self.user_feature or "cat_0", self.item_features if self.item_features is not None else ["cat_1"]
        require(len(items) > 0 and user not in items,
                f"the pairs' item columns {items} (data.item_features) must be at least one and not the user column {user!r} "
                f"(data.user_feature). Fix: data.item_features=[<sparse columns other than {user}>]")
        require(self.hard_negatives >= 0, f"data.hard_negatives must be >= 0, got {self.hard_negatives}. Fix: e.g. 8, or 0 for none")
        require(self.num_embeddings > 0, f"data.num_embeddings must be positive, got {self.num_embeddings}")
        if self.num_embeddings_per_feature is not None:
            require(
                len(self.num_embeddings_per_feature) == self.num_sparse,
                f"data.num_embeddings_per_feature has {len(self.num_embeddings_per_feature)} entries "
                f"but data.num_sparse={self.num_sparse}; give one size per categorical column",
            )
            require(all(n > 0 for n in self.num_embeddings_per_feature), "data.num_embeddings_per_feature entries must be positive")
        require(
            self.num_train_rows >= self.batch_size,
            f"data.num_train_rows={self.num_train_rows} is smaller than one batch (data.batch_size={self.batch_size})",
        )
        require(
            self.num_eval_rows >= self.batch_size,
            f"data.num_eval_rows={self.num_eval_rows} is smaller than one batch (data.batch_size={self.batch_size})",
        )
        require(self.id_skew > 0, f"data.id_skew must be positive, got {self.id_skew}")
        # a negative scale turns the hidden world's click score around: not a setting of the data the docs describe, and
        # nothing would refuse it later
        require(self.label_noise >= 0, f"data.label_noise must be >= 0 (the click score's scale; 0: labels are coin flips), "
                f"got {self.label_noise}. Fix: e.g. data.label_noise=0.5 for noisier labels")
        self.managed_collision = collision_config(self.managed_collision, SyntheticCollisionConfig, "data.managed_collision")
        if self.managed_collision is not None:
            self.managed_collision.check_features(sparse, list(self.num_embeddings_per_feature or [self.num_embeddings] * self.num_sparse))

    def default_num_steps(self) -> int:
        """:data:`DEFAULT_NUM_STEPS`: generated rows are an arbitrary amount, so the default length is in steps, not epochs."""
        return DEFAULT_NUM_STEPS

    def supports_batch_tokens(self) -> bool:
        """Decided with the model: :meth:`for_model` generates histories for a model over them (``batch_tokens`` then counts
        their tokens) and refuses ``batch_tokens`` for any other model."""
        return True

    def for_model(self, needs: DataNeeds) -> DataConfig:
        """A new config that serves a model with ``needs`` (for a model over histories a ``data=synthetic_sequences`` one,
        :meth:`_as_sequences`): the fields left ``null`` follow the model (its
        tasks and their kinds; for a two-tower model, (user, item) pairs linked through the sparse features
        of its towers); ``self`` when nothing changes.

        Raises:
            ConfigError: a two-tower model's tower has no sparse feature to link the pairs through, ``batch_tokens`` for a
                model without histories, or the combination fails a check of :meth:`__post_init__`.
        """
        if needs.sequences:
            return self._as_sequences(needs)
        require(self.batch_tokens is None, self.no_histories(" for this model (generated data has histories only for a model "
                                                             "over them: model=din, bst, sasrec)"))
        changes = self.label_changes(needs)
        sparse = sparse_names(self.num_sparse)
        known = {*sparse, *(f"int_{i}" for i in range(self.num_dense))}
        towers = {"user": [n for n in needs.user_features if n in sparse], "item": [n for n in needs.item_features if n in sparse]}
        # Unknown names are the model's to report (it lists the valid ones); only known, dense-only towers are ours.
        if (needs.user_features or needs.item_features) and set(needs.user_features) | set(needs.item_features) <= known:
            empty = [side for side, names in towers.items() if not names]
            require(not empty, f"data=synthetic links each (user, item) pair through a sparse feature of each tower, but the model's "
                    f"{' and '.join(empty)} tower has none (user: {list(needs.user_features)}, item: {list(needs.item_features)}). "
                    f"Fix: add a sparse feature to it (e.g. model.user_features=[cat_0,…], model.item_features=[cat_1,…]), or train "
                    f"on logged pairs (data=parquet)")
            if self.user_feature is None:
                changes["user_feature"] = towers["user"][0]
            if self.item_features is None:
                changes["item_features"] = towers["item"]
            if self.user_item_clusters is None:
                changes["user_item_clusters"] = PAIR_CLUSTERS
        return replace(self, **changes) if changes else self  # the combination passes the same checks as a configured one


    def _as_sequences(self, needs: DataNeeds) -> DataConfig:
        """``data=synthetic_sequences`` with this config's shared fields (batch size, rows, workers, seed, tasks and the funnel's
        label fields), for a model
        that attends over histories: the Criteo-shaped columns have none. Logged, so that the switch is seen."""
        changed = {f.name: getattr(self, f.name) for f in fields(self)
                   if f.name != "_target_" and getattr(self, f.name) != getattr(SyntheticDataConfig, f.name, None)}
        if not self.negatives.enabled:  # the histories' data.negatives is another thing: a share of negative rows
            changed.pop("negatives")
        own = {f.name for f in fields(SyntheticSequencesConfig)} - {"negatives"}
        shared = {k: v for k, v in changed.items() if k in own}
        log.info("the model attends over user histories, which data=synthetic does not have: generating them as "
                 "data=synthetic_sequences does (set data=synthetic_sequences to tune them)")
        ignored = sorted(k for k in changed if k not in own)
        if ignored:
            log.warning("data.%s %s no effect on generated histories (data=synthetic_sequences has no such field%s); "
                        "set data=synthetic_sequences and its own fields instead", ", data.".join(ignored),
                        "has" if len(ignored) == 1 else "have", "" if len(ignored) == 1 else "s")
        return SyntheticSequencesConfig(**shared).for_model(needs)



def sparse_names(num_sparse: int) -> list[str]:
    """The generated data's categorical columns, ``cat_0 …``: what the config checks names against and the data carries."""
    return [f"cat_{i}" for i in range(num_sparse)]
