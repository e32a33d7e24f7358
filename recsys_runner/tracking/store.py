"""The MLflow store: where it is (``tracking.uri``, ``MLFLOW_TRACKING_URI``, ``sqlite:///mlflow.db``), opening it
within seconds or failing with a :class:`~recsys_runner.errors.TrackingError` that names the URI, the cause and the fixes,
and serializing the creation of a new sqlite store across processes (:func:`store_lock`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shlex
import shutil
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from recsys_runner.errors import TrackingError

log = logging.getLogger(__name__)


def resolve_uri(uri: str | None) -> str:
    """``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else ``mlflow.db`` in the current directory."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('mlflow.db')}"


def uri_source(uri: str | None) -> str:
    """Where :func:`resolve_uri` takes the URI from, for messages."""
    if uri:
        return "tracking.uri"
    return "$MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "the default store"


def is_remote(uri: str) -> bool:
    """Whether ``uri`` is a tracking server (HTTP) rather than a store this process opens itself."""
    return uri.startswith(("http://", "https://"))


def sqlite_path(uri: str) -> str | None:
    """The absolute path of a ``sqlite:`` store's database file; ``None`` for other stores and in-memory databases."""
    if not uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(uri).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return os.path.abspath(database)


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Hold a lock on ``<database>.lock`` while opening a sqlite store (no-op for other stores).

    MLflow creates a new sqlite store's tables and default experiment without a lock, so processes
    that open a new file together crash one another (``table experiments already exists``,
    ``duplicate column name``), e.g. runs launched together by a script or a SLURM array. A store without tables
    is opened under an exclusive lock, so the next process waits and then finds the tables made; a
    store that has them is opened under a shared lock, so the jobs of a sweep still open it side by
    side (opening takes seconds: MLflow verifies the schema). ``flock`` is released by the kernel
    however its holder dies. The lock file stays (deleting it would let a waiter and a newcomer lock
    different files)."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # no creator can be at work while this is held
        if not _has_tables(path):
            fcntl.flock(fd, fcntl.LOCK_EX)  # not atomic (flock drops the shared lock first); MLflow re-checks its tables
        yield
    finally:
        os.close(fd)  # releases the lock


def missing_store(uri: str) -> str | None:
    """Why ``uri`` names no existing store, for a reader that must not create one (``compare``): a ``sqlite:`` file
    that does not exist or holds no tables yet, a local (``file:`` or plain path) store directory that does not exist;
    ``None`` when it exists, or when only a request can tell (a tracking server, a database server, in-memory sqlite).
    Reads nothing but the file system and creates no store (only the lock file beside an existing database); waits
    while another process is creating the store (:func:`_made`)."""
    path = sqlite_path(uri)
    if path is not None:
        if not os.path.isfile(path):
            return f"{path} does not exist"
        return None if _made(path) else f"{path} holds no MLflow tables (an empty database)"
    scheme = urlsplit(uri).scheme
    if scheme not in ("", "file"):
        return None
    local = urlsplit(uri).path if scheme == "file" else uri
    return None if os.path.isdir(local) else f"{os.path.abspath(local)} does not exist"


def _made(path: str) -> bool:
    """Whether the sqlite store at ``path`` has its tables, checked under a shared :func:`store_lock`: a run creating the
    store holds it exclusively until MLflow has made every table and the default experiment, so a reader (``compare``, a
    script polling a sweep's store) waits for that instead of seeing the first tables and opening the store itself,
    which would make the rest again (``table ... already exists``) and crash the creator. Where the lock file cannot be
    opened (a read-only folder) no run can be creating the store, and the tables are read without it."""
    try:
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return _has_tables(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        return _has_tables(path)
    finally:
        os.close(fd)  # releases the lock


def _has_tables(path: str) -> bool:
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return False
    with contextlib.closing(sqlite3.connect(f"{Path(path).as_uri()}?mode=ro", uri=True, timeout=60)) as db:
        return db.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0] > 0


def open_store(uri: str, source: str) -> Any:
    """Open the store at the start of a run or sweep: an ``MlflowClient`` whose store has answered and
    can be written.

    Fails within seconds with a :class:`TrackingError` naming ``uri`` (taken from ``source``, see
    :func:`uri_source`), the cause and the fixes; see the module docstring for why. Creates nothing
    but a missing sqlite store (the experiment is created with the run)."""
    from mlflow.tracking import MlflowClient

    with store_errors(uri, source):
        _check_sqlite_writable(uri, source)
        with store_lock(uri):
            client = MlflowClient(tracking_uri=uri)  # builds a sqlite store: its tables, its default experiment
            client.search_experiments(max_results=1)  # a request: a server answers now, or the check fails now
        return client


@contextlib.contextmanager
def store_errors(uri: str, source: str) -> Iterator[None]:
    """Around the start-of-run calls to a store: no HTTP retries, and a failure becomes a :class:`TrackingError`
    that names the URI, the cause and the fixes."""
    try:
        with no_http_retries(is_remote(uri)):
            yield
    except TrackingError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the store says, the run cannot start; the cause is in the message
        raise TrackingError(_store_error(uri, source, e)) from e

_NO_TRACKING = "or run without tracking: tracking=none"

_WHY_AT_START = ("A run needs its MLflow run from the start (a resume continues it, sweep jobs are filed under their "
                 "parent), so it does not start without its store; an outage after the start only buffers metrics.")


def _store_error(uri: str, source: str, error: BaseException) -> str:
    cause = _root_cause(error)
    if is_remote(uri) and isinstance(cause, OSError):
        parts = urlsplit(uri)
        return (f"tracking server {uri} ({source}) is not reachable: {_describe(cause)}. {_WHY_AT_START} Fix: start the "
                f"server (mlflow server --host {parts.hostname} --port {parts.port or 5000} --backend-store-uri "
                f"sqlite:///mlflow.db), check the URI (tracking.uri=... or MLFLOW_TRACKING_URI), {_NO_TRACKING}")
    return (f"tracking store {uri} ({source}) cannot be used: {_describe(cause)}. {_WHY_AT_START} Fix: check the URI "
            f"(tracking.uri=... or MLFLOW_TRACKING_URI) and the store behind it, {_NO_TRACKING}")


def _check_sqlite_writable(uri: str, source: str) -> None:
    """Write to a sqlite store and roll back: a read-only file or directory opens fine and fails at the first write."""
    path = sqlite_path(uri)
    if path is None:
        return
    directory = os.path.dirname(path)
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=60)) as db:  # creates a missing file, as MLflow would
            db.execute("BEGIN IMMEDIATE")
            db.execute("CREATE TABLE recsys_runner_write_probe (x INTEGER)")
            db.rollback()
    except sqlite3.Error as e:
        missing = "" if os.path.isdir(directory) else f" (directory {directory} does not exist)"
        raise TrackingError(
            f"tracking store {uri} ({source}) cannot be written: sqlite says {e!s}{missing}. Fix: make {path} and its "
            f"directory writable (sqlite writes a journal file next to the database), point tracking.uri (or "
            f"MLFLOW_TRACKING_URI) at a writable MLflow store, {_NO_TRACKING}"
        ) from e


def _root_cause(error: BaseException) -> BaseException:
    """The innermost exception of a chain (MLflow wraps requests, which wraps urllib3, which wraps the socket error)."""
    seen = {id(error)}
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        error = inner
    return error


def failure(error: BaseException) -> str:
    """What went wrong with a store, in one short line: the innermost cause of ``error`` (``ConnectionRefusedError: …``),
    not MLflow's wrapping of requests' wrapping of it."""
    return _describe(_root_cause(error))


def _describe(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text[:300]}" if text else type(error).__name__


EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
"""The experiment tag MLflow 3 reads for the kind of an experiment (its UI's default view in builds that honour it)."""
EXPERIMENT_KIND = "custom_model_development"
"""The kind the runner gives its experiments: model training, not GenAI traces."""
UI_VIEW = "workflowType=machine_learning"
"""The URL parameter that opens MLflow 3.x's OSS UI on an experiment's training runs: it ignores
:data:`EXPERIMENT_KIND_TAG` and would show a GenAI overview of traces by default."""


def experiment_id(client: Any, name: str) -> str:
    """The id of experiment ``name``, created when missing (tolerating a concurrent creator), with the experiment kind
    :data:`EXPERIMENT_KIND` unless it has a kind already (a user's choice stands)."""
    found = client.get_experiment_by_name(name)
    if found:
        _set_kind(client, found)
        return found.experiment_id
    try:
        return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except Exception:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        _set_kind(client, found)
        return found.experiment_id


def _set_kind(client: Any, experiment: Any) -> None:
    """Give an experiment made elsewhere (by hand, by an older runner) the runner's kind when it has none; a store that
    refuses only warns: the kind is a view, the run goes on without it."""
    if EXPERIMENT_KIND_TAG in (experiment.tags or {}):
        return
    try:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    except Exception as e:  # noqa: BLE001 - a missing view hint must not stop a run
        log.warning("could not tag MLflow experiment %s %s=%s: %s", experiment.name, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND, e)


UI_PORT = 5000
"""The port of the ``mlflow ui`` command the runner prints for a local store (MLflow's own default)."""


def ui_lines(tracking_uri: str, experiment_id: str, run_id: str | None = None, port: int = UI_PORT) -> list[str]:
    """How to see an experiment (or one of its runs) in the MLflow UI: a server's page, or for a local store the command
    that serves it and the page that command serves."""
    served = ui_url(tracking_uri, experiment_id, run_id)
    if served is not None:
        return [f"MLflow UI: {served}"]
    command = f"{mlflow_command()} ui --backend-store-uri {shlex.quote(tracking_uri)} --port {port}"
    return [f"MLflow UI: {command}", f"  then open {ui_url(f'http://127.0.0.1:{port}', experiment_id, run_id)}"]


def mlflow_command() -> str:
    """``mlflow`` as the user can type it to serve the UI: ``mlflow`` when that name on ``PATH`` is this environment's
    (an activated venv), else the absolute path of this environment's script. ``make run`` trains with
    ``.venv/bin/python`` without activating ``.venv``, so a bare ``mlflow`` would be "command not found" (or another
    installation's, of another MLflow version) in the shell it printed to."""
    own = Path(os.path.abspath(sys.executable)).parent / "mlflow"
    found = shutil.which("mlflow")
    if not own.is_file() or (found is not None and Path(found).resolve() == own.resolve()):
        return "mlflow"
    return shlex.quote(str(own))


def ui_url(tracking_uri: str, experiment_id: str, run_id: str | None = None) -> str | None:
    """The MLflow UI's page of an experiment (or of one of its runs) on the tracking server ``tracking_uri``, opened on
    its training runs (:data:`UI_VIEW`); ``None`` for a store this process opens itself (sqlite, a folder), which has
    no UI until ``mlflow ui`` serves it."""
    if not is_remote(tracking_uri):
        return None
    page = f"experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
    return f"{tracking_uri.rstrip('/')}/#/{page}?{UI_VIEW}"


@contextlib.contextmanager
def no_http_retries(remote: bool) -> Iterator[None]:
    """Fail fast while training: MLflow's default HTTP policy retries for minutes with backoff.

    The tracker retries on its own schedule instead (at the log cadence, and at the end)."""
    if not remote:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "5"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
