"""The feature schema shared by data and models.

Data modules describe *what* they produce (dense columns, sparse columns, their id spaces, how
each is pooled, which embedding table it reads); models derive their embedding tables from it, so
table sizes are written once, in the data config, and never repeated in the model config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType

from recsys_runner.errors import ConfigError

POOLINGS = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
"""Pooling modes a sparse feature may ask for (how a multi-hot bag becomes one vector)."""

EMBEDDING_DIM_MULTIPLE = 4
"""Every embedding table's width must be a multiple of this: fbgemm's fused embedding kernels, which
TorchRec uses for sharded tables on CPU and GPU, store each row in groups of 4 floats."""


def check_embedding_dim(key: str, dim: int) -> None:
    """Raise :class:`ConfigError` unless ``dim`` (the value of config key ``key``) is a positive multiple of 4.

    Checked in the config dataclasses, before anything is built: otherwise fbgemm fails deep inside
    DistributedModelParallel with an ``AssertionError`` about ``local_cols``.
    """
    if dim <= 0:
        raise ConfigError(f"{key} must be positive, got {dim}")
    if dim % EMBEDDING_DIM_MULTIPLE:
        nearest = -(-dim // EMBEDDING_DIM_MULTIPLE) * EMBEDDING_DIM_MULTIPLE
        raise ConfigError(
            f"{key}={dim} is not a multiple of {EMBEDDING_DIM_MULTIPLE}: fbgemm's fused embedding kernels (TorchRec's kernels "
            f"for sharded embedding tables, on CPU and GPU) store each row in groups of {EMBEDDING_DIM_MULTIPLE} floats. "
            f"Fix: use a multiple of {EMBEDDING_DIM_MULTIPLE}, e.g. {key}={nearest}"
        )


COLLISION_MODULES = ("auto", "mch", "hash_zch")
"""TorchRec's managed-collision modules: ``mch`` (``MCHManagedCollisionModule``: a sorted mapping, admission and eviction
every ``eviction_interval`` steps; CPU and GPU), ``hash_zch`` (``HashZchManagedCollisionModule``: multi-probe hashing in
an fbgemm kernel that admits and evicts inline; it trains on CUDA only) and ``auto`` (``hash_zch`` on CUDA, ``mch`` on
CPU: the run's ``distributed.device``)."""

EVICTION_POLICIES = ("lfu", "lru", "distance_lfu")
"""Eviction policies of an ``mch`` table (TorchRec's MCH ``LFU_``, ``LRU_``, ``DistanceLFU_EvictionPolicy``)."""

HASH_ZCH_EVICTION_POLICIES = ("lru", "ttl")
"""Eviction policies of a ``hash_zch`` table (TorchRec's ``HashZchEvictionPolicyName.LRU_EVICTION`` and
``SINGLE_TTL_EVICTION``, with the time to live counted in training steps instead of hours)."""


@dataclass(frozen=True, slots=True)
class ManagedCollision:
    """How a table maps raw ids to its rows through one of TorchRec's managed-collision modules, rather than by hashing.

    The table's ``num_embeddings`` rows are the slots; raw ids lie in ``[0, input_hash_size)``. ``module`` picks the
    module (:data:`COLLISION_MODULES`; ``auto`` is decided by :meth:`on` for the run's device). ``mch``: every
    ``eviction_interval`` training steps ``eviction_policy`` (``None``: ``lfu``) admits the ids seen since and evicts
    the ids it scores lowest (``decay_exponent`` weighs how fast an id's last access ages it: ``lru`` and
    ``distance_lfu``); the last slot of the table (of each row-wise shard) is the fallback an id without a slot reads.
    ``hash_zch``: an id takes a free slot among ``max_probe`` probed from its hash at its first lookup; when none is
    free, a slot whose id went unseen for more than ``ttl_steps`` training steps is taken (``eviction_policy`` ``lru``, the
    default: the least recently seen in the probe range; ``ttl``: the first such slot probed); otherwise the id shares
    its hash's slot with another id. Carried by :class:`SparseFeature`, so the models build the module; the data
    configs declare it (``recsys_runner.data.collision``).
    """

    input_hash_size: int
    eviction_policy: str | None = None
    eviction_interval: int = 100
    decay_exponent: float = 1.0
    module: str = "auto"
    ttl_steps: int = 100
    max_probe: int = 128

    def on(self, device_type: str) -> ManagedCollision:
        """These settings with ``module`` decided for a run on ``device_type`` (``cuda``, ``cpu``; other devices,
        e.g. ``meta``, decide nothing): ``auto`` becomes ``hash_zch`` on CUDA and ``mch`` elsewhere."""
        if self.module != "auto" or device_type not in ("cuda", "cpu"):
            return self
        return replace(self, module="hash_zch" if device_type == "cuda" else "mch")

    @property
    def policy(self) -> str:
        """The eviction policy in effect: ``eviction_policy``, else the module's default (``hash_zch``: ``lru``, ``mch``
        and an undecided ``auto``: ``lfu``)."""
        return self.eviction_policy or ("lru" if self.module == "hash_zch" else "lfu")


@dataclass(frozen=True, slots=True)
class SparseFeature:
    """A categorical feature whose ids lie in ``[0, num_embeddings)``.

    ``embedding_dim=None`` takes the model's ``embedding_dim``; ``table=None`` gives the feature a
    table of its own (``t_<name>``); features naming the same ``table`` share its rows, and must then
    agree on ``num_embeddings``, ``embedding_dim`` and ``pooling``. ``managed_collision``: the feature's raw ids are
    mapped to rows by a managed-collision module (:class:`ManagedCollision`), not hashed by the data. ``weighted``: each
    id of a bag comes with a weight (the batch's ``KeyedJaggedTensor`` carries ``weights``) and the bag pools to the
    weighted sum of its embeddings (:attr:`FeatureSpec.weighted`).
    """

    name: str
    num_embeddings: int
    embedding_dim: int | None = None
    pooling: str = "sum"
    table: str | None = None
    managed_collision: ManagedCollision | None = None
    weighted: bool = False

    @property
    def table_name(self) -> str:
        return self.table or f"t_{self.name}"


TRUNCATIONS = ("recent", "oldest")
"""Which end of a history longer than ``max_len`` is kept: the most ``recent`` events (the default) or the ``oldest``."""


@dataclass(frozen=True, slots=True)
class SequenceGroup:
    """A user's ordered history: sparse features of equal length per row, oldest event first.

    Each of ``features`` is a sparse feature of the :class:`FeatureSpec` (``hist_item_id``, ``hist_category``): the
    ``i``-th value of every one of them describes the ``i``-th event of the row's history, so they have the same
    length in every row (0 for an empty history). Such features are embedded *unpooled* (TorchRec's
    ``EmbeddingCollection``, one vector per event) by sequence models, and pooled like any multi-hot feature by the
    others. A sequence feature's candidate is the non-sequence feature reading the same table (``item_id`` for
    ``hist_item_id`` when both name ``table: item``): attention models compare each event with it.

    ``timestamps`` names a key of the batch's ``KeyedJaggedTensor`` holding each event's time (int64 seconds, same
    lengths, never embedded) for models with a time-gap bias or embedding; ``None``: the data has no event times.
    """

    name: str
    features: tuple[str, ...]
    max_len: int
    """The longest history a row keeps; longer ones were truncated by the data (``truncate``)."""
    truncate: str = "recent"
    timestamps: str | None = None

    def __post_init__(self) -> None:
        key = f"data.sequences.{self.name}"
        if not self.features:
            raise ConfigError(f"{key} lists no features: a sequence group has one or more list columns, e.g. [hist_item_id]")
        if self.max_len <= 0:
            raise ConfigError(f"{key}.max_len must be positive, got {self.max_len}")
        if self.truncate not in TRUNCATIONS:
            raise ConfigError(f"{key}.truncate={self.truncate!r} must be one of {list(TRUNCATIONS)}")


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    """What one batch contains: ``num_dense`` float columns, the sparse features, the label(s).

    ``label`` is one name (``Batch.labels`` is ``[B]``) or a tuple of task names (``Batch.labels`` is
    ``[B, T]``, column ``t`` holding task ``label[t]``'s label).
    """

    dense_names: tuple[str, ...]
    sparse: tuple[SparseFeature, ...]
    label: str | tuple[str, ...] = "label"
    sequences: tuple[SequenceGroup, ...] = ()
    """The histories among ``sparse`` (:class:`SequenceGroup`); empty for data without sequences."""
    sampled_items: int = 0
    """The last ``sampled_items`` (``K``) rows of every *training* batch are sampled catalogue items (item features only,
    user features empty, labels 0), appended after the ``B`` real rows by ``data.negatives``: a two-tower model scores its
    ``B`` queries against ``B + K`` candidates. Eval batches carry none. 0: every row is a real row."""
    label_kinds: tuple[str, ...] = ()
    """Per label of :attr:`label_names`: the kind the data checks its values as (``binary``: 0 or 1, ``regression``: any
    finite number, ``multiclass``: a class index), so a task that trains on the label can be refused before the first
    step when its loss needs another (BCE on a ``regression`` label would train on targets like 12.5); empty: not
    declared (one ``[B]`` label)."""

    def __post_init__(self) -> None:
        names = self.sparse_names
        seen: dict[str, str] = {}
        for group in self.sequences:
            unknown = [f for f in group.features if f not in names]
            if unknown:
                raise ConfigError(f"data.sequences.{group.name} names {unknown}, which are not sparse features of the data "
                                  f"({', '.join(names)}). Fix: list each history column in data.sparse as well")
            for f in group.features:
                if f in seen:
                    raise ConfigError(f"sparse feature {f!r} is in sequence groups {seen[f]!r} and {group.name!r}; it belongs to one")
                seen[f] = group.name
            if group.timestamps is not None and group.timestamps in names:
                raise ConfigError(f"data.sequences.{group.name}.timestamps={group.timestamps!r} is a sparse feature; event times "
                                  f"are not embedded. Fix: remove it from data.sparse")
        if self.label_kinds and len(self.label_kinds) != len(self.label_names):
            raise ConfigError(f"FeatureSpec.label_kinds={self.label_kinds} must give one kind per label of {self.label_names}")
        if self.sampled_items < 0:
            raise ConfigError(f"FeatureSpec.sampled_items must be >= 0, got {self.sampled_items}")
        groups = [g.name for g in self.sequences]
        if len(set(groups)) != len(groups):
            raise ConfigError(f"sequence group names {groups} repeat; give each group its own name")

    @property
    def label_names(self) -> tuple[str, ...]:
        """The task names whose labels a batch carries, in column order (one for a ``[B]`` label)."""
        return (self.label,) if isinstance(self.label, str) else self.label

    @property
    def multi_label(self) -> bool:
        """Whether ``Batch.labels`` is ``[B, T]`` (one column per task) rather than ``[B]``."""
        return not isinstance(self.label, str)

    @property
    def num_dense(self) -> int:
        return len(self.dense_names)

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    @property
    def weighted(self) -> bool:
        """Some feature is weighted: then every batch's ``KeyedJaggedTensor`` carries ``weights`` (1.0 for the ids of the
        unweighted features, which pool exactly as without weights) and the models' pooled embedding collections are
        built with TorchRec's ``is_weighted=True``, so a weighted feature's bag pools to ``Σ w_i · e[id_i]``."""
        return any(f.weighted for f in self.sparse)

    @property
    def weighted_names(self) -> list[str]:
        """The weighted sparse features, in ``sparse`` order."""
        return [f.name for f in self.sparse if f.weighted]

    @property
    def kjt_keys(self) -> list[str]:
        """The keys of a batch's ``KeyedJaggedTensor``, in order: the sparse features, then each group's event times."""
        return [*self.sparse_names, *(g.timestamps for g in self.sequences if g.timestamps is not None)]

    @property
    def sequence_names(self) -> list[str]:
        """The sparse features that are histories (members of a :class:`SequenceGroup`), in group order."""
        return [f for g in self.sequences for f in g.features]

    def group(self, name: str | None = None, *, model: str = "this model") -> SequenceGroup:
        """The sequence group ``name`` (``None``: the only or first one).

        Raises:
            ConfigError: the data has no sequence group (naming ``model``, which needs one), or none called ``name``.
        """
        if not self.sequences:
            raise ConfigError(f"{model} attends over a user's history, but the data has no sequence group. Fix: data=synthetic_sequences, "
                              f"or declare the history columns in data.sequences (docs/sequences.md)")
        if name is None:
            return self.sequences[0]
        for g in self.sequences:
            if g.name == name:
                return g
        raise ConfigError(f"{model} reads sequence group {name!r}, which the data does not have; its groups: "
                          f"{[g.name for g in self.sequences]}. Fix: model.sequence_group=<one of them>")

    def candidate_of(self, sequence_feature: str) -> str | None:
        """The non-sequence feature that reads ``sequence_feature``'s table (the candidate it is compared with), or ``None``."""
        by_name = {f.name: f for f in self.sparse}
        table, histories = by_name[sequence_feature].table_name, set(self.sequence_names)
        return next((f.name for f in self.sparse if f.table_name == table and f.name not in histories), None)

    @property
    def sequence_table_names(self) -> set[str]:
        """The tables some sequence feature reads: these are embedded unpooled (``EmbeddingCollection``) by sequence models."""
        histories = set(self.sequence_names)
        return {f.table_name for f in self.sparse if f.name in histories}

    def sequence_tables(self, embedding_dim: int) -> list[EmbeddingConfig]:
        """The unpooled tables of :attr:`sequence_table_names` with every feature reading them (histories and their
        candidates), for an ``EmbeddingCollection``; one width per table, as for :meth:`embedding_tables`."""
        unpooled = self.sequence_table_names
        return [EmbeddingConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                                feature_names=list(t.feature_names))
                for t in self.embedding_tables(embedding_dim) if t.name in unpooled]

    def embedding_tables(self, embedding_dim: int, pooling: PoolingType | None = None,
                         skip_sequence_tables: bool = False) -> list[EmbeddingBagConfig]:
        """The embedding tables the sparse features read, in first-use order.

        Args:
            embedding_dim: width of every table whose features do not set their own.
            pooling: forces one pooling for every table (``None``: each feature's own ``pooling``).
            skip_sequence_tables: leave out the tables a sequence feature reads (a sequence model embeds them
                unpooled, :meth:`sequence_tables`).

        Raises:
            ConfigError: features sharing a table disagree on its size, width or pooling.
        """
        tables: dict[str, EmbeddingBagConfig] = {}
        for f in self.sparse:
            dim = f.embedding_dim or embedding_dim
            pool = pooling if pooling is not None else POOLINGS[f.pooling]
            existing = tables.get(f.table_name)
            if existing is None:
                tables[f.table_name] = EmbeddingBagConfig(
                    name=f.table_name, embedding_dim=dim, num_embeddings=f.num_embeddings, feature_names=[f.name], pooling=pool
                )
                continue
            first = existing.feature_names[0]
            if (existing.num_embeddings, existing.embedding_dim, existing.pooling) != (f.num_embeddings, dim, pool):
                raise ConfigError(
                    f"sparse features {first!r} and {f.name!r} share table {f.table_name!r} but differ in num_embeddings "
                    f"({existing.num_embeddings} vs {f.num_embeddings}), embedding_dim ({existing.embedding_dim} vs {dim}) "
                    f"or pooling ({existing.pooling.value} vs {pool.value}). Fix: give both the same values in data.sparse, "
                    f"or drop 'table' from one of them"
                )
            existing.feature_names.append(f.name)
        skip = self.sequence_table_names if skip_sequence_tables else set()
        return [t for t in tables.values() if t.name not in skip]

    def managed_tables(self) -> dict[str, ManagedCollision]:
        """Each managed-collision table's settings by table name (empty: every table reads ids as the data encoded them).

        Raises:
            ConfigError: features sharing a table disagree on its managed collision.
        """
        managed: dict[str, tuple[str, ManagedCollision | None]] = {}
        for f in self.sparse:
            first = managed.setdefault(f.table_name, (f.name, f.managed_collision))
            if first[1] != f.managed_collision:
                raise ConfigError(f"sparse features {first[0]!r} and {f.name!r} share table {f.table_name!r} but not its "
                                  f"managed_collision ({first[1]} vs {f.managed_collision}). Fix: give both the same settings")
        return {t: mc for t, (_, mc) in managed.items() if mc is not None}

    def embedding_dims(self, embedding_dim: int) -> list[int]:
        """Each sparse feature's width, in ``sparse`` order: its own ``embedding_dim``, else ``embedding_dim``."""
        return [f.embedding_dim or embedding_dim for f in self.sparse]

    def require_uniform_dim(self, embedding_dim: int, model: str, why: str = "its arches combine embeddings pairwise") -> None:
        """Raise :class:`ConfigError` unless every feature embeds to ``embedding_dim``.

        Called for models that state they need one width (``same_embedding_width``), e.g. interaction
        arches (FM, DLRM's dot products) that combine all embeddings pairwise; ``why`` is the model's reason.
        """
        mixed = {f.name: f.embedding_dim for f in self.sparse if f.embedding_dim not in (None, embedding_dim)}
        if mixed:
            raise ConfigError(
                f"{model} needs one embedding width for every feature (model.embedding_dim={embedding_dim}): {why}; but "
                f"data.sparse sets embedding_dim {mixed}. Fix: remove embedding_dim from those data.sparse entries, or "
                f"set it to {embedding_dim}, or choose a model that accepts mixed widths (docs/models.md)"
            )


@dataclass(frozen=True, slots=True)
class DataNeeds:
    """What a model asks of its data, declared by its config before anything is built.

    Generated data shapes itself to it, so the default ``data=synthetic`` serves every model; data
    read from files has fixed columns and the model checks them instead (a missing label is a
    :class:`ConfigError`).
    """

    labels: tuple[str, ...] = ()
    """One label per task, in this order (``Batch.labels [B, T]``); empty: one unnamed label ``[B]``."""
    label_kinds: tuple[str, ...] = ()
    """``binary``, ``regression`` or ``multiclass`` per label of ``labels``; empty: all binary."""
    label_classes: tuple[int, ...] = ()
    """Per label of ``labels``: a ``multiclass`` label's number of classes, 0 for the others; empty: none."""
    user_features: tuple[str, ...] = ()
    """A two-tower model's user (query) features: each row must be a (user, item) pair worth retrieving."""
    item_features: tuple[str, ...] = ()
    """The two-tower model's item (candidate) features."""
    sequences: bool = False
    """The model attends over a user's history: generated data (``data=synthetic``) then generates histories
    (``data=synthetic_sequences``'s defaults)."""
    next_item: bool = False
    """A next-item model: every row's candidate should be the item that truly came next (no sampled negatives)."""
    funnel: tuple[str, ...] = ()
    """Binary label tasks that form a funnel, in order: each later one positive only on rows where the one before it is
    (ESMM's click, then the conversion). Files then refuse (or skip, ``data.on_bad_rows``) a row that breaks it as they
    read it, naming the file, row and columns (``data.funnel``); generated data draws funnels."""
    task_label_columns: tuple[tuple[str, str], ...] = ()
    """``(task, column)`` for each task the model trains on a label column not named after it
    (``model.task_specs.<task>.label``): files must have that column; generated data draws the label and only names it so."""


