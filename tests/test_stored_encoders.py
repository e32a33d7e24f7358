"""The data's encoders are fitted once, when training starts, and travel with every checkpoint (issue 29).

The scenario that failed silently: a CSV whose id columns get inferred vocabularies; a day of rows is appended to the
training file; ``evaluate`` of the same checkpoint on the same eval file must give the same eval/auc (it gave 0.50:
the vocabulary, rebuilt from the grown file, moved every id to another row), ``predict`` the same scores, and a resume
on the grown file the same id → row mapping. Files that contradict the stored encoders are refused naming the column;
a checkpoint written before encoders were stored still loads, with a warning.
"""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys_runner import evaluate, predict
from recsys_runner.__main__ import run as train
from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.encoding.stored import ENCODERS_FILE, StoredEncoders, from_json, stored_types
from recsys_runner.data.files.tabular import CsvData, ParquetData
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig
from recsys_runner.data.generated.generate import write_criteo_parquet
from recsys_runner.data_build import build_data
from recsys_runner.errors import DataError
from recsys_runner.serving.files import build_unsharded, served_rows
from recsys_runner.train.log_line import in_the_line, line_extra
from tests.test_data_infer import write_hours
from tests.test_evaluate import compose_entry


def _rows(rng: np.random.Generator, n: int, users: list[str], items: int) -> list[str]:
    """``label,user,item`` rows: the label follows the user (even users click, 90 %), so only the user's own row learns it."""
    out = []
    for _ in range(n):
        k = int(rng.integers(len(users)))
        label = int((k % 2 == 0) == (rng.random() < 0.9))
        out.append(f"{label},{users[k]},{int(rng.integers(items))}")
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One training run on the original files: its checkpoint, files and overrides."""
    root = tmp_path_factory.mktemp("encoders")
    rng = np.random.default_rng(0)
    users = [f"u{k}" for k in range(60)]
    original = "\n".join(["label,user,item", *_rows(rng, 6000, users, 40)]) + "\n"
    (root / "train.csv").write_text(original)
    (root / "eval.csv").write_text("\n".join(["label,user,item", *_rows(rng, 1500, users, 40)]) + "\n")
    data = ["data=csv", f"data.path={root}/train.csv", f"data.eval_path={root}/eval.csv", "data.batch_size=128",
            "data.shuffle=false", "model=deepfm", "optim=adagrad", "optim.sparse.lr=0.1", "distributed.device=cpu", "tracking=none"]
    train(compose_entry("config", *data, "train.num_steps=40", "train.log_every_steps=20", f"checkpoint.dir={root}/ck"))
    return {"root": root, "data": data, "checkpoint": root / "ck" / "step_00000040", "rng": rng, "original": original}


def _evaluate(trained: dict[str, Any], *extra: str) -> dict[str, float]:
    return evaluate.run(compose_entry("evaluate", *trained["data"], f"load={trained['checkpoint']}", *extra))


def _scores(trained: dict[str, Any], out: Path, input: str | None = None) -> np.ndarray:
    predict.run(compose_entry("predict", *trained["data"], f"load={trained['checkpoint']}",
                              f"predict.input={input or str(trained['root']) + '/eval.csv'}", f"predict.output={out}"))
    return np.concatenate([pq.read_table(p).column("score").to_numpy() for p in sorted(out.rglob("*.parquet"))])


def test_appended_rows_change_neither_evaluate_nor_predict_nor_resume(trained: dict[str, Any], tmp_path: Path) -> None:
    root, checkpoint = trained["root"], trained["checkpoint"]
    stored = json.loads((checkpoint / ENCODERS_FILE).read_text())
    assert {"user", "item"} <= set(stored["vocabularies"]) and stored["column_kinds"] == {"user": "text", "item": "number", "label": "number"}
    before = _evaluate(trained)
    scores = _scores(trained, tmp_path / "before")
    assert before["eval/auc"] > 0.75, f"the model must have learned the users for the test to mean anything: {before}"

    # A day of data: 4,000 rows of the last 20 users, now each far more frequent than the others. The vocabulary's size
    # stays, its order (most frequent first) does not: fitted again, nearly every user would read another user's row.
    with open(root / "train.csv", "a") as f:
        f.write("\n".join(_rows(trained["rng"], 4000, [f"u{k}" for k in range(40, 60)], 40)) + "\n")
    after = _evaluate(trained)
    assert after["eval/auc"] == pytest.approx(before["eval/auc"], abs=1e-6)
    assert after["eval/logloss"] == pytest.approx(before["eval/logloss"], abs=1e-6)
    np.testing.assert_allclose(_scores(trained, tmp_path / "after"), scores, atol=1e-6)

    # resume on the grown file: the stored vocabulary, not one fitted on the grown file
    c = build(validate(compose_entry("config", *trained["data"], "train.num_steps=45", f"checkpoint.dir={root}/ck")))
    try:
        schema, _ = from_json((checkpoint / ENCODERS_FILE).read_bytes(), "test")
        for name in ("user", "item"):
            np.testing.assert_array_equal(c.loop.data.schema.vocabularies[name].keys, schema.vocabularies[name].keys)
            np.testing.assert_array_equal(c.loop.data.schema.vocabularies[name].rows, schema.vocabularies[name].rows)
        assert c.loop.state.step == 40
    finally:
        c.close()
    # fine-tuning on the grown file (checkpoint.init_from) keeps the stored vocabulary too
    c = build(validate(compose_entry("config", *trained["data"], f"checkpoint.init_from={checkpoint}", f"checkpoint.dir={tmp_path}/ft")))
    try:
        np.testing.assert_array_equal(c.loop.data.schema.vocabularies["user"].rows, schema.vocabularies["user"].rows)
    finally:
        c.close()


def test_the_training_run_logs_its_encoders_to_mlflow(trained: dict[str, Any], mlflow_uri: str, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    from mlflow.tracking import MlflowClient

    (tmp_path / "train.csv").write_text(trained["original"])
    data = [o for o in trained["data"] if o != "tracking=none"]
    with caplog.at_level(logging.INFO, logger="recsys_runner.train.loop"):
        train(compose_entry("config", *data, f"data.path={tmp_path}/train.csv", "train.num_steps=2", "checkpoint=none",
                            "train.log_every_steps=1", f"tracking.uri={mlflow_uri}", "tracking.experiment=stored_encoders"))
    # the step lines show no rate or counter at 0 (Criteo's 26 vocabularies made each line ~1,600 characters), and say
    # what they leave to the run's metrics
    (line, *_) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1/2 train/loss=")]
    assert "oov_rate/user=" not in line and "oov_rate/item=" not in line and "data/bad_rows_skipped" not in line, line
    assert "(+2 lower data/oov_rate/<column> in the run's metrics)" in line, line
    rates = {f"data/oov_rate/cat_{i}": i / 100 for i in range(26)}  # Criteo's 26: the three highest are shown
    metrics = {"train/loss": 0.5, **rates, "data/truncated_histories": 0.0, "data/bad_rows_skipped": 3.0}
    assert list(in_the_line(metrics)) == ["train/loss", *(f"data/oov_rate/cat_{i}" for i in (23, 24, 25)), "data/bad_rows_skipped"]
    assert line_extra(metrics) == " (+23 lower data/oov_rate/<column> in the run's metrics)"
    client = MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("stored_encoders").experiment_id])
    logged = json.loads(Path(client.download_artifacts(run.info.run_id, ENCODERS_FILE, str(tmp_path))).read_text())
    assert logged["column_kinds"] == {"label": "number", "user": "text", "item": "number"}
    assert len(logged["vocabularies"]["user"]["keys"]) == 60
    # every training value has a row of its own (the vocabulary was fitted on these very files)
    assert run.data.metrics["data/oov_rate/user"] == 0.0 and run.data.metrics["data/oov_rate/item"] == 0.0


def test_values_unseen_at_training_read_oov_rows_and_their_share_is_reported(trained: dict[str, Any], tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(1)
    half_new = [f"u{k}" for k in range(10)] + [f"cold{k}" for k in range(10)]  # half the users never seen in training
    (tmp_path / "eval.csv").write_text("\n".join(["label,user,item", *_rows(rng, 2000, half_new, 40)]) + "\n")
    with caplog.at_level(logging.INFO, logger="recsys_runner"):
        _evaluate(trained, f"data.eval_path={tmp_path}/eval.csv")
        _scores(trained, tmp_path / "scores", f"{tmp_path}/eval.csv")
    lines = [r.getMessage() for r in caplog.records if "values unseen when the vocabularies were fitted" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("evaluate: ") and lines[1].startswith("predict: ")
    for line in lines:
        share = float(line.split("user ")[1].split("%")[0]) / 100
        assert 0.4 < share < 0.6 and "item 0.00%" in line, line


def test_files_that_contradict_the_stored_encoders_are_refused(trained: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "no_user.csv").write_text("label,item\n1,3\n0,4\n")
    with pytest.raises(DataError, match=r"has no column 'user', which the model was trained on \(its encoders are stored in"):
        _evaluate(trained, f"data.eval_path={tmp_path}/no_user.csv", f"data.path={tmp_path}/no_user.csv")
    (tmp_path / "int_users.csv").write_text("label,user,item\n1,3,3\n0,4,4\n")
    with pytest.raises(DataError, match=r"column 'user' of .* holds number values, but the model was trained on text values"):
        _evaluate(trained, f"data.eval_path={tmp_path}/int_users.csv", f"data.path={tmp_path}/int_users.csv")


def test_a_checkpoint_without_stored_encoders_loads_with_a_warning(trained: dict[str, Any], tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    old = tmp_path / "step_00000040"
    shutil.copytree(trained["checkpoint"], old)
    (old / ENCODERS_FILE).unlink()
    (tmp_path / "train.csv").write_text(trained["original"])  # the files it was trained on (another test grows the shared one)
    with caplog.at_level(logging.WARNING, logger="recsys_runner.build"):
        metrics = evaluate.run(compose_entry("evaluate", *trained["data"], f"data.path={tmp_path}/train.csv", f"load={old}"))
    assert "eval/auc" in metrics
    assert any("stores no data encoders" in r.getMessage() and "fitted on the data again" in r.getMessage() for r in caplog.records)


def test_a_checkpoint_without_stored_encoders_is_fitted_again_on_the_first_rows(make_cfg, tmp_path: Path) -> None:
    """A new run fits its encoders on rows spread over the files (tests/test_data_infer.py); a checkpoint written before
    encoders were stored was fitted on the files' first data.infer.sample_rows rows, and its ids keep their trained rows
    only if refitted so: training (resume, init_from), evaluate, predict (build_data) and export (build_unsharded) alike."""
    write_hours(tmp_path / "log.parquet", range(0, 12))  # time-sorted: the first 2,000 rows are hours 0-3
    step = tmp_path / "step_00000040"
    step.mkdir()
    (step / "meta.json").write_text(json.dumps({"step": 40, "overrides": [], "config": {"data": "parquet"}}))
    run = validate(make_cfg("data=parquet", f"data.path={tmp_path}/log.parquet", "data.label=click", "data.sparse=[{name: hour}]",
                            "data.infer.sample_rows=2000", "model=deepfm", "distributed.device=cpu", "tracking=none", tiny=False))
    new = build_data(run, torch.device("cpu"), None).schema.vocabularies["hour"]
    old = build_data(run, torch.device("cpu"), step).schema.vocabularies["hour"]
    exported = build_unsharded(run, None).data.schema.vocabularies["hour"]
    assert new.size >= 10 and old.size == exported.size == 4
    head = ParquetData(run.data, fit_on_head=True).schema.vocabularies["hour"]  # the fit of the code before the spread sample
    for refit in (old, exported):
        np.testing.assert_array_equal(refit.keys, head.keys)
        np.testing.assert_array_equal(refit.rows, head.rows)
    # the same file as CSV (plain text, whose sample is read from byte offsets spread over it)
    (tmp_path / "log.csv").write_text(pq.read_table(tmp_path / "log.parquet").to_pandas().to_csv(index=False))
    run = validate(make_cfg("data=csv", f"data.path={tmp_path}/log.csv", "data.label=click", "data.sparse=[{name: hour}]",
                            "data.infer.sample_rows=2000", "model=deepfm", "distributed.device=cpu", "tracking=none", tiny=False))
    assert build_data(run, torch.device("cpu"), None).schema.vocabularies["hour"].size >= 10
    assert build_data(run, torch.device("cpu"), step).schema.vocabularies["hour"].size == 4


def test_a_checkpoint_trained_on_generated_data_is_not_said_to_predate_stored_encoders(make_cfg, tmp_path: Path,
                                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """``make run``'s checkpoint (``data=synthetic``, its ``meta.json`` as the CLI writes it) scored on Criteo-shaped
    Parquet: it stores no encoders because generated data fits none. The warning said it was written before encoders
    were stored, and export asked for a fine-tune "with this version", sending a newcomer after an upgrade that exists."""
    step = tmp_path / "step_00001000"
    step.mkdir()
    config = {"data": "synthetic", "data._target_": "recsys_runner.data.generated.synthetic.SyntheticData"}
    (step / "meta.json").write_text(json.dumps({"step": 1000, "overrides": [], "config": config}))
    write_criteo_parquet(str(tmp_path / "day.parquet"), 300, num_embeddings=1000)
    run = validate(make_cfg("data=parquet", f"data.path={tmp_path}/day.parquet", "distributed.device=cpu", tiny=False))
    with caplog.at_level(logging.INFO):
        build_data(run, torch.device("cpu"), step)
        assert served_rows(None, step, raw=object(), null_values=[]) is None
    said = [r.getMessage() for r in caplog.records if str(step) in r.getMessage() or "MLflow model" in r.getMessage()]
    assert any("was trained on generated data (data=synthetic)" in m for m in said), said
    assert any(m.startswith("no MLflow model: the model was trained on generated data") for m in said), said
    assert not any("written before" in m or "fine-tune" in m for m in said), said


def test_ids_of_another_type_than_in_training_are_refused_not_read_as_oov(tmp_path: Path) -> None:
    """A model trained on Parquet int64 ids, scored on the same ids written as text (or a CSV: every column text): each
    id keyed another vocabulary row, and predict wrote an untrained model's scores with only an INFO line saying
    'user 100.00%' OOV. Refused for data.path, data.eval_path and predict.input, naming the column and both types."""
    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"label": [0, 1] * 20, "user": list(range(40)), "item": [3] * 40}), ints)
    texts = tmp_path / "texts.parquet"
    pq.write_table(pa.table({"label": [0, 1] * 20, "user": [str(u) for u in range(40)], "item": [3] * 40}), texts)
    (tmp_path / "texts.csv").write_text("label,user,item\n" + "".join(f"{k % 2},{k},3\n" for k in range(40)))
    sparse = [{"name": "user"}, {"name": "item", "num_embeddings": 8}]  # user: an inferred vocabulary; item: ids
    fitted = ParquetData(make(ParquetDataConfig, path=str(ints), batch_size=4, sparse=sparse))
    document = fitted.encoders_document()
    schema, kinds = from_json(document, "ck")
    stored = StoredEncoders(schema, kinds, "ck", stored_types(document))
    refused = r"column 'user' of {where} holds string values, but the model was trained on int64 values in it .*Fix: give " \
              r"the column the training files' type, int64"
    with pytest.raises(DataError, match=refused.format(where=r"data.path='.*texts\.parquet'")):
        ParquetData(make(ParquetDataConfig, path=str(texts), batch_size=4, sparse=sparse), encoders=stored)
    with pytest.raises(DataError, match=refused.format(where=r"data.path='.*texts\.csv'")):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "texts.csv"), batch_size=4, sparse=sparse), encoders=stored)
    data = ParquetData(make(ParquetDataConfig, path=str(ints), batch_size=4, sparse=sparse), encoders=stored)
    without_labels = tmp_path / "to_score.parquet"
    pq.write_table(pq.read_table(texts).drop_columns(["label"]), without_labels)
    scored = data.open_files(str(without_labels), "predict.input")
    scored.columns = ["user", "item"]  # as predict reads them: the features, no label
    with pytest.raises(DataError, match=refused.format(where=r"predict.input='.*to_score\.parquet'")):
        data.check_trained(scored, f"predict.input={str(without_labels)!r}", optional=["label"])
    # 'item' (encoding=id) reads "3" and 3 alike: no error for ids of the training's type in its column
    pq.write_table(pq.read_table(ints).drop_columns(["label"]).set_column(1, "item", pa.array(["3"] * 40)), without_labels)
    data.check_trained(scored, "predict.input", optional=["label"])


def test_a_vocabulary_fitted_on_rows_unlike_the_rest_is_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A gzip-compressed file sorted by time (Avazu's train.csv.gz: its first 100,000 rows are its first hour), whose sample
    is its first rows (its later lines are reached only by decompressing those before them), gives the vocabulary of
    ``hour`` the first hours alone, which looked like a covered column (every value seen often): every later row's hour
    read the column's OOV rows, said by nothing but ``data/oov_rate/hour`` among 20 other rates. The run says it once,
    naming the column, the share and the fix; a column the sample did cover (``item``) is not named."""
    rng = np.random.default_rng(0)
    lines = [f"{int(rng.random() < 0.3)},h{i * 50 // 12_000},{int(rng.integers(20))}" for i in range(12_000)]  # hours in order
    (tmp_path / "train.csv.gz").write_bytes(gzip.compress(("\n".join(["label,hour,item", *lines]) + "\n").encode()))
    with caplog.at_level(logging.WARNING, logger="recsys_runner.train.loop"):
        train(compose_entry("config", "data=csv", f"data.path={tmp_path}/train.csv.gz", "data.label=label", "data.batch_size=1000",
                            "data.eval_fraction=0.01", "data.infer.sample_rows=960", "model=lr", "train.num_epochs=1",
                            "train.num_steps=null", "train.log_every_steps=5", "distributed.device=cpu", "tracking=none",
                            "checkpoint=none"))
    said = [r.getMessage() for r in caplog.records if "the vocabulary of" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("the vocabulary of 'hour' lacks 9"), said  # 4 of 50 hours fitted
    assert "data.infer.sample_rows=<every row of the files>" in said[0]
