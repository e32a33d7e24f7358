"""Managed-collision tables: raw ids mapped to rows by TorchRec's MCH or HashZch module, with counters for the run's metrics.

A table whose feature carries :class:`~recsys_runner.features.ManagedCollision` is looked up through TorchRec's
``ManagedCollisionEmbeddingBagCollection``: a ``ManagedCollisionCollection`` of managed-collision modules remaps each
raw id to a slot, then an ordinary ``EmbeddingBagCollection`` embeds the slot. Two modules, by ``module``:

* :class:`CountedMCH` (TorchRec's ``MCHManagedCollisionModule``, ``mch``): every ``eviction_interval`` training steps
  the module admits the ids it saw since the last admission and evicts those its policy scores lowest; an id holding
  no slot reads the table's last slot (of each row-wise shard), the fallback, which TorchRec reserves and never evicts.
* :class:`CountedHashZch` (TorchRec's ``HashZchManagedCollisionModule``, ``hash_zch``; trains on CUDA only): an id
  takes a free slot among ``max_probe`` probed from its hash at its first lookup, or the slot of an id unseen for more
  than ``ttl_steps`` training steps (counted here in steps, :class:`_StepTtl`); when neither is in reach it reads the
  slot its hash points at, which another id holds (its "fallback": a hash collision). No slot is reserved.

Either way an evicted id's row and optimizer state are reset by the sharded module, and the mapping with the policy's
metadata are persistent buffers, so they are part of the model's state dict, sharded row-wise with the table, in
every checkpoint.

Tables without the option stay in a plain ``EmbeddingBagCollection``:
:func:`~recsys_runner.models.lookup.pooled_collections` splits them, :func:`~recsys_runner.models.lookup.pooled_lookup`
joins the two lookups. :func:`collision_counters` reads what the modules counted (summable over ranks) and
:func:`collision_rates` turns the summed counts into the logged ``mc/<table>/…`` metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.hash_mc_evictions import HashZchEvictionConfig, HashZchEvictionModule, HashZchEvictionPolicyName
from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHEvictionPolicy,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import JaggedTensor

from recsys_runner.errors import CheckpointError, ConfigError
from recsys_runner.features import ManagedCollision

__all__ = ["CountedHashZch", "CountedMCH", "HASH_ZCH_TRAINING_DEVICES", "collision_counters", "collision_rates",
           "managed_collision_module", "restore_collision_state"]

_EMPTY = torch.iinfo(torch.int64).max
"""The raw id TorchRec's MCH keeps in a slot no id holds (and in the fallback slot)."""


class CountedMCH(MCHManagedCollisionModule):
    """TorchRec's MCH module, counting what the run logs: lookups and fallback hits (training and evaluation apart)
    and the ids evicted from the mapping. The counts are never in a checkpoint (Python ints and non-persistent 0-d
    buffers), read and reset by :func:`collision_counters`; counting adds one fused op and no host sync to a lookup.

    Sharding rebuilds the module per row-wise shard through ``type(self)(...)``, so the shards count too.

    A mapping saved by more row-wise shards than now hold it (2 ranks' checkpoint evaluated or resumed on 1) keeps each
    saved shard's fallback: there, an id of shard ``j``'s block of the raw id space that held no slot read shard ``j``'s
    last slot, a row that shard trained. Loaded into one module, TorchRec's lookup would send every such id to the
    module's one last slot, and the checkpoint would score otherwise than where it was trained (measured: AUC 0.55668
    against 0.55736) without a word. :meth:`check_restored` records the saved shards' blocks and fallback slots, and
    :meth:`remap` sends an id without a slot to its block's fallback, as long as that slot holds no id (a resumed run's
    admission may give it one; from then on the block reads the module's own fallback, as ids first seen there do).
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
        self._saved_blocks: tuple[int, int, list[int]] | None = None
        """``(block size, first block, fallback slot of each block)`` of the saved shards this module holds, when it holds
        several (:meth:`check_restored`); ``None`` otherwise, which is every run that saves and loads on one layout."""
        self._block_fallbacks: torch.Tensor | None = None
        """Per saved block: its fallback slot while that slot holds no id, else this module's own fallback."""

    def remap(self, features: dict[str, JaggedTensor], *args: Any, **kwargs: Any) -> dict[str, JaggedTensor]:
        # passes on whatever this TorchRec's collection gives (1.8: mutate_miss_lengths, write_weights; 1.6: nothing)
        out = super().remap(features, *args, **kwargs)
        fallback = self._output_global_offset + self._zch_size - 1
        hits = self._fallbacks if self.training else self._eval_fallbacks
        for jagged in out.values():
            values = jagged.values()
            self._lookups[0 if self.training else 1] += values.numel()
            hits.add_(torch.count_nonzero(values == fallback))
        if self._block_fallbacks is not None:
            out = {name: self._to_block_fallbacks(features[name].values(), jagged, fallback) for name, jagged in out.items()}
        return out

    def _to_block_fallbacks(self, raw: torch.Tensor, jagged: JaggedTensor, fallback: int) -> JaggedTensor:
        """``jagged`` with each id that read ``fallback`` sent to the fallback of its raw id's saved block."""
        assert self._saved_blocks is not None and self._block_fallbacks is not None
        block, first, _ = self._saved_blocks
        index = (raw // block - first).clamp(0, self._block_fallbacks.numel() - 1)
        values = jagged.values()
        return JaggedTensor(values=torch.where(values == fallback, self._block_fallbacks[index], values),
                            lengths=jagged.lengths(), offsets=jagged.offsets(), weights=jagged.weights_or_none())

    def _refresh_block_fallbacks(self) -> None:
        """Point each saved block at its fallback slot while no id holds that slot, else at this module's own fallback."""
        if self._saved_blocks is None:
            return
        own = self._output_global_offset + self._zch_size - 1
        held = self._mch_remapped_ids_mapping[self._mch_sorted_raw_ids != _EMPTY]
        slots = torch.tensor(self._saved_blocks[2], dtype=torch.int64, device=self._mch_remapped_ids_mapping.device)
        self._block_fallbacks = torch.where(torch.isin(slots, held), torch.full_like(slots, own), slots)

    @torch.no_grad()
    def _update_and_evict(self, uniq_ids: torch.Tensor, uniq_ids_counts: torch.Tensor,
                          uniq_ids_metadata: dict[str, torch.Tensor]) -> None:
        held = self._mch_sorted_raw_ids[self._mch_sorted_raw_ids != _EMPTY]
        super()._update_and_evict(uniq_ids, uniq_ids_counts, uniq_ids_metadata)
        self._evictions.add_((~torch.isin(held, self._mch_sorted_raw_ids)).sum())
        self._refresh_block_fallbacks()

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
        inner = [s for s in saved if start <= s <= end]
        if len(inner) > 2:  # several saved shards in this one: keep their fallbacks (class docstring)
            block = -(-self._input_hash_size // (len(saved) - 1))  # TorchRec's row-wise input dist: a shard's block of raw ids
            self._saved_blocks = (block, saved.index(start), [s - 1 for s in inner[1:]])
            self._refresh_block_fallbacks()


HASH_ZCH_TRAINING_DEVICES = ("cuda",)
"""Devices whose fbgemm kernel lets :class:`CountedHashZch` insert ids (TorchRec's CPU kernel is read-only)."""

_EMPTY_SLOT = -1
"""The identity HashZch keeps in a slot no id holds, and the slot its kernel reports for a lookup that evicted nothing."""

_HASH_ZCH_POLICIES = {"lru": HashZchEvictionPolicyName.LRU_EVICTION, "ttl": HashZchEvictionPolicyName.SINGLE_TTL_EVICTION}


class _StepTtl(HashZchEvictionModule):
    """HashZch's eviction scores counted in training steps instead of hours of wall time.

    An id looked up at step ``s`` is stamped ``s + ttl_steps``; at step ``t`` the kernel may give a slot to a new id when
    its stamp is below ``t`` (``SINGLE_TTL_EVICTION``: the first such slot probed; ``LRU_EVICTION``: the lowest stamp,
    the least recently seen, of the probe range). TorchRec's own scorers stamp ``ttl + int(time.time() / 3600)``: a run of
    minutes would evict nothing, and a resumed run would evict otherwise than the uninterrupted one. Evaluation lookups
    get no stamp (TorchRec's CPU kernel refuses one). The TTL travels in ``config.single_ttl``, so that TorchRec's
    per-shard rebuild passes it on; :class:`CountedHashZch` sets :attr:`step`.
    """

    def __init__(self, policy_name: HashZchEvictionPolicyName, device: torch.device, config: HashZchEvictionConfig) -> None:
        super().__init__(policy_name=policy_name, device=device, config=config)
        self.ttl_steps = int(config.single_ttl or 0)
        self.step = 0
        """The training step being looked up (from 1: the kernel evicts only with a positive threshold)."""

    def forward(self, feature: JaggedTensor) -> tuple[torch.Tensor | None, int]:
        if not self.training:
            return None, -1
        stamps = torch.full((feature.values().numel(),), self.step + self.ttl_steps, dtype=torch.int32, device=self._device)
        return stamps, self.step


class CountedHashZch(HashZchManagedCollisionModule):
    """TorchRec's HashZch module with the counters and checks of :class:`CountedMCH`, evicting by training steps.

    * ``counters()``: slots holding an id; lookups and fallback lookups (an id that reads a slot another id holds: no
      free or expired slot in its probe range, or never admitted, at evaluation), training and evaluation apart; the
      slots whose id was evicted. What HashZch does not expose is not counted: how many distinct ids were refused a slot.
    * ``evict()`` hands the sharded module only the slots that were evicted: TorchRec's returns the kernel's ``-1``
      ("nothing evicted") as well, which the embedding module then resets at every training step as row ``-1``
      (fbgemm's reset: the row before the table in its weights buffer; the re-initialization: the table's last row).
    * the ids are a buffer, not TorchRec's int64 ``nn.Parameter``, which the runner's dense optimizers would take.
    * the lookup clock (:class:`_StepTtl`) counts training lookups and is saved with the mapping.
    * on CPU a training lookup raises :class:`~recsys_runner.errors.ConfigError` naming the fix (TorchRec's kernel fails
      with "Expected readonly to be true"); construction and evaluation lookups work there.

    Sharding rebuilds the module per row-wise shard through ``self.__class__(...)``, with TorchRec's keyword arguments of
    either TorchRec version (1.6: no ``read_only_suffix``, …), which pass through here unchanged.
    """

    _fallbacks: torch.Tensor
    _eval_fallbacks: torch.Tensor
    _eviction_module: HashZchEvictionModule | None
    _evicted_indices: list[torch.Tensor]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # TorchRec holds the ids in an int64 nn.Parameter (for its model publishing): the runner's dense optimizers, EMA
        # and clipping take every parameter DMP leaves them, so here they are the buffer they are (same state-dict key)
        identities = self._hash_zch_identities.data
        del self._hash_zch_identities
        self.register_buffer(self.IDENTITY_BUFFER, identities)
        for name in ("_fallbacks", "_eval_fallbacks"):
            self.register_buffer(name, torch.zeros((), dtype=torch.int64, device=self._device), persistent=False)
        self._lookups = [0, 0]
        """Lookups in training, in evaluation (their sizes are known without a sync)."""
        self._evicted = 0
        """Slots whose id was evicted since the last :meth:`counters` (known on the host once ``evict()`` ran)."""
        self._step = 0
        """Training lookups so far: the clock of :class:`_StepTtl`, saved as ``_current_iter_tensor`` (on the CPU and
        written only when the state dict is taken: no device work per lookup)."""
        # the name of MCH's clock: TorchRec's sharded collection keeps it one plain tensor, not a row-wise sharded one
        self.register_buffer("_current_iter_tensor", torch.zeros((1,), dtype=torch.int64))
        self.register_state_dict_pre_hook(_save_clock)
        self._install_clock()
        if self._device.type == "cuda":
            # TorchRec builds the rank-block tables on CPU and copies them to the device at every lookup: from pageable
            # memory, a copy that waits for the stream, twice per table and step
            self.input_mapper.to(self._device)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        # TorchRec's adds the ids to the buffers (a parameter there); here they are one already
        return nn.Module.named_buffers(self, prefix, recurse, remove_duplicate)

    def _install_clock(self) -> None:
        if self._eviction_module is not None and self._eviction_policy_name is not None and self._eviction_config is not None:
            self._eviction_module = _StepTtl(self._eviction_policy_name, self._device, self._eviction_config)

    def reset_training_mode(self) -> None:
        super().reset_training_mode()
        self._install_clock()

    @property
    def _offset(self) -> int:
        """This shard's first slot in the table."""
        return self._output_segments[self._start_bucket]

    def remap(self, features: dict[str, JaggedTensor], *args: Any, **kwargs: Any) -> dict[str, JaggedTensor]:
        # passes on whatever this TorchRec's collection gives (1.8: mutate_miss_lengths, write_weights; 1.6: mutate_miss_lengths)
        if self.training:
            if self.device.type not in HASH_ZCH_TRAINING_DEVICES:
                raise ConfigError(f"managed-collision table {self._name!r} uses module hash_zch, which trains on CUDA only "
                                  f"(TorchRec's CPU kernel cannot insert ids: 'Expected readonly to be true'), but the model is "
                                  f"on {self.device.type}. Fix: distributed.device=cuda, or managed_collision.module=mch "
                                  f"(or auto, which picks mch on CPU)")
            self._step += 1
            if isinstance(self._eviction_module, _StepTtl):
                self._eviction_module.step = self._step
        out = super().remap(features, *args, **kwargs)
        identities = self._hash_zch_identities.data.view(-1)
        hits = self._fallbacks if self.training else self._eval_fallbacks
        for name, jagged in out.items():
            raw = features[name].values()
            slots = jagged.values() - self._offset if self._offset else jagged.values()
            self._lookups[0 if self.training else 1] += raw.numel()
            hits.add_(torch.count_nonzero(identities[slots] != raw))
        return out

    def evict(self) -> torch.Tensor | None:
        if not self._evicted_indices:
            return None
        marked = torch.cat([*self._evicted_indices, torch.full((1,), _EMPTY_SLOT, dtype=torch.int64, device=self.device)])
        self._evicted_indices = []
        slots = torch.unique(marked)[1:]  # sorted, and -1 is in it: the slots evicted (one sync, as TorchRec's unique)
        self._evicted += slots.numel()
        if not slots.numel():
            return None
        return slots + self._offset if self._offset else slots

    def counters(self) -> dict[str, int]:
        """Slots holding an id now, and the counts since the last call (which resets them)."""
        counts = {"slots_used": int((self._hash_zch_identities != _EMPTY_SLOT).sum()), "evictions": self._evicted,
                  "lookups": self._lookups[0], "fallback_lookups": int(self._fallbacks),
                  "eval_lookups": self._lookups[1], "eval_fallback_lookups": int(self._eval_fallbacks)}
        for buffer in (self._fallbacks, self._eval_fallbacks):
            buffer.zero_()
        self._lookups, self._evicted = [0, 0], 0
        return counts

    def check_restored(self, table: str) -> None:
        """After a checkpoint was loaded into the buffers: refuse a mapping laid out for another number of ranks or another
        id space, and set the lookup clock to the checkpoint's.

        Raises:
            CheckpointError: the checkpoint's mapping was saved by another number of ranks (HashZch places an id by its
                rank's block of the id space: the slots it probes differ), or holds ids outside this config's id space.
        """
        saved = int(self.get_buffer(self.BUCKET_BUFFER).view(-1)[0])
        if saved != self._buckets:
            raise CheckpointError(f"the checkpoint's managed-collision table {table!r} (module hash_zch) was saved by {saved} "
                                  f"rank(s), and this run has {self._buckets}: HashZch places an id within its rank's block of "
                                  f"the id space, so the mapping does not carry over to another number of ranks. Fix: resume "
                                  f"on {saved} rank(s)")
        identities = self._hash_zch_identities.data.view(-1)
        ids = identities[identities != _EMPTY_SLOT]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self._input_hash_size):
            raise CheckpointError(f"the checkpoint's managed-collision table {table!r} maps raw ids up to {int(ids.max())}, "
                                  f"outside this config's input_hash_size={self._input_hash_size}: its id space changed. Fix: "
                                  f"resume with the training run's managed_collision.input_hash_size")
        block = -(-self._input_hash_size // self._buckets)  # TorchRec's TrainInputMapper: a rank's block of raw ids
        if ids.numel() and self._buckets > 1 and bool(((ids // block < self._start_bucket) | (ids // block >= self._end_bucket)).any()):
            raise CheckpointError(f"the checkpoint's managed-collision table {table!r} holds raw ids of other ranks' blocks: its "
                                  f"input_hash_size changed. Fix: resume with the training run's managed_collision.input_hash_size")
        self._step = int(self.get_buffer("_current_iter_tensor")[0])


def _save_clock(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """A state-dict pre-hook of :class:`CountedHashZch`: its lookup clock into its buffer."""
    assert isinstance(module, CountedHashZch)
    module.get_buffer("_current_iter_tensor").fill_(module._step)


def _policy(mc: ManagedCollision) -> MCHEvictionPolicy:
    if mc.policy == "lru":
        return LRU_EvictionPolicy(decay_exponent=mc.decay_exponent)
    if mc.policy == "distance_lfu":
        return DistanceLFU_EvictionPolicy(decay_exponent=mc.decay_exponent)
    return LFU_EvictionPolicy()


def managed_collision_module(table: EmbeddingBagConfig, mc: ManagedCollision, device: torch.device) -> CountedMCH | CountedHashZch:
    """The managed-collision module of ``table``: its ``num_embeddings`` rows are the slots, ids come raw in
    ``[0, input_hash_size)``. ``mc.module`` picks it; ``auto`` (where config validation did not decide it) follows
    ``device``: :class:`CountedHashZch` on CUDA, :class:`CountedMCH` on CPU and on ``meta`` (a model built for sharding
    from settings no config validation saw, e.g. a schema file's column: ``mch`` runs on either device).

    Its buckets (the blocks of the raw id space the row-wise shards split) are the process group's ranks: TorchRec's
    planner shards a table only over a multiple of its buckets, and the model is built after the group exists.

    Raises:
        ConfigError: a ``hash_zch`` table whose slots the ranks cannot split evenly (HashZch's buckets are equal).
    """
    buckets = dist.get_world_size() if dist.is_initialized() else 1
    mc = mc.on(device.type)
    if mc.module == "hash_zch":
        if table.num_embeddings % buckets:
            raise ConfigError(f"managed-collision table {table.name!r} (module hash_zch) has {table.num_embeddings} slots, which "
                              f"{buckets} ranks cannot split evenly: HashZch gives each rank's block of the id space an equal "
                              f"share. Fix: a num_embeddings that is a multiple of {buckets}")
        ttl = HashZchEvictionConfig(features=list(table.feature_names), single_ttl=mc.ttl_steps)
        return CountedHashZch(zch_size=table.num_embeddings, device=device, total_num_buckets=buckets, max_probe=mc.max_probe,
                              input_hash_size=mc.input_hash_size, name=table.name, eviction_policy_name=_HASH_ZCH_POLICIES[mc.policy],
                              eviction_config=ttl)
    return CountedMCH(zch_size=table.num_embeddings, device=device, eviction_policy=_policy(mc), buckets=buckets,
                      eviction_interval=mc.eviction_interval, input_hash_size=mc.input_hash_size, name=table.name)


def _tables(model: nn.Module) -> list[tuple[str, CountedMCH | CountedHashZch]]:
    return [(m._name or name, m) for name, m in model.named_modules() if isinstance(m, CountedMCH | CountedHashZch)]


def collision_counters(model: nn.Module) -> dict[str, float]:
    """This rank's counts of every managed table (``mc/<table>/<count>``, since the last call), summable over ranks
    (each rank holds other slots of a row-wise sharded table); empty for a model without managed tables."""
    return {f"mc/{table}/{k}": float(v) for table, m in _tables(model) for k, v in m.counters().items()}


@contextlib.contextmanager
def eval_counts_kept(model: nn.Module) -> Iterator[None]:
    """Within the block, evaluation lookups leave every managed table's eval counters (``eval_lookups``,
    ``eval_fallback_lookups``) as they were: the train loop's sanity eval reads eval batches whose lookups must not
    reach the first logged ``mc/<table>/eval_fallback_rate``. An eval changes no mapping, so the counts are all it
    leaves behind."""
    tables = _tables(model)
    saved = [(m._lookups[1], m._eval_fallbacks.clone()) for _, m in tables]
    try:
        yield
    finally:
        for (_, m), (lookups, fallbacks) in zip(tables, saved, strict=True):
            m._lookups[1] = lookups
            m._eval_fallbacks.copy_(fallbacks)


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
