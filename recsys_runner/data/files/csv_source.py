"""The delimited-text source (CSV, TSV, Criteo; plain or compressed): each file's layout read and checked
(:mod:`~recsys_runner.data.files.csv_header`), its lines cut into units of ``block_rows`` lines by one newline scan
(:mod:`~recsys_runner.data.files.csv_blocks`), each unit parsed as text (every field a string, converted by the encoder,
which names the exact line of a bad field); a line that opens a quote it does not close, or that is not UTF-8, is named with
its line and the fix. The unit is in :mod:`~recsys_runner.data.files.sources`, the Parquet source in
:mod:`~recsys_runner.data.files.parquet_source`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterator
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from recsys_runner import stores
from recsys_runner.data.files import compression as compressed
from recsys_runner.data.files.compression import Compression
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
from recsys_runner.data.files.spread_sample import file_shares, spread_lines
from recsys_runner.errors import DataError

log = logging.getLogger(__name__)

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
        (:mod:`~recsys_runner.data.files.spread_sample`): over their bytes where every file is plain text (:meth:`_spread`),
        else over the first lines of each file (:meth:`_file_heads`: a compressed file's later lines are reached only by
        decompressing every line before them); every row, in order, where the files hold no more. Lines with the wrong
        number of fields are left out; files after the first whose columns are named otherwise are not sampled.

        Raises:
            DataError: a line opens a quote it does not close (with ``data.on_bad_rows=skip``: left out), which would
                end the sample there; a line that is not UTF-8 text.
        """
        if spread and (like := self._like_files()):
            if not any(self.headers.compression(path) for path, _ in like):
                return self._spread(like, num_rows)
            return self._file_heads([path for path, _ in like], num_rows)
        tables: list[pa.Table] = []
        wanted = num_rows
        for path in self.files:
            lines, numbers, _ = self._first_lines(path, wanted)
            if not lines:
                continue
            table = self._head_table(path, lines, numbers)
            if tables and table.column_names != tables[0].column_names:
                break  # a file with other columns: infer from those seen so far
            tables.append(table)
            wanted -= table.num_rows
            if wanted <= 0:
                break
        if not tables:
            raise DataError(f"{self.files[0]} has no data lines to infer a schema from. Fix: point data.path at files with rows")
        return pa.concat_tables(tables)

    def _first_lines(self, path: str, n: int, skip: int = 0) -> tuple[list[bytes], list[int], bool]:
        """Up to ``n`` non-blank data lines of ``path`` from its first one on (the first ``skip`` of them passed over), each
        ending in a newline, with each one's line number (1-based, header counted), and whether the file holds more."""
        data_start = self._sample_layout(path)[1]
        lines: list[bytes] = []
        numbers: list[int] = []  # each kept line's number in the file (blank lines are left out)
        first_line, seen = self.line_offset(path), 0
        with self.headers.open_text(path, data_start) as f:
            for k, line in enumerate(f):
                if len(lines) >= n:
                    return lines, numbers, True
                if line.strip(b"\r\n"):
                    seen += 1
                    if seen > skip:
                        lines.append(line if line.endswith(b"\n") else line + b"\n")
                        numbers.append(first_line + k)
        return lines, numbers, False

    def _head_table(self, path: str, lines: list[bytes], numbers: list[int]) -> pa.Table:
        """``lines`` of ``path`` read from its start (``numbers``: their line numbers) as a sample's table."""
        names, _, delimiter = self._sample_layout(path)
        return self._lines_table(path, lines, numbers, lambda n: n, names, delimiter)

    def _file_heads(self, files: list[str], num_rows: int) -> pa.Table:
        """``num_rows`` lines of ``files`` (some compressed) spread over the files: each file (or each of evenly spaced ones,
        :func:`~recsys_runner.data.files.spread_sample.file_shares`) gives its share from its first lines, a file short of
        lines passing the rest on to the next, and what is still short read on in the files that hold more; so files
        holding no more lines than the sample give every line, in order, as the head sample does.

        Why: a compressed file cannot be entered in the middle, but files written one a day (Criteo's ``day_0.gz`` …
        ``day_23.gz``) can each be entered at their start: the sample then holds every day, not the first day's first
        lines. A single compressed file still gives its first lines, which is said (:func:`_say_head`)."""
        read: dict[str, tuple[list[bytes], list[int]]] = {}
        more: list[str] = []
        short = 0
        for path, share in file_shares(files, num_rows):
            lines, numbers, rest = self._first_lines(path, share + short)
            read[path] = lines, numbers
            short += share - len(lines)
            if rest:
                more.append(path)
        for path in more:
            if short <= 0:
                break
            lines, numbers = read[path]
            extra, extra_numbers, _ = self._first_lines(path, short, skip=len(lines))
            read[path] = lines + extra, numbers + extra_numbers
            short -= len(extra)
        tables = [self._head_table(path, *read[path]) for path in files if path in read and read[path][0]]
        if not tables:
            raise DataError(f"{self.files[0]} has no data lines to infer a schema from. Fix: point data.path at files with rows")
        if more:
            _say_head(more, len(read), self.headers.compression(more[0]), num_rows)
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
        """``num_rows`` non-blank lines of the plain-text ``files`` (each with the byte offset of its first data line), read
        from even spans of their data bytes (:func:`~recsys_runner.data.files.spread_sample.spread_lines`); an error about
        a line names its true line number (:meth:`_line_at`)."""
        picked = spread_lines(files, num_rows)
        tables = []
        for path, _ in files:
            if lines := picked[path]:
                names, _, delimiter = self._sample_layout(path)
                tables.append(self._lines_table(path, [line for _, line in lines], [at for at, _ in lines],
                                                partial(self._line_at, path), names, delimiter))
        if not tables:
            raise DataError(f"{self.files[0]} has no data lines to infer a schema from. Fix: point data.path at files with rows")
        return pa.concat_tables(tables)

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


def _say_head(more: list[str], read: int, codec: Compression | None, num_rows: int) -> None:
    """Say (rank 0) that a spread sample of ``num_rows`` lines was taken from the first lines of ``read`` files, of which
    ``more`` (the first one ``codec``-compressed) hold more lines than it read: a warning naming the fix for one file (its
    later rows are not in the sample at all), an info line for several.

    Why: a single compressed file sorted by time (Avazu's ``train.csv.gz``) is fitted on its first hours alone, and the
    warning on unseen values (:mod:`recsys_runner.train.loop`) comes only after training has read the later ones."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    kind = f"{codec.name}-compressed" if codec is not None else "read with compressed files"
    if read == 1:
        log.warning("%s is %s: the encoders (vocabularies, table sizes, zscore statistics) are fitted on its FIRST %d lines "
                    "(data.infer.sample_rows), because a line further on is reached only by decompressing every line before "
                    "it; a file sorted by time is fitted on its first hours alone. Fix: convert it to Parquet once (python -m "
                    "recsys_runner.data convert), whose sample is spread over all its rows, or decompress it, or split it into "
                    "several files (each is then sampled from its start)", more[0], kind, num_rows)
    else:
        log.info("the sample of %d rows (data.infer.sample_rows) is spread over %d compressed files, each giving its share "
                 "from its first lines (a compressed file is read from its start); for a sample spread within each file too, "
                 "convert them to Parquet (python -m recsys_runner.data convert)", num_rows, read)


def _first_blank_line(raw: bytes) -> int | None:
    """The 0-based index of the first empty line of ``raw`` (lines, each ending in a newline), or ``None``.

    Why: Arrow reads an empty line as a row of nulls, whose first bad value (a missing label) was what the message named,
    sending the user to look for a label in a line with nothing on it. Searched only where ``raw`` holds an empty line."""
    if not (raw.startswith((b"\n", b"\r\n")) or b"\n\n" in raw or b"\n\r\n" in raw):
        return None
    return next(i for i, line in enumerate(raw.split(b"\n")) if not line.rstrip(b"\r"))
