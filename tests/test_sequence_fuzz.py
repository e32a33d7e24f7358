"""Users' own sequence data, messy as it comes: event logs for ``python -m recsys_runner.data sequences`` and history
files for ``data=parquet``. Each case does the documented thing or stops early with one message naming the column, the
row and the fix; never a stack trace from inside pyarrow or torch, never a row lost or a value changed unsaid."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_runner.build import build
from recsys_runner.config import validate
from tests.test_evaluate import compose_entry
from tests.test_sequence_rows import distinct_times_log, run_sequences


@pytest.mark.parametrize("protocol", [[], ["metrics.exclude_seen=true"], ["model.eval_negatives=5", "model.eval_metrics=[hr@3,mrr]"]],
                         ids=["full_table", "exclude_seen", "sampled"])
def test_eval_rows_whose_true_item_the_mapping_has_not_seen_are_misses_not_a_crash(tmp_path: Path, protocol: list[str]) -> None:
    """The next day's log encoded with ``--vocab`` holds items the earlier mapping lacks: an eval row whose true item
    is one of them ranks no candidate (a miss, docs/sequences.md) and its loss is left out, where the eval's loss
    indexed the candidates' scores by its OOV id and stopped inside torch (``IndexError: Target 30 is out of bounds``)."""
    rows = run_sequences(tmp_path, distinct_times_log(num_users=30, seed=5), "rows", "--max-len", "6")
    first = pq.read_table(tmp_path / "log.parquet").to_pylist()[0]
    new = pa.table({"user": [first["user"]] * 2 + ["user-new"] * 2, "item": [first["item"], 999_999, first["item"], first["item"]],
                    "timestamp": [5000, 5001, 5000, 5001]})
    later = run_sequences(tmp_path, new, "later", "--vocab", str(rows), name="later.parquet")
    assert pq.read_table(later / "eval.parquet").column("item_id").to_pylist()[0] >= len((rows / "vocab" / "item.txt").read_text().split())
    spec = validate(compose_entry(
        "config", "model=sasrec", "model.embedding_dim=8", "data=parquet", f"data.path={rows}/train.parquet",
        f"data.eval_path={later}/eval.parquet", "data.batch_size=16", "distributed.device=cpu", "tracking=none",
        f"checkpoint.dir={tmp_path}/ck", "model.eval_metrics=[hr@10,mrr]", *protocol))
    c = build(spec)
    try:
        metrics = c.loop.evaluator.evaluate()
    finally:
        c.close()
    hits = [v for k, v in metrics.items() if k.startswith("eval/hr_at_")]
    assert hits and max(hits) <= 0.5  # of the two rows, the OOV target's is a miss
