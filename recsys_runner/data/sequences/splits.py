"""Which events of a log become rows of which file (``sequences --split``, ``--rows``), and the row kind the files record.

Splits, over each user's events sorted by time (ties by their ids, so a shuffled log splits alike):

* ``time --eval-from T``: events before ``T`` train, the others are ``eval`` rows; with ``--valid-from V`` (``V < T``)
  events in ``[V, T)`` are ``valid`` rows and those at or after ``T`` ``test`` rows.
* ``leave-last-out``: each user's last event is an ``eval`` row.
* ``leave-two-out``: each user's last event is a ``test`` row, the one before it a ``valid`` row, the others train; a
  user with fewer than 3 events has no valid/test row (all its events train: they are counted and said).

A held-out event takes every copy of it along (``--duplicates keep``), so a held-out row is never also a training row.

Row kinds: ``per-event`` (one row per event of the file's part: its history is the user's events strictly before it
in time) or ``per-user`` (one row per user with events in the part: its candidate is the user's last event there, its
history every event of the user before that one in the sorted order, at most ``max_len``). A next-item model
(SASRec, HSTU) trains on every position of a per-user row at once (causal attention), so it holds the same targets as
the user's per-event rows in one row; a model that scores one candidate per row (DIN, BST, the ranking and two-tower
models) would see one example per user, so such files record ``rows: per-user`` in their Parquet metadata
(:data:`ROWS_METADATA_KEY`) and :func:`check_rows_for_model` refuses them for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from recsys_runner import stores
from recsys_runner.data.locate import PARQUET_SUFFIXES, resolve_files
from recsys_runner.errors import ConfigError, UserError

SPLITS = ("time", "leave-last-out", "leave-two-out")
ROWS = ("per-event", "per-user")
ROWS_METADATA_KEY = b"recsys_runner.rows"
"""Parquet key-value metadata of the rows ``sequences`` writes: ``per-event`` or ``per-user``."""
LEAVE_TWO_OUT_MIN_EVENTS = 3


def part_names(split: str, valid_from: int | None) -> tuple[str, ...]:
    """The parts (and files ``<part>.parquet``) a split writes: ``train``/``eval``, or ``train``/``valid``/``test``."""
    return ("train", "valid", "test") if split == "leave-two-out" or valid_from is not None else ("train", "eval")


@dataclass(frozen=True)
class Sorted:
    """The log's events sorted by user, time and ids: per sorted position, its user's first position and the first
    position of its event (copies are neighbours)."""

    user_start: np.ndarray
    event_start: np.ndarray
    new_user: np.ndarray
    new_event: np.ndarray


def sorted_layout(users: np.ndarray, same: np.ndarray) -> Sorted:
    """:class:`Sorted` of events already in sorted order (``users``, and ``same``: equal for copies of one event)."""
    n = len(users)
    index = np.arange(n)
    new_user = np.ones(n, bool)
    new_user[1:] = users[1:] != users[:-1]
    new_event = new_user.copy()
    new_event[1:] |= same[1:] != same[:-1]
    user_start = np.maximum.accumulate(np.where(new_user, index, 0)) if n else index
    event_start = np.maximum.accumulate(np.where(new_event, index, 0)) if n else index
    return Sorted(user_start, event_start, new_user, new_event)


def events_from_end(s: Sorted) -> tuple[np.ndarray, np.ndarray]:
    """Per sorted position: how many of its user's distinct events come after its own (0: the last), and how many
    distinct events its user has."""
    event = np.cumsum(s.new_event) - 1
    last = np.ones(len(event), bool)
    last[:-1] = s.new_user[1:]
    user = np.cumsum(s.new_user) - 1
    last_event, first_event = event[last], event[s.new_user]
    return last_event[user] - event, (last_event - first_event + 1)[user]


def split_parts(split: str, times: np.ndarray, s: Sorted, eval_from: int | None, valid_from: int | None) -> tuple[dict[str, np.ndarray], int]:
    """Per part (:func:`part_names`), a mask of the sorted positions in it; and for leave-two-out the number of users
    with fewer than :data:`LEAVE_TWO_OUT_MIN_EVENTS` events (all train), else 0. ``times`` in sorted order."""
    if split == "time":  # copies share their time: they fall on the same side
        assert eval_from is not None
        if valid_from is None:
            return {"train": times < eval_from, "eval": times >= eval_from}, 0
        return {"train": times < valid_from, "valid": (times >= valid_from) & (times < eval_from), "test": times >= eval_from}, 0
    after, count = events_from_end(s)
    if split == "leave-last-out":
        return {"train": after > 0, "eval": after == 0}, 0
    enough = count >= LEAVE_TWO_OUT_MIN_EVENTS
    parts = {"train": (after > 1) | ~enough, "valid": (after == 1) & enough, "test": (after == 0) & enough}
    return parts, int((~enough & s.new_user).sum())


def per_user_rows(mask: np.ndarray, s: Sorted, max_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row per user with positions in ``mask`` (a user's positions in one part are consecutive): the sorted
    position of its candidate (the user's last event there), and its history ``[begin, end)``: the user's events before
    that event's first copy, the last ``max_len``."""
    n = len(mask)
    last_in_part = mask.copy()
    last_in_part[:-1] &= s.new_user[1:] | ~mask[1:]
    rows = np.flatnonzero(last_in_part) if n else np.zeros(0, np.int64)
    end = s.event_start[rows]
    return rows, np.maximum(s.user_start[rows], end - max_len), end


def rows_kind(path: str) -> str | None:
    """The row kind a Parquet file of ``sequences`` records (:data:`ROWS_METADATA_KEY`), ``None`` for other files."""
    fs, in_fs = stores.arrow_filesystem(path)
    meta = pq.read_schema(in_fs, filesystem=fs).metadata or {}
    return meta[ROWS_METADATA_KEY].decode() if ROWS_METADATA_KEY in meta else None


def check_rows_for_model(paths: dict[str, str | None], next_item: bool) -> None:
    """Refuse per-user rows for a model that scores one candidate per row (``next_item`` false); ``paths``: setting →
    its files (``data.path``, ``data.eval_path``), of which the first is read. Settings that name no readable Parquet
    file are left to the data module, which names what is wrong with them.

    Raises:
        ConfigError: naming the setting, the file, the row kind and the fix (``--rows per-event``).
    """
    if next_item:
        return
    for key, where in paths.items():
        try:
            path = resolve_files(where, key, PARQUET_SUFFIXES)[0] if where else None
            kind = rows_kind(path) if path else None
        except (UserError, OSError, ValueError):
            continue
        if kind == "per-user":
            raise ConfigError(f"{key}: {path} holds per-user rows (python -m recsys_runner.data sequences --rows per-user: one row per "
                              f"user, its last event the candidate), but this model scores one candidate per row (DIN, BST, the "
                              f"ranking and two-tower models) and would see one example per user. Fix: write the rows with "
                              f"--rows per-event, or train a next-item model (model=sasrec, model.block=hstu) on them")
