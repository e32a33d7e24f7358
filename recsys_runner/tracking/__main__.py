"""``python -m recsys_runner.tracking replay <file>``: send metrics a run could not deliver to its MLflow run;
``python -m recsys_runner.tracking end <run id>``: end a run left RUNNING whose process is gone."""

from __future__ import annotations

import argparse

from recsys_runner.errors import TrackingError, reported
from recsys_runner.tracking.outbox import replay
from recsys_runner.tracking.store import failure, missing_store, resolve_uri

_END_STATUSES = ("KILLED", "FAILED", "FINISHED")


def end(run_id: str, status: str, uri: str | None = None) -> str:
    """End MLflow run ``run_id`` with ``status`` at this time, when it is RUNNING: what a process that died without ending
    its run would have done (a sweep's launcher and ``compare collect`` do it for the runs they can tell apart). Returns
    the line to print.

    Raises:
        TrackingError: naming the store, when it is missing or does not answer, lacks the run, or the run has ended
            already (one line and exit status 2 from the command line).
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    store = resolve_uri(uri)
    if (missing := missing_store(store)) is not None:  # never create a store to look for a run in it
        raise TrackingError(f"no MLflow store at {store}: {missing}. Fix: pass the sweep's store with --uri")
    client = MlflowClient(tracking_uri=store)
    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":  # the store did not answer (a server down): not a missing run
            raise TrackingError(f"the MLflow store {client.tracking_uri} did not answer ({failure(e)}). Fix: start it, or "
                                "pass the store the run is in with --uri") from None
        raise TrackingError(f"no MLflow run {run_id} in {client.tracking_uri}. Fix: pass the store the run is in with --uri, "
                            "or check the run id") from None
    if run.info.status != "RUNNING":
        raise TrackingError(f"MLflow run {run_id} ({run.info.run_name}) has ended already: {run.info.status}; nothing done")
    client.set_terminated(run_id, status=status)
    return f"ended MLflow run {run_id} ({run.info.run_name}) {status}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recsys_runner.tracking", description="Tracking utilities.")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("replay", help="send metrics a run could not deliver (mlflow_unsent_<run id>.json)")
    rep.add_argument("file")
    rep.add_argument("--uri", default=None, help="tracking URI (default: the one the run used)")
    stop = sub.add_parser("end", help="end a run left RUNNING by a process that is gone (a killed job)")
    stop.add_argument("run_id")
    stop.add_argument("--status", choices=_END_STATUSES, default="KILLED", help="its end status (default: KILLED)")
    stop.add_argument("--uri", default=None, help="tracking URI (default: $MLFLOW_TRACKING_URI or ./mlflow.db)")
    args = parser.parse_args(argv)
    if args.command == "end":
        with reported():
            print(end(args.run_id, args.status, args.uri))
        return
    with reported():  # a missing or foreign file: one line, exit status 2
        run_id = replay(args.file, args.uri)
    print(f"replayed {args.file} into run {run_id}")


if __name__ == "__main__":
    main()
