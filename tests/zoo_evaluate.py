"""``torchrun --nproc_per_node=2 -m tests.zoo_evaluate <jobs.json> <out.json>``: several checkpoints evaluated in one
launch (tests/test_zoo_checkpoints.py).

A torchrun launch costs about 40 s of imports and process starts on the test machine, so one launch evaluates every
model of the zoo in turn: this driver creates the process group once, and each ``recsys_runner.evaluate.run`` finds it
made (``Distributed.setup`` creates one only when none exists, and ``close`` destroys only the group it created). The
jobs file maps a name to the overrides of ``python -m recsys_runner.evaluate``; rank 0 writes each job's metrics, every
rank having computed them together (the metrics are reduced over both ranks).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from pathlib import Path

import torch.distributed as dist
from hydra import compose, initialize_config_dir

from recsys_runner import evaluate
from recsys_runner.config import register_configs
from recsys_runner.distributed.launch import elastic_store
from recsys_runner.paths import CONFIG_PATH


def main(jobs_path: str, out_path: str) -> None:
    jobs: dict[str, list[str]] = json.loads(Path(jobs_path).read_text())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group("gloo", store=elastic_store(rank, world_size, timeout), rank=rank, world_size=world_size, timeout=timeout)
    if rank == 0:  # each job's sharding plan (logged by Distributed.plan), for the test to read on stderr
        plans = logging.getLogger("recsys_runner.distributed")
        plans.setLevel(logging.INFO)
        plans.addHandler(logging.StreamHandler(sys.stderr))
        plans.propagate = False
    try:
        register_configs()
        results: dict[str, dict[str, float]] = {}
        for name, overrides in jobs.items():
            with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
                cfg = compose(config_name="evaluate", overrides=overrides)
            results[name] = evaluate.run(cfg)
            assert dist.is_initialized(), f"evaluating {name} destroyed the launch's process group"
        if rank == 0:
            Path(out_path).write_text(json.dumps({"world_size": dist.get_world_size(), "metrics": results}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    # Every job's metrics are written and the process group destroyed; skip the interpreter's teardown, where a native
    # thread of the closed gloo group was seen to abort a rank ("terminate called without an active exception", SIGABRT)
    # on a loaded machine (the full suite on 2 cores), failing a launch whose work was done. bench/sequences.py does the same.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
