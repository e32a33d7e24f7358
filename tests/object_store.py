"""A real S3-compatible server on loopback for the object-store tests: moto's standalone server (``moto[server]``),
started by the tests themselves, so ``make test`` and ``.ci/run`` need nothing set up.

:func:`start_moto` starts one ``moto_server`` process on a free port of 127.0.0.1 and waits until it answers;
:class:`MotoServer` gives its endpoint, the environment a client needs (fake credentials: moto accepts any unless
``INITIAL_NO_AUTH_ACTION_COUNT`` makes it check them), buckets, and ``pause``/``resume`` (SIGSTOP/SIGCONT: the
server stops answering but keeps its objects, which a restart would lose) and ``stop`` (by its PID).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec

from tests.conftest import free_port

FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "",
                    "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@dataclass
class MotoServer:
    """One running ``moto_server`` (module docstring)."""

    endpoint: str
    proc: subprocess.Popen[bytes]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    """What a client's process needs: the endpoint (``AWS_ENDPOINT_URL``) and fake credentials."""

    def fs(self) -> Any:
        """An s3fs file system on this server (test setup and checks)."""
        return fsspec.filesystem("s3", key="testing", secret="testing", skip_instance_cache=True,
                                 client_kwargs={"endpoint_url": self.endpoint, "region_name": "us-east-1"})

    def bucket(self, name: str) -> str:
        """Create bucket ``name`` (if missing); ``s3://name``."""
        fs = self.fs()
        if not fs.exists(name):
            fs.call_s3("create_bucket", Bucket=name)
        return f"s3://{name}"

    def put(self, local: Path, uri: str) -> None:
        """Upload a file, or every file of a directory, to ``uri``."""
        fs, rest = self.fs(), uri.removeprefix("s3://").rstrip("/")
        files = [local] if local.is_file() else sorted(p for p in local.iterdir() if p.is_file())
        for f in files:
            fs.put_file(str(f), rest if local.is_file() else f"{rest}/{f.name}")

    @contextlib.contextmanager
    def as_client(self, monkeypatch: Any, settings: Any) -> Iterator[MotoServer]:
        """This process set up as a user would (the server's endpoint and credentials in the environment, ``settings``
        as ``storage.*``); afterwards the server answers again and the default settings are back."""
        from recsys_runner import store_settings

        for key, value in self.env.items():
            monkeypatch.setenv(key, value)
        store_settings.configure(settings)
        try:
            yield self
        finally:
            self.resume()
            store_settings.configure(store_settings.StorageConfig())

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def request_waiting(self) -> bool:
        """Whether a client has sent this paused server a request it has not read: a socket on the server's port holding
        unread bytes, or a connection not yet accepted (``rx_queue`` in ``/proc/net/tcp``; the kernel still accepts
        connections and data for a stopped process). A test that must act while a client waits on the store polls this
        instead of sleeping and hoping the client got there."""
        port = int(self.endpoint.rsplit(":", 1)[1])
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError):
                for line in Path(table).read_text().splitlines()[1:]:
                    fields = line.split()  # sl, local address, remote address, state, tx_queue:rx_queue, ...
                    if int(fields[1].rsplit(":", 1)[1], 16) == port and int(fields[4].split(":")[1], 16) > 0:
                        return True
        return False

    def stop(self) -> None:
        """Stop the server (its PID, never a name) and wait for it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_moto(tmp: Path, extra_env: dict[str, str] | None = None, timeout: float = 30.0) -> MotoServer:
    """Start ``moto_server`` on 127.0.0.1 at a free port and wait until it accepts connections."""
    port = free_port()
    exe = Path(sys.executable).parent / "moto_server"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
    log = tmp / f"moto-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*command, "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(extra_env or {})})
    endpoint = f"http://127.0.0.1:{port}"
    server = MotoServer(endpoint, proc, log, {**FAKE_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return server
        except OSError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"moto_server did not answer on {endpoint} within {timeout:.0f} s: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def moto_with_buckets(tmp: Path, *buckets: str) -> Iterator[MotoServer]:
    """A moto server (:func:`start_moto`) holding the empty ``buckets`` until the block ends, then stopped by its PID:
    the module fixture of a test file that shares one server."""
    server = start_moto(tmp)
    try:
        for name in buckets:
            server.bucket(name)
        yield server
    finally:
        server.stop()
