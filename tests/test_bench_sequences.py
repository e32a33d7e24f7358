"""``python -m recsys_runner.bench.sequences_rows --quick`` runs and writes its JSON; the generated log has Zipf
lengths capped at ``max_len + 2`` and per-user rows read far fewer tokens than per-event rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from recsys_runner.bench.sequences_rows import interaction_log, main


def test_the_log_has_capped_zipf_lengths_and_walks_per_user() -> None:
    log = interaction_log(500, 50, seed=1).to_pandas()
    lengths = log.groupby("user").size().to_numpy()
    assert lengths.min() >= 3 and lengths.max() <= 52 and np.median(lengths) < 10, "long-tailed"
    for _, events in log.groupby("user"):
        steps = np.diff(events["item"].to_numpy()) % 2000
        assert set(steps.tolist()) <= {1, 2, 3}
        assert np.all(np.diff(events["timestamp"].to_numpy()) > 0)


def test_quick_bench_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "bench_results" / "sequences_rows.json"
    assert main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    user, event = result["per_user"], result["per_event"]
    assert user["rows"] == 200 and event["rows"] > user["rows"]
    assert result["tokens_ratio"] > 5 and event["tokens_per_epoch"] > user["tokens_per_epoch"]
    # a quick per-event estimate is the difference of two short runs: noise on busy cores, so only its sign is checked
    assert user["s_per_epoch"] > 0 and event["s_per_epoch"] >= 0 and 0 <= user["valid_hr_at_10"] <= 1
