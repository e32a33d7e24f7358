"""A model's embedding-bag collections fused for serving: one ``embedding_bag`` over a concatenated table per group of
tables of one width, pooling and dtype, where TorchRec's eager ``EmbeddingBagCollection`` runs one per feature.

Why: an exported ``EmbeddingBagCollection`` is, for each feature, a split of the ids by the lengths' sums (an
``.item()`` each), a ``narrow`` of the ids and of the offsets, an ``embedding_bag`` and a cast. DeepFM on the Criteo
shape (26 features, each read by a deep and a first-order table) spends ~330 of its served program's 424 nodes there,
and a 1-row request pays for every node (the program's ops run one by one). With each feature's ids shifted by its
table's first row in a concatenated table, a group is one lookup, as fbgemm's table-batched embedding is on the
training side; fbgemm's own inference kernels are not used because the served model loads with torch alone
(docs/export.md). Sums and means pool the same ids in the same order as the per-table kernel, so the scores are the
same (``tests/test_fused_serving.py`` compares every pointwise model's).

Only what serving needs: no gradients, no variable batch per feature (``inverse_indices``); the tables' rows gathered
at :func:`for_serving` time, the model's float32 tables then read from the fused ones (their values as they were).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import pooling_type_to_str
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recsys_runner.serving.quantized_rows import QuantizedEmbeddings, QuantizedRows, why_kept_float

__all__ = ["FusedEmbeddingBags", "for_serving", "fusion_groups"]


class _Group(nn.Module):
    """The tables of one ``(width, pooling, dtype)``: ``weight`` their rows one table after another, ``base[k]`` the first
    row of the table key ``k`` reads (0 for a key none of them reads, whose ids are looked up as row 0 and dropped).

    Float32 tables (``kind`` ``none``) are copied into ``weight`` one by one, and each of ``weights`` then becomes a view
    of its rows there (``.data``: the same values, parameter objects and results), so the model and its served copy hold
    the tables once; quantized ones are written table by table into the stored format
    (:class:`~recsys_runner.serving.quantized_rows.QuantizedRows`), ``weights`` left as they are: the float reference."""

    base: torch.Tensor
    used: torch.Tensor
    key_index: torch.Tensor
    weight: torch.Tensor

    def __init__(self, weights: list[torch.Tensor], key_table: dict[int, int], num_keys: int, mode: str, kind: str = "none") -> None:
        super().__init__()
        starts = torch.tensor([0, *[w.shape[0] for w in weights]]).cumsum(0)
        self.mode = mode
        self.rows = None if kind == "none" else QuantizedRows([w.detach() for w in weights], kind)
        """The rows quantized (``export.quantize``, :mod:`~recsys_runner.serving.quantized_rows`), table by table; ``None``:
        ``weight``."""
        self.all_keys = sorted(key_table) == list(range(num_keys))
        """Every key of the batch is read by one of these tables: no id needs masking."""
        self.keys = sorted(key_table)
        """The keys read, in the batch's order: the order of this group's output slots."""
        if self.rows is None:
            self.register_buffer("weight", weights[0].detach().new_empty(int(starts[-1]), weights[0].shape[1]), persistent=True)
            for source, first, last in zip(weights, starts[:-1].tolist(), starts[1:].tolist(), strict=True):
                self.weight[first:last].copy_(source.detach())
                source.data = self.weight[first:last]  # the same rows where the fused table holds them: one copy, not two
        base = torch.zeros(num_keys, dtype=torch.long)
        used = torch.zeros(num_keys, dtype=torch.bool)
        for key, table in key_table.items():
            base[key], used[key] = starts[table], True
        self.register_buffer("base", base, persistent=False)
        self.register_buffer("used", used, persistent=False)
        self.register_buffer("key_index", torch.tensor(self.keys, dtype=torch.long), persistent=False)

    def stored(self) -> tuple[int, int, bool]:
        """``(width, bytes, quantized)`` of these tables as stored: what ``export.quantize`` reports."""
        if self.rows is not None:
            return self.rows.width, self.rows.nbytes, True
        return int(self.weight.shape[1]), self.weight.numel() * self.weight.element_size(), False

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, key_of_value: torch.Tensor,
                weights: torch.Tensor | None) -> torch.Tensor:
        """``(values [V], lengths [K, B], key_of_value [V], weights [V] | None) → pooled [B, slots · width]``."""
        ids = values + self.base[key_of_value]
        if not self.all_keys:
            ids = torch.where(self.used[key_of_value], ids, torch.zeros_like(ids))
        offsets = F.pad(lengths.reshape(-1).cumsum(0), (1, 0))
        if self.rows is None:
            pooled = F.embedding_bag(ids, self.weight, offsets, mode=self.mode, per_sample_weights=weights, include_last_offset=True)
        else:  # the bags' rows dequantized, then pooled by the same kernel, each value a bag of its own row
            looked_up = self.rows(ids)
            pooled = F.embedding_bag(torch.arange(ids.shape[0], device=ids.device), looked_up, offsets, mode=self.mode,
                                     per_sample_weights=weights, include_last_offset=True)
        num_keys, rows = lengths.shape
        pooled = pooled.view(num_keys, rows, -1)
        if not self.all_keys:
            pooled = pooled.index_select(0, self.key_index)
        return pooled.transpose(0, 1).reshape(rows, -1).float()


class FusedEmbeddingBags(nn.Module):
    """An ``EmbeddingBagCollection`` as a few lookups: ``KeyedJaggedTensor`` of the batch's ``keys`` → the same
    ``KeyedTensor`` (keys, widths and values in the collection's order).

    Args:
        ebc: the collection (its rows are gathered; its float32 tables then read them from the fused ones, :class:`_Group`).
        keys: the keys of the ``KeyedJaggedTensor`` it is called with, in order (the served batch's).
        kind: ``export.quantize``: the groups' rows stored row-wise quantized (:class:`QuantizedRows`), a group whose
            width does not gain by it kept float32 (:func:`~recsys_runner.serving.quantized_rows.why_kept_float`).

    Raises:
        ValueError: a feature the collection reads is not among ``keys``, or one group's tables read one feature twice
            (:func:`for_serving` then keeps the collection as it is).
    """

    column_order: torch.Tensor

    def __init__(self, ebc: EmbeddingBagCollection, keys: list[str], kind: str = "none") -> None:
        super().__init__()
        index = {k: i for i, k in enumerate(keys)}
        groups = fusion_groups(ebc, keys)
        tables = list(ebc.embedding_bags.values())
        self.weighted = ebc.is_weighted()
        self.groups = nn.ModuleList()
        columns: list[tuple[int, int]] = []  # per output column of the fused result: (slot in ebc order, column in slot)
        slot_of = {(f, n): s for s, (f, n) in enumerate((f, n) for n, c in enumerate(ebc._embedding_bag_configs) for f in c.feature_names)}
        for (width, mode, _), members in groups.items():
            key_table = {index[f]: n for f, n in members}
            numbers = sorted({n for _, n in members})
            local = {n: i for i, n in enumerate(numbers)}
            stored = kind if kind != "none" and why_kept_float(width, kind) is None else "none"
            self.groups.append(_Group([tables[n].weight for n in numbers], {k: local[n] for k, n in key_table.items()}, len(keys), mode,
                                      stored))
            by_key = sorted(members, key=lambda m: index[m[0]])
            columns += [(slot_of[m], c) for m in by_key for c in range(width)]
        widths = list(ebc._lengths_per_embedding)
        slot_start = [sum(widths[:s]) for s in range(len(widths))]
        order = [slot_start[s] + c for s, c in columns]  # the fused column each ebc-order column comes from
        inverse = sorted(range(len(order)), key=lambda i: order[i])
        self.identity = inverse == list(range(len(order)))
        self.register_buffer("column_order", torch.tensor(inverse, dtype=torch.long), persistent=False)
        self.embedding_names = list(ebc._embedding_names)
        """The output's keys, in order: what lets a model take the values whole, without a slice per feature
        (:func:`~recsys_runner.models.lookup.concatenated_lookup`)."""
        self.widths = widths
        self.num_keys = len(keys)

    def stored(self) -> list[tuple[int, int, bool]]:
        """Each group's ``(width, bytes, quantized)`` as stored (:meth:`_Group.stored`)."""
        return [cast(_Group, g).stored() for g in self.groups]

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        values = features.values()
        lengths = features.lengths().view(self.num_keys, -1)
        key_of_value = torch.repeat_interleave(torch.arange(self.num_keys, device=values.device), lengths.sum(dim=1),
                                               output_size=values.shape[0])
        weights = features.weights() if self.weighted else None
        pooled = torch.cat([g(values, lengths, key_of_value, weights) for g in self.groups], dim=1)
        if not self.identity:
            pooled = pooled.index_select(1, self.column_order)
        return KeyedTensor(keys=self.embedding_names, values=pooled, length_per_key=self.widths)


def fusion_groups(ebc: EmbeddingBagCollection, keys: list[str]) -> dict[tuple[int, str, torch.dtype], list[tuple[str, int]]]:
    """``ebc``'s tables by ``(width, pooling, dtype)``: each group's ``(feature, table number)`` pairs, one lookup each.

    Raises:
        ValueError: a feature the collection reads is not among ``keys``, or one group's tables read one feature twice.
    """
    groups: dict[tuple[int, str, torch.dtype], list[tuple[str, int]]] = defaultdict(list)
    tables = list(ebc.embedding_bags.values())
    for number, (config, bag) in enumerate(zip(ebc._embedding_bag_configs, tables, strict=True)):
        for feature in config.feature_names:
            if feature not in keys:
                raise ValueError(f"feature {feature!r} is not among the batch's keys {keys}")
            groups[(config.embedding_dim, pooling_type_to_str(config.pooling), bag.weight.dtype)].append((feature, number))
    for members in groups.values():
        if len({f for f, _ in members}) != len(members):
            raise ValueError(f"tables of one group read a feature twice: {members}")
    return groups


TABLES = (EmbeddingBagCollection, EmbeddingCollection, FusedEmbeddingBags, QuantizedEmbeddings)
"""The modules whose tensors are a model's tables: :func:`for_serving`'s copy shares them."""


def for_serving(model: nn.Module, keys: list[str], kind: str = "none") -> nn.Module:
    """A copy of ``model`` whose ``EmbeddingBagCollection`` modules are :class:`FusedEmbeddingBags` (module docstring), their
    rows stored in ``kind`` (``export.quantize``); a collection that cannot be fused (a feature outside ``keys``, a feature
    read twice in one group) stays as it is, which :func:`~recsys_runner.serving.quantize.check_quantizable` refuses before a
    quantized export starts. ``model``'s outputs are not changed: the export checks the served program against it.

    The copy shares ``model``'s embedding tables (and an already fused or quantized model's) instead of copying them, and
    ``model``'s float32 tables that a group fuses become views of that group's table (:class:`_Group`): an export holds
    each table once whatever it serves (docs/export.md, "Memory")."""
    tables = {id(t): t for m in model.modules() if isinstance(m, TABLES) for t in [*m.parameters(), *m.buffers()]}
    served = copy.deepcopy(model, memo=tables)  # every module but the tables: those the copy shares, a copy fuses or quantizes them
    for name, module in list(served.named_modules()):
        if type(module) is not EmbeddingBagCollection:
            continue
        try:
            fused = FusedEmbeddingBags(module, keys, kind)
        except ValueError:
            continue
        parent, _, attribute = name.rpartition(".")
        setattr(served.get_submodule(parent) if parent else served, attribute, fused)
    return served
