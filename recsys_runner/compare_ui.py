"""``python -m recsys_runner.compare --ui-url``: the MLflow UI's page of a store's most recently active experiment, as
``make ui`` prints it once the UI server it started answers (``--wait-for-ui``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from recsys_runner.tracking.store import UI_PORT, missing_store, ui_url


def last_experiment_url(client: Any, tracking_uri: str, port: int = UI_PORT) -> str | None:
    """The UI's page of the experiment whose run started last; ``None`` when the store holds no run. For a local store,
    the page that ``mlflow ui --port <port>`` serves."""
    ids = [e.experiment_id for e in client.search_experiments()]
    latest = client.search_runs(ids, max_results=1, order_by=["attributes.start_time DESC"]) if ids else []
    if not latest:
        return None
    experiment = latest[0].info.experiment_id
    return ui_url(tracking_uri, experiment) or ui_url(f"http://127.0.0.1:{port}", experiment)


def print_ui_url(uri: str, port: int = UI_PORT, server: int | None = None) -> int:
    """``--ui-url``: the last experiment's page, or a line saying there is none yet (status 0 either way: ``make ui``
    serves a store that may not exist yet). With ``server`` (``--wait-for-ui``, the PID of the ``mlflow ui`` that
    ``make ui`` started first) the page is printed once the UI answers (it takes ~15 s to start): a page printed
    before then was refused when opened at once."""
    from mlflow.tracking import MlflowClient

    why = ui_not_started(port, server) if server is not None else None
    if why is not None:
        print(f"the MLflow UI (PID {server}) {why}. Fix: make ui PORT=<a free port>", file=sys.stderr)
        return 0
    url = None if missing_store(uri) is not None else last_experiment_url(MlflowClient(tracking_uri=uri), uri, port)
    print(url or f"no run in {uri} yet: the UI lists runs once they log there")
    return 0


def ui_not_started(port: int, server: int, timeout_s: float = 300.0) -> str | None:
    """Wait until the MLflow UI ``server`` (a PID) answers its health check on 127.0.0.1:``port``; ``None`` then, else
    why not: the port answered at once, before any UI could have started (another server holds it, and this one
    cannot bind it), the process ended (it could not start: its own error says why), or ``timeout_s`` passed."""
    import urllib.request

    deadline, first = time.monotonic() + timeout_s, True
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return f"cannot serve port {port}: another server already answers there" if first else None
        except OSError:
            pass
        if not _alive(server):
            return f"ended before it answered on port {port}: its error is above"
        first = False
        time.sleep(0.25)
    return f"did not answer on port {port} within {timeout_s:.0f} s"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: not gone, and not a zombie (``make ui``'s shell reaps its server only at its
    ``wait``, so a server that failed to start stays one while :func:`ui_answers` polls; Linux's ``/proc`` says so)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"
