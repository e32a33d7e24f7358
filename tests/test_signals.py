"""Every command ends the same way on a signal: SIGTERM/SIGINT end the unit under way (or abandon it), training
checkpoints, the MLflow run ends KILLED, one message says what was kept and the exact command that resumes or redoes
it, and the exit status is 128 + signal (143, 130). Real signals, as a user or a scheduler sends them; and a relaunch of the same command that notices an interrupted run in the default checkpoint place. The
commands run in this process as ``python -m`` would run them (:func:`tests.conftest.run_in_process`), a SIGTERM sent by
another thread (:func:`tests.conftest.signal_in_process`: a real signal, handled by the command's own handler as in a
process of its own; in the final eval's first batch, sent by the eval itself); the SIGINT case is a process of its own,
SIGINT's default action reset in it as at a terminal.
The printed command run as typed in a shell: test_run_safety.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from recsys_runner.__main__ import run
from recsys_runner.checkpoint.storage import DcpFileStorage, list_checkpoints
from recsys_runner.config import register_configs
from recsys_runner.data.generated.generate import write_criteo_parquet
from recsys_runner.lifecycle import FINISHED_MARK, exit_codes, interrupted_message, interrupted_runs
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.runtime import Launch
from recsys_runner.train.signals import Interrupted, RaiseOnSignal, deferred, stopping
from tests.conftest import REPO, TINY, hint_of, run_in_process, signal_in_process
from tests.test_eval_stops import sigterm_in_eval
from tests.test_predict import trained_once  # noqa: F401 - a fixture: a DeepFM trained on Parquet once
from tests.test_run_safety import SMALL, runs

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
ENV.pop("HYDRA_FULL_ERROR", None)
LONG_EVAL = ["data.num_eval_rows=200000", "train.eval_max_batches=null"]
"""~780 eval batches: an evaluate that lasts seconds, long enough to be hit by a signal sent 0.2 s into it. The final-eval
case needs none of it: its SIGTERM comes inside its eval (test_eval_stops' :func:`~tests.test_eval_stops.sigterm_in_eval`)."""


def _sigint_as_at_a_terminal() -> None:
    """In the child: SIGINT with its default action, as a command typed at a terminal has it. A suite started in the
    background by a shell (``make test &``, a CI runner) ignores SIGINT, its children inherit that, and Python keeps an
    ignored SIGINT ignored, rightly (``nohup``, ``&``): the SIGINT tests would then test nothing but that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_when(argv: list[str], marker: str, signum: int, cwd: Path, delay_s: float = 0.5,
                 timeout_s: float = 120, ready: Callable[[], bool] | None = None) -> tuple[int, str]:
    """Run ``argv``, send ``signum`` ``delay_s`` after ``marker`` appears in its output (and, given ``ready``, once it
    returns true: polled, so that a loaded machine only waits longer); its exit status and output."""
    proc = subprocess.Popen(argv, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_sigint_as_at_a_terminal)
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        for line in proc.stdout:
            seen.append(line)
            if marker in line or time.monotonic() > deadline:
                break
        assert proc.poll() is None and marker in seen[-1], "".join(seen)[-3000:]
        while ready is not None and not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and (ready is None or ready()), "".join(seen)[-3000:]
        time.sleep(delay_s)
        proc.send_signal(signum)
        rest, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(seen) + rest


def _run_open(root: Path) -> Callable[[], bool]:
    """Whether a run of the MLflow store in ``root`` (sqlite, artifacts in ``root/mlruns``) is open: its
    ``manifest.json``, the last thing logged as a run opens (lifecycle.py's ``_open``), is there."""
    return lambda: any((root / "mlruns").glob("*/*/artifacts/manifest.json"))


def _new_run_open(uri: str, experiment: str, entry: str) -> Callable[[], bool]:
    """Whether a run of the command ``entry`` (its tag) opened in ``experiment`` since this was called. Read from the
    store ``uri``, which must exist whole already (a store being created must not be opened: test_tracking_faults); not
    from the artifact folder, which may be shared: a store made in-process keeps its artifacts in ./mlruns of the
    suite's directory, where the other pytest worker's stores put theirs (experiment 1 of each)."""
    def count() -> int:
        return sum(r.data.tags.get("entry") == entry for r in runs(uri, experiment))

    before = count()
    return lambda: count() > before


def _status(uri: str, run_id: str) -> str:
    return MlflowClient(tracking_uri=uri).get_run(run_id).info.status


# -- training: a signal during the final eval ---------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_during_the_final_eval_checkpoints_and_the_printed_command_resumes(store_uri: str, tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    uri = store_uri
    args = [*SMALL, "train.eval_max_batches=null", "train.num_steps=6", f"tracking.uri={uri}", "tracking.experiment=final_eval"]
    with monkeypatch.context() as patched:  # in the first batch of the final eval (of 32): the sanity eval, then it
        sent = sigterm_in_eval(patched, 2)
        stopped = run_in_process([sys.executable, "-m", "recsys_runner", *args], tmp_path)
    code, out = stopped.returncode, stopped.stdout + stopped.stderr
    assert sent == [2] and code == 143, out[-3000:]
    assert "step 6/6 train/loss" in out, out[-3000:]
    assert "Interrupted: stopped by SIGTERM during the final eval after step 6; checkpoint " in out, out[-3000:]
    command = hint_of(out)
    assert command is not None, out[-3000:]
    ckpt_dir = Path(next(a for a in command if a.startswith("checkpoint.dir=")).split("=", 1)[1])
    assert [p.name for p in list_checkpoints(ckpt_dir)] == ["step_00000006"]  # the default dir: this launch's run dir
    assert not (ckpt_dir / FINISHED_MARK).exists()
    (killed,) = runs(uri, "final_eval")
    assert killed.info.status == "KILLED" and "eval/auc" not in killed.data.metrics  # the eval was abandoned

    again = run_in_process(command, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step_00000006 at step 6" in again.stdout + again.stderr  # resumed there: no step trained twice
    (finished,) = runs(uri, "final_eval")  # the same MLflow run, continued
    assert finished.info.run_id == killed.info.run_id
    assert finished.info.status == "FINISHED" and "eval/auc" in finished.data.metrics
    assert (ckpt_dir / FINISHED_MARK).exists()


# -- evaluate: nothing to keep, the run KILLED, the command to redo it ----------------------------------------------
@pytest.fixture(scope="module")
def four_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of a TINY DeepFM trained 4 steps in this process, shared by both signals' evaluate runs."""
    root = tmp_path_factory.mktemp("four_steps")
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        run(compose(config_name="config", overrides=[*TINY, "train.num_steps=4", f"checkpoint.dir={root}/ckpt", "tracking=none"]))
    (checkpoint,) = list_checkpoints(root / "ckpt")
    return checkpoint


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_evaluate_ends_its_run_killed_with_the_command_to_redo_it(
    store_uri: str, four_steps: Path, tmp_path: Path, signum: int, code: int
) -> None:
    model = [a for a in TINY if a.startswith("data.")]
    checkpoint = four_steps
    uri = store_uri
    args = [*model, *LONG_EVAL, "distributed.device=cpu", f"load={checkpoint}", f"tracking.uri={uri}", "tracking.experiment=ev"]
    # "loaded weights of" is logged while evaluate builds, before its MLflow run is opened (on a loaded machine, seconds
    # before): a signal there finds no run to end KILLED. It waits for the open run; the eval, ~780 batches, then lasts.
    argv = [sys.executable, "-m", "recsys_runner.evaluate", *args]
    if signum == signal.SIGINT:  # a process: SIGINT's default action reset in it, as at a terminal (_sigint_as_at_a_terminal)
        got, out = _signal_when(argv, "loaded weights of", signum, tmp_path, delay_s=0.2, ready=_run_open(tmp_path))
    else:  # in this process, the same real signal from another thread (tests.conftest.signal_in_process)
        got, out, _ = signal_in_process(argv, tmp_path, "loaded weights of", signum, 0.2, ready=_run_open(tmp_path))
    assert got == code, out[-3000:]
    (line,) = [x for x in out.splitlines() if x.startswith("Interrupted:")]
    (mlrun,) = runs(uri, "ev")
    assert mlrun.info.status == "KILLED"
    name = signal.Signals(signum).name
    assert line.startswith(f"Interrupted: stopped by {name} during evaluate; nothing was kept "
                           f"(MLflow run {mlrun.info.run_id} is KILLED); redo it with: python -m recsys_runner.evaluate "), line
    assert f"load={checkpoint}" in line and "Traceback" not in out


# -- a relaunch notices the interrupted run in the default place ----------------------------------------------------
def test_a_relaunch_names_the_interrupted_run_of_the_same_command_and_how_to_resume_it(store_uri: str, tmp_path: Path,
                                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch in the same second, as when a launch takes under one: Hydra's run folder is to the second
    (``outputs/<date>/<time>``), and the relaunch shared it and silently resumed the first's checkpoints (a flaky failure
    waiting for a faster machine) until it became ``${new_dir:…}`` (recsys_runner/paths.py): the relaunch gets ``<time>_2``."""
    import hydra.core.utils

    class SameSecond(datetime.datetime):
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> SameSecond:
            return cls(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr(hydra.core.utils, "datetime", SameSecond)  # what Hydra's ${now:…} reads
    args = [*SMALL, "train.num_steps=6", "train.stop_after_steps=3", f"tracking.uri={store_uri}",
            "tracking.experiment=notice"]
    first = run_in_process([sys.executable, "-m", "recsys_runner", *args], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    first_dir = Path(next(a for a in hint_of(first.stderr) or [] if a.startswith("checkpoint.dir=")).split("=", 1)[1])

    second = run_in_process([sys.executable, "-m", "recsys_runner", *args], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    out = second.stdout + second.stderr
    (notice,) = [x for x in out.splitlines() if "an interrupted run of this command left checkpoints" in x]
    resume = hint_of(first.stderr)
    assert resume is not None
    assert f"in {first_dir}, up to step_00000003; this launch starts a new run from step 0" in notice, notice
    assert sorted(p.name for p in (tmp_path / "outputs" / "2026-01-02").iterdir()) == ["03-04-05", "03-04-05_2"]
    assert notice.endswith("run: python -m recsys_runner " + " ".join(resume[3:])), notice  # the first run's own hint
    assert "resuming from" not in out  # noticed, not resumed silently

    finished = run_in_process(resume, tmp_path)
    assert finished.returncode == 0 and hint_of(finished.stderr) is None, finished.stderr[-3000:]  # 3 → 6: the end
    assert (first_dir / FINISHED_MARK).exists()
    launch = Launch(overrides=tuple(reversed(args)), runs_root=tmp_path / "outputs", config_name="config")  # any order
    found = interrupted_runs(launch, DcpFileStorage(), None)
    assert first_dir not in found and len(found) == 1  # only the second launch's is left to offer
    other = Launch(overrides=(*args[:-1], "tracking.experiment=other"), runs_root=tmp_path / "outputs", config_name="config")
    assert interrupted_runs(other, DcpFileStorage(), None) == []  # another command's runs are not offered


# -- the guard every command runs under -----------------------------------------------------------------------------
def test_the_guard_raises_once_then_notes_and_leaves_others_handlers_alone() -> None:
    with pytest.raises(Interrupted, match="stopped by SIGTERM during evaluate") as caught, RaiseOnSignal("during evaluate"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    assert caught.value.exit_code == 143 and caught.value.step is None
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # given back

    def theirs(_s: int, _f: object) -> None: ...

    previous = signal.signal(signal.SIGUSR1, theirs)
    try:
        with RaiseOnSignal("during export"):
            assert signal.getsignal(signal.SIGUSR1) is theirs  # a handler someone installed (submitit's) stays
            with deferred() as late:
                os.kill(os.getpid(), signal.SIGTERM)
            assert late() == signal.SIGTERM  # held back while the run's end was written
            os.kill(os.getpid(), signal.SIGTERM)  # stopping already: only noted
        with RaiseOnSignal("during predict"):
            stopping()  # training's Interrupted is on its way out
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_the_message_says_what_was_kept_and_the_command() -> None:
    launch = Launch(overrides=("load=/ck/step_00000004", "data.num_eval_rows=512"), config_name="evaluate",
                    module="recsys_runner.evaluate")
    e = Interrupted(signal.SIGINT, None, None, when="during evaluate")
    assert interrupted_message(launch, e) == ("Interrupted: stopped by SIGINT during evaluate; nothing was kept; redo it with: "
                                              "python -m recsys_runner.evaluate load=/ck/step_00000004 data.num_eval_rows=512")
    e.run_id = "abc"
    assert "nothing was kept (MLflow run abc is KILLED); redo it with" in interrupted_message(launch, e)
    done = Interrupted(signal.SIGTERM, None, None, when="as evaluate ended", finished=True)
    assert interrupted_message(launch, done).endswith("the MLflow run had FINISHED with everything kept, nothing to redo.")
    training = Launch(overrides=("optim.lr=0.1",), output_dir=Path("/o/r"), config_name="config")
    stopped = Interrupted(signal.SIGTERM, 6, "/o/r/checkpoints/step_00000006", when="during the final eval")
    assert interrupted_message(training, stopped) == (
        "Interrupted: stopped by SIGTERM during the final eval after step 6; checkpoint /o/r/checkpoints/step_00000006\n"
        "Resume this run from step_00000006, into the same MLflow run, with this command:\n"
        "  python -m recsys_runner optim.lr=0.1 checkpoint.dir=/o/r/checkpoints")
    assert Launch(config_name="evaluate", module="recsys_runner.evaluate").command() == "python -m recsys_runner.evaluate"
    assert Launch(config_name="config").command_name == "training"


@pytest.mark.parametrize(("rank", "agreed", "told"), [("0", True, True), ("1", True, False), ("1", False, True)])
def test_an_agreed_stop_is_told_once_by_rank_zero(rank: str, agreed: bool, told: bool, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Under torchrun every rank raises the stop they agreed on (same step, checkpoint, command): only rank 0 prints
    its "Interrupted / Resume this run" block; a rank's own stop (here the store wait) is still told by that rank."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    launch = Launch(overrides=("optim.lr=0.1",), output_dir=Path("/o/r"), config_name="config")
    with pytest.raises(SystemExit) as ended, exit_codes(launch):
        raise Interrupted(None, 4, "/o/r/checkpoints/step_00000004", agreed=agreed)
    assert ended.value.code == 0  # train.stop_after_steps: a planned slice
    assert ("Resume this run from step_00000004" in capsys.readouterr().err) == told


# -- predict: a signal mid-write leaves no part, the run KILLED -----------------------------------------------------
def test_sigterm_during_predict_leaves_no_part_and_ends_its_run_killed(
    trained_once: tuple[Path, list[str]], tmp_path: Path,  # noqa: F811 - the fixture imported above
) -> None:
    root, trained = trained_once
    (tmp_path / "score").mkdir()
    write_criteo_parquet(str(tmp_path / "score" / "big.parquet"), 400_000, seed=3, num_embeddings=1000)
    out_dir = tmp_path / "out"
    argv = [sys.executable, "-m", "recsys_runner.predict", *trained, f"load={root}/ck", f"predict.input={tmp_path}/score",
            f"predict.output={out_dir}"]
    uri = next(a.split("=", 1)[1] for a in trained if a.startswith("tracking.uri="))
    # as for evaluate: "loaded weights of" comes before predict opens its MLflow run (on a loaded machine, seconds before:
    # it failed with a 1.5 s delay put there); a signal then found no run to end KILLED. It waits for the open run.
    code, out, _ = signal_in_process(argv, tmp_path, "loaded weights of", signal.SIGTERM, 0.2, ready=_new_run_open(uri, "predict", "predict"))
    assert code == 143, out[-3000:]
    (line,) = [x for x in out.splitlines() if x.startswith("Interrupted:")]
    assert line.startswith("Interrupted: stopped by SIGTERM during predict; ") and "python -m recsys_runner.predict " in line, line
    assert not out_dir.exists() or list(out_dir.iterdir()) == [], sorted(p.name for p in out_dir.iterdir())
    predicted = [r for r in runs(uri, "predict") if r.data.tags.get("entry") == "predict"]
    assert [r.info.status for r in predicted] == ["KILLED"]


# -- a second Ctrl-C while a checkpoint is written ------------------------------------------------------------------
def test_a_second_sigint_while_a_checkpoint_is_written_ends_killed_naming_the_last_complete_one(
    store_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C twice, the second while DCP writes the step-4 checkpoint: DCP catches the ``KeyboardInterrupt`` on its
    rank and raises a ``CheckpointException`` instead (a ``BaseException``), which used to reach the user as a
    traceback, exit 1 and the MLflow run FAILED. Now: one message naming the last complete checkpoint (step 2) and the
    command that resumes from it, exit 130, the run KILLED, the half-written step 4 never listed, and the resume works."""
    from torch.distributed.checkpoint import filesystem

    write_item, write = filesystem._write_item, DcpFileStorage.write
    armed: list[bool] = []

    def arm_at_step_4(self: DcpFileStorage, path: Path, *args: object, **kwargs: object) -> None:
        if path.name == "step_00000004" and not armed:
            armed.append(True)
        write(self, path, *args, **kwargs)

    def twice_at_the_second_checkpoint(*args: object, **kwargs: object) -> object:
        if armed == [True]:  # the first item DCP writes of the step-4 checkpoint
            armed.append(False)
            os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: noted, the loop would stop after this step...
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGINT)  # ...the second: at once, inside DCP's write
            time.sleep(5)  # the handler raises before this ends
        return write_item(*args, **kwargs)

    monkeypatch.setattr(DcpFileStorage, "write", arm_at_step_4)
    monkeypatch.setattr(filesystem, "_write_item", twice_at_the_second_checkpoint)
    uri = store_uri
    args = [*SMALL, "train.num_steps=8", "checkpoint.every_steps=2", f"tracking.uri={uri}", "tracking.experiment=twice"]
    out = run_in_process([sys.executable, "-m", "recsys_runner", *args], tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 130, text[-3000:]
    assert "Traceback" not in text and "CheckpointException" not in text, text[-3000:]
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("Interrupted:")]
    assert line.startswith("Interrupted: stopped by SIGINT a second time after step 4; checkpoint "), line
    assert line.endswith("step_00000002"), line
    (killed,) = runs(uri, "twice")
    assert killed.info.status == "KILLED"
    command = hint_of(out.stderr)
    assert command is not None, out.stderr[-3000:]
    ckpt_dir = Path(next(a for a in command if a.startswith("checkpoint.dir=")).split("=", 1)[1])
    assert [p.name for p in list_checkpoints(ckpt_dir)] == ["step_00000002"]  # step 4, cut off, is not listed

    monkeypatch.setattr(filesystem, "_write_item", write_item)
    monkeypatch.setattr(DcpFileStorage, "write", write)
    again = run_in_process(command, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    (finished,) = runs(uri, "twice")
    assert finished.info.run_id == killed.info.run_id and finished.info.status == "FINISHED"
