"""Paths and URIs as addresses: a setting's text made a local :class:`~pathlib.Path` or a :class:`UriPath` once, joined and split.

A setting that takes a path (``data.path``, ``checkpoint.dir``, ``predict.output``, export's ``out``) takes a URI too
(``s3://bucket/prefix``). :func:`as_path` resolves its text once, where the setting is read: a :class:`UriPath` for a
URI, else the local path; the rooms below take that and never parse the text again, and where the local disk and a
store truly differ they ask its type (:func:`is_remote`). :func:`is_uri`, :func:`join` and :func:`split` do the same
for the text forms that stay text (data files, which pyarrow reads).

A room of its own below :mod:`recsys_runner.stores`: an address is arithmetic on names, with no client, setting,
retry or error of a store, and a room that only names a place (the launch's resume command, the checkpoint policy's
directory, the ``sequences`` command's output) needs nothing else; ``stores`` imports it to pick a file system, never
the reverse. Which names of a listing are data files (:func:`is_data_name`) is decided here too, for a local folder and a
prefix alike. May import nothing of the package.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PosixPath
from typing import Any, NoReturn

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_uri(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names an object in a store (``scheme://…``; ``file://`` is the local disk)."""
    m = _SCHEME.match(os.fspath(path))
    return m is not None and m.group(1).lower() != "file"


class UriPath(PosixPath):
    """A URI as a :class:`~pathlib.Path`, so the checkpoint policy can join and split names of a store's
    checkpoints as it does of local ones (``root / name``, ``.name``, ``.parent``, ``.with_name``). It is an address
    only: reads and writes go through a storage (``checkpoint/storage.py``) or :mod:`recsys_runner.stores`; Path's
    file methods (``exists``, ``open``, ``mkdir``, ``glob``…: :data:`_LOCAL_FILE_METHODS`) raise :class:`TypeError` on
    it rather than silently use a local file named like the URI."""

    def __str__(self) -> str:
        return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*):/(?!/)", r"\1://", super().__str__())

    def __fspath__(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"UriPath({str(self)!r})"

    def absolute(self) -> UriPath:
        return self  # a URI is absolute already

    def resolve(self, strict: bool = False) -> UriPath:
        return self

    def expanduser(self) -> UriPath:
        return self


_LOCAL_FILE_METHODS = ("exists", "is_dir", "is_file", "is_symlink", "stat", "lstat", "open", "read_text", "read_bytes", "write_text",
                       "write_bytes", "mkdir", "rmdir", "touch", "unlink", "rename", "replace", "glob", "rglob", "iterdir", "samefile",
                       "chmod", "owner", "group", "readlink", "symlink_to", "hardlink_to")
"""Path's methods that touch the local disk: on a :class:`UriPath` they would read or write a local file named like
the URI (``s3:/bucket/…``), so each raises :class:`TypeError` instead (:func:`_refuse_local`)."""


def _refuse_local(name: str) -> Any:
    def refuse(self: UriPath, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(f"UriPath.{name}() on {self}: a UriPath is an address in an object store, and Path.{name} would use the local "
                        f"disk. Fix (in the code): go through the store: recsys_runner.stores (read_bytes, write_bytes, glob, "
                        f"list_files, remove, upload) or the checkpoint storage (checkpoint.object_storage.storage_for(path))")

    refuse.__name__ = refuse.__qualname__ = name
    return refuse


for _name in _LOCAL_FILE_METHODS:
    setattr(UriPath, _name, _refuse_local(_name))


def as_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a :class:`Path`: a :class:`UriPath` for a URI, else the local path with ``~`` expanded."""
    return UriPath(os.fspath(path)) if is_uri(path) else Path(path).expanduser()


def is_remote(path: Path) -> bool:
    """Whether a resolved path (:func:`as_path`, done once where a setting is read) is in an object store: its type says
    so, no string is parsed again."""
    return isinstance(path, UriPath)


def join(base: str, *names: str) -> str:
    """``base/name/…`` for a URI or a local path."""
    return "/".join([base.rstrip("/"), *names]) if is_uri(base) else os.path.join(base, *names)


def split(uri: str) -> tuple[str, str]:
    """``(scheme, path after the scheme)``; the path of ``s3://bucket/key`` is ``bucket/key``."""
    m = _SCHEME.match(uri)
    assert m is not None, uri
    return m.group(1).lower(), uri[m.end():]


NOT_DATA_SUFFIXES = (".md", ".rst", ".yaml", ".yml", ".json", ".crc", ".md5", ".sha1", ".sha256", ".sha512", ".py", ".sh",
                     ".ipynb", ".html", ".pdf")
"""Names that are no data file by their suffix (documentation, a saved schema file, checksums, scripts), left out of a
directory of text files, whose data files may have any name (``u.data``, ``day_0``, ``train.txt``)."""
NOT_DATA_STEMS = ("readme", "license", "licence", "notice", "changelog")
"""Names that are no data file by their stem, whatever their suffix (``README``, ``LICENSE.txt``), left out alike."""


def is_data_name(name: str, suffixes: tuple[str, ...] | None) -> bool:
    """Whether a file of a directory (or a prefix) named ``name`` is read as data: not hidden or a writer's marker (``.`` or
    ``_`` first: ``_SUCCESS``, ``.crc``), and with one of ``suffixes`` when given, else not a documentation, schema or checksum
    file by its name (:data:`NOT_DATA_SUFFIXES`, :data:`NOT_DATA_STEMS`).

    Why the second rule: a text directory takes files of any name, and a dataset's README, or the schema file a run logs
    and the user saved beside the data, was read as rows (``README has no column 'label'``) or, for an inferred schema,
    as the header of every file (``none of its columns ['hello'] is named label``)."""
    if name.startswith((".", "_")):
        return False
    if suffixes is not None:
        return name.endswith(suffixes)
    lower = name.lower()
    return not (lower.endswith(NOT_DATA_SUFFIXES) or lower.split(".", 1)[0] in NOT_DATA_STEMS)
