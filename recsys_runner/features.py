"""The feature schema shared by data and models.

Data modules describe *what* they produce (dense columns, sparse columns, their id spaces, how
each is pooled, which embedding table it reads); models derive their embedding tables from it, so
table sizes are written once, in the data config, and never repeated in the model config.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

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


@dataclass(frozen=True, slots=True)
class SparseFeature:
    """A categorical feature whose ids lie in ``[0, num_embeddings)``.

    ``embedding_dim=None`` takes the model's ``embedding_dim``; ``table=None`` gives the feature a
    table of its own (``t_<name>``); features naming the same ``table`` share its rows, and must then
    agree on ``num_embeddings``, ``embedding_dim`` and ``pooling``.
    """

    name: str
    num_embeddings: int
    embedding_dim: int | None = None
    pooling: str = "sum"
    table: str | None = None

    @property
    def table_name(self) -> str:
        return self.table or f"t_{self.name}"


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    """What one batch contains: ``num_dense`` float columns, the sparse features, the label(s).

    ``label`` is one name (``Batch.labels`` is ``[B]``) or a tuple of task names (``Batch.labels`` is
    ``[B, T]``, column ``t`` holding task ``label[t]``'s label).
    """

    dense_names: tuple[str, ...]
    sparse: tuple[SparseFeature, ...]
    label: str | tuple[str, ...] = "label"

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

    def embedding_tables(self, embedding_dim: int, pooling: PoolingType | None = None) -> list[EmbeddingBagConfig]:
        """The embedding tables the sparse features read, in first-use order.

        Args:
            embedding_dim: width of every table whose features do not set their own.
            pooling: forces one pooling for every table (``None``: each feature's own ``pooling``).

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
        return list(tables.values())

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
    """``binary`` or ``regression`` per label of ``labels``; empty: all binary."""
    user_features: tuple[str, ...] = ()
    """A two-tower model's user (query) features: each row must be a (user, item) pair worth retrieving."""
    item_features: tuple[str, ...] = ()
    """The two-tower model's item (candidate) features."""


