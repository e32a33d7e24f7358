"""``python -m recsys_runner.compare``: runs from MLflow as a table and as PNG plots.

For people who would rather read a terminal or look at a picture than click through the MLflow UI::

    python -m recsys_runner.compare                                     # the most recent sweep (else the default experiment)
    python -m recsys_runner.compare --experiment lr_grid               # every run of an experiment
    python -m recsys_runner.compare --parent <run id>                   # the children of one sweep
    python -m recsys_runner.compare --experiment lr_grid --filter "params.model._target_ LIKE '%DLRM'"
    python -m recsys_runner.compare collect --parent <run id> --wait    # a detached sweep: wait, summarize

It prints one row per run (name, status, the parameters that differ between the runs, final
metrics) and writes ``curves.png`` (each metric over steps, a line per run) and
``<metric>_vs_params.png`` (the final metric against each varying parameter) to ``--out``.

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
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recsys_runner.compare_collect import best_line, collect, wrong_parent
from recsys_runner.errors import ConfigError, reported
from recsys_runner.metrics.registry import best_first_key, higher_is_better
from recsys_runner.tracking.store import UI_PORT, missing_store, resolve_uri, ui_lines, ui_url
from recsys_runner.tracking.sweep_summary import SWEEP_PARENT_TAG
from recsys_runner.tracking.tracker import MlflowTrackingConfig

DEFAULT_METRICS = ("eval/auc", "eval/logloss", "train/loss")
"""The table's metrics for runs whose objective is ``eval/auc`` (single-task CTR, the runner's default)."""
MAX_EVAL_COLUMNS = 6
"""At most this many eval metrics in a table chosen from what the runs logged (:func:`default_metrics`): a multi-task run
logs a few per task, and a wider table no longer fits a terminal."""
_HIDDEN_PARAMS = ("tracking.", "hydra.")


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


def varying_params(runs: Sequence[Any]) -> list[str]:
    """Keys every run has as a param, with values that differ between ``runs`` (bookkeeping excluded)."""
    if not runs:
        return []
    keys = sorted(set.intersection(*(set(r.data.params) for r in runs)))
    keys = [k for k in keys if not k.startswith(_HIDDEN_PARAMS)]
    return [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]


def _short(value: str | None) -> str:
    if value is None:
        return "-"
    if "." in value and value.split(".")[-1][:1].isupper():  # a _target_ like recsys_runner.models.dlrm.DLRM
        return value.rsplit(".", 1)[-1]
    try:
        return f"{float(value):.4g}"
    except ValueError:
        return value if len(value) <= 24 else value[:21] + "..."


MANIFEST_COLUMNS: dict[str, str] = {
    "entry": "entry",
    "commit": "manifest.git_commit",
    "dirty": "manifest.git_dirty",
    "torch": "manifest.version.torch",
    "torchrec": "manifest.version.torchrec",
    "device": "manifest.device",
    "world": "manifest.world_size",
}
"""``--manifest`` columns: header → run tag (:mod:`recsys_runner.tracking.lineage`; ``entry`` is set by evaluate/predict runs)."""


def manifest_cells(run: Any) -> list[str]:
    """The :data:`MANIFEST_COLUMNS` of ``run``: the commit shortened to 8 characters, ``-`` where a tag is missing
    (runs made before the manifest existed; a training run has no ``entry`` tag: ``train``)."""
    tags = run.data.tags
    cells = []
    for header, tag in MANIFEST_COLUMNS.items():
        value = tags.get(tag, "train" if header == "entry" else None)
        if value is None:
            cells.append("-")
        elif header == "commit":
            cells.append(value[:8])
        elif header == "device":
            cells.append(value if len(value) <= 32 else value[:29] + "...")
        else:
            cells.append(value)
    return cells


def table(runs: Sequence[Any], metrics: Sequence[str] = DEFAULT_METRICS, manifest: bool = False) -> str:
    """A fixed-width text table: run name, status, varying params, final metrics; best ``metrics[0]`` first
    (:func:`best_first`). ``manifest``: also where each run came from
    (:data:`MANIFEST_COLUMNS`: entry, git commit, dirty, torch/torchrec versions, device, world size)."""
    params = varying_params(runs)
    ordered = best_first(runs, metrics[0]) if metrics else list(runs)
    header = ["run", "status", *params, *metrics, *(MANIFEST_COLUMNS if manifest else ())]
    rows = [
        [_short(r.info.run_name) if len(r.info.run_name or "") <= 24 else r.info.run_id[:8], r.info.status,
         *(_short(r.data.params.get(p)) for p in params),
         *(f"{r.data.metrics[m]:.4f}" if m in r.data.metrics else "-" for m in metrics),
         *(manifest_cells(r) if manifest else ())]
        for r in ordered
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)) for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def unlogged_metrics(runs: Sequence[Any], metrics: Sequence[str]) -> str | None:
    """Why ``--metric`` names a metric no run of ``runs`` logged (a typo: ``eval/acu``), with the closest logged one,
    or ``None``: such a column was all ``-``, and the ranking by it silently none."""
    logged = sorted({m for r in runs for m in r.data.metrics})
    unlogged = [m for m in metrics if m not in logged]
    if not unlogged:
        return None
    close = difflib.get_close_matches(unlogged[0], logged, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return (f"--metric {unlogged[0]}: none of the {len(runs)} runs selected logged it{hint}; they logged "
            f"{', '.join(logged) or 'no metric'}. Fix: --metric {close[0] if close else '<one of those>'}")


def default_metrics(runs: Sequence[Any]) -> list[str]:
    """The table's metrics without ``--metric``: :data:`DEFAULT_METRICS` when the runs' objective is ``eval/auc``, else
    their objective first (it ranks), then their other final eval metrics and ``train/loss``.

    Why not always :data:`DEFAULT_METRICS`: a multi-task run logs ``eval/<task>/auc``, a retrieval run
    ``eval/recall_at_50``, a next-item run ``eval/hr_at_10``, never ``eval/auc``, so the table showed ``-`` in every
    metric column and ranked nothing. The objective is what each run logged its best of (``best/<metric>``, the sweep's
    ``train.objective``, e.g. ``eval/ctr/auc`` for MMoE); the most common one wins, else the first eval metric by name.
    """
    logged = {m for r in runs for m in r.data.metrics}
    evals = sorted(m for m in logged if m.startswith("eval/"))
    objectives = Counter(m.removeprefix("best/") for r in runs for m in r.data.metrics if m.startswith("best/eval/"))
    objective = objectives.most_common(1)[0][0] if objectives else ("eval/auc" if "eval/auc" in logged or not evals else evals[0])
    if objective == "eval/auc":
        return list(DEFAULT_METRICS)
    others = [m for m in evals if m != objective][:MAX_EVAL_COLUMNS - 1]
    return [objective, *others, *(["train/loss"] if "train/loss" in logged else [])]


def best_first(runs: Sequence[Any], metric: str) -> list[Any]:
    """``runs`` ordered by final ``metric``, best first in the metric's direction (highest AUC, lowest log loss or
    MSE: :func:`~recsys_runner.metrics.registry.higher_is_better`), runs without it last; in their given order when
    the metric has no direction (``train/samples_per_s``, ``eval/calibration``)."""
    try:
        higher = higher_is_better(metric)
    except ConfigError:
        return list(runs)
    return sorted(runs, key=lambda r: best_first_key(r.data.metrics.get(metric), higher))


def _param_name(key: str) -> str:
    """``model._target_`` → ``model``, ``optim.sparse.lr`` → ``sparse.lr``: short but unambiguous legend keys."""
    parts = key.split(".")
    if parts[-1] == "_target_":
        return ".".join(parts[:-1])
    return ".".join(parts[-2:])


def _label(run: Any, params: Sequence[str]) -> str:
    if params:
        return ", ".join(f"{_param_name(p)}={_short(run.data.params.get(p))}" for p in params[:3])
    return run.info.run_name or run.info.run_id[:8]


def plot_curves(client: Any, runs: Sequence[Any], metrics: Sequence[str], path: Path) -> Path:
    """One panel per metric, its value over steps, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = varying_params(runs)
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        drawn = 0
        for run in runs:
            history = sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step)
            if history:
                ax.plot([m.step for m in history], [m.value for m in history], marker="o" if len(history) < 4 else None,
                        markersize=4, label=_label(run, params))
                drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    # The legend from the panel that drew the most runs (a metric may be missing from some runs).
    handles, labels = max((ax.get_legend_handles_labels() for ax in axes[0]), key=lambda hl: len(hl[1]))
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 * math.ceil(len(labels) / 3) if handles else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_vs_params(runs: Sequence[Any], metric: str, path: Path) -> Path | None:
    """The final ``metric`` against each varying parameter (log x for positive numbers spanning > 10x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    params = varying_params(runs)[:6]
    scored = [r for r in runs if metric in r.data.metrics]
    if not params or not scored:
        return None
    fig, axes = plt.subplots(1, len(params), figsize=(4.5 * len(params), 4), squeeze=False)
    for ax, param in zip(axes[0], params, strict=True):
        raw = [r.data.params.get(param) for r in scored]
        ys = [r.data.metrics[metric] for r in scored]
        try:
            xs: list[Any] = [float(v) for v in raw]
            ax.scatter(xs, ys)
            if min(xs) > 0 and max(xs) / min(xs) > 10:
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(NullFormatter())
        except (TypeError, ValueError):
            names = sorted({_short(v) for v in raw})
            ax.scatter([names.index(_short(v)) for v in raw], ys)
            ax.set_xticks(range(len(names)), names)
        ax.set_xlabel(param)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    fig.suptitle(f"final {metric} vs hyperparameters ({len(scored)} runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    print(table(runs, metrics, manifest=args.manifest))
    if not args.no_plots:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        written = [plot_curves(client, runs, metrics, out / "curves.png"),
                   plot_vs_params(runs, metrics[0], out / f"{metrics[0].replace('/', '_')}_vs_params.png")]
        print("plots: " + ", ".join(str(p) for p in written if p is not None))
    shown_experiment = client.get_run(parent_id).info.experiment_id if parent_id else runs[0].info.experiment_id
    print("\n".join(ui_lines(uri, shown_experiment, parent_id, args.port)), file=sys.stderr)
    return 1 if is_collect and failed else 0


if __name__ == "__main__":
    sys.exit(main())
