"""Which files a data path names: one file, a directory's data files, a glob, or the objects under an object-store prefix.

The one place a ``data.path``-like setting (``data.path``, ``data.eval_path``, ``data.items.path``, a sequence log,
predict's input) becomes a list of files, below every room that reads them (``files``, ``catalogue``, ``sequences``,
scoring), so none of those rooms imports another to find its files. May import ``stores``, ``uris`` and ``errors`` only.
"""

from __future__ import annotations

import glob
import logging
import os
import stat

from recsys_runner import stores, uris
from recsys_runner.errors import DataError

log = logging.getLogger(__name__)
_said: set[str | tuple[str, str]] = set()
"""Directories whose left-out documentation and schema files, or unread subdirectories, were logged: a run resolves its
paths several times."""

PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")
"""The names of Parquet files in a directory or under a prefix (other names there are left out)."""


def resolve_files(path: str, key: str, suffixes: tuple[str, ...] | None) -> list[str]:
    """The files ``path`` names: a file, a directory (its files, sorted) or a glob pattern.

    In a directory, names starting with ``.`` or ``_`` (``_SUCCESS``, ``.crc``) are ignored, and so are names without
    one of ``suffixes`` (when given), else documentation, schema and checksum files (``README``, ``schema.yaml``:
    :func:`~recsys_runner.uris.is_data_name`). An object-store URI (``s3://bucket/prefix/``, a glob of one)
    names objects alike (:func:`recsys_runner.stores.list_files`).
    """
    if uris.is_uri(path):
        left: list[str] = []
        files = stores.list_files(path, key, suffixes, left_out=left)
        _say_left_out(key, path, left)
        return files
    if any(ch in path for ch in "*?["):
        matched = sorted(glob.glob(path, recursive=True))
        _refuse_broken_links(matched, key, path)
        files = [p for p in matched if os.path.isfile(p)]
        if not files:
            unread = _not_regular([p for p in matched if not os.path.isdir(p)])
            raise DataError(f"{key}={path!r} is a glob pattern that matches no files{f' ({unread})' if unread else ''}. Fix: check the "
                            f"pattern (quote it so the shell does not expand it)")
        return files
    _refuse_broken_links([path], key, path)
    if not os.path.exists(path):
        raise DataError(f"{key}={path!r} does not exist. Fix: point {key} at a file, a directory or a glob such as '/data/train/*.parquet'")
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise DataError(f"{key}={path!r} is {_special_kind(path)}, not a regular file: the readers count a file's rows and "
                        f"read it again each epoch, which a pipe's or a device's stream cannot give (reading it could wait "
                        f"forever for a writer). Fix: write the data to a file and point {key} at it (compressed files are read "
                        f"as they are: gzip, bz2, zstd)")
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        raise DataError(f"{key}={path!r} is a directory that cannot be listed ({e.strerror or e}). Fix: check that you may read it "
                        f"(ls -ld {path}), or point {key} at readable files") from None
    _refuse_broken_links([os.path.join(path, n) for n in names if uris.is_data_name(n, suffixes)], key, path)
    files = [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n)) and uris.is_data_name(n, suffixes)]
    if suffixes is None:
        _say_left_out(key, path, [n for n in names if os.path.isfile(os.path.join(path, n)) and not n.startswith((".", "_"))
                                  and not uris.is_data_name(n, None)])
    special = [n for n in names if uris.is_data_name(n, suffixes) and os.path.exists(p := os.path.join(path, n))
               and not (os.path.isfile(p) or os.path.isdir(p))]
    unread = _not_regular([os.path.join(path, n) for n in special])
    if special and files and (path, "special") not in _said:
        _said.add((path, "special"))
        log.warning("%s=%r: %s", key, path, unread)
    folders = [n for n in names if os.path.isdir(os.path.join(path, n)) and not n.startswith((".", "_"))]
    if not files:
        wanted = f" with a name ending in {', '.join(suffixes)}" if suffixes else ""
        within = (f" (its subdirectories {', '.join(folders[:3])}{', …' if len(folders) > 3 else ''} are not read: name their files "
                  f"with a glob, e.g. {key}='{os.path.join(path, '**', '*' + (suffixes[0] if suffixes else ''))}')") if folders else ""
        within += f" ({unread})" if unread else ""
        raise DataError(f"{key}={path!r} is a directory without data files{wanted}{within}. Fix: point {key} at the directory that holds them")
    if folders and (path, "folders") not in _said:
        _said.add((path, "folders"))
        log.info("%s=%r: its files are read, not its %d subdirectories (%s); to read theirs too, name them with a glob, e.g. %s='%s'",
                 key, path, len(folders), ", ".join(folders[:3]) + (", …" if len(folders) > 3 else ""), key,
                 os.path.join(path, "**", "*" + (suffixes[0] if suffixes else "")))
    return files


def _say_left_out(key: str, path: str, left: list[str]) -> None:
    """Log once per ``path`` (a local directory or an object-store prefix alike) the names of its files left out as no data
    by their names (:func:`~recsys_runner.uris.is_data_name`: ``README``, ``schema.yaml``, checksums), so a file meant as
    data but named like documentation is not dropped without a word."""
    if not left or path in _said:
        return
    _said.add(path)
    log.info("%s=%r: %d file(s) left out as no data by their names (%s): documentation, schema and checksum files. "
             "To read one, name it (or a glob) in %s", key, path, len(left), ", ".join(left[:5]) + (", …" if len(left) > 5 else ""), key)


def _not_regular(paths: list[str]) -> str:
    """What is said of entries of a listing that are no regular files (``""`` for none): they are left out, not read."""
    if not paths:
        return ""
    shown = ", ".join(os.path.basename(p) for p in paths[:3]) + (", …" if len(paths) > 3 else "")
    what = _special_kind(paths[0])
    return f"{shown} {'is' if len(paths) == 1 else 'are no regular files, the first'} {what}: only regular files are read"


def _special_kind(path: str) -> str:
    """What a path that exists but is neither a regular file nor a directory is: a named pipe (FIFO), a socket or a device."""
    mode = os.stat(path).st_mode
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file"


def _refuse_broken_links(paths: list[str], key: str, given: str) -> None:
    """Refuse a data file that is a symbolic link to nothing (its target deleted or moved, or a loop of links).

    Why: such a link is no file (``os.path.isfile`` is false), so a directory's or a glob's listing left it out without
    a word, training on fewer files than the folder names, and as ``data.path`` itself it was said not to exist.

    Raises:
        DataError: naming the link, where it points and the fix.
    """
    for p in paths:
        if os.path.islink(p) and not os.path.exists(p):
            target = os.readlink(p)
            what = "is" if p == given else f"holds {p}:"
            raise DataError(f"{key}={given!r} {what} a symbolic link to {target!r}, which does not exist (deleted or moved, or a "
                            f"loop of links). Fix: restore the link's target, or remove the link")
