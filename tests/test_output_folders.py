"""Every local folder a training run writes is checked when the run is built (recsys_runner/tracking/folders.py): a file in
the TensorBoard folder's place, a TensorBoard folder this user cannot write, an MLflow artifact folder in the same state
and an unusable temporary folder for profiler traces each stop the run before the data and the model are built, in one
line that names the setting, the path, the cause and the fix, where they used to fail at the first write after training
had started (a raw ``FileExistsError``/``PermissionError`` traceback, or metrics buffered as a tracking outage)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from recsys_runner.errors import TrackingError
from recsys_runner.staging import unwritable
from recsys_runner.tracking.folders import check_folder
from recsys_runner.tracking.tracker import MlflowTracker, MlflowTrackingConfig
from recsys_runner.train.profiling import check_trace_folder
from tests.conftest import REPO, TINY
from tests.test_run_safety import runs

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
ENV.pop("HYDRA_FULL_ERROR", None)
RUN = [*[a for a in TINY if not a.startswith("train.")], "train.num_steps=2", "train.summary_every_steps=1",
       "train.summary_histograms=true", "tracking.tensorboard=true"]
"""A run that would write TensorBoard scalars and histograms at its first step."""

_NO_ROOT_POWERS = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]
"""Runs a command as root without the capability to write through permission bits (CAP_DAC_OVERRIDE), so that a folder
without write permission is one for it (the tests run as root here; as another user the bits hold anyway)."""


def _cli(cwd: Path, *args: str, as_user: bool = False) -> tuple[subprocess.CompletedProcess[str], str]:
    prefix = _NO_ROOT_POWERS if as_user and os.geteuid() == 0 else []
    result = subprocess.run([*prefix, sys.executable, "-m", "recsys_runner", *args], cwd=cwd, env=ENV, capture_output=True,
                            text=True, timeout=300)
    return result, result.stdout + result.stderr


def _refused(result: subprocess.CompletedProcess[str], out: str) -> str:
    """The one error line of a run refused before its data and model were built."""
    assert result.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "sharding plan" not in out and "step 1/" not in out, out[-3000:]
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("Tracking error: ")]
    return line


def test_a_file_in_the_tensorboard_folders_place_stops_the_run_before_the_model_is_built(
        make_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process, with the launch the CLI would hand down (its run directory): the command's side (exit 2, one line, no
    traceback, nothing built) is the CLI test below, which meets the same check."""
    import recsys_runner.build
    from recsys_runner.__main__ import run
    from recsys_runner.runtime import Launch

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tensorboard").write_text("not a folder")

    def no_data(*args: object, **kwargs: object) -> None:
        raise AssertionError("the data was built before the folder was checked")

    monkeypatch.setattr(recsys_runner.build, "build_data", no_data)
    cfg = make_cfg(*RUN, tiny=False)
    with pytest.raises(TrackingError) as raised:
        run(cfg, Launch(output_dir=run_dir))
    line = f"{raised.value.label}: {raised.value}"
    assert line == (f"Tracking error: tracking.tensorboard=true writes its event files into {run_dir}/tensorboard, which cannot "
                    f"be written: a file is in its place. Fix: move or remove {run_dir}/tensorboard, use another run directory "
                    "(hydra.run.dir=<dir>), or tracking.tensorboard=false"), line
    assert runs(cfg.tracking.uri, cfg.tracking.experiment) == []  # refused before its MLflow run was opened


@pytest.mark.slow
def test_a_tensorboard_folder_this_user_cannot_write_stops_the_run_before_the_model_is_built(tmp_path: Path) -> None:
    assert shutil.which("setpriv") is not None or os.geteuid() != 0, "setpriv (util-linux) drops root's write-through power"
    run_dir = tmp_path / "run"
    logdir = run_dir / "tensorboard"
    logdir.mkdir(parents=True)
    logdir.chmod(0o555)
    try:
        probe = subprocess.run([*(_NO_ROOT_POWERS if os.geteuid() == 0 else []), "touch", str(logdir / "x")], capture_output=True)
        assert probe.returncode != 0, "the folder must be unwritable for the run's process"
        uri = f"sqlite:///{tmp_path}/mlflow.db"
        result, out = _cli(tmp_path, *RUN, f"hydra.run.dir={run_dir}", f"tracking.uri={uri}", "tracking.experiment=tb_perm",
                           as_user=True)
    finally:
        logdir.chmod(0o755)
    line = _refused(result, out)
    assert line.startswith(f"Tracking error: tracking.tensorboard=true writes its event files into {logdir}, which cannot be "
                           f"written: permission denied: this user (uid {os.geteuid()}) cannot create files in {logdir}. "
                           f"Fix: make {logdir} writable for this user (chmod u+w {logdir}, or chown it), use another run "
                           "directory (hydra.run.dir=<dir>), or tracking.tensorboard=false"), line
    assert not list(logdir.iterdir())


def test_the_cause_is_named_for_a_file_in_the_folders_place_or_its_parents_and_a_missing_folder_is_fine(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert unwritable(tmp_path / "file") == (tmp_path / "file", "a file is in its place", f"move or remove {tmp_path}/file")
    assert unwritable(tmp_path / "file" / "tb") == (
        tmp_path / "file", f"a file is in the place of its parent folder {tmp_path}/file", f"move or remove {tmp_path}/file")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    dangling = unwritable(tmp_path / "link")
    assert dangling is not None and dangling[1] == "a link to nothing is in its place"
    assert unwritable(tmp_path / "new" / "deeper") is None and not (tmp_path / "new").exists()  # nothing made, nothing left
    assert unwritable(tmp_path) is None and sorted(p.name for p in tmp_path.iterdir()) == ["file", "link"]
    with pytest.raises(TrackingError, match=r"^x=1 writes its files into .*/file, which cannot be written: a file is in its "
                                            r"place\. Fix: move or remove .*/file, or x=0$"):
        check_folder(tmp_path / "file", setting="x=1", writes="its files", fixes=("x=0",))


def test_an_mlflow_artifact_folder_that_cannot_be_written_is_refused_when_the_store_is_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The summaries' histograms, the manifest and the profiler traces are MLflow artifacts: MLflow writes their folder
    only at the first artifact, and a failure there would be buffered as an outage until the end of the run."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlruns").write_text("")  # a new experiment's artifacts go to ./mlruns beside a database store
    tracker = MlflowTracker(MlflowTrackingConfig(uri=uri, experiment="new"))
    with pytest.raises(TrackingError) as new:
        tracker.check()
    assert str(new.value) == (
        f"the MLflow store {uri} (tracking.uri) writes experiment 'new''s run artifacts (config.yaml, the manifest, summaries' "
        f"histograms, profiler traces) into {tmp_path}/mlruns, which cannot be written: a file is in its place. Fix: move or "
        f"remove {tmp_path}/mlruns, start the run from another directory (a new experiment's artifacts go to its ./mlruns), "
        "or tracking=none")

    (tmp_path / "artifacts").write_text("")
    MlflowClient(tracking_uri=uri).create_experiment("old", artifact_location=str(tmp_path / "artifacts"))
    with pytest.raises(TrackingError, match=r"experiment 'old''s run artifacts .* into .*/artifacts, which cannot be written: "
                                            r"a file is in its place\. .*use another tracking\.experiment"):
        MlflowTracker(MlflowTrackingConfig(uri=uri, experiment="old")).check()
    (tmp_path / "mlruns").unlink()
    MlflowTracker(MlflowTrackingConfig(uri=uri, experiment="new")).check()  # a folder to be made: fine


def test_profiler_traces_need_a_temporary_folder_that_can_be_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tmp").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # what $TMPDIR set tempfile to
    with pytest.raises(TrackingError, match=r"^train\.profile\.enabled=true writes its traces \(before logging them as "
                                            r"artifacts\) into .*/tmp, which cannot be written: a file is in its place\. "
                                            r"Fix: move or remove .*/tmp, set TMPDIR to a writable folder, or "
                                            r"train\.profile\.enabled=false$"):
        check_trace_folder()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    check_trace_folder()


def test_profiler_traces_need_a_run_folder_that_can_be_written(tmp_path: Path) -> None:
    (tmp_path / "profile").write_text("")  # <run dir>/profile, where a CLI run keeps its traces
    with pytest.raises(TrackingError, match=r"^train\.profile\.enabled=true writes its traces into .*/profile, which cannot "
                                            r"be written: a file is in its place\. Fix: move or remove .*/profile, use another "
                                            r"run directory \(hydra\.run\.dir=<dir>\), or train\.profile\.enabled=false$"):
        check_trace_folder(tmp_path / "profile")
    check_trace_folder(tmp_path / "new" / "profile")  # a folder to be made: fine
