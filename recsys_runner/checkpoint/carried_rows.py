"""Rows carried to their new row numbers: with vocabularies fitted anew or grown (``data.vocabulary=refit|extend``) an
``init_from`` loads each such table's trained rows by id (:class:`CarriedRows`): every rank reads the whole trained
table and copies the row of each id into the id's new row of its own shards, its weights, EMA weights and optimizer
state alike. :func:`~recsys_runner.checkpoint.weights.load_into` takes these tables' tensors out of what it loads by
name (:func:`split_carried`) and loads them here (:func:`load_carried`)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from recsys_runner.checkpoint.storage import CheckpointStorage, TensorIndex
from recsys_runner.checkpoint.tensor_keys import param_of, shape_of
from recsys_runner.data.encoding.vocabulary import RowCarry
from recsys_runner.errors import CheckpointError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CarriedRows:
    """``init_from`` with the vocabularies fitted anew (``data.vocabulary=refit``): the embedding tables whose trained
    rows are carried over by id (:func:`~recsys_runner.data.encoding.vocabulary.carry_rows`), by the data's table name.

    A table's tensors are every checkpoint key whose parameter is ``…<table>.weight`` or ``…<prefix>_<table>.weight``
    (the first-order / wide tables beside it): its weights, EMA weights and optimizer state are carried.
    """

    tables: Mapping[str, RowCarry]
    """The tables carried, by the data's table name (``t_user``, or a shared ``table:``)."""
    all_tables: frozenset[str]
    """Every table of the data, so that ``t_a``'s tensors are told from those of a table ``t_x_t_a``."""

    def table_of(self, key: str) -> str | None:
        """The carried table checkpoint key ``key`` (``model/…``, ``ema/…``, ``optim/<param>/<state>``) belongs to, or ``None``."""
        parts = key.split("/")
        param = parts[1] if len(parts) > 1 else ""
        if not param.endswith(".weight") or "." not in param.removesuffix(".weight"):
            return None
        name = param.removesuffix(".weight").rsplit(".", 1)[1]
        owners = [t for t in self.all_tables if name == t or name.endswith(f"_{t}")]
        owner = max(owners, key=len, default=None)
        return owner if owner in self.tables else None


def split_carried(path: Path, index: TensorIndex, ours: Mapping[str, Any], wanted: Mapping[str, str],
                  carry: CarriedRows) -> tuple[dict[str, str], dict[str, tuple[str, np.ndarray]]]:
    """``wanted`` without the tensors of the carried tables, and those tables' tensors carried by id: ours' key →
    (checkpoint key, the checkpoint row of each of its rows). A table's weights and EMA weights are carried, and its
    optimizer state the same way (:func:`_carried_state`): the accumulated state of a row belongs to the id that trained
    it, which keeps its meaning, so Adagrad's sum or Adam's moments go with it; a new row keeps the optimizer's initial
    value (fresh). A table whose state cannot be carried row by row starts its state fresh, with one warning.

    Raises:
        CheckpointError: the checkpoint's table has fewer rows than its stored vocabulary gives out.
    """
    rest: dict[str, str] = {}
    carried: dict[str, tuple[str, np.ndarray]] = {}
    states: dict[str, list[str]] = {}  # a carried table's parameter's optimizer (optim/<half>.<param>) → its state keys
    for k, src in wanted.items():
        table = carry.table_of(k)
        if table is None:
            rest[k] = src
            continue
        if k.startswith("optim/"):
            states.setdefault(k.rsplit("/", 1)[0], []).append(k)
            continue
        rows = carry.tables[table].old_rows
        theirs, mine = index.get(src), shape_of(ours[k])
        if theirs is None or len(theirs) != 2 or mine[0] != len(rows) or theirs[1] != mine[1]:
            rest[k] = src  # not there, or another width: the fine_tune rule decides (a warning names it)
            continue
        if len(rows) and int(rows.max()) >= theirs[0]:
            raise CheckpointError(f"checkpoint {path}: {src} has {theirs[0]} rows, but its stored vocabulary of {table} gives "
                                  f"out row {int(rows.max())}: its encoders.json does not belong to its weights. Fix: "
                                  f"checkpoint.init_from=<a checkpoint written by one training run>, or data.vocabulary=keep")
        carried[k] = (src, rows)
    fresh: dict[str, str] = {}  # table → an example of its state that cannot be carried
    for keys in states.values():
        weights = f"model/{param_of(keys[0])}"
        if weights not in carried or any(wanted[k] not in index for k in keys):
            rest |= {k: wanted[k] for k in keys}  # weights not carried, or state of the other optimizer half: the fine_tune rule says
            continue
        table = carry.table_of(keys[0])
        assert table is not None
        trained = index[carried[weights][0]]
        assert trained is not None  # carried: 2-d
        plans = {k: _carried_state(index[wanted[k]], shape_of(ours[k]), carry.tables[table].old_rows, trained[0]) for k in keys}
        if stuck := [k for k, plan in plans.items() if isinstance(plan, str)]:
            fresh.setdefault(table, f"{stuck[0]}: {plans[stuck[0]]}")
            continue
        for k, plan in plans.items():
            if plan is None:
                rest[k] = wanted[k]
            else:
                assert not isinstance(plan, str)
                carried[k] = (wanted[k], plan)
    if fresh and (not dist.is_initialized() or dist.get_rank() == 0):
        log.warning("init_from %s: the optimizer state of %d carried tables starts fresh (their weights are carried by id): "
                    "its layout there cannot be carried row by row to this run's, e.g. %s. Row-wise state of a column_wise "
                    "table is kept per column shard, so another number of column shards changes it. Fix: give the tables the "
                    "checkpoint's sharding (its run's sharding_plan.txt; +distributed.tables={<table>: {sharding_types: [...]}}), "
                    "or leave it: only these tables' accumulators restart", path, len(fresh),
                    "; ".join(f"{t} ({why})" for t, why in sorted(fresh.items())[:3]))
    return rest, carried


def _carried_state(theirs: list[int] | None, mine: list[int], rows: np.ndarray, old: int) -> np.ndarray | str | None:
    """How one optimizer state of a carried table loads: the checkpoint row of each of ours (as for the weights), ``None``
    to load it as it is (a value per table or shard, e.g. a step count, of the same shape both sides), or why it cannot
    be carried. ``rows``: the table's carry (:attr:`~recsys_runner.data.encoding.vocabulary.RowCarry.old_rows`);
    ``old``: the rows of the table's weights in the checkpoint.

    A state per element (Adagrad's sum, Adam's moments) has the weights' shape, and its rows go as theirs. A state per
    row (row-wise Adagrad) has a row per table row, or, for a ``column_wise`` table, one block of rows per column shard
    (TorchRec's layout): each block's rows go as the weights', when both sides have as many blocks."""
    new = len(rows)
    if theirs is None:
        return "a state of no shape there"
    if len(mine) == 2 and mine[0] == new and theirs == [old, mine[1]]:
        return rows
    if len(mine) == 1 and len(theirs) == 1 and mine[0] >= new and mine[0] % new == 0 and theirs[0] % old == 0 and theirs[0] >= old:
        blocks, there = mine[0] // new, theirs[0] // old
        if blocks != there:
            return f"{there} row-wise blocks there, {blocks} here"
        return np.concatenate([np.where(rows >= 0, rows + b * old, -1) for b in range(blocks)])
    if theirs == mine and (not mine or int(np.prod(mine)) < new):
        return None
    return f"shape {theirs} there, {mine} here"


def load_carried(storage: CheckpointStorage, path: Path, index: TensorIndex, ours: Mapping[str, Any],
                 carried: Mapping[str, tuple[str, np.ndarray]]) -> None:
    """Copy each carried table's trained rows into the new rows of ours' shards (every rank reads the whole table)."""
    whole: dict[str, Any] = {}
    for k, (src, _) in carried.items():
        if src not in whole:
            theirs = index[src]
            assert theirs is not None
            with warnings.catch_warnings():  # a ShardedTensor's dtype warns that ShardedTensor is deprecated
                warnings.simplefilter("ignore", FutureWarning)
                whole[src] = torch.empty(theirs, dtype=ours[k].dtype)
    storage.load_tensors(path, whole)
    for k, (src, rows) in carried.items():
        old_rows = torch.from_numpy(rows)
        for (row, col), shard in _local_shards(ours[k]):
            picked = old_rows[row:row + shard.shape[0]]
            has = picked >= 0
            values = whole[src][picked[has]] if shard.dim() == 1 else whole[src][picked[has], col:col + shard.shape[1]]
            shard[has] = values.to(shard.device, shard.dtype)


def _local_shards(t: Any) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """This rank's pieces of a 1-d or 2-d tensor (a ShardedTensor's local shards, or the whole tensor), each with its
    offset (row, column; 0 for a 1-d one) in the whole."""
    if hasattr(t, "local_shards"):
        return [((int(s.metadata.shard_offsets[0]), int(([*s.metadata.shard_offsets, 0])[1])), s.tensor) for s in t.local_shards()]
    if isinstance(t, DTensor):
        raise CheckpointError("data.vocabulary=refit carries rows into ShardedTensor shards (TorchRec's table-, row- and "
                              "column-wise sharding) and plain tensors (data-parallel), not into this table's DTensor. Fix: "
                              "data.vocabulary=keep, or shard the table one of those ways (distributed.tables.<table>.sharding_types)")
    return [((0, 0), t)]
