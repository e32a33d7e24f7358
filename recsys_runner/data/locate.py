"""Which files a data path names: one file, a directory's data files, a glob, or the objects under an object-store prefix.

The one place a ``data.path``-like setting (``data.path``, ``data.eval_path``, ``data.items.path``, a sequence log,
predict's input) becomes a list of files, below every room that reads them (``files``, ``catalogue``, ``sequences``,
scoring), so none of those rooms imports another to find its files. May import ``stores``, ``uris`` and ``errors`` only.
"""

from __future__ import annotations

import glob
import logging
import os

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
        return stores.list_files(path, key, suffixes)
    if any(ch in path for ch in "*?["):
        matched = sorted(glob.glob(path, recursive=True))
        _refuse_broken_links(matched, key, path)
        files = [p for p in matched if os.path.isfile(p)]
        if not files:
            raise DataError(f"{key}={path!r} is a glob pattern that matches no files. Fix: check the pattern (quote it so the shell does not expand it)")
        return files
    _refuse_broken_links([path], key, path)
    if not os.path.exists(path):
        raise DataError(f"{key}={path!r} does not exist. Fix: point {key} at a file, a directory or a glob such as '/data/train/*.parquet'")
    if os.path.isfile(path):
        return [path]
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        raise DataError(f"{key}={path!r} is a directory that cannot be listed ({e.strerror or e}). Fix: check that you may read it "
                        f"(ls -ld {path}), or point {key} at readable files") from None
    _refuse_broken_links([os.path.join(path, n) for n in names if uris.is_data_name(n, suffixes)], key, path)
    files = [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n)) and uris.is_data_name(n, suffixes)]
    if suffixes is None and path not in _said:
        _said.add(path)
        if left := [n for n in names if os.path.isfile(os.path.join(path, n)) and not n.startswith((".", "_")) and not uris.is_data_name(n, None)]:
            log.info("%s=%r: %d file(s) left out as no data by their names (%s): documentation, schema and checksum files. "
                     "To read one, name it (or a glob) in %s", key, path, len(left), ", ".join(left[:5]) + (", …" if len(left) > 5 else ""), key)
    folders = [n for n in names if os.path.isdir(os.path.join(path, n)) and not n.startswith((".", "_"))]
    if not files:
        wanted = f" with a name ending in {', '.join(suffixes)}" if suffixes else ""
        within = (f" (its subdirectories {', '.join(folders[:3])}{', …' if len(folders) > 3 else ''} are not read: name their files "
                  f"with a glob, e.g. {key}='{os.path.join(path, '**', '*' + (suffixes[0] if suffixes else ''))}')") if folders else ""
        raise DataError(f"{key}={path!r} is a directory without data files{wanted}{within}. Fix: point {key} at the directory that holds them")
    if folders and (path, "folders") not in _said:
        _said.add((path, "folders"))
        log.info("%s=%r: its files are read, not its %d subdirectories (%s); to read theirs too, name them with a glob, e.g. %s='%s'",
                 key, path, len(folders), ", ".join(folders[:3]) + (", …" if len(folders) > 3 else ""), key,
                 os.path.join(path, "**", "*" + (suffixes[0] if suffixes else "")))
    return files


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
