"""Managed-collision tables: raw ids mapped to rows by TorchRec's MCH module, with counters for the run's metrics.

A table whose feature carries :class:`~recsys_runner.features.ManagedCollision` is looked up through TorchRec's
``ManagedCollisionEmbeddingBagCollection``: a ``ManagedCollisionCollection`` of :class:`CountedMCH` (TorchRec's
``MCHManagedCollisionModule``) remaps each raw id to a slot, then an ordinary ``EmbeddingBagCollection`` embeds the
slot. Every ``eviction_interval`` training steps the module admits the ids it saw since the last admission and evicts
those its policy scores lowest (their rows, and their optimizer state, are reset by the sharded module); an id
holding no slot reads the table's last slot (of each row-wise shard), the fallback, which TorchRec reserves and never
evicts. The mapping and the policy's metadata are persistent buffers, so they are part of the model's state dict,
sharded row-wise with the table, in every checkpoint.

Tables without the option stay in a plain ``EmbeddingBagCollection``: :func:`pooled_collections` splits them,
:func:`pooled_lookup` joins the two lookups. :func:`collision_counters` reads what :class:`CountedMCH` counted (summable
over ranks) and :func:`collision_rates` turns the summed counts into the logged ``mc/<table>/…`` metrics.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHEvictionPolicy,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from recsys_runner.errors import CheckpointError
from recsys_runner.features import FeatureSpec, ManagedCollision

__all__ = ["CountedMCH", "collision_counters", "collision_rates", "managed_collision_module", "pooled_collections",
           "pooled_lookup", "managed_feature_names", "restore_collision_state"]

_EMPTY = torch.iinfo(torch.int64).max
"""The raw id TorchRec's MCH keeps in a slot no id holds (and in the fallback slot)."""


class CountedMCH(MCHManagedCollisionModule):
    """TorchRec's MCH module, counting what the run logs: lookups and fallback hits (training and evaluation apart)
    and the ids evicted from the mapping. The counts are never in a checkpoint (Python ints and non-persistent 0-d
    buffers), read and reset by :func:`collision_counters`; counting adds one fused op and no host sync to a lookup.

    Sharding rebuilds the module per row-wise shard through ``type(self)(...)``, so the shards count too.
    """

    _fallbacks: torch.Tensor
    _eval_fallbacks: torch.Tensor
    _evictions: torch.Tensor

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in ("_fallbacks", "_eval_fallbacks", "_evictions"):
            self.register_buffer(name, torch.zeros((), dtype=torch.int64, device=self.device), persistent=False)
        self._lookups = [0, 0]
        """Lookups in training, in evaluation (their sizes are known without a sync)."""

    def remap(self, features: dict[str, JaggedTensor], *args: Any, **kwargs: Any) -> dict[str, JaggedTensor]:
        # passes on whatever this TorchRec's collection gives (1.8: mutate_miss_lengths, write_weights; 1.6: nothing)
        out = super().remap(features, *args, **kwargs)
        fallback = self._output_global_offset + self._zch_size - 1
        hits = self._fallbacks if self.training else self._eval_fallbacks
        for jagged in out.values():
            values = jagged.values()
            self._lookups[0 if self.training else 1] += values.numel()
            hits.add_(torch.count_nonzero(values == fallback))
        return out

    @torch.no_grad()
    def _update_and_evict(self, uniq_ids: torch.Tensor, uniq_ids_counts: torch.Tensor,
                          uniq_ids_metadata: dict[str, torch.Tensor]) -> None:
        held = self._mch_sorted_raw_ids[self._mch_sorted_raw_ids != _EMPTY]
        super()._update_and_evict(uniq_ids, uniq_ids_counts, uniq_ids_metadata)
        self._evictions.add_((~torch.isin(held, self._mch_sorted_raw_ids)).sum())

    def counters(self) -> dict[str, int]:
        """Slots holding an id now, and the counts since the last call (which resets them)."""
        counts = {"slots_used": int((self._mch_sorted_raw_ids != _EMPTY).sum()), "evictions": int(self._evictions),
                  "lookups": self._lookups[0], "fallback_lookups": int(self._fallbacks),
                  "eval_lookups": self._lookups[1], "eval_fallback_lookups": int(self._eval_fallbacks)}
        for buffer in (self._fallbacks, self._eval_fallbacks, self._evictions):
            buffer.zero_()
        self._lookups = [0, 0]
        return counts

    def check_restored(self, table: str) -> None:
        """After a checkpoint was loaded into the buffers: refuse a mapping of another id space, then re-sort it
        (a mapping saved by several row-wise shards and loaded into fewer is their sorted blocks end to end).

        Raises:
            CheckpointError: the checkpoint's mapping holds raw ids outside this config's ``input_hash_size``, or was
                saved with other slots.
        """
        saved = [int(s) for s in self._output_segments_tensor.tolist() if s >= 0]
        start, end = self._output_global_offset, self._output_global_offset + self._zch_size
        if start not in saved or end not in saved:
            raise CheckpointError(f"the checkpoint's managed-collision table {table!r} has slots {saved[0]}..{saved[-1]}, where "
                                  f"this config's shard holds {start}..{end}: its num_embeddings changed. Fix: resume with the "
                                  f"training run's data.*num_embeddings")
        slots = self._mch_remapped_ids_mapping
        if bool(((slots < start) | (slots >= end)).any()):
            raise CheckpointError(f"the checkpoint's managed-collision table {table!r} was saved by fewer ranks than load it: its "
                                  f"mapping cannot be split over more row-wise shards (TorchRec's MCH). Fix: resume on as many "
                                  f"ranks as wrote it, or fewer")
        ids = self._mch_sorted_raw_ids[self._mch_sorted_raw_ids != _EMPTY]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self._input_hash_size):
            raise CheckpointError(f"the checkpoint's managed-collision table {table!r} maps raw ids up to {int(ids.max())}, "
                                  f"outside this config's input_hash_size={self._input_hash_size}: its id space changed. Fix: "
                                  f"resume with the training run's managed_collision.input_hash_size")
        self.validate_state()


def _policy(mc: ManagedCollision) -> MCHEvictionPolicy:
    if mc.eviction_policy == "lru":
        return LRU_EvictionPolicy(decay_exponent=mc.decay_exponent)
    if mc.eviction_policy == "distance_lfu":
        return DistanceLFU_EvictionPolicy(decay_exponent=mc.decay_exponent)
    return LFU_EvictionPolicy()


def managed_collision_module(table: EmbeddingBagConfig, mc: ManagedCollision, device: torch.device) -> CountedMCH:
    """The MCH module of ``table``: its ``num_embeddings`` rows are the slots, ids come raw in ``[0, input_hash_size)``.

    Its buckets (the blocks of the raw id space the row-wise shards split) are the process group's ranks: TorchRec's
    planner shards a table only over a multiple of its buckets, and the model is built after the group exists.
    """
    buckets = dist.get_world_size() if dist.is_initialized() else 1
    return CountedMCH(zch_size=table.num_embeddings, device=device, eviction_policy=_policy(mc), buckets=buckets,
                      eviction_interval=mc.eviction_interval, input_hash_size=mc.input_hash_size, name=table.name)


def pooled_collections(tables: list[EmbeddingBagConfig], managed: dict[str, ManagedCollision]
                       ) -> tuple[EmbeddingBagCollection | None, ManagedCollisionEmbeddingBagCollection | None]:
    """The plain tables in an ``EmbeddingBagCollection`` and the managed ones (``managed``, by table name) in a
    ``ManagedCollisionEmbeddingBagCollection``; either is ``None`` without tables. Created on ``meta`` like every
    table: DistributedModelParallel materializes (and, for the managed ones, rebuilds per shard) what each rank owns."""
    meta = torch.device("meta")
    plain = [t for t in tables if t.name not in managed]
    ours = [t for t in tables if t.name in managed]
    ebc = EmbeddingBagCollection(tables=plain, device=meta) if plain else None
    if not ours:
        return ebc, None
    modules: dict[str, Any] = {t.name: managed_collision_module(t, managed[t.name], meta) for t in ours}
    collection = ManagedCollisionCollection(modules, ours)
    return ebc, ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=ours, device=meta), collection)


def pooled_lookup(ebc: nn.Module | None, mc_ebc: nn.Module | None, sparse: KeyedJaggedTensor, names: Sequence[str],
                  managed: Collection[str]) -> dict[str, torch.Tensor]:
    """Each feature ``names``' pooled embedding ``[B, D_f]`` by name: from the managed collection for the features in
    ``managed``, from the plain one for the others.

    Written so that ``torch.fx`` can trace it (TorchRec's ``TrainPipelineSparseDist`` does, to find the lookups it
    pipelines): the collections' outputs are indexed by the known names, never iterated or merged as dicts, which a
    traced ``KeyedTensor`` cannot be (``tests/test_pipelines.py``)."""
    plain = ebc(sparse) if ebc is not None else None
    mapped = mc_ebc(sparse)[0] if mc_ebc is not None else None  # (pooled KeyedTensor, remapped ids)
    pooled: dict[str, torch.Tensor] = {}
    for name in names:
        source = mapped if name in managed else plain
        assert source is not None, f"feature {name!r} is in neither embedding collection"
        pooled[name] = source[name]
    return pooled


def managed_feature_names(features: FeatureSpec) -> frozenset[str]:
    """The sparse features whose table maps its raw ids through a managed-collision module (:func:`pooled_lookup`'s
    ``managed``)."""
    tables = features.managed_tables()
    return frozenset(f.name for f in features.sparse if f.table_name in tables)


def _tables(model: nn.Module) -> list[tuple[str, CountedMCH]]:
    return [(m._name or name, m) for name, m in model.named_modules() if isinstance(m, CountedMCH)]


def collision_counters(model: nn.Module) -> dict[str, float]:
    """This rank's counts of every managed table (``mc/<table>/<count>``, since the last call), summable over ranks
    (each rank holds other slots of a row-wise sharded table); empty for a model without managed tables."""
    return {f"mc/{table}/{k}": float(v) for table, m in _tables(model) for k, v in m.counters().items()}


def collision_rates(counters: dict[str, float]) -> dict[str, float]:
    """``counters`` (summed over ranks) as logged: each table's slots used, evictions and fallback lookups, and its
    fallback rates in place of the lookup counts: the share of lookups since the last log that read the fallback slot,
    in training (``fallback_rate``) and evaluation (``eval_fallback_rate``, when an evaluation ran since)."""
    out = {k: v for k, v in counters.items() if not (k.startswith("mc/") and k.endswith("lookups") and "fallback" not in k)}
    for key in [k for k in counters if k.startswith("mc/") and k.endswith("/lookups")]:
        table = key.removesuffix("/lookups")
        for prefix in ("", "eval_"):
            lookups = counters.get(f"{table}/{prefix}lookups", 0.0)
            if lookups:
                out[f"{table}/{prefix}fallback_rate"] = counters[f"{table}/{prefix}fallback_lookups"] / lookups
    return out


def restore_collision_state(model: nn.Module) -> None:
    """Check and re-sort every managed table's mapping after a checkpoint was loaded into ``model`` in place (DCP loads
    tensors, not through ``load_state_dict``, so TorchRec's own post-load hook does not run)."""
    for table, module in _tables(model):
        module.check_restored(table)
