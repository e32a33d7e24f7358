"""A job preempted before its first checkpoint, launched again: whether the relaunch may continue the MLflow run of the
first launch instead of starting a second run for the same job.

A launch that resumes a checkpoint continues the MLflow run the checkpoint names (``meta.json``'s ``run_id``). A launch
stopped before it wrote one (a preemption during the sanity eval, a first checkpoint the store never took) left nothing
to name its run: the requeued launch, the same command on the same checkpoint directory, found no checkpoint and
started a new run, leaving the first one ``KILLED`` with nothing to resume, and the user two runs for one job. So
every training launch records its run in the checkpoint directory at start (:data:`RECORD_FILE`, :func:`run_record`,
written through the checkpoint storage, so an object store keeps it as well), and a launch that finds no checkpoint but
such a record continues that run when nothing would tell the two launches apart in it (:func:`why_not_continue`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from recsys_runner.tracking.store import sqlite_path

RECORD_FILE = ".mlflow_run"
"""The record of the MLflow run a training launch opened, in its checkpoint directory: JSON ``{"run_id", "uri"}``."""

PREEMPTED_TAG = "preempted"
"""Set ``true`` on a run that ended ``KILLED`` because its job was preempted (submitit requeues it)."""

_SHOWN_CHANGES = 3  # params named in the reason a changed config gives; the rest are counted


def run_record(run_id: str, uri: str) -> str:
    """The text of :data:`RECORD_FILE` for run ``run_id`` of the store ``uri``."""
    return json.dumps({"run_id": run_id, "uri": uri})


def recorded_id(record: str) -> str | None:
    """The run id a record names; ``None`` when it is no record this version wrote (unreadable, or another shape)."""
    try:
        found = json.loads(record)
    except ValueError:
        return None
    run_id = found.get("run_id") if isinstance(found, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


def _same_store(a: str, b: str) -> bool:
    """Two URIs of one store: equal, or two spellings of one sqlite file."""
    return a == b or (sqlite_path(a) is not None and sqlite_path(a) == sqlite_path(b))


def why_not_continue(client: Any, record: str, *, uri: str, experiment: str, params: Mapping[str, str],
                     parent: str | None) -> str | None:
    """Why the run ``record`` names must not be continued by a launch at step 0 that would log ``params`` into
    ``experiment`` of the store ``uri`` (under sweep ``parent``, if any); ``None`` when it may.

    It may when nothing would tell the two launches apart in it: it ended ``KILLED`` and tagged preempted (so no one
    is logging into it and its job was meant to go on), it is in this store and experiment (and sweep), it logged the
    same params (the same config: the run says what it trained with), and it logged no metric at all (this launch
    starts at step 0, so any metric there is one this launch logs again: two values at one step)."""
    run_id = recorded_id(record)
    if run_id is None:
        return "the record cannot be read"
    recorded_uri = json.loads(record).get("uri")
    if not isinstance(recorded_uri, str) or not _same_store(recorded_uri, uri):
        return f"it is in another tracking store ({recorded_uri}, this launch logs to {uri})"
    try:
        run = client.get_run(run_id)
    except Exception as e:  # noqa: BLE001 - deleted, or never reached this store: a new run, as with no record
        return f"the store does not have it ({type(e).__name__}: {str(e)[:200]})"
    if run.info.status != "KILLED" or run.data.tags.get(PREEMPTED_TAG) != "true":
        if run.info.status == "KILLED":
            return "it was KILLED, but not by a preemption (a stop asked for by hand is not continued)"
        return f"it ended {run.info.status}, not KILLED by a preemption"
    found = client.get_experiment_by_name(experiment)
    if found is None or found.experiment_id != run.info.experiment_id:
        return f"it is not in experiment {experiment!r}"
    if run.data.tags.get("mlflow.parentRunId") != parent:
        return "it belongs to another sweep" if parent else "it is a sweep's job, this launch is not"
    changed = sorted(k for k in params.keys() | run.data.params.keys() if params.get(k) != run.data.params.get(k))
    if changed:
        shown = "; ".join(f"{k}: {run.data.params.get(k, '(unset)')} -> {params.get(k, '(unset)')}" for k in changed[:_SHOWN_CHANGES])
        more = f" and {len(changed) - _SHOWN_CHANGES} more" if len(changed) > _SHOWN_CHANGES else ""
        return f"this launch's config differs from the one it logged ({shown}{more})"
    if run.data.metrics:
        keys = sorted(run.data.metrics)
        return (f"it logged metrics ({', '.join(keys[:_SHOWN_CHANGES])}{' …' if len(keys) > _SHOWN_CHANGES else ''}) that this launch, "
                f"starting from step 0 with no checkpoint, would log again")
    return None

