"""PLE and DBMTL: output shapes, the structure that makes each what it is (PLE with one level and no task experts is
MMoE; a task's last-level experts serve it alone; DBMTL's cvr reads the ctr tower, never the reverse), their tower
order and config errors, training and evaluation on the default data from the CLI, on 2 ranks, and export."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from torch import nn

from recsys_runner import evaluate
from recsys_runner.__main__ import run
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.generated.synthetic import SyntheticData
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.errors import ConfigError
from recsys_runner.models.common import materialize
from recsys_runner.models.dbmtl import DBMTLConfig, dependency_order, task_dependencies
from recsys_runner.models.mmoe import MMoEConfig
from recsys_runner.models.ple import PLEConfig
from tests.conftest import TINY, run_in_process, torchrun
from tests.rank_jobs import jobs
from tests.test_evaluate import compose_entry
from tests.test_export import check_export, export_cfg  # noqa: F401 - a fixture
from tests.test_models import CPU, small_data

DATA = small_data("ple")
"""Eight-row batches with a ``ctr`` and a ``cvr`` label, 3 dense and 4 sparse features (tables of 50 rows)."""
BATCH = next(iter(DATA.train_batches(0, 0, 1)))


def built(config: PLEConfig | DBMTLConfig | MMoEConfig, seed: int = 0) -> nn.Module:
    """The model of ``config`` on :data:`DATA`, its tables materialized on CPU, initialized from ``seed``."""
    torch.manual_seed(seed)
    return materialize(config.build(features=DATA.features, dense_device=CPU))


def outputs(model: nn.Module) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return model(BATCH.dense_features, BATCH.sparse_features)


def ple(**values: object) -> PLEConfig:
    return make(PLEConfig, **{"embedding_dim": 8, "expert_layer_sizes": [16], "tower_layer_sizes": [8], **values})


def dbmtl(**values: object) -> DBMTLConfig:
    return make(DBMTLConfig, **{"embedding_dim": 8, "bottom_layer_sizes": [16], "tower_layer_sizes": [12],
                                "relation_layer_sizes": [8], **values})


@pytest.mark.parametrize("config", [
    ple(), ple(num_levels=1), ple(num_levels=3, num_shared_experts=2, num_task_experts=0), ple(num_task_experts=3),
    dbmtl(), dbmtl(relations={}), dbmtl(bottom_layer_sizes=[], num_experts=3, expert_layer_sizes=[16]),
    dbmtl(tasks=["cvr", "ctr"], relations={"cvr": "ctr"}),
], ids=["ple", "ple-1-level", "ple-3-levels-mmoe-like", "ple-3-task-experts", "dbmtl", "dbmtl-no-relations",
        "dbmtl-mmoe-no-bottom", "dbmtl-dependent-first"])
def test_every_variant_gives_a_logit_per_task_and_trains_every_parameter(config: PLEConfig | DBMTLConfig) -> None:
    model = built(config)
    kept: list[torch.Tensor] = []
    model.get_submodule(type(model).shared_module).register_forward_hook(lambda _m, _i, out: kept.append(out))
    out = model(BATCH.dense_features, BATCH.sparse_features)
    assert list(out) == list(config.tasks) == [t.name for t in model.tasks]
    assert all(v.shape == (8,) and torch.isfinite(v).all() for v in out.values())
    (shared,) = kept  # the representation every task reads: each task's logits have a gradient on it
    assert shared.shape[0] == 8
    assert all(torch.autograd.grad(v.sum(), shared, retain_graph=True)[0].abs().sum() > 0 for v in out.values())
    sum(v.sum() for v in out.values()).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()] == []


def test_ple_with_one_level_and_no_task_experts_is_mmoe() -> None:
    mmoe = built(make(MMoEConfig, embedding_dim=8, num_experts=3, expert_layer_sizes=[16, 8], tower_layer_sizes=[8]))
    model = built(ple(num_levels=1, num_shared_experts=3, num_task_experts=0, expert_layer_sizes=[16, 8]), seed=1)
    renamed = {k.replace("experts.", "last_level.shared_experts.", 1) if k.startswith("experts.") else
               k.replace("gates.ctr.", "last_level.task_gates.0.").replace("gates.cvr.", "last_level.task_gates.1."): v
               for k, v in mmoe.state_dict().items()}
    model.load_state_dict(renamed)  # strict: the same parameters under other names
    ple_out, mmoe_out = outputs(model), outputs(mmoe)
    for task in ("ctr", "cvr"):
        torch.testing.assert_close(ple_out[task], mmoe_out[task])
    assert len(model.levels) == 0 and model.last_level.shared_gate is None  # one level is the last: no shared gate


def test_ple_last_level_task_experts_serve_their_task_alone() -> None:
    model = built(ple(num_levels=2, num_shared_experts=2, num_task_experts=2))
    before = outputs(model)

    def perturbed(level: int) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for p in [*model.levels, model.last_level][level].task_experts[0].parameters():  # ctr's experts
                p.add_(0.5)
        return outputs(model)

    last = perturbed(-1)
    assert not torch.allclose(last["ctr"], before["ctr"]) and torch.equal(last["cvr"], before["cvr"])
    first = perturbed(0)  # the first level's shared gate mixes ctr's experts into what cvr's last gate reads
    assert not torch.allclose(first["cvr"], last["cvr"])


def test_dbmtl_cvr_reads_the_ctr_tower_and_ctr_never_reads_cvr() -> None:
    model = built(dbmtl(relations={"cvr": ["ctr"]}))
    assert model.order == ["ctr", "cvr"] and sorted(model.relation_mlps) == ["cvr"]
    assert model.relation_mlps["cvr"]._mlp[0]._linear.in_features == 12 + 12  # its own tower's output and ctr's
    before = outputs(model)
    with torch.no_grad():
        for p in model.towers["cvr"].parameters():
            p.add_(0.5)
    after_cvr = outputs(model)
    assert torch.equal(after_cvr["ctr"], before["ctr"]) and not torch.allclose(after_cvr["cvr"], before["cvr"])
    with torch.no_grad():
        for p in model.towers["ctr"].parameters():
            p.add_(0.5)
    after_ctr = outputs(model)
    assert not torch.allclose(after_ctr["ctr"], after_cvr["ctr"]) and not torch.allclose(after_ctr["cvr"], after_cvr["cvr"])


def test_dbmtl_chains_its_relations_through_the_dependency_order(make_cfg) -> None:
    other_tasks = validate(make_cfg("model=dbmtl", "model.tasks=[ctr,watch]", "tracking=none")).model
    assert task_dependencies(other_tasks.tasks, other_tasks.relations) == {"ctr": [], "watch": ["ctr"]}  # null follows the tasks
    tasks = ["ltv", "cvr", "ctr"]
    assert task_dependencies(tasks, None) == {"ltv": [], "cvr": ["ltv"], "ctr": ["cvr"]}  # null: each on the one before
    deps = task_dependencies(tasks, {"ltv": ["ctr", "cvr"], "cvr": "ctr"})
    assert deps == {"ltv": ["ctr", "cvr"], "cvr": ["ctr"], "ctr": []}
    assert dependency_order(tasks, deps) == ["ctr", "cvr", "ltv"]
    assert dependency_order(tasks, task_dependencies(tasks, {})) == tasks
    data = SyntheticData(make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50, tasks=tasks))
    model = dbmtl(tasks=tasks, relations={"ltv": ["ctr", "cvr"], "cvr": ["ctr"]}).build(features=data.features, dense_device=CPU)
    assert model.order == ["ctr", "cvr", "ltv"] and list(model.heads) == tasks
    # ltv's relation MLP reads its own tower (12 wide) and the hidden vectors of ctr (its tower: 12) and cvr (its relation MLP: 8)
    assert model.relation_mlps["ltv"]._mlp[0]._linear.in_features == 12 + 12 + 8


@pytest.mark.parametrize(("overrides", "message"), [
    (["model=dbmtl", "model.relations={cvr: [click]}"],
     r"model.relations=\{'cvr': \['click'\]\} names task\(s\) \['click'\] that are not in model.tasks=\['ctr', 'cvr'\]. "
     r"Fix: relate tasks of model.tasks, e.g. model.relations=\{cvr: \[ctr\]\}"),
    (["model=dbmtl", "model.relations={cvr: [ctr], ctr: [cvr]}"],
     r"model.relations has a cycle: ctr -> cvr -> ctr \(each depends on the next\).* Fix: drop one of these dependencies"),
    (["model=dbmtl", "model.tasks=[a,b,c]", "model.relations={a: [c], b: [a], c: [b]}"], r"model.relations has a cycle: a -> c -> b -> a"),
    (["model=dbmtl", "model.relations={cvr: [ctr, cvr]}"], r"model.relations: task 'cvr' depends on itself. Fix: remove 'cvr' from model.relations.cvr"),
    (["model=dbmtl", "model.relations=[ctr]"], r"model.relations=\['ctr'\] must map a task to the tasks it depends on"),
    (["model=dbmtl", "model.relations={cvr: [ctr, ctr]}"], r"model.relations.cvr=\['ctr', 'ctr'\] names a task twice"),
    (["model=dbmtl", "model.num_experts=-1"], r"model.num_experts must be 0 \(no expert layer\) or more"),
    (["model=dbmtl", "model.bottom_layer_sizes=[64,0]"], r"model.bottom_layer_sizes=\[64, 0\] has a non-positive layer size"),
    (["model=dbmtl", "model.relation_layer_sizes=[]"], "model.relation_layer_sizes must list at least one layer size"),
    (["model=ple", "model.num_levels=0"], "model.num_levels must be at least 1, got 0"),
    (["model=ple", "model.num_shared_experts=0"],
     r"model.num_shared_experts=0: every PLE level needs at least one shared expert .* Fix: model.num_shared_experts=1 or more"),
    (["model=ple", "model.num_task_experts=-1"], "model.num_task_experts must be 0 or more, got -1"),
    (["model=ple", "model.expert_layer_sizes=[]"], "model.expert_layer_sizes must list at least one layer size"),
    (["model=ple", "model.embedding_dim=6"], r"model.embedding_dim=6 is not a multiple of 4"),
    (["model=ple", "model.tasks=[ctr,ltv]", "data=synthetic_multitask"],
     r"model.tasks=\['ctr', 'ltv'\]: task\(s\) \['ltv'\] have no label column"),
])
def test_bad_configs_say_what_to_fix(make_cfg, overrides: list[str], message: str) -> None:
    cfg = make_cfg(*overrides, "tracking=none")
    with pytest.raises(ConfigError, match=message):
        spec = validate(cfg)
        spec.model.build(features=spec.data.for_model(spec.model.data_needs()).build().features, dense_device=CPU)


@pytest.mark.parametrize("model", ["ple", "dbmtl"])
def test_taobao_preset_composes_as_torcheasyrec_configures_it_and_trains(make_cfg, tmp_path: Path, model: str) -> None:
    small = ["train.num_epochs=null", "train.num_steps=3", "train.log_every_steps=3", "train.eval_every_steps=null", "train.eval_max_batches=2",
             "data.batch_size=256", "data.num_train_rows=4096", "data.num_eval_rows=1024", "distributed.device=cpu", f"checkpoint.dir={tmp_path}"]
    preset = validate(make_cfg(f"experiment={model}_taobao", tiny=False))
    assert preset.checkpoint.best_metric == "eval/ctr/auc" and preset.train.num_epochs == 1 and preset.data.tasks == ["ctr", "cvr"]
    built = preset.model.build(features=preset.data.build().features, dense_device=CPU)
    if model == "ple":
        assert len(built.levels) == 2 and len(built.last_level.shared_experts.experts) == 3
    else:
        assert built.dependencies == {"ctr": [], "cvr": ["ctr"]} and built.bottom._mlp[0]._linear.out_features == 512
    assert math.isfinite(run(make_cfg(f"experiment={model}_taobao", *small, tiny=False)))


def final_metrics(uri: str, experiment: str) -> dict[str, float]:
    client = MlflowClient(tracking_uri=uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {**mlrun.data.metrics, "world_size": float(mlrun.data.tags["world_size"])}


@pytest.mark.parametrize("model", ["ple", "dbmtl"])
def test_trains_on_the_default_data_from_the_cli_and_evaluates_its_checkpoint(mlflow_uri: str, tmp_path: Path, model: str) -> None:
    """``python -m recsys_runner model=<model>`` with nothing else but the tiny sizes: the default data draws a label per
    task; both tasks learn, and evaluating the checkpoint reproduces the final eval. The command runs in this process as
    ``python -m`` runs it (:func:`tests.conftest.run_in_process`), without ~10 s of imports."""
    args = [*TINY, f"model={model}", f"tracking.uri={mlflow_uri}", f"tracking.experiment=cli_{model}", f"checkpoint.dir={tmp_path}/ck"]
    out = run_in_process([sys.executable, "-m", "recsys_runner", *args, f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    final = final_metrics(mlflow_uri, f"cli_{model}")
    assert final["eval/ctr/auc"] > 0.6 and final["eval/cvr/auc"] > 0.6, final
    evaluated = evaluate.run(compose_entry("evaluate", *TINY, f"model={model}", "tracking=none", f"load={tmp_path}/ck"))
    for key in ("eval/ctr/auc", "eval/cvr/auc", "eval/cvr/logloss"):
        assert evaluated[key] == pytest.approx(final[key], abs=1e-6), key


@pytest.mark.slow
def test_two_ranks_train_both_models_and_one_rank_evaluates_the_same(tmp_path: Path) -> None:
    """torchrun, 2 ranks (gloo), tables sharded across both: PLE and DBMTL train (two jobs of one launch,
    :mod:`tests.rank_jobs`); each 2-rank checkpoint, evaluated on 1 rank (resharded by DCP), gives the 2-rank run's eval."""
    uri = f"sqlite:///{tmp_path}/mt.db"
    models = ("ple", "dbmtl")
    args = {model: [f"model={model}", f"checkpoint.dir={tmp_path}/{model}"] for model in models}
    env = jobs(*[(tmp_path, {}, [*args[model], f"tracking.experiment={model}2", f"hydra.run.dir={tmp_path}/run_{model}"])
                 for model in models])
    out = torchrun(*TINY, "train.num_steps=16", f"tracking.uri={uri}", cwd=tmp_path, module="tests.rank_jobs", env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    for model in models:
        two = final_metrics(uri, f"{model}2")
        assert two["world_size"] == 2 and two["eval/ctr/auc"] > 0.55 and two["eval/cvr/auc"] > 0.55, two
        one = evaluate.run(compose_entry("evaluate", *TINY, "train.num_steps=16", *args[model], "tracking=none", f"load={tmp_path}/{model}"))
        for key in ("eval/ctr/auc", "eval/cvr/auc"):
            assert one[key] == pytest.approx(two[key], abs=1e-5), (model, key)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ple", "dbmtl"])
def test_exports_and_scores_like_the_trained_model(make_cfg, export_cfg, tmp_path: Path, model: str) -> None:  # noqa: F811
    spec, _, expected = check_export(make_cfg, export_cfg, tmp_path, f"model={model}", "data=synthetic_multitask")
    assert [(o["name"], o["kind"]) for o in spec["outputs"]] == [("ctr", "binary"), ("cvr", "binary")]
    assert spec["output_type"] == "dict[task name, Tensor]" and expected.shape == (64, 2)
    assert json.loads(json.dumps(spec))["model"] == {"ple": "PLE", "dbmtl": "DBMTL"}[model]
