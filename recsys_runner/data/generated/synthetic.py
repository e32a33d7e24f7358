"""Deterministic, Criteo-shaped synthetic click data whose labels truly depend on the features.

A hidden "world" (per-id effects for each categorical feature, weights for the dense features and
one dense×sparse interaction: :mod:`recsys_runner.data.generated.synthetic_world`) is drawn once from ``seed``; each
row's click probability is the sigmoid of its score, and its label is a Bernoulli draw. A model that learns the world reaches an
AUC far above 0.5 (about 0.8 with the defaults); one that learns nothing stays at 0.5.

With ``tasks=[ctr, cvr, …]`` a batch carries one label per task (``labels [B, T]``), a conversion
funnel like Taobao's: the first task is the click drawn as above; each later task has a hidden world
of its own and is only ever positive on a clicked row (``label_t = click · Bernoulli(p_t)``); a
``regression`` task's label is an amount on every row, ``softplus(score_t)``. With ``user_item_clusters=K`` the id
of each item feature (``cat_1``) lies in the cluster ``id mod K`` of the user feature (``cat_0``): a
two-tower model can learn which items go with which users.

The data serves whichever model it is given (:meth:`SyntheticDataConfig.for_model`): the fields
left ``null`` follow the model's declared needs, so a multi-task model gets one label per task and
a two-tower model gets (user, item) pairs linked through its towers' features.

Every batch is generated from ``(seed, split, batch index)`` alone, so any rank can produce any
batch without reading the others, training is reproducible, and nothing is written to disk. With
``num_workers`` (``auto``: on CUDA) DataLoader worker processes generate a rank's batches off the
training thread, worker ``w`` of ``W`` the ``w``-th, ``(w+W)``-th … of them, which the DataLoader
interleaves back in order: the batches are exactly those of the in-process path, in the same order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.data.base import DataConfig, DataModule
from recsys_runner.data.catalogue.items import ItemTable
from recsys_runner.data.catalogue.negatives import MinedNegatives, NegativeSampler, NegativesConfig
from recsys_runner.data.collision import SyntheticCollisionConfig, collision_config, spread_ids
from recsys_runner.data.generated.synthetic_items import (
    HARD_COLUMN,
    generated_item_table,
    hard_negative_ids,
    item_lookups,
    pair_popularity,
)
from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
from recsys_runner.data.generated.synthetic_world import TaskLabels, World
from recsys_runner.data.schema import LABEL_KINDS
from recsys_runner.errors import require
from recsys_runner.features import DataNeeds, FeatureSpec, SparseFeature

log = logging.getLogger(__name__)
_TRAIN, _EVAL = 0, 1
PAIR_CLUSTERS = 16
"""``K`` of the (user, item) pairs drawn for a two-tower model when ``user_item_clusters`` is null."""
DEFAULT_NUM_STEPS = 1000
"""Optimizer steps a run on generated data takes when neither ``train.num_steps`` nor ``train.num_epochs`` is set."""


@dataclass(kw_only=True)
class SyntheticDataConfig(DataConfig):
    """Schema of ``conf/data/synthetic.yaml``."""

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
    tasks: list[str] | None = None
    """Task names, one label each (``labels [B, T]``): the first is the click, each later one a
    conversion observed only on clicked rows, e.g. ``[ctr, cvr]``. ``null``: the model's tasks — one
    click label ``[B]`` for a single-task model, one label per task for a multi-task one (``model=mmoe``)."""
    label_kinds: Any = None
    """Per task of ``tasks``: ``binary`` (the default) or ``regression`` (an amount on every row: ``softplus`` of
    the task's own score, e.g. a watch time), e.g. ``{watch: regression}``. With
    ``tasks: null``, the model's task kinds. A mapping, typed ``Any`` so that ``data.label_kinds={…}``
    works as a plain override."""
    label_classes: Any = None
    """Per ``multiclass`` task of ``label_kinds``: its number of classes ``C >= 2``, e.g. ``{category: 5}``; its label is a
    class index ``0..C-1``, the ``C`` quantiles of ``sigmoid(score_t + logistic noise)`` (learnable: the class rises with
    the task's own score). With ``tasks: null``, the model's (``model.task_specs.<task>.num_classes``)."""
    conversion_bias: float = 0.0
    """Logit offset of each later task's own score: its base rate given a click (0: about one in two; -3: a few in
    a hundred, a rare task whose loss is small next to the click's)."""
    conversion_conflict: float = 0.0
    """How strongly each later task's score falls with the click's score (``score_t - c·score_click``): with ``c > 0`` the
    tasks pull the shared layers apart — a seesaw, where equal fixed loss weights favour the click (docs/multitask.md)."""
    conversion_amount: float | None = None
    """A later ``regression`` task's label as a purchase amount: ``conversion_amount·(1 + softplus(score_t))`` on rows that
    convert (the funnel: a click, then ``Bernoulli(sigmoid(score_t))``), 0 elsewhere — a large-variance amount whose MSE
    dwarfs the click's log loss; its ``auc`` ranks the converting rows. ``null``: ``softplus(score_t)`` on every row."""
    selection_bias: float = 0.0
    """How strongly the click selects on conversion: the click's score gains ``selection_bias`` times the first later
    task's own score, so rows that would convert are clicked more and clicked rows are a biased sample of the impressions
    (a CVR model fitted on them alone ranks the unclicked ones badly; ESMM's setting, ``data=synthetic_esmm``). 0: the
    click ignores the conversion world."""
    conversion_truth: str | None = None
    """Name of one more label column, written on every row: whether the row would convert if clicked (the first later
    task's conversion draw before the click gates it), so a CVR model can be evaluated on all impressions (ESMM's
    ``cvr_all`` task, docs/multitask.md). Ground truth no logged data has: no task trains on it unless told to.
    ``null``: no such column."""
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
        if self.tasks is not None:
            require(len(self.tasks) > 0 and len(set(self.tasks)) == len(self.tasks),
                    f"data.tasks={self.tasks} must list distinct task names, e.g. data.tasks=[ctr,cvr], or be null")
        kinds = self.label_kinds or {}
        require(isinstance(kinds, dict), f"data.label_kinds must map task names to kinds, e.g. {{watch: regression}}; got {kinds!r}")
        require(not kinds or self.tasks is not None,
                f"data.label_kinds={kinds} is set but data.tasks is null (the model's tasks, with the model's kinds). "
                f"Fix: data.label_kinds=null and model.task_kinds=[...], or list data.tasks as well")
        unknown = sorted(set(kinds) - set(self.tasks or []))
        require(not unknown, f"data.label_kinds names {unknown}, which are not in data.tasks={self.tasks}. Fix: one entry per task to change")
        wrong = sorted({k for k in kinds.values() if k not in LABEL_KINDS})
        require(not wrong, f"data.label_kinds has kind(s) {wrong}; each must be one of {list(LABEL_KINDS)}")
        self._check_classes(kinds)
        if self.selection_bias or self.conversion_truth is not None:
            what = "data.selection_bias" if self.selection_bias else f"data.conversion_truth={self.conversion_truth!r}"
            require(self.tasks is None or (len(self.tasks) >= 2 and kinds.get(self.tasks[1], "binary") == "binary"),
                    f"{what} reads the funnel's first conversion, but data.tasks={self.tasks} has no binary task after the click. "
                    f"Fix: data.tasks=[ctr,cvr] (or null: the model's tasks), or data.selection_bias=0 data.conversion_truth=null")
            require(self.conversion_truth not in (self.tasks or []),
                    f"data.conversion_truth={self.conversion_truth!r} is also a task of data.tasks={self.tasks}; it is a column of "
                    f"its own. Fix: another name, e.g. data.conversion_truth=cvr_if_clicked")
        if self.user_item_clusters is not None:
            require(self.user_item_clusters > 0, f"data.user_item_clusters must be positive or null, got {self.user_item_clusters}")
            require(self.num_sparse >= 2, "data.user_item_clusters needs data.num_sparse >= 2 (cat_0 is the user, cat_1 the item)")
        sparse = _sparse_names(self.num_sparse)
        pair = [self.user_feature] if self.user_feature is not None else []
        strangers = [n for n in [*pair, *(self.item_features or [])] if n not in sparse]
        require(not strangers, f"data.user_feature/item_features name {strangers}, which are not sparse columns of the synthetic "
                f"data ({sparse[0]} … {sparse[-1]}). Fix: name cat_<i> columns, or leave them null to follow the model")
        user, items = self.user_feature or "cat_0", self.item_features if self.item_features is not None else ["cat_1"]
        require(len(items) > 0 and user not in items,
                f"the pairs' item columns {items} (data.item_features) must be at least one and not the user column {user!r} "
                f"(data.user_feature). Fix: data.item_features=[<sparse columns other than {user}>]")
        require(self.hard_negatives >= 0, f"data.hard_negatives must be >= 0, got {self.hard_negatives}. Fix: e.g. 8, or 0 for none")
        require(self.num_dense >= 0, f"data.num_dense must be >= 0, got {self.num_dense}")
        require(self.num_sparse > 0, f"data.num_sparse must be positive, got {self.num_sparse}: the models need at least one embedding table")
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
        self.managed_collision = collision_config(self.managed_collision, SyntheticCollisionConfig, "data.managed_collision")
        if self.managed_collision is not None:
            self.managed_collision.check_features(sparse, list(self.num_embeddings_per_feature or [self.num_embeddings] * self.num_sparse))

    def default_num_steps(self) -> int:
        """:data:`DEFAULT_NUM_STEPS`: generated rows are an arbitrary amount, so the default length is in steps, not epochs."""
        return DEFAULT_NUM_STEPS

    def _check_classes(self, kinds: dict[str, str]) -> None:
        """``label_classes``: a count ``>= 2`` for each multiclass task of ``label_kinds``, and for no other."""
        classes = self.label_classes or {}
        require(isinstance(classes, dict), f"data.label_classes must map task names to class counts, e.g. {{category: 5}}; got {classes!r}")
        multi = sorted(t for t, k in kinds.items() if k == "multiclass")
        require(sorted(classes) == multi, f"data.label_classes={classes} must give exactly the multiclass tasks of "
                f"data.label_kinds ({multi}) their number of classes, e.g. data.label_classes={{{multi[0] if multi else 'category'}: 5}}")
        small = {t: c for t, c in classes.items() if not isinstance(c, int) or c < 2}
        require(not small, f"data.label_classes has {small}; each must be an integer >= 2")

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
        changes: dict[str, Any] = {}
        if self.tasks is None and needs.labels:
            changes["tasks"] = list(needs.labels)
            if needs.task_label_columns:  # a column to read exists only in files
                log.warning("%s: generated data has no label columns to choose from; it draws each task's label (the click, then the "
                            "funnel's conversions) and only names it so, so this has no effect here. It picks a label column of files "
                            "(data=parquet|csv)", ", ".join(f"model.task_specs.{task}.label={column}"
                                                            for task, column in needs.task_label_columns))
            kinds = {n: k for n, k in zip(needs.labels, needs.label_kinds, strict=False) if k != "binary"}
            if kinds:
                changes["label_kinds"] = kinds
            classes = {n: c for n, c in zip(needs.labels, needs.label_classes, strict=False) if c}
            if classes:
                changes["label_classes"] = classes
        sparse = _sparse_names(self.num_sparse)
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
        """``data=synthetic_sequences`` with this config's shared fields (batch size, rows, workers, seed), for a model
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


def _sparse_names(num_sparse: int) -> list[str]:
    return [f"cat_{i}" for i in range(num_sparse)]


class SyntheticData(DataModule):
    """Criteo-shaped click data generated on the fly; see the module docstring.

    Example::

        data = make(SyntheticDataConfig, batch_size=4, num_dense=2, num_sparse=3, num_embeddings=10).build()
        batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        batch.dense_features.shape   # (4, 2)
        batch.sparse_features.keys() # ['cat_0', 'cat_1', 'cat_2']
    """

    def __init__(self, config: SyntheticDataConfig) -> None:
        c = self.config = config.resolved()  # built by DataConfig.build, already; constructed directly, decided here
        require(c.batch_tokens is None, c.no_histories())
        assert isinstance(c.num_workers, int)
        self._workers = c.num_workers
        self._pin = bool(c.pin_memory)
        slots = list(c.num_embeddings_per_feature or [c.num_embeddings] * c.num_sparse)
        mc, names = c.managed_collision, _sparse_names(c.num_sparse)
        sizes = mc.check_features(names, slots) if mc is not None else slots  # ids drawn per column: a managed one's raw ids
        managed = {n: mc.spec() for n in mc.features} if mc is not None else {}
        self._raw = [(j, sizes[j], managed[n].input_hash_size) for j, n in enumerate(names) if n in managed]
        """``(column, distinct ids, input_hash_size)`` of each managed column: its ids are spread over that raw id space."""
        sparse = tuple(SparseFeature(n, k, managed_collision=managed.get(n)) for n, k in zip(names, slots, strict=True))
        self._hard = c.hard_negatives
        if self._hard:
            item = sparse[names.index((c.item_features or ["cat_1"])[0])]
            require(c.user_item_clusters is not None and item.managed_collision is None
                    and item.num_embeddings >= 2 * c.user_item_clusters,
                    f"data.hard_negatives={self._hard} lists other items of the user's cluster per (user, item) pair; the data "
                    f"has no pairs, a managed-collision item column, or fewer than 2 items per cluster. Fix: "
                    f"data=synthetic_retrieval (or model=dssm) with data.num_embeddings >= 2 · clusters, or data.hard_negatives=0")
            sparse = (*sparse, SparseFeature(HARD_COLUMN, item.num_embeddings, table=item.table_name))
        self.features = FeatureSpec(
            dense_names=tuple(f"int_{i}" for i in range(c.num_dense)),
            sparse=sparse,
            label=(*c.tasks, *([c.conversion_truth] if c.conversion_truth is not None else [])) if c.tasks is not None else "label",
        )
        require(not (c.selection_bias or c.conversion_truth is not None) or len(c.tasks or []) >= 2,
                f"data.selection_bias / data.conversion_truth read the funnel's first conversion, but the data has labels "
                f"{list(c.tasks or ['label'])}. Fix: data.tasks=[ctr,cvr], or a multi-task model (model=esmm)")
        self.batch_size = c.batch_size
        self._num_train_batches = c.num_train_rows // c.batch_size
        self._num_eval_batches = c.num_eval_rows // c.batch_size
        self._sizes = torch.tensor(sizes, dtype=torch.float64)
        self._id_skew = c.id_skew
        self._seed = c.seed
        self._world = World.draw(c.seed, c.num_dense, sizes, c.label_noise)
        self._task_labels = TaskLabels(
            worlds=[World.draw(c.seed * 1000 + t, c.num_dense, sizes, c.label_noise, bias=c.conversion_bias)
                    for t in range(1, len(c.tasks or []))],
            kinds=[(c.label_kinds or {}).get(t, "binary") for t in c.tasks or []],
            classes=[(c.label_classes or {}).get(t, 0) for t in c.tasks or []],
            conflict=c.conversion_conflict,
            amount=c.conversion_amount,
            truth=c.conversion_truth is not None,
        )
        self._selection_bias = c.selection_bias
        self._clusters = c.user_item_clusters
        if c.user_item_clusters is not None:
            names = self.features.sparse_names
            self._user = names.index(c.user_feature or "cat_0")
            self._items = [names.index(n) for n in c.item_features or ["cat_1"]]
        self._catalogue, self._sampler = self._open_catalogue(c, sizes)

    def _open_catalogue(self, c: SyntheticDataConfig, sizes: list[int]) -> tuple[ItemTable | None, NegativeSampler | None]:
        """The generated item table of the (user, item) pairs (none without pairs) and, with ``data.negatives``, its sampler;
        the item columns after the first become functions of the item id (``self._lookups``) so that the catalogue is real."""
        self._lookups: list[torch.Tensor] = []
        table = None
        if self._clusters is not None:
            first, others = self._items[0], self._items[1:]
            lookups = item_lookups(sizes[first], [sizes[j] for j in others], self._clusters, c.seed)
            self._lookups = [torch.from_numpy(v) for v in lookups]
            names = [self.features.sparse_names[j] for j in self._items]
            popularity = pair_popularity(sizes[first], sizes[self._user], self._clusters, c.id_skew)
            table = generated_item_table(names, lookups, popularity, self._as_generated)
        # generated data has one hard-negative column, which data.hard_negatives turns on
        column = "" if c.negatives.hard_column == HARD_COLUMN else f" data.negatives.hard_column={HARD_COLUMN}"
        hard_fix = (f"data.negatives.hard_column={HARD_COLUMN}, the list column data.hard_negatives={c.hard_negatives} generates"
                    if c.hard_negatives else f"data.hard_negatives=8{column} (the generated data then lists 8 hard negative items per "
                    f"row in {HARD_COLUMN}), or data.negatives.hard_column=null")
        c.negatives.check(table, self.features, "the generated data has no (user, item) pairs. Fix: data=synthetic_retrieval, or a "
                                                "two-tower model (model=dssm), or data.user_item_clusters=<K>", hard_fix)
        if table is None or not c.negatives.enabled:
            return table, None
        sampler = NegativeSampler(c.negatives, table, self.features, c.seed)
        self.features = sampler.features(self.features)
        return table, sampler

    def _as_generated(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Column ``name``'s ids as batches carry them (a managed-collision column's spread over its raw id space)."""
        j = self.features.sparse_names.index(name)
        for column, *spread in self._raw:
            if column == j:
                return spread_ids(torch.from_numpy(ids), *spread).numpy()
        return ids

    def item_table(self) -> ItemTable | None:
        return self._catalogue

    def negative_miner(self) -> MinedNegatives | None:
        """The lists hard negatives are mined into at each full-corpus eval (``data.negatives.mined_ratio``), or ``None``."""
        return self._sampler.mined if self._sampler is not None else None

    def num_train_batches(self, world_size: int) -> int:
        return self._num_train_batches // world_size

    def train_batches(self, epoch: int, rank: int, world_size: int) -> Iterator[Batch]:
        # A seeded permutation per epoch shuffles batch order; ranks take strided, disjoint slices
        # and equally many batches (the remainder is dropped) so that no rank waits on another.
        order = torch.randperm(self._num_train_batches, generator=torch.Generator().manual_seed(self._seed * 7919 + epoch))
        mine = order[rank :: world_size][: self.num_train_batches(world_size)]
        return self._batches(_TRAIN, [int(i) for i in mine])

    def eval_batches(self, rank: int, world_size: int) -> Iterator[Batch]:
        # Every eval batch on some rank, whatever the world size (the evaluator keeps a rank with one fewer in step), so
        # that the eval metrics do not depend on the number of ranks.
        return self._batches(_EVAL, list(range(rank, self._num_eval_batches, world_size)))

    def _batches(self, split: int, indices: list[int]) -> Iterator[Batch]:
        """Batches ``indices`` of ``split``, in that order: generated here, or with workers by DataLoader worker processes."""
        if self._workers == 0:
            for index in indices:
                tensors = self._tensors(split, index)
                yield self._assemble(tuple(t.pin_memory() for t in tensors) if self._pin else tensors)
            return
        # Never more workers than batches: the DataLoader's round robin then hands worker w exactly the
        # batches i ≡ w (mod workers) that _Stream gives it, in order.
        loader = DataLoader(_Stream(self, split, indices), batch_size=None, num_workers=min(self._workers, max(len(indices), 1)),
                            pin_memory=self._pin, multiprocessing_context="fork" if os.name == "posix" else None)
        for tensors in loader:
            yield self._assemble(tensors)

    def batch(self, split: int, index: int) -> Batch:
        """Generate batch ``index`` of ``split`` (0 train, 1 eval); pure function of the seed."""
        return self._assemble(self._tensors(split, index))

    def _assemble(self, tensors: tuple[torch.Tensor, ...]) -> Batch:
        dense, values, lengths, labels = tensors
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=self.features.sparse_names, values=values, lengths=lengths)
        return Batch(dense_features=dense, sparse_features=kjt, labels=labels)

    def _tensors(self, split: int, index: int) -> tuple[torch.Tensor, ...]:
        """Batch ``index`` of ``split`` as ``(dense, values, lengths, labels)``, which cross a worker process boundary as they are."""
        g = torch.Generator().manual_seed(hash((self._seed, split, index)) & 0x7FFF_FFFF_FFFF_FFFF)
        n, f = self.batch_size, len(self._sizes)
        u = torch.rand(n, f, generator=g, dtype=torch.float64)
        ids = (self._sizes * u.pow(self._id_skew)).long().clamp_max_(self._sizes.long() - 1)
        if self._clusters is not None:
            k = self._clusters
            first = self._items[0]
            moved = ids[:, first] - ids[:, first] % k + ids[:, self._user] % k
            ids[:, first] = torch.where(moved < int(self._sizes[first]), moved, (moved - k).clamp_min(0))
            for j, lookup in zip(self._items[1:], self._lookups, strict=True):
                ids[:, j] = lookup[ids[:, first]]  # the item's own value: one catalogue row per item id
        dense = torch.randn(n, self.features.num_dense, generator=g)
        score = self._world.score(dense, ids)
        if self._selection_bias:  # the click selects on what makes the row convert (the first conversion's own score)
            score = score + self._selection_bias * self._task_labels.worlds[0].score(dense, ids)
        labels = torch.bernoulli(torch.sigmoid(score), generator=g)
        if self.features.multi_label:
            labels = torch.stack(self._task_labels.labels(labels, score, dense, ids, g), dim=1)
        if self._hard:  # drawn last, so the other columns are the same with and without the list
            first = self._items[0]
            hard = hard_negative_ids(ids[:, first], ids[:, self._user], self._hard, int(self._sizes[first]), self._clusters or 1,
                                     self._id_skew, g)
        for j, distinct, space in self._raw:
            ids[:, j] = spread_ids(ids[:, j], distinct, space)
        tensors = (dense, ids.t().reshape(-1), torch.ones(n * f, dtype=torch.int32), labels)
        if self._hard:
            tensors = (dense, torch.cat([tensors[1], hard.reshape(-1)]),
                       torch.cat([tensors[2], torch.full((n,), self._hard, dtype=torch.int32)]), labels)
        return self._sampler.extend(tensors, (index,)) if self._sampler is not None and split == _TRAIN else tensors


class _Stream(IterableDataset):
    """Batches ``indices`` of a split as tensors; in DataLoader worker ``w`` of ``W``, the share ``indices[w::W]``."""

    def __init__(self, data: SyntheticData, split: int, indices: list[int]) -> None:
        super().__init__()
        self.data, self.split, self.indices = data, split, indices

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        info = get_worker_info()
        mine = self.indices if info is None else self.indices[info.id :: info.num_workers]
        return (self.data._tensors(self.split, i) for i in mine)
