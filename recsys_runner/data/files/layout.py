"""What a delimited text file's first lines say about its layout: the delimiter, whether the first line is a header,
and the hint a reader gives when a line splits into the wrong number of fields."""

from __future__ import annotations

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
    """``line``'s fields by ``delimiter``, stripped of spaces and quotes."""
    return [f.strip().strip('"') for f in line.split(delimiter)]


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


def delimiter_hint(text: str, delimiter: str) -> str:
    """A sentence naming the delimiter ``text`` (a line read as one field) seems to use instead of ``delimiter``, or ``""``."""
    for other, name in DELIMITER_NAMES.items():
        if other != delimiter and other in text:
            return (f" The line contains {name}: the file looks {name[:-1]}-separated, but data.delimiter={delimiter!r}. "
                    f"Fix: set data.delimiter={other!r}")
    return ""
