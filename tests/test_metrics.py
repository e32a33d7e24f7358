"""Every metric against a straightforward reference: hand-checked small cases and brute-force pair counts."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torchmetrics.classification import BinaryAUROC
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError
from recsys_runner.metrics.classification import (
    AUC,
    XAUC,
    Accuracy,
    Calibration,
    GroupedAUC,
    LogLoss,
    NormalizedEntropy,
)
from recsys_runner.metrics.decay import DecayAUC, DecayingMetric
from recsys_runner.metrics.functional import binary_auc, grouped_auc, xauc
from recsys_runner.metrics.registry import (
    METRICS,
    NAME_PATTERNS,
    MetricsConfig,
    best_first_key,
    build_eval_metrics,
    build_train_metrics,
    default_objective,
    eval_metrics,
    higher_is_better,
    improved,
    metric_entry,
    register_metric,
)
from recsys_runner.metrics.regression import MeanAbsoluteError, MeanSquaredError
from recsys_runner.metrics.retrieval import RecallAtK
from recsys_runner.metrics.tasks import TaskTrainMetrics, grouping_ids
from recsys_runner.tasks import BinaryTask

CPU = torch.device("cpu")


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def pairwise_auc(preds: list[float], labels: list[float], weights: list[float] | None = None) -> float:
    """Brute force: over (positive, negative) pairs, 1 if the positive scores higher, ½ on a tie."""
    w = weights or [1.0] * len(preds)
    num = den = 0.0
    for i, j in itertools.product(range(len(preds)), repeat=2):
        if labels[i] == 1 and labels[j] == 0:
            num += w[i] * w[j] * (1.0 if preds[i] > preds[j] else 0.5 if preds[i] == preds[j] else 0.0)
            den += w[i] * w[j]
    return num / den


def pairwise_xauc(preds: list[float], targets: list[float]) -> float:
    num = den = 0
    for i, j in itertools.combinations(range(len(preds)), 2):
        if targets[i] != targets[j]:
            dp, dt = preds[j] - preds[i], targets[j] - targets[i]
            num += 1.0 if dp * dt > 0 else 0.5 if dp == 0 else 0.0
            den += 1
    return num / den


def fed(metric, *batches) -> float:
    for args in batches:
        metric.update(*args[:2], **({"groups": args[2]} if len(args) > 2 else {}))
    return float(metric.compute())


# ---- AUC --------------------------------------------------------------------------------------


def test_auc_hand_cases() -> None:
    assert fed(AUC(), (t(0.1, 0.4, 0.35, 0.8), t(0, 0, 1, 1))) == pytest.approx(0.75)
    # positives {0.5, 0.9}, negatives {0.5, 0.2}: the 0.5/0.5 tie counts ½ → 3.5 / 4
    assert fed(AUC(), (t(0.5, 0.5, 0.2, 0.9), t(1, 0, 0, 1))) == pytest.approx(0.875)
    assert math.isnan(fed(AUC(), (t(0.3, 0.7), t(1, 1))))


def test_auc_matches_pairwise_and_torchmetrics_across_batches() -> None:
    g = torch.Generator().manual_seed(0)
    preds = (torch.rand(200, generator=g) * 10).round() / 10  # many ties
    labels = (torch.rand(200, generator=g) < preds).double()
    value = fed(AUC(), (preds[:70], labels[:70]), (preds[70:], labels[70:]))
    assert value == pytest.approx(pairwise_auc(preds.tolist(), labels.tolist()))
    assert value == pytest.approx(float(BinaryAUROC()(preds, labels.long())), abs=1e-6)


def test_default_eval_metrics_keep_their_keys() -> None:
    m = eval_metrics(CPU)
    m.update(t(0.2, 0.8, 0.6), torch.tensor([0, 1, 0]))
    out = m.compute()
    assert set(out) == {"auc", "logloss"}
    assert float(out["auc"]) == pytest.approx(1.0)


# ---- grouped AUC -------------------------------------------------------------------------------

GAUC_CASE = (
    # group 7: AUC 1 over 2 rows; group 3: AUC 0 over 3 rows; group 5: one class only, excluded.
    t(0.9, 0.2, 0.1, 0.6, 0.4, 0.3),
    t(1, 1, 0, 0, 0, 1),
    torch.tensor([7, 3, 7, 3, 3, 5]),
)


def test_grouped_auc_hand_case_both_weightings() -> None:
    assert fed(GroupedAUC("impressions"), GAUC_CASE) == pytest.approx((1.0 * 2 + 0.0 * 3) / 5)
    assert fed(GroupedAUC("uniform"), GAUC_CASE) == pytest.approx(0.5)
    assert math.isnan(float(grouped_auc(t(0.1, 0.2), t(1, 1), torch.tensor([1, 2]))))


def test_grouped_auc_equals_per_group_reference_with_ties_and_batches() -> None:
    g = torch.Generator().manual_seed(1)
    n = 300
    preds = (torch.rand(n, generator=g) * 8).round() / 8
    labels = (torch.rand(n, generator=g) < preds).double()
    groups = torch.randint(0, 12, (n,), generator=g) * 1000  # sparse, non-contiguous ids
    num = den = 0.0
    for k in groups.unique().tolist():
        sel = groups == k
        if labels[sel].min() != labels[sel].max():
            num += pairwise_auc(preds[sel].tolist(), labels[sel].tolist()) * int(sel.sum())
            den += int(sel.sum())
    value = fed(GroupedAUC(), (preds[:100], labels[:100], groups[:100]), (preds[100:], labels[100:], groups[100:]))
    assert value == pytest.approx(num / den)


def test_grouped_auc_without_groups_says_what_is_missing() -> None:
    with pytest.raises(ValueError, match="groups="):
        GroupedAUC().update(t(0.1), t(1))


# ---- XAUC --------------------------------------------------------------------------------------


def test_xauc_hand_cases() -> None:
    # pairs (1,2) and (1,3) ordered like the targets, (2,3) reversed → 2/3
    assert float(xauc(t(0.1, 0.3, 0.2), t(1, 2, 3))) == pytest.approx(2 / 3)
    # equal targets are skipped; a prediction tie counts ½ → (0.5 + 1) / 2
    assert float(xauc(t(0.5, 0.1, 0.5), t(1, 1, 2))) == pytest.approx(0.75)
    assert math.isnan(float(xauc(t(0.5, 0.1), t(1, 1))))


def test_xauc_exact_matches_brute_force_and_sampling_is_deterministic_and_order_free() -> None:
    g = torch.Generator().manual_seed(2)
    targets = (torch.rand(120, generator=g) * 20).round()
    preds = targets + torch.randn(120, generator=g) * 5
    exact = fed(XAUC(), (preds[:50], targets[:50]), (preds[50:], targets[50:]))
    assert exact == pytest.approx(pairwise_xauc(preds.tolist(), targets.tolist()))
    sampled = float(xauc(preds, targets, max_pairs=2000))
    perm = torch.randperm(120, generator=g)
    assert float(xauc(preds[perm], targets[perm], max_pairs=2000)) == sampled  # same rows, other order: same pairs
    assert sampled == pytest.approx(exact, abs=0.05)


# ---- additive metrics --------------------------------------------------------------------------


def test_additive_metrics_hand_cases() -> None:
    assert fed(LogLoss(), (t(0.5, 0.25), t(1, 0))) == pytest.approx(-(math.log(0.5) + math.log(0.75)) / 2)
    # 0.5 >= threshold predicts 1 against label 0: rows 1 and 4 right → 0.5
    assert fed(Accuracy(), (t(0.6, 0.4, 0.5, 0.1), t(1, 1, 0, 0))) == pytest.approx(0.5)
    assert fed(Calibration(), (t(0.2, 0.3, 0.5, 0.4), t(1, 0, 0, 1))) == pytest.approx(1.4 / 2)
    assert fed(MeanAbsoluteError(), (t(1, 2, 3), t(2, 2, 5))) == pytest.approx(1.0)
    assert fed(MeanSquaredError(), (t(1, 2, 3), t(2, 2, 5))) == pytest.approx(5 / 3)


def test_normalized_entropy() -> None:
    # predicting the base rate for every row is NE 1 by definition
    assert fed(NormalizedEntropy(), (t(0.25, 0.25), t(1, 0)), (t(0.25, 0.25), t(0, 0))) == pytest.approx(1.0)
    base = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert fed(NormalizedEntropy(), (t(0.5, 0.5, 0.5, 0.5), t(1, 0, 0, 0))) == pytest.approx(math.log(2) / base)
    assert math.isnan(fed(NormalizedEntropy(), (t(0.3), t(1))))


def test_recall_at_k_ties_count_against_the_positive() -> None:
    scores = t(0.9, 0.1, 0.5, 0.2, 0.8, 0.8, 0.3, 0.2, 0.1).view(3, 3)
    positives = torch.tensor([2, 1, 0])
    # query 0: 0.9 beats its positive; query 1: its positive ties 0.8; query 2: positive on top
    assert fed(RecallAtK(1), (scores, positives)) == pytest.approx(1 / 3)
    assert fed(RecallAtK(2), (scores, positives)) == pytest.approx(1.0)


# ---- decaying train metrics --------------------------------------------------------------------


def test_decaying_metric_matches_the_closed_form() -> None:
    rate, step = 0.5, 2
    m = DecayingMetric(MeanAbsoluteError(), decay_rate=rate, decay_step=step)
    errors = [1.0, 3.0, 2.0, 2.0, 4.0, 8.0, 100.0]
    for i, e in enumerate(errors):
        m.update(t(e), t(0))
        if i == 0:
            assert float(m.compute()) == pytest.approx(1.0)  # before the first window: the metric so far
    w1, w2, w3 = 2.0, 2.0, 6.0
    expected = rate * (rate * w1 + (1 - rate) * w2) + (1 - rate) * w3
    assert float(m.compute()) == pytest.approx(expected)  # the open 7th update is not in it yet


@pytest.mark.parametrize("metric", [LogLoss(), Accuracy(), NormalizedEntropy(), MeanAbsoluteError(), MeanSquaredError(), AUC()],
                         ids=lambda m: type(m).__name__)
def test_a_metric_over_no_rows_is_nan_not_a_perfect_score(metric) -> None:
    """A mean over no rows is undefined (a masked task's eval without one masked row): NaN, as AUC over one class, not
    the 0 that reads as a perfect log loss or error."""
    assert math.isnan(fed(metric, (torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64))))


def test_ranking_means_over_no_rows_are_nan() -> None:
    assert math.isnan(fed(RecallAtK(5), (torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))))
    for name in ("hr@5", "ndcg@5", "mrr", "ann_recall@5"):
        metric = metric_entry(name).factory(MetricsConfig(eval=[name], train=[]))
        metric.update(torch.zeros(0, 7), torch.zeros(0, dtype=torch.long))
        assert math.isnan(float(metric.compute())), name


def _decayed(windows: list[float], rate: float) -> float:
    """The documented rule by hand: the first defined window as is, then ``rate·value + (1−rate)·window``; an
    undefined (NaN) window leaves the value."""
    value = math.nan
    for w in windows:
        if math.isnan(w):
            continue
        value = w if math.isnan(value) else rate * value + (1 - rate) * w
    return value


def test_a_window_without_rows_or_with_one_class_leaves_the_decayed_value() -> None:
    """A window over which the metric is undefined (no rows: a masked task's window without a clicked row; one class
    for ne) neither pulls the value toward 0 nor turns it NaN for the rest of the run."""
    rate = 0.5
    empty = (torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64))
    batches = [empty, (t(0.9, 0.2), t(1, 0)), empty, (t(0.6, 0.3), t(1, 1)), (t(0.7, 0.4), t(0, 1))]
    for cls in (LogLoss, NormalizedEntropy, Accuracy):
        m = DecayingMetric(cls(), decay_rate=rate, decay_step=1)
        for b in batches:
            m.update(*b)
        windows = [fed(cls(), b) for b in batches]
        assert math.isnan(windows[0]) and math.isnan(windows[2])
        assert float(m.compute()) == pytest.approx(_decayed(windows, rate)), cls.__name__
    assert math.isnan(fed(NormalizedEntropy(), batches[3]))  # one class: ne's window 4 is undefined too


def test_masked_train_metrics_pass_over_windows_without_a_masked_row() -> None:
    """Through the runner's path (TaskTrainMetrics, a masked cvr task): windows whose batches have no clicked row are
    passed over, and the value equals the decay rule over the defined windows."""
    g = torch.Generator().manual_seed(4)
    tasks = (BinaryTask("ctr", column=0), BinaryTask("cvr", column=1, mask_column=0))
    spec = MetricsConfig(train=["logloss"], decay_rate=0.8, decay_step=2)
    train_metrics = TaskTrainMetrics(spec, tasks, CPU, flush_every=3)
    windows: list[float] = []
    for window in range(6):
        rows = []
        for _ in range(2):
            logits = torch.randn(8, 2, generator=g)
            click = torch.zeros(8) if window in (0, 3) else torch.randint(0, 2, (8,), generator=g).float()
            labels = torch.stack([click, click * torch.randint(0, 2, (8,), generator=g).float()], dim=1)
            train_metrics.update(logits, labels)
            keep = click > 0
            rows.append((torch.sigmoid(logits[keep, 1]).double(), labels[keep, 1].double()))
        p, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        windows.append(float(F.binary_cross_entropy(p, y)) if len(p) else math.nan)
    assert train_metrics.compute()["train/cvr/logloss"] == pytest.approx(_decayed(windows, 0.8))


def test_decay_auc_matches_weighted_pairwise_auc() -> None:
    rate, step = 0.8, 3
    g = torch.Generator().manual_seed(3)
    m = DecayingMetric(DecayAUC(num_bins=1000), decay_rate=rate, decay_step=step)
    num_windows, rows = 4, []
    for w in range(num_windows):
        for _ in range(step):
            preds = (torch.rand(6, generator=g) * 100).floor() / 100 + 0.0005  # one bin per distinct value
            labels = (torch.rand(6, generator=g) < preds).double()
            m.update(preds, labels)
            rows += [(p, y, w) for p, y in zip(preds.tolist(), labels.tolist(), strict=True)]
    weight = [rate ** (num_windows - 1) if w == 0 else (1 - rate) * rate ** (num_windows - 1 - w) for _, _, w in rows]
    expected = pairwise_auc([p for p, _, _ in rows], [y for _, y, _ in rows], weight)
    assert float(m.compute()) == pytest.approx(expected)


def test_decay_auc_bins_count_what_bincount_counts() -> None:
    """DecayAUC counts rows per bin without a host sync (index_add_); the counts are bincount's, NaN rows left out."""
    g = torch.Generator().manual_seed(5)
    preds = torch.cat([torch.rand(500, generator=g), torch.tensor([0.0, 1.0, float("nan"), float("inf")])])
    labels = (torch.rand(504, generator=g) < 0.4).double()
    m = DecayAUC(num_bins=100)
    m.update(preds, labels)
    keep = torch.isfinite(preds)
    bins = (preds[keep].clamp(0, 1) * 100).long().clamp_max(99)
    assert torch.equal(m.pos_buffer, torch.bincount(bins, weights=labels[keep], minlength=100))
    assert torch.equal(m.neg_buffer, torch.bincount(bins, weights=1 - labels[keep], minlength=100))


def test_train_metrics_built_from_config() -> None:
    tm = build_train_metrics(MetricsConfig(train=["auc", "logloss"], decay_step=1), CPU)
    tm.update(t(0.2, 0.9), t(0, 1))
    out = tm.compute()
    assert set(out) == {"train/auc", "train/logloss"} and out["train/auc"] == pytest.approx(1.0)


# ---- config and registry -----------------------------------------------------------------------


def test_collection_routes_groups_only_to_gauc() -> None:
    spec = MetricsConfig(eval=["auc", "gauc", "xauc", "ne", "calibration", "accuracy", "mae", "mse", "logloss"], grouping_key="user")
    m = build_eval_metrics(spec, CPU)
    preds, labels, groups = GAUC_CASE
    m.update(preds, labels, groups=groups)
    out = {k: float(v) for k, v in m.compute().items()}
    assert set(out) == set(spec.eval)
    assert out["gauc"] == pytest.approx(0.4) and out["auc"] == pytest.approx(binary_auc(preds, labels).item())


def test_an_unknown_metric_is_refused_listing_every_valid_name() -> None:
    """The message names every registered metric and every ``<name>@<k>`` pattern (``ann_recall@<k>`` was left out)."""
    with pytest.raises(ConfigError) as raised:
        MetricsConfig(eval=["recal@10"])
    for name in [*METRICS, *NAME_PATTERNS]:
        assert name in str(raised.value)
    assert "unknown metric 'recal@10' (did you mean recall@10?)" in str(raised.value)
    with pytest.raises(ConfigError, match=r"unknown metric 'loglos' \(did you mean logloss\?\)"):
        MetricsConfig(eval=["loglos"])
    with pytest.raises(ConfigError, match=r"unknown metric 'ndcg' \(did you mean ndcg@10\? it needs its k\)"):
        MetricsConfig(eval=["ndcg"])
    # TorchEasyRec's names and capitals: no close spelling among ours (grouped_auc), or a wrong one (AUC had none)
    with pytest.raises(ConfigError, match=r"unknown metric 'grouped_auc' \(TorchEasyRec's name for gauc: did you mean gauc\?\)"):
        MetricsConfig(eval=["grouped_auc"])
    with pytest.raises(ConfigError, match=r"unknown metric 'mean_squared_error' \(TorchEasyRec's name for mse: did you mean mse\?\)"):
        MetricsConfig(train=["mean_squared_error"])
    with pytest.raises(ConfigError, match=r"unknown metric 'AUC' \(did you mean auc\?\)"):
        MetricsConfig(eval=["AUC"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eval": ["auc", "ndcg"]}, r"unknown metric 'ndcg' .*Valid names: accuracy, auc, calibration, gauc"),
        ({"eval": ["auc", "auc"]}, r"metrics.eval lists \['auc'\] more than once"),
        ({"eval": ["gauc"]}, "metrics.grouping_key is not set"),
        ({"eval": ["auc", "recall@10"]}, "mixes pointwise metrics"),
        ({"eval": ["recall@0"]}, "needs k >= 1"),
        ({"train": ["gauc"], "grouping_key": "u"}, "cannot be computed at train time"),
        ({"decay_rate": 1.0}, r"metrics.decay_rate must be in \[0, 1\)"),
        ({"decay_step": 0}, "metrics.decay_step must be positive"),
        ({"gauc_weighting": "clicks"}, "impressions or uniform"),
    ],
)
def test_bad_metric_configs_say_what_to_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MetricsConfig), kwargs))


def test_recall_only_collection_and_registry_refuses_duplicates() -> None:
    m = build_eval_metrics(MetricsConfig(eval=["inbatch_recall@1", "inbatch_recall@2"], train=[]), CPU)
    m.update(t(0.9, 0.1, 0.5, 0.2, 0.8, 0.8, 0.3, 0.2, 0.1).view(3, 3), torch.tensor([2, 1, 0]))
    assert {k: round(float(v), 4) for k, v in m.compute().items()} == {"inbatch_recall@1": 0.3333, "inbatch_recall@2": 1.0}
    with pytest.raises(ValueError, match="already registered"):
        register_metric("auc", AUC, "pointwise", "again")
    with pytest.raises(ValueError, match="already registered"):
        register_metric("recall@5", RecallAtK, "retrieval", "shadowing the pattern")


@pytest.mark.parametrize(
    ("key", "higher"),
    [("eval/auc", True), ("eval/ctr/auc", True), ("eval/gauc", True), ("train/accuracy", True), ("eval/xauc", True),
     ("eval/recall_at_10", True), ("recall@10", True), ("eval/logloss", False), ("eval/cvr/logloss", False),
     ("train/mse", False), ("eval/mae", False), ("eval/ne", False), ("train/loss", False)],
)
def test_direction_is_the_metric_class_s(key: str, higher: bool) -> None:
    assert higher_is_better(key) is higher


def test_every_registered_metric_states_its_direction() -> None:
    assert {name: entry.higher_is_better for name, entry in METRICS.items()} == {
        "auc": True, "gauc": True, "xauc": True, "accuracy": True,
        "logloss": False, "ne": False, "mae": False, "mse": False, "calibration": None, "mrr": True,
    }
    assert DecayAUC.higher_is_better is True and RecallAtK.higher_is_better is True


def test_direction_of_an_unknown_or_undirected_metric_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"'eval/ndcg' names no metric.*Valid names: accuracy, auc, calibration"):
        higher_is_better("eval/ndcg")
    with pytest.raises(ConfigError, match="calibration .* is best at a target value"):
        higher_is_better("eval/ctr/calibration")


def test_improved_follows_the_direction_and_min_delta() -> None:
    assert improved(0.7, None, True) and improved(0.3, None, False)
    assert improved(0.71, 0.7, True) and not improved(0.69, 0.7, True) and not improved(0.7, 0.7, True)
    assert improved(0.69, 0.7, False) and not improved(0.71, 0.7, False)
    assert not improved(0.705, 0.7, True, min_delta=0.01) and improved(0.72, 0.7, True, min_delta=0.01)
    assert not improved(0.695, 0.7, False, min_delta=0.01) and improved(0.68, 0.7, False, min_delta=0.01)


def test_improved_never_takes_nan_for_the_best_and_any_value_beats_a_nan_best() -> None:
    """A NaN evaluation (one class, a diverged model) must not become the best: nothing compares above NaN, so the best
    checkpoint, ``best/<metric>`` and early stopping would stay stuck on it."""
    nan = math.nan
    assert not improved(nan, None, True) and not improved(nan, 0.7, True) and not improved(nan, 0.3, False)
    assert improved(0.6, nan, True) and improved(0.9, nan, False, min_delta=0.1)


def test_best_first_key_puts_nan_and_missing_values_last_in_either_direction() -> None:
    values = [0.6, math.nan, 0.8, None, 0.7]
    assert [v for v in sorted(values, key=lambda v: best_first_key(v, True)) if v is not None and not math.isnan(v)] == [0.8, 0.7, 0.6]
    assert sorted(values, key=lambda v: best_first_key(v, False))[:3] == [0.6, 0.7, 0.8]
    assert min([math.nan, 0.2, 0.9], key=lambda v: best_first_key(v, True)) == 0.9  # a NaN first does not stick as max()'s would


def test_default_objective_is_eval_auc_when_logged_else_the_first() -> None:
    assert default_objective(["eval/logloss", "eval/auc"]) == "eval/auc"
    assert default_objective(["eval/ctr/auc", "eval/cvr/auc"]) == "eval/ctr/auc"
    assert default_objective({"eval/mse": 1.0}) == "eval/mse"
    with pytest.raises(ConfigError, match="no eval metric"):
        default_objective([])


def test_default_objective_passes_over_a_metric_without_a_direction() -> None:
    """``metrics.eval=[calibration,logloss]`` with no objective set watches log loss: calibration (best at 1) cannot
    rank evaluations, and taking it failed the run when its watched eval was built."""
    assert default_objective(["eval/calibration", "eval/logloss"]) == "eval/logloss"
    assert default_objective(["eval/ctr/calibration", "eval/cvr/mse"]) == "eval/cvr/mse"
    with pytest.raises(ConfigError, match=r"none of which is better higher or lower.*metrics.eval=\[calibration,logloss\]"):
        default_objective(["eval/calibration"])


def test_grouping_ids_from_a_sparse_feature() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["user", "item"], values=torch.tensor([4, 9, 1, 2]), lengths=torch.tensor([1, 1, 1, 1]))
    assert grouping_ids(kjt, "user").tolist() == [4, 9]
    with pytest.raises(ConfigError, match=r"metrics.grouping_key='shop' is not a sparse feature; the data has user, item"):
        grouping_ids(kjt, "shop")
    multi = KeyedJaggedTensor.from_lengths_sync(keys=["user"], values=torch.tensor([4, 9, 1]), lengths=torch.tensor([2, 1]))
    with pytest.raises(ConfigError, match="exactly one id per row"):
        grouping_ids(multi, "user")


def test_logloss_matches_definition() -> None:
    probs = torch.tensor([0.9, 0.2, 0.6, 0.4])
    labels = torch.tensor([1, 0, 0, 1])
    metric = LogLoss()
    metric.update(probs[:2], labels[:2])
    metric.update(probs[2:], labels[2:])
    expected = -(math.log(0.9) + math.log(0.8) + math.log(0.4) + math.log(0.4)) / 4
    assert float(metric.compute()) == pytest.approx(expected)
