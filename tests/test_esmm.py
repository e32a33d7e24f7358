"""ESMM (issue 32, point 3): its outputs and tasks, the CTCVR logit against ``logit(σ(a)σ(b))`` at extreme logits, the
selection-biased data and its eval-only truth column, the learning test (ESMM's CVR AUC over all impressions beats the
same towers fitted on clicked rows only), bad input, resume, the default data from the CLI with evaluate on 1 and 2
ranks, and the served MLflow model.

The suites over every ``conf/model`` option (test_models, test_model_structure, test_pipelines, test_fused_serving,
test_configs) also run ESMM; this file adds what is specific to it, at tiny sizes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from decimal import Decimal, getcontext
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient
from torch import nn
from torchrec.datasets.utils import Batch

from recsys_runner import evaluate
from recsys_runner.__main__ import run
from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.generated.synthetic import SyntheticData
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.models.common import materialize
from recsys_runner.models.esmm import ESMM, ESMMConfig, product_logit
from recsys_runner.models.train_wrapper import TrainWrapper
from recsys_runner.tasks import BinaryTask, check_batch_labels
from recsys_runner.train.loop import train
from recsys_runner.train.signals import Interrupted
from tests.conftest import TINY, run_in_process, torchrun
from tests.test_evaluate import compose_entry
from tests.test_interaction_models import one_thread
from tests.test_mlflow_model import ATOL, _click_rows, _scores, _trained
from tests.test_models import CPU


def small(**values: Any) -> SyntheticData:
    """Eight-row batches with a ``ctr`` and a ``cvr`` label (3 dense, 4 sparse features); ``values`` change the config."""
    return SyntheticData(make(SyntheticDataConfig, **{"batch_size": 8, "num_dense": 3, "num_sparse": 4, "num_embeddings": 50,
                                                       "num_train_rows": 64, "num_eval_rows": 64, "tasks": ["ctr", "cvr"], **values}))


def esmm(data: SyntheticData, seed: int = 0, **values: Any) -> nn.Module:
    """A tiny ESMM on ``data``, its tables materialized on CPU, initialized from ``seed``."""
    torch.manual_seed(seed)
    config = make(ESMMConfig, **{"embedding_dim": 8, "tower_layer_sizes": [16], **values})
    return materialize(config.build(features=data.features, dense_device=CPU))


# --- outputs and tasks ------------------------------------------------------------------------------------------------


def test_outputs_a_logit_per_task_and_ctcvr_is_the_product_of_the_towers() -> None:
    data = small()
    model = esmm(data)
    assert isinstance(model, ESMM)
    assert [(t.name, t.label, t.weight) for t in model.tasks] == [("ctr", "ctr", 1.0), ("cvr", "cvr", 0.0), ("ctcvr", "cvr", 1.0)]
    ctr, cvr, ctcvr = model.tasks
    assert cvr.mask_column == ctr.column == 0 and ctcvr.mask_column is None and isinstance(ctcvr, BinaryTask)
    batch = next(iter(data.train_batches(0, 0, 1)))
    with torch.no_grad():
        out = model(batch.dense_features, batch.sparse_features)
    assert list(out) == ["ctr", "cvr", "ctcvr"] and all(v.shape == (8,) for v in out.values())
    expected = torch.logit(torch.sigmoid(out["ctr"].double()) * torch.sigmoid(out["cvr"].double()))
    torch.testing.assert_close(out["ctcvr"].double(), expected, atol=1e-5, rtol=1e-5)
    assert (out["ctcvr"] < torch.minimum(out["ctr"], out["cvr"])).all()  # pCTCVR <= both factors


def test_the_cvr_tower_learns_only_through_the_product() -> None:
    """With ``cvr_weight=0`` the whole loss's gradient on the CVR tower is that of the CTCVR loss alone; the CTR tower
    gets the CTR loss's and the CTCVR loss's."""
    data = small()
    model = esmm(data)
    wrapper = TrainWrapper(model, features=data.features)
    batch = next(iter(data.train_batches(0, 0, 1)))
    loss, _ = wrapper(batch)
    loss.backward()
    whole = {tower: [p.grad.clone() for p in getattr(model, tower).parameters()] for tower in ("ctr_tower", "cvr_tower")}
    model.zero_grad()
    out = model(batch.dense_features, batch.sparse_features)
    ctr_loss = nn.functional.binary_cross_entropy_with_logits(out["ctr"], batch.labels[:, 0])
    ctcvr_loss = nn.functional.binary_cross_entropy_with_logits(out["ctcvr"], batch.labels[:, 1])

    def grads(loss: torch.Tensor, tower: str) -> list[torch.Tensor | None]:
        return list(torch.autograd.grad(loss, list(getattr(model, tower).parameters()), retain_graph=True, allow_unused=True))

    assert all(g is None for g in grads(ctr_loss, "cvr_tower")), "the CTR loss must not reach the CVR tower"
    for got, expected in zip(whole["cvr_tower"], grads(ctcvr_loss, "cvr_tower"), strict=True):
        torch.testing.assert_close(got, expected)
    from_ctr, from_ctcvr = grads(ctr_loss, "ctr_tower"), grads(ctcvr_loss, "ctr_tower")
    assert all(g is not None for g in from_ctcvr), "the CTCVR loss must reach the CTR tower through the product"
    # a real share of the CTR tower's gradient, not a vanishing one
    ctcvr_norm, ctr_norm = (torch.cat([g.flatten() for g in gs]).norm() for gs in (from_ctcvr, from_ctr))
    assert ctcvr_norm > 0.01 * ctr_norm, (ctcvr_norm, ctr_norm)
    for got, a, b in zip(whole["ctr_tower"], from_ctr, from_ctcvr, strict=True):
        torch.testing.assert_close(got, a + b)


def reference_logit(a: float, b: float) -> float:
    """``logit(σ(a)·σ(b))`` in 60-digit decimals: exact where float64 rounds ``σ(30)`` to 1."""
    getcontext().prec = 60
    one = Decimal(1)
    p = one / (one + (-Decimal(a)).exp()) * (one / (one + (-Decimal(b)).exp()))
    return float((p / (one - p)).ln())


def test_ctcvr_logit_is_logit_of_the_product_at_every_scale() -> None:
    """Every pair of logits from -100 to 100: within 1e-5 of the exact value in float32, gradients finite. The naive
    ``logit(σ(a)σ(b))`` in float32 is infinite once both towers are sure (``σ(30)`` rounds to 1)."""
    values = [-100.0, -30.0, -8.0, -1.0, 0.0, 0.5, 3.0, 17.0, 30.0, 100.0]
    a, b = (t.reshape(-1) for t in torch.meshgrid(torch.tensor(values), torch.tensor(values), indexing="ij"))
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    got = product_logit(a, b)
    expected = torch.tensor([reference_logit(x, y) for x, y in zip(a.tolist(), b.tolist(), strict=True)])
    torch.testing.assert_close(got.detach(), expected, atol=1e-5, rtol=1e-6)
    got.sum().backward()
    assert a.grad is not None and b.grad is not None and torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()
    naive = torch.logit(torch.sigmoid(torch.tensor(30.0)) * torch.sigmoid(torch.tensor(30.0)))
    assert torch.isinf(naive) and product_logit(torch.tensor(30.0), torch.tensor(30.0)) == pytest.approx(30 - np.log(2), abs=1e-5)


# --- the selection-biased data ----------------------------------------------------------------------------------------


def test_biased_data_selects_clicks_on_conversion_and_its_truth_column_is_eval_only() -> None:
    """``data=synthetic_esmm``'s fields: the truth column is the conversion on clicked rows and a draw on every other;
    clicked rows would convert far more often than unclicked ones (the selection); the other labels are those of the
    same data without the column, and an ESMM trained on either is the same model (no task trains on the truth)."""
    biased = small(selection_bias=4.0, conversion_truth="cvr_if_clicked", batch_size=4096, num_train_rows=4096, num_eval_rows=4096)
    plain = small(selection_bias=4.0, batch_size=4096, num_train_rows=4096, num_eval_rows=4096)
    assert biased.features.label_names == ("ctr", "cvr", "cvr_if_clicked") and plain.features.label_names == ("ctr", "cvr")
    labels = next(iter(biased.train_batches(0, 0, 1))).labels
    torch.testing.assert_close(labels[:, :2], next(iter(plain.train_batches(0, 0, 1))).labels)
    click, conversion, truth = labels.unbind(1)
    assert torch.equal(conversion, click * truth)
    assert truth[click == 1].mean() > truth[click == 0].mean() + 0.3, (truth[click == 1].mean(), truth[click == 0].mean())

    small_biased, small_plain = small(selection_bias=4.0, conversion_truth="cvr_if_clicked"), small(selection_bias=4.0)
    models = [esmm(small_biased), esmm(small_plain)]
    assert [t.name for t in models[0].tasks] == ["ctr", "cvr", "ctcvr", "cvr_all"] and models[0].tasks[3].weight == 0
    assert models[0].tasks[3].train_metrics == ()
    for model, data in zip(models, (small_biased, small_plain), strict=True):
        wrapper = TrainWrapper(model, features=data.features)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for batch in data.train_batches(0, 0, 1):
            loss, _ = wrapper(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)


# --- learning: CVR over all impressions -------------------------------------------------------------------------------

LEARN = ["model=esmm", "data=synthetic_esmm", "data.batch_size=256", "data.num_train_rows=16384", "train.num_steps=128",
         "model.embedding_dim=8", "model.tower_layer_sizes=[32]", "tracking=none", "checkpoint=none", "train.log_every_steps=128"]
"""Two epochs of 64 batches of the selection-biased data (``selection_bias=4``): the conversions are few (about 1,200
clicked rows an epoch), as the paper's data sparsity."""
NAIVE = ["model.ctcvr_weight=0", "model.cvr_weight=1"]
"""The same towers with the CVR tower fitted on clicked rows only (``cvr`` masked by the click): the naive CVR model."""


def trained(make_cfg, *overrides: str) -> dict[str, float]:
    c = build(validate(make_cfg(*overrides)))
    try:
        with one_thread():
            return train(c.loop)
    finally:
        c.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_esmm_ranks_conversion_over_all_impressions_better_than_cvr_fitted_on_clicks(make_cfg, seed: int) -> None:
    """``eval/cvr_all/auc``: the CVR tower against whether each impression would convert if clicked. Measured (seed 0, 1):
    ESMM 0.738, 0.711; naive 0.666, 0.639 (docs/multitask.md)."""
    ours = trained(make_cfg, *LEARN, f"data.seed={seed}")
    naive = trained(make_cfg, *LEARN, *NAIVE, f"data.seed={seed}")
    assert ours["eval/cvr_all/auc"] > naive["eval/cvr_all/auc"] + 0.03, (ours, naive)
    assert ours["eval/ctr/auc"] > 0.7 and ours["eval/ctcvr/auc"] > 0.7, ours


# --- bad input --------------------------------------------------------------------------------------------------------

BAD = [
    (["data=synthetic_multitask", "data.tasks=[ctr]"],
     r"ESMM trains on a click label and a conversion label, but the data has no model.conversion_label='cvr'; its label\(s\): "
     r"\['ctr'\]\. Fix: .*data.labels=\{ctr: <click column>, cvr: <conversion column>\}"),
    (["data=synthetic_multitask", "model.click_label=click", "model.conversion_label=buy"],
     r"has no model.click_label='click' and no model.conversion_label='buy'"),
    (["model.ctcvr_weight=0"], r"model.ctcvr_weight=0 and model.cvr_weight=0: the CVR tower would get no gradient. Fix: "),
    (["model.cvr_weight=-1"], r"model.cvr_weight must be >= 0"),
    (["model.conversion_without_click=drop"], r"model.conversion_without_click='drop' must be one of \['error', 'and'\]"),
    (["model.conversion_label=ctr"], r"model.click_label and model.conversion_label are both 'ctr'"),
    (["model.embedding_dim=6"], r"model.embedding_dim=6 is not a multiple of 4"),
    (["data.selection_bias=2", "data.tasks=[ctr]"], r"data.selection_bias reads the funnel's first conversion, but data.tasks=\['ctr'\]"),
    (["data.conversion_truth=cvr", "data.tasks=[ctr,cvr]"], r"data.conversion_truth='cvr' is also a task of data.tasks"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[o[-1] for o, _ in BAD])
def test_bad_configs_name_the_key_and_the_fix(make_cfg, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        spec = validate(make_cfg("model=esmm", *overrides, "tracking=none"))
        spec.model.build(features=spec.data.for_model(spec.model.data_needs()).build().features, dense_device=CPU)


def test_a_conversion_without_a_click_stops_step_one_or_counts_as_not_converted() -> None:
    data = small()
    batch = next(iter(data.train_batches(0, 0, 1)))
    labels = batch.labels.clone()
    labels[:3] = torch.tensor([0.0, 1.0])  # three conversions without a click
    bad = Batch(dense_features=batch.dense_features, sparse_features=batch.sparse_features, labels=labels)
    tasks = TrainWrapper(esmm(data), features=data.features).tasks
    # checked on the host as the loop (training batch) or the evaluator (eval batch) reads the batch: train/batch_checks.py
    with pytest.raises(DataError, match=r"ESMM: 3 of this training batch's 8 rows have the conversion label 'cvr' positive where "
                                        r"the click 'ctr' is 0.* Fix the labels in the training data \(data\.path\).*"
                                        r"model.conversion_without_click=and"):
        check_batch_labels(tasks, bad.labels, "training batch")
    with pytest.raises(DataError, match=r"ESMM: 3 of this eval batch's 8 rows .* Fix the labels in the eval data \(data\.eval_path"):
        check_batch_labels(tasks, bad.labels, "eval batch")
    check_batch_labels(tasks, batch.labels, "training batch")  # the generated funnel: a conversion only after a click
    _, (_, _, targets) = TrainWrapper(esmm(data, conversion_without_click="and"), features=data.features)(bad)
    torch.testing.assert_close(targets[:, 2], labels[:, 0] * labels[:, 1])  # ctcvr: click AND conversion
    torch.testing.assert_close(targets[:, 1], labels[:, 1])  # cvr: the conversion (its loss and metrics see clicked rows)


@pytest.fixture(scope="module")
def click_csv(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A CSV of clicks and buys (a buy only after a click), text users, a price with gaps, multi-hot tags; rows to score."""
    root = tmp_path_factory.mktemp("esmm_csv")
    rng = np.random.default_rng(0)
    header = "click,buy,user,item,price,tags"
    users = [f"u{k}" for k in range(30)]
    rows = _click_rows(rng, 1500, users, two_labels=True)
    (root / "train.csv").write_text("\n".join([header, *rows]) + "\n")
    (root / "score.csv").write_text("\n".join([header, *_click_rows(rng, 100, [*users, "newcomer"], two_labels=True)]) + "\n")
    broken = [f"0,1,{r.split(',', 2)[2]}" if i % 50 == 7 else r for i, r in enumerate(rows)]  # a buy without a click, 1 in 50
    (root / "broken.csv").write_text("\n".join([header, *broken]) + "\n")
    data = ["data.batch_size=128", "data.labels={ctr: click, cvr: buy}", "data.label=null", "data=csv",
            "data.sparse=[{name: user}, {name: item}, {name: tags, separator: '|'}]", "data.dense=[{name: price}]", "model=esmm",
            "model.tower_layer_sizes=[32,16]", "distributed.device=cpu", "tracking=none"]
    return {"root": root, "data": data}


@pytest.mark.parametrize(("broken", "batch"), [("data.path", "training"), ("data.eval_path", "eval")])
def test_logged_data_with_a_buy_without_a_click_stops_at_step_one(click_csv: dict[str, Any], tmp_path: Path, broken: str,
                                                                   batch: str) -> None:
    """One row in 50 buys without a click: the first one read stops the run (``data.funnel``, which model=esmm sets),
    naming the file, its line and both columns, so no step completes; in the eval data, the first eval stops the run.
    Before, ESMM's batch check said only that some rows of "this training batch" broke the funnel."""
    files = {"data.path": f"{click_csv['root']}/train.csv", "data.eval_path": f"{click_csv['root']}/train.csv"}
    files[broken] = f"{click_csv['root']}/broken.csv"
    data = [*click_csv["data"], *(f"{k}={v}" for k, v in files.items()), "train.num_steps=1", "train.eval_max_batches=2",
            "checkpoint=none"]
    c = build(validate(compose_entry("config", *data)))
    try:
        with pytest.raises(DataError, match=rf"bad row in {click_csv['root']}/broken.csv, line 9, column 'buy': the label of task "
                                            rf"'cvr' is 1 where the label of task 'ctr' before it \(column 'click'\) is 0, but "
                                            rf"data.funnel=\['ctr', 'cvr'\]"):
            train(c.loop)
        assert c.loop.state.step == 0
    finally:
        c.close()


# --- resume -----------------------------------------------------------------------------------------------------------


def test_resumed_training_matches_uninterrupted(make_cfg, tmp_path: Path) -> None:
    """Stopped after step 3 and resumed, the run ends where the uninterrupted one does: every eval metric of every task
    (``ctcvr`` reads both towers, ``cvr`` the clicked rows, ``cvr_all`` every row) to 1e-6."""
    common = ["model=esmm", "data=synthetic_esmm", "data.num_eval_rows=512", "model.tower_layer_sizes=[32]", "optim/dense=adam",
              "train.num_steps=6", "tracking=none"]
    straight = trained(make_cfg, *common, f"checkpoint.dir={tmp_path}/a")
    sliced = [*common, f"checkpoint.dir={tmp_path}/b", "train.stop_after_steps=3"]
    with pytest.raises(Interrupted, match="after step 3"):
        run(make_cfg(*sliced))
    resumed = trained(make_cfg, *sliced)
    evals = {k: v for k, v in straight.items() if k.startswith("eval/")}
    assert {"eval/ctcvr/auc", "eval/cvr/auc", "eval/cvr_all/auc"} <= set(evals)
    assert {k: v for k, v in resumed.items() if k.startswith("eval/")} == pytest.approx(evals, abs=1e-6)


# --- the default data from the CLI; evaluate on 1 and 2 ranks ----------------------------------------------------------


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``python -m recsys_runner model=esmm`` with the tiny sizes only, in this process: the default data draws the click
    and the funnel's conversion. Its final eval, as the last checkpoint records it (``meta.json``)."""
    root = tmp_path_factory.mktemp("esmm_cli")
    args = [*TINY, "model=esmm", "tracking=none", f"checkpoint.dir={root}/ck"]
    out = run_in_process([sys.executable, "-m", "recsys_runner", *args, f"hydra.run.dir={root}/run"], root)
    assert out.returncode == 0, out.stderr[-4000:]
    meta = json.loads((root / "ck" / "step_00000030" / "meta.json").read_text())
    yield {"root": root, "final": meta["metrics"], "load": f"{root}/ck"}


EVAL_KEYS = ("eval/ctr/auc", "eval/cvr/auc", "eval/cvr/logloss", "eval/ctcvr/auc", "eval/ctcvr/logloss")


def test_trains_on_the_default_data_and_evaluates_its_checkpoint(default_run: dict[str, Any]) -> None:
    final = default_run["final"]
    assert final["eval/ctr/auc"] > 0.6 and final["eval/ctcvr/auc"] > 0.6 and final["eval/cvr/auc"] > 0.55, final
    assert "eval/cvr_all/auc" not in final  # the default data has no would-convert column
    evaluated = evaluate.run(compose_entry("evaluate", *TINY, "model=esmm", "tracking=none", f"load={default_run['load']}"))
    for key in EVAL_KEYS:
        assert evaluated[key] == pytest.approx(final[key], abs=1e-6), key


@pytest.mark.slow
def test_two_ranks_evaluate_like_one(default_run: dict[str, Any], mlflow_uri: str, tmp_path: Path) -> None:
    """torchrun, 2 gloo ranks, the tables split between them: each rank evaluates half the rows (its own number of
    clicked rows for the masked ``cvr``); the logged metrics equal one process's."""
    args = [*TINY, "model=esmm", "data.num_eval_rows=2048", f"load={default_run['load']}"]
    one = evaluate.run(compose_entry("evaluate", *args, "tracking=none"))
    out = torchrun(*args, "tracking=mlflow", f"tracking.uri={mlflow_uri}", "tracking.experiment=esmm_eval_2", f"hydra.run.dir={tmp_path}/run",
                   cwd=tmp_path, module="recsys_runner.evaluate")
    assert out.returncode == 0, out.stderr[-4000:]
    client = MlflowClient(tracking_uri=mlflow_uri)
    (logged,) = client.search_runs([client.get_experiment_by_name("esmm_eval_2").experiment_id])
    assert logged.data.tags["world_size"] == "2"
    for key in EVAL_KEYS:
        assert logged.data.metrics[key] == pytest.approx(one[key], abs=1e-5), key


# --- export: the served MLflow model scores like the trained one ------------------------------------------------------


def test_the_served_mlflow_model_scores_like_the_trained_model(click_csv: dict[str, Any], tmp_path: Path) -> None:
    """Trained on logged clicks and buys, exported; the MLflow pyfunc returns one score column per task, each equal to
    what ``predict`` writes from the checkpoint."""
    data = [*click_csv["data"], f"data.path={click_csv['root']}/train.csv"]
    trained_model = _trained(tmp_path, data, 8)
    reference = _scores(data, trained_model["checkpoint"], click_csv["root"] / "score.csv", tmp_path / "predicted")
    served = mlflow.pyfunc.load_model(str(trained_model["model"])).predict(pd.read_csv(click_csv["root"] / "score.csv", dtype=str))
    assert list(served.columns) == ["score_ctr", "score_cvr", "score_ctcvr"] == [c for c in reference.columns if c.startswith("score")]
    for column in served.columns:
        np.testing.assert_allclose(served[column].to_numpy(), reference[column].to_numpy(), atol=ATOL)
    np.testing.assert_allclose(served["score_ctcvr"], served["score_ctr"] * served["score_cvr"], rtol=1e-4, atol=1e-7)
