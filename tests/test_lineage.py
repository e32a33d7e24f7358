"""The reproducibility manifest on a run, and finding a run's checkpoint from its MLflow id."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from recsys_runner.errors import CheckpointError
from recsys_runner.tracking import lineage
from tests.conftest import TINY, run_in_process

MANIFEST_TAGS = {"manifest.command", "manifest.git_commit", "manifest.git_dirty", "manifest.device", "manifest.device_count",
                 "manifest.world_size", "manifest.hostname", "manifest.num_threads", "manifest.version.python", "manifest.version.torch",
                 "manifest.version.torchrec", "manifest.version.fbgemm", "manifest.version.hydra", "manifest.version.mlflow"}


def test_a_training_run_carries_the_manifest_and_its_checkpoint_dir(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    # as python -m runs it (the module as __main__, sys.argv the command's: the manifest's command), without the imports
    out = run_in_process([sys.executable, "-m", "recsys_runner", *TINY, "train.num_steps=4", f"tracking.uri={uri}",
                          "tracking.experiment=lineage", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("lineage").experiment_id])
    tags = run.data.tags
    assert MANIFEST_TAGS <= set(tags), MANIFEST_TAGS - set(tags)
    assert tags["manifest.command"].startswith("python -m recsys_runner ") and "train.num_steps=4" in tags["manifest.command"]
    assert tags["manifest.world_size"] == "1" and tags["manifest.version.torch"] == torch.__version__
    assert tags["manifest.device"].startswith("cpu:")
    manifest = json.loads(Path(client.download_artifacts(run.info.run_id, "manifest.json", str(tmp_path))).read_text())
    assert manifest["command"] == tags["manifest.command"] and manifest["versions"]["torch"] == torch.__version__
    # the checkpoint the run saved at its end is found from the run id alone
    found = lineage.resolve_checkpoint(run.info.run_id, lookup_run=lineage.run_tags(uri))
    assert found == Path(tags[lineage.CHECKPOINT_DIR_TAG]) / "step_00000004"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True, capture_output=True)


def test_git_state_reports_commit_dirty_and_diff(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-qm", "one")
    commit, dirty, diff = lineage._git_state(tmp_path)
    assert commit is not None and len(commit) == 40 and dirty is False and diff == ""
    (tmp_path / "a.py").write_text("x = 2\n")
    commit2, dirty, diff = lineage._git_state(tmp_path)
    assert commit2 == commit and dirty is True and "+x = 2" in diff
    assert lineage._git_state(tmp_path / "nowhere") == (None, None, "")


def test_a_dirty_tree_logs_its_diff_and_tags_mlflow_source() -> None:
    logged: dict[str, str] = {}

    class Texts:
        def log_text(self, text: str, artifact_file: str) -> None:
            logged[artifact_file] = text

    manifest = lineage.collect(world_size=2, device=torch.device("cpu"), argv=["python", "-m", "recsys_runner", "x=1"])
    manifest.git_commit, manifest.git_dirty, manifest.git_diff = "a" * 40, True, "+changed"
    lineage.record(Texts(), manifest)
    assert logged[lineage.DIFF_FILE] == "+changed" and json.loads(logged[lineage.MANIFEST_FILE])["world_size"] == 2
    assert "git_diff" not in json.loads(logged[lineage.MANIFEST_FILE])
    assert manifest.tags()["mlflow.source.git.commit"] == "a" * 40 and manifest.tags()["manifest.git_dirty"] == "true"


def test_resolve_checkpoint_explains_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="neither a directory nor a known MLflow run id"):
        lineage.resolve_checkpoint(str(tmp_path / "nope"))
    # a run id with no store to look it up in (tracking=none): it was "neither a directory nor a known MLflow run id",
    # as if the id were wrong
    with pytest.raises(CheckpointError, match=r"load=163b30d3c36a434fba18973e152d27fc looks like an MLflow run id, but this "
                                              r"command has no MLflow store to look it up in \(tracking=none\). Fix: drop tracking=none"):
        lineage.resolve_checkpoint("163b30d3c36a434fba18973e152d27fc")
    with pytest.raises(CheckpointError, match=r"holds no complete checkpoint .*point load= at one"):
        lineage.resolve_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"^MLflow run abc123 in sqlite:///runs.db \(tracking.uri\) has no 'checkpoint_dir' "
                                              r"tag.*instead: load=<path>"):
        lineage.resolve_checkpoint("abc123", lookup_run=StoredTags("sqlite:///runs.db"))
    with pytest.raises(CheckpointError, match=r"does not exist on this machine; copy them here and pass load=<path>"):
        lineage.resolve_checkpoint("abc123", lookup_run=StoredTags("sqlite:///runs.db", tags={lineage.CHECKPOINT_DIR_TAG: str(tmp_path / "gone")}))
    # a store that is not there is not created to look in; one that does not answer is asked once, not for minutes
    with pytest.raises(CheckpointError, match=rf"^load=abc123 is no checkpoint directory, and the MLflow store sqlite:///{tmp_path}/no.db "
                                              rf"\(tracking.uri\) to look it up in as a run id is not there: {tmp_path}/no.db does not exist"):
        lineage.resolve_checkpoint("abc123", lookup_run=lineage.run_tags(f"sqlite:///{tmp_path}/no.db"))
    assert not (tmp_path / "no.db").exists()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        server = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with pytest.raises(CheckpointError, match=rf"^load=abc123 is no checkpoint directory, and the MLflow store {server} \(tracking.uri\), "
                                              r"which would know it as a run id, did not answer \(ConnectionRefusedError: .*\)\. Fix: start "
                                              r"the store, or tracking.uri=<the store the training run logged to>, or load=<its checkpoint"):
        lineage.resolve_checkpoint("abc123", lookup_run=lineage.run_tags(server))
    # evaluate, predict and export take load=; no hint names the checkpoint= of another command
    source = Path(lineage.__file__).read_text()
    assert "checkpoint=<" not in source and "point checkpoint=" not in source


@dataclass(frozen=True)
class StoredTags(lineage.RunTags):
    """A store whose every run has ``tags``."""

    tags: dict[str, str] = field(default_factory=dict)

    def read(self, run_id: str, key: str) -> dict[str, str]:
        return self.tags


def fake_checkpoint(path: Path, *, meta: bool = True) -> Path:
    """A step folder as the locator sees it: complete with ``meta.json`` and DCP's ``.metadata``."""
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    if meta:
        (path / "meta.json").write_text("{}")
    return path


def test_a_damaged_step_folder_is_named_with_the_checkpoint_to_load_instead(tmp_path: Path) -> None:
    # was: "<step folder> holds no complete checkpoint ...; point load= at one", the step folder not called damaged
    root = tmp_path / "checkpoints"
    earlier = fake_checkpoint(root / "step_00000002")
    damaged = fake_checkpoint(root / "step_00000003", meta=False)
    with pytest.raises(CheckpointError, match=rf"{damaged} is an incomplete checkpoint \(meta\.json is missing\): damaged, or copied "
                                              rf"part-way .*Fix: load={earlier} \(the newest complete checkpoint beside it, step 2\)"):
        lineage.resolve_checkpoint(str(damaged))
    assert lineage.resolve_checkpoint(str(root)) == earlier  # the root: the newest complete one, as before
    alone = fake_checkpoint(tmp_path / "copied" / "step_00000007", meta=False)
    with pytest.raises(CheckpointError, match=r"copied holds no complete checkpoint: its step folders \(step_00000007\) are incomplete "
                                              r"\(step_00000007: meta\.json is missing\)"):
        lineage.resolve_checkpoint(str(alone.parent))


def test_a_run_directory_given_to_load_names_its_checkpoints_folder(tmp_path: Path) -> None:
    # was: "<run dir> holds no complete checkpoint", though <run dir>/checkpoints held them
    run = tmp_path / "outputs" / "day0"
    fake_checkpoint(run / "checkpoints" / "step_00000010")
    (run / ".hydra").mkdir()
    with pytest.raises(CheckpointError, match=rf"{run} holds no checkpoint, but its checkpoints/ folder does: it is a training run's "
                                              rf"directory, .*Fix: load={run}/checkpoints \(its newest checkpoint, step_00000010\)"):
        lineage.resolve_checkpoint(str(run))


def test_load_of_a_root_whose_newest_is_incomplete_says_once_which_it_skipped_and_which_it_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # was: the locator silently took the older complete checkpoint, whose weights score differently
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    out = run_in_process([sys.executable, "-m", "recsys_runner", *TINY, "train.num_steps=4", "checkpoint.every_steps=2",
                          f"tracking.uri={uri}", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    root = tmp_path / "run" / "checkpoints"
    (root / "step_00000004" / "meta.json").unlink()  # copied part-way
    # evaluate resolves load= twice (the training's overrides, then the checkpoint): the warning comes once. Counted at
    # the logger: before Hydra configures logging, pytest's handler (not stderr) takes a record
    warned: list[str] = []
    monkeypatch.setattr(lineage.log, "warning", lambda fmt, *args: warned.append(fmt % args))
    out = run_in_process([sys.executable, "-m", "recsys_runner.evaluate", f"load={root}", f"tracking.uri={uri}",
                          f"hydra.run.dir={tmp_path}/eval"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    warning = (f"load={root}: skipped step_00000004 (meta.json is missing), incomplete or damaged (copied part-way, a deleted "
               f"file, or still being written); loading step_00000002, the newest complete one there, instead")
    assert len(warned) == 1 and warned[0].startswith(warning), warned
    assert lineage.locate_checkpoint(str(root)) == lineage.Located(root / "step_00000002", ((root / "step_00000004", "meta.json is missing"),))


def test_a_multirun_directory_given_to_load_lists_its_jobs_checkpoints_folders(tmp_path: Path) -> None:
    # was: "<multirun dir> holds no complete checkpoint", though each <job>/checkpoints held them
    sweep = tmp_path / "multirun" / "day0"
    for job in ("0", "1"):
        fake_checkpoint(sweep / job / "checkpoints" / "step_00000010")
    (sweep / "multirun.yaml").write_text("")
    with pytest.raises(CheckpointError, match=rf"{sweep} holds no checkpoint: it is a multirun's directory, whose jobs each keep "
                                              rf"theirs in <job>/checkpoints. Fix: load= one job's, e.g.\n  load={sweep}/0/checkpoints"
                                              rf"\n  load={sweep}/1/checkpoints$"):
        lineage.resolve_checkpoint(str(sweep))
