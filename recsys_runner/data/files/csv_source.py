"""The delimited-text source (CSV, TSV, Criteo; plain or compressed): a file's layout (delimiter, header) detected or
checked, its lines cut into units of ``block_rows`` lines by one newline scan, each unit parsed as text (every field a
string, converted by the encoder, which names the exact line of a bad field); a line that opens a quote it does not
close, or that is not UTF-8, is named with its line and the fix. The unit and the Parquet source are in
:mod:`~recsys_runner.data.files.sources`."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from recsys_runner import stores
from recsys_runner.data.files import compression as compressed
from recsys_runner.data.files.compression import Compression
from recsys_runner.data.files.layout import (
    delimiter_hint,
    detect_delimiter,
    looks_like_data,
    looks_like_header,
    not_utf8,
    not_utf8_message,
    open_quote_fix,
    open_quote_lines,
    split_fields,
)
from recsys_runner.data.files.sources import PARQUET_MAGIC, SNIFF_BYTES, Unit, looks_like_text, read_head, skip_empty, unreadable
from recsys_runner.errors import DataError

log = logging.getLogger(__name__)


DELIMITER_OPTIONS = {"\t": "tab", ",": "comma", ";": "semicolon", "|": "pipe"}
"""How each detectable delimiter is written on the command line (``data.delimiter=comma``)."""



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
    ) -> None:
        self.files, self.columns = files, columns
        self.delimiter, self.header, self.column_names = delimiter, header, column_names
        """As configured; ``None``: detected per file (:meth:`layout`)."""
        self.null_values, self.block_rows, self.skip = null_values, block_rows, on_bad_rows == "skip"
        self.header_key = header_key
        """The setting ``header`` comes from, for messages: ``data.header``, or ``data.eval_header`` for eval files."""
        self.follows_training = follows_training
        """Eval files read with the training files' ``header`` (``data.eval_header=null``): one laid out otherwise (a header
        line where those have none, or none where they have one) is refused, naming ``data.eval_header``."""
        self.num_bad_rows = 0
        self._names: dict[str, list[str]] = {}
        self._data_start: dict[str, int] = {}
        self._layouts: dict[str, tuple[str, bool]] = {}
        self._compressions: dict[str, Compression | None] = {}

    def compression(self, path: str) -> Compression | None:
        """``path``'s compression, told by its first bytes (``None``: plain text)."""
        if path not in self._compressions:
            self._compressions[path] = compressed.detect(path, read_head(path))
        return self._compressions[path]

    def _open(self, path: str, start: int = 0) -> AbstractContextManager[IO[bytes]]:
        """``path``'s text (decompressed) from byte ``start`` of it on."""
        return compressed.open_text(path, self.compression(path), start)

    def _first_lines(self, path: str, n: int = 2) -> list[str]:
        lines = []
        with self._open(path) as f:
            for raw in f:
                if line := raw.decode("utf-8", errors="replace").rstrip("\r\n"):
                    lines.append(line)
                if len(lines) >= n:
                    break
        return lines

    def layout(self, path: str) -> tuple[str, bool]:
        """``path``'s delimiter and whether its first line is a header: as configured, or detected from its first lines
        where ``data.delimiter`` / ``data.header`` is null.

        Raises:
            DataError: nothing to detect from, or a header-less file without ``data.column_names``.
        """
        if path in self._layouts:
            return self._layouts[path]
        delimiter, header = self.delimiter, self.header
        lines = self._first_lines(path) if delimiter is None or header is None else []
        if delimiter is None:
            delimiter = detect_delimiter(lines) if lines else None
            if delimiter is None:
                shown = repr(lines[0][:120]) if lines else "nothing"
                raise DataError(f"{path}: cannot detect its delimiter (data.delimiter=null): its first line is {shown}, split alike "
                                f"by none of tab, comma, semicolon, pipe. Fix: set data.delimiter (tab, comma, semicolon, pipe, or the character)")
        if header is None:
            header = bool(lines) and looks_like_header(lines, delimiter)
            if not header and not self.column_names:
                raise DataError(f"{path}: its first line {lines[0][:120]!r} looks like data, not a header naming the columns "
                                f"(data.header=null detects it). Fix: data.column_names=[...] (all columns, in file order), or data.header=true")
        self._layouts[path] = (delimiter, header)
        return delimiter, header

    def detected(self) -> tuple[str, bool]:
        """The first file's ``delimiter`` and ``header`` as read (detected where configured ``null``)."""
        return self.layout(self.files[0])

    def _misread(self, path: str, delimiter: str, header: bool, names: list[str]) -> str:
        """Why ``path`` may be misread with ``delimiter``/``header`` (``names`` the columns it gets): what its first lines
        look like instead, and the settings that read them; ``""`` when they fit."""
        lines = self._first_lines(path)
        if not lines:
            return ""
        data = lines[1:] if header else lines
        found = detect_delimiter(lines)
        seen = (f"Its first line is {lines[0][:100]!r}" + (f", detected: delimiter {DELIMITER_OPTIONS.get(found, found)!r}" if found else "")
                + (f", a header line ({', '.join(split_fields(lines[0], found)[:6])})" if found and looks_like_header(lines, found) else "")
                if found else f"Its first line is {lines[0][:100]!r}")
        fields = len(split_fields(data[0], delimiter)) if data else len(names)
        if fields != len(names) and (fields == 1 or (found is not None and found != delimiter)):
            fix = []
            if found and found != delimiter:
                fix.append(f"data.delimiter={DELIMITER_OPTIONS.get(found, found)}")
            if found and looks_like_header(lines, found) and not header:
                fix.append("data.header=true")
            return (f" The lines split into {fields} field(s) by data.delimiter={delimiter!r}, but "
                    f"{'the header' if header else 'data.column_names'} names {len(names)} columns {names}: the wrong delimiter"
                    f"{' or header' if not header else ''}? {seen}. Fix: {' '.join(fix) or 'set data.delimiter and data.header to match the file'} "
                    f"(or data.delimiter=null data.header=null to detect both)")
        if not header and found == delimiter and looks_like_header(lines, delimiter):
            return (f" {seen}: it names columns, but data.header=false reads it as data. Fix: data.header=true (data.column_names then "
                    f"replaces its names), or data.header=null to detect it")
        return ""

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
        self.files = skip_empty(self.files, empty, "has a header line but no rows", say_skipped)
        return units

    def has_rows(self, path: str) -> bool:
        """Whether ``path`` holds a line after its header, from its first lines: the files :meth:`units` reads."""
        _, data_start, more = self._header(path, check_columns=False)
        return not data_start or more

    def names(self, path: str) -> list[str]:
        """The column names of ``path`` (its header line, or ``data.column_names``)."""
        if path not in self._names:
            self._index(path)
        return self._names[path]

    def _header(self, path: str, *, check_columns: bool = True) -> tuple[list[str], int, bool]:
        """``path``'s column names, the byte offset of its first data line (in its decompressed text) and whether a line
        follows the first, after checking it is delimited text (and, with ``check_columns``, that it holds the config's
        columns: not for :meth:`has_rows`, which also sees predict inputs without a label)."""
        head = read_head(path)
        if head.startswith(PARQUET_MAGIC):
            raise DataError(f"{path} looks like a Parquet file (it begins with Parquet's magic bytes {PARQUET_MAGIC.decode()}), "
                            f"but this data option reads delimited text. Fix: use data=parquet data.path={path}")
        codec = self.compression(path)
        if codec is not None:
            with self._open(path) as f:
                head = f.read(SNIFF_BYTES)
        if not looks_like_text(head):
            what = f"its first {len(head)} bytes" + (f", decompressed ({codec.name})" if codec else "")
            raise DataError(f"{path} is not a text file (NUL bytes in {what}), but this data option reads "
                            f"delimited text, one record per line. Fix: point data.path at CSV/TSV files (plain, or gzip/bz2/zstd-"
                            f"compressed), or choose the data option of the file's format, e.g. data=parquet")
        with self._open(path) as f:
            first_line = f.readline()
            more = bool(f.read(1))
        if not first_line or (self.header is not False and not more and not first_line.strip(b"\r\n")):
            raise DataError(f"{path} is an empty file" + (f" (once decompressed, {codec.name})" if codec else "")
                            + ". Fix: remove it from data.path, or write it again")
        delimiter, header = self.layout(path)
        if self.follows_training and not header and looks_like_header(lines := self._first_lines(path), delimiter):
            raise DataError(f"{path} begins with a header line ({lines[0][:100]!r}), but the training files (data.path) have none "
                            f"({self.header_key}=null reads eval files as data.header=false does), so it would be read as a row of "
                            f"data: a header mismatch. Fix: data.eval_header=true (the line is skipped; data.column_names names "
                            f"the columns), or remove the line from the eval file")
        if header:
            names = split_fields(first_line.decode("utf-8", errors="replace").rstrip("\r\n"), delimiter)
            data_start = len(first_line)
            if self.column_names:  # names of the config's replace the header's
                if len(self.column_names) != len(names):
                    raise DataError(f"{path}'s header names {len(names)} columns {names}, but data.column_names lists {len(self.column_names)} "
                                    f"{list(self.column_names)}. Fix: list one name per column of the file, or data.column_names=null")
                names = list(self.column_names)
        else:
            assert self.column_names is not None
            names, data_start = list(self.column_names), 0
        missing = [c for c in self.columns if c not in names] if check_columns else []
        if missing:
            if header and len(names) == 1 and (hint := delimiter_hint(names[0], delimiter)):
                raise DataError(f"{path} has no column {missing[0]!r}: its header line is one column, {names[0]!r}.{hint}")
            if header and looks_like_data(lines := self._first_lines(path), delimiter):
                raise DataError(self._not_a_header(path, missing[0], lines[0]))
            where = "its header" if header else "data.column_names"
            raise DataError(f"{path} has no column {missing[0]!r}; {where} lists {names}. Fix: correct the column names in "
                            f"data.label(s) / data.dense / data.sparse" + ("" if header else " or data.column_names")
                            + self._misread(path, delimiter, header, names))
        return names, data_start, more

    def _not_a_header(self, path: str, column: str, first: str) -> str:
        """The message for a file whose first line, read as the header, is data: the cause and the fix."""
        said = f"{self.header_key}=null (as data.header=true)" if self.follows_training else f"{self.header_key}=true"
        cause = f"{path} has no column {column!r}: its first line {first[:100]!r} looks like data, not a header naming the columns, " \
                f"but {said} reads it as the header"
        if self.follows_training:
            return (f"{cause}; the training files (data.path) have a header line, this eval file has none: a header mismatch. "
                    f"Fix: data.eval_header=false (every line of the eval files is data, under the training header's column "
                    f"names in file order, or data.column_names), or add the header line to the eval file")
        if self.header_key != "data.header":
            return f"{cause}. Fix: {self.header_key}=false (every line is data, under the training header's column names or data.column_names)"
        return (f"{cause}. Fix: data.header=false data.column_names=[...] (the names of all columns, in file order), or "
                f"data.header=null to detect it")

    def header_names(self) -> list[str]:
        """The first file's column names (its header, or ``data.column_names``), without reading its rows; a header
        that is one column split by another delimiter than ``data.delimiter`` is the wrong delimiter, said so."""
        names = self._header(self.files[0])[0]
        delimiter, header = self.layout(self.files[0])
        if header and len(names) == 1 and (hint := delimiter_hint(names[0], delimiter)):
            raise DataError(f"{self.files[0]} has no column 'label': its header line is one column, {names[0]!r}.{hint}")
        return names

    def sample(self, num_rows: int) -> pa.Table:
        """The first ``num_rows`` rows of the files (in order), every column as text (missing values null), to infer
        a schema from (:mod:`recsys_runner.data.encoding.fit`); lines with the wrong number of fields are left out.

        Raises:
            DataError: a line opens a quote it does not close (with ``data.on_bad_rows=skip``: left out), which would
                end the sample there; a line that is not UTF-8 text.
        """
        tables: list[pa.Table] = []
        wanted = num_rows
        for path in self.files:
            names, data_start, _ = self._header(path)
            delimiter, header = self.layout(path)
            if path == self.files[0] and (why := self._misread(path, delimiter, header, names)):
                raise DataError(f"{path} does not read as configured.{why}")
            lines: list[bytes] = []
            numbers: list[int] = []  # each kept line's number in the file (blank lines are left out)
            first_line = self.line_offset(path)
            with self._open(path, data_start) as f:
                for k, line in enumerate(f):
                    if line.strip(b"\r\n"):
                        lines.append(line if line.endswith(b"\n") else line + b"\n")
                        numbers.append(first_line + k)
                    if len(lines) >= wanted:
                        break
            if not lines:
                continue
            table, invalid = self._sample_table(path, lines, numbers, names, delimiter)
            swallowed = table.num_rows + len(invalid) < len(lines) or any('"' in text for text in invalid)
            if swallowed and (quoted := open_quote_lines(b"".join(lines), delimiter)):
                # a line opening a quote swallowed the lines after it, which would end the sample there
                if not self.skip:
                    raise DataError(f"bad row in {path}, line {numbers[quoted[0]]}: {open_quote_fix(lines[quoted[0]])}. "
                                    f"Or set data.on_bad_rows=skip to skip such rows (they are counted and logged)")
                kept = sorted(set(range(len(lines))) - set(quoted))
                lines, numbers = [lines[i] for i in kept], [numbers[i] for i in kept]
                table, _ = self._sample_table(path, lines, numbers, names, delimiter)
            if tables and table.column_names != tables[0].column_names:
                break  # a file with other columns: infer from those seen so far
            tables.append(table)
            wanted -= table.num_rows
            if wanted <= 0:
                break
        if not tables:
            raise DataError(f"{self.files[0]} has no data lines to infer a schema from. Fix: point data.path at files with rows")
        return pa.concat_tables(tables)

    def _sample_table(self, path: str, lines: list[bytes], numbers: list[int], names: list[str], delimiter: str) -> tuple[pa.Table, list[str]]:
        """``lines`` of ``path`` (each ending in a newline; ``numbers``: their line numbers) as a table of text columns, and
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
                raise DataError(not_utf8_message(path, numbers[index], lines[index], at)) from None
            raise DataError(f"{path}: its first lines cannot be parsed as delimited text ({str(e).splitlines()[0]}). "
                            f"Fix: check data.delimiter={delimiter!r} and the file's format") from None
        return table, invalid

    def _index(self, path: str) -> list[Unit]:
        names, data_start, more = self._header(path)
        self._names[path], self._data_start[path] = names, data_start
        if data_start and not more:
            return []  # a header alone: a partitioned writer's empty part, skipped by units()
        codec = self.compression(path)
        if codec is not None:
            return [self._count_stream(path, codec, data_start)]
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
                picks = newlines[line_numbers % self.block_rows == 0]
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
            first = b * self.block_rows
            n = min(self.block_rows, num_lines - first)
            if n <= 0:
                break
            stop = starts[b + 1] if b + 1 < len(starts) else size
            units.append(Unit(path, b, first, n, (start, stop)))
        return units

    def _count_stream(self, path: str, codec: Compression, data_start: int) -> Unit:
        """A compressed file as one unit: its lines counted by decompressing it once (no parsing)."""
        started, num_lines, last_byte = time.monotonic(), 0, b"\n"
        for chunk in compressed.chunks(path, codec, data_start):
            num_lines += chunk.count(b"\n")
            last_byte = chunk[-1:]
        if last_byte != b"\n":
            num_lines += 1  # a last line without a newline
        if int(os.environ.get("RANK", "0")) == 0:
            log.info("%s is %s-compressed: %d rows, counted by decompressing it once (%.1f s); it is read as one stream, "
                     "from its start", path, codec.name, num_lines, time.monotonic() - started)
        return Unit(path, 0, 0, num_lines, compression=codec.name)

    def line_offset(self, path: str) -> int:
        """Line number of file row ``r`` is ``r + line_offset`` (1-based, header counted)."""
        return 2 if self.layout(path)[1] else 1

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
        codec = self.compression(unit.path)
        assert codec is not None and self.names(unit.path)  # indexed: names and data start known
        first, tail = 0, b""
        for chunk in compressed.chunks(unit.path, codec, self._data_start[unit.path]):
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
        delimiter = self.layout(path)[0]
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
        if invalid:
            number, expected, actual, text = invalid[0]
            if not self.skip:
                line = f"line {first_row + number + self.line_offset(path) - 1}" if number is not None else part
                hint = delimiter_hint(text, delimiter) if actual == 1 else ""
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
        delimiter = self.layout(path)[0]
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
