"""The delimited-text source (CSV, TSV, Criteo; plain or compressed): each file's layout read and checked
(:mod:`~recsys_runner.data.files.csv_header`), its lines cut into units of ``block_rows`` lines by one newline scan
(:mod:`~recsys_runner.data.files.csv_blocks`), each unit parsed as text (every field a string, converted by the encoder,
which names the exact line of a bad field); a line that opens a quote it does not close, or that is not UTF-8, is named with
its line and the fix. The unit and the Parquet source are in :mod:`~recsys_runner.data.files.sources`."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from recsys_runner import stores
from recsys_runner.data.files import compression as compressed
from recsys_runner.data.files.csv_blocks import line_blocks, stream_unit
from recsys_runner.data.files.csv_header import CsvHeaders
from recsys_runner.data.files.layout import (
    delimiter_hint,
    not_utf8,
    not_utf8_message,
    open_quote_fix,
    open_quote_lines,
)
from recsys_runner.data.files.sources import Unit, repeated_names, skip_empty, unreadable, without_repeats
from recsys_runner.errors import DataError

TEXT_SAMPLE_PIECES = 100
"""How many even spans of plain text a spread sample reads its lines from (:meth:`CsvSource._spread`). Each costs one seek
and a read of :data:`SPAN_BUFFER_BYTES`, not a row group's columns as a Parquet piece does, so text takes ten times the
pieces Parquet does (:data:`~recsys_runner.data.files.sources.SAMPLE_PIECES`): 300,000 rows of 24 hours in time order get
a piece every 3,000 rows, every hour several."""

SPAN_BUFFER_BYTES = 1 << 16
"""The read buffer of a span of a spread sample: a share of its lines (1,000 of a 100,000-row sample) without reading
ahead the 1 MiB an object store's reader takes for a sequential read (:func:`recsys_runner.stores.open_input`)."""


@dataclass
class _Span:
    """Where a spread sample reads lines of a plain-text file (:meth:`CsvSource._spread`): those that start at a byte in
    [``pos``, ``stop``); ``pos`` moves on as they are read (``synced``: it is at a line start; ``data_start``: where the
    file's first data line starts, a line start)."""

    path: str
    data_start: int
    pos: int
    stop: int
    synced: bool = False


class CsvSource:
    """Delimited text files (CSV, TSV, Criteo), one unit per block of ``block_rows`` lines; a compressed file (gzip,
    bz2, zstd, told by its first bytes) is one unit, read as a stream.

    Splitting assumes one record per line (no newlines inside quoted fields). Every field is read as
    text and converted by the encoder, which reports the exact line of a bad field.
    """

    def __init__(
        self,
        files: list[str],
        columns: list[str],
        *,
        delimiter: str | None,
        header: bool | None,
        column_names: list[str] | None,
        null_values: list[str],
        block_rows: int,
        on_bad_rows: str,
        header_key: str = "data.header",
        follows_training: bool = False,
        reference: tuple[str, list[str]] | None = None,
        **messages: str,
    ) -> None:
        self.files, self.columns = files, columns
        self.headers = CsvHeaders(delimiter=delimiter, header=header, column_names=column_names, header_key=header_key,
                                  follows_training=follows_training, reference=reference, **messages)
        """Each file's layout (``delimiter``, ``header``, ``column_names`` as configured, ``None``: detected per file); for
        eval files ``header_key`` is ``data.eval_header`` and ``follows_training`` checks them against the training files';
        ``messages``: the other settings :class:`CsvHeaders`' messages name (the item catalogue's keys, for its files);
        ``reference``: the first training file and its columns, for eval files (:attr:`CsvHeaders.reference`)."""
        self.null_values, self.block_rows, self.skip = null_values, block_rows, on_bad_rows == "skip"
        self.num_bad_rows = 0
        self._names: dict[str, list[str]] = {}
        self._data_start: dict[str, int] = {}

    def follow_training(self, first: str, train: CsvSource, key: str, what: str) -> None:
        """Read these files as files with the training files' columns (``first``: the first training file; ``train`` its
        source), named by ``key`` and each a ``what`` in messages (:meth:`TabularData.open_files`)."""
        self.headers.reference = (first, train.names(first))
        self.headers.path_key, self.headers.what = key, what

    def detected(self) -> tuple[str, bool]:
        """The first file's ``delimiter`` and ``header`` as read (detected where configured ``null``)."""
        return self.headers.layout(self.files[0])

    def units(self, say_skipped: bool = True) -> list[Unit]:
        """Every file's blocks of lines; files with a header line and no rows are skipped (:func:`skip_empty`, saying so
        unless ``say_skipped`` is false): :attr:`files` is then the files with rows.

        Raises:
            DataError: every file is a header alone; a file is empty, unreadable or laid out otherwise than configured.
        """
        units, empty = [], []
        for path in self.files:
            found = self._index(path)
            units.extend(found)
            if not found:
                empty.append(path)
        self.files = skip_empty(self.files, empty, "has a header line but no rows", say_skipped, self.headers.path_key)
        return units

    def has_rows(self, path: str) -> bool:
        """Whether ``path`` holds a line after its header, from its first lines: the files :meth:`units` reads."""
        _, data_start, more = self.headers.inspect(path, None)
        return not data_start or more

    def names(self, path: str) -> list[str]:
        """The column names of ``path`` (its header line, or ``data.column_names``)."""
        if path not in self._names:
            self._index(path)
        return self._names[path]

    def header_names(self, read: Collection[str] = ()) -> list[str]:
        """The first file's column names (its header, or ``data.column_names``), without reading its rows
        (:meth:`~recsys_runner.data.files.csv_header.CsvHeaders.header_names`), after checking that none of the columns
        ``read`` (beyond this source's own) is a name it repeats."""
        return self.headers.header_names(self.files[0], self.columns, read)

    def sample(self, num_rows: int, spread: bool = False) -> pa.Table:
        """``num_rows`` rows of the files, every column as text (missing values null), to infer a schema and fit encoders
        from (:mod:`recsys_runner.data.encoding.fit`): the first ones, or with ``spread`` lines spread over the files
        (:meth:`_spread`) where every file is plain text (a compressed file's later lines are reached only by decompressing
        every line before them: its first ones); every row, in order, where the files hold no more. Lines with the wrong
        number of fields are left out; files after the first whose columns are named otherwise are not sampled.

        Raises:
            DataError: a line opens a quote it does not close (with ``data.on_bad_rows=skip``: left out), which would
                end the sample there; a line that is not UTF-8 text.
        """
        if spread and (like := self._like_files()) and not any(self.headers.compression(path) for path, _ in like):
            return self._spread(like, num_rows)
        tables: list[pa.Table] = []
        wanted = num_rows
        for path in self.files:
            names, data_start, delimiter = self._sample_layout(path)
            lines: list[bytes] = []
            numbers: list[int] = []  # each kept line's number in the file (blank lines are left out)
            first_line = self.line_offset(path)
            with self.headers.open_text(path, data_start) as f:
                for k, line in enumerate(f):
                    if line.strip(b"\r\n"):
                        lines.append(line if line.endswith(b"\n") else line + b"\n")
                        numbers.append(first_line + k)
                    if len(lines) >= wanted:
                        break
            if not lines:
                continue
            table = self._lines_table(path, lines, numbers, lambda n: n, names, delimiter)
            if tables and table.column_names != tables[0].column_names:
                break  # a file with other columns: infer from those seen so far
            tables.append(table)
            wanted -= table.num_rows
            if wanted <= 0:
                break
        if not tables:
            raise DataError(f"{self.files[0]} has no data lines to infer a schema from. Fix: point data.path at files with rows")
        return pa.concat_tables(tables)

    def _sample_layout(self, path: str) -> tuple[list[str], int, str]:
        """``path``'s column names, the byte offset of its first data line and its delimiter, for the sample; the first
        file's layout checked against its lines (:meth:`~recsys_runner.data.files.csv_header.CsvHeaders.misread`)."""
        names, data_start, _ = self.headers.inspect(path, self.columns)
        delimiter, header = self.headers.layout(path)
        if path == self.files[0] and (why := self.headers.misread(path, delimiter, header, names)):
            raise DataError(f"{path} does not read as configured.{why}")
        return names, data_start, delimiter

    def _like_files(self) -> list[tuple[str, int]]:
        """The files up to the first with data bytes whose columns are named otherwise than the first's (the head sample
        stops there too), each with the byte offset of its first data line."""
        like: list[tuple[str, int]] = []
        first: list[str] | None = None
        for path in self.files:
            names, data_start, _ = self._sample_layout(path)
            unique = [n for n in names if n not in repeated_names(names)]
            if stores.file_size(path) > data_start and first is not None and unique != first:
                break
            first = first if first is not None else unique
            like.append((path, data_start))
        return like

    def _spread(self, files: list[tuple[str, int]], num_rows: int) -> pa.Table:
        """``num_rows`` non-blank lines of the plain-text ``files`` (each with the byte offset of its first data line): their
        data bytes taken together are cut into :data:`TEXT_SAMPLE_PIECES` even spans, and each
        span's share of the sample is its first lines (a span begins at the first line that starts in it: one ``readline``
        resyncs a seek). A span whose lines run out before its share (lines are longer there) passes the rest on to the
        next, and what is still short is read on after where each span stopped; so files holding no more lines than
        the sample give every line, in order, as the head sample does.

        Why: CTR logs are written in time order, so their first rows are their first hours; a vocabulary fitted on them
        lacks every later value of a column such as ``hour``. The spans cost one seek each, not a scan of the files (the
        newline scan that cuts them into units reads every byte)."""
        ends = [stores.file_size(path) for path, _ in files]
        total = sum(end - start for (_, start), end in zip(files, ends, strict=True))
        k = min(TEXT_SAMPLE_PIECES, num_rows)
        spans: list[list[_Span]] = []
        for i in range(k):
            lo, hi, at = i * total // k, (i + 1) * total // k, 0
            parts = []
            for (path, start), end in zip(files, ends, strict=True):
                a, b = max(lo, at), min(hi, at + end - start)
                if a < b:
                    parts.append(_Span(path, start, start + a - at, start + b - at))
                at += end - start
            spans.append(parts)
        picked: dict[str, list[tuple[int, bytes]]] = {path: [] for path, _ in files}
        short = 0
        for i, parts in enumerate(spans):
            short += (i + 1) * num_rows // k - i * num_rows // k
            for span in parts:
                short -= self._span_lines(span, short, picked[span.path])
        for span in (span for parts in spans for span in parts):
            short -= self._span_lines(span, short, picked[span.path])
        tables = []
        for path, _ in files:
            if lines := sorted(picked[path]):
                names, _, delimiter = self._sample_layout(path)
                tables.append(self._lines_table(path, [line for _, line in lines], [at for at, _ in lines],
                                                partial(self._line_at, path), names, delimiter))
        if not tables:
            raise DataError(f"{self.files[0]} has no data lines to infer a schema from. Fix: point data.path at files with rows")
        return pa.concat_tables(tables)

    def _span_lines(self, span: _Span, n: int, out: list[tuple[int, bytes]]) -> int:
        """Up to ``n`` more non-blank lines that start in ``span`` (from where it stopped), into ``out`` with each one's
        byte offset; how many."""
        if n <= 0 or span.pos >= span.stop:
            return 0
        got = 0
        resync = span.pos > span.data_start and not span.synced
        with stores.open_input(span.path, buffer_bytes=SPAN_BUFFER_BYTES) as f:  # plain text: entered by a seek
            f.seek(span.pos - 1 if resync else span.pos)
            if resync:  # the rest of the line the span begins in (a lone newline where it begins at a line)
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

    def _line_at(self, path: str, offset: int) -> int:
        """The line number (1-based, header counted) of the line of plain-text ``path`` that starts at byte ``offset``: its
        newlines before it counted, for an error message about a line of a spread sample."""
        data_start, count = self.headers.inspect(path, None)[1], 0
        with self.headers.open_text(path, data_start) as f:
            left = offset - data_start
            while left > 0 and (chunk := f.read(min(left, 1 << 24))):
                count += chunk.count(b"\n")
                left -= len(chunk)
        return count + self.line_offset(path)

    def _lines_table(self, path: str, lines: list[bytes], at: list[int], number: Callable[[int], int], names: list[str],
                     delimiter: str) -> pa.Table:
        """The sampled ``lines`` of ``path`` (each ending in a newline; ``at``: where each is, ``number`` its line number) as
        a table of text columns, lines with the wrong number of fields left out.

        Raises:
            DataError: a line opens a quote it does not close (with ``data.on_bad_rows=skip``: left out), which would
                end the sample there; a line that is not UTF-8 text.
        """
        table, invalid = self._sample_table(path, lines, lambda i: number(at[i]), names, delimiter)
        swallowed = table.num_rows + len(invalid) < len(lines) or any('"' in text for text in invalid)
        if swallowed and (quoted := open_quote_lines(b"".join(lines), delimiter)):
            # a line opening a quote swallowed the lines after it, which would end the sample there
            if not self.skip:
                raise DataError(f"bad row in {path}, line {number(at[quoted[0]])}: {open_quote_fix(lines[quoted[0]])}. "
                                f"Or set data.on_bad_rows=skip to skip such rows (they are counted and logged)")
            kept = sorted(set(range(len(lines))) - set(quoted))
            lines, at = [lines[i] for i in kept], [at[i] for i in kept]
            table, _ = self._sample_table(path, lines, lambda i: number(at[i]), names, delimiter)
        return without_repeats(table)

    def _sample_table(self, path: str, lines: list[bytes], number: Callable[[int], int], names: list[str],
                      delimiter: str) -> tuple[pa.Table, list[str]]:
        """``lines`` of ``path`` (each ending in a newline; ``number``: the line number of each, by index) as a table of text columns, and
        the text of each row left out for the wrong number of fields."""
        raw = b"".join(lines)
        invalid: list[str] = []

        def on_invalid(row: pacsv.InvalidRow) -> str:
            invalid.append(row.text)
            return "skip"

        try:
            table = pacsv.read_csv(
                pa.BufferReader(raw),
                read_options=pacsv.ReadOptions(column_names=names, use_threads=False, block_size=len(raw) + 1),
                parse_options=pacsv.ParseOptions(delimiter=delimiter, invalid_row_handler=on_invalid),
                convert_options=pacsv.ConvertOptions(column_types=dict.fromkeys(names, pa.string()), null_values=list(self.null_values),
                                                     strings_can_be_null=True, quoted_strings_can_be_null=True),
            )
        except pa.ArrowInvalid as e:
            if (wrong := not_utf8(raw)) is not None:
                index, at = wrong
                raise DataError(not_utf8_message(path, number(index), lines[index], at)) from None
            raise DataError(f"{path}: its first lines cannot be parsed as delimited text ({str(e).splitlines()[0]}). "
                            f"Fix: check data.delimiter={delimiter!r} and the file's format") from None
        return table, invalid

    def _index(self, path: str) -> list[Unit]:
        names, data_start, more = self.headers.inspect(path, self.columns)
        self._names[path], self._data_start[path] = names, data_start
        if data_start and not more:
            return []  # a header alone: a partitioned writer's empty part, skipped by units()
        codec = self.headers.compression(path)
        if codec is not None:
            return [stream_unit(path, codec, data_start, self.headers.path_key)]
        return line_blocks(path, data_start, self.block_rows)

    def line_offset(self, path: str) -> int:
        """Line number of file row ``r`` is ``r + line_offset`` (1-based, header counted)."""
        return self.headers.line_offset(path)

    def read(self, unit: Unit) -> Iterator[tuple[pa.Table, np.ndarray]]:
        """The unit as tables of text columns (a block of lines: one table; a compressed file: one per
        :data:`~recsys_runner.data.files.compression.STREAM_CHUNK_BYTES` of its text), and the 0-based file row of each
        of their rows."""
        if unit.compression is not None:
            yield from self._read_stream(unit)
            return
        start, stop = unit.byte_range
        try:
            with stores.open_input(unit.path) as f:
                f.seek(start)
                raw = f.read(stop - start)
        except OSError as e:
            raise unreadable(unit.path, e) from None
        yield self._parse(unit.path, raw, unit.first_row, unit.num_rows, unit.part)

    def _read_stream(self, unit: Unit) -> Iterator[tuple[pa.Table, np.ndarray]]:
        """A compressed file's lines, decompressed chunk by chunk, each chunk cut at its last newline and parsed."""
        codec = self.headers.compression(unit.path)
        assert codec is not None and self.names(unit.path)  # indexed: names and data start known
        first, tail = 0, b""
        for chunk in compressed.chunks(unit.path, codec, self._data_start[unit.path], self.headers.path_key):
            text = tail + chunk
            cut = text.rfind(b"\n") + 1
            text, tail = text[:cut], text[cut:]
            if text:
                n = text.count(b"\n")
                yield self._parse(unit.path, text, first, n, f"rows {first}-{first + n - 1}")
                first += n
        if tail:
            yield self._parse(unit.path, tail, first, 1, f"row {first}")

    def _parse(self, path: str, raw: bytes, first_row: int, num_rows: int, part: str) -> tuple[pa.Table, np.ndarray]:
        """``num_rows`` lines of ``path`` (``raw``, from its file row ``first_row``; ``part`` names them) as a table of text
        columns, and the 0-based file row of each of its rows."""
        delimiter = self.headers.layout(path)[0]
        table, invalid = self._read_text(path, raw, part, first_row)
        swallowed = table.num_rows + len(invalid) < num_rows or any('"' in text for *_, text in invalid)
        if swallowed and (quoted := open_quote_lines(raw, delimiter)):
            # a line opening a quote swallowed the lines after it: it alone is the bad row, the others are read
            lines = raw.split(b"\n")
            if not self.skip:
                raise DataError(f"bad row in {path}, line {first_row + quoted[0] + self.line_offset(path)}: "
                                f"{open_quote_fix(lines[quoted[0]])}. Or set data.on_bad_rows=skip to skip such rows (they are "
                                f"counted and logged)")
            for i in quoted:
                lines[i] = b""  # an empty line: a bad row of its own, counted below
            table, invalid = self._read_text(path, b"\n".join(lines), part, first_row)
        file_rows = np.arange(first_row, first_row + num_rows)
        if not self.skip and (blank := _first_blank_line(raw)) is not None:
            raise DataError(f"bad row in {path}, line {first_row + blank + self.line_offset(path)}: the line is empty (a blank line "
                            f"between the rows or after the last one is a row without a label). Fix: remove the blank lines (e.g. "
                            f"sed -i '/^\\s*$/d' {path}), or set data.on_bad_rows=skip to skip such rows (they are counted and logged)")
        if invalid:
            number, expected, actual, text = invalid[0]
            if not self.skip:
                line = f"line {first_row + number + self.line_offset(path) - 1}" if number is not None else part
                hint = delimiter_hint(text, delimiter, self.headers.fixed_layout) if actual == 1 else ""
                raise DataError(
                    f"bad row in {path}, {line}: expected {expected} fields separated by {delimiter!r}, found {actual} "
                    f"({text[:80]!r})." + (hint or " Fix the line, or set data.on_bad_rows=skip to skip such rows (they are counted and logged)")
                )
            self.num_bad_rows += len(invalid)
            dropped = [first_row + num - 1 for num, *_ in invalid if num is not None]
            file_rows = np.setdiff1d(file_rows, dropped)[: table.num_rows]
        return table, file_rows

    def _read_text(self, path: str, raw: bytes, part: str, first_row: int) -> tuple[pa.Table, list[tuple[int | None, int, int, str]]]:
        """Lines of ``path`` (``raw``, from its file row ``first_row``; ``part`` names them) as a table of text columns, and
        the lines with the wrong number of fields: (1-based number in ``raw``, fields expected, found, text)."""
        names = self.names(path)
        delimiter = self.headers.layout(path)[0]
        invalid: list[tuple[int | None, int, int, str]] = []

        def on_invalid(row: pacsv.InvalidRow) -> str:
            invalid.append((row.number, row.expected_columns, row.actual_columns, row.text))
            return "skip"

        try:
            table = pacsv.read_csv(
                pa.BufferReader(raw),
                read_options=pacsv.ReadOptions(column_names=names, use_threads=False, block_size=max(1 << 20, len(raw) + 1)),
                parse_options=pacsv.ParseOptions(delimiter=delimiter, ignore_empty_lines=False, invalid_row_handler=on_invalid),
                convert_options=pacsv.ConvertOptions(
                    include_columns=self.columns,
                    column_types=dict.fromkeys(self.columns, pa.string()),
                    null_values=list(self.null_values),
                    strings_can_be_null=True,
                    quoted_strings_can_be_null=True,
                ),
            )
        except pa.ArrowInvalid as e:
            if (wrong := not_utf8(raw)) is not None:
                index, at = wrong
                raise DataError(not_utf8_message(path, first_row + index + self.line_offset(path), raw.split(b"\n")[index], at)) from None
            raise DataError(f"{path}, {part}: cannot be parsed as delimited text ({str(e).splitlines()[0]}). "
                            f"Fix: check data.delimiter={delimiter!r} and the file's format") from None
        return table, invalid


def _first_blank_line(raw: bytes) -> int | None:
    """The 0-based index of the first empty line of ``raw`` (lines, each ending in a newline), or ``None``.

    Why: Arrow reads an empty line as a row of nulls, whose first bad value (a missing label) was what the message named,
    sending the user to look for a label in a line with nothing on it. Searched only where ``raw`` holds an empty line."""
    if not (raw.startswith((b"\n", b"\r\n")) or b"\n\n" in raw or b"\n\r\n" in raw):
        return None
    return next(i for i, line in enumerate(raw.split(b"\n")) if not line.rstrip(b"\r"))
