"""How each delimited text file is laid out, read from its first lines and checked against the config: its compression,
delimiter and header (as configured, or detected where ``data.delimiter`` / ``data.header`` is null), its column names and
the byte where its rows begin. A file laid out otherwise than configured (the wrong delimiter, a header line where none is
expected or none where one is, an eval file unlike the training files, a Parquet or binary file, an empty one) is a
:class:`~recsys_runner.errors.DataError` naming what its first lines look like and the settings that read them. The
source that reads the rows is :mod:`~recsys_runner.data.files.csv_source`; what one file's first lines say on their own
(a delimiter detected, a header recognized) is :mod:`~recsys_runner.data.files.layout`."""

from __future__ import annotations

from collections.abc import Collection
from contextlib import AbstractContextManager
from typing import IO

from recsys_runner.data.files import compression as compressed
from recsys_runner.data.files.compression import Compression
from recsys_runner.data.files.layout import (
    delimiter_hint,
    detect_delimiter,
    looks_like_data,
    looks_like_header,
    split_fields,
)
from recsys_runner.data.files.sources import (
    PARQUET_MAGIC,
    SNIFF_BYTES,
    check_unique_names,
    closest_column,
    lacks_training_column,
    looks_like_text,
    read_head,
)
from recsys_runner.data.files.tabular_config import MULTI_CHARACTER_FIX
from recsys_runner.errors import DataError

BOM = "\ufeff"
"""The byte order mark some writers (Excel's "CSV UTF-8", Windows Notepad) put before a file's first line: not part of
its first column's name (Arrow's parser skips it before the rows too)."""
DELIMITER_OPTIONS = {"\t": "tab", ",": "comma", ";": "semicolon", "|": "pipe"}
"""How each detectable delimiter is written on the command line (``data.delimiter=comma``)."""


class CsvHeaders:
    """The layout of each file of a delimited-text source (:class:`~recsys_runner.data.files.csv_source.CsvSource`): the
    reader settings it was given, and per file what was read or detected from its first lines, read once.
    """

    def __init__(
        self,
        *,
        delimiter: str | None,
        header: bool | None,
        column_names: list[str] | None,
        header_key: str = "data.header",
        follows_training: bool = False,
        names_key: str = "data.column_names",
        names_said: str = "the training header's column names in file order, or data.column_names",
        path_key: str = "data.path",
        what: str = "eval file",
        fixed_layout: str | None = None,
        reference: tuple[str, list[str]] | None = None,
    ) -> None:
        self.delimiter, self.header, self.column_names = delimiter, header, column_names
        """As configured; ``None``: detected per file (:meth:`layout`)."""
        self.reference = reference
        """For files read with the training files' columns (eval files): the first training file and its column names, so
        a column these files lack but it holds is named as this file's mistake, not the config's."""
        self.fixed_layout = fixed_layout
        """For a format that fixes the delimiter and the header (``data=criteo``, which has no keys for them): what it reads
        and the fix, said instead of ``data.delimiter`` / ``data.header`` when a file is laid out otherwise (another
        delimiter, a header line)."""
        self.header_key = header_key
        """The setting ``header`` comes from, for messages: ``data.header``, ``data.eval_header`` for eval files, or
        ``data.items.header`` for the item catalogue's."""
        self.follows_training = follows_training
        """Files read with the training files' ``header`` (``data.eval_header=null``, ``data.items.header=null``): one laid out
        otherwise (a header line where those have none, or none where they have one) is refused, naming ``header_key``."""
        self.names_key, self.names_said, self.path_key, self.what = names_key, names_said, path_key, what
        """For messages: the setting ``column_names`` comes from, what names the columns of a file without a header line,
        the setting naming the files, and what one file is (``eval file``, ``catalogue file``) when it follows the training
        files."""
        self._layouts: dict[str, tuple[str, bool]] = {}
        self._compressions: dict[str, Compression | None] = {}

    def compression(self, path: str) -> Compression | None:
        """``path``'s compression, told by its first bytes (``None``: plain text)."""
        if path not in self._compressions:
            self._compressions[path] = compressed.detect(path, read_head(path), self.path_key)
        return self._compressions[path]

    def open_text(self, path: str, start: int = 0) -> AbstractContextManager[IO[bytes]]:
        """``path``'s text (decompressed) from byte ``start`` of it on."""
        return compressed.open_text(path, self.compression(path), start, self.path_key)

    def first_lines(self, path: str, n: int = 2) -> list[str]:
        """``path``'s first ``n`` non-empty lines as text (bytes that are not UTF-8 replaced), to detect or check its layout."""
        lines = []
        with self.open_text(path) as f:
            for i, raw in enumerate(f):
                if line := _line(raw, first=i == 0):
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
        lines = self.first_lines(path) if delimiter is None or header is None else []
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

    def misread(self, path: str, delimiter: str, header: bool, names: list[str]) -> str:
        """Why ``path`` may be misread with ``delimiter``/``header`` (``names`` the columns it gets): what its first lines
        look like instead, and the settings that read them; ``""`` when they fit."""
        lines = self.first_lines(path)
        if not lines:
            return ""
        data = lines[1:] if header else lines
        found = detect_delimiter(lines)
        seen = (f"Its first line is {lines[0][:100]!r}" + (f", detected: delimiter {DELIMITER_OPTIONS.get(found, found)!r}" if found else "")
                + (f", a header line ({', '.join(split_fields(lines[0], found)[:6])})" if found and looks_like_header(lines, found) else "")
                if found else f"Its first line is {lines[0][:100]!r}")
        fields = len(split_fields(data[0], delimiter)) if data else len(names)
        # data.column_names of another length than every first line (never one bad row, which data.on_bad_rows handles)
        alike = not header and len(data) > 1 and all(len(split_fields(line, delimiter)) == fields for line in self.first_lines(path, 3))
        if fields != len(names) and (fields == 1 or alike or (found is not None and found != delimiter)):
            if alike and fields > 2 and all(not f for f in split_fields(data[0], delimiter)[1::2]):  # ml-1m's '::' read by ':'
                return (f" {seen}: its fields are separated by {delimiter * 2!r}, which data.delimiter={delimiter!r} splits into "
                        f"{fields} fields, every other one empty, where data.column_names names "
                        f"{len(names)} columns {names}. Fix: {MULTI_CHARACTER_FIX}")
            fix = []
            if found and found != delimiter:
                fix.append(f"data.delimiter={DELIMITER_OPTIONS.get(found, found)}")
            if found and looks_like_header(lines, found) and not header:
                fix.append("data.header=true")
            if alike and not fix:
                fix.append(f"data.column_names naming all {fields} columns in file order, or set data.delimiter to match the file")
            return (f" The lines split into {fields} field(s) by data.delimiter={delimiter!r}, but "
                    f"{'the header' if header else 'data.column_names'} names {len(names)} columns {names}: the wrong delimiter"
                    f"{' or header' if not header else ''}? {seen}. Fix: {' '.join(fix) or 'set data.delimiter and data.header to match the file'} "
                    f"(or data.delimiter=null data.header=null to detect both)")
        if not header and found == delimiter and looks_like_header(lines, delimiter):
            return (f" {seen}: it names columns, but data.header=false reads it as data. Fix: data.header=true (data.column_names then "
                    f"replaces its names), or data.header=null to detect it")
        return ""

    def inspect(self, path: str, columns: list[str] | None, read: Collection[str] = ()) -> tuple[list[str], int, bool]:
        """``path``'s column names, the byte offset of its first data line (in its decompressed text) and whether a line
        follows the first, after checking it is delimited text (and, unless ``columns`` is ``None``, that it holds those
        columns: not for a source's ``has_rows``, which also sees predict inputs without a label), and that it names none of
        ``columns`` and ``read`` twice (another name may repeat: such columns are not read)."""
        head = read_head(path)
        if head.startswith(PARQUET_MAGIC):
            raise DataError(f"{path} looks like a Parquet file (it begins with Parquet's magic bytes {PARQUET_MAGIC.decode()}), "
                            f"but this data option reads delimited text. Fix: use data=parquet data.path={path}")
        codec = self.compression(path)
        if codec is not None:
            with self.open_text(path) as f:
                head = f.read(SNIFF_BYTES)
        if not looks_like_text(head):
            what = f"its first {len(head)} bytes" + (f", decompressed ({codec.name})" if codec else "")
            raise DataError(f"{path} is not a text file (NUL bytes in {what}), but this data option reads "
                            f"delimited text, one record per line. Fix: point {self.path_key} at CSV/TSV files (plain, or gzip/bz2/zstd-"
                            f"compressed), or choose the data option of the file's format, e.g. data=parquet")
        with self.open_text(path) as f:
            first_line = f.readline()
            more = bool(f.read(1))
        if not first_line or (self.header is not False and not more and not first_line.strip(b"\r\n")):
            raise DataError(f"{path} is an empty file" + (f" (once decompressed, {codec.name})" if codec else "")
                            + f". Fix: remove it from {self.path_key}, or write it again")
        if b"\r" in first_line.rstrip(b"\r\n"):
            raise DataError(f"{path}: its lines end in a carriage return alone (\\r, classic Mac OS line endings; its first line reads "
                            f"{_line(first_line, first=True)[:100]!r}), but records are split at newlines (\\n or \\r\\n), so the "
                            f"whole file would be one line. Fix: convert its line endings, e.g. tr '\\r' '\\n' < {path} > unix.csv")
        delimiter, header = self.layout(path)
        if self.fixed_layout is not None and not header and looks_like_header(lines := self.first_lines(path), delimiter):
            raise DataError(f"{path} begins with a header line ({lines[0][:100]!r}), but {self.fixed_layout}")
        if self.follows_training and not header and looks_like_header(lines := self.first_lines(path), delimiter):
            raise DataError(f"{path} begins with a header line ({lines[0][:100]!r}), but the training files (data.path) have none "
                            f"({self.header_key}=null reads {self.what}s as data.header=false does), so it would be read as a row of "
                            f"data: a header mismatch. Fix: {self.header_key}=true (the line is read as the header: it names the columns, "
                            f"or {self.names_key} replaces its names), or remove the line from the {self.what}")
        if header:
            names = split_fields(_line(first_line, first=True), delimiter)
            data_start = len(first_line)
            if self.column_names:  # names of the config's replace the header's
                if len(self.column_names) != len(names):
                    raise DataError(f"{path}'s header names {len(names)} columns {names}, but {self.names_key} lists {len(self.column_names)} "
                                    f"{list(self.column_names)}. Fix: list one name per column of the file, or {self.names_key}=null")
                names = list(self.column_names)
        else:
            assert self.column_names is not None
            names, data_start = list(self.column_names), 0
        if header and not self.column_names:
            check_unique_names(path, names, "its header line", f"rename the repeated columns in the header line, or name every "
                               f"column with {self.names_key}=[...] (one name per column, in file order)", {*(columns or ()), *read})
        else:
            check_unique_names(path, names, self.names_key, f"give each column a name of its own in {self.names_key}",
                               {*(columns or ()), *read})
        missing = [c for c in columns if c not in names] if columns is not None else []
        if missing:
            if header and len(names) == 1 and (hint := delimiter_hint(names[0], delimiter)):
                raise DataError(f"{path} has no column {missing[0]!r}: its header line is one column, {names[0]!r}.{hint}")
            if header and looks_like_data(lines := self.first_lines(path), delimiter):
                raise DataError(self.not_a_header(path, missing[0], lines[0]))
            where = "its header" if header else "data.column_names"
            if self.reference is not None and missing[0] in self.reference[1]:
                raise DataError(lacks_training_column(path, missing, f"{where} lists {names}", self.reference[0], self.path_key, self.what))
            raise DataError(f"{path} has no column {missing[0]!r}; {where} lists {names}{closest_column(missing[0], names)}. Fix: "
                            f"correct the column names in data.label(s) / data.dense / data.sparse" + ("" if header else " or data.column_names")
                            + self.misread(path, delimiter, header, names))
        return names, data_start, more

    def not_a_header(self, path: str, column: str, first: str) -> str:
        """The message for a file whose first line, read as the header, is data: the cause and the fix."""
        said = f"{self.header_key}=null (as data.header=true)" if self.follows_training else f"{self.header_key}=true"
        cause = f"{path} has no column {column!r}: its first line {first[:100]!r} looks like data, not a header naming the columns, " \
                f"but {said} reads it as the header"
        if self.follows_training:
            return (f"{cause}; the training files (data.path) have a header line, this {self.what} has none: a header mismatch. "
                    f"Fix: {self.header_key}=false (every line of the {self.what}s is data, under {self.names_said}), or add "
                    f"the header line to the {self.what}")
        if self.header_key != "data.header":
            return f"{cause}. Fix: {self.header_key}=false (every line is data, under {self.names_said})"
        return (f"{cause}. Fix: data.header=false data.column_names=[...] (the names of all columns, in file order), or "
                f"data.header=null to detect it")

    def header_names(self, path: str, columns: list[str], read: Collection[str] = ()) -> list[str]:
        """``path``'s column names (its header, or ``data.column_names``), checked to hold ``columns`` and to name none of them
        nor of ``read`` twice, without reading its rows; a header that is one column split by another delimiter than
        ``data.delimiter`` is the wrong delimiter, said so."""
        names = self.inspect(path, columns, read)[0]
        delimiter, header = self.layout(path)
        if header and len(names) == 1 and (hint := delimiter_hint(names[0], delimiter)):
            raise DataError(f"{path} has no column 'label': its header line is one column, {names[0]!r}.{hint}")
        return names

    def line_offset(self, path: str) -> int:
        """Line number of file row ``r`` is ``r + line_offset`` (1-based, header counted)."""
        return 2 if self.layout(path)[1] else 1


def _line(raw: bytes, first: bool) -> str:
    """A line of a file as text, without its line ending (bytes that are not UTF-8 replaced) and, for the file's ``first``
    line, without a byte order mark (:data:`BOM`)."""
    text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
    return text.removeprefix(BOM) if first else text
