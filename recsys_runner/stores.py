"""Object stores: a path or a URI (``s3://bucket/prefix/*.parquet``) → a file system and the path in it.

Every place that takes a path (``data.path``, ``data.items``, ``checkpoint.dir``, ``predict.output``, export's
``out``) takes a URI too: local paths go to the local disk as before; ``s3://`` goes to pyarrow's
``S3FileSystem`` (data reads) and to s3fs (DCP checkpoints, the lock, small writes); any other scheme fsspec knows
(``gs://``, ``abfs://``…) goes through fsspec, wrapped for pyarrow where pyarrow reads it.

The clients come from :mod:`recsys_runner.store_settings` (``storage.*``: where the store is, its region, how hard to
retry; never credentials), which this module reads through and never configures. Every failure becomes a
:class:`~recsys_runner.errors.UserError` naming the URI, the cause and the fix (:func:`store_error`).

A setting's text is resolved once, where the setting is read (:func:`~recsys_runner.uris.as_path`: a local
:class:`~pathlib.Path` or a :class:`~recsys_runner.uris.UriPath`, :mod:`recsys_runner.uris`), and the rooms below take
that and never parse the text again. Where the local disk and a store truly differ (no rename, no directories, no file
lock in a store) they ask its type (:func:`~recsys_runner.uris.is_remote`): an output folder replaced whole
(``staging.py``), the checkpoint lock and storage, predict's part files. Everything else goes through this module's
calls, which work on both (:func:`read_bytes`, :func:`arrow_filesystem`, :func:`failure`…). Data files, listed from
``data.path`` by ``data/locate.py``, stay text for pyarrow. May import ``store_settings``, ``uris`` and ``errors`` only.
"""

from __future__ import annotations

import bisect
import contextlib
import glob as local_glob
import io
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING

import fsspec
import pyarrow as pa
import pyarrow.fs as pafs

from recsys_runner import uris
from recsys_runner.errors import DataError, UserError
from recsys_runner.store_settings import arrow_s3, endpoint_url, fsspec_for, settings

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer


def _botocore_errors() -> tuple[type[BaseException], ...]:
    """botocore's base error, where botocore is installed (it comes with s3fs; a machine without it reaches no bucket)."""
    try:
        from botocore.exceptions import BotoCoreError
    except ImportError:
        return ()
    return (BotoCoreError,)


STORE_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, *_botocore_errors())
"""What a store call raises when the store refuses or does not answer: pyarrow's and s3fs's ``OSError`` (a missing
object is ``FileNotFoundError``), and botocore's own errors, which s3fs passes through untranslated (an unreachable
endpoint is ``EndpointConnectionError``, neither an ``OSError`` nor a ``ValueError``)."""


def arrow_filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow file system that holds ``path`` and the path in it (the local disk for a local path)."""
    if not uris.is_uri(path):
        return pafs.LocalFileSystem(), path
    scheme, rest = uris.split(path)
    if scheme in ("s3", "s3a"):
        return arrow_s3(), rest
    return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec_for(scheme))), rest


def fsspec_filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec file system of a URI and the path in it."""
    scheme, rest = uris.split(uri)
    return fsspec_for(scheme), rest


def _uri(scheme: str, rest: str) -> str:
    return f"{scheme}://{rest}"


def list_files(path: str, key: str, suffixes: tuple[str, ...] | None, *, left_out: list[str] | None = None) -> list[str]:
    """The objects a URI names, as URIs: one object, the objects under a prefix (sorted; those :func:`~recsys_runner.uris.is_data_name` refuses
    left out) or a glob (``s3://b/day_*/*.parquet``).

    ``left_out``, when given, receives the names under a prefix left out as no data by their names (documentation,
    schema and checksum files; not hidden or marker names, nor names without one of ``suffixes``), for the caller to
    say as it says a local directory's (:mod:`recsys_runner.data.locate`)."""
    scheme, rest = uris.split(path)
    fs = fsspec_for(scheme)
    glob = any(ch in rest for ch in "*?[")
    try:  # only the store's calls: a DataError of ours is a ValueError too, and would read as the store refusing the listing
        if glob:
            found = [p for p, info in fs.glob(rest, detail=True).items() if info.get("type") == "file"]
        elif is_object(fs, rest):
            return [path]
        else:
            entries = fs.find(rest.rstrip("/") + "/", maxdepth=1, detail=True)
    except STORE_ERRORS as e:
        raise store_error(path, e, key=key, doing="listing it") from None
    if glob:
        if not found:
            _check_bucket(path)
            raise DataError(f"{key}={path!r} is a glob pattern that matches no objects. Fix: check the pattern and the bucket's listing "
                            f"(aws s3 ls {path.rsplit('/', 1)[0]}/)")
        return [_uri(scheme, p) for p in sorted(found)]
    names = sorted((p, p.rsplit("/", 1)[-1]) for p, info in entries.items() if info.get("type") == "file")
    files = [_uri(scheme, p) for p, name in names if uris.is_data_name(name, suffixes)]
    if left_out is not None and suffixes is None:
        left_out.extend(name for _, name in names if not name.startswith((".", "_")) and not uris.is_data_name(name, None))
    if not files:
        _check_bucket(path)
        wanted = f" with a name ending in {', '.join(suffixes)}" if suffixes else ""
        raise DataError(f"{key}={path!r} is an empty prefix: no objects{wanted} under it. Fix: point {key} at the prefix that holds "
                        f"the data (aws s3 ls {path.rstrip('/')}/ lists it), or upload the files there")
    return files


def find(uri: str, cls: type[UserError] = DataError) -> list[str]:
    """Every object under the prefix ``uri``, at any depth, sorted, as URIs (none under a prefix that holds nothing)."""
    scheme, rest = uris.split(uri)
    try:
        found = fsspec_for(scheme).find(rest.rstrip("/") + "/")
    except FileNotFoundError:
        return []
    except STORE_ERRORS as e:
        raise store_error(uri, e, cls=cls, doing="listing it") from None
    return sorted(_uri(scheme, p) for p in found)


def is_object(fs: fsspec.AbstractFileSystem, rest: str) -> bool:
    """Whether ``rest`` is one object. Not ``fs.isfile``: it answers ``False`` to any failure, so a store that stopped
    answering would be waited for once here and once more by the listing after."""
    try:
        return bool(fs.info(rest).get("type") == "file")
    except FileNotFoundError:
        return False


def _check_bucket(uri: str) -> None:
    """Raise the clear error when the bucket of ``uri`` does not exist (a listing of a missing bucket is just empty)."""
    scheme, rest = uris.split(uri)
    bucket = rest.split("/", 1)[0]
    try:
        fsspec_for(scheme).ls(bucket, detail=False)  # raises what a listing under it swallows: no bucket, no access
    except FileNotFoundError:
        found = False
    except STORE_ERRORS as e:
        raise store_error(uri, e, doing="checking its bucket") from None
    else:
        found = True
    if not found:
        raise DataError(f"{uri}: the bucket {bucket!r} does not exist (at {endpoint_url() or 'AWS'}). Fix: create it, or correct the URI "
                        f"(and storage.endpoint_url / AWS_ENDPOINT_URL for an S3-compatible store)")


def open_input(path: str, *, buffer_bytes: int = 1 << 20) -> IO[bytes]:
    """``path`` opened for reading bytes (seekable, line-iterable): the local file, or a buffered object-store reader."""
    if not uris.is_uri(path):
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    fs, rest = arrow_filesystem(path)
    try:
        return io.BufferedReader(fs.open_input_file(rest), buffer_size=buffer_bytes)
    except STORE_ERRORS as e:
        raise store_error(path, e, doing="opening it") from None


READ_AHEAD_THREADS = 16
"""How many requests :func:`read_ahead_inputs` has in flight at once: 1,000 blocks cost about 63 round trips, not 1,000
(docs/data.md, the sample's cost)."""


@contextlib.contextmanager
def read_ahead_inputs(starts: dict[str, list[int]], block_bytes: int, buffer_bytes: int) -> Iterator[Callable[[str], IO[bytes]]]:
    """An opener of the files ``starts`` names, as :func:`open_input` opens them, where an object's blocks of
    ``block_bytes`` at its ``starts`` (in the order they will be read) are fetched ahead, :data:`READ_AHEAD_THREADS` at a
    time, and served from memory: a reader that seeks to many places one after another (the spread sample) waits for a
    few round trips, not one per place. Local files are opened as they are (a seek costs nothing). Reads pending at
    the end are cancelled; the openers' files must be closed by then."""
    remote = [path for path in starts if uris.is_uri(path)]
    if not remote:
        yield lambda path: open_input(path, buffer_bytes=buffer_bytes)
        return
    readers: dict[str, _ReadAhead] = {}
    with ThreadPoolExecutor(READ_AHEAD_THREADS, thread_name_prefix="read-ahead") as pool:
        try:
            for path in remote:  # in order: a file's open, then its blocks, ahead of the next file's
                fs, rest = arrow_filesystem(path)
                opened = pool.submit(fs.open_input_file, rest)
                readers[path] = _ReadAhead(path, opened, [(at, pool.submit(_read_block, opened, at, block_bytes))
                                                          for at in sorted(starts[path])])
            yield lambda path: (io.BufferedReader(readers[path], buffer_size=buffer_bytes) if path in readers
                                else open_input(path, buffer_bytes=buffer_bytes))
        finally:
            pool.shutdown(cancel_futures=True)
            for reader in readers.values():
                reader.release()


def _read_block(opened: Future[pa.NativeFile], at: int, size: int) -> bytes:
    """``size`` bytes at ``at`` (fewer at the end) of the file ``opened`` (its open submitted before: done or running)."""
    return bytes(opened.result().read_at(size, at))  # Arrow's read_at: thread-safe, no shared position


class _ReadAhead(io.RawIOBase):
    """An object read at its position from a block fetched ahead that holds it (waited for), else by a request of its
    own; a store's failure, in the thread that fetched a block or here, becomes :func:`store_error` naming the URI."""

    def __init__(self, uri: str, opened: Future[pa.NativeFile], blocks: list[tuple[int, Future[bytes]]]) -> None:
        super().__init__()
        self._uri, self._opened, self._blocks = uri, opened, blocks
        self._starts = [at for at, _ in blocks]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = 0 if whence == io.SEEK_SET else self._pos if whence == io.SEEK_CUR else self._file("reading its size").size()
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        data = self._ahead(len(view))
        if data is None:
            try:
                data = bytes(self._file("reading it").read_at(len(view), self._pos))
            except STORE_ERRORS as e:
                raise store_error(self._uri, e, doing="reading it") from None
        view[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def _ahead(self, size: int) -> bytes | None:
        """Up to ``size`` bytes at the position from the last block starting at or before it, where it holds it (blocks are
        of one size, so no earlier one does then)."""
        i = bisect.bisect_right(self._starts, self._pos) - 1
        if i < 0:
            return None
        at, block = self._blocks[i]
        try:
            data = block.result()
        except STORE_ERRORS as e:
            raise store_error(self._uri, e, doing="reading it") from None
        if self._pos - at >= len(data):
            return None
        return data[self._pos - at:self._pos - at + size]

    def _file(self, doing: str) -> pa.NativeFile:
        try:
            return self._opened.result()
        except STORE_ERRORS as e:
            raise store_error(self._uri, e, doing=doing) from None

    def release(self) -> None:
        """Close the object's file (the reads ahead are over)."""
        if not self._opened.cancelled() and self._opened.done() and self._opened.exception() is None:
            self._opened.result().close()


def file_size(path: str) -> int:
    """The size of ``path`` in bytes."""
    if not uris.is_uri(path):
        return os.path.getsize(path)
    fs, rest = arrow_filesystem(path)
    try:
        info = fs.get_file_info(rest)
    except STORE_ERRORS as e:
        raise store_error(path, e, doing="reading its size") from None
    if info.type != pafs.FileType.File:
        raise DataError(f"{path} does not exist. Fix: check the URI (aws s3 ls {path})")
    return int(info.size)


def read_bytes(path: str, cls: type[UserError] = DataError) -> bytes:
    """The whole object (or local file) at ``path``."""
    if not uris.is_uri(path):
        return Path(path).read_bytes()
    fs, rest = fsspec_filesystem(path)
    try:
        data: bytes = fs.cat_file(rest)
    except FileNotFoundError:
        raise
    except STORE_ERRORS as e:
        raise store_error(path, e, cls=cls, doing="reading it") from None
    return data


def write_bytes(path: str, data: bytes, cls: type[UserError] = DataError) -> None:
    """Write ``data`` to ``path`` (an object is replaced whole, never seen half-written)."""
    if not uris.is_uri(path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
        return
    fs, rest = fsspec_filesystem(path)
    try:
        fs.pipe_file(rest, data)
    except STORE_ERRORS as e:
        raise store_error(path, e, cls=cls, doing="writing it") from None


def glob(pattern: str, cls: type[UserError] = DataError) -> list[str]:
    """The objects (or local files) matching ``pattern``, sorted, as URIs (or paths)."""
    if not uris.is_uri(pattern):
        return sorted(p for p in local_glob.glob(pattern) if os.path.isfile(p))
    scheme, rest = uris.split(pattern)
    try:
        found = fsspec_for(scheme).glob(rest, detail=True)
    except STORE_ERRORS as e:
        raise store_error(pattern, e, cls=cls, doing="listing it") from None
    return sorted(_uri(scheme, p) for p, info in found.items() if info.get("type") == "file")


def remove(path: str, cls: type[UserError] = DataError) -> None:
    """Delete the file or object at ``path`` (everything under it for a directory or a prefix); nothing there is fine."""
    if not uris.is_uri(path):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            Path(path).unlink(missing_ok=True)
        return
    fs, rest = fsspec_filesystem(path)
    try:
        fs.rm(rest, recursive=True)
    except FileNotFoundError:
        pass
    except STORE_ERRORS as e:
        raise store_error(path, e, cls=cls, doing="removing it") from None


def upload(local: Path, uri: str, cls: type[UserError] = DataError) -> list[str]:
    """Copy the file or directory tree ``local`` to ``uri`` (files under it keep their relative names); the URIs written."""
    fs, rest = fsspec_filesystem(uri)
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    written = []
    for f in files:
        target = rest if f == local else f"{rest.rstrip('/')}/{f.relative_to(local).as_posix()}"
        try:
            fs.put_file(str(f), target)
        except STORE_ERRORS as e:
            raise store_error(_uri(uris.split(uri)[0], target), e, cls=cls, doing=f"uploading {f}") from None
        written.append(_uri(uris.split(uri)[0], target))
    return written


_CAUSES = (
    (("ACCESS_DENIED", "AccessDenied", "InvalidAccessKeyId", "INVALID_ACCESS_KEY_ID", "SignatureDoesNotMatch", "Forbidden", "403",
      "credentials", "Access Key Id", "PermissionError"),
     "access denied: the credentials are wrong, missing or may not use it",
     "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws/credentials) to keys that may use it"),
    (("NoSuchBucket", "NO_SUCH_BUCKET", "bucket does not exist", "Bucket does not exist"),
     "its bucket does not exist", "create the bucket, or correct the URI"),
    (("curlCode", "NETWORK_CONNECTION", "Could not connect", "Couldn't connect", "Connection refused", "timed out", "Timeout",
      "ConnectTimeout", "ReadTimeout", "EndpointConnectionError", "Connect timeout", "Operation timed out"),
     "the store cannot be reached", "check that it is up and reachable, and storage.endpoint_url / AWS_ENDPOINT_URL"),
)


def store_error(uri: str, e: BaseException, *, key: str | None = None, cls: type[UserError] = DataError,
                doing: str | None = None) -> UserError:
    """A :class:`UserError` of ``cls`` naming ``uri`` (and the setting ``key``), what was being done (``doing``, e.g.
    ``writing the checkpoint``), why the store refused it and the fix."""
    text = f"{type(e).__name__}: {e}"
    where = f"{key}={uri!r}" if key else uri
    what = f" ({doing})" if doing else ""
    at = f" at {endpoint_url()}" if endpoint_url() else ""
    for marks, cause, fix in _CAUSES:
        if any(m in text for m in marks):
            tries = (f", after {settings().max_attempts} attempts with backoff (storage.max_attempts, storage.request_timeout_s="
                     f"{settings().request_timeout_s:g})") if "reached" in cause else ""
            return cls(f"{where}{what}: {cause}{at}{tries} ({text.splitlines()[0][:300]}). Fix: {fix}")
    return cls(f"{where}{what}: the store{at} refused it ({text.splitlines()[0][:300]}). Fix: check the URI and that the store holds it")


def failure(path: str, e: BaseException, *, key: str | None = None) -> UserError | None:
    """The store's error (:func:`store_error`) when ``path`` is in an object store and ``e`` is the store refusing or not
    answering; ``None`` when ``e`` is about the file itself (truncated, corrupt), which the reader names in its own words."""
    return store_error(path, e, key=key) if uris.is_uri(path) and is_store_failure(e) else None


def is_store_failure(e: BaseException) -> bool:
    """Whether ``e`` is the store refusing or not answering (credentials, bucket, network), not a damaged file."""
    text = f"{type(e).__name__}: {e}"
    return any(m in text for marks, _, _ in _CAUSES for m in marks)
