"""compare's PNG plots (``--out``): ``curves.png``, each metric over steps with a line per run, and
``<metric>_vs_params.png``, the final metric against each parameter that varies between the runs. With ``--repeats``
(a :class:`~recsys_runner.compare_repeats.Grouping`) a configuration's runs share a colour and a legend entry, and the
second plot shows each configuration's mean with its std as an error bar.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recsys_runner.compare_repeats import Grouping
from recsys_runner.compare_table import short_value, varying_params


def _param_name(key: str) -> str:
    """``model._target_`` → ``model``, ``optim.sparse.lr`` → ``sparse.lr``: short but unambiguous legend keys."""
    parts = key.split(".")
    if parts[-1] == "_target_":
        return ".".join(parts[:-1])
    return ".".join(parts[-2:])


def _label(run: Any, params: Sequence[str]) -> str:
    if params:
        return ", ".join(f"{_param_name(p)}={short_value(run.data.params.get(p))}" for p in params[:3])
    return run.info.run_name or run.info.run_id[:8]


def plot_curves(client: Any, runs: Sequence[Any], metrics: Sequence[str], path: Path, grouping: Grouping | None = None) -> Path:
    """One panel per metric, its value over steps, one line per run; with ``grouping``, one colour and one legend
    entry (``… (n=3)``) per configuration, so that its seeds read as one band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = varying_params(runs)
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        drawn, labelled = 0, set[int]()
        for run in runs:
            history = sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step)
            if not history:
                continue
            style: dict[str, Any] = {"label": _label(run, params)}
            if grouping is not None:
                i = next(i for i, g in enumerate(grouping.groups) if run in g.runs)
                group = grouping.groups[i]
                style = {"color": f"C{i % 10}", "alpha": 0.8,
                         "label": f"{_label(group.runs[0], grouping.params)} (n={len(group.runs)})" if i not in labelled else "_"}
                labelled.add(i)
            ax.plot([m.step for m in history], [m.value for m in history], marker="o" if len(history) < 4 else None,
                    markersize=4, **style)
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


def plot_vs_params(runs: Sequence[Any], metric: str, path: Path, grouping: Grouping | None = None) -> Path | None:
    """The final ``metric`` against each varying parameter (log x for positive numbers spanning > 10x); with
    ``grouping``, a point per configuration at its mean, its std as an error bar (none for a single run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    params = list(grouping.params if grouping is not None else varying_params(runs))[:6]
    # (a run standing for its points, their values, their std): a configuration's first run and its mean with --repeats
    points = ([(g.runs[0], statistics.fmean(g.values(metric)), g.std(metric) or 0.0) for g in grouping.groups if g.values(metric)]
              if grouping is not None else [(r, r.data.metrics[metric], 0.0) for r in runs if metric in r.data.metrics])
    if not params or not points:
        return None
    fig, axes = plt.subplots(1, len(params), figsize=(4.5 * len(params), 4), squeeze=False)
    ys, errs = [y for _, y, _ in points], [e for _, _, e in points]
    for ax, param in zip(axes[0], params, strict=True):
        raw = [r.data.params.get(param) for r, _, _ in points]
        try:
            xs: list[Any] = [float(v) for v in raw]
            _points(ax, xs, ys, errs if grouping is not None else None)
            if min(xs) > 0 and max(xs) / min(xs) > 10:
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(NullFormatter())
        except (TypeError, ValueError):
            names = sorted({short_value(v) for v in raw})
            _points(ax, [names.index(short_value(v)) for v in raw], ys, errs if grouping is not None else None)
            ax.set_xticks(range(len(names)), names)
        ax.set_xlabel(param)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    fig.suptitle(f"final {metric} vs hyperparameters ({len(points)} runs)" if grouping is None else
                 f"final {metric} vs hyperparameters\nmean ± std over repeats ({len(points)} configurations)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _points(ax: Any, xs: Sequence[float], ys: Sequence[float], errs: Sequence[float] | None) -> None:
    """A scatter of runs, or of configurations' means with their std as error bars."""
    if errs is None:
        ax.scatter(xs, ys)
    else:
        ax.errorbar(xs, ys, yerr=errs, fmt="o", capsize=3)
