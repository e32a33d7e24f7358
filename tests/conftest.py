"""Shared fixtures: compose the real config exactly as the CLI does, with tiny, fast settings.

Following lightning-hydra-template: configs come from ``conf/`` through Hydra's compose API,
everything runs on CPU, for a few real steps, and every output (MLflow store, Hydra dirs) goes
under pytest's temporary directories.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import re
import runpy
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from recsys_runner.config import register_configs
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.tasks import Task

REPO = Path(__file__).resolve().parent.parent

# One intra-op thread in each test process and in each process a test starts, unless the developer set OMP_NUM_THREADS:
# distributed.num_threads=auto samples the idle CPUs at start, so on the shared 2-core machine (two pytest workers, each
# training) a test's thread count followed the load, and with it the rounding of every sum its training made: a seed that
# trained MIND past DSSM on one thread did not on two (tests/test_mind.py failed in one full suite of several). On one
# thread a test trains the same numbers in every run, and the two workers no longer spin threads against each other.
# auto itself is tested with the variable removed (tests/test_run_length.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Small enough for ~1 s of training, large enough that a model that learns beats AUC 0.6.
TINY = [
    "data.batch_size=256",
    "data.num_embeddings=1000",
    "data.num_train_rows=32768",
    "data.num_eval_rows=8192",
    "train.num_steps=30",
    "train.log_every_steps=10",
    "train.eval_every_steps=null",
    "distributed.device=cpu",
]


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store for the session (creating one costs seconds of schema migration)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.fixture(scope="session")
def created_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty sqlite MLflow store, created (its schema migrated: seconds, most of them alembic's) once per session, for
    :func:`store_uri` to copy."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("created_store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store_uri(created_store: Path, tmp_path: Path) -> str:
    """``sqlite:///<tmp_path>/mlflow.db``: a store of this test's own, as a command run in ``tmp_path`` creates it on first
    use, without the seconds of its schema migration (a copy of :func:`created_store`, its Default experiment's
    artifacts moved to ``<tmp_path>/mlruns/0``, where the command would have put them). For tests whose point is not a
    store being created (tests/test_tracking_faults.py's are)."""
    return copied_store(created_store, tmp_path)


def copied_store(created_store: Path, folder: Path, name: str = "mlflow.db") -> str:
    """:func:`store_uri`'s copy of :func:`created_store`, as ``<folder>/<name>``: for a fixture of a wider scope, or a test
    that needs a second store."""
    path = folder / name
    shutil.copyfile(created_store, path)
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0", (str(folder / "mlruns" / "0"),))
    return f"sqlite:///{path}"


@pytest.fixture
def make_cfg(mlflow_uri: str, request: pytest.FixtureRequest) -> Callable[..., DictConfig]:
    """``make_cfg("model=dlrm", ...)`` → the composed config, TINY settings and this test's experiment."""
    register_configs()

    def _make(*overrides: str, tiny: bool = True) -> DictConfig:
        base = [*TINY] if tiny else []
        if "tracking=none" not in overrides:
            base += [f"tracking.uri={mlflow_uri}", f"tracking.experiment={re.sub(r'[^A-Za-z0-9_]+', '_', request.node.name)}"]
        with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
            return compose(config_name="config", overrides=[*base, *overrides])

    return _make


SACCT = """#!/bin/sh
# sacct as submitit calls it (sacct -o JobID,State,NodeList --parsable2 -j ID): the states of this test's jobs
printf 'JobID|State|NodeList\\n'
cat "$(dirname "$0")/states"
"""


@pytest.fixture
def slurm_states(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``sacct`` first on ``PATH`` answering from ``<bin>/states`` (``<id>|<state>|<node>`` lines): SLURM's account of a
    detached sweep's jobs, as submitit reads it, without a cluster (tests/test_slurm.py runs the real one), for
    ``compare collect``'s tests (tests/test_compare.py, tests/test_sweeps_left_runs.py)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text(SACCT)
    (bin_dir / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir / "states"


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """``python -m recsys_runner *args`` in ``cwd``, capturing output."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None) if env is None or "HYDRA_FULL_ERROR" not in env else None
    return subprocess.run(
        [sys.executable, "-m", "recsys_runner", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


class _Watched(io.StringIO):
    """A captured stdout that calls ``on_text`` with every piece written to it (log lines arrive whole)."""

    def __init__(self, on_text: Callable[[str], None]) -> None:
        super().__init__()
        self.on_text = on_text

    def write(self, text: str) -> int:
        written = super().write(text)
        self.on_text(text)
        return written


def _logger_states() -> dict[str, tuple[int, bool, bool, list[logging.Handler]]]:
    """Every existing named logger's level, ``disabled``, ``propagate`` and handlers: what to put back."""
    return {name: (logger.level, logger.disabled, logger.propagate, logger.handlers[:])
            for name, logger in logging.Logger.manager.loggerDict.items() if isinstance(logger, logging.Logger)}


def _store_tree(repo: dict[str, Any]) -> dict[str, Any]:
    """A copy of the ConfigStore's tree of groups (its dicts copied, its stored nodes shared): what to put back."""
    return {k: _store_tree(v) if isinstance(v, dict) else v for k, v in repo.items()}


def _put_back(repo: dict[str, Any], saved: dict[str, Any]) -> None:
    """Every node ``saved`` held back in ``repo``, where the run stored another under its name; what the run stored
    under new names (Hydra's own configs, stored on first use) stays."""
    for key, value in saved.items():
        if isinstance(value, dict):
            _put_back(repo.setdefault(key, {}), value)
        else:
            repo[key] = value


def run_in_process(argv: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None,
                   on_stdout: Callable[[str], None] | None = None) -> subprocess.CompletedProcess[str]:
    """``argv`` = ``[python, "-m", module, *args]`` (e.g. a printed resume command) run in this process as ``python -m``
    runs it: the module as ``__main__`` (runpy), ``sys.argv`` the command's, in ``cwd``, with ``env`` added; its exit
    status, stdout and stderr, as :func:`subprocess.run` gives them. For a launch whose process is not the point (what
    it does with its arguments is): it costs its work, not ~10 s of imports. Not for what only a fresh process shows
    (signals from outside, import-time warnings, which Python prints once per process)."""
    assert list(argv[1:2]) == ["-m"], argv
    out, err = (io.StringIO() if on_stdout is None else _Watched(on_stdout)), io.StringIO()
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv[:]
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    saved_loggers = _logger_states()  # Hydra's job logging sets levels (and may disable loggers) for the process
    # runpy runs the entry module's code afresh: its schema classes are defined again and stored in Hydra's ConfigStore
    # over the imported module's (e.g. predict_schema's PredictConfig), so a later test's isinstance checks would fail
    store = ConfigStore.instance()
    saved_repo = _store_tree(store.repo)
    code = 0
    try:
        if env is None or "HYDRA_FULL_ERROR" not in env:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        os.environ.update(env or {})
        os.chdir(cwd)
        sys.argv = [argv[2], *argv[3:]]  # runpy puts the module's file first, as -m does
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            # the module was imported before (by a test, or an earlier run): runpy runs its code afresh all the same
            warnings.filterwarnings("ignore", r".* found in sys\.modules after import of package", RuntimeWarning)
            try:
                runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
            except SystemExit as e:
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    finally:
        _put_back(store.repo, saved_repo)
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        for key in set(os.environ) - set(saved_env):  # what the command (or env) set, as its process's exit would drop it
            del os.environ[key]
        for key, value in saved_env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        for handler in root.handlers[:]:  # Hydra's job logging (console, the run dir's log file): closed, the suite's back
            if handler not in saved_handlers:
                root.removeHandler(handler)
                handler.close()
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        for name, (level, disabled, propagate, handlers) in saved_loggers.items():
            logger = logging.getLogger(name)
            logger.setLevel(level)
            logger.disabled, logger.propagate = disabled, propagate
            logger.handlers[:] = handlers
        inference = sys.modules.get("recsys_runner.inference")
        if inference is not None:  # overrides carried for a command that never used them (--cfg job, a composition
            inference._carried = None  # error) die with its process; here the next command must not find them
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


def signal_in_process(argv: Sequence[str], cwd: Path, marker: str, signum: int, delay_s: float,
                      ready: Callable[[], bool] | None = None) -> tuple[int, str, float]:
    """:func:`run_in_process` that gets ``signum`` ``delay_s`` after ``marker`` appears in its stdout (and, given
    ``ready``, once that returns true): a real signal to this process, sent by another thread, handled by the command's
    own handler in the main thread as in a process of its own. Its exit status, stdout + stderr and when it was sent.
    Sent only while a handler of ``recsys_runner.train.signals`` holds the signal (else the test fails: the suite's
    process is not killed by a signal that came too late)."""
    sent: list[float] = []
    unsent: list[object] = []

    def send() -> None:
        deadline = time.monotonic() + 120
        while ready is not None and not ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(delay_s)
        handler = signal.getsignal(signum)
        if type(getattr(handler, "__self__", None)).__module__ != "recsys_runner.train.signals":
            unsent.append(handler)  # the command is over (or never took the signal): nothing of it to stop
            return
        sent.append(time.time())
        os.kill(os.getpid(), signum)

    started: list[threading.Thread] = []

    def watch(text: str) -> None:
        if marker in text and not started:
            started.append(threading.Thread(target=send, daemon=True))
            started[0].start()

    done = run_in_process(argv, cwd, on_stdout=watch)
    if started:
        started[0].join(timeout=180)
    assert started, f"{marker!r} never came: {(done.stdout + done.stderr)[-3000:]}"
    assert sent and not unsent, f"no command handler held the signal when it was due ({unsent}): {(done.stdout + done.stderr)[-3000:]}"
    return done.returncode, done.stdout + done.stderr, sent[0]


def hint_of(stderr: str) -> list[str] | None:
    """The resume command the CLI printed (after an interruption or a NaN stop), as argv for this interpreter."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Resume this run from"):
            argv = shlex.split(lines[i + 1])
            assert argv[:3] == ["python", "-m", "recsys_runner"], argv
            return [sys.executable, *argv[1:]]
    return None


def torchrun(*args: str, cwd: Path, module: str = "recsys_runner", timeout: int = 600,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --nproc_per_node=2 -m <module> *args`` on loopback in ``cwd``, capturing output:
    the 2-rank gloo run of the multi-rank tests (this checkout's package first on the path; ``env``: more variables)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", module, *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO)})


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""The kernel's ephemeral range: where it picks a port for any process's ``connect()`` or ``bind(port 0)``."""
LOWEST_TEST_PORT = 10_000


def worker_ports(worker: str | None = None, workers: str | None = None) -> range:
    """The ports :func:`free_port` hands out in this pytest worker (``PYTEST_XDIST_WORKER`` ``gw<i>`` of
    ``PYTEST_XDIST_WORKER_COUNT``): its own share of the ports below the kernel's ephemeral range.

    A port asked of the kernel (``bind`` to port 0) is free only until the test's process binds it, seconds later (a
    torchrun's Python start-up on a loaded machine): meanwhile any process may get the same port from the kernel, the
    other worker's gloo ranks, an HTTP client or a server bound to port 0, and the test fails on ``address already in use``
    (or, for a port meant to be unreachable, finds something listening). Below the ephemeral range the kernel hands out
    nothing; the two workers' shares do not overlap."""
    worker = worker if worker is not None else os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    workers = workers if workers is not None else os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")
    try:
        ephemeral = int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32_768  # Linux's default
    index, count = int(worker.removeprefix("gw") or 0), max(int(workers), 1)
    share = max(ephemeral - LOWEST_TEST_PORT, 0) // count
    return range(LOWEST_TEST_PORT + index * share, LOWEST_TEST_PORT + (index + 1) * share)


_next_port = iter(range(random.randrange(1 << 20), 1 << 62))
"""Where :func:`free_port` looks next in :func:`worker_ports` (a random start: this module may be imported twice, as
``conftest`` and as ``tests.conftest``, and the two must not hand out the same sequence)."""


def free_port() -> int:
    """A TCP port free on loopback now, that no other process will be handed by the kernel before the test binds it (for
    a process group, a test server or a SLURM daemon; see :func:`worker_ports`); one from the kernel where no range is left
    below its ephemeral one."""
    ports = worker_ports()
    for _ in range(min(len(ports), 1000)):
        port = ports[next(_next_port) % len(ports)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))  # no SO_REUSEADDR: a port still in TIME_WAIT is passed over too
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def skip_unless_ci(reason: str) -> NoReturn:
    """Skip with ``reason`` (its ``SKIPPED`` saying so), or fail with it under ``CI=true``: there a skip is not a pass,
    the feature would go untested (``make test`` installs what these tests need where it can)."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(reason.replace("SKIPPED", "CANNOT RUN under CI"), pytrace=False)
    pytest.skip(reason)


SLURM_SKIP_MARK = "SLURM TESTS SKIPPED"
"""Begins the skip reason of every SLURM test that cannot run here (tests/slurm_cluster.py's fixture)."""
SLURM_HOW_TO_RUN = ("as root on a machine with apt-get, `make test` installs slurmctld slurmd slurm-client munge itself "
                    "(.ci/install-slurm) and runs them; elsewhere install those packages and run pytest as root")


def slurm_skip_summary(skipped: Sequence[Any]) -> str | None:
    """The one summary line for the SLURM tests among the ``skipped`` reports: how many, why, how to run them; ``None``
    when none of them was skipped."""
    reasons = [str(r.longrepr[2]) for r in skipped if isinstance(r.longrepr, tuple) and SLURM_SKIP_MARK in str(r.longrepr[2])]
    if not reasons:
        return None
    why = reasons[0].split(": ", 2)[-1] if ": " in reasons[0] else reasons[0]
    return f"SLURM tests skipped ({len(reasons)}): {why}; to run them: {SLURM_HOW_TO_RUN}"


SERIAL_GROUPS = {"test_slurm": "slurm", "test_slurm_preempt": "slurm", "test_slurm_summary": "slurm",
                 "test_sweeps_dead_jobs": "slurm", "test_sweeps_left_runs": "slurm"}
"""Test modules that must share one xdist worker: the SLURM ones each start daemons of one single-node cluster."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (``make test``), keep each test module on one worker, so its
    module-scoped fixtures (a trained checkpoint, a started server) are built once, and the SLURM modules together.
    Runs before xdist reads the ``xdist_group`` marks; without xdist the marks are inert."""
    for item in items:
        module = item.path.stem
        item.add_marker(pytest.mark.xdist_group(SERIAL_GROUPS.get(module, module)))


LOADGROUP_BROKEN_FROM = (9, 2)
"""The pytest whose ``Node.nodeid`` stopped reading ``item._nodeid``, where pytest-xdist (3.8) writes a test's group."""


def pytest_configure(config: pytest.Config) -> None:
    """Refuse ``--dist loadgroup`` (``make test``) on a pytest where its groups silently do not take: each module's tests
    would spread over the workers (module fixtures built on both, the suite slower) and the SLURM modules would run side
    by side on one cluster. The fix is the pin in pyproject's dev extras, which ``make test`` installs."""
    version = tuple(int(p) for p in pytest.__version__.split(".")[:2] if p.isdigit())
    if config.getoption("dist", "no") == "loadgroup" and version >= LOADGROUP_BROKEN_FROM:
        raise pytest.UsageError(f"pytest {pytest.__version__} ignores pytest-xdist's --dist loadgroup groups (its Node.nodeid no "
                                f"longer reads the @<group> suffix xdist writes). Fix: pip install 'pytest<9.2', the dev extras' "
                                f"pin (`make test` installs it)")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Say in one line, at the end of the run, that the SLURM tests did not run and how to run them (a skip is
    otherwise one ``s`` among hundreds of dots)."""
    line = slurm_skip_summary(terminalreporter.stats.get("skipped", []))
    if line:
        terminalreporter.write_line(line, yellow=True, bold=True)


class FixedHeads(torch.nn.Module):
    """A stand-in multi-task model for loss tests: its ``tasks`` and a fixed output ``{task: tensor}``, whatever the input."""

    def __init__(self, tasks: tuple[Task, ...], out: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.tasks, self.out = tasks, out

    def forward(self, dense: torch.Tensor, sparse: object) -> dict[str, torch.Tensor]:
        return self.out


class LogWarnings(logging.Handler):
    """Collects the warnings logged under ``logger`` (``recsys_runner`` and its children by default) while in its
    ``with`` block; works with ``-p no:logging``, unlike caplog."""

    def __init__(self, logger: str = "recsys_runner") -> None:
        super().__init__(logging.WARNING)
        self.logger = logger
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> LogWarnings:
        logging.getLogger(self.logger).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(self.logger).removeHandler(self)
