"""Sharding control and the plan-only dry run: per-table choices, planner knobs, other world sizes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from recsys_runner.config import validate
from recsys_runner.errors import ConfigError
from recsys_runner.plan import dry_run
from tests.conftest import TINY


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
    (module_plan,) = plan.plan.values()
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
])
def test_bad_planner_settings(make_cfg, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(override, "tracking=none"))


def test_planner_knobs_reach_the_topology(make_cfg) -> None:
    import torch

    from recsys_runner.models.common import TrainWrapper

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


def _plan_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "recsys_runner.plan", *TINY, "tracking=none", f"hydra.run.dir={cwd}/out", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_plan_cli_fits_and_does_not_fit(tmp_path: Path) -> None:
    """Exit 0 and a per-rank table when it fits; exit 1 and the planner's reason when 2 ranks of 10 MB cannot hold it."""
    fits = _plan_cli("distributed.plan_world_size=2", cwd=tmp_path)
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert "sharding plan for world_size=2" in fits.stdout and "fits: yes" in fits.stdout
    assert not list(tmp_path.glob("**/mlflow.db")), "a dry run logs nothing"
    too_big = _plan_cli("distributed.plan_world_size=2", "distributed.ddr_cap_gb=0.01", "data.num_embeddings=200000", cwd=tmp_path)
    assert too_big.returncode == 1, too_big.stderr[-2000:]
    assert "DOES NOT FIT" in too_big.stdout and "insufficient storage" in too_big.stdout
