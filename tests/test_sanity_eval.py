"""The sanity eval (``train.sanity_eval_batches``): before the first step, the eval's per-batch path on a few eval batches,
so that an error only the eval meets stops the run in seconds, with the eval's own message, before any step or
checkpoint; and it leaves the training exactly as without it (losses, weights, EMA, optimizer state, the data's
counters, the modules' modes, the random generators, samples/s, once-only data warnings). A signal during it stops the
run before the first step."""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import DictConfig
from torchrec.datasets.utils import Batch

from recsys_runner.__main__ import run
from recsys_runner.build import build
from recsys_runner.checkpoint.storage import list_checkpoints
from recsys_runner.config import validate
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.models.collision import collision_counters
from recsys_runner.train import evaluation, loop, throughput
from recsys_runner.train.loop import train
from tests.conftest import LogWarnings, hint_of, run_in_process, torchrun
from tests.test_run_safety import runs, steps_logged
from tests.test_sequence_files import MAX_LEN, histories, parquet, write_parquet

ROWS = 64


def _write(path: Path, n: int, label: list[int] | None = None, tag: list[list[int]] | None = None) -> str:
    """``n`` click rows (``label``, ``item``, a one-id list ``tag``) at ``path``; ``label``/``tag`` replace the columns."""
    pq.write_table(pa.table({"label": label or [i % 2 for i in range(n)], "item": [i % 16 for i in range(n)],
                             "tag": tag or [[i % 16] for i in range(n)]}), path)
    return str(path)


def _files(tmp_path: Path, *extra: str, eval_label: list[int] | None = None, eval_tag: list[list[int]] | None = None) -> list[str]:
    """A DeepFM over two sparse columns of Parquet rows, 4 steps of 8 rows, a checkpoint every step."""
    return ["data=parquet", f"data.path={_write(tmp_path / 'train.parquet', ROWS)}",
            f"data.eval_path={_write(tmp_path / 'eval.parquet', 16, eval_label, eval_tag)}", "data.batch_size=8",
            "data.num_workers=0", "data.sparse=[{name:item,num_embeddings:16},{name:tag,num_embeddings:16}]",
            "train.num_steps=4", "train.log_every_steps=1", "train.eval_every_steps=null", "distributed.device=cpu",
            "tracking=none", f"checkpoint.dir={tmp_path}/ck", "checkpoint.every_steps=1", *extra]


EVAL_ONLY_ERRORS = {
    # a bad row in the first eval batch, data.on_bad_rows=fail (the default): the reader's DataError
    "bad-eval-row": ({"eval_label": [7] + [i % 2 for i in range(1, 16)]}, (), DataError,
                     r"bad row in .*eval\.parquet, row group 0, row 0 of the file, column 'label': the label is 7"),
    # gauc groups by a feature that an eval row holds two ids of (every training row holds one): only the eval reads it
    "grouping-id": ({"eval_tag": [[1, 2]] + [[i % 16] for i in range(1, 16)]}, ("metrics.eval=[auc,gauc]", "metrics.grouping_key=tag"),
                    ConfigError, r"metrics.grouping_key='tag' must hold exactly one id per row"),
}


@pytest.mark.parametrize("case", sorted(EVAL_ONLY_ERRORS))
def test_an_eval_only_error_stops_the_run_before_the_first_step(make_cfg: Callable[..., DictConfig], tmp_path: Path, case: str) -> None:
    """Without the sanity eval (``0``) the error came at the final eval, after four steps and their checkpoints; with
    the default it is the same error, with the same message, before any step or checkpoint, and so in a resumed launch."""
    files, extra, error, message = EVAL_ONLY_ERRORS[case]
    overrides = _files(tmp_path, *extra, **files)
    with pytest.raises(error, match=message) as late:
        run(make_cfg(*overrides, "train.sanity_eval_batches=0", tiny=False))
    assert [p.name for p in list_checkpoints(tmp_path / "ck")][-1] == "step_00000004"  # the training was spent
    with pytest.raises(error) as early:
        run(make_cfg(*overrides, f"checkpoint.dir={tmp_path}/ck_sanity", tiny=False))
    assert str(early.value) == str(late.value)
    assert list_checkpoints(tmp_path / "ck_sanity") == []  # no step trained, nothing written
    with pytest.raises(error) as resumed:  # a resumed launch checks again before its first step (its eval data may be new)
        run(make_cfg(*overrides, "train.num_steps=6", tiny=False))
    assert str(resumed.value) == str(late.value)
    assert [p.name for p in list_checkpoints(tmp_path / "ck")][-1] == "step_00000004"


def test_the_sanity_eval_leaves_the_data_counters_modes_and_generators_as_they_were(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    """Its rows reach no logged counter (a bad row skipped in the first eval batch is not ``data/bad_rows_skipped`` at
    the first log step), every module keeps its train/eval mode, and no generator moves."""
    bad_first = [7] + [i % 2 for i in range(1, 16)]
    spec = validate(make_cfg(*_files(tmp_path, "data.on_bad_rows=skip", "checkpoint=none", eval_label=bad_first), tiny=False))
    c = build(spec)
    try:
        model, data = c.loop.evaluator.model, c.loop.data
        frozen = next(m for m in model.modules() if not list(m.children()))
        frozen.eval()  # a module a fine-tune keeps in eval mode: left so, not put in train mode
        modes = [m.training for m in model.modules()]
        counters, generators = data.metrics(), (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
        assert c.loop.evaluator.sanity_check(2) == 2
        assert data.metrics() == counters and counters["data/bad_rows_skipped"] == 0
        assert [m.training for m in model.modules()] == modes
        assert torch.equal(torch.get_rng_state(), generators[0]) and random.getstate() == generators[1]
        assert np.array_equal(np.random.get_state()[1], generators[2])
    finally:
        c.close()


def test_the_sanity_eval_leaves_no_managed_table_eval_count(make_cfg: Callable[..., DictConfig]) -> None:
    """Its lookups do not reach the first logged ``mc/<table>/eval_fallback_rate`` (an eval's counts since the last log)."""
    spec = validate(make_cfg("data.num_embeddings=100", "data.managed_collision={features: [cat_0], input_hash_size: 1000000}",
                             "tracking=none", "checkpoint=none"))
    c = build(spec)
    try:
        model = c.loop.evaluator.model
        collision_counters(model)  # counts since the last call: none now
        c.loop.evaluator.sanity_check(2)
        counts = collision_counters(model)
        assert "mc/t_cat_0/eval_lookups" in counts and counts["mc/t_cat_0/eval_lookups"] == 0, counts
        assert counts["mc/t_cat_0/eval_fallback_lookups"] == 0
    finally:
        c.close()


def _flat(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict by its path; a sharded tensor by its local shards."""
    if isinstance(value, dict):
        return {k: t for key, v in value.items() for k, t in _flat(v, f"{prefix}/{key}").items()}
    if isinstance(value, list | tuple):
        return {k: t for i, v in enumerate(value) for k, t in _flat(v, f"{prefix}/{i}").items()}
    if hasattr(value, "local_shards"):
        return {f"{prefix}/{i}": s.tensor for i, s in enumerate(value.local_shards())}
    return {prefix: value.detach().clone()} if isinstance(value, torch.Tensor) else {}


def _trained(make_cfg: Callable[..., DictConfig], monkeypatch: pytest.MonkeyPatch, pipeline: str, sanity: int) -> tuple[list[float], dict[str, float], dict[str, torch.Tensor]]:
    """A BST (dropout 0.1, drawn from torch's generator) with an EMA evaluated with, trained 3 steps: its losses, final
    eval metrics, and weights, EMA and optimizer state."""
    spec = validate(make_cfg("model=bst", "model.feedforward_dim=16", "data=synthetic_sequences", "data.batch_size=64",
                             "data.num_train_rows=2048", "data.num_eval_rows=512", "train.num_steps=3", "train.log_every_steps=1",
                             "train.eval_every_steps=null", "train.ema.decay=0.9", "train.ema.eval_with_ema=true", "distributed.device=cpu",
                             "tracking=none", "checkpoint=none", f"distributed.pipeline={pipeline}", f"train.sanity_eval_batches={sanity}",
                             tiny=False))
    c = build(spec)
    try:
        step, losses = c.loop.stepper.step, []

        def recorded(batches: Any) -> torch.Tensor | None:
            loss = step(batches)
            if loss is not None:
                losses.append(float(loss))
            return loss

        monkeypatch.setattr(c.loop.stepper, "step", recorded)
        metrics = train(c.loop)
        assert c.loop.stepper.policy.ema is not None
        state = {"model": c.loop.evaluator.model.state_dict(), "ema": c.loop.stepper.policy.ema.state_dict(),
                 "optimizer": c.loop.stepper.optimizer.state_dict()}
        return losses, metrics, _flat(state)
    finally:
        c.close()


@pytest.mark.parametrize("pipeline", ["base", "sparse_dist"])
def test_training_is_bit_identical_with_and_without_the_sanity_eval(
    make_cfg: Callable[..., DictConfig], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, pipeline: str
) -> None:
    """``sparse_dist``: TorchRec's pipeline, detached for the eval before it ever ran a batch, trains on unchanged."""
    with caplog.at_level(logging.INFO, logger="recsys_runner.train.loop"):
        plain = _trained(make_cfg, monkeypatch, pipeline, 0)
        assert "sanity eval skipped: train.sanity_eval_batches=0" in caplog.text
        checked = _trained(make_cfg, monkeypatch, pipeline, 2)
        assert "sanity eval: 2 eval batches" in caplog.text
    assert checked[0] == plain[0] and len(plain[0]) == 3
    assert checked[1] == plain[1]
    assert checked[2].keys() == plain[2].keys() and checked[2]
    assert [k for k, t in plain[2].items() if not torch.equal(t, checked[2][k])] == []


def _signal_at_the_first_eval_batch(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """SIGTERM to this process as the first eval batch of the run (the sanity eval's) is read, once, in the main thread as
    a signal from outside would be handled; the returned list gets one entry per eval batch read (the first: the one the
    signal came in)."""
    real, read = evaluation.checked_batches, []

    def checked(batches: Iterable[Batch], *args: Any) -> Iterator[Batch]:
        for batch in real(batches, *args):
            if not read:
                os.kill(os.getpid(), signal.SIGTERM)
            read.append(1)
            yield batch

    monkeypatch.setattr(evaluation, "checked_batches", checked)
    return read


@pytest.mark.parametrize(("resumed", "ranks"), [(False, 1), (True, 2)], ids=["new-run", "resumed-run-as-with-ranks"])
def test_a_signal_during_the_sanity_eval_stops_the_run_before_the_first_step(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch, resumed: bool, ranks: int
) -> None:
    """It was taken only after the first step, whose checkpoint was then written. Now no step trains, nothing is written,
    the MLflow run is KILLED, the exit is 143 and the command printed goes on: the resume from the checkpoint the launch
    resumed from, or the run again. With one rank the sanity eval is abandoned after the batch the signal came in; as
    with several (no ``stop`` hook: every rank must finish its collectives) it ends, then the signal is agreed on."""
    experiment = f"sanity_signal_{resumed}"
    if ranks > 1:
        monkeypatch.setattr(loop, "_stop_hook", lambda *_: None)
    args = [a for a in _files(tmp_path) if a != "tracking=none"]
    launch = [sys.executable, "-m", "recsys_runner", *args, f"tracking.uri={mlflow_uri}", f"tracking.experiment={experiment}",
              f"hydra.run.dir={tmp_path}/run"]
    if resumed:  # a first launch of 2 steps; the second, of 4, resumes from its step 2
        assert run_in_process([*launch, "train.num_steps=2"], tmp_path).returncode == 0
        launch = [*launch, "train.num_steps=4"]
    before = [p.name for p in list_checkpoints(tmp_path / "ck")]
    read = _signal_at_the_first_eval_batch(monkeypatch)
    done = run_in_process(launch, tmp_path)
    assert done.returncode == 143, done.stderr[-3000:]
    assert len(read) == (1 if ranks == 1 else 2), done.stderr[-3000:]  # abandoned after the batch the signal came in, or whole
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == before  # no step trained, nothing written
    (mlrun,) = runs(mlflow_uri, experiment)
    assert mlrun.info.status == "KILLED"
    assert steps_logged(mlflow_uri, mlrun.info.run_id) == ([1, 2] if resumed else [])
    if resumed:
        assert f"Interrupted: stopped by SIGTERM during the sanity eval after step 2; checkpoint {tmp_path}/ck/step_00000002" \
            in done.stderr, done.stderr[-3000:]
        command = hint_of(done.stderr)
        assert command is not None and f"checkpoint.dir={tmp_path}/ck" in command, done.stderr[-3000:]
    else:
        said = (f"Interrupted: stopped by SIGTERM during the sanity eval; nothing was kept (MLflow run {mlrun.info.run_id} is "
                f"KILLED); redo it with: python -m recsys_runner ")
        assert said in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_a_signal_to_one_rank_during_the_sanity_eval_stops_both_before_the_first_step(tmp_path: Path) -> None:
    """2 gloo ranks, rank 1 signalled at its first eval batch (:mod:`tests.sanity_signal`): the sanity eval ends on both
    (its gathers are collectives), the ranks agree on the signal and both stop before the first step, nothing written.
    Before, the signal waited for the first agreement of the steps (``train.stop_check_every_steps``), here the final
    eval, after every step and checkpoint."""
    args = [a for a in _files(tmp_path) if not a.startswith("checkpoint.dir=")]
    done = torchrun(*args, f"checkpoint.dir={tmp_path}/ck", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path, module="tests.sanity_signal")
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "exitcode  : 143" in out, out[-3000:]
    assert "Interrupted: stopped by SIGTERM during the sanity eval; nothing was kept; redo it with: " in out, out[-3000:]
    assert "sanity eval: 1 eval batches" in out and "step 1/4" not in out, out[-3000:]
    assert list_checkpoints(tmp_path / "ck") == []


class _Clock:
    """``time`` for the meter: it stands still unless moved (:attr:`now`), so a window lasts exactly what the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_the_sanity_eval_is_not_counted_in_samples_per_s(make_cfg: Callable[..., DictConfig], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A sanity eval of 1000 s (on the meter's clock) and steps of 1 s each: the first window's samples/s is its rows per
    second of steps (8 rows / 1 s), not per 1001 s."""
    clock, logged = _Clock(), {}
    monkeypatch.setattr(throughput, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    sanity_check = evaluation.Evaluator.sanity_check

    def slow(self: evaluation.Evaluator, *args: Any, **kwargs: Any) -> int:
        clock.now += 1000.0
        return sanity_check(self, *args, **kwargs)

    monkeypatch.setattr(evaluation.Evaluator, "sanity_check", slow)
    c = build(validate(make_cfg(*_files(tmp_path, "checkpoint=none", "train.num_steps=2"), tiny=False)))
    try:
        step = c.loop.stepper.step

        def timed(batches: Any) -> torch.Tensor | None:
            clock.now += 1.0
            return step(batches)

        monkeypatch.setattr(c.loop.stepper, "step", timed)
        monkeypatch.setattr(c.loop.tracker, "log_metrics", lambda metrics, at: logged.setdefault(at, {}).update(metrics))
        train(c.loop)
    finally:
        c.close()
    assert clock.now == 1002.0  # the sanity eval ran, and two steps
    assert logged[1]["train/samples_per_s"] == pytest.approx(8.0) and logged[2]["train/samples_per_s"] == pytest.approx(8.0)


def test_a_once_only_data_warning_is_said_once_over_the_sanity_eval_training_and_eval(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    """A list cut to ``max_values`` in the first eval row warns once per column; the sanity eval puts the data's counters
    back (``data/truncated_lists`` counts no row of it), which must not make the final eval say it a second time. The
    counter still counts the eval's cut row once (the final eval's), as without the sanity eval."""
    eval_tag = [[1, 2]] + [[i % 16] for i in range(1, 16)]  # every training row holds one id
    capped = "data.sparse=[{name:item,num_embeddings:16},{name:tag,num_embeddings:16,max_values:1}]"
    spec = validate(make_cfg(*_files(tmp_path, capped, "checkpoint=none", eval_tag=eval_tag), tiny=False))
    c = build(spec)
    try:
        with LogWarnings("recsys_runner.data") as warnings:
            train(c.loop)
        counted = c.loop.data.metrics()["data/truncated_lists"]
    finally:
        c.close()
    said = [m for m in warnings.messages if "were cut to their first 1 values" in m]
    assert len(said) == 1, warnings.messages
    assert said[0].startswith(f"data.eval_path={tmp_path / 'eval.parquet'}: "), said  # the files the cut list is in
    assert counted == 1.0


def test_the_truncated_histories_warning_is_not_said_again_after_the_counters_are_put_back(tmp_path: Path) -> None:
    """The same for histories cut to ``max_len`` (read as the sanity eval and then the eval read them): said once, counted
    once."""
    write_parquet(tmp_path / "train.parquet", histories(0))
    write_parquet(tmp_path / "eval.parquet", histories(1, 20))
    data = parquet(tmp_path)
    long = sum(len(r["hist_item"] or []) > MAX_LEN for r in histories(1, 20))
    with LogWarnings("recsys_runner.data") as warnings:
        with data.counters_kept():
            list(data.eval_batches(0, 1))
        list(data.eval_batches(0, 1))
    assert long and data.metrics()["data/truncated_histories"] == long
    assert sum("were truncated" in m for m in warnings.messages) == 1, warnings.messages
