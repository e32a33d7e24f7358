"""``python -m recsys_runner.bench.topk --quick --in-process`` runs both models and writes its JSON: one output row per
input row, top lists ``k`` long, no seen item in a top list with exclude-seen on (checked again here on the written
parts, row by row), positive rates and a breakdown that adds up; the generated log maps every item when users
outnumber items, and the bench's own seen-item count counts what it should."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_runner.bench import topk
from recsys_runner.data.sequences.mapping import load_mapping
from recsys_runner.scoring_topk import TOP_ITEMS


def test_the_log_starts_a_user_at_every_item_and_caps_its_lengths() -> None:
    log = topk.interaction_log(300, 200, max_len=10, seed=1).to_pandas()
    assert log["item"].nunique() == 200 and log["user"].nunique() == 300
    lengths = log.groupby("user").size().to_numpy()
    assert lengths.min() >= 2 and lengths.max() <= 11
    for _, events in log.groupby("user"):
        assert set((np.diff(events["item"].to_numpy()) % 200).tolist()) <= {1, 2, 3}


def test_seen_in_top_counts_the_top_items_found_in_their_rows_history(tmp_path: Path) -> None:
    rows, _, items = topk.write_rows(tmp_path, 40, 30, 6)
    assert items == 30
    mapping = load_mapping(str(rows))["item"]
    histories = pq.read_table(rows / "eval.parquet")["hist_item_id"].to_pylist()
    assert all(histories)
    # each row's top list: its first history item (raw id), then an id no history holds
    tops = [[int(mapping[h[0]]), 10_000] for h in histories]
    (tmp_path / "out").mkdir()
    pq.write_table(pa.table({TOP_ITEMS: tops}), tmp_path / "out" / "part-00000-00000.parquet")
    assert topk.seen_in_top(tmp_path / "out", rows / "eval.parquet", mapping) == (len(histories), len(histories), [2])


def test_quick_bench_predicts_every_row_and_never_a_seen_item_with_exclude_seen(tmp_path: Path) -> None:
    out, work = tmp_path / "bench_results" / "topk.json", tmp_path / "work"
    assert topk.main(["--quick", "--in-process", "--json", str(out), "--workdir", str(work)]) == 0
    result = json.loads(out.read_text())
    assert result["input_rows"] == result["users"] == 600 and result["items"] == 500 and result["predict"] == "in_process"
    assert set(result["models"]) == set(topk.MODELS)
    users = pq.read_table(work / "rows" / "eval.parquet")
    mapping = load_mapping(str(work / "rows"))["item"]
    for model, figures in result["models"].items():
        for name in ("on", "off"):
            cli = figures[f"exclude_seen_{name}"]
            assert cli["rows"] == cli["rows_written"] == users.num_rows, (model, name)
            assert cli["list_lengths"] == [result["k"]] and cli["rows_per_s"] > 0, (model, name)
            profile = figures[f"breakdown_exclude_seen_{name}"]
            assert profile["rows"] == 256 and profile["rows_per_s"] > 0 and profile["queries_s"] > 0 and profile["scoring_s"] >= 0
            assert sum(profile["share"].values()) == pytest.approx(1.0, abs=0.05), (model, name, profile["share"])
        # the written parts themselves, row by row: with exclude-seen on no top item is in the row's history
        written = pq.read_table(sorted((work / f"out_{model}_exclude_seen_on").glob("part-*.parquet")))[TOP_ITEMS].to_pylist()
        histories = [set(mapping[h].tolist()) for h in users["hist_item_id"].to_pylist()]
        assert len(written) == len(histories) and not any(set(top) & seen for top, seen in zip(written, histories, strict=True))
        assert figures["exclude_seen_on"]["seen_in_top"] == 0, model
        assert figures["exclude_seen_off"]["seen_in_top"] > 0, f"{model}: unmasked, some top items are seen ones (the check can fail)"
