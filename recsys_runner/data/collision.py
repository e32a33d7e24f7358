"""Managed-collision settings of a sparse column, and the raw ids generated data gives such a column.

A managed-collision table does not hash ids into its rows: the data passes each raw id (an integer in
``[0, input_hash_size)``; a text value's stable 64-bit FNV-1a hash modulo ``input_hash_size``) and the model maps it
to a row ("slot") with TorchRec's managed-collision module (``recsys_runner.models.collision``), which admits the
ids it sees most (or most recently) and evicts the others. The settings are declared here, once, for files
(``data.sparse[...].managed_collision``) and for generated data (``data.managed_collision``), and reach the models
as :class:`~recsys_runner.features.ManagedCollision` on the feature.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import torch

from recsys_runner.errors import require
from recsys_runner.features import EVICTION_POLICIES, ManagedCollision

__all__ = ["MAX_INPUT_HASH_SIZE", "ManagedCollisionConfig", "SyntheticCollisionConfig", "collision_config", "spread_ids"]

C = TypeVar("C", bound="ManagedCollisionConfig")

MAX_INPUT_HASH_SIZE = 2**63 - 1
"""The largest raw id space: every non-negative int64 (TorchRec's MCH default)."""

@dataclass(kw_only=True)
class ManagedCollisionConfig:
    """A table whose raw ids are mapped to rows by TorchRec's managed-collision (MCH) module instead of hashing.

    The table's ``num_embeddings`` rows are its slots; the last slot (of each row-wise shard, with several ranks) is
    the fallback that every id without a slot reads: an id first seen since the last eviction, or one seen only at
    evaluation or prediction. Such lookups are counted (``mc/<table>/fallback_rate``), never an error.
    """

    input_hash_size: int = MAX_INPUT_HASH_SIZE
    """Raw id space ``[0, input_hash_size)``: an integer id outside it is a bad row, a text value is hashed into it.
    With several ranks the slots are sharded row-wise and each rank admits the ids of one block of this space, so
    ids should spread over it (text hashes do; small integer ids want a small ``input_hash_size``)."""
    eviction_policy: str = "lfu"
    """``lfu`` (evict the least frequently seen ids), ``lru`` (the least recently seen) or ``distance_lfu`` (frequency
    divided by the time since the last access). TorchRec's MCH policies have no time-to-live; ``decay_exponent``
    sets how fast an id's last access ages it."""
    eviction_interval: int = 100
    """Training steps between two admissions/evictions; ids first seen in between read the fallback slot until then.
    Each admission sorts the table's slots: every step, that costs several times a step (``python -m
    recsys_runner.bench.collision``), hence 100."""
    decay_exponent: float | None = None
    """``lru``/``distance_lfu``: the exponent of the steps since an id's last access in its score (``null``: 1.0)."""

    def check(self, key: str, slots: int | None) -> None:
        """Raise :class:`~recsys_runner.errors.ConfigError` naming ``key`` (where this config lives) for impossible settings."""
        require(self.eviction_policy in EVICTION_POLICIES,
                f"{key}.eviction_policy={self.eviction_policy!r} must be one of {list(EVICTION_POLICIES)}")
        require(self.eviction_interval >= 1, f"{key}.eviction_interval={self.eviction_interval} must be at least 1 (training steps)")
        require(1 <= self.input_hash_size <= MAX_INPUT_HASH_SIZE,
                f"{key}.input_hash_size={self.input_hash_size} must lie in [1, 2**63 - 1]: raw ids are non-negative int64")
        require(self.decay_exponent is None or self.eviction_policy != "lfu",
                f"{key}.decay_exponent is set but eviction_policy=lfu scores by frequency alone. Fix: eviction_policy=lru or "
                f"distance_lfu, or decay_exponent=null")
        require(self.decay_exponent is None or self.decay_exponent > 0, f"{key}.decay_exponent must be positive, got {self.decay_exponent}")
        require(slots is None or slots >= 2,
                f"{key}: a managed-collision table needs at least 2 slots (num_embeddings={slots}): its last slot is the fallback "
                f"that ids without a slot read. Fix: raise num_embeddings")

    def spec(self) -> ManagedCollision:
        """The settings the model builds its managed-collision module from."""
        return ManagedCollision(self.input_hash_size, self.eviction_policy, self.eviction_interval,
                                1.0 if self.decay_exponent is None else self.decay_exponent)


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
