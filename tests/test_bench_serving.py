"""The issue-29 benches (``bench.serving``, ``bench.encoding``, ``bench.transforms``) run at their smallest sizes and write
every figure docs/performance.md quotes (no timing or AUC assertions: the numbers are the machine's). The encoding and
transforms benches take ~6 and ~15 s here; the serving bench trains, exports and starts a real ``mlflow models serve``
(~2.5 min on 2 busy cores), so it is marked slow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recsys_runner.bench import encoding, serving, transforms


@pytest.mark.slow
def test_serving_bench_times_http_profiles_and_compares_predict(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    serving.main(["--quick", "--workers", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert set(result["http"]) == {"rows_1", "rows_1000"}
    for name, figures in result["http"].items():
        assert figures["p50_ms"] > 0 and figures["p99_ms"] >= figures["p50_ms"] and figures["requests"] == 3, name
        assert figures["target_p50_ms"] == serving.TARGETS_MS[name] and isinstance(figures["met"], bool)
    for profiled in result["profile"].values():
        assert profiled["server_rest_ms"] >= 0
        for clock in ("wall", "cpu"):
            assert {*serving.PARTS, "in_process_total_ms"} <= set(profiled[clock])
            assert profiled[clock]["encode_ms"] > 0 and profiled[clock]["program_ms"] > 0
    speed = result["throughput"]
    assert speed["rows"] == 1000 and speed["predict_cli_rows_per_s"] > 0
    assert speed["pyfunc_rows_per_s"] > 0 and speed["pyfunc_auto_threads_rows_per_s"] > 0 and speed["auto_threads"] >= 1


def test_encoding_bench_reads_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "encoding.json"
    encoding.main(["--quick", "--rows", "5000", "--json", str(out)])
    variants = json.loads(out.read_text())["variants"]
    assert list(variants) == ["plain", "vocab", "transforms", "vocab_transforms"]
    assert variants["plain"]["ratio"] == 1.0 and all(v["rows_per_s"] > 0 for v in variants.values())
    assert variants["vocab_transforms"]["target"] == encoding.TARGET and isinstance(variants["vocab_transforms"]["met"], bool)


def test_transforms_bench_trains_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "transforms.json"
    transforms.main(["--quick", "--train-rows", "1000", "--eval-rows", "500", "--json", str(out)])
    result = json.loads(out.read_text())
    assert list(result["variants"]) == ["raw", "log1p", "log1p_zscore", "quantiles"]
    for name, v in result["variants"].items():
        assert 0 < v["auc"] < 1 and v["logloss"] > 0 and len(v["auc_per_seed"]) == 1, name
    assert result["variants"]["log1p"]["auc_vs_log1p"] == 0.0 and result["best_auc"] in result["variants"]
