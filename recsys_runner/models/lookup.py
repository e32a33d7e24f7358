"""A model's pooled embedding lookup: plain tables in an ``EmbeddingBagCollection``, managed ones through TorchRec's managed collection.

:func:`pooled_collections` splits a model's tables into the two collections (the managed ones, by
:meth:`~recsys_runner.features.FeatureSpec.managed_tables`, get their module from
:func:`~recsys_runner.models.collision.managed_collision_module`), :func:`pooled_lookup` joins the two lookups by feature
name, :func:`concatenated_lookup` lays them side by side (taking a fused collection's values whole), and
:func:`managed_feature_names` says which features read the managed one.

A room of its own beside :mod:`recsys_runner.models.collision`: every model that pools embeddings reads through it, with
managed tables or none, and it carries what the lookup itself must honour (weighted bags, a batch without weights named
as the user's mistake, the served program's fused bags, a body ``torch.fx`` can trace); the managed-collision modules and
the run's counters over them are that module's, and this one imports it, never the reverse.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import ManagedCollisionCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec, ManagedCollision
from recsys_runner.models.collision import managed_collision_module

__all__ = ["concatenated_lookup", "managed_feature_names", "pooled_collections", "pooled_lookup"]


def pooled_collections(tables: list[EmbeddingBagConfig], managed: dict[str, ManagedCollision], weighted: bool = False
                       ) -> tuple[EmbeddingBagCollection | None, ManagedCollisionEmbeddingBagCollection | None]:
    """The plain tables in an ``EmbeddingBagCollection`` and the managed ones (``managed``, by table name) in a
    ``ManagedCollisionEmbeddingBagCollection``; either is ``None`` without tables. Created on ``meta`` like every
    table: DistributedModelParallel materializes (and, for the managed ones, rebuilds per shard) what each rank owns.

    ``weighted`` (:attr:`FeatureSpec.weighted`): the plain collection pools each bag by the batch's weights
    (``is_weighted=True``); the features without weights carry 1.0 per id, which pools exactly as without weights."""
    meta = torch.device("meta")
    plain = [t for t in tables if t.name not in managed]
    ours = [t for t in tables if t.name in managed]
    ebc = EmbeddingBagCollection(tables=plain, device=meta, is_weighted=weighted) if plain else None
    if not ours:
        return ebc, None
    modules: dict[str, Any] = {t.name: managed_collision_module(t, managed[t.name], meta) for t in ours}
    collection = ManagedCollisionCollection(modules, ours)
    return ebc, ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=ours, device=meta), collection)


def pooled_lookup(ebc: nn.Module | None, mc_ebc: nn.Module | None, sparse: KeyedJaggedTensor, names: Sequence[str],
                  managed: Collection[str], weighted: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """Each feature ``names``' pooled embedding ``[B, D_f]`` by name: from the managed collection for the features in
    ``managed``, from the plain one for the others.

    Written so that ``torch.fx`` can trace it (TorchRec's ``TrainPipelineSparseDist`` does, to find the lookups it
    pipelines): the collections' outputs are indexed by the known names, never iterated or merged as dicts, which a
    traced ``KeyedTensor`` cannot be (``tests/test_pipelines.py``).

    Raises:
        ConfigError: ``weighted`` (the weighted features, whose collection pools by weights) is not empty but ``sparse``
            carries no weights: a batch built without them names the problem instead of a stack trace."""
    _check_weights(weighted, sparse)
    plain = ebc(sparse) if ebc is not None else None
    mapped = mc_ebc(sparse)[0] if mc_ebc is not None else None  # (pooled KeyedTensor, remapped ids)
    pooled: dict[str, torch.Tensor] = {}
    for name in names:
        source = mapped if name in managed else plain
        assert source is not None, f"feature {name!r} is in neither embedding collection"
        pooled[name] = source[name]
    return pooled


def concatenated_lookup(ebc: nn.Module | None, mc_ebc: nn.Module | None, sparse: KeyedJaggedTensor, names: Sequence[str],
                        managed: Collection[str], weighted: Sequence[str] = ()) -> torch.Tensor:
    """The features ``names``' pooled embeddings side by side, ``[B, ΣD_f]`` (:func:`pooled_lookup`'s, concatenated).

    A plain collection whose output holds exactly ``names`` in this order (it says so by an ``embedding_names`` list:
    the served program's fused bags, :mod:`recsys_runner.serving.fused`) gives its values as they are: the same tensor,
    without a slice per feature and a concatenation, which a 1-row request pays for op by op. TorchRec's collections,
    sharded or not, name no ``embedding_names`` and take the per-feature path, as the pipeline's tracing needs."""
    if mc_ebc is None and ebc is not None and getattr(ebc, "embedding_names", None) == list(names):
        _check_weights(weighted, sparse)
        return ebc(sparse).values()
    pooled = pooled_lookup(ebc, mc_ebc, sparse, names, managed, weighted)
    return torch.cat([pooled[name] for name in names], dim=1)


def _check_weights(weighted: Sequence[str], sparse: KeyedJaggedTensor) -> None:
    """Raise :class:`ConfigError` when ``weighted`` features are read from a batch without weights."""
    if weighted and sparse.weights_or_none() is None:  # a traced (fx) batch's weights are a proxy, never None
        raise ConfigError(f"the features {list(weighted)} are weighted (data.sparse weighted / weights), but this batch carries no "
                          f"weights: the data must encode them (data.sparse weighted / weights), as training did. Fix: give the "
                          f"model batches of the data it was trained with")


def managed_feature_names(features: FeatureSpec) -> frozenset[str]:
    """The sparse features whose table maps its raw ids through a managed-collision module (:func:`pooled_lookup`'s
    ``managed``)."""
    tables = features.managed_tables()
    return frozenset(f.name for f in features.sparse if f.table_name in tables)
