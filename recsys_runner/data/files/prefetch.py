"""Read-ahead of object-store units: the next row groups (or blocks of lines) of a shard are read in a background
thread while the current one is encoded and trained on, so a store's round trips do not stall steps
(``storage.prefetch_units``, docs/storage.md). Local files, and compressed files (streams), are read in turn."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from recsys_runner import store_settings, uris
from recsys_runner.data.files.sources import Unit


def read_ahead(source: Any, units: list[Unit], depth: int | None = None) -> Iterator[Iterator[tuple[pa.Table, np.ndarray]]]:
    """``source.read(unit)`` of each unit in turn; units in an object store are read ``depth`` (``None``:
    ``storage.prefetch_units``) ahead, whole, in a background thread, so the next unit's round trips overlap this one's
    encoding and the training step. A compressed file (one unit, the whole file) is never read whole: it streams as it
    is consumed, while the units after it are read ahead."""
    depth = store_settings.settings().prefetch_units if depth is None else depth
    ahead = [u for u in units if uris.is_uri(u.path) and u.compression is None]
    if depth <= 0 or not ahead:
        yield from (source.read(u) for u in units)
        return
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead")
    pending: list[Future[list[tuple[pa.Table, np.ndarray]]]] = []
    queued = iter(ahead)

    def whole(unit: Unit) -> list[tuple[pa.Table, np.ndarray]]:
        return list(source.read(unit))

    try:
        for unit in units:
            while len(pending) < depth + 1 and (next_unit := next(queued, None)) is not None:
                pending.append(pool.submit(whole, next_unit))
            if uris.is_uri(unit.path) and unit.compression is None:
                with store_settings.waiting():  # a stop signal is taken here at once: the store may be stalled
                    ready = pending.pop(0).result()  # the futures are in the order of the units read ahead
                yield iter(ready)
            else:
                yield source.read(unit)
    finally:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=False)
