"""The input path from DataLoader workers: batches packed into one buffer per batch are the batches of the in-process path,
bit for bit (Parquet, CSV, synthetic; 2 workers); the loader benchmark runs; every bench that times runner windows refuses
too few ``--steps`` before it builds anything."""

from __future__ import annotations

import importlib

import pytest

BENCHES_WITH_WINDOWS = ("data", "regimes", "storage", "zoo", "caching", "table_dtype", "step_options", "multitask", "retrieval")


@pytest.mark.parametrize("name", BENCHES_WITH_WINDOWS)
def test_bench_refuses_steps_without_a_timed_window(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--steps 10`` is one warm-up window and nothing to time: refused at parsing (exit 2, naming the fix), not a
    ``StatisticsError: no median for empty data`` after the model is built and trained."""
    main = importlib.import_module(f"recsys_runner.bench.{name}").main
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "10"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--steps" in err and "Fix: --steps 20 or more" in err, err
