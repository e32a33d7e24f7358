"""Read-ahead of object-store units: the next row groups (or blocks of lines) of a shard are read in a background
thread while the current one is encoded and trained on, so a store's round trips do not stall steps
(``storage.prefetch_units``, docs/storage.md). Local files are read in turn, as before."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from recsys_runner import stores
from recsys_runner.data.files.sources import Unit


def read_ahead(source: Any, units: list[Unit], depth: int | None = None) -> Iterator[Iterator[tuple[pa.Table, np.ndarray]]]:
    """``source.read(unit)`` of each unit in turn; units in an object store are read ``depth`` (``None``:
    ``storage.prefetch_units``) ahead, whole, in a background thread, so the next unit's round trips overlap this one's
    encoding and the training step."""
    depth = stores.settings().prefetch_units if depth is None else depth
    if depth <= 0 or not any(stores.is_uri(u.path) for u in units):
        yield from (source.read(u) for u in units)
        return
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead")
    pending: list[Future[list[tuple[pa.Table, np.ndarray]]]] = []
    queued = iter(units)

    def whole(unit: Unit) -> list[tuple[pa.Table, np.ndarray]]:
        return list(source.read(unit))

    try:
        for _ in units:
            while len(pending) < depth + 1 and (unit := next(queued, None)) is not None:
                pending.append(pool.submit(whole, unit))
            yield iter(pending.pop(0).result())
    finally:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=False)
