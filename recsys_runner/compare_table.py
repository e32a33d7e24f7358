"""What ``python -m recsys_runner.compare`` shows of the runs it selected as text: a fixed-width table of the parameters
that vary between them and their final metrics (with ``--manifest``, where each run came from), best first in the
first metric's direction, and the metrics it shows when ``--metric`` names none.
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Sequence
from typing import Any

from recsys_runner.errors import ConfigError
from recsys_runner.metrics.registry import best_first_key, higher_is_better

DEFAULT_METRICS = ("eval/auc", "eval/logloss", "train/loss")
"""The table's metrics for runs whose objective is ``eval/auc`` (single-task CTR, the runner's default)."""
MAX_EVAL_COLUMNS = 6
"""At most this many eval metrics in a table chosen from what the runs logged (:func:`default_metrics`): a multi-task run
logs a few per task, and a wider table no longer fits a terminal."""
HIDDEN_PARAMS = ("tracking.", "hydra.")
"""Param prefixes that are bookkeeping, not configuration: never a column, never what sets runs apart."""


def varying_params(runs: Sequence[Any]) -> list[str]:
    """Keys every run has as a param, with values that differ between ``runs`` (bookkeeping excluded)."""
    if not runs:
        return []
    keys = sorted(set.intersection(*(set(r.data.params) for r in runs)))
    keys = [k for k in keys if not k.startswith(HIDDEN_PARAMS)]
    return [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]


def short_value(value: str | None) -> str:
    """A param's value as a table cell or a plot label: ``-`` when missing, a ``_target_``'s class name, a number to 4
    significant digits, other text cut to 24 characters."""
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
        [short_value(r.info.run_name) if len(r.info.run_name or "") <= 24 else r.info.run_id[:8], r.info.status,
         *(short_value(r.data.params.get(p)) for p in params),
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
