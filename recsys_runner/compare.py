"""``python -m recsys_runner.compare``: runs from MLflow as a table and as PNG plots.

For people who would rather read a terminal or look at a picture than click through the MLflow UI::

    python -m recsys_runner.compare                                     # the most recent sweep (else the default experiment)
    python -m recsys_runner.compare --experiment lr_grid               # every run of an experiment
    python -m recsys_runner.compare --parent <run id>                   # the children of one sweep
    python -m recsys_runner.compare --experiment lr_grid --filter "params.model._target_ LIKE '%DLRM'"
    python -m recsys_runner.compare --experiment seeds --repeats seed  # a row per configuration: mean ± std over seeds
    python -m recsys_runner.compare collect --parent <run id> --wait    # a detached sweep: wait, summarize

It prints one row per run (name, status, the parameters that differ between the runs, final
metrics) and writes ``curves.png`` (each metric over steps, a line per run) and
``<metric>_vs_params.png`` (the final metric against each varying parameter) to ``--out``. With ``--repeats <key>``
(``seed``; ``seeds`` for every seed param) the runs that differ only in that key are one row: each metric's mean ± std
over them, ``n``, and whether the best two rows differ by more than their spread
(:mod:`recsys_runner.compare_repeats`); the plots then show each configuration's mean and std.

``collect`` finishes a sweep whose launcher returned before its jobs did (e.g.
``hydra/launcher=submitit_slurm_detached``): it waits until every job has ended, writes the best
trial to the parent run, ends it, then prints and plots like the default command. A job that SLURM says failed is
named in a line at once, one that died before it created its MLflow run included; the parent then ends ``FAILED`` and
the command exits 1. What collect does before the table is :mod:`recsys_runner.compare_collect`'s.

After the table it prints (on stderr, so that stdout stays the table) how to look at the same runs in the MLflow UI:
for a local store the command that serves it (``mlflow ui --backend-store-uri <uri> --port 5000``) and the page to
open, for a tracking server its page: the sweep's parent run, else the experiment. ``--ui-url`` prints only the page of
the store's most recently active experiment (``make ui`` does, once the server it started answers: ``--wait-for-ui``).

compare only reads: a store that does not exist (``--uri sqlite:///no/such/dir/x.db``, or a bare ``compare`` in a
folder without ``mlflow.db``) is not created; it says so in one line naming the URI and how to point at the right
one, and exits with status 2.

The table and the metrics it shows are :mod:`recsys_runner.compare_table`'s, the plots :mod:`recsys_runner.compare_plots`'s,
``--ui-url``'s page :mod:`recsys_runner.compare_ui`'s.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recsys_runner.compare_collect import best_line, collect, wrong_parent
from recsys_runner.compare_plots import plot_curves, plot_vs_params
from recsys_runner.compare_repeats import Grouping, group_runs, grouped_table, repeat_keys, spread_note
from recsys_runner.compare_table import DEFAULT_METRICS, default_metrics, table, unlogged_metrics
from recsys_runner.compare_ui import print_ui_url
from recsys_runner.errors import ConfigError, reported
from recsys_runner.tracking.store import UI_PORT, missing_store, resolve_uri, ui_lines
from recsys_runner.tracking.sweep_summary import SWEEP_PARENT_TAG
from recsys_runner.tracking.tracker import MlflowTrackingConfig


def find_runs(client: Any, *, experiments: Sequence[str] = (), parent: str | None = None, filter_string: str = "") -> list[Any]:
    """Runs of the named experiments (or of the parent's experiment), optionally a sweep's children, filtered."""
    ids = []
    for name in experiments:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            known = sorted(e.name for e in client.search_experiments())
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"no MLflow experiment named {name!r} at {client.tracking_uri} ({hint}experiments there: "
                              f"{', '.join(known) or 'none'}). Fix: --experiment <one of them>, or --uri for another store")
        ids.append(exp.experiment_id)
    clauses = [filter_string] if filter_string else []
    if parent:
        ids = ids or [client.get_run(parent).info.experiment_id]
        clauses.append(f"tags.mlflow.parentRunId = '{parent}'")
    if not ids:
        raise ConfigError("name an --experiment or a --parent run")
    runs = client.search_runs(ids, filter_string=" and ".join(clauses), max_results=10000, order_by=["attributes.start_time ASC"])
    return [r for r in runs if SWEEP_PARENT_TAG not in r.data.tags]  # a sweep's parent is a summary, not a trial


def default_selection(client: Any) -> tuple[list[str], str | None, str]:
    """What a bare ``python -m recsys_runner.compare`` shows: the most recently started sweep (its children), else
    every run of the default experiment (``tracking.experiment``'s default); with a line saying which, and how to
    pick another."""
    experiments = client.search_experiments()
    ids = [e.experiment_id for e in experiments]
    sweeps = client.search_runs(ids, filter_string=f"tags.`{SWEEP_PARENT_TAG}` != ''", max_results=1,
                                order_by=["attributes.start_time DESC"]) if ids else []
    other = "pick another with --parent <run id> or --experiment <name>"
    if sweeps:
        parent = sweeps[0]
        name = next((e.name for e in experiments if e.experiment_id == parent.info.experiment_id), parent.info.experiment_id)
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(parent.info.start_time / 1000))
        return [], parent.info.run_id, (f"the most recent sweep: {parent.info.run_name} (--parent {parent.info.run_id}, "
                                        f"experiment {name}, started {started}); {other}")
    default = MlflowTrackingConfig().experiment
    if client.get_experiment_by_name(default) is None:
        names = ", ".join(sorted(e.name for e in experiments if e.name != "Default")) or "none"
        raise ConfigError(f"no sweep and no experiment {default!r} at {client.tracking_uri} (experiments there: {names}); "
                         f"name one with --experiment <name>, or --uri for another store")
    return [default], None, f"the runs of experiment {default} (no sweep in this store); {other}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recsys_runner.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--uri", default=None, help="tracking URI (default: $MLFLOW_TRACKING_URI or ./mlflow.db); a store that "
                   "does not exist is not created: compare says so and exits with status 2")
    p.add_argument("--experiment", action="append", default=[],
                   help="experiment name (repeatable); with neither this nor --parent: the most recent sweep, else the "
                        f"runs of experiment {MlflowTrackingConfig().experiment!r}")
    p.add_argument("--parent", default=None, help="a sweep's parent run id: compare its children")
    p.add_argument("--filter", default="", help="MLflow search filter, e.g. \"params.optim.sparse.lr > '0.05'\"")
    p.add_argument("--metric", action="append", default=None, help=f"metrics for the table and plots, the first ranks (default: {', '.join(DEFAULT_METRICS)}, or, for runs whose "
                   "objective is another metric (best/<metric>), that one, their other eval metrics and train/loss)")
    p.add_argument("--repeats", action="append", default=None, metavar="KEY",
                   help="runs that differ only in this param are repeats of one configuration: a row per configuration, "
                        "each metric as mean ± std over them, n, and Welch's t-test p against the best (repeatable; "
                        "'seeds' is every seed param: seed, data.seed)")
    p.add_argument("--out", default="compare", help="directory for the PNGs (default: ./compare)")
    p.add_argument("--no-plots", action="store_true", help="print the table only")
    p.add_argument("--manifest", action="store_true", help="add where each run came from: entry, git commit, dirty, "
                   "torch/torchrec versions, device, world size")
    p.add_argument("--port", type=int, default=UI_PORT, help=f"the port in the printed `mlflow ui` command and page (default {UI_PORT})")
    p.add_argument("--ui-url", action="store_true", help="print only the MLflow UI page of the store's most recently "
                   "active experiment (what `make ui` prints)")
    p.add_argument("--wait-for-ui", type=int, default=None, metavar="PID", help="with --ui-url: print it once the MLflow "
                   "UI of this process answers on --port (or say that process ended first)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; ``argv[0] == "collect"`` selects the collector. A user's mistake (an experiment the store lacks) is one
    line and exit status 2, as in every command (:func:`~recsys_runner.errors.reported`)."""
    with reported():
        return _main(argv)
    return 2  # not reached: reported() exits


def _main(argv: Sequence[str] | None) -> int:
    from mlflow.tracking import MlflowClient

    args_in = list(sys.argv[1:] if argv is None else argv)
    is_collect = bool(args_in) and args_in[0] == "collect"
    parser = _parser()
    if is_collect:
        args_in = args_in[1:]
        parser.add_argument("--wait", action="store_true", help="poll until every job of the sweep has ended")
        parser.add_argument("--timeout", type=float, default=24 * 3600, help="give up waiting after this many seconds")
    args = parser.parse_args(args_in)
    uri = resolve_uri(args.uri)
    if args.ui_url:
        return print_ui_url(uri, args.port, args.wait_for_ui)
    missing = missing_store(uri)
    if missing is not None:  # opening it would create it (a sqlite file and its folder): compare only reads
        source = "--uri" if args.uri else "$MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "the default, ./mlflow.db"
        print(f"no MLflow store at {uri} ({source}): {missing}; compare reads runs and creates no store. Fix: point --uri "
              "(or MLFLOW_TRACKING_URI) at the store the runs logged to, their tracking.uri (e.g. --uri sqlite:///<dir>/mlflow.db), "
              "or run compare in the directory holding mlflow.db", file=sys.stderr)
        return 2
    client = MlflowClient(tracking_uri=uri)
    failed: list[str] | None = None
    if is_collect and not args.parent:
        parser.error("collect needs --parent <run id>")
    if args.parent and (wrong := wrong_parent(client, uri, args.parent, collect=is_collect)) is not None:
        print(wrong, file=sys.stderr)
        return 2
    if is_collect:
        failed = collect(client, args.parent, wait=args.wait, timeout_s=args.timeout)
        if failed is None:
            return 1
        print(best_line(client, args.parent))
    experiments, parent_id = args.experiment, args.parent
    if not experiments and not parent_id:
        experiments, parent_id, shown = default_selection(client)
        print(f"showing {shown}", file=sys.stderr)
    runs = find_runs(client, experiments=experiments, parent=parent_id, filter_string=args.filter)
    if not runs:
        print("no runs match", file=sys.stderr)
        return 1
    metrics = args.metric or default_metrics(runs)
    if not args.metric and metrics[0] != DEFAULT_METRICS[0]:
        print(f"ranked by {metrics[0]}, the runs' objective (--metric <name> ranks by another)", file=sys.stderr)
    if args.metric and (unlogged := unlogged_metrics(runs, args.metric)) is not None:
        print(unlogged, file=sys.stderr)
        return 2
    grouping: Grouping | None = None
    if args.repeats:
        grouping = group_runs(runs, repeat_keys(runs, args.repeats))
        print(grouped_table(grouping, metrics, manifest=args.manifest))
        if (note := spread_note(grouping, metrics[0])) is not None:
            print(note)
    else:
        print(table(runs, metrics, manifest=args.manifest))
    if not args.no_plots:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        written = [plot_curves(client, runs, metrics, out / "curves.png", grouping),
                   plot_vs_params(runs, metrics[0], out / f"{metrics[0].replace('/', '_')}_vs_params.png", grouping)]
        print("plots: " + ", ".join(str(p) for p in written if p is not None))
    shown_experiment = client.get_run(parent_id).info.experiment_id if parent_id else runs[0].info.experiment_id
    print("\n".join(ui_lines(uri, shown_experiment, parent_id, args.port)), file=sys.stderr)
    return 1 if is_collect and failed else 0


if __name__ == "__main__":
    sys.exit(main())
