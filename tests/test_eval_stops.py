"""A stop signal during an eval is honoured within one chunk of its work, and a step's eval is logged once per MLflow run.

Real SIGTERMs: the full-corpus eval of a two-tower model and a periodic
eval are abandoned between chunks, well before the eval would end, and the resume evaluates that step once; an eval that
completed and was logged before the stop is not evaluated (nor logged) again by the resume, whether the checkpoint of its
step recorded it or, written before it, did not (then the MLflow run's history says so). Each MLflow history is read with
``MlflowClient.get_metric_history``: exactly one value per step. Every command runs in this process as ``python -m``
would run it (:func:`tests.conftest.run_in_process`; a SIGTERM from another thread at a given log line:
:func:`tests.conftest.signal_in_process`, from the tracker itself right after it logged a metric, or from the eval
itself as it reads its first batch: :func:`sigterm_in_eval`): what the command
does with its arguments and the signal is the point here, not the interpreter; that the printed command works as typed
in a shell is test_run_safety's ``..._executed_verbatim_...``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from torchrec.datasets.utils import Batch

from recsys_runner.checkpoint.storage import list_checkpoints
from recsys_runner.tracking.tracker import MlflowTracker
from recsys_runner.train import evaluation
from tests.conftest import TINY, hint_of, run_in_process, signal_in_process, torchrun
from tests.test_run_safety import runs

CORPUS = ["model=dssm", "data=synthetic_retrieval", "data.num_sparse=2", "data.batch_size=512", "data.num_embeddings=100000",
          "data.num_train_rows=8192", "data.num_eval_rows=4096", "model.eval_metrics=[recall@10]", "train.num_steps=2",
          "train.log_every_steps=1", "train.eval_every_steps=null", "train.eval_max_batches=null", "distributed.device=cpu"]
"""A DSSM whose final eval ranks 4096 queries against a catalogue of 100k items (13 chunks of 8192): seconds of work."""

_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")



def _at(line: str) -> float:
    """The wall-clock time of a log line (Hydra's ``[2026-01-01 12:00:00,123]`` prefix)."""
    found = _STAMP.match(line)
    assert found, line
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _signal_after(argv: list[str], marker: str, delay_s: float, cwd: Path) -> tuple[int, str, float]:
    """Run ``argv``, send it SIGTERM ``delay_s`` after ``marker`` appears in its output; its exit status, output and the
    wall-clock time the signal was sent. In this process (:func:`tests.conftest.signal_in_process`): a real SIGTERM,
    sent by another thread, handled by the command's own handler as in a process of its own."""
    return signal_in_process(argv, cwd, marker, signal.SIGTERM, delay_s)


def _history(uri: str, run_id: str, key: str) -> list[int]:
    """The steps of every value of ``key`` the MLflow run holds (one per logging: MLflow keeps them all)."""
    return sorted(m.step for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key))


def _stopped_after(command: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch, after: str) -> subprocess.CompletedProcess[str]:
    """``command`` run in this process (:func:`tests.conftest.run_in_process`), which sends itself SIGTERM right after
    its tracker logged ``after`` (``<metric>@<step>``), once: the signal then comes between two lines of the loop, where
    no outside sender can aim (it is handled as one from outside: by the command's own handler, in the main thread)."""
    key, step = after.rsplit("@", 1)
    log, sent = MlflowTracker.log_metrics, []

    def log_then_stop(self: MlflowTracker, metrics: Mapping[str, float], at: int) -> None:
        log(self, metrics, at)
        if key in metrics and at == int(step) and not sent:
            sent.append(at)
            os.kill(os.getpid(), signal.SIGTERM)

    with monkeypatch.context() as patched:
        patched.setattr(MlflowTracker, "log_metrics", log_then_stop)
        done = run_in_process(command, cwd)
    assert sent, f"{after} was never logged: {done.stderr[-3000:]}"
    return done


def sigterm_in_eval(patched: pytest.MonkeyPatch, nth: int) -> list[int]:
    """A SIGTERM to this process as the ``nth`` eval of a command run in it reads its first batch (the sanity eval, which
    every launch runs before its first step, is the first), once; the list it appends ``nth`` to when it sent it. The
    signal lands inside the eval whatever the machine's load, so the eval need not last seconds for a signal sent from
    outside at a log line to find it still under way: it is handled as one from outside (by the command's own handler,
    in the main thread), and the eval is abandoned after the batch it came in."""
    checked, evals, sent = evaluation.checked_batches, [], []

    def signalled(batches: Iterable[Batch], *args: Any) -> Iterator[Batch]:
        evals.append(1)
        for i, batch in enumerate(checked(batches, *args)):
            if len(evals) == nth and i == 0 and not sent:
                sent.append(nth)
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch

    patched.setattr(evaluation, "checked_batches", signalled)
    return sent


def _resume(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """A printed resume command, run in this process (no ~10 s of imports): exit status and output as a process's."""
    return run_in_process(command, cwd)


@pytest.mark.slow
def test_sigterm_during_a_full_corpus_eval_stops_within_a_chunk_and_the_resume_logs_it_once(
    store_uri: str, tmp_path: Path
) -> None:
    uri = store_uri
    args = [*CORPUS, f"tracking.uri={uri}", "tracking.experiment=corpus_stop", f"hydra.run.dir={tmp_path}/run"]
    # 1 s after the last step: the final eval is ranking queries against the catalogue
    code, out, sent = _signal_after([sys.executable, "-m", "recsys_runner", *args], "step 2/2 train/loss", 1.0, tmp_path)
    assert code == 143, out[-3000:]
    assert "Interrupted: stopped by SIGTERM during the final eval after step 2; checkpoint " in out, out[-3000:]
    (saved,) = [line for line in out.splitlines() if "checkpoint saved:" in line]
    stopped_s = _at(saved) - sent  # from the signal to the checkpoint of the abandoned eval's step
    (killed,) = runs(uri, "corpus_stop")
    assert killed.info.status == "KILLED" and "eval/recall_at_10" not in killed.data.metrics  # nothing of it logged

    command = hint_of(out)
    assert command is not None, out[-3000:]
    again = _resume(command, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    lines = (again.stdout + again.stderr).splitlines()
    at = next(i for i, line in enumerate(lines) if "step 2/2 eval/recall_at_10=" in line)
    before = next(line for line in reversed(lines[:at]) if _STAMP.match(line))
    eval_s = _at(lines[at]) - _at(before)  # the whole eval, which the resume runs to the end
    assert eval_s > 2.0, lines[at - 3: at + 1]  # long enough for the bound below to mean something
    print(f"stopped {stopped_s:.2f} s after the signal; the whole eval takes {eval_s:.2f} s")
    assert stopped_s < eval_s / 4, (stopped_s, eval_s)  # within a chunk's work, not after the eval
    (finished,) = runs(uri, "corpus_stop")
    assert finished.info.run_id == killed.info.run_id and finished.info.status == "FINISHED"
    assert _history(uri, finished.info.run_id, "eval/recall_at_10") == [2]


PERIODIC = {
    "deepfm": ([a for a in TINY if not a.startswith("train.")], "eval/auc"),
    "sasrec": (["model=sasrec", "data=synthetic_sequences", "data.batch_size=128", "data.num_items=20000", "data.max_len=20",
                "data.num_train_rows=8192", "data.num_eval_rows=2048", "model.embedding_dim=32", "distributed.device=cpu"],
               "eval/hr_at_10"),
}
"""Evals of several batches: a DeepFM's 32 batches of AUC, a SASRec's 16 batches each scored against all 20k items (hr@k);
the SIGTERM comes in the first batch of the periodic eval of step 2 (:func:`sigterm_in_eval`), so the rest is abandoned."""


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(PERIODIC))
def test_sigterm_during_a_periodic_eval_abandons_it_and_the_resume_evaluates_that_step_first(
    store_uri: str, tmp_path: Path, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = store_uri
    data, key = PERIODIC[model]
    args = [*data, "train.eval_max_batches=null", "train.num_steps=4", "train.log_every_steps=1", "train.eval_every_steps=2",
            f"tracking.uri={uri}", "tracking.experiment=periodic_stop", f"hydra.run.dir={tmp_path}/run"]
    with monkeypatch.context() as patched:
        sent = sigterm_in_eval(patched, 2)  # the sanity eval, then the periodic eval of step 2
        stopped = run_in_process([sys.executable, "-m", "recsys_runner", *args], tmp_path)
    code, out = stopped.returncode, stopped.stdout + stopped.stderr
    assert sent == [2] and code == 143, out[-3000:]
    assert "step 2/4 train/loss" in out and "step 1/4 train/loss" in out, out[-3000:]  # the signal came after step 2
    assert "Interrupted: stopped by SIGTERM during the eval after step 2; checkpoint " in out, out[-3000:]
    assert f"step 2/4 {key}" not in out and "step 3/4" not in out  # abandoned, and no step after it
    command = hint_of(out)
    assert command is not None, out[-3000:]
    ckpt_dir = Path(next(a for a in command if a.startswith("checkpoint.dir=")).split("=", 1)[1])
    assert [p.name for p in list_checkpoints(ckpt_dir)] == ["step_00000002"]

    again = _resume(command, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    lines = [line for line in (again.stdout + again.stderr).splitlines() if re.search(r"step \d/4 ", line)]
    assert f"step 2/4 {key}" in lines[0] and "step 3/4 train/loss" in lines[1], lines  # step 2's eval, before step 3
    (run,) = runs(uri, "periodic_stop")
    assert run.info.status == "FINISHED"
    assert _history(uri, run.info.run_id, key) == [2, 4]


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_first", [False, True], ids=["checkpoint-after-eval", "checkpoint-before-eval"])
def test_an_eval_logged_before_the_stop_is_not_evaluated_or_logged_again_by_the_resume(
    store_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpoint_first: bool
) -> None:
    """The duplicate a user saw: the final eval completed and was logged, the signal stopped the run at its end (a signal
    that comes as the end checkpoint is written, or during an eval with several ranks), and the resume evaluated the
    same step again: two values of ``eval/auc`` at it. ``checkpoint-before-eval``: the checkpoint of that step was
    written by an earlier stop before the eval (it cannot record it), so the MLflow run's history is what says it."""
    uri = store_uri
    args = [*[a for a in TINY if not a.startswith("train.")], "train.num_steps=4", "train.log_every_steps=2",
            "train.eval_every_steps=null", f"tracking.uri={uri}", "tracking.experiment=once", f"hydra.run.dir={tmp_path}/run"]
    launch = [sys.executable, "-m", "recsys_runner", *args]
    if checkpoint_first:  # stopped after the last step's log line, before the final eval: step 4's checkpoint, no metrics
        first = _stopped_after(launch, tmp_path, monkeypatch, "train/loss@4")
        assert first.returncode == 143 and "stopped by SIGTERM after step 4" in first.stderr, first.stderr[-3000:]
        command = hint_of(first.stderr)
        assert command is not None
        launch = command
    stopped = _stopped_after(launch, tmp_path, monkeypatch, "eval/auc@4")  # right after the eval is logged
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "Interrupted: stopped by SIGTERM at the end of training after step 4; checkpoint " in stopped.stderr, stopped.stderr[-3000:]
    (run,) = runs(uri, "once")
    assert run.info.status == "KILLED" and _history(uri, run.info.run_id, "eval/auc") == [4]

    command = hint_of(stopped.stderr)
    assert command is not None
    again = _resume(command, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stdout + again.stderr
    why = "the MLflow run holds its metrics at this step" if checkpoint_first else "its checkpoint recorded it"
    assert f"step 4: its eval was completed and logged by an earlier launch ({why}); not evaluated again" in out, out[-3000:]
    assert "step 4/4 eval/auc" not in out, out[-3000:]  # not evaluated again
    (finished,) = runs(uri, "once")
    assert finished.info.run_id == run.info.run_id and finished.info.status == "FINISHED"
    assert _history(uri, run.info.run_id, "eval/auc") == [4]  # once
    assert finished.data.metrics["eval/auc"] == run.data.metrics["eval/auc"]



def _two_ranks(tmp_path: Path, *extra: str) -> list[str]:
    """A DeepFM of 6 steps on 2 gloo ranks (:mod:`tests.eval_signal`'s), its checkpoints in ``<tmp_path>/ck``."""
    return [*[a for a in TINY if not a.startswith("train.")], "train.num_steps=6", "train.log_every_steps=1",
            "train.eval_max_batches=2", "tracking=none", f"checkpoint.dir={tmp_path}/ck", f"hydra.run.dir={tmp_path}/run", *extra]


def _stopped_after_step_3_with_its_eval(tmp_path: Path, done: subprocess.CompletedProcess[str], trained: int) -> None:
    """Both ranks stopped on the signal right after the eval of step 3, its checkpoint holding the eval's metrics, each
    rank having trained ``trained`` steps in this launch."""
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "exitcode  : 143" in out, out[-3000:]
    assert f"Interrupted: stopped by SIGTERM after step 3; checkpoint {tmp_path}/ck/step_00000003" in out, out[-3000:]
    assert "step 3/6 eval/auc=" in out and "step 4/6" not in out, out[-3000:]
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["step_00000003"]
    assert [(tmp_path / f"steps_rank{r}.txt").read_text() for r in (0, 1)] == [str(trained)] * 2


@pytest.mark.slow
def test_a_signal_to_one_rank_during_a_periodic_eval_stops_both_right_after_it_with_its_metrics(tmp_path: Path) -> None:
    """2 gloo ranks, rank 1 signalled at the first batch of the eval of step 3 (:mod:`tests.eval_signal`): the eval ends
    on both (its forwards and gathers are collectives), then the ranks agree on the signal at once, not at the next
    ``train.stop_check_every_steps`` (10) boundary: both stop after step 3, its checkpoint holds the eval's metrics, and
    neither rank trains a step more than the other. Before, the signal waited for that boundary, here past the last
    step: the run trained on to step 6 and its final eval."""
    done = torchrun(*_two_ranks(tmp_path, "train.eval_every_steps=3"), cwd=tmp_path, module="tests.eval_signal")
    _stopped_after_step_3_with_its_eval(tmp_path, done, trained=3)
    meta = json.loads((tmp_path / "ck" / "step_00000003" / "meta.json").read_text())
    assert set(meta["metrics"]) >= {"eval/auc", "eval/logloss"}, meta


@pytest.mark.slow
def test_a_signal_to_one_rank_during_the_eval_a_resume_starts_with_stops_both_right_after_it(tmp_path: Path) -> None:
    """The eval a resumed run runs first (its checkpoint, at an eval step, lacks the eval: here written by a launch
    without evals, resumed with ``train.eval_every_steps=3``) on 2 gloo ranks, rank 1 signalled in it: the ranks agree
    right after it and stop before training a step, rather than at the next ``train.stop_check_every_steps`` boundary."""
    first = run_in_process([sys.executable, "-m", "recsys_runner", *_two_ranks(tmp_path, "train.eval_every_steps=null",
                                                                               "train.stop_after_steps=3")], tmp_path)
    assert first.returncode == 0 and [p.name for p in list_checkpoints(tmp_path / "ck")] == ["step_00000003"], first.stderr[-3000:]
    done = torchrun(*_two_ranks(tmp_path, "train.eval_every_steps=3"), cwd=tmp_path, module="tests.eval_signal")
    _stopped_after_step_3_with_its_eval(tmp_path, done, trained=0)
