"""What a newcomer sees: one live bar on a terminal, plain lines in a pipe, and no known library noise."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
import warnings
from pathlib import Path

import pytest

from recsys_runner.config import validate
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.noise import LOG_RECORDS, WARNINGS, quiet_known_noise
from recsys_runner.progress import Progress
from tests.conftest import TINY, run_cli

# The known noise of a default run before recsys_runner.noise; none of it may reach the screen.
NOISE = ["FutureWarning", "UserWarning", "broadcast_buffers", "is_fx_tracing", "Detected call of `lr_scheduler.step()`",
         "Parameter Info", "#####"]


def run_in_terminal(argv: list[str], cwd: Path, timeout: float = 300) -> tuple[int, str]:
    """Run ``argv`` with stdin, stdout and stderr on a pseudo-terminal 120 columns wide; its exit status and screen bytes."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.Popen(argv, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its side
                break
            if not data:
                break
            chunks.append(data)
        proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def test_training_on_a_terminal_draws_one_bar_and_keeps_train_lines_in_the_log_file(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, screen = run_in_terminal([sys.executable, "-m", "recsys_runner", *TINY, "train.eval_every_steps=20", "tracking=none",
                                    f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert code == 0, screen[-3000:]
    assert "\r" in screen and re.search(r"\d+/30 \[", screen), screen[-3000:]  # tqdm redraws in place: "N/30 [elapsed<eta, rate, ...]"
    assert "30/30 [" in screen and re.search(r"\d(step/s|s/step)", screen) and "loss=" in screen and "samples/s=" in screen
    assert "auc=" in screen.split("step 20/30 eval/auc=")[-1], "the eval results join the bar"
    assert "step 20/30 eval/auc=" in screen, "eval results are printed above the bar as they arrive"
    assert "step 10/30 train/loss=" not in screen, "the bar already shows the train line"
    logged = (run_dir / "__main__.log").read_text()
    assert "step 10/30 train/loss=" in logged and "step 20/30 eval/auc=" in logged, "the log file keeps every line"
    assert not [n for n in NOISE if n in screen], screen


def test_training_in_a_pipe_logs_plain_lines_and_no_known_noise(tmp_path: Path) -> None:
    out = run_cli(*TINY, "train.eval_every_steps=20", "tracking=none", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    screen = out.stdout + out.stderr
    assert "\r" not in screen and not re.search(r"\d(step/s|s/step)|\d+/30 \[", screen), "no bar when nobody watches"
    for step in (10, 20, 30):
        assert f"step {step}/30 train/loss=" in out.stdout
    assert "step 20/30 eval/auc=" in out.stdout
    summary = [line for line in screen.splitlines() if "sharding plan:" in line]
    assert len(summary) == 1 and "52 table_wise (fused kernel); est. " in summary[0] and "MB/rank" in summary[0], summary
    assert not [n for n in NOISE if n in screen], screen


def test_planner_stats_table_only_at_debug(make_cfg, caplog: pytest.LogCaptureFixture) -> None:
    import torch

    from recsys_runner.models.train_wrapper import TrainWrapper

    run = validate(make_cfg("tracking=none"))
    data = run.data.for_model(run.model.data_needs()).build()
    model = TrainWrapper(run.model.build(features=data.features, dense_device=torch.device("meta")))
    distributed = run.distributed.build()
    distributed.setup()
    try:
        with caplog.at_level(logging.INFO):  # every logger at INFO, TorchRec's planner stats logger included
            distributed.plan(model, batch_size=data.batch_size)
        at_info = [r for r in caplog.records if r.name in ("torchrec.distributed.planner.stats", "recsys_runner.distributed.sharding")]
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="recsys_runner.distributed"):
            distributed.plan(model, batch_size=data.batch_size)
    finally:
        distributed.close()
    assert [r.getMessage()[:26] for r in at_info] == ["sharding plan: 52 tables o"], "at INFO only our summary line"
    stats = [r for r in caplog.records if r.getMessage().startswith("TorchRec planner stats")]
    assert len(stats) == 1 and stats[0].levelno == logging.DEBUG and stats[0].name == "recsys_runner.distributed.sharding"
    assert "Parameter Info" in stats[0].getMessage() and "t_cat_25" in stats[0].getMessage()
    assert not [r for r in caplog.records if r.name.startswith("torchrec")], "the table went through our logger only"


def test_progress_bar_forced_draws_counts_postfix_and_writes_above() -> None:
    screen = io.StringIO()
    with Progress(3, unit="step", mode="bar", file=screen) as progress:
        assert progress.active
        progress.update(1)
        progress.update(2, loss=0.5)
    assert "3/3" in screen.getvalue() and "loss=0.5" in screen.getvalue() and "step" in screen.getvalue()
    assert not progress.active, "closed by the context manager"


def test_progress_disabled_off_rank0_draws_and_writes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    screen = io.StringIO()
    with Progress(3, enabled=False, mode="bar", file=screen) as progress:
        progress.update(3, loss=0.5)
        progress.write("a line")
        assert not progress.active and progress.shown_on_bar() == {}
    assert screen.getvalue() == "" and capsys.readouterr() == ("", "")


def test_progress_auto_without_a_terminal_prints_plain_lines(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(3) as progress:  # pytest captures stdout/stderr: not terminals
        assert not progress.active
        progress.update(3, loss=0.5)
        progress.write("a -> b")
    assert capsys.readouterr() == ("a -> b\n", "")
    with pytest.raises(ValueError, match="one of"):
        Progress(3, mode="fancy")


def test_progress_moves_console_logging_above_the_bar_and_back(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    console, file = logging.StreamHandler(sys.stdout), logging.FileHandler(tmp_path / "run.log")
    root, log = logging.getLogger(), logging.getLogger("recsys_runner.test_progress")
    root.addHandler(console)
    root.addHandler(file)
    log.setLevel(logging.INFO)
    try:
        with Progress(10, mode="bar", file=io.StringIO()) as progress:
            assert console not in root.handlers and file in root.handlers
            log.info("train line", extra=progress.shown_on_bar())
            log.info("checkpoint line")
        assert console in root.handlers
        log.info("after the bar", extra=progress.shown_on_bar())
    finally:
        root.removeHandler(console)
        root.removeHandler(file)
        file.close()
    shown = capsys.readouterr().out
    assert "checkpoint line" in shown and "after the bar" in shown and "train line" not in shown
    assert (tmp_path / "run.log").read_text().splitlines() == ["train line", "checkpoint line", "after the bar"]


def test_noise_filters_are_each_specific() -> None:
    for w in WARNINGS:
        assert w.message and w.module not in ("", ".*") and w.category is not Warning and len(w.why) > 40, w
    for r in LOG_RECORDS:
        assert r.logger and r.message and len(r.why) > 40, r
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_known_noise()
        for w in WARNINGS:  # each silenced where it comes from...
            warnings.warn_explicit(_example(w.message), w.category, "x.py", 1, module=_module_of(w.module))
        assert seen == []
        broadcast = next(w for w in WARNINGS if "broadcast_buffers" in w.message)
        # ...but the same text from another module, and another FutureWarning from the same module, still show.
        warnings.warn_explicit(_example(broadcast.message), FutureWarning, "x.py", 1, module="my_project.model")
        warnings.warn_explicit("`foo` is deprecated", FutureWarning, "x.py", 1, module="torchrec.distributed.model_parallel")
        warnings.warn_explicit(_example(broadcast.message), UserWarning, "x.py", 1, module="torchrec.distributed.model_parallel")
    assert len(seen) == 3


def test_noise_log_filters_drop_only_the_known_records(caplog: pytest.LogCaptureFixture) -> None:
    quiet_known_noise()
    for known in LOG_RECORDS:
        logger, example = logging.getLogger(known.logger), _example(known.message.strip("()").split("|")[0])
        with caplog.at_level(logging.INFO, logger=known.logger):
            logger.warning(example)
            logger.warning("something else went wrong")
            logging.getLogger(known.logger + ".child").warning(example)  # the filter is the named logger's only
        assert [r.getMessage() for r in caplog.records] == ["something else went wrong", example]
        caplog.clear()


def test_saving_an_mlflow_model_says_nothing_of_its_input_example_check(tmp_path: Path) -> None:
    """An export printed MLflow's "Validating input example against model signature" twice, in MLflow's own format
    between the runner's lines; a real save_model with an input example, as export's, now says nothing at INFO. (MLflow's
    loggers do not propagate to the root, so a handler of the logger itself sees what reaches its console handler.)"""
    import mlflow.pyfunc
    import pandas as pd
    from mlflow.models import infer_signature

    class Seen(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    logger, handler = logging.getLogger("mlflow.pyfunc"), Seen()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as seen:  # every warning shown (as pytest shows them), then noise.py's
            warnings.simplefilter("always")
            quiet_known_noise()
            example = pd.DataFrame({"x": [1.0, 2.0]})
            mlflow.pyfunc.save_model(path=str(tmp_path / "model"), loader_module="served_model", input_example=example,
                                     signature=infer_signature(example), pip_requirements=["pandas"])
    finally:
        logger.removeHandler(handler)
    assert (tmp_path / "model" / "MLmodel").exists()
    assert handler.messages == [], handler.messages
    # MLflow's df.columns == range(n) on the example (pandas' Pandas4Warning "Operation with range is deprecated")
    assert [f"{w.category.__name__}: {w.message}" for w in seen if "range" in str(w.message)] == []


def test_a_hash_zch_table_is_built_without_torchrecs_noise(caplog: pytest.LogCaptureFixture) -> None:
    """HashZch (data.managed_collision's module on CUDA) printed TorchRec's copy-construct UserWarning and its "Skipping
    validation on ManagedCollisionModule" log line for every table at start-up (noise.py says why both are harmless)."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from recsys_runner.features import ManagedCollision
    from recsys_runner.models.collision import managed_collision_module

    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        quiet_known_noise()
        table = EmbeddingBagConfig(num_embeddings=64, embedding_dim=8, name="t_user", feature_names=["user"])
        managed_collision_module(table, ManagedCollision(input_hash_size=1000, module="hash_zch"), torch.device("cpu"))
    assert [str(w.message) for w in seen] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


FIXED = ["assuming the intent is to", "Operation with range is deprecated", "To copy construct from a tensor"]
"""Library warnings that our code now avoids or noise.py silences (``torch.distributed.checkpoint``'s single-process
notice, MLflow's pandas deprecation, HashZch's tensor copy): none may come back in a CLI flow."""


def test_a_file_trained_model_is_trained_and_exported_without_the_fixed_warnings(tmp_path: Path) -> None:
    """``python -m recsys_runner`` on a CSV then ``python -m recsys_runner.export`` (which saves and logs the MLflow model
    with its input example) with every warning shown (``PYTHONWARNINGS=always``: DeprecationWarnings too, as pytest and a
    notebook show them): none of :data:`FIXED` is printed."""
    rows = ["click,user,item,price"] + [f"{i % 2},u{i % 23},{i % 11},{(i % 7) * 1.5}" for i in range(600)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    data = ["data=csv", f"data.path={tmp_path}/t.csv", "data.label=click", "data.batch_size=64", "distributed.device=cpu",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    env = {"PYTHONWARNINGS": "always"}
    trained = run_cli(*data, "train.num_steps=4", f"checkpoint.dir={tmp_path}/ck", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path, env=env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    exported = subprocess.run([sys.executable, "-m", "recsys_runner.export", *data, f"load={tmp_path}/ck", f"export.dir={tmp_path}/export",
                               f"hydra.run.dir={tmp_path}/run_export"], cwd=tmp_path, env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (tmp_path / "export" / "mlflow_model" / "MLmodel").exists()
    screen = trained.stdout + trained.stderr + exported.stdout + exported.stderr
    assert [line for line in screen.splitlines() if any(f in line for f in FIXED)] == []


def test_data_convert_bar_and_plain_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "day_0.tsv"
    line = "\t".join(["1", *[str(i) for i in range(13)], *[f"{i:08x}" for i in range(26)]]) + "\n"
    src.write_text(line * 50)
    args = ["convert", "--num-embeddings", "100", "--row-group-rows", "10", str(src)]
    assert data_main([*args, str(tmp_path / "a"), "--progress", "bar"]) == 0
    out, err = capsys.readouterr()
    assert "\r" in err and "convert: 100%" in err and "rows=50" in err, err
    assert f"{src} -> " in out and "converted 50 rows" in out
    assert data_main([*args, str(tmp_path / "b")]) == 0  # auto: captured output is no terminal
    out, err = capsys.readouterr()
    assert err == "" and f"{src} -> " in out and "converted 50 rows" in out


def _example(pattern: str) -> str:
    """A message that the filter's pattern matches (its regex escapes undone, a group of alternatives at its first)."""
    text = re.sub(r"\((?:\?:)?([^()|]*)\|[^()]*\)", r"\1", pattern.removeprefix(r"\s*"))
    text = re.sub(r"\\(.)", r"\1", text)
    assert re.match(pattern, text), pattern
    return text


def _module_of(pattern: str) -> str:
    """A module name the filter's module pattern matches."""
    name = pattern.removesuffix("$").replace("\\.", ".").strip("()").split("|")[0]
    assert re.match(pattern, name), pattern
    return name
