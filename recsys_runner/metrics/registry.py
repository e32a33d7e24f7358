"""The metric registry: config name → metric class, what its ``update`` reads, and which way is better.

Which metrics run is chosen by config (:class:`MetricsConfig`, a list of names per phase) through :data:`METRICS`:
unknown names are errors that list the valid ones, and registering a name twice is an error.
:func:`build_eval_metrics` builds the eval collection and :func:`build_train_metrics` the decaying train metrics.

A metric's direction is a fact of its class (its ``higher_is_better``), exposed by its
:class:`MetricEntry`; :func:`higher_is_better` reads it for a logged key (``eval/ctr/logloss``) and
:func:`improved` compares two values with it. The default objective (the eval metric a run reports and a
sweep ranks by when no setting names one) is declared here once: :data:`DEFAULT_OBJECTIVE`,
:func:`default_objective`.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

from recsys_runner.errors import ConfigError, require
from recsys_runner.metrics.classification import AUC, XAUC, Accuracy, Calibration, GroupedAUC, LogLoss, NormalizedEntropy
from recsys_runner.metrics.corpus import AnnRecallAtK, CoverageAtK, MeanReciprocalRank
from recsys_runner.metrics.decay import DecayAUC, DecayingMetric, TrainMetrics
from recsys_runner.metrics.regression import MeanAbsoluteError, MeanSquaredError
from recsys_runner.metrics.retrieval import HitRateAtK, NDCGAtK, RecallAtK
from recsys_runner.metrics.state import Metric, MetricCollection

Inputs = Literal["pointwise", "grouped", "retrieval", "ranking", "multiclass"]


@dataclass(frozen=True)
class MetricEntry:
    """A registered metric: its class, how to build it from the config, and what ``update`` takes."""

    metric: type[Metric]
    factory: Callable[[MetricsConfig], Metric]
    inputs: Inputs
    doc: str
    also: tuple[Inputs, ...] = ()
    """Other inputs ``update`` takes: ``multiclass`` for a metric that also reads class probabilities ``[B, C]`` with
    class indices ``[B]`` (a multi-class task's, ``accuracy``, ``logloss``, ``auc``)."""

    def reads(self, kinds: Iterable[str]) -> bool:
        """Whether the metric's ``update`` takes any of the inputs ``kinds`` (a task's ``metric_inputs_kinds``)."""
        return any(k == self.inputs or k in self.also for k in kinds)

    @property
    def higher_is_better(self) -> bool | None:
        """The class's direction: ``True`` (AUC), ``False`` (log loss), ``None`` when best at a target
        value (calibration, at 1)."""
        return self.metric.higher_is_better


METRICS: dict[str, MetricEntry] = {}
"""The metric registry, by config name. ``recall@<k>``, ``inbatch_recall@<k>``, ``hr@<k>``, ``ndcg@<k>``, ``coverage@<k>``
are matched by :data:`AT_K_NAME`."""

AT_K: dict[str, tuple[type[RecallAtK] | type[HitRateAtK] | type[CoverageAtK] | type[AnnRecallAtK], Inputs, str]] = {
    "inbatch_recall": (RecallAtK, "retrieval", "recall at {k} over in-batch candidates"),
    "recall": (HitRateAtK, "ranking", "recall at {k} of the true item over the full item table (the whole catalogue)"),
    "hr": (HitRateAtK, "ranking", "hit rate at {k} of the true item over the full item table"),
    "ndcg": (NDCGAtK, "ranking", "NDCG at {k} of the true item over the full item table"),
    "coverage": (CoverageAtK, "ranking", "share of the item table in some row's top {k}"),
    "ann_recall": (AnnRecallAtK, "ranking", "share of the exact top {k} an approximate index (model.index=faiss) returns"),
}
"""The ``<name>@<k>`` metrics (``recall@10``, ``hr@10``, ``ndcg@10``): class, inputs, doc, by name. ``recall@k`` is
full-table (full-corpus) recall, which equals ``hr@k`` with one relevant item per row; ``inbatch_recall@k`` ranks among
the batch's candidates only."""
AT_K_NAME = re.compile(r"(inbatch_recall|ann_recall|recall|hr|ndcg|coverage)@([0-9]+)")
"""Names ``recall@1``, ``hr@10``, ``ndcg@50`` …: :data:`AT_K`'s class with that ``k``."""

NAME_PATTERNS: dict[str, Inputs] = {f"{name}@<k>": inputs for name, (_, inputs, _) in AT_K.items()}
"""The metric names matched by a pattern rather than registered one by one, and their inputs."""


def register_metric(
    name: str, metric: type[Metric], inputs: Inputs, doc: str, factory: Callable[[MetricsConfig], Metric] | None = None,
    also: tuple[Inputs, ...] = (),
) -> None:
    """Add ``metric`` to :data:`METRICS` as ``name``; a name may be registered once. ``factory`` builds it from
    the config (default: ``metric()``); its direction is ``metric.higher_is_better``; ``also``: other inputs its
    ``update`` takes (:attr:`MetricEntry.also`)."""
    if name in METRICS or AT_K_NAME.fullmatch(name):
        raise ValueError(f"metric {name!r} is already registered")
    METRICS[name] = MetricEntry(metric, factory or (lambda spec: metric()), inputs, doc, also)


register_metric("auc", AUC, "pointwise", "ROC AUC, exact over all ranks' rows; multi-class: macro one-vs-rest AUC",
                also=("multiclass",))
register_metric("logloss", LogLoss, "pointwise", "mean binary cross-entropy; multi-class: mean -log p(true class)", also=("multiclass",))
register_metric("accuracy", Accuracy, "pointwise", "share of rows with (pred >= 0.5) == label; multi-class: argmax == label",
                also=("multiclass",))
register_metric("gauc", GroupedAUC, "grouped", "AUC per metrics.grouping_key group, averaged", lambda s: GroupedAUC(s.gauc_weighting))
register_metric("xauc", XAUC, "pointwise", "pairwise ordering accuracy for real targets", lambda s: XAUC(s.xauc_max_pairs))
register_metric("ne", NormalizedEntropy, "pointwise", "log loss / entropy of the base rate")
register_metric("calibration", Calibration, "pointwise", "sum of preds / sum of labels")
register_metric("mae", MeanAbsoluteError, "pointwise", "mean absolute error")
register_metric("mse", MeanSquaredError, "pointwise", "mean squared error")
register_metric("mrr", MeanReciprocalRank, "ranking", "mean reciprocal rank of the true item over the full item table")


def metric_entry(name: str, key: str = "metrics") -> MetricEntry:
    """The registry entry for ``name``; :class:`ConfigError` listing the valid names otherwise."""
    if (m := AT_K_NAME.fullmatch(name)) is not None:
        base, k = m.group(1), int(m.group(2))
        require(k > 0, f"{key}: {name!r} needs k >= 1, e.g. {base}@10")
        cls, inputs, doc = AT_K[base]
        return MetricEntry(cls, lambda s: cls(k), inputs, doc.format(k=k))
    if name not in METRICS:
        raise ConfigError(f"{key}: unknown metric {name!r}{_closest(name)}. Valid names: {', '.join(sorted(METRICS))}, "
                          f"{', '.join(NAME_PATTERNS)} (<k> a count, e.g. recall@10)")
    return METRICS[name]


TORCHEASYREC_METRICS = {"grouped_auc": "gauc", "mean_absolute_error": "mae", "mean_squared_error": "mse",
                        "multiclass_auc": "auc"}
"""TorchEasyRec's metric names (its ``metric.proto``) for metrics registered here under another: a migrating user's
``metrics.eval=[grouped_auc]`` has no close spelling among ours (``auc`` for a multi-class task is the macro AUC)."""


def _closest(name: str) -> str:
    """`` (did you mean recall@10?)`` for a misspelt metric name (``recal@10``, ``loglos``), keeping its ``@k``, or one
    without its ``@k`` (``hr``), ours for a TorchEasyRec name (:data:`TORCHEASYREC_METRICS`) or for one in capitals
    (``AUC``); else ``""``."""
    if (ours := TORCHEASYREC_METRICS.get(name.lower())) is not None:
        return f" (TorchEasyRec's name for {ours}: did you mean {ours}?)"
    if name.lower() != name and (name.lower() in METRICS or AT_K_NAME.fullmatch(name.lower())):
        return f" (did you mean {name.lower()}?)"
    base, at, k = name.partition("@")
    if not at and base in AT_K:
        return f" (did you mean {base}@10? it needs its k)"
    close = difflib.get_close_matches(base, list(AT_K) if at else list(METRICS), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}{at}{k}?)" if close else ""


def torcheasyrec_key(key: str) -> str | None:
    """A logged key whose metric is named as TorchEasyRec does (``eval/grouped_auc``) under our name (``eval/gauc``);
    ``None`` for any other key."""
    head, _, name = key.rpartition("/")
    ours = TORCHEASYREC_METRICS.get(name.lower())
    return f"{head}/{ours}" if ours is not None and head else None


def metric_key(name: str) -> str:
    """The logged key of metric ``name``: ``recall@10`` → ``recall_at_10`` (MLflow keys cannot hold ``@``)."""
    return name.replace("@", "_at_")


def metric_name(key: str) -> str:
    """The metric name in a logged key, :func:`metric_key` undone: ``eval/ctr/logloss`` → ``logloss``,
    ``eval/recall_at_10`` → ``recall@10`` (the last ``/`` segment; a bare name is its own)."""
    name = key.rsplit("/", 1)[-1]
    return name if name in METRICS else name.replace("_at_", "@")


# --------------------------------------------------------------------------------------------
# Direction and the default objective.
# --------------------------------------------------------------------------------------------

LOSS = "loss"
"""The training loss's name in logged keys (``train/loss``, the train loop's meter): no registered metric, but
a logged value with a direction — lower is better."""

SELECTION_KEY = "eval/selection"
"""The logged weighted sum of eval metrics ``metrics.selection`` configures: higher is better, since each
lower-is-better metric enters it negated (:func:`selection_score`)."""


def selection_score(weights: dict[str, float], values: dict[str, float]) -> float:
    """``Σ_k w_k·±v_k`` over ``metrics.selection``'s keys: ``+v`` for a higher-is-better metric, ``-v`` for a lower one."""
    return sum(w * (values[k] if higher_is_better(k) else -values[k]) for k, w in weights.items())

DEFAULT_OBJECTIVE = "eval/auc"
"""The eval metric a run reports (``train.objective``), watches for its best value and a sweep ranks by when
no setting names one and the run logs it; :func:`default_objective` otherwise takes the first eval metric with a
direction."""


def default_objective(eval_keys: Iterable[str]) -> str:
    """:data:`DEFAULT_OBJECTIVE` when among ``eval_keys`` (as logged), else the first of them with a direction: a metric
    best at a target value (``calibration``) cannot rank evaluations, so ``metrics.eval=[calibration,logloss]`` watches
    ``eval/logloss``.

    Raises:
        ConfigError: ``eval_keys`` is empty, or none of them has a direction.
    """
    keys = list(eval_keys)
    if DEFAULT_OBJECTIVE in keys:
        return DEFAULT_OBJECTIVE
    if not keys:
        raise ConfigError("no eval metric is logged, so the run has no objective. Fix: list at least one in metrics.eval, "
                          "e.g. metrics.eval=[auc]")
    for key in keys:
        try:
            higher_is_better(key)
        except ConfigError:
            continue
        return key
    raise ConfigError(f"the run logs only {keys}, none of which is better higher or lower, so it has no objective to "
                      f"watch or return. Fix: add one that is, e.g. metrics.eval=[{','.join(map(metric_name, keys))},logloss]")


def higher_is_better(key: str) -> bool:
    """Whether a larger value of ``key`` is better: its metric class's ``higher_is_better``.

    ``key`` is a logged key (``eval/auc``, ``eval/ctr/logloss``, ``train/mse``, ``eval/recall_at_10``) or a
    metric name (``recall@10``): the phase prefix and task segment are dropped (:func:`metric_name`).
    ``train/loss`` (:data:`LOSS`) is lower-is-better.

    Raises:
        ConfigError: the name is no registered metric (the message lists the valid ones), or its metric is
            best at a target value rather than higher or lower (``calibration``).
    """
    name = metric_name(key)
    if name == LOSS:
        return False
    if key == SELECTION_KEY:
        return True
    if name not in METRICS and not AT_K_NAME.fullmatch(name):
        raise ConfigError(f"{key!r} names no metric with a known direction. Valid names: {', '.join(sorted(METRICS))}, "
                          f"recall@<k> (e.g. recall@10), inbatch_recall@<k>, hr@<k>, ndcg@<k>, coverage@<k>, {LOSS}")
    entry = metric_entry(name, key)
    if entry.higher_is_better is None:
        raise ConfigError(f"{key!r}: {name} ({entry.doc}) is best at a target value, neither higher nor lower, so it "
                          f"cannot rank runs. Fix: name another metric, e.g. {DEFAULT_OBJECTIVE}")
    return entry.higher_is_better


def improved(value: float, best: float | None, higher_is_better: bool, min_delta: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` (``None``: nothing to beat yet) by more than ``min_delta``, in the
    direction ``higher_is_better`` (e.g. :func:`higher_is_better` of the watched key).

    A NaN ``value`` (an AUC over one class, a diverged model's log loss) beats nothing, and any other value beats a NaN
    ``best``: were NaN ever the best, no later evaluation could compare above it (every comparison with NaN is false),
    so the best checkpoint and early stopping would stay stuck on it."""
    if math.isnan(value):
        return False
    if best is None or math.isnan(best):
        return True
    return value > best + min_delta if higher_is_better else value < best - min_delta


def best_first_key(value: float | None, higher_is_better: bool) -> tuple[bool, float]:
    """A sort key that orders values best first in the direction ``higher_is_better``, with a missing (``None``) or
    NaN value last: ``sorted(runs, key=lambda r: best_first_key(r.value, True))``. A bare ``±value`` key would let a
    NaN (a diverged trial's) stop the sort or a ``max`` wherever it falls, since every comparison with NaN is false."""
    if value is None or math.isnan(value):
        return True, 0.0
    return False, -value if higher_is_better else value


# --------------------------------------------------------------------------------------------
# The metrics config and the builders.
# --------------------------------------------------------------------------------------------


TRAIN_METRICS = {"auc", "logloss", "accuracy", "ne", "calibration", "mae", "mse", "xauc"}
"""Metrics that can decay at train time: those computed from the step's ``(preds, labels)`` alone."""


@dataclass(kw_only=True)
class MetricsConfig:
    """Which metrics to compute, by phase (a ``metrics`` section, or a task's field)."""

    eval: list[str] = field(default_factory=lambda: ["auc", "logloss"])
    """Eval metric names, each logged as ``eval/<name>``; see ``docs/metrics.md``. Pointwise and
    ``gauc`` metrics combine; ``inbatch_recall@<k>`` (in-batch retrieval scores) and the full-table ranking metrics
    (``recall@<k>``, ``hr@<k>``, ``ndcg@<k>``, ``mrr``, ``coverage@<k>``) with each other only: a two-tower model
    computes both kinds, the ranking ones over its item catalogue."""
    train: list[str] = field(default_factory=lambda: ["auc"])
    """Decaying train metrics, logged as ``train/<name>`` at the log cadence (``[]`` for none)."""
    decay_rate: float = 0.9
    """Weight of the history when a train-metric window closes: ``value = rate·value + (1−rate)·window``."""
    decay_step: int = 100
    """Updates (micro-batches) per train-metric window."""
    grouping_key: str | None = None
    """Sparse feature whose id groups rows for ``gauc`` (e.g. a user id); one id per row."""
    gauc_weighting: str = "impressions"
    """``gauc`` weights each group by its rows (``impressions``) or equally (``uniform``)."""
    xauc_max_pairs: int = 1 << 22
    """``xauc`` is exact up to this many pairs, then computed on this many seeded random pairs."""
    exclude_seen: bool = False
    """Full-table ranking metrics (``hr@<k>``, ``ndcg@<k>``, ``recall@<k>``, ``mrr``, ``coverage@<k>``) rank each row's
    true item among the items its user has not interacted with: the row's earlier items score ``-inf``, except the
    true item (the protocol of the HSTU paper and generative-recommenders' tables). Earlier items: a next-item model's
    history as the row holds it (``data.sequences.<group>.max_len`` events at most); a two-tower model's user-side
    features that read the item table, and ``data.items.seen``. ``false``: nothing is excluded."""
    selection: dict[str, float] = field(default_factory=dict)
    """Weights of eval metrics whose sum is logged as ``eval/selection``, to choose the best checkpoint, stop early or
    rank a sweep by several tasks at once, e.g. ``{eval/ctr/auc: 0.5, eval/cvr/auc: 0.5}`` with
    ``checkpoint.best_metric=eval/selection``; a lower-is-better metric (logloss) enters negated, so the sum is
    higher-is-better. ``{}``: none."""

    def __post_init__(self) -> None:
        for phase, names in (("metrics.eval", self.eval), ("metrics.train", self.train)):
            duplicates = sorted({n for n in names if list(names).count(n) > 1})
            require(not duplicates, f"{phase} lists {duplicates} more than once; list each metric once")
            for name in names:
                metric_entry(name, phase)
        kinds = {"pointwise" if e.inputs == "grouped" else e.inputs for e in map(metric_entry, self.eval)}
        require(
            len(kinds) <= 1 or kinds == {"retrieval", "ranking"},
            f"metrics.eval={list(self.eval)} mixes pointwise metrics (per-row predictions) with ranking metrics: "
            f"inbatch_recall@<k> (in-batch retrieval scores), recall@<k>, hr@<k>, ndcg@<k>, mrr, coverage@<k> (full-table scores); "
            f"a task produces one of them. Fix: keep only one kind",
        )
        untrainable = [n for n in self.train if n not in TRAIN_METRICS]
        require(
            not untrainable,
            f"metrics.train={list(self.train)}: {untrainable} cannot be computed at train time (they need grouping ids or "
            f"retrieval scores the train step does not return). Fix: move them to metrics.eval; train-time options: "
            f"{', '.join(sorted(TRAIN_METRICS))}",
        )
        require(
            "gauc" not in self.eval or self.grouping_key is not None,
            "metrics.eval lists gauc but metrics.grouping_key is not set. Fix: metrics.grouping_key=<sparse feature "
            "holding the group id, e.g. a user id>",
        )
        require(0 <= self.decay_rate < 1, f"metrics.decay_rate must be in [0, 1), got {self.decay_rate}")
        require(self.decay_step > 0, f"metrics.decay_step must be positive, got {self.decay_step}")
        require(
            self.gauc_weighting in ("impressions", "uniform"),
            f"metrics.gauc_weighting must be impressions or uniform, got {self.gauc_weighting!r}",
        )
        require(self.xauc_max_pairs > 0, f"metrics.xauc_max_pairs must be positive, got {self.xauc_max_pairs}")
        if self.selection:
            bad = [f"{k}={w}" for k, w in self.selection.items() if w < 0]
            require(not bad, f"metrics.selection weights must be >= 0, got {', '.join(bad)}")
            require(sum(self.selection.values()) > 0, f"metrics.selection={self.selection}: the weights are all 0. Fix: a positive weight")
            for key in self.selection:
                require(key.startswith("eval/") and key != SELECTION_KEY,
                        f"metrics.selection key {key!r} must be an eval metric as logged, e.g. eval/ctr/auc")
                higher_is_better(key)  # a metric with a direction: a ConfigError names the key otherwise


def build_eval_metrics(spec: MetricsConfig, device: torch.device) -> MetricCollection:
    """The eval metrics ``spec.eval`` names, as one collection on ``device``.

    ``update(preds, labels, groups=ids)`` passes ``groups`` only to ``gauc``; ``compute()`` returns
    ``{name: value}`` (collective under a process group).
    """
    metrics = {name: metric_entry(name, "metrics.eval").factory(spec) for name in spec.eval}
    return MetricCollection(metrics).to(device)


def build_train_metrics(spec: MetricsConfig, device: torch.device, prefix: str = "train/") -> TrainMetrics:
    """The decaying train metrics ``spec.train`` names (``auc`` decays as :class:`DecayAUC`)."""
    metrics = {}
    for name in spec.train:
        inner = DecayAUC() if name == "auc" else metric_entry(name, "metrics.train").factory(spec)
        metrics[name] = DecayingMetric(inner, spec.decay_rate, spec.decay_step)
    return TrainMetrics(metrics, prefix).to(device)


def eval_metrics(device: torch.device) -> MetricCollection:
    """Binary-classification eval metrics with the default config: ``auc`` and ``logloss``."""
    return build_eval_metrics(MetricsConfig(), device)
