"""Permutation feature importance (Breiman): how much of a checkpoint's eval metrics each input feature carries.

``python -m recsys_runner.evaluate load=<checkpoint> evaluate.importance=permutation`` scores the eval data once as it is
and once more per feature with that feature's values shuffled across the rows of each batch, everything else left as it
was; a feature the model relies on loses it its metrics (AUC drops, log loss rises, HR@k falls), one it ignores changes
nothing. A feature is a dense column, a sparse feature (a row's whole list of ids, and their weights, moves together), or a
history group (its features and event times, with the row's history length, move as one). Each rank shuffles its own
rows, by a permutation drawn from ``evaluate.importance_seed``, the rank, the batch's number and the feature's name, so a
rerun gives the same numbers and a feature's do not depend on which others are measured. The passes are the evaluator's
own (``train.eval_max_batches``, the EMA weights, a two-tower model's full-corpus pass), so the unshuffled pass is the
evaluate's metrics.

**Models that rank items** (task kinds ``next_item``: SASRec/HSTU; ``retrieval``: DSSM, MIND, with or without a
full-corpus pass): only the query side moves. The item each row is to find and the items it is ranked against never do:

* a two-tower model's item-side features are its item tower's (``model.item_features``): they give the in-batch
  candidates and the row's positive; the user tower's features, and any the model does not read, may be shuffled;
* a next-item model's target is the row's candidate, the non-history feature that shares a table with a history feature
  (``item_id`` beside ``hist_item_id``, ``category`` beside ``hist_category``:
  :meth:`~recsys_runner.features.FeatureSpec.candidate_of`), which the data makes the true next item; those candidates
  are the item side. The history holds the events before it, never the target, so a history group moves whole, as for
  a pointwise model;
* the catalogue (the item index, the next-item model's item table) is built from the model and the items alone: a
  two-tower model's item index is built once for all the shuffled passes
  (:meth:`~recsys_runner.train.corpus.CorpusEval.index_kept`).

Naming an item-side feature in ``evaluate.importance_features`` is refused; ``[]`` measures every query-side one.

**What stays each row's own.** The model reads the shuffled batch; the eval's bookkeeping reads the batch as it is: the
labels, the grouping key of grouped metrics (GAUC's users), each row's target, and the seen items that
``metrics.exclude_seen`` masks and ``model.eval_negatives`` draws around (a next-item model's ``protocol_rows``, the
corpus pass's seen features). The mask and the sampled candidates are the eval's protocol, not an input of the model: a
shuffled history must not change which items the row is ranked against, or its drop would mix what the model lost with a
different question. So ``data.items.seen``, which only the mask reads, measures exactly 0.
"""

from __future__ import annotations

import contextlib
import csv
import difflib
import io
import json
import logging
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.data.base import batch_kjt
from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec
from recsys_runner.metrics.registry import higher_is_better, metric_name
from recsys_runner.progress import Progress
from recsys_runner.tasks import Task
from recsys_runner.train.corpus import inner_with
from recsys_runner.train.evaluation import Evaluator

log = logging.getLogger(__name__)

IMPORTANCE_FILE = "importance"
"""``importance.csv`` and ``importance.json``: the table, in the evaluate run's directory and as MLflow artifacts."""
RANKING_KINDS = ("next_item", "retrieval")
"""Task kinds whose eval ranks items: their item-side features are never shuffled (:func:`item_side`)."""


@dataclass(frozen=True)
class Feature:
    """One input feature as the permutation moves it: dense ``columns`` of ``Batch.dense_features`` or ``keys`` of its
    ``KeyedJaggedTensor`` (several for a history group: its features and event times, shuffled by one permutation)."""

    name: str
    kind: str
    """``dense``, ``sparse`` or ``history``."""
    columns: tuple[int, ...] = ()
    keys: tuple[str, ...] = ()


def input_features(features: FeatureSpec) -> list[Feature]:
    """Every input feature of the data: each dense column, each sparse feature outside a history, each history group."""
    histories = set(features.sequence_names)
    out = [Feature(name, "dense", columns=(i,)) for i, name in enumerate(features.dense_names)]
    out += [Feature(name, "sparse", keys=(name,)) for name in features.sparse_names if name not in histories]
    out += [Feature(g.name, "history", keys=(*g.features, *((g.timestamps,) if g.timestamps else ())))
            for g in features.sequences]
    return out


def item_side(model: nn.Module, tasks: tuple[Task, ...], features: FeatureSpec) -> dict[str, str]:
    """The input features a ranking model's eval must not move (the module docstring says why), each with the reason
    printed when one is named; empty for a pointwise model.

    Raises:
        ConfigError: a retrieval task whose model does not say its towers' features.
    """
    kinds = {t.kind for t in tasks}
    out: dict[str, str] = {}
    if "retrieval" in kinds:
        towers = inner_with(model, "tower_features")
        if towers is None:
            raise ConfigError("evaluate.importance=permutation shuffles a retrieval model's query side only, but this model "
                              "names no towers' features (tower_features). Fix: evaluate.importance=none")
        out |= {name: "an item-tower feature (model.item_features): the row's positive and the in-batch candidates"
                for name in towers.tower_features["item"]}
    if "next_item" in kinds:
        out |= {c: f"the row's candidate (history feature {f}'s), which the eval ranks as the true next item"
                for g in features.sequences for f in g.features if (c := features.candidate_of(f)) is not None}
    return out


def selected(features: list[Feature], names: list[str], item: dict[str, str] | None = None) -> list[Feature]:
    """The features ``names`` lists (``evaluate.importance_features``; empty: all but the ``item`` side), in the data's
    order. ``item``: :func:`item_side` (a history group is item-side when one of its features is).

    Raises:
        ConfigError: a name that is no input feature, with the closest one and the valid names; a column of a history
            group, with the group's name; an item-side feature, with why.
    """
    item = item or {}
    sides = {f.name: next((item[n] for n in (f.name, *f.keys) if n in item), None) for f in features}
    known = {f.name: f for f in features}
    for name in names:
        group = next((f.name for f in features if f.kind == "history" and name in f.keys), None)
        if name not in known and group is not None:
            raise ConfigError(f"evaluate.importance_features names {name!r}, a column of history group {group!r}, whose "
                              f"columns are shuffled together (one history per row). Fix: evaluate.importance_features=[{group}]")
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.0)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"evaluate.importance_features names {name!r}, which is no input feature of the data{hint}; "
                              f"its features: {list(known)}. Fix: evaluate.importance_features=[<some of them>], or [] for all")
        if (why := sides[name]) is not None:
            query = [n for n, side in sides.items() if side is None]
            raise ConfigError(f"evaluate.importance_features names {name!r}, {why}: this model ranks items, and shuffling the "
                              f"item side would move the item each row is to find. Only the query side is measured: {query}. "
                              f"Fix: evaluate.importance_features=[<some of them>], or [] for all")
    return [f for f in features if (f.name in names if names else sides[f.name] is None)]


def permute_kjt_rows(kjt: KeyedJaggedTensor, keys: tuple[str, ...], order: torch.Tensor) -> KeyedJaggedTensor:
    """``kjt`` with row ``i`` of each of ``keys`` replaced by row ``order[i]`` (its whole list: lengths, values and weights);
    the other keys untouched. Each key's values keep their total, so the batch's per-key lengths and offsets, and with
    them the sharded model's input split, stay as they were."""
    names = kjt.keys()
    stride = kjt.stride()
    lengths = kjt.lengths().view(len(names), stride).long()
    rows = torch.arange(stride).repeat(len(names), 1)
    for key in keys:
        rows[names.index(key)] = order
    starts = (torch.cumsum(lengths.flatten(), 0) - lengths.flatten()).view_as(lengths).gather(1, rows).flatten()
    moved = lengths.gather(1, rows).flatten()
    new_starts = torch.cumsum(moved, 0) - moved
    index = torch.repeat_interleave(starts - new_starts, moved) + torch.arange(int(moved.sum()))
    weights = kjt.weights_or_none()
    return batch_kjt(names, kjt.values()[index], moved.to(kjt.lengths().dtype),
                     weights[index] if weights is not None else None)


def permute_rows(batch: Batch, feature: Feature, order: torch.Tensor) -> Batch:
    """``batch`` with ``feature``'s values of row ``i`` taken from row ``order[i]``; labels and other features kept."""
    dense = batch.dense_features
    if feature.columns:
        dense = dense.clone()
        columns = list(feature.columns)
        dense[:, columns] = batch.dense_features[order][:, columns]
    sparse = permute_kjt_rows(batch.sparse_features, feature.keys, order) if feature.keys else batch.sparse_features
    return Batch(dense_features=dense, sparse_features=sparse, labels=batch.labels)


def row_order(seed: int, rank: int, batch: int, feature: str, rows: int) -> torch.Tensor:
    """The permutation of a batch's ``rows``, fixed by the seed, the rank, the batch's number and the feature's name."""
    rng = np.random.default_rng([seed, rank, batch, zlib.crc32(feature.encode())])
    return torch.from_numpy(rng.permutation(rows))


def change_name(key: str) -> str:
    """The worse-is-positive change of eval metric ``key``: ``eval/auc`` → ``auc_drop``, ``eval/ctr/logloss`` →
    ``ctr/logloss_rise``; ``calibration``, best at 1, → ``calibration_error_rise`` (its distance from 1, permuted minus
    base: a plain difference would read a shuffle that moves 0.94 to 0.96 as the feature helping)."""
    task = key.removeprefix("eval/").rpartition("/")[0]
    try:
        suffix = "drop" if higher_is_better(key) else "rise"
    except ConfigError:  # best at a target value: calibration, at 1
        suffix = "error_rise"
    return f"{task + '/' if task else ''}{key.rpartition('/')[2]}_{suffix}"


def changes(base: dict[str, float], permuted: dict[str, float]) -> dict[str, float]:
    """Each metric's :func:`change_name` and value: positive where the shuffled feature made the metric worse."""
    out = {}
    for key, value in base.items():
        name = change_name(key)
        if name.endswith("_drop"):
            out[name] = value - permuted[key]
        elif name.endswith("_error_rise"):
            out[name] = abs(permuted[key] - 1) - abs(value - 1)
        else:
            out[name] = permuted[key] - value
    return out


@dataclass
class Importance:
    """One feature's row of the table: the metrics with it shuffled and their changes (:func:`changes`)."""

    feature: Feature
    metrics: dict[str, float]
    changes: dict[str, float]


def measure(evaluator: Evaluator, features: list[Feature], *, seed: int, show: bool) -> list[Importance]:
    """Each of ``features``' metrics with its rows shuffled in every eval batch of this rank (a collective: every rank
    measures the same features in the same order); ``show`` draws a progress bar per pass (rank 0)."""
    rank = evaluator.env.rank
    kept = evaluator.corpus.index_kept() if evaluator.corpus is not None else contextlib.nullcontext()
    with kept:  # a two-tower model's item index: built by the first pass, reused by the others
        return [Importance(feature, _shuffled_metrics(evaluator, feature, seed, rank, show), {}) for feature in features]


def _shuffled_metrics(evaluator: Evaluator, feature: Feature, seed: int, rank: int, show: bool) -> dict[str, float]:
    """The eval metrics with ``feature``'s rows shuffled in each of this rank's batches (:func:`row_order`)."""
    def shuffled(n: int, batch: Batch) -> Batch:
        return permute_rows(batch, feature, row_order(seed, rank, n, feature.name, batch.labels.shape[0]))

    with evaluator.data.counters_kept(), Progress(evaluator.max_batches, enabled=show, unit="batch",
                                                  desc=f"importance {feature.name}") as progress:
        return evaluator.evaluate(progress, rewrite=shuffled)


def ranked(base: dict[str, float], rows: list[Importance]) -> list[Importance]:
    """``rows`` with their changes against ``base``, the most important first: by the first AUC's drop (the first task's),
    else by the first metric's change."""
    for row in rows:
        row.changes = changes(base, row.metrics)
    keys = list(base)
    first = change_name(next((k for k in keys if metric_name(k) == "auc"), keys[0])) if keys else None

    def key(row: Importance) -> float:  # a NaN change (an AUC over one class) last
        value = row.changes[first] if first is not None else float("nan")
        return -value if np.isfinite(value) else float("inf")
    return sorted(rows, key=key)


def table(base: dict[str, float], rows: list[Importance]) -> str:
    """The importance table as printed: one line per feature, its kind and each metric's change, under the base metrics."""
    names = list(changes(base, base))
    width = max([len("feature"), *(len(r.feature.name) for r in rows)])
    lines = ["base " + " ".join(f"{k}={v:.6g}" for k, v in base.items()),
             f"{'feature':<{width}}  {'kind':<7}  " + "  ".join(f"{n:>14}" for n in names)]
    lines += [f"{r.feature.name:<{width}}  {r.feature.kind:<7}  " + "  ".join(f"{r.changes[n]:>14.6f}" for n in names)
              for r in rows]
    return "\n".join(lines)


def as_csv(base: dict[str, float], rows: list[Importance]) -> str:
    """``importance.csv``: ``feature,kind,<change>…,<metric permuted>…``, a row per feature, most important first."""
    names, keys = list(changes(base, base)), list(base)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["feature", "kind", *names, *keys])
    for r in rows:
        writer.writerow([r.feature.name, r.feature.kind, *(r.changes[n] for n in names), *(r.metrics[k] for k in keys)])
    return out.getvalue()


def as_json(base: dict[str, float], rows: list[Importance], seed: int) -> str:
    """``importance.json``: the base metrics, the seed and per feature its kind, changes and permuted metrics."""
    return json.dumps({"method": "permutation", "seed": seed, "base": base, "features": [
        {"feature": r.feature.name, "kind": r.feature.kind, "changes": r.changes, "metrics": r.metrics} for r in rows]},
        indent=2)


_BAD = re.compile(r"[^\w.\- ]")


def metric_keys(rows: list[Importance]) -> dict[str, float]:
    """``importance/<feature>/<change>`` for MLflow: a feature name's characters outside MLflow's (letters, digits,
    ``_ - . `` and space; ``/`` would add a level) become ``_``, a name of dots alone too; two names made alike get ``_2``…"""
    out: dict[str, float] = {}
    taken: set[str] = set()
    for r in rows:
        name = _BAD.sub("_", r.feature.name)
        name = name if name.strip(".") else name.replace(".", "_") or "_"
        unique, n = name, 1
        while unique in taken:
            n += 1
            unique = f"{name}_{n}"
        taken.add(unique)
        out |= {f"importance/{unique}/{change}": value for change, value in r.changes.items()}
    return out


def write(directory: Path | None, base: dict[str, float], rows: list[Importance], seed: int) -> dict[str, str]:
    """The artifacts by file name (``importance.csv``, ``importance.json``), written to ``directory`` too when given."""
    texts = {f"{IMPORTANCE_FILE}.csv": as_csv(base, rows), f"{IMPORTANCE_FILE}.json": as_json(base, rows, seed)}
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            (directory / name).write_text(text)
    return texts
