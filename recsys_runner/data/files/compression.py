"""Compressed text files (gzip, bz2, zstd): which compression a file has, and its bytes decompressed as a stream.

A compressed file cannot be entered in the middle: its lines are found, counted and read from its first byte on,
through Arrow's decompressing input stream (local files and object-store URIs alike). A damaged file is a
:class:`~recsys_runner.errors.DataError` naming the file, its compression and the command that checks it."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

import pyarrow as pa

from recsys_runner import stores
from recsys_runner.errors import DataError, UserError


@dataclass(frozen=True)
class Compression:
    """A compression text files are read through."""

    name: str
    """Arrow's codec name, also the one messages show."""
    suffixes: tuple[str, ...]
    """File name endings that say so."""
    magic: tuple[bytes, ...]
    """What a file of it begins with (any one)."""
    check: str
    """The command that tests a file of it."""


COMPRESSIONS = (
    Compression("gzip", (".gz", ".gzip"), (b"\x1f\x8b",), "gzip -t"),
    Compression("bz2", (".bz2",), tuple(b"BZh" + bytes([level]) + block for level in b"123456789"
                                        for block in (b"1AY&SY", b"\x17rE8P\x90")), "bzip2 -t"),
    Compression("zstd", (".zst", ".zstd"), (b"\x28\xb5\x2f\xfd",), "zstd -t"),
)
"""The compressions read, recognized by a file's first bytes (its name may say otherwise)."""

UNREAD = {"xz": (b"\xfd7zXZ\x00", (".xz",)), "lz4": (b"\x04\x22\x4d\x18", (".lz4",)), "zip": (b"PK\x03\x04", (".zip",))}
"""Compressions recognized but not read: refused with the fix."""

STREAM_CHUNK_BYTES = 8 << 20
"""Decompressed bytes handed on at a time: what a reader holds of a compressed file beyond its current rows."""


def detect(path: str, head: bytes, given: str = "data.path") -> Compression | None:
    """The compression of ``path`` by its first bytes ``head``; ``None``: not compressed. ``given``: what named the file,
    for the fix (as :func:`read_error`'s).

    Raises:
        DataError: a compression that is not read (xz, lz4, zip), or a name that says compressed on bytes that are not
            (a damaged file).
    """
    for c in COMPRESSIONS:
        if head.startswith(c.magic):
            return c
    for name, (magic, suffixes) in UNREAD.items():
        if head.startswith(magic) or path.endswith(suffixes):
            raise DataError(f"{path} is {name}-compressed, which is not read. Fix: recompress it with zstd or gzip (e.g. "
                            f"{'unzip -p' if name == 'zip' else name + ' -dc'} {path} | zstd -o <file>.zst), or decompress it")
    named = next((c for c in COMPRESSIONS if path.endswith(c.suffixes)), None)
    if named is not None and b"\x00" in head:
        raise DataError(f"{path}: its name says {named.name}-compressed, but it does not begin as a {named.name} file does: it is "
                        f"corrupt, or compressed otherwise. Fix: check it ({named.check} {path}), download or compress it again, "
                        f"or remove it from {given}")
    return None  # plain text (even if named .gz: read as it is)


def plain_name(path: str) -> str:
    """``path``'s file name without a compression's suffix (``day_0.tsv.gz`` → ``day_0.tsv``)."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    for c in COMPRESSIONS:
        for suffix in c.suffixes:
            if name.endswith(suffix) and len(name) > len(suffix):
                return name[: -len(suffix)]
    return name


def read_error(path: str, compression: Compression, e: BaseException, given: str = "data.path") -> UserError:
    """Why ``path`` cannot be decompressed, as a :class:`DataError` naming it, its compression and the check; a store that
    does not answer, as the store's error. ``given``: what named the file (a key, or a command's argument)."""
    if (refused := stores.failure(path, e)) is not None:
        return refused
    return DataError(f"{path} cannot be decompressed as {compression.name} ({str(e).splitlines()[0]}): the file is truncated or "
                     f"corrupt. Fix: check it ({compression.check} {path}), download or compress it again, or remove it from {given}")


@contextmanager
def open_text(path: str, compression: Compression | None, start: int = 0, given: str = "data.path") -> Iterator[IO[bytes]]:
    """``path``'s bytes (decompressed) from byte ``start`` of them on, as a line-iterable binary file; a read that fails
    for the compressed data is a :func:`read_error` (``given``: what named the file)."""
    if compression is None:
        with stores.open_input(path) as plain:
            plain.seek(start)
            yield plain
        return
    try:
        fs, rest = stores.arrow_filesystem(path)
        stream = fs.open_input_stream(rest, compression=compression.name)
        with io.BufferedReader(stream, buffer_size=1 << 20) as f:
            _skip(f, start)
            yield f
    except (OSError, pa.ArrowException) as e:
        raise read_error(path, compression, e, given) from None


def _skip(f: io.BufferedReader, n: int) -> None:
    while n > 0 and (got := len(f.read(min(n, STREAM_CHUNK_BYTES)))):
        n -= got


def chunks(path: str, compression: Compression, start: int = 0, given: str = "data.path") -> Iterator[bytes]:
    """``path``'s decompressed bytes from ``start`` on, :data:`STREAM_CHUNK_BYTES` at a time (``given``: what named the
    file, for :func:`read_error`)."""
    with open_text(path, compression, start, given) as f:
        while chunk := f.read(STREAM_CHUNK_BYTES):
            yield chunk
