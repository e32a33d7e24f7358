"""``recsys_runner.bench.jagged --quick`` (every model, both paths, speed and memory) and ``recsys_runner.bench.zoo --quick``
land in their JSON and tables (no timing assertions: the numbers are the machine's; docs/performance.md holds the measured
ones)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recsys_runner.bench import zoo
from recsys_runner.bench.jagged import ATTENTIONS, MODELS, main


@pytest.mark.slow
def test_quick_jagged_bench_writes_both_models_and_both_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "jagged.json"
    main(["--quick", "--json", str(out)])
    result = json.loads(out.read_text())
    assert sorted(result["models"]) == sorted(MODELS)
    for model, figures in result["models"].items():
        assert all(figures["speed"]["tokens_per_s"][a] > 0 for a in ATTENTIONS), model
        assert figures["speed"]["ratio"] > 0 and figures["speed"]["target"] == 1.5
        for attention in ATTENTIONS:
            budgets = figures["memory"][attention]
            assert len(budgets) == 2 and all(m["tokens"] > 0 and m["padded"] >= m["tokens"] for m in budgets.values()), budgets
    stdout = capsys.readouterr().out
    assert all(f"{model}: tokens/s jagged" in stdout for model in ("hstu_rank", "din", "bst"))


@pytest.mark.slow
def test_quick_zoo_bench_times_each_model_next_to_its_shapes_reference(tmp_path: Path) -> None:
    """``recsys_runner.bench.zoo --quick --models lr``: DeepFM and LR on the Criteo shape, DIN on histories."""
    out = tmp_path / "zoo.json"
    zoo.main(["--quick", "--models", "lr", "--json", str(out)])
    shapes = json.loads(out.read_text())["shapes"]
    assert sorted(shapes["criteo"]["models"]) == ["deepfm", "lr"] and sorted(shapes["histories"]["models"]) == ["din"]
    assert shapes["criteo"]["models"]["deepfm"]["ratio_to_reference"] == 1.0
    assert all(m["samples_per_s"] > 0 for s in shapes.values() for m in s["models"].values())
