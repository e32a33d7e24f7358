"""What a run logged that its store has not taken yet: held through an outage, re-sent, and at the run's end, if the
store is still gone, written to a replay file that ``python -m recsys_runner.tracking replay`` sends later.

Training never waits on a tracking server: a metric batch (or text artifact) that cannot be sent stays in the
:class:`Outbox` and is re-sent with the next one, with a growing pause between attempts (:meth:`Outbox.due`), and a
single warning per outage. What is still there when the run ends — and the run's end itself, when the store does not
take it — goes to ``mlflow_unsent_<run id>.json`` (:func:`unsent_file`) in the directory the run started in, which
the run names in its tag :data:`UNSENT_DIR_TAG`: a sweep's launcher or ``compare collect`` looks there before ending a
run whose job completed but whose end never reached the store (:mod:`recsys_runner.tracking.sweep_jobs`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from recsys_runner.errors import Stopped, TrackingError
from recsys_runner.tracking.store import is_remote, no_http_retries

log = logging.getLogger(__name__)

METRICS_PER_CALL = 1000
"""MLflow's limit on metrics per ``log_batch``."""
UNSENT_DIR_TAG = "tracking.unsent_dir"
"""On every MLflow run: the directory its :func:`unsent_file` goes to if the store is gone when the run ends."""


def unsent_file(directory: str | Path, run_id: str) -> Path:
    """Where a run's data the store did not take at its end waits for ``python -m recsys_runner.tracking replay``."""
    return Path(directory) / f"mlflow_unsent_{run_id}.json"


class Outbox:
    """The metric values (``mlflow.entities.Metric``) and texts a run logged that the store at ``uri`` has not taken yet."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.metrics: list[Any] = []
        self.texts: list[tuple[str, str]] = []  # (text, artifact file)
        self.next_try = 0.0
        """When the next attempt is due (``time.monotonic()``): after a failure, a pause that doubles up to a minute."""
        self._remote = is_remote(uri)
        self._backoff_s = 1.0
        self._warned = False

    def due(self) -> bool:
        """Whether sending is due now: never inside the pause after a failure, so an outage does not slow training."""
        return time.monotonic() >= self.next_try

    def empty(self) -> bool:
        return not self.metrics and not self.texts

    def flush(self, client: Any, run_id: str) -> bool:
        """Send everything held to ``run_id``, in order; True when nothing is left. Never raises for a store outage."""
        try:
            with no_http_retries(self._remote):
                while self.metrics:
                    client.log_batch(run_id, metrics=self.metrics[:METRICS_PER_CALL])
                    del self.metrics[:METRICS_PER_CALL]
                while self.texts:
                    text, artifact_file = self.texts[0]
                    client.log_text(run_id, text, artifact_file)
                    self.texts.pop(0)
        except Stopped:  # a signal that arrived while sending: the command stops, the data stays held for the run's end
            raise
        except Exception as e:  # noqa: BLE001 - any store failure: keep the data and carry on training
            self.next_try = time.monotonic() + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, 60.0)
            if not self._warned:
                log.warning("tracking server %s unreachable (%s); training continues, metrics are buffered and re-sent",
                            self.uri, type(e).__name__)
                self._warned = True
            return False
        if self._warned:
            log.warning("tracking server %s reachable again; buffered metrics sent", self.uri)
            self._warned = False
        self._backoff_s = 1.0
        self.next_try = 0.0
        return True

    def write(self, directory: Path, run_id: str, status: str) -> Path:
        """Write what is held, and the run's end ``status``, to the run's replay file in ``directory``; its path."""
        path = unsent_file(directory, run_id)
        record = {
            "uri": self.uri,
            "run_id": run_id,
            "status": status,
            "metrics": [[m.key, m.value, m.timestamp, m.step] for m in self.metrics],
            "texts": self.texts,
        }
        path.write_text(json.dumps(record))
        return path


_RECORD_KEYS = ("uri", "run_id", "status", "metrics", "texts")
"""What :meth:`Outbox.write` puts in a replay file, and :func:`replay` reads."""


def replay(path: str | Path, uri: str | None = None) -> str:
    """Send a file written by :meth:`Outbox.write` to its run and set the run's end status.

    Raises:
        TrackingError: the file is missing or is no replay file (the command line's one line and exit status 2, not a
            traceback).
    """
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    fix = (f"Fix: give the mlflow_unsent_<run id>.json a run wrote when its store was gone (the run's tag {UNSENT_DIR_TAG} "
           "names its directory)")
    try:
        record = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TrackingError(f"{path}: no such file. {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TrackingError(f"{path} cannot be read as a replay file ({type(e).__name__}: {e}). {fix}") from None
    if not isinstance(record, dict) or (lacks := [k for k in _RECORD_KEYS if k not in record]):
        raise TrackingError(f"{path} is no replay file: it lacks {lacks if isinstance(record, dict) else list(_RECORD_KEYS)}. {fix}")
    client = MlflowClient(tracking_uri=uri or record["uri"])
    metrics = [Metric(k, v, ts, step) for k, v, ts, step in record["metrics"]]
    for i in range(0, len(metrics), METRICS_PER_CALL):
        client.log_batch(record["run_id"], metrics=metrics[i : i + METRICS_PER_CALL])
    for text, artifact_file in record["texts"]:
        client.log_text(record["run_id"], text, artifact_file)
    client.set_terminated(record["run_id"], status=record["status"])
    return str(record["run_id"])
