"""What the MLflow UI shows of each run (issue 33, part A): the experiment's kind, each run's datasets, its source and,
after an export, its model — asserted through ``MlflowClient``, which reads what the UI reads.

One module-scoped training on a small CSV (a multi-hot column among its columns) is shared: an evaluate of its
checkpoint on the same file, an export of it, then an evaluate after rows were appended to the file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from recsys_runner import evaluate, export, predict
from recsys_runner.__main__ import run as train
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.errors import ConfigError
from recsys_runner.tracking import datasets
from recsys_runner.tracking.store import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, experiment_id, ui_url
from recsys_runner.tracking.tracker import MlflowTracker, MlflowTrackingConfig
from tests.conftest import TINY, LogWarnings
from tests.test_evaluate import compose_entry
from tests.test_mlflow_model import _click_rows

STEPS = 3
EXPERIMENT = "datasets"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A DeepFM trained a few steps on a CSV, evaluated on the same file, exported with its MLflow model, then evaluated
    again after rows were appended to the file."""
    root = tmp_path_factory.mktemp("datasets")
    uri = f"sqlite:///{root}/mlflow.db"
    header = "click,user,item,price,tags"
    rng = np.random.default_rng(0)
    path = root / "train.csv"
    path.write_text("\n".join([header, *_click_rows(rng, 1200, [f"u{k}" for k in range(30)])]) + "\n")
    data = ["data=csv", f"data.path={path}", "data.batch_size=64", "data.sparse=[{name: user}, {name: item}, "
            "{name: tags, separator: '|'}]", "data.dense=[{name: price}]", "data.label=click", "model=deepfm",
            "distributed.device=cpu", f"tracking.uri={uri}", f"tracking.experiment={EXPERIMENT}", "train.eval_max_batches=2"]
    train(compose_entry("config", *data, f"train.num_steps={STEPS}", "train.log_every_steps=3", f"checkpoint.dir={root}/ck"))
    checkpoint = root / "ck" / f"step_{STEPS:08d}"
    evaluate.run(compose_entry("evaluate", *data, f"load={checkpoint}"))
    export.run(compose_entry("export", *data, f"load={checkpoint}", f"export.dir={root}/export", "export.mlflow_model=true"))
    (root / "score.csv").write_text("\n".join([header, *_click_rows(rng, 50, ["u1", "u3"])]) + "\n")
    predict.run(compose_entry("predict", *data, f"load={checkpoint}", f"predict.input={root}/score.csv", f"predict.output={root}/scores"))
    with path.open("a") as f:
        f.write("\n".join(_click_rows(rng, 100, ["u1", "u2"])) + "\n")
    with LogWarnings() as warned:
        evaluate.run(compose_entry("evaluate", *data, f"load={checkpoint}"))
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    return {"root": root, "client": client, "experiment": experiment, "runs": runs, "checkpoint": checkpoint, "warned": warned.messages,
            "path": path}


def _by_entry(runs: list[Any], entry: str | None) -> list[Any]:
    return [r for r in runs if r.data.tags.get("entry") == entry]


def _inputs(client: MlflowClient, run: Any) -> dict[str, Any]:
    """The run's dataset inputs by name, as the UI's Dataset column reads them: ``(dataset, context)``."""
    fresh = client.get_run(run.info.run_id)
    return {d.dataset.name: (d.dataset, {t.key: t.value for t in d.tags}["mlflow.data.context"]) for d in fresh.inputs.dataset_inputs}


def test_the_runners_experiment_opens_as_model_training_and_a_users_kind_stays(trained: dict[str, Any], tmp_path: Path) -> None:
    assert trained["experiment"].tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/kinds.db")
    mine = client.create_experiment("genai", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    assert experiment_id(client, "genai") == mine
    assert client.get_experiment(mine).tags[EXPERIMENT_KIND_TAG] == "genai_development"
    untagged = client.create_experiment("by_hand")
    experiment_id(client, "by_hand")  # an experiment made without a kind gets the runner's at first use
    assert client.get_experiment(untagged).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND


def test_ui_url_opens_the_training_view_on_a_server_and_is_none_for_a_local_store() -> None:
    assert ui_url("http://127.0.0.1:5000/", "3") == "http://127.0.0.1:5000/#/experiments/3?workflowType=machine_learning"
    assert ui_url("https://mlflow.example", "3", "abc") == "https://mlflow.example/#/experiments/3/runs/abc?workflowType=machine_learning"
    assert ui_url("sqlite:///mlflow.db", "3") is None and ui_url("/tmp/mlruns", "3", "abc") is None


def test_training_and_evaluate_runs_log_their_data_with_a_digest_of_the_files(trained: dict[str, Any]) -> None:
    client, runs = trained["client"], trained["runs"]
    (training,) = _by_entry(runs, None)
    first, after_append = _by_entry(runs, "evaluate")
    logged = _inputs(client, training)
    assert {name: context for name, (_, context) in logged.items()} == {"csv/train": "training", "csv/eval": "evaluation"}
    dataset, _ = logged["csv/train"]
    assert json.loads(dataset.source) == {"uri": str(trained["path"])} and dataset.source_type == "local"
    profile = json.loads(dataset.profile)
    assert profile["digest_of"] == datasets.CONTENTS and profile["files"] == 1
    assert profile["num_rows"] + json.loads(logged["csv/eval"][0].profile)["num_rows"] == 1200  # a hash split of one file
    columns = {c["name"]: c["type"] for c in json.loads(dataset.schema)["mlflow_colspec"]}
    assert columns == {"click": "string", "price": "string", "user": "string", "item": "string", "tags": "string"}  # CSV: text
    assert len(dataset.digest) == datasets.DIGEST_LENGTH and dataset.digest != logged["csv/eval"][0].digest
    # The same files give the same digest in another run; appended rows another one, and the evaluate says so.
    assert _inputs(client, first)["csv/train"][0].digest == dataset.digest
    assert _inputs(client, after_append)["csv/train"][0].digest != dataset.digest
    assert any("data csv/train (training) has digest" in m and "changed since" in m for m in trained["warned"])
    # The record of the training data travels with the checkpoint, beside the encoders fitted on it.
    stored = datasets.read_stored(trained["checkpoint"])
    assert stored is not None and {r.name: r.digest for r in stored}["csv/train"] == dataset.digest


def test_runs_carry_the_standard_source_tags(trained: dict[str, Any]) -> None:
    (training,) = _by_entry(trained["runs"], None)
    tags = training.data.tags
    assert tags["mlflow.source.name"] == "recsys_runner" and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.source.git.commit"] == tags["manifest.git_commit"] and len(tags["mlflow.source.git.commit"]) == 40
    assert "@" not in tags.get("mlflow.source.git.repoURL", "")
    (evaluated, _) = _by_entry(trained["runs"], "evaluate")
    assert evaluated.data.tags["mlflow.source.name"] == "recsys_runner.evaluate"
    (exported,) = _by_entry(trained["runs"], "export")
    assert exported.data.tags["mlflow.source.name"] == "recsys_runner.export"


def test_the_exported_model_is_an_output_of_the_training_run(trained: dict[str, Any]) -> None:
    client, runs = trained["client"], trained["runs"]
    (training,) = _by_entry(runs, None)
    (exported,) = _by_entry(runs, "export")
    (model,) = client.search_logged_models(experiment_ids=[trained["experiment"].experiment_id])
    assert model.source_run_id == training.info.run_id  # what the UI's Models column lists a run's models by
    outputs = client.get_run(training.info.run_id).outputs.model_outputs
    assert [(o.model_id, o.step) for o in outputs] == [(model.model_id, STEPS)]
    assert [o.model_id for o in client.get_run(exported.info.run_id).outputs.model_outputs] == [model.model_id]


def test_predict_logs_the_files_it_scores_beside_the_training_data(trained: dict[str, Any]) -> None:
    client, runs = trained["client"], trained["runs"]
    (training,) = _by_entry(runs, None)
    (predicted,) = _by_entry(runs, "predict")
    inputs = _inputs(client, predicted)
    assert {name: context for name, (_, context) in inputs.items()} == {"csv/train": "training", "csv/eval": "evaluation",
                                                                        "csv/predict": "prediction"}
    scored, _ = inputs["csv/predict"]
    assert json.loads(scored.source)["uri"] == str(trained["root"] / "score.csv")
    assert scored.digest != inputs["csv/train"][0].digest
    assert inputs["csv/train"][0].digest == _inputs(client, training)["csv/train"][0].digest  # before the file grew


def test_generated_data_names_its_generator_and_seed(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    train(compose_entry("config", *TINY, "train.num_steps=2", "data.seed=7", "model=dlrm", f"tracking.uri={uri}",
                        "tracking.experiment=generated", "train.eval_max_batches=1"))
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("generated").experiment_id])
    logged = _inputs(client, run)
    dataset, context = logged["synthetic/train"]
    assert context == "training" and json.loads(dataset.source) == {"uri": "synthetic://SyntheticData?seed=7"}
    assert json.loads(dataset.profile) == {"digest_of": datasets.GENERATOR, "generator": "SyntheticData", "seed": 7, "num_rows": 32768}
    columns = {c["name"]: c["type"] for c in json.loads(dataset.schema)["mlflow_colspec"]}
    assert columns.pop("label") == "double" and len(columns) == 13 + 26  # Criteo-shaped: 13 dense, 26 categorical
    assert sorted(columns.values()) == ["double"] * 13 + ["long"] * 26
    assert logged["synthetic/eval"][1] == "evaluation" and logged["synthetic/eval"][0].digest != dataset.digest


def test_a_store_that_refuses_datasets_only_warns() -> None:
    class Refusing:
        def log_inputs(self, run_id: str, datasets: Any) -> None:
            raise ConnectionError("server gone")

    tracker = MlflowTracker(MlflowTrackingConfig(uri="http://127.0.0.1:9", experiment="x"))
    tracker._client, tracker.run_id = Refusing(), "run0"
    record = datasets.DataRecord(name="csv/train", digest="0" * 8, source_type="local", source="/d", context="training",
                                 profile={}, columns=[])
    with LogWarnings() as warned:
        tracker.log_inputs([record])
    assert any("could not log the datasets csv/train" in m and "server gone" in m for m in warned.messages)


def test_dataset_digest_max_mb_is_validated() -> None:
    with pytest.raises(ConfigError, match="tracking.dataset_digest_max_mb must be >= 0"):
        MlflowTrackingConfig(dataset_digest_max_mb=-1)


def test_data_over_the_digest_limit_gets_a_digest_of_its_listing_without_being_read(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from recsys_runner.data.base import SplitFiles

    files = [tmp_path / "a.csv", tmp_path / "b.csv"]
    for f in files:
        f.write_text("click,user\n1,u1\n")
    split = SplitFiles(str(tmp_path), tuple(str(f) for f in files), 2)
    monkeypatch.setattr(datasets, "_chunks", lambda path: pytest.fail(f"{path} was read"))
    record = datasets._files_record("csv/train", split, "training", [], max_digest_mb=0)
    assert record.profile == {"digest_of": datasets.LISTING, "files": 2, "bytes": 32, "num_rows": 2}
    assert datasets._files_record("csv/train", split, "training", [], max_digest_mb=0).digest == record.digest
    with files[1].open("a") as f:
        f.write("0,u2\n")
    assert datasets._files_record("csv/train", split, "training", [], max_digest_mb=0).digest != record.digest


def test_a_resume_on_files_changed_since_warns_that_its_epoch_position_no_longer_fits(tmp_path: Path) -> None:
    """A resume after a file of the folder was removed (or rows appended) went on without a word: it skips the batches of
    the epoch the checkpoint had trained, counted in the old files, so it trained rows twice or never."""
    folder = tmp_path / "days"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for day in ("day_0", "day_1"):
        (folder / f"{day}.csv").write_text("click,user,item\n" + "".join(f"{int(rng.random() < 0.5)},u{rng.integers(20)},"
                                                                       f"{rng.integers(30)}\n" for _ in range(400)))
    run = ["data=csv", f"data.path={folder}", "data.batch_size=32", "distributed.device=cpu", "tracking=none",
           "train.eval_every_steps=null", f"checkpoint.dir={tmp_path}/ck"]
    train(compose_entry("config", *run, "train.num_steps=3"))
    with LogWarnings() as unchanged:
        train(compose_entry("config", *run, "train.num_steps=4"))
    assert not [m for m in unchanged.messages if "changed since" in m]
    (folder / "day_1.csv").unlink()
    with LogWarnings() as changed:
        train(compose_entry("config", *run, "train.num_steps=5"))
    (warned,) = [m for m in changed.messages if "changed since" in m]
    assert warned.startswith(f"data csv/train (training) has digest {datasets.read_stored(tmp_path / 'ck' / 'step_00000005')[0].digest}, "
                             f"but checkpoint {tmp_path}/ck/step_00000004 was trained on digest")
    assert "The resumed run trains on them as they are now" in warned and "checkpoint.resume=never" in warned


def test_an_evaluate_or_resume_on_converted_files_warns_that_the_hash_eval_split_moved(tmp_path: Path,
                                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The hash eval split keys rows by file name: ``a.csv`` converted to ``a.parquet`` holds out other rows, so evaluating
    (or resuming) the CSV-trained checkpoint on the conversion would score rows it trained on; the split's keys recorded
    with the checkpoint make that a warning. The same files, or files of their own (data.eval_path), say nothing."""
    rng = np.random.default_rng(0)
    (tmp_path / "text").mkdir()
    rows = [f"{int(u > 24)},{u},{i}" for u, i in zip(rng.integers(0, 50, 600), rng.integers(0, 50, 600), strict=True)]
    (tmp_path / "text" / "a.csv").write_text("\n".join(["click,user,item", *rows]) + "\n")
    (tmp_path / "schema.yaml").write_text("label: click\nsparse:\n- {name: user, num_embeddings: 50}\n- {name: item, num_embeddings: 50}\n")
    base = ["model=deepfm", "distributed.device=cpu", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "data.batch_size=32",
            "train.eval_max_batches=1", "train.log_every_steps=2"]
    text = ["data=csv", f"data.path={tmp_path}/text", f"data.schema={tmp_path}/schema.yaml"]
    train(compose_entry("config", *base, *text, "train.num_steps=2", f"checkpoint.dir={tmp_path}/ck"))
    checkpoint = tmp_path / "ck" / "step_00000002"
    stored = datasets.read_stored(checkpoint)
    assert stored is not None and [r.profile.get("split_keys") for r in stored if r.context == "evaluation"] == [["a.csv"]]
    assert data_main(["convert", "--format", "csv", "--schema", str(tmp_path / "schema.yaml"), f"{tmp_path}/text",
                      f"{tmp_path}/converted", "--progress", "log"]) == 0
    assert "these files hold out other rows than their sources did" in capsys.readouterr().out
    converted = ["data=parquet", f"data.path={tmp_path}/converted"]

    moved = "the eval split holds out other rows than checkpoint"
    with LogWarnings() as warned:
        evaluate.run(compose_entry("evaluate", *base, *text, f"load={checkpoint}"))
    assert not [m for m in warned.messages if moved in m], warned.messages
    with LogWarnings() as warned:
        evaluate.run(compose_entry("evaluate", *base, *converted, f"load={checkpoint}"))
    (said,) = [m for m in warned.messages if moved in m]
    assert "a.parquet (trained as a.csv)" in said and "rows the checkpoint trained on" in said and "data.eval_path" in said
    with LogWarnings() as warned:  # eval rows of their own: no split to move
        evaluate.run(compose_entry("evaluate", *base, *converted, f"data.eval_path={tmp_path}/converted", f"load={checkpoint}"))
    assert not [m for m in warned.messages if moved in m], warned.messages
    with LogWarnings() as warned:
        train(compose_entry("config", *base, *converted, "train.num_steps=4", f"checkpoint.dir={tmp_path}/ck"))
    (said,) = [m for m in warned.messages if moved in m]
    assert "trains on rows its earlier steps held out" in said


def test_a_fine_tune_on_a_sliver_of_the_days_rows_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """A truncated day (350 of the usual 18,000 rows; its cut last line skipped) fine-tuned yesterday's model on 2% of a
    day without a word."""
    from recsys_runner.tracking.datasets import DataRecord, note_shrunk

    def record(source: str, rows: int, context: str = "training") -> DataRecord:
        return DataRecord(name="criteo/train" if context == "training" else "criteo/eval", digest=source, source_type="local",
                          source=source, context=context, profile={"files": 1, "bytes": rows * 100, "num_rows": rows}, columns=[])

    yesterday = [record("/d/day_1", 17945), record("/d/day_2", 9000, "evaluation")]
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        assert note_shrunk(yesterday, [record("/d/day_2", 16000), record("/d/day_3", 10, "evaluation")], "ck") is None
        assert note_shrunk(yesterday, [record("/d/day_5", 350)], "ck") == "criteo/train"
        assert note_shrunk(None, [record("/d/day_5", 350)], "ck") is None  # a checkpoint written before data_inputs.json
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("data criteo/train (training) is /d/day_5: 350 rows in 1 files, 2.0% of the 17945 rows checkpoint ck "
                           "was trained on (/d/day_1, 1 files). A day that arrived truncated or partial?"), line
