"""A sweep's outcome: its children counted and ranked by the objective, the best one written to the parent run, a table of
every child (``sweep_summary.json``, ``sweep_summary.csv``) as the parent's artifacts, and the parent ended.

Used when a multirun ends (:mod:`recsys_runner.tracking.sweep`), when it stops early, and by ``python -m
recsys_runner.compare collect`` for a sweep whose jobs outlived its launcher.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from recsys_runner.metrics.registry import DEFAULT_OBJECTIVE, best_first_key, higher_is_better
from recsys_runner.tracking.sweep_names import SWEPT_KEYS_TAG, SWEPT_PARAM, override_values, unescape

log = logging.getLogger(__name__)

_TERMINAL = {"FINISHED", "FAILED", "KILLED"}
SWEEP_PARENT_TAG = "sweep.objective"
"""Present on a sweep's parent run only (its value is the objective's metric name)."""
SUMMARY_METRICS = ("eval/auc", "eval/logloss", "train/loss")
"""The metrics of each child the summary table holds, after the objective (those a child logged)."""


@dataclass(frozen=True)
class SweepSummary:
    """The state of a sweep's children, and the best finished one."""

    num_children: int
    num_finished: int
    num_terminal: int
    best_run_id: str | None
    best_value: float | None
    best_overrides: str | None


def sweep_objective(client: Any, parent_run_id: str) -> str:
    """The objective metric recorded on a sweep's parent run (``train.objective`` at launch)."""
    return client.get_run(parent_run_id).data.tags.get(SWEEP_PARENT_TAG) or DEFAULT_OBJECTIVE


def summarize(client: Any, parent_run_id: str, objective: str | None = None) -> SweepSummary:
    """Count the parent's children and find the finished child with the best ``objective``
    (the parent's recorded objective by default), in the metric's direction (:func:`higher_is_better`)."""
    objective = objective or sweep_objective(client, parent_run_id)
    children = child_runs(client, client.get_run(parent_run_id))
    finished = [r for r in children if r.info.status == "FINISHED" and objective in r.data.metrics]
    higher = higher_is_better(objective)
    ranked = [r for r in finished if not math.isnan(r.data.metrics[objective])]  # a NaN trial (diverged) is best at nothing
    best = min(ranked, key=lambda r: best_first_key(r.data.metrics[objective], higher), default=None)
    return SweepSummary(
        num_children=len(children),
        num_finished=len(finished),
        num_terminal=sum(r.info.status in _TERMINAL for r in children),
        best_run_id=best.info.run_id if best else None,
        best_value=best.data.metrics[objective] if best else None,
        best_overrides=best.data.tags.get("hydra.overrides") if best else None,
    )


def finish_parent(client: Any, parent_run_id: str, summary: SweepSummary, objective: str | None = None,
                  status: str | None = None) -> None:
    """Write the best child's overrides (as ``best.<key>`` params), metric and id to the parent, and end it: ``status``,
    by default ``FINISHED`` when a child finished, else ``FAILED``."""
    from mlflow.entities import Metric, Param

    objective = objective or sweep_objective(client, parent_run_id)
    params = []
    if summary.best_run_id is not None:
        best = client.get_run(summary.best_run_id)
        # Sweepers re-quote values (``sqlite\\:///…``); compare without the escapes.
        common = {unescape(o) for o in (client.get_run(parent_run_id).data.tags.get("sweep.overrides") or "").split()}
        swept = [unescape(o) for o in (summary.best_overrides or "").split() if unescape(o) not in common]
        params = [Param(f"best.{k}", v) for k, v in _override_pairs(" ".join(swept))]
        now = int(time.time() * 1000)
        client.log_batch(parent_run_id, metrics=[Metric(f"best/{objective}", float(summary.best_value or 0.0), now, 0)])
        for key in ("train/loss", "eval/logloss"):
            if key in best.data.metrics:
                client.log_metric(parent_run_id, f"best/{key}", best.data.metrics[key])
        client.set_tag(parent_run_id, "best.run_id", summary.best_run_id)
        client.set_tag(parent_run_id, "best.run_name", best.info.run_name)
    existing = client.get_run(parent_run_id).data.params
    new = [p for p in params if p.key not in existing]
    if new:
        client.log_batch(parent_run_id, params=new)
    _write_summary(client, parent_run_id, objective)
    client.set_tag(parent_run_id, "sweep.num_finished", str(summary.num_finished))
    client.set_tag(parent_run_id, "sweep.num_children", str(summary.num_children))
    client.set_terminated(parent_run_id, status=status or ("FINISHED" if summary.num_finished else "FAILED"))
    if summary.best_run_id is not None:
        log.info("sweep parent %s: best %s=%.4f from run %s (%s)", parent_run_id, objective, summary.best_value,
                 summary.best_run_id, summary.best_overrides)


def summary_rows(client: Any, parent_run_id: str, objective: str) -> list[dict[str, Any]]:
    """One row per child of the sweep, best ``objective`` first (children without it last): run id, name, status,
    its ``swept.<key>`` values (from its overrides for a child logged before those params existed), the objective
    and :data:`SUMMARY_METRICS` (``None`` where a child has no value)."""
    parent = client.get_run(parent_run_id)
    keys = [k for k in parent.data.tags.get(SWEPT_KEYS_TAG, "").split(",") if k]
    metrics = list(dict.fromkeys([objective, *SUMMARY_METRICS]))
    higher = higher_is_better(objective)
    children = sorted(child_runs(client, parent), key=lambda r: best_first_key(r.data.metrics.get(objective), higher))
    rows = []
    for child in children:
        tried = dict(override_values((child.data.tags.get("hydra.overrides") or "").split()))
        rows.append({"run_id": child.info.run_id, "run_name": child.info.run_name, "status": child.info.status,
                     **{f"{SWEPT_PARAM}{k}": child.data.params.get(f"{SWEPT_PARAM}{k}", tried.get(k)) for k in keys},
                     **{m: child.data.metrics.get(m) for m in metrics}})
    return rows


def _write_summary(client: Any, parent_run_id: str, objective: str) -> None:
    """The table of every child as the parent's artifacts ``sweep_summary.json`` (for scripts) and ``sweep_summary.csv``
    (for a spreadsheet or the UI's artifact view). An artifact store that fails only warns: the parent still ends."""
    try:
        rows = summary_rows(client, parent_run_id, objective)
        document = {"objective": objective, "runs": rows}
        client.log_text(parent_run_id, json.dumps(document, indent=2), "sweep_summary.json")
        client.log_text(parent_run_id, _csv(rows), "sweep_summary.csv")
    except Exception as e:  # noqa: BLE001 - the summary is a convenience; the children's runs hold everything
        log.warning("could not write the summary table of sweep %s: %s", parent_run_id, e)


def _csv(rows: Sequence[Mapping[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else ["run_id"], lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return out.getvalue()


def child_runs(client: Any, parent: Any) -> list[Any]:
    return list(client.search_runs([parent.info.experiment_id], max_results=10000,
                                   filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"))


def _override_pairs(overrides: str) -> list[tuple[str, str]]:
    """``"optim.lr=0.1 model=dlrm"`` → ``[("optim.lr", "0.1"), ("model", "dlrm")]`` (``+``/``~`` prefixes dropped)."""
    pairs = []
    for item in overrides.split():
        key, sep, value = item.partition("=")
        if sep:
            pairs.append((key.lstrip("+~"), value))
    return pairs
