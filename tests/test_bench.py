"""``recsys_runner.bench``: every regime runs and lands in the JSON (no timing assertions: the numbers are the machine's)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from recsys_runner.bench.regimes import TARGETS, Regime, alternate, main
from recsys_runner.bench.sequences import Settings, variants

REGIMES = ["a_in_memory", "b_synthetic", "b_parquet", "c_host_overhead", "e_din_in_memory"]
BATCHINGS = ["rows", "tokens", "grouped_quarter", "grouped_half", "grouped"]


def test_alternate_flips_the_order_every_round() -> None:
    calls: list[str] = []

    def path(name: str, value: float):
        return lambda: calls.append(name) or value

    out = alternate(3, {"x": path("x", 1.0), "y": path("y", 2.0)}, "t")
    assert out == {"x": [1.0, 1.0, 1.0], "y": [2.0, 2.0, 2.0]}
    assert calls == ["x", "y", "y", "x", "x", "y"]


def test_regime_ratio_is_the_median_of_per_round_ratios() -> None:
    r = Regime.paired("a_in_memory", "", [90.0, 100.0, 50.0], [100.0, 100.0, 100.0], {})
    assert (r.ratio, r.ratio_min, r.ratio_max, r.target) == (0.9, 0.5, 1.0, TARGETS["a_in_memory"])
    assert r.runner_samples_per_s == 90.0 and r.reference_samples_per_s == 100.0


def test_sequence_batchings_share_one_token_budget() -> None:
    s = Settings()
    assert s.fixed_rows == 8192 // 201  # the rows whose longest histories (200 events + 1) fit the same budget
    assert list(variants(s)) == BATCHINGS
    assert variants(s)["grouped"] == "data.batch_tokens=8192,data.group_by_length=true"
    quick = Settings.quick()
    assert quick.batch_tokens // 4 >= quick.max_len + 1, "every quick budget must hold one longest row"


@pytest.mark.parametrize("flag", ["--steps", "--host-steps"])
def test_too_few_steps_is_refused(flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's usage error (exit 2) naming the flag and why, before anything is written (not even the JSON's folder)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main([flag, "10"])
    assert exited.value.code == 2
    assert f"error: argument {flag}: 10 steps time no window: a round's first 10 steps are warm-up" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_quick_bench_writes_every_regime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m recsys_runner.bench --quick``, its ``__main__`` run in this process (runpy, as ``-m`` does): one
    interpreter fewer to start; the startup regime still launches its own. Batches of 32 rows and a Parquet file of
    2,000 (not --quick's 128 and 20,000): the plumbing is checked, not the figures."""
    out = tmp_path / "bench.json"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["recsys_runner.bench", "--quick", "--batch-size", "32", "--parquet-rows", "2000",
                                      "--json", str(out)])
    runpy.run_module("recsys_runner.bench", run_name="__main__", alter_sys=True)
    stdout = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert sorted(result["regimes"]) == sorted(REGIMES)
    for name in REGIMES:
        r = result["regimes"][name]
        for key in ("runner_samples_per_s", "reference_samples_per_s", "ratio", "target"):
            assert r[key] > 0, (name, key, r)
    assert set(result["startup"]) == {"total_s", "imports_s", "rest_s"}
    assert result["startup"]["total_s"] > 0 and result["startup"]["imports_s"] > 0
    assert "a_in_memory" in stdout and "d_startup" in stdout
    sequences = result["sequences"]
    assert sorted(sequences["memory"]) == sorted(BATCHINGS) and sorted(sequences["speed"]) == sorted(BATCHINGS)
    for name in BATCHINGS:
        assert sequences["speed"][name]["tokens_per_s"] > 0 and sequences["memory"][name]["tokens"] > 0, name
    assert "f_tokens_vs_rows" in stdout and "g_memory_linear" in stdout
