"""How this process reaches an object store: the ``storage.*`` settings (:class:`StorageConfig`), the clients built
from them (pyarrow's S3 file system for data reads, fsspec's for the rest; one retry policy, timeouts that hold), how
long a call to a store that stopped answering takes to fail (:func:`give_up_after_s`), and whether the main thread is
waiting on one now (:func:`waiting`).

Credentials are never configured here: both clients read the standard chain of the store's client
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and ``~/.aws/credentials``,
an instance role). What is configured is where the store is (``endpoint_url`` for an S3-compatible store, else
``AWS_ENDPOINT_URL``), its region and how hard to retry.

Apart from :mod:`recsys_runner.stores`, which reads, writes and lists through these clients and names every failure,
because how a store is reached is set once per process (each entry calls :func:`configure`) and read by rooms that
touch no file: the data workers hand the settings on, the signal handler asks whether the main thread waits, DCP's
checkpoint reader and writer take the fsspec options. May import ``errors`` only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow.fs as pafs

from recsys_runner.errors import require


@dataclass(kw_only=True)
class StorageConfig:
    """``storage.*``: where an object store is and how hard to retry it. Never credentials (module docstring)."""

    endpoint_url: str | None = None
    """The S3 endpoint of an S3-compatible store (MinIO, Ceph, a loopback test server), e.g.
    ``http://127.0.0.1:9000``; ``null``: ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, else AWS itself."""
    region: str | None = None
    """The bucket's region; ``null``: ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` / the client's config file."""
    max_attempts: int = 5
    """Tries of each request (the first included), with exponential backoff between them, before it fails."""
    connect_timeout_s: float = 5.0
    """Seconds to wait for a connection to the store."""
    request_timeout_s: float = 30.0
    """Seconds to wait for a request's answer. A store that stops answering is given up on after about
    ``max_attempts × (connect_timeout_s + request_timeout_s)`` plus the backoff between tries (:func:`give_up_after_s`),
    for every kind of call: data reads, listings, the checkpoint lock, checkpoint writes and reads, outputs."""
    lock_ttl_s: float = 60.0
    """A checkpoint directory's lock in an object store is renewed every third of this; a lock not renewed for this
    long belongs to a dead run and is taken over (on one host a dead holder's lock is taken over at once)."""
    prefetch_units: int = 2
    """Units (Parquet row groups, blocks of text lines) of object-store files read ahead in a background thread, so
    a slow store does not stall steps; 0 reads in the training process's turn."""

    def __post_init__(self) -> None:
        require(self.max_attempts >= 1, f"storage.max_attempts={self.max_attempts} must be >= 1 (1: no retry). Fix: e.g. storage.max_attempts=5")
        require(self.connect_timeout_s > 0 and self.request_timeout_s > 0, "storage.connect_timeout_s and storage.request_timeout_s must "
                "be > 0. Fix: e.g. storage.request_timeout_s=30")
        require(self.lock_ttl_s >= 3, f"storage.lock_ttl_s={self.lock_ttl_s} must be >= 3 seconds. Fix: e.g. storage.lock_ttl_s=60")
        require(self.prefetch_units >= 0, f"storage.prefetch_units={self.prefetch_units} must be >= 0. Fix: e.g. storage.prefetch_units=2")
        require(self.endpoint_url is None or "://" in self.endpoint_url,
                f"storage.endpoint_url={self.endpoint_url!r} needs a scheme. Fix: e.g. storage.endpoint_url=http://127.0.0.1:9000")


_settings = StorageConfig()


def configure(config: StorageConfig) -> None:
    """Use ``config`` for every store this process opens from now on (each entry calls it once, from the run's config)."""
    global _settings
    _settings = config
    arrow_s3.cache_clear()  # a new client: the settings, and the credentials in the environment now
    fsspec_for.cache_clear()
    _aio_session.cache_clear()


def settings() -> StorageConfig:
    """The :class:`StorageConfig` in force."""
    return _settings


_waiting = 0
"""How deep the main thread is in calls that wait on a store (:func:`waiting`)."""


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Mark the block as the main thread waiting on a store (a checkpoint write, a unit being read ahead), for the
    training loop's signal handler: a stop it would otherwise take after the step is taken at once instead, since a
    stalled store can hold the step for the whole retry bound (:func:`give_up_after_s`), past a scheduler's grace period.
    Other threads' waits are not marked (signals reach only the main thread)."""
    global _waiting
    main = threading.current_thread() is threading.main_thread()
    if main:
        _waiting += 1
    try:
        yield
    finally:
        if main:
            _waiting -= 1


def waiting_now() -> bool:
    """Whether the main thread is inside :func:`waiting`."""
    return _waiting > 0


def give_up_after_s() -> float:
    """About how long one call to a store that stopped answering takes to fail under the settings in force: every
    attempt waits for its connection and its answer, with exponential backoff (at most 20 s) between attempts."""
    s = _settings
    backoff = sum(min(2.0 ** i, 20.0) for i in range(s.max_attempts - 1))
    return s.max_attempts * (s.connect_timeout_s + s.request_timeout_s) + backoff


def endpoint_url() -> str | None:
    """The S3 endpoint in force: ``storage.endpoint_url``, ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL`` or none (AWS)."""
    return _settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def region() -> str | None:
    """The region in force; an endpoint without one gets ``us-east-1`` (S3-compatible stores ignore it)."""
    found = _settings.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return found or ("us-east-1" if endpoint_url() else None)


@functools.cache
def arrow_s3() -> pafs.S3FileSystem:
    """pyarrow's S3 file system under the settings in force (data reads); one per process, built on first use."""
    s = _settings
    options: dict[str, Any] = {"connect_timeout": s.connect_timeout_s, "request_timeout": s.request_timeout_s,
                               "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=s.max_attempts)}
    if (url := endpoint_url()) is not None:
        options["endpoint_override"] = url
        options["scheme"] = url.split("://", 1)[0]
    if (where := region()) is not None:
        options["region"] = where
    return pafs.S3FileSystem(**options)


@functools.cache
def fsspec_for(scheme: str) -> fsspec.AbstractFileSystem:
    """The fsspec file system of ``scheme`` under the settings in force (s3fs for ``s3``); one per process, built on
    first use."""
    fs = fsspec.filesystem(scheme, **fsspec_options(scheme))
    return one_retry_policy(fs)


def one_retry_policy(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    """``fs`` with retries only in its client (botocore's ``storage.max_attempts``): s3fs retries each call again 5
    times on a timeout around the client's own attempts, which multiplied a stalled store's wait 5-fold (minutes
    with no log line). For every s3fs instance the package makes, DCP's checkpoint reader and writer included."""
    if hasattr(fs, "retries"):
        fs.retries = 1
    return fs


def fsspec_options(scheme: str = "s3") -> dict[str, Any]:
    """The fsspec storage options of ``scheme`` (for s3fs: endpoint, region, retries, timeouts; never credentials)."""
    if scheme not in ("s3", "s3a"):
        return {}
    s = _settings
    client: dict[str, Any] = {}
    if (url := endpoint_url()) is not None:
        client["endpoint_url"] = url
    if (where := region()) is not None:
        client["region_name"] = where
    return {"client_kwargs": client, "skip_instance_cache": True, "use_listings_cache": False, "session": _aio_session(),
            "config_kwargs": {"retries": {"max_attempts": s.max_attempts, "mode": "standard"},
                              "connect_timeout": s.connect_timeout_s, "read_timeout": s.request_timeout_s}}


@functools.cache
def _aio_session() -> Any:
    """The aiobotocore session of every s3fs instance: botocore's, without its ``Expect: 100-continue`` header on
    uploads. aiohttp waits for the server's ``100 Continue`` with no timeout at all, so a store that stopped answering
    held a checkpoint write or the lock forever (``storage.request_timeout_s`` never applied); without the header the
    body goes at once and the answer is waited for within the timeout. Credentials come from the standard chain as before."""
    from aiobotocore.session import AioSession

    session = AioSession()
    session.get_component("event_emitter").register_last("before-call.s3", _no_expect_header, unique_id="recsys-runner-no-expect")
    return session


def _no_expect_header(params: dict[str, Any], **_: Any) -> None:
    params.get("headers", {}).pop("Expect", None)


def _forget_clients() -> None:
    """In a forked child (a DataLoader worker reading a bucket): drop the parent's store clients, so that the child
    builds its own on first use. A client holds connection pools, locks and the SDK's threads; the threads do not
    survive a fork, and a lock one of them held at that moment stays held in the child, so a worker that reused the
    parent's client could hang or crash (a worker segfault was seen once in the suite)."""
    arrow_s3.cache_clear()
    fsspec_for.cache_clear()
    _aio_session.cache_clear()


os.register_at_fork(after_in_child=_forget_clients)
