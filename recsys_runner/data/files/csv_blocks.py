"""A delimited text file cut into units without parsing it: a plain file into blocks of ``block_rows`` lines, found by one
scan of its bytes for newlines; a compressed file into one unit, its lines counted by decompressing it once. The source
that reads the units is :mod:`~recsys_runner.data.files.csv_source`; the unit is :class:`~recsys_runner.data.files.sources.Unit`."""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from recsys_runner import stores
from recsys_runner.data.files import compression as compressed
from recsys_runner.data.files.compression import Compression
from recsys_runner.data.files.sources import Unit

log = logging.getLogger(__name__)


def line_blocks(path: str, data_start: int, block_rows: int) -> list[Unit]:
    """Plain-text ``path``'s lines from byte ``data_start`` on (after its header) as units of ``block_rows`` lines, each
    with its byte range: one pass over the bytes finds the start offset of every ``block_rows``-th line."""
    size = stores.file_size(path)
    # One pass over the bytes: the start offset of every block_rows-th line.
    starts, num_lines, pos, last_byte = [data_start], 0, data_start, b"\n"
    chunk_bytes = 1 << 24
    with stores.open_input(path) as f:
        f.seek(data_start)
        while chunk := f.read(chunk_bytes):
            newlines = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
            # line k+1 starts after newline k; record those with (k+1) % block_rows == 0
            line_numbers = num_lines + np.arange(1, len(newlines) + 1)
            picks = newlines[line_numbers % block_rows == 0]
            starts.extend((pos + picks + 1).tolist())
            num_lines += len(newlines)
            pos += len(chunk)
            last_byte = chunk[-1:]
    if last_byte != b"\n":
        num_lines += 1  # a last line without a newline
    elif starts[-1] == size:
        starts.pop()  # a block boundary exactly at the end of the file
    units = []
    for b, start in enumerate(starts):
        first = b * block_rows
        n = min(block_rows, num_lines - first)
        if n <= 0:
            break
        stop = starts[b + 1] if b + 1 < len(starts) else size
        units.append(Unit(path, b, first, n, (start, stop)))
    return units


def stream_unit(path: str, codec: Compression, data_start: int, given: str = "data.path") -> Unit:
    """A compressed file as one unit: its lines (from byte ``data_start`` of its text on) counted by decompressing it once
    (no parsing); ``given``: what named the file, for a read error's fix."""
    started, num_lines, last_byte = time.monotonic(), 0, b"\n"
    for chunk in compressed.chunks(path, codec, data_start, given):
        num_lines += chunk.count(b"\n")
        last_byte = chunk[-1:]
    if last_byte != b"\n":
        num_lines += 1  # a last line without a newline
    if int(os.environ.get("RANK", "0")) == 0:
        log.info("%s is %s-compressed: %d rows, counted by decompressing it once (%.1f s); it is read as one stream, "
                 "from its start", path, codec.name, num_lines, time.monotonic() - started)
    return Unit(path, 0, 0, num_lines, compression=codec.name)
