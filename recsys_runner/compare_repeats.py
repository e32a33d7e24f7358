"""``python -m recsys_runner.compare --repeats <key>``: runs that differ only in a seed are one configuration's repeats.

In CTR work a 0.001 AUC gain matters, and the spread over seeds is of the same order: a configuration is judged by
its mean over several seeds, against that spread. :func:`group_runs` puts the runs that agree on every param but the
repeat keys (and their sweep copies ``swept.<key>``) into one :class:`Group`; :func:`grouped_table` shows each
metric's mean ± sample std and ``n``, best mean first, with Welch's t-test p-value of each row against the first
(:func:`welch_p`; the t distribution from :func:`math.lgamma`, no scipy), and :func:`spread_note` says whether the
first two rows' mean ± std overlap. :func:`repeat_keys` resolves ``--repeats seeds`` and refuses a key no run has.
"""

from __future__ import annotations

import difflib
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from recsys_runner.compare_table import HIDDEN_PARAMS, MANIFEST_COLUMNS, manifest_cells, short_value, varying_params
from recsys_runner.errors import ConfigError
from recsys_runner.metrics.registry import best_first_key, higher_is_better

SEEDS = "seeds"
"""``--repeats seeds``: every seed param the runs have (``seed``, the training one; ``data.seed``, the data's)."""
P_COLUMN = "p_vs_first"
"""The grouped table's column of Welch's p-value against the first (best) row."""
_SWEPT = "swept."  # a sweep child's copy of each swept key (recsys_runner.tracking.sweep_names.SWEPT_PARAM)


@dataclass(frozen=True)
class Group:
    """One configuration: the runs that differ only in the repeat keys, in the order they were selected."""

    runs: tuple[Any, ...]

    def values(self, metric: str) -> list[float]:
        """``metric``'s final value in each run that logged it (a NaN kept: a diverged seed makes the mean NaN)."""
        return [r.data.metrics[metric] for r in self.runs if metric in r.data.metrics]

    def mean(self, metric: str) -> float | None:
        values = self.values(metric)
        return statistics.fmean(values) if values else None

    def std(self, metric: str) -> float | None:
        """The sample standard deviation (``n - 1``); ``None`` with fewer than two values."""
        values = self.values(metric)
        return statistics.stdev(values) if len(values) > 1 else None

    def status(self) -> str:
        """The runs' status, or how many have each (``FINISHED:2,FAILED:1``) when they differ."""
        counts = Counter(r.info.status for r in self.runs)
        return next(iter(counts)) if len(counts) == 1 else ",".join(f"{s}:{n}" for s, n in counts.items())


def repeat_keys(runs: Sequence[Any], requested: Sequence[str]) -> list[str]:
    """The param keys ``--repeats`` names, ``seeds`` expanded to every param of ``runs`` named ``seed`` or ``*.seed``.

    Raises:
        ConfigError: no run has a requested key as a param (a typo: ``--repeats sed``), naming the closest params.
    """
    params = sorted({k for r in runs for k in r.data.params if not k.startswith((*HIDDEN_PARAMS, _SWEPT))})
    keys: list[str] = []
    for key in requested:
        found = [p for p in params if p == "seed" or p.endswith(".seed")] if key == SEEDS else [key] if key in params else []
        if not found:
            close = difflib.get_close_matches(key, params, n=3, cutoff=0.5)
            named = (f"the closest: {', '.join(close)}" if close else "the params that differ between them: "
                     + (", ".join(p for p in varying_params(runs) if not p.startswith(_SWEPT)) or "none"))
            raise ConfigError(f"--repeats {key}: none of the {len(runs)} runs selected has {'a seed' if key == SEEDS else key} "
                              f"as a param; {named}. Fix: --repeats {close[0] if close else '<one of those>'}")
        keys += [k for k in found if k not in keys]
    return keys


@dataclass(frozen=True)
class Grouping:
    """The selected runs as configurations (:func:`group_runs`), and the params that set those apart (the columns)."""

    groups: tuple[Group, ...]
    params: tuple[str, ...]


def group_runs(runs: Sequence[Any], keys: Sequence[str]) -> Grouping:
    """``runs`` grouped by all their params but ``keys`` and ``swept.<key>`` (bookkeeping ``tracking.*`` ignored), the
    groups in the order of their first run; the columns are the params that vary between ``runs``, less those (and less
    ``swept.<key>`` where ``<key>`` is a column too: the same value). A key that changes together with others (``seed``
    with ``optim.lr``) still groups the runs by the others: that is what a repeat is."""
    skip = {*keys, *(_SWEPT + k for k in keys)}
    groups: dict[frozenset[tuple[str, str]], list[Any]] = {}
    for run in runs:
        config = frozenset((k, v) for k, v in run.data.params.items() if k not in skip and not k.startswith(HIDDEN_PARAMS))
        groups.setdefault(config, []).append(run)
    # a sweep child's swept.<key> repeats its <key>: one column of the two
    params = [p for p in varying_params(runs) if p not in skip]
    return Grouping(tuple(Group(tuple(g)) for g in groups.values()),
                    tuple(p for p in params if not (p.startswith(_SWEPT) and p.removeprefix(_SWEPT) in params)))


def best_groups_first(groups: Sequence[Group], metric: str) -> list[Group]:
    """``groups`` by mean ``metric``, best first in its direction (no mean, or NaN, last); as given without one."""
    try:
        higher = higher_is_better(metric)
    except ConfigError:
        return list(groups)
    return sorted(groups, key=lambda g: best_first_key(g.mean(metric), higher))


def mean_std(group: Group, metric: str) -> str:
    """A cell: ``0.7129 ± 0.0046``, ``0.7129`` for one value, ``-`` for none; ``[k]`` after it when only ``k`` of the
    group's runs logged ``metric`` (a run that failed before its first eval)."""
    values = group.values(metric)
    if not values:
        return "-"
    std = group.std(metric)
    cell = f"{group.mean(metric):.4f}" + (f" ± {std:.4f}" if std is not None else "")
    return cell + (f" [{len(values)}]" if len(values) < len(group.runs) else "")


def grouped_table(grouping: Grouping, metrics: Sequence[str], manifest: bool = False) -> str:
    """The table of ``--repeats``: a row per configuration (``n`` runs, their status, the params that vary, each
    metric's mean ± std), best mean ``metrics[0]`` first, and :data:`P_COLUMN`: Welch's two-sided t-test of the row's
    ``metrics[0]`` against the first row's (``-`` where either has fewer than two values)."""
    params = grouping.params
    ordered = best_groups_first(grouping.groups, metrics[0]) if metrics else list(grouping.groups)
    header = ["n", "status", *params, *metrics, *([P_COLUMN] if metrics else []), *(MANIFEST_COLUMNS if manifest else ())]
    rows = []
    for i, group in enumerate(ordered):
        p = welch_p(ordered[0].values(metrics[0]), group.values(metrics[0])) if metrics and i else None
        rows.append([str(len(group.runs)), group.status(), *(short_value(group.runs[0].data.params.get(k)) for k in params),
                     *(mean_std(group, m) for m in metrics), *([f"{p:.3g}" if p is not None else "-"] if metrics else []),
                     *(_manifest(group) if manifest else ())])
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)) for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _manifest(group: Group) -> list[str]:
    """The group's :data:`MANIFEST_COLUMNS`: a value its runs share, else how many they have (``2 values``)."""
    return [cells[0] if len(set(cells)) == 1 else f"{len(set(cells))} values"
            for cells in zip(*(manifest_cells(r) for r in group.runs), strict=True)]


def label(group: Group, params: Sequence[str]) -> str:
    """A configuration's name in a note or a legend: its varying params (``optim.lr=0.1``), else its first run's name."""
    if params:
        return " ".join(f"{k}={short_value(group.runs[0].data.params.get(k))}" for k in params)
    return group.runs[0].info.run_name or group.runs[0].info.run_id[:8]


def spread_note(grouping: Grouping, metric: str) -> str | None:
    """Whether the best two configurations' ``metric`` is a real difference: do their mean ± std overlap, and Welch's
    p-value when each has two values or more; ``None`` with fewer than two configurations having ``metric``."""
    params = grouping.params
    ordered = [g for g in best_groups_first(grouping.groups, metric) if g.values(metric)]
    if len(ordered) < 2:
        return None
    first, second = ordered[:2]
    a, b = first.values(metric), second.values(metric)
    head = f"{metric}: the first, {label(first, params)} ({mean_std(first, metric)}, n={len(a)}), and the second, " \
           f"{label(second, params)} ({mean_std(second, metric)}, n={len(b)})"
    if min(len(a), len(b)) < 2:
        return f"{head}: one run alone shows no spread; repeat each over seeds (e.g. -m seed=0,1,2) to tell a real difference from noise"
    mean_a, mean_b, std_a, std_b = statistics.fmean(a), statistics.fmean(b), statistics.stdev(a), statistics.stdev(b)
    overlap = abs(mean_a - mean_b) <= std_a + std_b
    p = welch_p(a, b)
    verdict = ("within one std of each other: the difference may be seed noise" if overlap else
               "more than one std apart")
    return f"{head}: {verdict}" + (f"; Welch's t-test p={p:.3g}" if p is not None else "")


def welch_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Welch's two-sided t-test p-value for equal means of ``a`` and ``b`` (unequal variances); ``None`` when either
    has fewer than two values, a value is NaN, or both have no spread (the statistic is undefined)."""
    if min(len(a), len(b)) < 2 or any(math.isnan(x) for x in (*a, *b)):
        return None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return None
    t = (statistics.fmean(a) - statistics.fmean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))  # Welch–Satterthwaite
    return _incomplete_beta(df / 2, 0.5, df / (df + t * t))  # P(|T| >= |t|) for Student's t with df degrees


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (Numerical Recipes' ``betai``)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of :func:`_incomplete_beta`, evaluated by the modified Lentz method."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)), -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h
