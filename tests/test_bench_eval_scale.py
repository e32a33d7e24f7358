"""``python -m recsys_runner.bench.eval_scale`` at a tiny size: every case runs and writes its JSON row, the values are
the metrics' own over the generated rows (the bench measures the evaluator's computation, not another), the states it
reports are the bytes the metrics hold, and a case measured in a fresh interpreter gives the in-process values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recsys_runner.bench import eval_scale
from recsys_runner.metrics.functional import binary_auc, grouped_auc

SMALL = {"rows": 5000, "batch": 512, "rows_per_group": 10, "items": 400, "threads": 1, "ranks": 1}


def test_every_case_runs_and_reports_the_metrics_own_values(tmp_path: Path) -> None:
    out = tmp_path / "bench_results" / "eval_scale.json"
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    rows = eval_scale.main([*argv, "--in-process", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["settings"] == SMALL and written["cases"] == rows
    by_case = {r["case"]: r for r in rows}
    assert list(by_case) == list(eval_scale.CASES)
    logits, labels, groups = eval_scale.eval_rows(SMALL["rows"], SMALL["rows_per_group"])
    preds = torch.sigmoid(logits)
    assert by_case["auc"]["values"]["auc"] == round(float(binary_auc(preds, labels)), 6)
    assert by_case["all"]["values"]["gauc"] == round(float(grouped_auc(preds, labels, groups)), 6)
    assert by_case["all"]["values"]["auc"] == by_case["auc"]["values"]["auc"]
    assert 0 < by_case["coverage"]["values"]["coverage@100"] <= 1
    # AUC keeps its rows' float32 predictions and 0/1 labels: 5 bytes a row; coverage one byte per catalogue item
    assert by_case["auc"]["state_bytes"] == SMALL["rows"] * 5
    assert by_case["gauc"]["state_bytes"] == SMALL["rows"] * 13  # + 8-byte group ids, copied out of the batch
    assert by_case["coverage"]["state_bytes"] == SMALL["items"] + 8  # and the catalogue size, a float64
    for row in rows:
        assert row["rows"] == SMALL["rows"] and row["threads"] == 1
        assert row["update_s"] >= 0 and row["compute_s"] >= 0 and row["peak_growth_mb"] >= 0


def test_a_case_in_a_fresh_interpreter_measures_the_same_values() -> None:
    [fresh] = eval_scale.bench_eval_scale(SMALL, ["gauc"])
    assert fresh["values"] == eval_scale.measure("gauc", **SMALL)["values"]
    assert fresh["state_bytes"] == SMALL["rows"] * 13


def test_an_unknown_case_is_refused_naming_the_cases(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        eval_scale.main(["--cases", "auc,gauk"])
    assert "unknown ['gauk']; the cases are auc, gauc" in capsys.readouterr().err


@pytest.mark.slow
def test_two_ranks_measure_each_ranks_share_and_report_the_unions_values() -> None:
    """``--ranks 2``: two processes of one gloo group, each keeping half the rows (half the states' bytes), report the
    one-process values; ``--gather`` (the state gather, AUC's former way over ranks) reports the same values."""
    [one] = eval_scale.bench_eval_scale(SMALL, ["all"])
    [routed] = eval_scale.bench_eval_scale(SMALL | {"ranks": 2}, ["all"])
    [gathered] = eval_scale.bench_eval_scale(SMALL | {"ranks": 2}, ["all"], gather=True)
    assert routed["values"] == gathered["values"] == one["values"]
    assert routed["ranks"] == 2 and not routed["gather"] and gathered["gather"]
    assert len(routed["peak_growth_mb_ranks"]) == 2 and routed["peak_growth_mb"] == max(routed["peak_growth_mb_ranks"])
    assert routed["state_bytes"] < one["state_bytes"] * 0.6  # the larger rank's half, not the union


def test_ranks_in_process_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        eval_scale.main(["--ranks", "2", "--in-process"])
    assert "--ranks 2 needs a process per rank" in capsys.readouterr().err
