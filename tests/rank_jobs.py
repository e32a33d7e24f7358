"""Several ``python -m recsys_runner`` jobs in one torchrun launch: a rank module's ``__main__`` calls :func:`run_jobs`,
which forms the process group once and runs the runner's ``main`` for each job of ``$RANK_JOBS`` in turn, each in its own
working directory, with its own environment variables and overrides after the launch's. Every job finds the group
already formed, so it neither creates nor destroys it (:meth:`~recsys_runner.distributed.sharding.Distributed.close`):
the launch pays the ranks' start-up (torch, torchrec, the group) once instead of once per job. A job that exits 0 (a
stopped run) goes on to the next; any other exit ends the launch with its status. For a test that compares
jobs whose differences are in the config or in the rank module's own environment variables, not in the launch.

``$RANK_JOBS``: a JSON list of ``{"dir": <folder>, "env": {<name>: <value>}, "args": [<override>, ...], "own_output": bool}``;
without it, one job, the launch's own command line (:func:`jobs`). ``own_output``: the job's standard output and error
(file descriptors 1 and 2, native writes included) go to ``<dir>/rank<r>.stdout`` and ``.stderr`` instead of the
launch's, for a test that checks what one job of several said."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import recsys_runner.__main__ as entry
from recsys_runner.distributed.config import DistributedConfig
from recsys_runner.distributed.sharding import Distributed
from recsys_runner.lifecycle import end_rank_process
from recsys_runner.overrides import check_command_line


def jobs(*specs: tuple[Path, dict[str, str], list[str]], own_output: bool = False) -> dict[str, str]:
    """The environment entry that makes a launch run ``specs``: (working directory, environment variables, overrides)."""
    return {"RANK_JOBS": json.dumps([{"dir": str(d), "env": env, "args": list(args), "own_output": own_output}
                                     for d, env, args in specs])}


@contextlib.contextmanager
def _output_to(folder: Path | None) -> Iterator[None]:
    """File descriptors 1 and 2 to ``folder/rank<r>.stdout`` and ``.stderr`` meanwhile (``None``: left as they are)."""
    if folder is None:
        yield
        return
    rank = os.environ.get("RANK", "0")
    kept = [os.dup(1), os.dup(2)]
    try:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            (sys.stdout if fd == 1 else sys.stderr).flush()
            with open(folder / f"rank{rank}.{name}", "a") as f:
                os.dup2(f.fileno(), fd)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), kept, strict=True):
            os.dup2(old, fd)
            os.close(old)


def run_jobs() -> None:
    specs: list[dict[str, Any]] = json.loads(os.environ.get("RANK_JOBS", "null")) or [{"dir": ".", "env": {}, "args": []}]
    # the group every job finds, and leaves, formed; with the launch's distributed.timeout_s (a job's own would not reach it)
    timeouts = [int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("distributed.timeout_s=")]
    Distributed(DistributedConfig(device="cpu", **({"timeout_s": timeouts[-1]} if timeouts else {}))).setup()
    argv, home = list(sys.argv), Path.cwd()
    for spec in specs:
        os.chdir(home / spec["dir"])
        os.environ.update(spec["env"])
        sys.argv = [*argv, *spec["args"]]
        with _output_to(Path.cwd() if spec.get("own_output") else None):
            check_command_line("config")
            try:
                entry.main()
            except SystemExit as e:  # a job that ends well by exiting (train.stop_after_steps: exit 0) lets the next run
                if e.code not in (0, None):
                    raise
    end_rank_process()


if __name__ == "__main__":  # ``torchrun -m tests.rank_jobs``: the runner's own jobs
    run_jobs()
