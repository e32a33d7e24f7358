"""Multi-task labels from users' own files, fuzzed: a task whose kind differs from how the data reads its label, a
predict input without the label columns, loss weighting over one task, text booleans in a CSV label column, and the
task → label column mapping when the tasks come in another order than the data's labels (docs/multitask.md)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from recsys_runner import evaluate, predict
from recsys_runner.__main__ import run as train
from recsys_runner.config import register_configs
from recsys_runner.configurable import make
from recsys_runner.data.base import DataError
from recsys_runner.data.files.tabular import CsvData, ParquetData
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
from recsys_runner.errors import ConfigError
from recsys_runner.models.esmm import ESMMConfig
from recsys_runner.models.mmoe import MMoEConfig
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.train.weighting import LossWeightingConfig
from tests.test_evaluate import compose_entry

ROWS = 64


def _table(rows: int = ROWS, seed: int = 0) -> dict[str, np.ndarray]:
    """A click, a conversion drawn independently of it, an amount, and two id columns."""
    rng = np.random.default_rng(seed)
    return {"click": rng.integers(0, 2, rows), "buy": rng.integers(0, 2, rows), "amount": rng.random(rows) * 20,
            "item": rng.integers(0, 20, rows), "user": rng.integers(0, 10, rows)}


def _parquet(path: Path, drop: tuple[str, ...] = ()) -> str:
    pq.write_table(pa.table({k: v for k, v in _table().items() if k not in drop}), path)
    return str(path)


def _data(path: str, cls: type = ParquetData, **kw) -> ParquetData | CsvData:
    fields = {"path": path, "eval_path": path, "labels": {"ctr": "click", "gmv": "amount"}, "dense": [],
              "sparse": [{"name": "item", "num_embeddings": 20}], "batch_size": 16, "shuffle": False}
    return cls(make({ParquetData: ParquetDataConfig, CsvData: CsvDataConfig}[cls], **(fields | kw)))


@pytest.mark.parametrize(("data_kinds", "model", "message"), [
    # binary task on a label the data reads as any number: BCE trained on the amounts, then the eval's log loss failed
    # deep inside torch ("all elements of target should be between 0 and 1")
    ({"gmv": "regression"}, {}, r"task 'gmv' is binary .* but the data reads its label 'gmv' as regression .* Fix: "
                                r"data\.label_kinds\.gmv=binary, or '\+model\.task_specs\.gmv\.kind=regression' \(or huber\)"),
    # regression task on a label the data checks as 0/1: every amount was a bad row "the task is binary (BCE)"
    ({}, {"task_kinds": ["binary", "regression"]}, r"task 'gmv' is regression .* as binary .* Fix: data\.label_kinds\.gmv=regression"),
    ({"gmv": "multiclass"}, {"task_kinds": ["binary", "huber"]},
     r"task 'gmv' is huber .* as multiclass .*'\+model\.task_specs\.gmv=\{kind: multiclass, num_classes: <C>\}'"),
])
def test_task_kind_must_match_how_the_data_reads_its_label(tmp_path: Path, data_kinds: dict, model: dict, message: str) -> None:
    data = _data(_parquet(tmp_path / "a.parquet"), label_kinds=data_kinds or None)
    with pytest.raises(ConfigError, match=message):
        make(MMoEConfig, tasks=["ctr", "gmv"], **model).resolve_tasks(data.features)
    # generated data with its own data.tasks / data.label_kinds is checked the same way, rows and histories alike
    classes = {t: 3 for t, k in data_kinds.items() if k == "multiclass"} or None
    for config in (SyntheticDataConfig, SyntheticSequencesConfig):
        synthetic = make(config, tasks=["ctr", "gmv"], label_kinds=data_kinds or None, label_classes=classes).build()
        with pytest.raises(ConfigError, match=message):
            make(MMoEConfig, tasks=["ctr", "gmv"], **model).resolve_tasks(synthetic.features)


def test_agreeing_kinds_bind_by_name_whatever_the_order(tmp_path: Path) -> None:
    data = _data(_parquet(tmp_path / "a.parquet"), labels={"ctr": "click", "gmv": "amount", "cvr": "buy"},
                 label_kinds={"gmv": "regression"})
    tasks = make(MMoEConfig, tasks=["gmv", "cvr", "ctr"], task_kinds=["huber", "binary", "binary"]).resolve_tasks(data.features)
    # each task reads its own label's column of Batch.labels [B, T] (ctr, gmv, cvr), never its position's
    assert [(t.name, t.label, t.column) for t in tasks] == [("gmv", "gmv", 1), ("cvr", "cvr", 2), ("ctr", "ctr", 0)]
    batch = next(iter(data.train_batches(0, 0, 1)))
    table = _table()
    for t, column in zip(tasks, ["amount", "buy", "click"], strict=True):
        np.testing.assert_allclose(batch.labels[:, t.column].numpy(), table[column][:16], rtol=1e-6)
    # ESMM's click and conversion are binary: a conversion the data reads as a number is refused too
    with pytest.raises(ConfigError, match=r"task 'cvr' is binary .* label 'cvr' as regression"):
        make(ESMMConfig).resolve_tasks(_data(_parquet(tmp_path / "a.parquet"), labels={"ctr": "click", "cvr": "amount"},
                                             label_kinds={"cvr": "regression"}).features)


def test_a_task_spec_naming_the_files_column_says_labels_are_named_by_data_labels(tmp_path: Path) -> None:
    """``model.task_specs.ctr.label=click`` with ``data.labels={ctr: click}``: the data's label is named ``ctr``; the message
    listed ``['ctr', 'cvr']`` as "label columns" beside the file's column ``click``, and said nothing of the mapping."""
    data = _data(_parquet(tmp_path / "a.parquet"), labels={"ctr": "click", "cvr": "buy"})
    with pytest.raises(ConfigError, match=r"model\.task_specs\.ctr\.label='click' is not a label column of the data; its label "
                                          r"columns: \['ctr', 'cvr'\]\. Fix: name one of them: for files these are the names "
                                          r"data\.labels=\{name: column\} gives the file's columns, not the columns' own names"):
        make(MMoEConfig, task_specs={"ctr": {"label": "click"}}).resolve_tasks(data.features)


@pytest.mark.parametrize("kind", ["pareto", "uncertainty"])
def test_loss_weighting_over_one_task_is_refused(tmp_path: Path, kind: str) -> None:
    data = _data(_parquet(tmp_path / "a.parquet"), labels={"ctr": "click", "cvr": "buy"})
    one = make(MMoEConfig, tasks=["ctr"]).resolve_tasks(data.features)
    with pytest.raises(ConfigError, match=rf"train\.loss_weighting\.kind={kind} weights the losses of several tasks, but "
                                          rf"model\.tasks=\['ctr'\] has one: .* Fix: train\.loss_weighting\.kind=fixed"):
        LossWeightingConfig(kind=kind).build(one)
    assert LossWeightingConfig(kind=kind).build(make(MMoEConfig).resolve_tasks(data.features)) is not None


def test_csv_text_booleans_are_labels_and_other_text_names_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    path.write_text("item,click,buy\n3,True,false\n1,FALSE,true\n4,1,0\n")  # pandas writes a bool column as True/False
    data = _data(str(path), CsvData, labels={"ctr": "click", "cvr": "buy"}, drop_remainder=False)
    (batch,) = list(data.train_batches(0, 0, 1))
    assert batch.labels.tolist() == [[1, 0], [0, 1], [1, 0]]
    path.write_text("item,click,buy\n3,1,yes\n")
    with pytest.raises(DataError, match=r"log\.csv, line 2, column 'buy': 'yes' is not a number, but it is a label, and a label "
                                        r"is a number: 0 or 1 for a binary task \(true/false also read as 1/0\)"):
        list(_data(str(path), CsvData, labels={"ctr": "click", "cvr": "buy"}).train_batches(0, 0, 1))


def test_a_decimal_label_column_reads_as_numbers(tmp_path: Path) -> None:
    """A SQL export's ``DECIMAL(10, 2)`` amount was refused for the whole column as "not a number", with a fix for text."""
    amounts = [Decimal("12.50"), Decimal("0.00"), Decimal("-3.25"), None]
    pq.write_table(pa.table({"click": [1, 0, 1, 0], "amount": pa.array(amounts, pa.decimal128(10, 2)), "item": [1, 2, 3, 4]}),
                   tmp_path / "d.parquet")
    data = _data(str(tmp_path / "d.parquet"), label_kinds={"gmv": "regression"}, batch_size=3, on_bad_rows="skip")
    (batch,) = list(data.train_batches(0, 0, 1))  # the null amount is a bad row, skipped and counted
    assert batch.labels.tolist() == [[1, 12.5], [0, 0], [1, -3.25]]


def _train(tmp_path: Path, train_file: str, *extra: str, labels: str = "{ctr: click, cvr: buy}") -> list[str]:
    """MMoE trained 2 steps on ``train_file`` (tasks ``[cvr, ctr]``, the data's labels ``{ctr, cvr}``); its overrides."""
    overrides = ["model=mmoe", "model.tasks=[cvr,ctr]", "data=parquet", f"data.path={train_file}", "data.label=null",
                 f"data.labels={labels}", "data.sparse=[{name: item}, {name: user}]", "data.batch_size=16",
                 "train.num_steps=2", "train.eval_every_steps=null", "distributed.device=cpu", "tracking=none",
                 f"checkpoint.dir={tmp_path}/ck", *extra]
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        train(compose(config_name="config", overrides=overrides))
    return overrides


def test_a_negative_sample_weight_stops_training(tmp_path: Path) -> None:
    """A sample-weight column is read as any finite number; a negative weight trained its row's loss upwards, silently."""
    table = _table()
    table["w"] = np.where(np.arange(ROWS) == 5, -2.0, 1.0)
    pq.write_table(pa.table(table), tmp_path / "w.parquet")
    with pytest.raises(DataError, match=r"task 'cvr': its sample-weight column \(model\.task_specs\.cvr\.sample_weight\) holds -2 "
                                        r"in this training batch, but a row's weight in the loss must be >= 0"):
        _train(tmp_path, str(tmp_path / "w.parquet"), "data.label_kinds={w: regression}", "+model.task_specs.cvr.sample_weight=w",
               "checkpoint=none", labels="{ctr: click, cvr: buy, w: w}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """An MMoE checkpoint for this module's predict and evaluate (tasks ``[cvr, ctr]``): its directory and overrides."""
    root = tmp_path_factory.mktemp("task_fuzz")
    return root, _train(root, _parquet(root / "train.parquet"))


def test_predict_of_a_multi_task_checkpoint_on_files_without_labels(trained: tuple[Path, list[str]], tmp_path: Path) -> None:
    """The files to score may lack the label columns (docs/lifecycle.md): predict listed the files it scores for its
    run's dataset input with the training's columns, labels included, and refused such an input."""
    root, overrides = trained
    (tmp_path / "score").mkdir()
    _parquet(tmp_path / "score" / "b.parquet", drop=("click", "buy", "amount"))
    result = predict.run(compose_entry("predict", *overrides, f"load={root}/ck", f"predict.input={tmp_path}/score",
                                       f"predict.output={tmp_path}/out", "predict.columns=[item,user]"))
    written = pq.read_table(result.parts[0])
    assert result.rows == ROWS and written.column_names == ["item", "user", "score_cvr", "score_ctr"]
    assert written["item"].to_pylist() == _table()["item"].tolist()
    # scoring that output again, its score column copied through: two columns score_ctr made parts Arrow cannot read back
    with pytest.raises(ConfigError, match=r"predict\.columns copies \['score_ctr'\], which predict writes itself \(this model's "
                                          r"output columns: \['score_cvr', 'score_ctr'\]\)"):
        predict.run(compose_entry("predict", *overrides, f"load={root}/ck", f"predict.input={tmp_path}/out",
                                  f"predict.output={tmp_path}/again", "predict.columns=[item,user,score_ctr]"))
    assert not list((tmp_path / "again").glob("*part-*"))


def test_evaluate_reads_the_label_columns_the_command_names(trained: tuple[Path, list[str]], tmp_path: Path) -> None:
    """Labels are not encoders: evaluate read the checkpoint's stored label columns whatever data.labels said, so a file
    whose labels are named otherwise was refused and a swapped mapping scored each task against its training column."""
    root, overrides = trained
    load = f"load={root}/ck"
    first = evaluate.run(compose_entry("evaluate", *overrides, load, f"data.eval_path={root}/train.parquet"))
    renamed = tmp_path / "renamed.parquet"
    pq.write_table(pa.table(_table()).rename_columns(["is_click", "is_buy", "amount", "item", "user"]), renamed)
    again = evaluate.run(compose_entry("evaluate", *overrides, load, f"data.path={renamed}", f"data.eval_path={renamed}",
                                       "data.labels={ctr: is_click, cvr: is_buy}"))
    assert again == first  # the same rows and labels under other column names
    swapped = evaluate.run(compose_entry("evaluate", *overrides, load, f"data.eval_path={root}/train.parquet",
                                         "data.labels={ctr: buy, cvr: click}"))
    assert swapped["eval/ctr/auc"] != first["eval/ctr/auc"] and swapped["eval/cvr/auc"] != first["eval/cvr/auc"]
