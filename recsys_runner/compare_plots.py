"""compare's PNG plots (``--out``): ``curves.png``, each metric over steps with a line per run, and
``<metric>_vs_params.png``, the final metric against each parameter that varies between the runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
            names = sorted({short_value(v) for v in raw})
            ax.scatter([names.index(short_value(v)) for v in raw], ys)
            ax.set_xticks(range(len(names)), names)
        ax.set_xlabel(param)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    fig.suptitle(f"final {metric} vs hyperparameters ({len(scored)} runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
