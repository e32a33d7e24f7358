"""TorchRec's preprocessed Criteo files (``data=criteo_npy``): per day ``day_{i}_dense.npy`` (float32 ``[N, 13]``, already
log-transformed), ``day_{i}_sparse.npy`` (integer ids ``[N, 26]``) and ``day_{i}_labels.npy`` (``[N, 1]``), as
``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys`` (TorchRec's ``npy_preproc_criteo.py``) writes them for its DLRM
example.

The files are read by memory map in blocks of ``block_rows`` rows (a :class:`~recsys_runner.data.files.sources.Unit`
each), so the rows are split between ranks and workers as a Parquet file's row groups are, and nothing loads a whole
day. A block becomes an Arrow table of :data:`~recsys_runner.data.files.criteo_config.CRITEO_COLUMNS` (``label``,
``int_0…``, ``cat_0…``), which the encoder reads as it reads ``data=criteo``'s columns: the ids modulo their table's size
(as TorchRec's ``InMemoryBinaryCriteoIterDataPipe`` takes them with ``hashes``), the dense values as they are.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from recsys_runner import uris
from recsys_runner.data.files.criteo_config import CRITEO_COLUMNS, CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE
from recsys_runner.data.files.sources import Unit, skip_empty
from recsys_runner.errors import DataError

NPY_KINDS = ("dense", "sparse", "labels")
"""The three files of a day, as TorchRec names them ``day_{i}_{kind}.npy``."""

DAY_FILE = re.compile(r"^day_(\d+)_(dense|sparse|labels)\.npy$")

REWRITE = ("Fix: write the day again with torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys (TorchRec's "
           "npy_preproc_criteo.py), or remove its three files from data.path")
"""The fix for a day whose files do not match."""


@dataclass(frozen=True)
class NpyDay:
    """One day's three files and its row count."""

    day: int
    dense: str
    sparse: str
    labels: str
    rows: int


def npy_shape(path: str) -> tuple[tuple[int, ...], np.dtype]:
    """An ``.npy`` file's shape and dtype, from its header alone.

    Raises:
        DataError: the file is not a readable ``.npy`` file.
    """
    try:
        arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not a readable .npy file ({e}). {REWRITE}") from None
    if not isinstance(arr, np.ndarray):
        raise DataError(f"{path} is not a .npy array (an .npz archive?). {REWRITE}")
    return arr.shape, arr.dtype


def _check_day(day: int, paths: dict[str, str]) -> NpyDay:
    """The day's files, after checking what a row of each must be: 13 float dense values, 26 integer ids, one integer
    label, and as many rows in each file.

    Raises:
        DataError: naming the file, what it holds and the fix.
    """
    shapes = {kind: npy_shape(paths[kind]) for kind in NPY_KINDS}
    widths = {"dense": CRITEO_NUM_DENSE, "sparse": CRITEO_NUM_SPARSE, "labels": 1}
    for kind, (shape, dtype) in shapes.items():
        row = shape[1:] if kind != "labels" or len(shape) != 1 else (1,)
        if len(shape) not in (1, 2) or row != (widths[kind],):
            raise DataError(f"{paths[kind]} holds an array of shape {shape}, but TorchRec's {kind} file of a Criteo day holds "
                            f"[rows, {widths[kind]}]. {REWRITE}")
        want_float = kind == "dense"
        if not (np.issubdtype(dtype, np.floating) if want_float else np.issubdtype(dtype, np.integer)):
            raise DataError(f"{paths[kind]} holds {dtype} values, but TorchRec's {kind} file holds "
                            f"{'floats (log-transformed counts)' if want_float else 'integers'}. {REWRITE}")
    rows = {kind: shape[0] for kind, (shape, _) in shapes.items()}
    if len(set(rows.values())) > 1:
        raise DataError(f"day {day}'s files differ in rows ({', '.join(f'{os.path.basename(paths[k])}: {n}' for k, n in rows.items())}): "
                        f"row i of each is one example, so they must hold as many. {REWRITE}")
    return NpyDay(day, paths["dense"], paths["sparse"], paths["labels"], rows["dense"])


def npy_days(files: list[str], key: str) -> list[NpyDay]:
    """The days of ``files`` (the ``.npy`` files ``key`` names), in day order, each with its three files checked.

    Raises:
        DataError: a file on an object store, a ``.npy`` file not named ``day_{i}_{kind}.npy``, a day lacking one of its
            three files, or files that do not match (:func:`_check_day`).
    """
    if any(uris.is_uri(f) for f in files):
        raise DataError(f"{key} names files on an object store ({files[0]}); data=criteo_npy reads local files by memory map. "
                        f"Fix: copy the day_*_{{dense,sparse,labels}}.npy files to a local (or mounted) folder and point {key} at it")
    by_day: dict[int, dict[str, str]] = {}
    for path in files:
        if (m := DAY_FILE.match(os.path.basename(path))) is None:
            raise DataError(f"{path} is not named as TorchRec names its Criteo files (day_<i>_dense.npy, day_<i>_sparse.npy, "
                            f"day_<i>_labels.npy). Fix: rename it so, or remove it from {key}")
        by_day.setdefault(int(m.group(1)), {})[m.group(2)] = path
    days = []
    for day, paths in sorted(by_day.items()):
        if missing := [k for k in NPY_KINDS if k not in paths]:
            have = next(iter(paths.values()))
            raise DataError(f"day {day} has {os.path.basename(have)} but no day_{day}_{missing[0]}.npy next to it "
                            f"({os.path.dirname(have) or '.'}): each day is three files, dense, sparse and labels. Fix: write "
                            f"day {day} again with TorchRec's tsv_to_npys, or remove its files from {key}")
        days.append(_check_day(day, paths))
    return days


class NpySource:
    """TorchRec's Criteo ``.npy`` days, one unit per block of ``block_rows`` rows of a day (the unit's path: the day's
    dense file)."""

    def __init__(self, files: list[str], columns: list[str], block_rows: int, key: str = "data.path") -> None:
        self.days = npy_days(files, key)
        self.files = [d.dense for d in self.days]
        """Each day's dense file: the day, as split files and held-out rows name it."""
        self.columns = columns or list(CRITEO_COLUMNS)
        self.block_rows = block_rows
        self._by_dense = {d.dense: d for d in self.days}

    def units(self, say_skipped: bool = True) -> list[Unit]:
        """Each day's blocks of rows; days of 0 rows skipped (:func:`~recsys_runner.data.files.sources.skip_empty`).

        Raises:
            DataError: every day is empty.
        """
        self.files = skip_empty(self.files, [d.dense for d in self.days if d.rows == 0], "holds 0 rows", say_skipped)
        return [Unit(d.dense, b, first, min(self.block_rows, d.rows - first), row_block=True)
                for d in self.days if d.rows for b, first in enumerate(range(0, d.rows, self.block_rows))]

    def last_day_apart(self, half: str, key: str) -> tuple[NpySource, NpySource, list[Unit]]:
        """TorchRec's split of these days (``InMemoryBinaryCriteoIterDataPipe``'s stages): the days but the last, to train
        on; the last day; and the units of its ``half``: ``val``, its first ``ceil(rows / 2)`` rows, or ``test``, the rest
        (``key``: the setting that names the days, for errors).

        Raises:
            DataError: fewer than two days (one to train on, one held out).
        """
        if len(self.days) < 2:
            raise DataError(f"data.last_day=holdout holds out the last day of {key} and trains on the days before it, but "
                            f"{key} holds only day {self.days[0].day} ({self.days[0].dense}). Fix: point {key} at the days to "
                            f"train on and the one to evaluate on (TorchRec's 1TB: day_0 … day_23), or data.last_day=train")
        *before, last = self.days
        train, held = (NpySource([f for d in days for f in (d.dense, d.sparse, d.labels)], self.columns, self.block_rows, key)
                       for days in (before, [last]))
        middle = (last.rows + 1) // 2  # TorchRec's int(np.ceil(samples_in_file / 2.0))
        start, stop = (0, middle) if half == "val" else (middle, last.rows)
        units = [Unit(last.dense, b, first, min(self.block_rows, stop - first), row_block=True)
                 for b, first in enumerate(range(start, stop, self.block_rows))]
        return train, held, units

    def column_files(self, path: str) -> dict[str, str]:
        """Each column's file in the day whose dense file is ``path`` (a unit's path), for the bad-row messages
        (:class:`~recsys_runner.data.encoding.rows.Location`): a bad label is in the labels file, a bad id in the sparse one."""
        day = self._by_dense[path]
        return {name: day.labels if name == "label" else day.dense if name.startswith("int_") else day.sparse for name in CRITEO_COLUMNS}

    def follow_training(self, first: str, train: NpySource, key: str, what: str) -> None:
        """Eval days are read as training days: the layout is fixed, there is no column to name as their mistake."""

    def read(self, unit: Unit) -> Iterator[tuple[pa.Table, np.ndarray]]:
        """The unit's rows as one table, and the 0-based day row of each row."""
        yield self._rows(self._by_dense[unit.path], unit.first_row, unit.first_row + unit.num_rows), np.arange(
            unit.first_row, unit.first_row + unit.num_rows)

    def sample(self, num_rows: int, spread: bool = False) -> pa.Table:
        """The first ``num_rows`` rows of the days (all, in order, where they hold no more); ``spread`` is not needed: the
        columns are fixed, and only tables sized from the data (``data.num_embeddings=null``) read the sample."""
        tables, wanted = [], num_rows
        for day in self.days:
            if wanted <= 0:
                break
            take = min(wanted, day.rows)
            if take:
                tables.append(self._rows(day, 0, take, list(CRITEO_COLUMNS)))
            wanted -= take
        if not tables:
            raise DataError(f"{self.days[0].dense} has no rows to read. Fix: point data.path at days with rows")
        return pa.concat_tables(tables)

    def _rows(self, day: NpyDay, start: int, stop: int, columns: list[str] | None = None) -> pa.Table:
        """Rows ``[start, stop)`` of ``day`` as a table of ``columns`` (default: those read)."""
        wanted = columns or self.columns
        arrays: dict[str, np.ndarray] = {}
        dense, sparse = np.load(day.dense, mmap_mode="r"), np.load(day.sparse, mmap_mode="r")
        for name in wanted:
            if name == "label":
                arrays[name] = np.asarray(np.load(day.labels, mmap_mode="r")[start:stop]).reshape(-1)
            elif name.startswith("int_"):
                arrays[name] = np.ascontiguousarray(dense[start:stop, int(name[4:])])
            else:
                arrays[name] = np.ascontiguousarray(sparse[start:stop, int(name[4:])], dtype=np.int64)
        return pa.table(arrays)
