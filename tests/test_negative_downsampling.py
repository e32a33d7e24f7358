"""``data.negative_rate``: every positive and a hashed fraction of the negatives trained, the same rows over ranks, workers
and shuffles; the model's outputs corrected by ``log(r)`` wherever they are scored, by the rate the checkpoint stores."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys_runner import evaluate, export, predict
from recsys_runner.__main__ import run as train
from recsys_runner.build import _total_steps
from recsys_runner.checkpoint.resume_changes import treatment
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.files.downsample import SAMPLING_FILE
from recsys_runner.data.files.tabular import ParquetData
from recsys_runner.data.files.tabular_config import ParquetDataConfig
from recsys_runner.errors import ConfigError
from recsys_runner.overrides import explain
from recsys_runner.serving import mlflow_model
from tests.test_evaluate import compose_entry

RATE = 0.25
CTR = 0.1
"""The true click rate of :func:`ctr_files`: every row's label is a Bernoulli(CTR) draw, whatever its features."""


def id_files(tmp_path: Path, n: int = 400) -> Path:
    """Two Parquet files of ``n`` rows each, about 20% positives, each row's id in ``rid`` (row groups of 37 rows)."""
    rng = np.random.default_rng(0)
    for name, first in (("a", 0), ("b", n)):
        labels = (rng.random(n) < 0.2).astype(np.int8)
        pq.write_table(pa.table({"label": labels, "rid": np.arange(first, first + n)}), tmp_path / f"{name}.parquet", row_group_size=37)
    return tmp_path


def id_data(path: Path, **kw) -> ParquetData:
    args = {"path": str(path), "batch_size": 8, "sparse": [{"name": "rid", "num_embeddings": 800}], "negative_rate": RATE,
            "drop_remainder": False, "eval_fraction": 0.2} | kw
    return ParquetData(make(ParquetDataConfig, **args))


def rows(batches) -> list[tuple[int, int]]:
    """(row id, label) of every row of ``batches``, sorted."""
    return sorted((int(i), int(y)) for b in batches for i, y in zip(b.sparse_features["rid"].values().tolist(), b.labels.tolist(), strict=True))


def test_the_rows_kept_are_the_same_over_ranks_workers_and_epochs_every_positive_and_about_r_of_the_negatives(tmp_path: Path) -> None:
    path = id_files(tmp_path)
    one = id_data(path)
    kept = rows(one.train_batches(0, 0, 1))
    every = rows(id_data(path, negative_rate=None).train_batches(0, 0, 1))
    two = id_data(path, num_workers=2)
    assert sorted(sum((rows(two.train_batches(3, r, 2)) for r in range(2)), [])) == kept  # 2 ranks x 2 workers, another epoch
    assert rows(id_data(path, shuffle=False).train_batches(0, 0, 1)) == kept
    positives, negatives = [r for r in every if r[1] == 1], [r for r in every if r[1] == 0]
    assert [r for r in kept if r[1] == 1] == positives
    share = sum(1 for r in kept if r[1] == 0) / len(negatives)
    assert abs(share - RATE) < 0.07, share
    assert one.metrics()["data/negatives_downsampled"] == len(every) - len(kept)
    assert one.num_train_batches(1) is None  # known only by reading: ranks agree step by step (synchronized)
    assert rows(one.eval_batches(0, 1)) == rows(id_data(path, negative_rate=None).eval_batches(0, 1))  # eval rows: all
    assert rows(id_data(path, seed=1).train_batches(0, 0, 1)) != kept  # data.seed chooses the negatives


@pytest.mark.parametrize("rate", [0, -0.5, 1.5])
def test_a_rate_outside_0_1_is_refused_naming_the_key(tmp_path: Path, rate: float) -> None:
    with pytest.raises(ConfigError, match=r"data.negative_rate=.* must lie in \(0, 1\]"):
        make(ParquetDataConfig, path=str(tmp_path), negative_rate=rate)


def test_several_labels_and_models_other_than_one_binary_task_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.negative_rate=0.5 downsamples the negatives of one binary label, but data.labels"):
        make(ParquetDataConfig, path=str(tmp_path), negative_rate=0.5, labels={"ctr": "click", "cvr": "buy"})
    pq.write_table(pa.table({"click": [0, 1], "buy": [0, 1], "item_id": [1, 2], "user_id": [1, 2]}), tmp_path / "a.parquet")
    files = ("tracking=none", "data=parquet", f"data.path={tmp_path}", "data.negative_rate=0.5")
    with pytest.raises(ConfigError, match=r"but this is a model of 2 tasks .*Fix: data.negative_rate=null"):
        validate(compose_entry("config", *files, "model=mmoe"))
    with pytest.raises(ConfigError, match=r"but this is a two-tower \(retrieval\) model"):
        validate(compose_entry("config", *files, "model=dssm", "data.label=click"))
    # generated data has no such key (its rows are drawn, none downsampled): named as the file options' key
    with pytest.raises(ConfigError, match=r"negative_rate is a key of data=parquet, csv, criteo, criteo_npy, not of the data chosen"):
        explain("config", ["data.negative_rate=0.5"])


def test_a_resume_refuses_another_rate() -> None:
    assert treatment("data.negative_rate", None, 0.5)[0] == "refuse"
    assert treatment("data.negative_rate", 0.5, 0.25)[0] == "refuse"


def test_a_preset_counting_epochs_is_told_to_count_steps_and_drop_its_epochs(tmp_path: Path) -> None:
    # experiment=criteo_tsv sets train.num_epochs=1: 'set train.num_steps' alone met 'both are set' on the next launch
    run = validate(compose_entry("config", "experiment=criteo_tsv", f"data.path={tmp_path}/train.txt", "data.negative_rate=0.1",
                                 "tracking=none"))
    with pytest.raises(ConfigError, match=r"train.num_epochs=1 needs to know .*Fix: set train.num_steps=<steps> train.num_epochs=null,"):
        _total_steps(run, None)


def test_a_rate_of_one_trains_every_row_and_keeps_the_epochs_length(tmp_path: Path) -> None:
    # a sweep's baseline (data.negative_rate=0.1,0.3,1): rate 1 drops nothing, so train.num_epochs must not be refused
    root = id_files(tmp_path)
    every, one = id_data(root, negative_rate=None), id_data(root, negative_rate=1.0)
    assert one.num_train_batches(1) == every.num_train_batches(1) is not None
    assert rows(one.train_batches(0, 0, 1)) == rows(every.train_batches(0, 0, 1))


def ctr_files(root: Path) -> Path:
    """Training and eval Parquet files whose labels are Bernoulli(:data:`CTR`) draws independent of the features."""
    rng = np.random.default_rng(7)
    for name, n in (("train", 12000), ("eval", 6000)):
        (root / name).mkdir(parents=True)
        table = pa.table({"label": (rng.random(n) < CTR).astype(np.int8), "item": rng.integers(0, 50, n),
                          "price": rng.random(n).astype(np.float32)})
        pq.write_table(table, root / name / "part-0.parquet")
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """A logistic regression trained with ``data.negative_rate`` on :func:`ctr_files`: the overrides and its checkpoint."""
    root = ctr_files(tmp_path_factory.mktemp("ctr"))
    overrides = ["model=lr", "optim=adagrad", "optim.lr=0.2", "data=parquet", f"data.path={root}/train", f"data.eval_path={root}/eval",
                 "data.label=label", "data.dense=[{name: price}]", "data.sparse=[{name: item, num_embeddings: 64}]",
                 "data.batch_size=128", "train.num_steps=100", "train.eval_every_steps=null", "distributed.device=cpu",
                 "tracking=none", "metrics.eval=[auc,logloss,calibration]", f"checkpoint.dir={root}/ck"]
    train(compose_entry("config", *overrides, f"data.negative_rate={RATE}"))
    (checkpoint,) = sorted((root / "ck").glob("step_*"))
    return overrides, checkpoint


def test_evaluate_and_predict_correct_the_outputs_by_the_checkpoints_rate(trained: tuple[list[str], Path], tmp_path: Path) -> None:
    overrides, checkpoint = trained
    assert json.loads((checkpoint / SAMPLING_FILE).read_text()) == {"negative_rate": RATE}
    # Without data.negative_rate here: the checkpoint's rate corrects the scores, so the mean score is the true CTR
    metrics = evaluate.run(compose_entry("evaluate", *overrides, f"load={checkpoint}"))
    assert abs(metrics["eval/calibration"] - 1) < 0.25, metrics
    scored = predict.run(compose_entry("predict", *overrides, f"load={checkpoint}", f"predict.output={tmp_path}/q"))
    q = pq.read_table(scored.output).column("score").to_numpy().astype(np.float64)
    assert abs(q.mean() - CTR) < 0.025, q.mean()
    # The same weights read as if trained on every row: the scores of the downsampled rows, log(r) apart in logit
    uncorrected = tmp_path / "uncorrected"
    shutil.copytree(checkpoint, uncorrected)
    (uncorrected / SAMPLING_FILE).unlink()
    scored = predict.run(compose_entry("predict", *overrides, f"load={uncorrected}", f"predict.output={tmp_path}/p"))
    p = pq.read_table(scored.output).column("score").to_numpy().astype(np.float64)
    assert p.mean() > 2 * CTR, p.mean()  # about CTR / (CTR + (1 - CTR) * RATE) = 0.31
    logit = lambda x: np.log(x) - np.log1p(-x)  # noqa: E731
    assert np.allclose(logit(q) - logit(p), math.log(RATE), atol=1e-4)
    assert evaluate.run(compose_entry("evaluate", *overrides, f"load={uncorrected}"))["eval/calibration"] > 2


def test_a_command_that_states_another_rate_than_the_checkpoints_is_refused(trained: tuple[list[str], Path]) -> None:
    overrides, checkpoint = trained
    with pytest.raises(ConfigError, match=rf"data.negative_rate=0.5, but checkpoint .* was trained with data.negative_rate={RATE}"):
        evaluate.run(compose_entry("evaluate", *overrides, "data.negative_rate=0.5", f"load={checkpoint}"))


@pytest.mark.parametrize("vocabulary", ["extend", "refit"])
def test_a_fine_tune_that_extends_or_refits_the_vocabulary_stores_its_rate_too(trained: tuple[list[str], Path], tmp_path: Path,
                                                                               vocabulary: str) -> None:
    # refit/extend build the data their own way: their checkpoints lacked sampling.json, so evaluate, predict and
    # export of the fine-tune (carrying data.negative_rate from its launch) refused it as 'trained with every negative'
    overrides, checkpoint = trained
    tuned = [*overrides, f"data.negative_rate={RATE}", "train.num_steps=2", f"checkpoint.dir={tmp_path}/ck"]
    train(compose_entry("config", *tuned, f"checkpoint.init_from={checkpoint}", f"data.vocabulary={vocabulary}"))
    (fine_tuned,) = sorted((tmp_path / "ck").glob("step_*"))
    assert json.loads((fine_tuned / SAMPLING_FILE).read_text()) == {"negative_rate": RATE}
    assert "eval/auc" in evaluate.run(compose_entry("evaluate", *tuned, f"load={fine_tuned}"))


@pytest.mark.slow  # ~7 s: torch.export and the MLflow model's own check
def test_the_export_and_its_mlflow_model_serve_the_corrected_probabilities(trained: tuple[list[str], Path], tmp_path: Path) -> None:
    overrides, checkpoint = trained
    out = export.run(compose_entry("export", *overrides, f"load={checkpoint}", f"export.dir={tmp_path}/export"))
    spec = json.loads((out / export.FEATURE_SPEC_FILE).read_text())
    assert spec["negative_rate"] == RATE and "log(0.25)" in spec["calibration"]
    example = torch.load(out / export.EXAMPLE_FILE)
    program = torch.export.load(str(out / export.MODEL_FILE)).module()
    q = torch.sigmoid(program(*example["inputs"])).double()
    assert abs(float(q.mean()) - CTR) < 0.03, float(q.mean())  # the probability on all rows, not on the downsampled ones
    rows = pq.read_table(checkpoint.parent.parent / "eval" / "part-0.parquet").slice(0, 200).to_pandas().drop(columns=["label"]).astype(str)
    served = mlflow.pyfunc.load_model(str(out / mlflow_model.MODEL_DIR)).predict(rows)
    scored = predict.run(compose_entry("predict", *overrides, f"load={checkpoint}", f"predict.input={checkpoint.parent.parent}/eval",
                                       f"predict.output={tmp_path}/q"))
    want = pq.read_table(scored.output).column("score").to_numpy()[:200]
    assert np.allclose(served["score"].to_numpy(), want, atol=1e-5)
