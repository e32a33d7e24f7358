"""Sharding control and the plan-only dry run: per-table choices, planner knobs, other world sizes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from recsys_runner.config import validate
from recsys_runner.errors import ConfigError
from recsys_runner.plan import dry_run
from tests.conftest import TINY, run_in_process


def test_dry_run_plans_for_another_world_size(make_cfg) -> None:
    report = dry_run(make_cfg("distributed.plan_world_size=4", "distributed.sharding_types=[column_wise]", "tracking=none"))
    assert report.world_size == 4 and report.fits
    assert [r.rank for r in report.ranks] == [0, 1, 2, 3]
    assert all(r.ddr > 0 for r in report.ranks), "column-wise spreads every table over all 4 ranks"
    text = str(report)
    assert "rank:3" in text and "column_wise" in text and "fits: yes" in text


def test_per_table_sharding_types_override_the_global_ones(make_cfg) -> None:
    cfg = make_cfg("+distributed.tables={t_cat_0: {sharding_types: [data_parallel]}, t_cat_1: {sharding_types: [column_wise]}}",
                   "distributed.sharding_types=[table_wise]", "distributed.plan_world_size=2", "tracking=none")
    plan = dry_run(cfg).plan
    assert plan is not None
    module_plan = plan.plan["model.sparse_arch.ebc"]  # DeepFM's embeddings (its first-order weights are another EBC)
    types = {name: p.sharding_type for name, p in module_plan.items()}
    assert types["t_cat_0"] == "data_parallel" and types["t_cat_1"] == "column_wise"
    assert {types[f"t_cat_{i}"] for i in range(2, 26)} == {"table_wise"}


def test_unknown_table_is_a_config_error_listing_the_tables(make_cfg) -> None:
    cfg = make_cfg("+distributed.tables={t_cat_99: {sharding_types: [table_wise]}}", "tracking=none")
    with pytest.raises(ConfigError, match=r"distributed.tables names \['t_cat_99'\].*t_cat_0, t_cat_1, t_cat_2"):
        dry_run(cfg)


def test_per_table_sharding_type_checked_against_device(make_cfg) -> None:
    cfg = make_cfg("+distributed.tables={t_cat_0: {sharding_types: [row_wise]}}", "tracking=none")
    with pytest.raises(ConfigError, match=r"distributed.tables.t_cat_0.sharding_types=\['row_wise'\].*cannot shard .* on cpu"):
        validate(cfg)


@pytest.mark.parametrize("override, message", [
    ("distributed.intra_node_bandwidth_gbps=0", "distributed.intra_node_bandwidth_gbps must be positive"),
    ("distributed.plan_local_world_size=3", "distributed.plan_local_world_size=3 needs distributed.plan_world_size"),
    ("+distributed.tables={t_cat_0: {compute_kernels: [magic]}}", "distributed.tables.t_cat_0.compute_kernels has unknown 'magic'"),
    # TorchRec's enum names, as TorchEasyRec's configs write them: the fix is the list in its values
    ("distributed.sharding_types=[TABLE_WISE,row_wise]",
     r"distributed.sharding_types has unknown 'TABLE_WISE'; .*Fix: distributed.sharding_types=\[table_wise,row_wise\]$"),
    ("distributed.compute_kernels=[fused_uvm_cachng]", r"Fix: distributed.compute_kernels=\[fused_uvm_caching\]$"),
])
def test_bad_planner_settings(make_cfg, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(override, "tracking=none"))


def test_planner_knobs_reach_the_topology(make_cfg) -> None:
    import torch

    from recsys_runner.models.train_wrapper import TrainWrapper

    cfg = make_cfg("distributed.intra_node_bandwidth_gbps=100", "distributed.cross_node_bandwidth_gbps=5", "distributed.hbm_cap_gb=2",
                   "distributed.ddr_cap_gb=3", "distributed.planner_batch_size=4096", "tracking=none")
    distributed = validate(cfg).distributed.build()
    data = validate(cfg).data.build()
    model = TrainWrapper(validate(cfg).model.build(features=data.features, dense_device=torch.device("meta")))
    planner, _, topology = distributed._planner(model, batch_size=256, world_size=8, local_world_size=4, device_type="cuda")
    assert topology.world_size == 8 and topology.local_world_size == 4
    assert topology.intra_host_bw == pytest.approx(100 * 1024**3 / 1000)
    assert topology.inter_host_bw == pytest.approx(5 * 1024**3 / 1000)
    assert topology.devices[0].storage.hbm == 2 * 1024**3 and topology.devices[0].storage.ddr == 3 * 1024**3
    assert planner._batch_size == 4096


def _plan_cli(*args: str, cwd: Path, process: bool = True) -> subprocess.CompletedProcess[str]:
    """``python -m recsys_runner.plan``: a process, or (``process=False``) in this one as ``python -m`` runs it
    (:func:`tests.conftest.run_in_process`), without ~10 s of imports."""
    argv = [sys.executable, "-m", "recsys_runner.plan", *TINY, "tracking=none", f"hydra.run.dir={cwd}/out", *args]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300) if process else run_in_process(argv, cwd)


def test_plan_cli_fits_and_does_not_fit(tmp_path: Path) -> None:
    """Exit 0 and a per-rank table when it fits; exit 1 and the planner's reason when 2 ranks of 10 MB cannot hold it."""
    fits = _plan_cli("distributed.plan_world_size=2", cwd=tmp_path)
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert "sharding plan for world_size=2" in fits.stdout and "fits: yes" in fits.stdout
    assert not list(tmp_path.glob("**/mlflow.db")), "a dry run logs nothing"
    too_big = _plan_cli("distributed.plan_world_size=2", "distributed.ddr_cap_gb=0.01", "data.num_embeddings=200000", cwd=tmp_path,
                       process=False)
    assert too_big.returncode == 1, too_big.stderr[-2000:]
    assert "DOES NOT FIT" in too_big.stdout and "insufficient storage" in too_big.stdout


def _types(plan) -> dict[str, str]:
    assert plan is not None
    return {name: p.sharding_type for module_plan in plan.plan.values() for name, p in module_plan.items()}


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # planning for cuda needs no GPU; unrestricted, it picked row_wise for all 26
def test_one_rank_plan_keeps_tables_whole(make_cfg, device: str) -> None:
    types = _types(dry_run(make_cfg(f"distributed.device={device}", "distributed.plan_world_size=1", "tracking=none")).plan)
    assert len(types) == 52 and set(types.values()) <= {"table_wise", "data_parallel"}, types  # 26 embedding + 26 first-order tables


def test_one_rank_plan_gives_explicitly_asked_sharding_types(make_cfg) -> None:
    one_rank = ("distributed.device=cuda", "distributed.plan_world_size=1", "tracking=none")
    assert set(_types(dry_run(make_cfg("distributed.sharding_types=[row_wise]", *one_rank)).plan).values()) == {"row_wise"}
    types = _types(dry_run(make_cfg("+distributed.tables={t_cat_0: {sharding_types: [row_wise]}}", *one_rank)).plan)
    assert types["t_cat_0"] == "row_wise"
    assert {types[f"t_cat_{i}"] for i in range(1, 26)} <= {"table_wise", "data_parallel"}
    on_cpu = _types(dry_run(make_cfg("distributed.sharding_types=[column_wise]", "distributed.plan_world_size=1", "tracking=none")).plan)
    assert set(on_cpu.values()) == {"column_wise"}


def test_many_ranks_are_not_restricted() -> None:
    from recsys_runner.distributed.config import DistributedConfig
    from recsys_runner.distributed.planner import table_constraints

    config = DistributedConfig()
    assert table_constraints(config, ["t_a", "t_b"], world_size=2) is None
    one = table_constraints(config, ["t_a", "t_b"], world_size=1)
    assert one is not None and one["t_a"].sharding_types == ["table_wise", "data_parallel"]


def test_plan_logs_a_one_line_summary_and_the_full_plan_at_debug(make_cfg, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import torch

    from recsys_runner.models.train_wrapper import TrainWrapper
    from recsys_runner.optim.sparse import apply_sparse_optimizer

    run = validate(make_cfg("tracking=none"))
    data = run.data.for_model(run.model.data_needs()).build()
    model = TrainWrapper(run.model.build(features=data.features, dense_device=torch.device("meta")))
    apply_sparse_optimizer(model, run.optim.sparse)
    distributed = run.distributed.build()
    env = distributed.setup()  # gloo, world size 1, as a single-process run
    try:
        assert env.world_size == 1
        with caplog.at_level(logging.DEBUG, logger="recsys_runner.distributed"):
            plan = distributed.plan(model, batch_size=data.batch_size)
    finally:
        distributed.close()
    ours = [r for r in caplog.records if r.name == "recsys_runner.distributed.sharding"]
    # the plan's own INFO lines (setup's thread line is not the plan's, and is logged before it)
    info = [r.getMessage() for r in ours if r.levelno == logging.INFO and not r.getMessage().startswith("torch CPU threads")]
    assert len(info) == 1, info
    assert "\n" not in info[0]
    assert info[0].startswith("sharding plan: 52 tables on 1 rank: 52 table_wise (fused kernel); est. "), info[0]
    assert "MB/rank (HBM 0.0 MB, DDR " in info[0]
    debug = [r.getMessage() for r in ours if r.levelno == logging.DEBUG]
    assert any("t_cat_25" in m and "table_wise" in m for m in debug), "the full per-table plan is logged at DEBUG"
    assert set(_types(plan).values()) == {"table_wise"}


def test_plan_summary_counts_types_and_kernels_over_ranks(make_cfg) -> None:
    from recsys_runner.distributed.plan_report import plan_summary

    cfg = make_cfg("+distributed.tables={t_cat_0: {sharding_types: [data_parallel]}}", "distributed.sharding_types=[table_wise]",
                   "distributed.plan_world_size=4", "tracking=none")
    report = dry_run(cfg)
    assert report.plan is not None
    usage = [(r.hbm, r.ddr) for r in report.ranks]
    line = plan_summary(report.plan, 4, usage)
    assert line.startswith("sharding plan: 52 tables on 4 ranks: 51 table_wise (fused kernel), 1 data_parallel (dense kernel); est. max ")
    assert plan_summary(report.plan, 4).endswith("1 data_parallel (dense kernel)")


def _placements(plan) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    assert plan is not None
    return {name: (p.sharding_type, p.compute_kernel, tuple(p.ranks or ())) for module_plan in plan.plan.values()
            for name, p in module_plan.items()}


def test_dynamic_programming_proposer_plans_a_large_table_config_differently(make_cfg) -> None:
    """52 tables of 1M rows (DeepFM's embeddings and first-order weights) on 2 GPUs of 2 GB: not every table fits in HBM,
    so the plan trades device memory for speed; TorchRec's default proposers upgrade tables one at a time, the dynamic
    programming proposer picks one option per table for each total HBM budget. Both plans are valid (every table placed,
    each rank within its budget) and they differ."""
    plans = {}
    for proposer in ("default", "dynamic_programming"):
        report = dry_run(make_cfg("distributed.device=cuda", "distributed.plan_world_size=2", "distributed.hbm_cap_gb=2",
                                  "data.num_embeddings=1000000", f"distributed.planner.proposer={proposer}", "tracking=none"))
        assert report.fits, str(report)
        assert f"on cuda, proposer={proposer}" in str(report).splitlines()[0]
        plans[proposer] = _placements(report.plan)
        assert len(plans[proposer]) == 52 and all(ranks for _, _, ranks in plans[proposer].values())
        assert "fused_uvm_caching" in {kernel for _, kernel, _ in plans[proposer].values()}, "the budget forces tables off HBM"
    assert plans["default"].keys() == plans["dynamic_programming"].keys()
    assert plans["default"] != plans["dynamic_programming"]


@pytest.mark.parametrize("overrides, message", [
    (["distributed.planner.proposer=magic"], r"distributed.planner.proposer='magic' is not one of .*dynamic_programming"),
    (["distributed.planner.proposer=dynamic_programming"], r"dynamic_programming budgets device \(HBM\) memory.*Fix"),
])
def test_bad_proposer_settings(make_cfg, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(*overrides, "tracking=none"))  # TINY plans on distributed.device=cpu


def test_torcheasyrecs_planning_variables_are_named_with_our_keys() -> None:
    # a launch script migrated from TorchEasyRec set them and planned as if they had no effect, without a word
    from recsys_runner.distributed.config import foreign_environment

    said = foreign_environment({"STORAGE_RESERVE_PERCENT": "0.5", "CROSS_NODE_BANDWIDTH": "25e9", "PROCESS_GROUP_TIMEOUT_SECONDS": "3600",
                                "PATH": "/bin"})
    assert [s.rsplit("Fix: ", 1)[1] for s in said] == [
        "distributed.storage_reserve_percent=0.5", "distributed.cross_node_bandwidth_gbps=25 (GB/s; TorchEasyRec's is bytes/s)",
        "distributed.timeout_s=3600"]
    assert all(" is TorchEasyRec's and is not read here" in s for s in said)
    assert foreign_environment({"PATH": "/bin"}) == []
