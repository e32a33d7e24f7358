"""Tables larger than the GPU: UVM-cached plans for CUDA (planned on this CPU, no GPU needed), their cache ratio, the
caps too small for even the caches, the CPU's refusal of UVM kernels, and the caching bench's CPU smoke."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest

from recsys_runner.config import validate
from recsys_runner.errors import ConfigError
from recsys_runner.plan import dry_run

BIG = ("distributed.device=cuda", "data.num_embeddings=1000000", "tracking=none")
"""52 tables of 1M rows (DeepFM's 26 of width 16 and 26 first-order ones): 1.9 GB of weights, planned for one GPU."""
CACHED_ONLY = "distributed.compute_kernels=[fused_uvm_caching]"


def _kernels(report) -> dict[str, Counter]:
    assert report.plan is not None, report.error
    return {module: Counter(p.compute_kernel for p in plan.values()) for module, plan in report.plan.plan.items()}


def test_a_cap_below_the_tables_caches_them_and_the_plan_prints_the_ratio(make_cfg) -> None:
    """1.4 GB (1.19 after the reserve) holds the caches (1.12 GB, the planner's estimate) but not the tables: every
    embedding table is UVM-cached; the room left keeps a few small first-order tables whole."""
    report = dry_run(make_cfg(*BIG, "distributed.hbm_cap_gb=1.4", "distributed.compute_kernels=[fused,fused_uvm_caching]"))
    assert report.fits, str(report)
    kernels = _kernels(report)
    assert kernels["model.sparse_arch.ebc"] == Counter(fused_uvm_caching=26)
    assert kernels["model.first_order.ebc"]["fused_uvm_caching"] > 13
    assert "table_wise (fused_uvm_caching kernel, cache 20% of rows: " in report.summary
    assert report.summary in str(report), "the plan command prints the summary line"
    cached = next(p for p in report.plan.plan["model.sparse_arch.ebc"].values())
    assert cached.cache_params is None, "no cache_load_factor set: TorchRec's default (20%)"


def test_cache_load_factor_sets_the_caches_size(make_cfg) -> None:
    default = dry_run(make_cfg(*BIG, "distributed.hbm_cap_gb=4", CACHED_ONLY))
    half = dry_run(make_cfg(*BIG, "distributed.hbm_cap_gb=4", CACHED_ONLY, "distributed.cache_load_factor=0.5"))
    assert "52 table_wise (fused_uvm_caching kernel, cache 20% of rows: 396.7 MB HBM of 1.94 GB)" in default.summary
    assert "52 table_wise (fused_uvm_caching kernel, cache 50% of rows: 991.8 MB HBM of 1.94 GB)" in half.summary
    assert half.ranks[0].hbm > default.ranks[0].hbm, "the planner budgets the larger caches"
    assert {p.cache_params.load_factor for m in half.plan.plan.values() for p in m.values()} == {0.5}
    one = dry_run(make_cfg(*BIG, "distributed.hbm_cap_gb=4", CACHED_ONLY, "+distributed.tables={t_cat_0: {cache_load_factor: 0.5}}"))
    assert "cache 20%-50% of rows" in one.summary


def test_prefetch_pipeline_locks_prefetched_rows_in_the_caches(make_cfg) -> None:
    report = dry_run(make_cfg(*BIG, "distributed.hbm_cap_gb=4", CACHED_ONLY, "distributed.pipeline=prefetch"))
    assert {p.cache_params.prefetch_pipeline for m in report.plan.plan.values() for p in m.values()} == {True}


@pytest.mark.parametrize("overrides, ratio", [
    (("distributed.hbm_cap_gb=0.5", "distributed.compute_kernels=[fused,fused_uvm_caching]"), "20% of their rows (TorchRec's default)"),
    (("distributed.hbm_cap_gb=2", CACHED_ONLY, "distributed.cache_load_factor=0.5"), "50% of their rows (distributed.cache_load_factor)"),
])
def test_a_cap_too_small_for_the_caches_names_the_settings_and_the_fix(make_cfg, overrides: tuple[str, ...], ratio: str) -> None:
    report = dry_run(make_cfg(*BIG, *overrides))
    assert not report.fits and report.error is not None
    cap = overrides[0].split("=")[1]
    assert report.error.startswith(f"distributed.hbm_cap_gb={cap} cannot hold even the tables' UVM caches"), report.error
    assert ratio in report.error
    assert "Fix: distributed.hbm_cap_gb=" in report.error and "a smaller distributed.cache_load_factor" in report.error
    assert "insufficient storage" in report.error, "TorchRec's own message follows"


def test_without_caching_kernels_a_small_cap_is_the_planners_message(make_cfg) -> None:
    report = dry_run(make_cfg(*BIG, "distributed.hbm_cap_gb=0.5", "distributed.compute_kernels=[fused]"))
    assert not report.fits and report.error is not None
    assert "UVM caches" not in report.error and "insufficient storage" in report.error


@pytest.mark.parametrize("override, key", [
    ("distributed.compute_kernels=[fused_uvm_caching]", "distributed.compute_kernels"),
    ("distributed.compute_kernels=[fused,fused_uvm]", "distributed.compute_kernels"),
    ("+distributed.tables={t_cat_0: {compute_kernels: [fused_uvm_caching]}}", "distributed.tables.t_cat_0.compute_kernels"),
])
def test_uvm_kernels_are_refused_on_cpu(make_cfg, override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"{key}=.*cannot run on cpu .*available there: \['dense', 'fused'\]\. "
                                          rf"Fix: {key}=\[fused\] \(or null\), or distributed.device=cuda"):
        validate(make_cfg(override, "tracking=none"))  # TINY: distributed.device=cpu


def test_cache_load_factor_must_be_a_share(make_cfg) -> None:
    from recsys_runner.distributed.config import DistributedConfig

    for share in (0.0, 1.0):  # TorchRec refuses 1 too: the cache would be the table
        with pytest.raises(ConfigError, match=rf"distributed.cache_load_factor={share} must lie strictly between 0 and 1"):
            DistributedConfig(cache_load_factor=share)
    with pytest.raises(ConfigError, match=r"distributed.tables.t_cat_0.cache_load_factor=1.5 must lie strictly between 0 and 1"):
        validate(make_cfg("+distributed.tables={t_cat_0: {cache_load_factor: 1.5}}", "tracking=none"))


def test_cache_load_factor_without_a_cached_table_warns(make_cfg, caplog: pytest.LogCaptureFixture) -> None:
    import torch

    from recsys_runner.models.train_wrapper import TrainWrapper

    run = validate(make_cfg("distributed.cache_load_factor=0.3", "tracking=none"))
    data = run.data.for_model(run.model.data_needs()).build()
    model = TrainWrapper(run.model.build(features=data.features, dense_device=torch.device("meta")))
    distributed = run.distributed.build()
    distributed.setup()
    try:
        with caplog.at_level(logging.WARNING, logger="recsys_runner.distributed"):
            distributed.plan(model, batch_size=data.batch_size)
    finally:
        distributed.close()
    assert any("distributed.cache_load_factor has no effect" in r.getMessage() for r in caplog.records)
    assert distributed.summary.startswith("sharding plan: 52 tables on 1 rank: 52 table_wise (fused kernel)")


def test_caching_bench_cpu_smoke_trains_the_hbm_variant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from recsys_runner.bench.caching import main

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "caching.json"
    result = main(["--quick", "--json", str(out), "distributed.device=cpu"])
    printed = capsys.readouterr().out
    assert "UVM caching is fbgemm's CUDA kernel and this run is on the CPU: training hbm only" in printed
    assert list(result["samples_per_s"]) == ["hbm"] and result["samples_per_s"]["hbm"] > 0
    assert result["plans"]["hbm"].startswith("sharding plan: 52 tables on 1 rank: 52 table_wise (fused kernel)")
    assert json.loads(out.read_text())["ratio_to_hbm"]["hbm"]["median"] == 1.0
