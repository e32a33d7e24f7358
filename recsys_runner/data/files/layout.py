"""What a delimited text file's first lines say about its layout: the delimiter, whether the first line is a header,
and the hint a reader gives when a line splits into the wrong number of fields."""

from __future__ import annotations

import csv
import re

DELIMITER_NAMES = {"\t": "tabs", ",": "commas", ";": "semicolons", "|": "pipes"}
"""Delimiters recognized when a file's lines look split by another one than ``data.delimiter``."""

HEADER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_ .\-]*$")
"""What a column name in a header line looks like."""


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def split_fields(line: str, delimiter: str) -> list[str]:
    """``line``'s fields by ``delimiter``, stripped of spaces and quotes; a quoted field holds the delimiter as the rows'
    parser reads it (``"price, USD"`` is one field: a header split at every comma named more columns than its rows have)."""
    fields = next(csv.reader([line], delimiter=delimiter), None) or [""]
    return [f.strip().strip('"') for f in fields]


def detect_delimiter(lines: list[str]) -> str | None:
    """The delimiter of :data:`DELIMITER_NAMES` that splits the first lines into the same number (> 1) of fields, the
    one giving the most fields; ``None`` if none does."""
    best: tuple[int, str] | None = None
    for d in DELIMITER_NAMES:
        counts = {line.count(d) for line in lines}
        if len(counts) == 1 and (n := counts.pop()) > 0 and (best is None or n > best[0]):
            best = (n, d)
    return None if best is None else best[1]


def looks_like_header(lines: list[str], delimiter: str) -> bool:
    """Whether the first of ``lines`` names columns: every field a name (not a number, not empty), and the next line
    has a number in a field where it has a name."""
    first = split_fields(lines[0], delimiter)
    if not all(HEADER_NAME.match(f) for f in first):
        return False
    if len(lines) < 2:
        return True
    second = split_fields(lines[1], delimiter)
    return any(_is_number(b) for a, b in zip(first, second, strict=False) if not _is_number(a))


def looks_like_data(lines: list[str], delimiter: str) -> bool:
    """Whether the first of ``lines`` is a row like the next one rather than a header naming columns: both split into the
    same number of fields, and a field holds a number in both (a header names its columns)."""
    if len(lines) < 2:
        return False
    first, second = split_fields(lines[0], delimiter), split_fields(lines[1], delimiter)
    return len(first) == len(second) > 1 and any(_is_number(a) and _is_number(b) for a, b in zip(first, second, strict=True))


def delimiter_hint(text: str, delimiter: str, fixed: str | None = None) -> str:
    """A sentence naming the delimiter ``text`` (a line read as one field) seems to use instead of ``delimiter``, or ``""``;
    ``fixed``: the format fixes its delimiter (``data=criteo``), and this says what it reads and the fix instead of a
    ``data.delimiter`` it has no key for."""
    for other, name in DELIMITER_NAMES.items():
        if other != delimiter and other in text:
            if fixed is not None:
                return f" The line contains {name}: the file looks {name[:-1]}-separated, but {fixed}"
            spelled = "comma" if other == "," else repr(other)  # data.delimiter=',' reaches Hydra as a bare comma, a list separator
            return (f" The line contains {name}: the file looks {name[:-1]}-separated, but data.delimiter={delimiter!r}. "
                    f"Fix: set data.delimiter={spelled}")
    return ""


QUOTE = b'"'
"""The quote character of delimited text as the reader parses it (Arrow's default): a field that begins with it runs to
the next one, a doubled ``""`` inside standing for one."""


def _opens_quote(line: bytes, delimiter: bytes) -> bool:
    """Whether a field of ``line`` (no line ending) begins with a quote that the line does not close."""
    start = 0
    while start < len(line):  # ``start``: the first byte of a field
        if line[start:start + 1] == QUOTE:
            i = start + 1
            while (j := line.find(QUOTE, i)) >= 0 and line[j + 1:j + 2] == QUOTE:
                i = j + 2  # a doubled quote inside the field
            if j < 0:
                return True
            start = j + 1
        nxt = line.find(delimiter, start)
        if nxt < 0:
            return False
        start = nxt + 1
    return False


def open_quote_lines(raw: bytes, delimiter: str) -> list[int]:
    """The 0-based numbers of the lines of ``raw`` with a field that opens a quote the line does not close.

    Why: the reader (one record per line) would read on into the next lines for the closing quote, so the lines after
    such a one vanish into one bad row, or end a sample early; found, the line itself is the bad row.
    """
    if QUOTE not in raw:
        return []
    d = delimiter.encode()
    return [i for i, line in enumerate(raw.split(b"\n")) if QUOTE in line and _opens_quote(line.rstrip(b"\r"), d)]


def open_quote_fix(line: bytes) -> str:
    """What an error about an unclosed quote says of the line, and the fix."""
    shown = line.rstrip(b"\r\n").decode("utf-8", errors="replace")[:100]
    return (f"a field opens a quote ({QUOTE.decode()}) that the line does not close ({shown!r}); one record is one line, so the "
            f"reader would run on into the next lines for the closing quote. Fix the line: close the quote, or remove it (a quote "
            f"inside a quoted field is written twice, \"\"; one inside an unquoted field needs nothing)")

def not_utf8(raw: bytes) -> tuple[int, int] | None:
    """Where ``raw`` (lines of a text file) first fails to be UTF-8: the 0-based line and the byte's position in that line;
    ``None`` when it is all UTF-8."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        start = raw.rfind(b"\n", 0, e.start) + 1
        return raw.count(b"\n", 0, e.start), e.start - start
    return None


def not_utf8_message(path: str, line_number: int, line: bytes, at: int) -> str:
    """The error for line ``line_number`` of ``path`` (its bytes ``line``), not UTF-8 from its byte ``at`` on: the reader
    reads delimited text as UTF-8, so a file written in another encoding (Latin-1, Windows-1252) is converted first."""
    shown = line.rstrip(b"\r\n").decode("utf-8", errors="replace")[:100]
    return (f"{path}, line {line_number}: not UTF-8 text (byte {line[at:at + 1]!r} at position {at + 1} of the line: {shown!r}); "
            f"delimited text is read as UTF-8, and this file was written in another encoding (a byte like this is usual in "
            f"Latin-1 or Windows-1252). Fix: convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8 {path} > <new file> (or "
            f"-f cp1252), and point data.path at it")
