"""The feature schema shared by data and models.

Data modules describe *what* they produce (dense columns, sparse columns and their id spaces);
models derive their embedding tables from it, so table sizes are written once, in the data
config, and never repeated in the model config.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType


@dataclass(frozen=True, slots=True)
class SparseFeature:
    """A categorical feature whose ids lie in ``[0, num_embeddings)``."""

    name: str
    num_embeddings: int


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    """What one batch contains: ``num_dense`` float columns, the sparse features, one label."""

    dense_names: tuple[str, ...]
    sparse: tuple[SparseFeature, ...]
    label: str = "label"

    @property
    def num_dense(self) -> int:
        return len(self.dense_names)

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    def embedding_tables(
        self, embedding_dim: int, pooling: PoolingType = PoolingType.SUM
    ) -> list[EmbeddingBagConfig]:
        """One table per sparse feature, ``t_<feature>``, all of width ``embedding_dim``."""
        return [
            EmbeddingBagConfig(
                name=f"t_{f.name}",
                embedding_dim=embedding_dim,
                num_embeddings=f.num_embeddings,
                feature_names=[f.name],
                pooling=pooling,
            )
            for f in self.sparse
        ]
