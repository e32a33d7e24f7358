"""Managed-collision settings of a sparse column, and the raw ids generated data gives such a column.

A managed-collision table does not hash ids into its rows: the data passes each raw id (an integer in
``[0, input_hash_size)``; a text value's stable 64-bit FNV-1a hash modulo ``input_hash_size``) and the model maps it
to a row ("slot") with one of TorchRec's managed-collision modules (``recsys_runner.models.collision``): ``mch``,
which admits the ids it sees most (or most recently) every ``eviction_interval`` steps, or ``hash_zch`` (CUDA only),
which admits an id at its first lookup and evicts ids unseen for ``ttl_steps``. The settings are declared here, once,
for files (``data.sparse[...].managed_collision``) and for generated data (``data.managed_collision``), and reach the
models as :class:`~recsys_runner.features.ManagedCollision` on the feature. :func:`resolve_collision_modules` decides
``module: auto`` from the run's device (config validation calls it).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import torch

from recsys_runner.errors import require
from recsys_runner.features import COLLISION_MODULES, EVICTION_POLICIES, HASH_ZCH_EVICTION_POLICIES, ManagedCollision

__all__ = ["MAX_INPUT_HASH_SIZE", "ManagedCollisionConfig", "SyntheticCollisionConfig", "collision_config", "managed_collision_configs",
           "resolve_collision_modules", "spread_ids"]

C = TypeVar("C", bound="ManagedCollisionConfig")

MAX_INPUT_HASH_SIZE = 2**63 - 1
"""The largest raw id space: every non-negative int64 (TorchRec's MCH default)."""

DEFAULT_EVICTION_INTERVAL = 100
"""``mch``'s ``eviction_interval`` when unset."""
DEFAULT_TTL_STEPS = 100
"""``hash_zch``'s ``ttl_steps`` when unset."""
DEFAULT_MAX_PROBE = 128
"""``hash_zch``'s ``max_probe`` when unset (TorchRec's default)."""

_MCH_ONLY = ("eviction_interval", "decay_exponent")
_HASH_ZCH_ONLY = ("ttl_steps", "max_probe")


@dataclass(kw_only=True)
class ManagedCollisionConfig:
    """A table whose raw ids are mapped to rows by one of TorchRec's managed-collision modules instead of hashing.

    The table's ``num_embeddings`` rows are its slots. With ``mch`` the last slot (of each row-wise shard, with several
    ranks) is the fallback that every id without a slot reads: an id first seen since the last eviction, or one seen
    only at evaluation or prediction. With ``hash_zch`` every slot holds an id; an id without one reads the slot its
    hash points at, which another id holds. Such lookups are counted (``mc/<table>/fallback_rate``), never an error.
    Settings of one module only (``eviction_interval``, ``decay_exponent``: ``mch``; ``ttl_steps``, ``max_probe``:
    ``hash_zch``) are refused with the other.
    """

    module: str = "auto"
    """``mch`` (TorchRec's ``MCHManagedCollisionModule``, CPU and GPU), ``hash_zch`` (``HashZchManagedCollisionModule``:
    multi-probe hashing in an fbgemm kernel, CUDA only: its CPU kernel cannot insert) or ``auto``: ``hash_zch`` when
    ``distributed.device`` is CUDA, ``mch`` on CPU (docs/performance.md: MCH's lookup costs a CPU step +96-113 %)."""
    input_hash_size: int = MAX_INPUT_HASH_SIZE
    """Raw id space ``[0, input_hash_size)``: an integer id outside it is a bad row, a text value is hashed into it.
    With several ranks the slots are sharded row-wise and each rank admits the ids of one block of this space, so
    ids should spread over it (text hashes do; small integer ids want a small ``input_hash_size``)."""
    eviction_policy: str | None = None
    """``mch``: ``lfu`` (evict the least frequently seen ids; the default), ``lru`` (the least recently seen) or
    ``distance_lfu`` (frequency divided by the time since the last access); TorchRec's MCH policies have no
    time-to-live, ``decay_exponent`` sets how fast an id's last access ages it. ``hash_zch``: ``lru`` (the default: a
    new id takes the least recently seen slot of its probe range whose id went unseen for over ``ttl_steps``) or ``ttl``
    (the first such slot it probes). ``null``: the module's default."""
    eviction_interval: int | None = None
    """``mch``: training steps between two admissions/evictions; ids first seen in between read the fallback slot until
    then. Each admission sorts the table's slots: every step, that costs several times a step (``python -m
    recsys_runner.bench.collision``), hence ``null`` = 100."""
    decay_exponent: float | None = None
    """``mch`` ``lru``/``distance_lfu``: the exponent of the steps since an id's last access in its score (``null``: 1.0)."""
    ttl_steps: int | None = None
    """``hash_zch``: training steps (lookups of training batches) an id keeps its slot without being seen before a new
    id may take it (``null``: 100; 0: any slot not seen this step). TorchRec counts it in hours of wall time; steps make a
    resumed run evict as the uninterrupted one."""
    max_probe: int | None = None
    """``hash_zch``: slots probed from an id's hash for the id or a free/expired slot (``null``: TorchRec's 128); more
    probes find more room in a full table, at a longer lookup of ids that hold no slot."""

    def check(self, key: str, slots: int | None) -> None:
        """Raise :class:`~recsys_runner.errors.ConfigError` naming ``key`` (where this config lives) for impossible settings;
        with ``module: auto`` the settings of one module only are checked once the device decides it
        (:meth:`resolve`)."""
        require(self.module in COLLISION_MODULES, f"{key}.module={self.module!r} must be one of {list(COLLISION_MODULES)}")
        policies = list(dict.fromkeys([*EVICTION_POLICIES, *HASH_ZCH_EVICTION_POLICIES]))
        require(self.eviction_policy is None or self.eviction_policy in policies,
                f"{key}.eviction_policy={self.eviction_policy!r} must be one of {policies} (mch: {list(EVICTION_POLICIES)}; "
                f"hash_zch: {list(HASH_ZCH_EVICTION_POLICIES)}) or null (the module's default)")
        require(self.eviction_interval is None or self.eviction_interval >= 1,
                f"{key}.eviction_interval={self.eviction_interval} must be at least 1 (training steps)")
        require(1 <= self.input_hash_size <= MAX_INPUT_HASH_SIZE,
                f"{key}.input_hash_size={self.input_hash_size} must lie in [1, 2**63 - 1]: raw ids are non-negative int64")
        require(self.decay_exponent is None or self.decay_exponent > 0, f"{key}.decay_exponent must be positive, got {self.decay_exponent}")
        require(self.decay_exponent is None or self.module == "hash_zch" or (self.eviction_policy or "lfu") != "lfu",
                f"{key}.decay_exponent is set but eviction_policy={self.eviction_policy or 'lfu'} scores by frequency alone. Fix: "
                f"eviction_policy=lru or distance_lfu, or decay_exponent=null")
        require(self.ttl_steps is None or self.ttl_steps >= 0, f"{key}.ttl_steps={self.ttl_steps} must be at least 0 (training steps)")
        require(self.max_probe is None or self.max_probe >= 1, f"{key}.max_probe={self.max_probe} must be at least 1")
        require(slots is None or slots >= 2,
                f"{key}: a managed-collision table needs at least 2 slots (num_embeddings={slots}): its last slot is the fallback "
                f"that ids without a slot read. Fix: raise num_embeddings")
        self._check_module(key, chosen_by=None)

    def resolve(self, key: str, device_type: str) -> None:
        """Decide ``module: auto`` for a run on ``device_type`` (``cuda``: ``hash_zch``, else ``mch``; the resolved config
        records the choice) and check the settings against the module.

        Raises:
            ConfigError: ``hash_zch`` off CUDA, or a setting the module does not have, naming the key and the fix.
        """
        chosen_by = None
        if self.module == "auto":
            self.module = "hash_zch" if device_type == "cuda" else "mch"
            chosen_by = f"{key}.module=auto picks {self.module} on {device_type}"
        require(self.module != "hash_zch" or device_type == "cuda",
                f"{key}.module=hash_zch needs distributed.device=cuda, but the run is on {device_type}: TorchRec's "
                f"HashZchManagedCollisionModule admits ids in a CUDA kernel, and its CPU kernel only reads (training fails "
                f"with 'Expected readonly to be true'). Fix: distributed.device=cuda, or {key}.module=mch (or auto, which "
                f"picks mch on CPU)")
        self._check_module(key, chosen_by)

    def _check_module(self, key: str, chosen_by: str | None) -> None:
        """The settings of the other module are refused, naming the field; nothing is checked while ``module`` is ``auto``."""
        if self.module == "auto":
            return
        other, own_policies = ("mch", HASH_ZCH_EVICTION_POLICIES) if self.module == "hash_zch" else ("hash_zch", EVICTION_POLICIES)
        why = chosen_by or f"{key}.module={self.module}"
        fix = "" if chosen_by is None else f", or {key}.module={other}"
        for name in _MCH_ONLY if self.module == "hash_zch" else _HASH_ZCH_ONLY:
            require(getattr(self, name) is None, f"{key}.{name} is a setting of module {other}, and {why}. Fix: drop "
                    f"{key}.{name} (null){fix}" + (f"; hash_zch's ids expire after {key}.ttl_steps instead" if name == "eviction_interval" else ""))
        policy = self.eviction_policy
        require(policy is None or policy in own_policies,
                f"{key}.eviction_policy={policy} is a policy of module {other}, and {why}, whose policies are "
                f"{list(own_policies)}. Fix: {key}.eviction_policy={own_policies[0]} (or null: {own_policies[0]}){fix}")

    def spec(self) -> ManagedCollision:
        """The settings the model builds its managed-collision module from (the unset ones at their defaults)."""
        return ManagedCollision(
            self.input_hash_size, self.eviction_policy,
            DEFAULT_EVICTION_INTERVAL if self.eviction_interval is None else self.eviction_interval,
            1.0 if self.decay_exponent is None else self.decay_exponent, self.module,
            DEFAULT_TTL_STEPS if self.ttl_steps is None else self.ttl_steps,
            DEFAULT_MAX_PROBE if self.max_probe is None else self.max_probe)


@dataclass(kw_only=True)
class SyntheticCollisionConfig(ManagedCollisionConfig):
    """``data.managed_collision`` of generated data: which ``cat_<i>`` columns are managed, and how many distinct raw
    ids each draws (more than its slots, so that ids keep arriving and are evicted)."""

    features: list[str] = field(default_factory=lambda: ["cat_0"])
    """The managed columns; their table has ``num_embeddings`` slots, the others are plain tables."""
    distinct_ids: int | None = None
    """Distinct raw ids a managed column draws from (with ``data.id_skew``), spread over ``[0, input_hash_size)``;
    ``null``: 10 times its ``num_embeddings``."""

    def check_features(self, names: list[str], sizes: list[int]) -> list[int]:
        """Check ``features`` against the data's columns ``names`` (sized ``sizes``); return each column's distinct ids."""
        key = "data.managed_collision"
        strangers = [n for n in self.features if n not in names]
        require(bool(self.features) and not strangers, f"{key}.features={self.features} must name sparse columns of the data "
                f"({names[0]} … {names[-1]}), e.g. {key}.features=[cat_0]")
        counts = []
        for name, size in zip(names, sizes, strict=True):
            if name in self.features:
                self.check(key, size)
            distinct = (self.distinct_ids or 10 * size) if name in self.features else size
            require(distinct <= self.input_hash_size, f"{key}.distinct_ids={distinct} exceeds input_hash_size={self.input_hash_size}: "
                    f"the generated raw ids must be distinct. Fix: raise {key}.input_hash_size or lower {key}.distinct_ids")
            counts.append(distinct)
        require(self.distinct_ids is None or self.distinct_ids > 0, f"{key}.distinct_ids must be positive, got {self.distinct_ids}")
        return counts


def collision_config(value: Any, cls: type[C], key: str) -> C | None:
    """``value`` (``null``, a mapping from YAML or the command line, or a config) as a ``cls``.

    Why a mapping: the option is typed ``Any`` in the data configs, because Hydra cannot merge an override such as
    ``data.managed_collision={features: [cat_0]}`` into a structured node that is ``null``.

    Raises:
        ConfigError: not a mapping, or a key ``cls`` does not have (naming ``key`` and the valid keys).
    """
    if value is None or isinstance(value, cls):
        return value
    require(isinstance(value, Mapping), f"{key} must be a mapping such as {{eviction_policy: lfu}} or null, got {value!r}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(value) - set(names))
    require(not unknown, f"{key} has unknown key(s) {unknown}; its keys: {', '.join(names)}")
    return cls(**value)


def spread_ids(ids: torch.Tensor, distinct: int, input_hash_size: int) -> torch.Tensor:
    """Generated ids ``[0, distinct)`` as distinct raw ids spread over ``[0, input_hash_size)`` (``distinct <= input_hash_size``):
    shuffled by a multiplication modulo ``distinct`` (popular ids are not neighbours), then spaced evenly.

    Why spread: with several ranks each row-wise shard of a managed table admits one block of the raw id space, so ids
    packed at its start would all land on the first rank's slots; real raw ids (hashes, 64-bit keys) are spread too.
    """
    multiplier = next(m for m in itertools.count(int(distinct * 0.618) | 1) if math.gcd(m, distinct) == 1)  # a bijection mod distinct
    return (ids * (multiplier % distinct)) % distinct * (input_hash_size // distinct)


def managed_collision_configs(data: Any) -> list[tuple[str, ManagedCollisionConfig]]:
    """Every managed-collision config of the data config ``data``, with its key: generated data's
    ``data.managed_collision``, file columns' ``data.sparse[<name>].managed_collision``."""
    found: list[tuple[str, ManagedCollisionConfig]] = []
    mc = getattr(data, "managed_collision", None)
    if isinstance(mc, ManagedCollisionConfig):
        found.append(("data.managed_collision", mc))
    for column in getattr(data, "sparse", None) or []:
        mc = getattr(column, "managed_collision", None)
        if isinstance(mc, ManagedCollisionConfig):
            found.append((f"data.sparse[{column.name}].managed_collision", mc))
    return found


def resolve_collision_modules(data: Any, device_type: str) -> None:
    """Decide ``module: auto`` of every managed-collision table of the data config ``data`` for a run on ``device_type``
    (``cuda`` or ``cpu``: ``distributed.device`` resolved) and check each against its module
    (:meth:`ManagedCollisionConfig.resolve`). Config validation calls it; a table it never saw (a column a schema file
    declares) is decided where the model is built: ``auto`` is then ``mch`` (``models/collision.py``).

    Raises:
        ConfigError: ``hash_zch`` off CUDA, or a setting its module does not have, naming the key and the fix.
    """
    for key, mc in managed_collision_configs(data):
        mc.resolve(key, device_type)
