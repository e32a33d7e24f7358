"""The spread sample: which rows of files holding more than ``data.infer.sample_rows`` rows the encoders are fitted on
(:mod:`recsys_runner.data.encoding.fit`), and the reading of plain text at those places.

Why spread: CTR logs are written in time order (Criteo's days, Avazu's ``hour``), so their first rows are their first
hours, and a vocabulary fitted on them lacks every later value of such a column. A sample is therefore taken as many
short runs of rows (:func:`piece_count`: 1,000 of 100 rows for 100,000), evenly spaced over the files in their order: a value that holds a
contiguous block of more than ``1 / runs`` of the rows is seen. Where the runs can be placed is bounded by what reading
them costs, per format:

* plain text: anywhere, a seek each (:func:`spread_lines`), so the runs are spread over every byte of the files;
* Parquet: a run inside a row group costs decoding the group's rows before it, so the runs are spread over the rows of
  as many evenly spaced row groups as :data:`PARQUET_DECODE_FACTOR` times the sample's rows allow, every group when
  the files hold no more (:func:`group_runs`);
* compressed text: a line is reached only by decompressing every line before it, so each file gives its share from its
  first lines, over at most as many evenly spaced files as there are runs (:func:`file_shares`).

The places follow from the files' row counts and sizes alone: the same files give the same sample. Files holding no
more rows than the sample are read whole by the sources, as their head sample reads them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO

import pyarrow as pa

from recsys_runner import stores

PIECE_ROWS = 20
"""The fewest rows (lines) of each of the evenly spaced runs a spread sample is taken in (:func:`piece_count`)."""

MAX_PIECES = 1000
"""The most runs a spread sample is taken in: a sample of 100,000 rows is 1,000 runs of 100 rows, a run every 40,000
rows of Avazu's 40-million-row ``train.csv`` (an hour holds 170,000 on average), where 100 spans of plain text and 10
runs of Parquet missed hours between them. Each run of plain text costs a seek (an object store's request, made
:data:`~recsys_runner.stores.READ_AHEAD_THREADS` at a time), so runs are not made shorter than the sample allows: 1,000
seeks read 100,000 lines about as fast as 100 did (docs/data.md)."""

PARQUET_DECODE_FACTOR = 4
"""How many times the sample's rows a Parquet spread sample may decode: a run decodes its row group's rows before it
and every row group's columns are read whole, so the runs are spread over every row group of files holding at most
this many times the sample, else over evenly spaced row groups holding about that many rows (each read whole). About
what 10 runs of 10,000 rows at any place in ``convert``'s 65,536-row groups decoded on average (a run and half a group
before it, each), the sample taken before runs were many."""

SPAN_BUFFER_BYTES = 1 << 14
"""The read buffer of a span of plain text: about a run's lines (100 lines of 160 bytes), without reading ahead the
1 MiB an object store's reader takes for a sequential read (:func:`recsys_runner.stores.open_input`)."""


def piece_count(num_rows: int) -> int:
    """How many runs a spread sample of ``num_rows`` rows is taken in: as many of :data:`PIECE_ROWS` rows as it holds, at
    most :data:`MAX_PIECES`, at least one."""
    return max(1, min(MAX_PIECES, num_rows // PIECE_ROWS))


def spread_pieces(total: int, num_rows: int, pieces: int) -> list[tuple[int, int]]:
    """(first, stop) of each of ``pieces`` runs of rows that together hold ``num_rows`` of ``total`` rows (more than
    ``num_rows``), evenly spaced: the first begins at row 0, the gaps between them are as even as the sizes, the last ends
    at most at ``total``. The same counts give the same pieces (a sample is reproducible)."""
    k = min(pieces, num_rows)
    gap = total - num_rows
    return [(i * num_rows // k + i * gap // k, (i + 1) * num_rows // k + i * gap // k) for i in range(k)]


def sampled_groups(groups: list[tuple[str, int, int]], num_rows: int) -> list[tuple[str, int, int]]:
    """The row groups (file, index, rows; in order, holding more than ``num_rows`` rows) a Parquet spread sample reads:
    every one where they hold at most :data:`PARQUET_DECODE_FACTOR` × ``num_rows`` rows, else the groups holding evenly
    spaced rows, as many as the average group size lets that many rows hold (more where they hold fewer than the sample)."""
    total = sum(n for *_, n in groups)
    budget = PARQUET_DECODE_FACTOR * num_rows
    if total <= budget:
        return groups
    starts = [0]
    for *_, n in groups:
        starts.append(starts[-1] + n)
    count = max(1, budget * len(groups) // total)
    while True:
        picked = sorted({_group_at(starts, j * total // count) for j in range(count)})
        if sum(groups[g][2] for g in picked) >= num_rows or count >= len(groups):
            return [groups[g] for g in picked]
        count += 1


def _group_at(starts: list[int], row: int) -> int:
    """The index of the group holding ``row``, of groups beginning at ``starts`` (and the end)."""
    lo, hi = 0, len(starts) - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if starts[mid] <= row:
            lo = mid
        else:
            hi = mid - 1
    return lo


def group_runs(groups: list[tuple[str, int, int]], num_rows: int) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """Per row group (file, index) read, the (first, stop) rows in it of the runs of a spread sample of ``num_rows`` rows of
    ``groups`` (each (file, index, rows); in order, holding more): :func:`piece_count` runs evenly spaced over the rows of
    the :func:`sampled_groups` taken together, a run that crosses a group's end continuing in the next."""
    read = sampled_groups(groups, num_rows)
    bounds = spread_pieces(sum(n for *_, n in read), num_rows, piece_count(num_rows))
    wanted: dict[tuple[str, int], list[tuple[int, int]]] = {}
    start = 0
    for path, g, n in read:
        for first, stop in bounds:
            lo, hi = max(first, start), min(stop, start + n)
            if lo < hi:
                wanted.setdefault((path, g), []).append((lo - start, hi - start))
        start += n
    return wanted


def take_runs(tables: Iterable[pa.Table], runs: list[tuple[int, int]]) -> list[pa.Table]:
    """The rows ``runs`` ((first, stop), in order) of a row group read as consecutive ``tables``, as slices of them; the
    reading stops after the last run's last row."""
    out: list[pa.Table] = []
    at, end = 0, runs[-1][1]
    for table in tables:
        for lo, hi in runs:
            if lo < at + table.num_rows and hi > at:
                out.append(table.slice(max(lo - at, 0), min(hi, at + table.num_rows) - max(lo, at)))
        at += table.num_rows
        if at >= end:
            break
    return out


def file_shares(files: list[str], num_rows: int) -> list[tuple[str, int]]:
    """The files (in order) a spread sample of ``num_rows`` lines of compressed text reads from their first lines, each with
    its share: every file, or :func:`piece_count` evenly spaced ones where there are more, the rows split evenly."""
    k = min(len(files), piece_count(num_rows))
    picked = [files[i * len(files) // k] for i in range(k)]
    return [(path, (i + 1) * num_rows // k - i * num_rows // k) for i, path in enumerate(picked)]


@dataclass
class Span:
    """Where a spread sample reads lines of a plain-text file (:func:`spread_lines`): those that start at a byte in
    [``pos``, ``stop``); ``pos`` moves on as they are read (``synced``: it is at a line start; ``data_start``: where the
    file's first data line starts, a line start)."""

    path: str
    data_start: int
    pos: int
    stop: int
    synced: bool = False


def text_spans(files: list[tuple[str, int, int]], num_rows: int) -> list[list[Span]]:
    """The data bytes of the plain-text ``files`` (each (path, first data byte, size)) taken together, cut into
    :func:`piece_count` even spans, each as its parts in the files it crosses."""
    total = sum(end - start for _, start, end in files)
    k = min(piece_count(num_rows), num_rows)
    spans: list[list[Span]] = []
    for i in range(k):
        lo, hi, at = i * total // k, (i + 1) * total // k, 0
        parts = []
        for path, start, end in files:
            a, b = max(lo, at), min(hi, at + end - start)
            if a < b:
                parts.append(Span(path, start, start + a - at, start + b - at))
            at += end - start
        spans.append(parts)
    return spans


def spread_lines(files: list[tuple[str, int]], num_rows: int) -> dict[str, list[tuple[int, bytes]]]:
    """``num_rows`` non-blank lines of the plain-text ``files`` (each with the byte offset of its first data line), each
    with its byte offset, per file in order: their data bytes cut into :func:`text_spans`, each span's share of the
    sample its first lines (a span begins at the first line that starts in it: one ``readline`` resyncs a seek). A span
    whose lines run out before its share (lines are longer there) passes the rest on to the next, and what is still short
    is read on after where each span stopped; so files holding no more lines than the sample give every line, in order,
    as the head sample does. Each file is opened once a pass, its spans entered by a seek each (not a scan of the file);
    an object's spans' first :data:`SPAN_BUFFER_BYTES` are fetched ahead, concurrently (:func:`_read_spans`)."""
    spans = text_spans([(path, start, stores.file_size(path)) for path, start in files], num_rows)
    k = len(spans)
    shares = [(i + 1) * num_rows // k - i * num_rows // k for i in range(k)]
    picked: dict[str, list[tuple[int, bytes]]] = {path: [] for path, _ in files}
    short = _read_spans(spans, shares, 0, picked)
    if short:
        _read_spans(spans, [0] * k, short, picked)
    return {path: sorted(lines) for path, lines in picked.items()}


def _read_spans(spans: list[list[Span]], shares: list[int], short: int, picked: dict[str, list[tuple[int, bytes]]]) -> int:
    """One pass over ``spans`` in order, each reading its share (and what is ``short`` of those before it) into
    ``picked``; each file opened once, an object's blocks at the spans it may enter read ahead
    (:func:`~recsys_runner.stores.read_ahead_inputs`: a few round trips' wait, not one per span; those the pass does not
    reach are cancelled). What is still short."""
    handles: dict[str, IO[bytes]] = {}
    starts: dict[str, list[int]] = {}
    for span in (span for parts in spans for span in parts if span.pos < span.stop):
        starts.setdefault(span.path, []).append(_entry(span))
    with stores.read_ahead_inputs(starts, SPAN_BUFFER_BYTES, SPAN_BUFFER_BYTES) as open_input:
        try:
            for parts, share in zip(spans, shares, strict=True):
                short += share
                for span in parts:
                    if short > 0 and span.pos < span.stop:
                        if span.path not in handles:
                            handles[span.path] = open_input(span.path)
                        short -= _span_lines(handles[span.path], span, short, picked[span.path])
        finally:
            for f in handles.values():
                f.close()
    return short


def _entry(span: Span) -> int:
    """Where reading ``span`` seeks to: its position, or the byte before it where it may begin inside a line (the rest of
    that line is read to resync)."""
    return span.pos - 1 if span.pos > span.data_start and not span.synced else span.pos


def _span_lines(f: IO[bytes], span: Span, n: int, out: list[tuple[int, bytes]]) -> int:
    """Up to ``n`` more non-blank lines that start in ``span`` (from where it stopped), read from its file ``f``, into
    ``out`` with each one's byte offset; how many."""
    got = 0
    entry = _entry(span)
    f.seek(entry)  # plain text: entered by a seek
    if entry < span.pos:  # the rest of the line the span begins in (a lone newline where it begins at a line)
        span.pos += len(f.readline()) - 1
    span.synced = True
    while got < n and span.pos < span.stop:
        line = f.readline()
        if not line:
            span.pos = span.stop
            break
        if line.strip(b"\r\n"):
            out.append((span.pos, line if line.endswith(b"\n") else line + b"\n"))
            got += 1
        span.pos += len(line)
    return got
