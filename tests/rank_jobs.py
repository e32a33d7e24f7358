"""Several ``python -m recsys_runner`` jobs in one torchrun launch: a rank module's ``__main__`` calls :func:`run_jobs`,
which forms the process group once and runs the runner's ``main`` for each job of ``$RANK_JOBS`` in turn, each in its own
working directory, with its own environment variables and overrides after the launch's. Every job finds the group
already formed, so it neither creates nor destroys it (:meth:`~recsys_runner.distributed.sharding.Distributed.close`):
the launch pays the ranks' start-up (torch, torchrec, the group) once instead of once per job. For a test that compares
jobs whose differences are in the config or in the rank module's own environment variables, not in the launch.

``$RANK_JOBS``: a JSON list of ``{"dir": <folder>, "env": {<name>: <value>}, "args": [<override>, ...]}``; without it,
one job, the launch's own command line (:func:`jobs`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import recsys_runner.__main__ as entry
from recsys_runner.distributed.config import DistributedConfig
from recsys_runner.distributed.sharding import Distributed
from recsys_runner.lifecycle import end_rank_process
from recsys_runner.overrides import check_command_line


def jobs(*specs: tuple[Path, dict[str, str], list[str]]) -> dict[str, str]:
    """The environment entry that makes a launch run ``specs``: (working directory, environment variables, overrides)."""
    return {"RANK_JOBS": json.dumps([{"dir": str(d), "env": env, "args": list(args)} for d, env, args in specs])}


def run_jobs() -> None:
    specs: list[dict[str, Any]] = json.loads(os.environ.get("RANK_JOBS", "null")) or [{"dir": ".", "env": {}, "args": []}]
    Distributed(DistributedConfig(device="cpu")).setup()  # the group every job finds, and leaves, formed
    argv, home = list(sys.argv), Path.cwd()
    for spec in specs:
        os.chdir(home / spec["dir"])
        os.environ.update(spec["env"])
        sys.argv = [*argv, *spec["args"]]
        check_command_line("config")
        entry.main()
    end_rank_process()


if __name__ == "__main__":  # ``torchrun -m tests.rank_jobs``: the runner's own jobs
    run_jobs()
