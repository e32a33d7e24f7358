"""Export for serving: the trained model as a torch.export program that a process of torch alone loads.

Each case trains a few real steps through the CLI's ``run``, exports the checkpoint, loads ``model.pt2``
in a Python process of its own that imports only torch (asserted; one such process serves a test process's every
export, :func:`run_fresh`), and compares its output on an eval batch
with the trained model's: the sharded DistributedModelParallel model restored from the same checkpoint
by the training build. Tolerance: ``atol=1e-5, rtol=1e-5`` (fbgemm's CPU embedding kernels, which the
sharded model runs, may sum a bag in another order than ATen's ``embedding_bag``; the exported program
itself matches the eager unsharded model to ``EXACT_ATOL`` = 1e-6, checked by the export).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner import export
from recsys_runner.__main__ import run as train_run
from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.errors import CheckpointError, ConfigError
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.serving import program as serving
from recsys_runner.train.corpus import inner_with
from recsys_runner.train.signals import Interrupted
from tests.conftest import TINY, run_in_process

SMALL = ["data.batch_size=64", "data.num_train_rows=1024", "data.num_eval_rows=256", "train.num_steps=3",
         "train.log_every_steps=3", "train.eval_max_batches=1"]
ATOL = RTOL = 1e-5

# Runs in an interpreter of its own that imports torch only, started once per test process (:func:`run_fresh`): for each
# request line from stdin (JSON: a list of [program, inputs, output] files) it loads each program anew, runs it on its
# saved inputs and saves its output, then answers one line: "LOADED ok", or "LOADED " and the error, among them any
# module of recsys_runner, Hydra, TorchRec or fbgemm_gpu found imported.
LOADER = """
import json, sys, traceback, torch
for request in sys.stdin:
    try:
        for program_file, inputs_file, output_file in json.loads(request):
            program = torch.export.load(program_file).module()
            dense, values, lengths = torch.load(inputs_file)
            with torch.no_grad():
                torch.save(program(dense, values, lengths), output_file)
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("recsys_runner", "hydra", "omegaconf", "torchrec", "fbgemm_gpu"))
        answer = f"imported {leaked}" if leaked else "ok"
    except Exception:
        answer = traceback.format_exc()
    print("LOADED " + json.dumps(answer), flush=True)
"""
LOADER_TIMEOUT_S = 300
"""How long one request to the loader may take (a process per request had ``subprocess.run``'s 300 s)."""


@pytest.fixture
def export_cfg(mlflow_uri: str, request: pytest.FixtureRequest) -> Callable[..., DictConfig]:
    """``conf/export.yaml`` composed like the CLI, with the TINY settings and this test's MLflow experiment."""
    export.register()
    experiment = re.sub(r"[^A-Za-z0-9_]+", "_", request.node.name)

    def _make(*overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
            return compose(config_name="export", overrides=[*TINY, f"tracking.uri={mlflow_uri}",
                                                            f"tracking.experiment={experiment}", *overrides])

    return _make


def train_and_score(make_cfg: Callable[..., DictConfig], checkpoints: Path, *overrides: str) -> tuple[Batch, torch.Tensor]:
    """Train ``overrides`` into ``checkpoints``; the trained model's logits on the second eval batch (the export's
    own example is the first), from the sharded model the training build restores from that checkpoint."""
    train_run(make_cfg(*SMALL, *overrides, f"checkpoint.dir={checkpoints}"))
    c = build(validate(make_cfg(*SMALL, *overrides, f"checkpoint.dir={checkpoints}", "checkpoint.resume=latest", "tracking=none")))
    try:
        *_, batch = itertools.islice(c.loop.data.eval_batches(0, 1), 2)
        evaluator = c.loop.evaluator
        model = evaluator.model.eval()
        if (retrieval := inner_with(model, "in_batch_ranking")) is not None:
            retrieval.in_batch_ranking = False  # the served scores, every pair's (the evaluation leaves accidental hits out)
        with torch.no_grad(), evaluator.ema.swapped_in() if evaluator.ema is not None else contextlib.nullcontext():
            _, (_, logits, _) = model(batch)
        return batch, logits
    finally:
        c.close()


class _TorchOnly:
    """The :data:`LOADER` process of this test process: started on first use, in an empty directory of its own and without
    ``PYTHONPATH`` (nothing of this checkout importable), ended when the test process exits. One interpreter start (torch
    and torch.export's imports: ~10 s on a loaded 2-core machine) for every export this process checks, not one each;
    each program is loaded anew from its file, and what the process has imported is checked after every request."""

    process: subprocess.Popen[str] | None = None
    stderr: Path | None = None

    @classmethod
    def run(cls, calls: list[list[str]]) -> None:
        if cls.process is None or cls.process.poll() is not None:
            home = Path(tempfile.mkdtemp(prefix="torch_only_"))
            cls.stderr = home / "stderr"
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            with open(cls.stderr, "w") as err:
                cls.process = subprocess.Popen([sys.executable, "-c", LOADER], cwd=home, env=env, stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=err, text=True)
            atexit.register(cls.close)
        process = cls.process
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(calls) + "\n")
        process.stdin.flush()
        watchdog = threading.Timer(LOADER_TIMEOUT_S, process.kill)  # stuck: killed, and its stdout ends
        watchdog.start()
        try:
            line = process.stdout.readline()
            while line and not line.startswith("LOADED "):  # anything else the programs printed
                line = process.stdout.readline()
        finally:
            watchdog.cancel()
        if not line:  # the next call starts a new one
            cls.close()
            raise AssertionError(f"the torch-only loader died or ran past {LOADER_TIMEOUT_S} s: "
                                 f"{cls.stderr.read_text()[-3000:] if cls.stderr else ''}")
        answer = json.loads(line.removeprefix("LOADED "))
        assert answer == "ok", answer

    @classmethod
    def close(cls) -> None:
        if cls.process is not None and cls.process.poll() is None:
            cls.process.kill()
            cls.process.wait()
        cls.process = None


def run_fresh(directory: Path, tmp_path: Path, calls: list[tuple[str, tuple[torch.Tensor, ...]]]) -> list[object]:
    """Each ``(file, inputs)`` of ``calls``: the program ``directory/file`` run on ``inputs`` in an interpreter that imports
    only torch (:class:`_TorchOnly`); their outputs."""
    files = []
    for i, (file, inputs) in enumerate(calls):
        torch.save(inputs, tmp_path / f"inputs{i}.pt")
        files.append([str(directory / file), str(tmp_path / f"inputs{i}.pt"), str(tmp_path / f"output{i}.pt")])
    _TorchOnly.run(files)
    return [torch.load(tmp_path / f"output{i}.pt") for i in range(len(calls))]


def load_fresh(directory: Path, batch: Batch, tmp_path: Path) -> object:
    """``model.pt2`` run on ``batch`` in a new interpreter that imports only torch; its output."""
    return run_fresh(directory, tmp_path, [(export.MODEL_FILE, serving.serving_inputs(batch))])[0]


def as_logits(output: object, spec: dict) -> torch.Tensor:
    """The program's output as the TrainWrapper's logits: a multi-task dict side by side in task order (a multiclass
    task's ``[B, C]`` as ``C`` columns)."""
    if isinstance(output, dict):
        return torch.cat([output[o["name"]].reshape(len(output[o["name"]]), -1) for o in spec["outputs"]], dim=1)
    assert isinstance(output, torch.Tensor)
    return output


def check_export(make_cfg, export_cfg, tmp_path: Path, *overrides: str, load: str | None = None) -> tuple[dict, Batch, torch.Tensor]:
    batch, expected = train_and_score(make_cfg, tmp_path / "ck", *overrides)
    out = export.run(export_cfg(*SMALL, *overrides, f"load={load or tmp_path / 'ck'}", f"export.dir={tmp_path / 'export'}"))
    spec = json.loads((out / export.FEATURE_SPEC_FILE).read_text())
    got = as_logits(load_fresh(out, batch, tmp_path), spec)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    assert spec["sparse_features"] and [f["name"] for f in spec["sparse_features"]] == list(batch.sparse_features.keys())
    assert spec["inputs"]["lengths"]["shape"] == [len(batch.sparse_features.keys()), "B"] and spec["needs_torchrec"] is False
    return spec, batch, expected


DEEPFM_EXPERIMENT = "test_deepfm_export_loads_without_recsys_runner_and_scores_like_the_trained_model"
"""Where :func:`deepfm_trained` trains: the experiment that test's export (``export_cfg``: the test's name) logs to."""


@pytest.fixture(scope="module")
def deepfm_trained(mlflow_uri: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Batch, torch.Tensor]:
    """DeepFM (the default model) trained with SMALL, once for the module's tests that export it: its checkpoints root,
    the eval batch and the trained model's logits on it (:func:`train_and_score`)."""
    root = tmp_path_factory.mktemp("deepfm")
    batch, expected = train_and_score(_composer("config", mlflow_uri, DEEPFM_EXPERIMENT), root / "ck")
    return root / "ck", batch, expected


def test_deepfm_export_loads_without_recsys_runner_and_scores_like_the_trained_model(
        deepfm_trained: tuple[Path, Batch, torch.Tensor], export_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    checkpoints, batch, expected = deepfm_trained
    client = MlflowClient(tracking_uri=mlflow_uri)
    (experiment,) = [e for e in client.search_experiments() if e.name.startswith("test_deepfm_export")]
    (trained,) = [r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get("entry") != "export"]
    source = trained.info.run_id
    assert trained.data.tags["checkpoint_dir"] == str(checkpoints.absolute())

    # load= an MLflow run id: its checkpoint_dir tag names the checkpoints
    out = export.run(export_cfg(*SMALL, f"load={source}", f"export.dir={tmp_path / 'export'}"))
    spec = json.loads((out / export.FEATURE_SPEC_FILE).read_text())
    got = load_fresh(out, batch, tmp_path)
    assert isinstance(got, torch.Tensor) and got.shape == (64,)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    assert spec["model"] == "DeepFM" and spec["weights"] == "raw" and spec["source_run_id"] == source
    assert spec["outputs"] == [{"name": None, "kind": "binary", "shape": [], "meaning": "logit; sigmoid(logit) is the probability"}]
    assert spec["inputs"]["dense"]["shape"] == ["B", 13] and len(spec["sparse_features"]) == 26
    example = torch.load(out / export.EXAMPLE_FILE)
    assert torch.export.load(str(out / export.MODEL_FILE)).module()(*example["inputs"]).shape == example["outputs"].shape
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and manifest["device_type"] == "cpu"
    assert manifest["versions"]["torch"] == torch.__version__

    (mlrun,) = [r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get("entry") == "export"]
    tags = mlrun.data.tags
    assert mlrun.info.status == "FINISHED"
    assert tags["source_run_id"] == source and tags["mlflow.parentRunId"] == source and tags["export.weights"] == "raw"
    assert tags["manifest.world_size"] == "1" and tags["manifest.device"].startswith("cpu:") and "manifest.version.torch" in tags
    artifacts = {a.path for a in client.list_artifacts(mlrun.info.run_id, export.ARTIFACT_DIR)}
    assert artifacts == {f"export/{n}" for n in ("model.pt2", "feature_spec.json", "example.pt", "manifest.json")}
    assert "manifest.json" in {a.path for a in client.list_artifacts(mlrun.info.run_id)}

    # the same checkpoint under another model's config: refused, naming the fix
    with pytest.raises(CheckpointError, match="does not match this model config.*Fix: give the same model="):
        export.run(export_cfg(*SMALL, "model=dlrm", f"load={checkpoints}", f"export.dir={tmp_path / 'x'}"))


EVERY_MODEL = ["dlrm", "dcn_v2", "wide_deep", "mmoe", "dssm"]
DSSM_TOWERS = ["model.user_features=[cat_0,int_0,cat_2]", "model.item_features=[cat_1,int_3]"]
"""DSSM: towers of two sparse features and a dense column, and of one of each, so each tower program selects both kinds."""


def _composer(config_name: str, mlflow_uri: str, experiment: str) -> Callable[..., DictConfig]:
    """``make_cfg``/``export_cfg`` for a module-scoped fixture: ``conf/<config_name>.yaml`` with TINY, the session's store
    and ``experiment`` (unless ``tracking=none`` is among the overrides)."""
    from recsys_runner.config import register_configs

    register_configs()
    export.register()

    def _make(*overrides: str) -> DictConfig:
        tracking = [] if "tracking=none" in overrides else [f"tracking.uri={mlflow_uri}", f"tracking.experiment={experiment}"]
        with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
            return compose(config_name=config_name, overrides=[*TINY, *tracking, *overrides])

    return _make


@pytest.fixture(scope="module")
def every_model(mlflow_uri: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each of :data:`EVERY_MODEL` trained a few steps and exported (a folder and an experiment each), then every program
    (each model's ``model.pt2``, DSSM's tower programs too) run in one request to the process that imports only torch
    (:func:`run_fresh`). Per model: its export folder, spec, batch, trained logits and the programs'
    outputs, or the exception its training or export raised (re-raised by that model's test)."""
    done: dict[str, Any] = {}
    calls: list[tuple[str, tuple[torch.Tensor, ...]]] = []
    for model in EVERY_MODEL:
        root = tmp_path_factory.mktemp(f"export_{model}")
        overrides = [f"model={model}", *(DSSM_TOWERS if model == "dssm" else [])]
        try:
            make_cfg = _composer("config", mlflow_uri, f"every_model_{model}")
            batch, expected = train_and_score(make_cfg, root / "ck", *overrides)
            out = export.run(_composer("export", mlflow_uri, f"every_model_{model}")(
                *SMALL, *overrides, f"load={root / 'ck'}", f"export.dir={root / 'export'}"))
            spec = json.loads((out / export.FEATURE_SPEC_FILE).read_text())
        except Exception as e:  # noqa: BLE001 - the model's own test raises it
            done[model] = e
            continue
        first = len(calls)
        calls.append((str(out / export.MODEL_FILE), serving.serving_inputs(batch)))
        if model == "dssm":
            calls += [(str(out / spec["towers"][name]["file"]), tower_inputs(batch, spec, name)) for name in ("user", "item")]
        done[model] = {"out": out, "spec": spec, "batch": batch, "expected": expected, "calls": range(first, len(calls))}
    outputs = run_fresh(Path("/"), tmp_path_factory.mktemp("export_fresh"), calls) if calls else []
    for entry in done.values():
        if isinstance(entry, dict):
            entry["outputs"] = [outputs[i] for i in entry["calls"]]
    return done


@pytest.mark.slow
@pytest.mark.parametrize("model", EVERY_MODEL)
def test_every_model_exports_and_scores_like_the_trained_model(every_model: dict[str, Any], model: str) -> None:
    entry = every_model[model]
    if isinstance(entry, Exception):
        raise entry
    spec, batch, expected = entry["spec"], entry["batch"], entry["expected"]
    got = as_logits(entry["outputs"][0], spec)  # what check_export checks, the program run by the torch-only process
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    assert spec["sparse_features"] and [f["name"] for f in spec["sparse_features"]] == list(batch.sparse_features.keys())
    assert spec["inputs"]["lengths"]["shape"] == [len(batch.sparse_features.keys()), "B"] and spec["needs_torchrec"] is False
    kinds = {"mmoe": ["binary", "binary"], "dssm": ["retrieval"]}.get(model, ["binary"])
    assert [o["kind"] for o in spec["outputs"]] == kinds
    assert spec["output_type"] == ("dict[task name, Tensor]" if model == "mmoe" else "Tensor")
    assert ("towers" in spec) == (model == "dssm")
    if model == "dssm":  # each tower apart, fed only its own features: user · item / temperature is the model's score
        towers = spec["towers"]
        user, item = entry["outputs"][1:]
        assert isinstance(user, torch.Tensor) and isinstance(item, torch.Tensor)
        scores = user @ item.t() / towers["temperature"]
        torch.testing.assert_close(scores, expected, atol=ATOL, rtol=RTOL)
        features = {name: towers[name]["inputs"]["dense"]["columns"] + [f["name"] for f in towers[name]["sparse_features"]]
                    for name in ("user", "item")}
        assert features == {"user": ["int_0", "cat_0", "cat_2"], "item": ["int_3", "cat_1"]}


def tower_inputs(batch: Batch, spec: dict, tower: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch`` as a server would feed tower ``tower`` from ``feature_spec.json`` alone: the tower's dense columns,
    and its sparse features' ids and lengths, in the order the spec lists them."""
    dense, values, lengths = serving.serving_inputs(batch)
    keys, columns = list(batch.sparse_features.keys()), spec["inputs"]["dense"]["columns"]
    mine = spec["towers"][tower]
    dense_index = [columns.index(c) for c in mine["inputs"]["dense"]["columns"]]
    sparse_index = [keys.index(f["name"]) for f in mine["sparse_features"]]
    per_feature = torch.split(values, lengths.sum(dim=1).tolist())
    return dense[:, dense_index], torch.cat([per_feature[i] for i in sparse_index]), lengths[sparse_index]


@pytest.mark.slow
def test_cli_exports_the_ema_weights_a_run_evaluated_with(make_cfg, tmp_path: Path, mlflow_uri: str) -> None:
    ema = ["train.ema.decay=0.5", "train.ema.eval_with_ema=true"]
    batch, expected = train_and_score(make_cfg, tmp_path / "ck", *ema)
    args = [*TINY, *SMALL, *ema, f"tracking.uri={mlflow_uri}", "tracking.experiment=export_cli", f"load={tmp_path / 'ck'}", f"export.dir={tmp_path / 'export'}"]
    done = run_in_process([sys.executable, "-m", "recsys_runner.export", *args], tmp_path)  # the command, without its imports
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exported to {tmp_path / 'export'}" in done.stdout
    spec = json.loads((tmp_path / "export" / export.FEATURE_SPEC_FILE).read_text())
    assert spec["weights"] == "ema"
    torch.testing.assert_close(load_fresh(tmp_path / "export", batch, tmp_path), expected, atol=ATOL, rtol=RTOL)


def test_export_needs_load_and_rejects_unknown_keys(export_cfg, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="load is required"):
        export.run(export_cfg(f"export.dir={tmp_path}"))
    with pytest.raises(ConfigError, match="unknown key export.dri .did you mean export.dir"):
        export.run(export_cfg(f"load={tmp_path}", f"+export.dri={tmp_path}"))
    with pytest.raises(ConfigError, match="unknown key train.num_step .did you mean train.num_steps"):
        export.run(export_cfg(f"load={tmp_path}", "+train.num_step=5"))
    kept = validate(export_cfg(f"load={tmp_path}", "model=dlrm"))  # conf/export.yaml keeps the training config's values
    assert type(kept.model).__name__ == "DLRMConfig" and type(kept.data).__name__ == "SyntheticDataConfig"
    assert kept.train.num_steps == 30 and kept.data.num_embeddings == 1000 and kept.tracking.experiment.startswith("test_export")
    with pytest.raises(ConfigError, match="export.weights='best' must be one of"):
        export._options(export_cfg(f"load={tmp_path}", "export.weights=best"))
    with pytest.raises(ConfigError, match="export.compile=true compiles the MLflow model's program: it needs export.mlflow_model=true"):
        export._options(export_cfg(f"load={tmp_path}", "export.compile=true", "export.mlflow_model=false"))
    for other in (f"export.dir={tmp_path}", "export.weights=best"):  # load= is checked first: nothing else is, or read, before
        with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
            export.run(export_cfg(f"load={tmp_path}", other))


class BranchesOnIds(nn.Module):
    """A model torch.export cannot trace for every batch: a Python branch on the ids' values."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        if sparse.values().max() > 5:
            return self.linear(dense).squeeze(1)
        return -self.linear(dense).squeeze(1)


def test_a_model_that_cannot_be_exported_is_named_with_the_reason() -> None:
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([1, 7, 3]), lengths=torch.tensor([1, 1, 1]))
    batch = Batch(dense_features=torch.randn(3, 2), sparse_features=kjt, labels=torch.zeros(3))
    with pytest.raises(ConfigError, match=r"model BranchesOnIds cannot be exported with torch.export \(.*\)\. Its forward must be traceable"):
        serving.export_program(serving.ServingModule(BranchesOnIds(), ["a"]), batch)


def test_export_refuses_a_used_dir_before_building_and_overwrite_replaces_the_whole_export(
        deepfm_trained: tuple[Path, Batch, torch.Tensor], export_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoints = deepfm_trained[0]
    out = tmp_path / "export"
    out.mkdir()
    for stale in ("model.pt2", "feature_spec.json", "user_tower.pt2", "item_tower.pt2"):  # an earlier DSSM export
        (out / stale).write_text("dssm")
    cfg = [*SMALL, f"load={checkpoints}", f"export.dir={out}"]

    def no_build(*_: object) -> None:
        raise AssertionError("the model was built before export.dir was refused")

    monkeypatch.setattr(export, "build_unsharded", no_build)
    with pytest.raises(ConfigError, match=rf"export.dir={out} is not empty \(it holds \['feature_spec.json', 'item_tower.pt2', "
                                          r".*Fix: export.overwrite=true to replace them, or a new export.dir"):
        export.run(export_cfg(*cfg))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds \['notes.txt'\], which no export writes; export.overwrite=true replaces only"):
        export.run(export_cfg(*SMALL, f"load={checkpoints}", f"export.dir={tmp_path / 'other'}", "export.overwrite=true"))
    under_a_file = tmp_path / "other" / "notes.txt" / "export"  # not a raw NotADirectoryError once the model is traced
    with pytest.raises(ConfigError, match=rf"export.dir={under_a_file} cannot be written: a file is in the place of its parent "
                                          rf"folder {tmp_path / 'other' / 'notes.txt'}\. Fix: move or remove"):
        export.run(export_cfg(*SMALL, f"load={checkpoints}", f"export.dir={under_a_file}"))
    monkeypatch.undo()

    # overwrite: the DeepFM export replaces the DSSM one as a whole (no tower files left beside it)
    assert export.run(export_cfg(*cfg, "export.overwrite=true")) == out
    written = {"model.pt2", "feature_spec.json", "example.pt", "manifest.json"}
    assert {p.name for p in out.iterdir()} == written
    assert json.loads((out / export.FEATURE_SPEC_FILE).read_text())["model"] == "DeepFM"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "other"]  # no temporary sibling left

    # stopped after every file is written (Ctrl-C, or the lifecycle's SIGTERM) but before the move: the export in place
    # stays whole and the temporary directory is gone
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    write_export = export.write_export

    def stopped(*args: Any, **kwargs: Any) -> list[str]:
        write_export(*args, **kwargs)
        assert {p.name for p in kwargs["out"].iterdir()} >= written - {"manifest.json"} and kwargs["out"] != out
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "write_export", stopped)
    with pytest.raises(KeyboardInterrupt):
        export.run(export_cfg(*cfg, "export.overwrite=true"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "other"]


class StoppedWhileTraced(nn.Module):
    """A model whose forward is where the lifecycle's signal handler raises (SIGTERM while torch.export traces it)."""

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        raise Interrupted(signal.SIGTERM, None, None)


def test_a_signal_while_tracing_is_a_stop_not_a_model_that_cannot_be_exported() -> None:
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([1, 7, 3]), lengths=torch.tensor([1, 1, 1]))
    batch = Batch(dense_features=torch.randn(3, 2), sparse_features=kjt, labels=torch.zeros(3))
    with pytest.raises(Interrupted):
        serving.export_program(serving.ServingModule(StoppedWhileTraced(), ["a"]), batch)
