"""``experiment=sasrec_movielens`` and ``experiment=hstu_movielens`` on the output of ``python -m recsys_runner.data
sequences`` (issue 31, point 6): only ``data=parquet data.path=<out>/train.parquet data.eval_path=<out>/valid.parquet``
and a step cap (the test's own ``checkpoint.dir`` and ``tracking=none`` aside: the CLI sets a run folder), with the published values mapped."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from recsys_runner.__main__ import run
from recsys_runner.config import validate
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.data.generated.generate import write_movielens_ratings
from recsys_runner.models.sasrec import SASRecConfig


@pytest.fixture(scope="module")
def ml_users(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated MovieLens-style log as per-user leave-two-out rows of up to 200 events, the papers' protocol."""
    root = tmp_path_factory.mktemp("ml")
    write_movielens_ratings(str(root / "ratings.csv"), 6000, layout="ratings.csv")
    assert data_main(["sequences", str(root / "ratings.csv"), str(root / "ml_users"), "--user", "userId", "--item", "movieId",
                      "--time", "timestamp", "--max-len", "200", "--rows", "per-user", "--split", "leave-two-out"]) == 0
    return root / "ml_users"


@pytest.mark.parametrize(("preset", "block", "time_buckets"), [("sasrec_movielens", "sasrec", 128), ("hstu_movielens", "hstu", 128)])
def test_a_sequence_preset_trains_on_the_commands_output(make_cfg, ml_users: Path, tmp_path: Path, preset: str, block: str,
                                                       time_buckets: int) -> None:
    cfg = make_cfg(f"experiment={preset}", "data=parquet", f"data.path={ml_users / 'train.parquet'}",
                   f"data.eval_path={ml_users / 'valid.parquet'}", "train.num_steps=3", f"checkpoint.dir={tmp_path}",
                   "tracking=none", tiny=False)
    spec = validate(cfg)
    model = spec.model
    assert isinstance(model, SASRecConfig) and model.block == block and model.time_buckets == time_buckets
    assert (model.embedding_dim, model.num_blocks, model.num_heads, model.dropout, model.temperature) == (52, 2, 1, 0.2, 0.05)
    assert spec.data.batch_size == 128 and spec.optim.lr == 0.001 and spec.metrics.exclude_seen
    features = spec.data.build(device="cpu").features
    assert features.sequences[0].max_len == 200 and features.sequences[0].timestamps == "hist_ts"
    assert math.isfinite(run(cfg))


def test_the_hstu_preset_composes_on_its_generated_data(make_cfg) -> None:
    spec = validate(make_cfg("experiment=hstu_movielens", "tracking=none", tiny=False))
    assert isinstance(spec.model, SASRecConfig) and spec.model.block == "hstu" and spec.data.max_len == 200
