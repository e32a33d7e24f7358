"""Rows that train and evaluate, or none: a next-item row without its true next item is a bad row where the model trains or
evaluates (predict's top-k reads it), and eval data with no row to evaluate is refused before the first step, never logged
as ``eval/<metric>=nan`` after the training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from recsys_runner import evaluate, predict
from recsys_runner.__main__ import run as train
from recsys_runner.build import build
from recsys_runner.config import register_configs, validate
from recsys_runner.data.files.splits import eval_mask
from recsys_runner.errors import DataError
from recsys_runner.paths import CONFIG_PATH
from tests.test_evaluate import compose_entry

SCHEMA = pa.schema([("user", pa.int64()), ("item_id", pa.int64()), ("hist_item_id", pa.list_(pa.int64())), ("label", pa.int64())])
ROWS = 48


def _rows(path: Path, n: int = ROWS, item: list[int | None] | None = None, history: list[list[int | None]] | None = None) -> str:
    """``n`` next-item rows (``item_id`` after ``hist_item_id``) written to ``path``; ``item``/``history`` replace the columns."""
    pq.write_table(pa.table({"user": list(range(n)), "item_id": item or [i % 12 for i in range(n)],
                             "hist_item_id": history or [[(i + 1) % 12, (i + 2) % 12] for i in range(n)], "label": [1] * n},
                            schema=SCHEMA), path)
    return str(path)


def _overrides(tmp_path: Path, *extra: str) -> list[str]:
    return ["model=sasrec", "model.embedding_dim=8", "model.eval_metrics=[hr@5]", "data=parquet", "data.batch_size=8",
            "data.num_workers=0", "data.sparse=[{name:user,num_embeddings:64},{name:item_id,table:item},{name:hist_item_id,table:item}]",
            "+data.sequences={hist:{features:[hist_item_id],max_len:4}}", "distributed.device=cpu", "tracking=none",
            f"checkpoint.dir={tmp_path}/ck", "train.num_steps=2", "train.eval_every_steps=null", *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """SASRec trained two steps on good rows; its folder and overrides."""
    root = tmp_path_factory.mktemp("eval_rows")
    overrides = _overrides(root, f"data.path={_rows(root / 'train.parquet')}", f"data.eval_path={_rows(root / 'eval.parquet', 16)}")
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        train(compose(config_name="config", overrides=overrides))
    return root, overrides


@pytest.mark.parametrize("block", ["sasrec", "hstu"])
def test_a_next_item_row_without_its_true_next_item_is_a_bad_row(tmp_path: Path, block: str) -> None:
    """A null ``item_id`` read as an empty bag, whose padded id trained the row toward item 0 (and judged it against item
    0), unsaid; now a bad row naming the column, or skipped and counted with ``on_bad_rows=skip``."""
    path = _rows(tmp_path / "rows.parquet", item=[None if i % 4 == 0 else i % 12 for i in range(ROWS)])
    spec = validate(compose_entry("config", *_overrides(tmp_path, f"model.block={block}", f"data.path={path}", f"data.eval_path={path}")))
    data = spec.served_data.build(device="cpu")
    for batches in (data.train_batches(0, 0, 1), data.eval_batches(0, 1)):
        with pytest.raises(DataError, match=r"rows\.parquet, row group 0, row 0 of the file, column 'item_id': it is missing \(null or "
                                            r"empty\): a next-item model trains toward and is judged against each row's 'item_id'"):
            list(batches)
    skipping = validate(compose_entry("config", *_overrides(tmp_path, f"data.path={path}", f"data.eval_path={path}",
                                                            "data.on_bad_rows=skip"))).served_data.build(device="cpu")
    batches = list(skipping.eval_batches(0, 1))
    assert sum(len(b.labels) for b in batches) == ROWS * 3 // 4
    assert all(int(b.sparse_features["item_id"].lengths().min()) == 1 for b in batches)
    assert skipping.metrics()["data/bad_rows_skipped"] == ROWS // 4


def test_predict_top_k_reads_rows_without_a_candidate(trained: tuple[Path, list[str]], tmp_path: Path) -> None:
    """Top-k answers what comes after a history, so predict's rows may leave the candidate null: still read, every one."""
    root, overrides = trained
    rows = _rows(tmp_path / "requests.parquet", 6, item=[None] * 6)
    result = predict.run(compose_entry("predict", *overrides, f"load={root}/ck", f"predict.input={rows}",
                                       f"predict.output={tmp_path}/out", "predict.top_k=3"))
    assert result.rows == 6


@pytest.mark.parametrize("split", ["eval_path", "held_out"])
def test_eval_data_whose_rows_are_all_bad_is_refused_before_the_first_step(tmp_path: Path, split: str) -> None:
    """Every eval row skipped as bad (``on_bad_rows=skip``) trained the whole run, then logged ``eval/hr_at_5=nan``
    after the skip warning; now refused when the run is built, naming the eval files, their rows and the fix."""
    bad = [[1, None]] * ROWS
    if split == "eval_path":
        paths = [f"data.path={_rows(tmp_path / 'train.parquet')}", f"data.eval_path={_rows(tmp_path / 'bad.parquet', 5, history=bad[:5])}"]
        said = r"data.eval_path='.*bad\.parquet' \(.*bad\.parquet\) holds 5 eval rows, and all 5 are bad rows"
    else:  # the rows held out of a training file: its bad rows are exactly the held-out ones
        held = eval_mask(str(tmp_path / "train.parquet"), np.arange(ROWS), 0.25)
        history = [[1, None] if h else [(i + 1) % 12, (i + 2) % 12] for i, h in enumerate(held)]
        paths = [f"data.path={_rows(tmp_path / 'train.parquet', history=history)}", "data.eval_fraction=0.25"]
        said = rf"the share of data.path='.*train\.parquet' .* held out by data.eval_fraction=0.25 holds {int(held.sum())} eval rows, and all"
    spec = validate(compose_entry("config", *_overrides(tmp_path, *paths, "data.on_bad_rows=skip")))
    with pytest.raises(DataError, match=r"the eval data has no row to evaluate \(its metrics would all be NaN\): " + said +
                                        r".*Fix: correct or remove the bad rows"):
        build(spec)


def test_evaluate_on_eval_data_without_a_good_row_is_refused(trained: tuple[Path, list[str]], tmp_path: Path) -> None:
    """``python -m recsys_runner.evaluate`` on a day whose rows are all bad logged NaN metrics as the checkpoint's."""
    root, overrides = trained
    bad = _rows(tmp_path / "day.parquet", 4, item=[None] * 4)
    with pytest.raises(DataError, match=r"no row to evaluate.*day\.parquet.*holds 4 eval rows, and all 4 are bad rows"):
        evaluate.run(compose_entry("evaluate", *overrides, f"load={root}/ck", f"data.eval_path={bad}", "data.on_bad_rows=skip"))


def test_an_eval_that_steps_no_batch_is_a_data_error_not_nan(trained: tuple[Path, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where emptiness is known only at the eval (a data module that checks nothing ahead), the evaluator says so."""
    root, overrides = trained
    spec = validate(compose_entry("config", *overrides, "checkpoint=none"))
    c = build(spec)
    try:
        monkeypatch.setattr(c.loop.data, "eval_batches", lambda rank, world_size: iter(()))
        with pytest.raises(DataError, match=r"the eval data gave no row to evaluate \(its metrics would all be NaN\): .*eval\.parquet.* "
                                            r"holds 16 eval rows; rank 0 read 0 and skipped 0 as bad rows"):
            c.loop.evaluator.evaluate()
    finally:
        c.close()
