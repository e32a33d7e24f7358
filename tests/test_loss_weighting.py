"""Multi-task training: task definitions (label, kind, mask, sample weight), loss weighting (fixed, uncertainty,
Pareto) with its MLflow keys and checkpoint state, selection by a weighted sum of task metrics, and their errors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.__main__ import run
from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.data.memory import InMemoryData
from recsys_runner.errors import ConfigError
from recsys_runner.models.train_wrapper import TrainWrapper
from recsys_runner.tasks import BinaryTask, HuberTask
from recsys_runner.train.loop import train
from recsys_runner.train.signals import Interrupted
from recsys_runner.train.weighting import LossWeightingConfig, ParetoWeighting, UncertaintyWeighting, min_norm_weights
from tests.conftest import TINY, FixedHeads, torchrun
from tests.rank_jobs import jobs
from tests.rank_weighting import record_steps

MULTITASK = ["model=mmoe", "data=synthetic_multitask", "model.num_experts=2", "model.expert_layer_sizes=[16]",
             "model.tower_layer_sizes=[8]", "model.embedding_dim=8"]


def train_run(cfg: DictConfig, tracked: bool = True) -> tuple[dict[str, float], nn.Module, list[dict[str, torch.Tensor]]]:
    """Train as the CLI does (an MLflow run when ``tracked``); the final eval metrics, the TrainWrapper's weighting and
    its state at each training step (:func:`~tests.rank_weighting.record_steps`)."""
    c = build(validate(cfg))
    try:
        weighting = c.loop.stepper.weighting
        assert weighting is not None
        steps = record_steps(weighting)
        if tracked:
            c.loop.tracker.start(run_name="test", tags={}, params={})
        final = train(c.loop)
        if tracked:
            c.loop.tracker.finish("FINISHED")
        return final, weighting, steps
    finally:
        c.close()


def history(uri: str, experiment: str, key: str) -> dict[int, float]:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    (mlrun,) = client.search_runs([exp.experiment_id])
    return {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, key)}


# -- the min-norm solver ------------------------------------------------------------------------------------------------
def test_min_norm_weights_match_the_closed_form_and_a_grid() -> None:
    g = torch.tensor([[1.0, 0.0], [0.2, 0.5]])
    gram = g @ g.t()
    alpha = min_norm_weights(gram, torch.zeros(2))
    a = float(((g[1] - g[0]) @ g[1]) / ((g[0] - g[1]) @ (g[0] - g[1])))  # Sener & Koltun's two-task closed form
    assert alpha.tolist() == pytest.approx([a, 1 - a], abs=1e-5)
    floored = min_norm_weights(gram, torch.tensor([0.45, 0.0]))
    assert floored.tolist() == pytest.approx([0.45, 0.55], abs=1e-5)  # the optimum (a < 0.45) moved onto the floor
    g3 = torch.tensor([[1.0, 0.1, 0.0], [-0.3, 1.0, 0.2], [0.1, -0.4, 0.8]])
    gram3 = g3 @ g3.t()
    floors = torch.tensor([0.1, 0.05, 0.0])
    solved = min_norm_weights(gram3, floors, iterations=200)
    grid = torch.stack(torch.meshgrid(torch.linspace(0, 1, 201), torch.linspace(0, 1, 201), indexing="ij"), -1).reshape(-1, 2)
    grid = grid[grid.sum(1) <= 1]
    u = torch.cat([grid, 1 - grid.sum(1, keepdim=True)], 1)
    candidates = floors + (1 - floors.sum()) * u
    best = ((candidates @ gram3) * candidates).sum(1).min()
    assert float(solved @ gram3 @ solved) <= float(best) + 1e-4
    assert bool((solved >= floors - 1e-6).all()) and float(solved.sum()) == pytest.approx(1.0)


# -- task definitions -----------------------------------------------------------------------------------------------------


def test_mask_sample_weight_and_huber_losses() -> None:
    ctr, cvr, amount = torch.tensor([0.0, 1.0, -1.0]), torch.tensor([0.5, -0.5, 2.0]), torch.tensor([0.0, 3.0, 1.0])
    labels = torch.tensor([[1.0, 1.0, 0.5, 2.0], [0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 4.0, 0.0]])  # ctr, cvr, amount, row weight
    tasks = (BinaryTask("ctr", column=0, weight_column=3), BinaryTask("cvr", column=1, mask_column=0),
             HuberTask("amount", column=2, delta=1.0))
    wrapper = TrainWrapper(FixedHeads(tasks, {"ctr": ctr, "cvr": cvr, "amount": amount}))
    loss, _ = wrapper(Batch(dense_features=torch.zeros(3, 1), sparse_features=None, labels=labels))  # type: ignore[arg-type]
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    ctr_rows = bce(ctr, labels[:, 0], reduction="none")
    ctr_loss = (ctr_rows * labels[:, 3]).sum() / labels[:, 3].sum()
    cvr_loss = bce(cvr[[0, 2]], labels[[0, 2], 1])  # clicked rows only
    huber = torch.tensor([0.5 * 0.25, 3.0 - 0.5, 3.0 - 0.5]).mean()  # |d| = 0.5, 3, 3
    assert float(loss) == pytest.approx(float(ctr_loss + cvr_loss + huber), rel=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+model.task_specs.cvr.only_where_positive=click"],
         r"model.task_specs.cvr.only_where_positive='click' must name another task of model.tasks=\['ctr', 'cvr'\]"),
        (["+model.task_specs.ltv.weight=1.0"], r"model.task_specs names \['ltv'\], which are not tasks"),
        (["model.loss_weights=[1.0,-0.5]"], r"model.loss_weights=\[1.0, -0.5\] must be >= 0 and not all 0"),
        (["+model.task_specs.cvr.weight=-0.5"], r"task weights must be >= 0 .* got cvr=-0.5"),
        (["model.loss_weights=[0.0,0.0]"], r"model.loss_weights=\[0.0, 0.0\] must be >= 0 and not all 0"),
        (["+model.task_specs.ctr.weight=0", "+model.task_specs.cvr.weight=0"], r"task weights are all 0"),
        (["+model.task_specs.cvr.label=buy"], r"model.task_specs.cvr.label='buy' is not a label column of the data; its label columns: \['ctr', 'cvr'\]"),
        (["+model.task_specs.ctr.sample_weight=w"], r"model.task_specs.ctr.sample_weight='w' is not a column of the data"),
        (["+model.task_specs.cvr.kind=ordinal"], r"model.task_specs.cvr.kind has \['ordinal'\]"),
        (["train.loss_weighting.kind=pareto", "train.loss_weighting.min_weight=0.6"],
         r"train.loss_weighting.min_weight\(s\) ctr=0.6, cvr=0.6 above 1/num_tasks=0.5"),
        (["train.loss_weighting.kind=pareto", "+train.loss_weighting.min_weights.ltv=0.1"],
         r"train.loss_weighting.min_weights names \['ltv'\], which are not tasks"),
        (["train.loss_weighting.kind=pareto", "model.loss_weights=[1.0,2.0]"], r"kind=pareto chooses the task weights itself"),
        (["train.loss_weighting.kind=magic"], r"train.loss_weighting.kind='magic' must be one of \['fixed', 'uncertainty', 'pareto'\]"),
        (["+metrics.selection={eval/ctr/auc: 0.5, eval/ltv/auc: 0.5}"],
         r"metrics.selection names 'eval/ltv/auc', which this run does not log \(its tasks: \['ctr', 'cvr'\]\)"),
        (["+metrics.selection={eval/ctr/auc: -1.0}"], r"metrics.selection weights must be >= 0"),
    ],
)
def test_bad_multitask_configs_name_the_key_before_step_one(make_cfg, overrides: list[str], message: str) -> None:
    cfg = make_cfg(*MULTITASK, *overrides, "tracking=none")
    with pytest.raises(ConfigError, match=message):
        build(validate(cfg)).close()


def test_pareto_needs_a_declared_shared_representation(make_cfg) -> None:
    cfg = make_cfg("model=deepfm", "data=synthetic", "train.loss_weighting.kind=uncertainty", "tracking=none")
    with pytest.raises(ConfigError, match=r"weights the losses of several tasks, but DeepFM has one"):
        build(validate(cfg)).close()
    tasks = (BinaryTask("a", column=0), BinaryTask("b", column=1))
    weighting = LossWeightingConfig(kind="pareto").build(tasks)
    with pytest.raises(ConfigError, match=r"FixedHeads declares none \(a class attribute shared_module"):
        TrainWrapper(FixedHeads(tasks, {}), weighting=weighting)


# -- weighting in training: logged, learned, checkpointed -----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["uncertainty", "pareto"])
def test_weighting_trains_and_logs_each_task_weight_and_loss(make_cfg, mlflow_uri: str, kind: str) -> None:
    cfg = make_cfg(*MULTITASK, f"train.loss_weighting.kind={kind}", "data.conversion_bias=-3")
    final, weighting, steps = train_run(cfg)
    assert final["eval/ctr/auc"] > 0.55 and final["eval/cvr/auc"] > 0.55, final
    for task in ("ctr", "cvr"):
        losses = history(mlflow_uri, cfg.tracking.experiment, f"train/loss/{task}")
        weights = history(mlflow_uri, cfg.tracking.experiment, f"train/weight/{task}")
        assert sorted(losses) == sorted(weights) == [10, 20, 30] and all(v > 0 for v in losses.values())
    w = history(mlflow_uri, cfg.tracking.experiment, "train/weight/cvr")[30]
    if kind == "uncertainty":
        assert isinstance(weighting, UncertaintyWeighting)
        assert w == pytest.approx(float(torch.exp(-weighting.log_variance.detach()[1])), rel=1e-5)
        s, losses = torch.stack([x["log_variance"] for x in steps]), torch.stack([x["losses"] for x in steps])
        assert s.shape == (30, 2) and torch.allclose(s[0], losses[0].log())  # set at step 1 from the first losses
        # trained by the dense optimizer (Adagrad: each update against its gradient's sign) after step 1, where the
        # gradient w·(1 - exp(-s)·L) of the loss w·(exp(-s)·L + s) is 0 but for rounding; the losses fall, so s falls
        gradient = 1 - torch.exp(-s[1:-1]) * losses[1:-1]
        moves = s[2:] - s[1:-1]
        clear = gradient.abs() > 1e-3
        assert int(clear.sum()) > 40 and bool((moves[clear].sign() == -gradient[clear].sign()).all()), (moves, gradient)
        assert bool((s[-1] < s[1] - 0.1).all()), s
    else:
        assert isinstance(weighting, ParetoWeighting) and weighting.count == 30
        assert w > 1.0, "the rare task (smaller loss and gradient) gets the larger share"
        assert w == pytest.approx(2 * float(weighting.alpha[1]), rel=1e-5)


def test_pareto_with_accumulation_and_bf16_solves_once_per_optimizer_step(make_cfg) -> None:
    cfg = make_cfg(*MULTITASK, "train.loss_weighting.kind=pareto", "train.grad_accum_steps=2", "precision=bf16",
                   "train.num_steps=6", "data.conversion_bias=-3", "tracking=none", "checkpoint=none")
    c = build(validate(cfg))
    try:
        weighting = c.loop.stepper.weighting
        assert isinstance(weighting, ParetoWeighting) and weighting.every_n_steps == 2  # forwards between solves
        solves = []
        solve = weighting._solve
        weighting._solve = lambda *args: (solves.append(weighting.count), solve(*args))[1]  # type: ignore[method-assign]
        final = train(c.loop)
    finally:
        c.close()
    assert solves == [0, 2, 4, 6, 8, 10], "a solve at each optimizer step's first micro-batch"
    assert torch.isfinite(weighting.task_weights).all() and float(weighting.task_weights[1]) > 1.0
    assert all(v == v for v in final.values())


@pytest.mark.parametrize("kind", ["uncertainty", "pareto"])
def test_resume_keeps_the_weighting_state(make_cfg, mlflow_uri: str, tmp_path: Path, kind: str) -> None:
    common = [*MULTITASK, f"train.loss_weighting.kind={kind}", "train.loss_weighting.every_n_steps=3", "train.num_steps=12",
              "train.log_every_steps=1", "optim/dense=adam", "optim.dense.lr=0.003"]
    straight = make_cfg(*common, f"checkpoint.dir={tmp_path}/a", f"tracking.experiment=straight_{kind}")
    run(straight)
    sliced = make_cfg(*common, f"checkpoint.dir={tmp_path}/b", f"tracking.experiment=sliced_{kind}", "train.stop_after_steps=7")
    with pytest.raises(Interrupted, match="after step 7"):
        run(sliced)
    run(sliced)  # resumes at 7: the Pareto solves stay on steps 1, 4, 7, 10 only if the counter was restored
    for key in ("train/weight/ctr", "train/weight/cvr", "train/loss/cvr"):
        a, b = history(mlflow_uri, f"straight_{kind}", key), history(mlflow_uri, f"sliced_{kind}", key)
        assert sorted(b) == list(range(1, 13))
        for step in range(1, 13):
            assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-6), f"{key} step {step}: {b[step]} vs {a[step]}"
        if key.startswith("train/weight/"):  # they move on both sides of the resume: a frozen weighting would match too
            assert a[7] != pytest.approx(a[1], abs=1e-3) and a[12] != pytest.approx(a[7], abs=1e-3), (key, a)


def union(a: Batch, b: Batch) -> Batch:
    """One batch of ``a``'s rows then ``b``'s: what two ranks holding ``a`` and ``b`` train on together."""
    ka, kb = a.sparse_features, b.sparse_features
    keys = ka.keys()
    values = torch.cat([torch.cat([ka[k].values(), kb[k].values()]) for k in keys])
    lengths = torch.cat([torch.cat([ka[k].lengths(), kb[k].lengths()]) for k in keys])
    return Batch(dense_features=torch.cat([a.dense_features, b.dense_features]), labels=torch.cat([a.labels, b.labels]),
                 sparse_features=KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths))


def first_step_on_the_union(cfg: DictConfig) -> dict[str, torch.Tensor]:
    """One process, one step on the union of the first batches 2 ranks train on: the weighting that step trained with."""
    c = build(validate(cfg))
    try:
        data = c.loop.data
        first = union(next(iter(data.train_batches(0, 0, 2))), next(iter(data.train_batches(0, 1, 2))))
        both = InMemoryData(data.features, [first], [first])
        weighting = c.loop.stepper.weighting
        assert weighting is not None
        steps = record_steps(weighting)
        train(replace(c.loop, data=both, evaluator=replace(c.loop.evaluator, data=both), total_steps=1))
    finally:
        c.close()
    return steps[0]


@pytest.mark.slow
def test_weightings_train_on_two_ranks(make_cfg, tmp_path: Path) -> None:
    """2-rank gloo runs (both kinds' jobs in one launch, :mod:`tests.rank_jobs`): the Pareto Gram matrix and uncertainty's
    first losses are all-reduced inside the forward, so both ranks train with the same weights at every step, and the
    first step's are those of one process on the union of the ranks' batches. The tables are replicated (``data_parallel``), so that both ranks and the one process draw the same
    initial rows: shards drawn per rank start another model (step-1 Pareto shares 0.5522 against 0.5545). Measured
    gaps to the one process: 2e-7; with each rank solving its own Gram matrix, 0.0026 in the shares; with each rank's
    own first losses, 0.0055 in the log-variances."""
    kinds = ("pareto", "uncertainty")
    common = [*MULTITASK, *TINY, "train.num_steps=6", "tracking=none", "checkpoint=none", "distributed.sharding_types=[data_parallel]"]
    for kind in kinds:
        (tmp_path / kind).mkdir()
    env = jobs(*[(tmp_path / kind, {}, [f"train.loss_weighting.kind={kind}", f"hydra.run.dir={tmp_path}/{kind}/run"]) for kind in kinds])
    out = torchrun(*common, cwd=tmp_path, module="tests.rank_weighting", env=env)  # both kinds' jobs in one launch
    assert out.returncode == 0, out.stderr[-3000:]
    assert (out.stdout + out.stderr).count("eval/ctr/auc=") >= 2, (out.stdout + out.stderr)[-3000:]  # each job's final eval
    for kind in kinds:
        args = [*common, f"train.loss_weighting.kind={kind}"]
        ranks = [torch.load(tmp_path / kind / f"weighting_rank{r}.pt") for r in range(2)]
        assert len(ranks[0]["steps"]) == len(ranks[1]["steps"]) == 6
        for key in set(ranks[0]["steps"][0]) - {"losses"}:  # each rank's own losses differ; what they train with may not
            for step, (a, b) in enumerate(zip(ranks[0]["steps"], ranks[1]["steps"], strict=True), start=1):
                assert torch.equal(a[key], b[key]), f"{kind} {key} at step {step}: rank 0 {a[key]}, rank 1 {b[key]}"
            assert torch.equal(ranks[0][key], ranks[1][key]), f"{kind} {key} after training: {ranks[0][key]}, {ranks[1][key]}"
        one = first_step_on_the_union(make_cfg(*args))
        for key in ("alpha", "log_variance", "weights"):
            if key in one:
                assert ranks[0]["steps"][0][key].tolist() == pytest.approx(one[key].tolist(), abs=1e-5), (kind, key, ranks[0]["steps"][0], one)


def test_selection_by_a_weighted_sum_of_task_metrics(make_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    cfg = make_cfg(*MULTITASK, "+metrics.selection={eval/ctr/auc: 0.5, eval/cvr/logloss: 1.0}", "checkpoint.best_metric=eval/selection",
                   "train.early_stopping.metric=eval/selection", "train.early_stopping.patience=5", "train.objective=eval/selection",
                   "train.eval_every_steps=10", "train.eval_max_batches=4", f"checkpoint.dir={tmp_path}")
    final, _, _ = train_run(cfg)
    assert final["eval/selection"] == pytest.approx(0.5 * final["eval/ctr/auc"] - final["eval/cvr/logloss"])
    logged = history(mlflow_uri, cfg.tracking.experiment, "eval/selection")
    assert sorted(logged) == [10, 20, 30]
    best = history(mlflow_uri, cfg.tracking.experiment, "best/eval/selection")
    assert max(best.values()) == pytest.approx(max(logged.values()))  # higher is better: logloss entered negated


# -- the seesaw: equal fixed weights lose the click; uncertainty and Pareto keep both tasks ------------------------------
SEESAW = ["model=mmoe", "data=synthetic", "data.tasks=[ctr,gmv]", "data.label_kinds={gmv: regression}", "data.conversion_amount=10",
          "data.conversion_bias=-1", "data.conversion_conflict=0.5", "model.tasks=[ctr,gmv]", "model.task_kinds=[binary,regression]",
          "+model.task_specs.gmv.eval_metrics=[auc,mse]", "optim=adagrad", "optim.lr=0.1", "data.batch_size=512",
          "data.num_embeddings=1000", "data.num_train_rows=1048576", "data.num_eval_rows=32768", "train.num_steps=250",
          "train.log_every_steps=100", "checkpoint=none", "tracking=none"]
"""A click and a purchase amount (``gmv``: 10·(1 + softplus) on the ~11 % of rows that convert, else 0): the amount's MSE
(~45) dwarfs the click's log loss (~0.6), so with equal fixed weights the amount's gradients run the shared experts and
embeddings and the click's AUC falls; the amount's ``auc`` ranks the converting rows (docs/multitask.md). With 32768 eval rows
and 250 steps the click's AUC below its single-task best was, for seeds 0 / 1: fixed 0.073 / 0.039, uncertainty 0.003 /
0.003, Pareto 0.003 / 0.003 (the amount's never more than -0.001): both sides of TOLERANCE with room, so one seed is run.
(At 400 steps: fixed 0.075 / 0.044, uncertainty 0.002 / 0.002, Pareto -0.001 / 0.002; 250 keep the separation and cut
the test's five trainings by ~40 %.)"""
WEIGHTINGS = {"fixed": [], "uncertainty": ["train.loss_weighting.kind=uncertainty"],
              "pareto": ["train.loss_weighting.kind=pareto", "train.loss_weighting.normalization=l2"]}
"""Uncertainty as configured by default (log-variances from the first losses); Pareto on unit-norm task gradients
(without normalization it gives the click, the smaller gradient, nearly all the weight)."""
TOLERANCE = 0.01


def _aucs(make_cfg, *overrides: str) -> dict[str, float]:
    c = build(validate(make_cfg(*SEESAW, *overrides, tiny=False)))
    try:
        final = train(c.loop)
    finally:
        c.close()
    return {t: final[f"eval/{t}/auc"] for t in ("ctr", "gmv")}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0])  # seed 1 separates as well (SEESAW's docstring); one seed keeps the suite's time
def test_seesaw_uncertainty_and_pareto_keep_both_tasks_near_their_single_task_best(make_cfg, seed: int) -> None:
    seeds = [f"seed={seed}", f"data.seed={seed}"]
    best = {"ctr": _aucs(make_cfg, *seeds, "model.loss_weights=[1.0,0.0]")["ctr"],
            "gmv": _aucs(make_cfg, *seeds, "model.loss_weights=[0.0,1.0]")["gmv"]}
    gaps = {}
    for kind, overrides in WEIGHTINGS.items():
        aucs = _aucs(make_cfg, *seeds, *overrides)
        gaps[kind] = {t: round(best[t] - aucs[t], 4) for t in best}
    print(f"seed {seed}: single-task best {best}; AUC below it: {gaps}")
    assert max(gaps["fixed"].values()) > TOLERANCE, f"fixed equal weights should lose a task by more than {TOLERANCE}: {gaps}"
    for kind in ("uncertainty", "pareto"):
        assert max(gaps[kind].values()) <= TOLERANCE, f"{kind} should keep both tasks within {TOLERANCE} AUC: {gaps}"


def test_a_reader_of_weights_ignores_the_loss_weighting_state(tmp_path: Path) -> None:
    """export builds the model without the TrainWrapper: the checkpoint's ``model/weighting.*`` is not another model's."""
    from recsys_runner.checkpoint.weights import _refuse_mismatch
    from recsys_runner.errors import CheckpointError

    wanted = {"model/model.tower.weight": torch.zeros(2, 3)}
    _refuse_mismatch(tmp_path, {"model/model.tower.weight": [2, 3], "model/weighting.log_variance": [2],
                                "model/weighting.alpha": [2]}, wanted)
    with pytest.raises(CheckpointError, match=r"has \['model/model.other.weight'\] this model does not"):
        _refuse_mismatch(tmp_path, {"model/model.tower.weight": [2, 3], "model/model.other.weight": [4]}, wanted)
