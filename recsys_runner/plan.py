"""``python -m recsys_runner.plan [overrides]``: the sharding plan and per-rank memory, nothing else.

Composes the same config as a training run, builds the data module and the model with every tensor on ``meta``
(no memory per embedding row, no data read, no process group: a table of 1e9 rows plans in seconds), and asks TorchRec's planner for a plan — for this
machine's world size, or for ``distributed.plan_world_size`` ranks
(``distributed.plan_local_world_size`` per node). It prints the plan, each rank's estimated
device (HBM) and host (DDR) memory against its budget (``distributed.hbm_cap_gb``/``ddr_cap_gb``
minus ``distributed.storage_reserve_percent``) and whether it fits; exit status 0 if it fits, 1 if
not. E.g. will 8 GPUs with 80 GB hold 26 tables of 10M rows?::

    python -m recsys_runner.plan distributed.device=cuda distributed.plan_world_size=8 \\
        distributed.hbm_cap_gb=80 data.num_embeddings=10000000
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from recsys_runner.build import meta_model
from recsys_runner.config import register_configs, validate
from recsys_runner.distributed.config import resolve_device_type
from recsys_runner.distributed.plan_report import PlanReport
from recsys_runner.distributed.sharding import Distributed
from recsys_runner.errors import reported
from recsys_runner.noise import quiet_known_noise
from recsys_runner.optim.sparse import apply_sparse_optimizer
from recsys_runner.overrides import check_command_line
from recsys_runner.paths import CONFIG_PATH

quiet_known_noise()
register_configs()


def dry_run(cfg: DictConfig) -> PlanReport:
    """Validate ``cfg`` and plan its model for the configured world, allocating nothing."""
    run = validate(cfg)
    distributed: Distributed = run.distributed.build()
    data, model = meta_model(run)  # planning reads only the data's features and batch size, and places embedding tables
    apply_sparse_optimizer(model, run.optim.sparse)  # optimizer state counts toward table memory
    return distributed.dry_plan(model, batch_size=data.batch_size, device_type=resolve_device_type(run.distributed.device))


@hydra.main(config_path=CONFIG_PATH, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with reported():
        report = dry_run(cfg)
    print(report)
    if not report.fits:
        sys.exit(1)


if __name__ == "__main__":
    check_command_line("config")  # a typo: one line with the closest valid name (overrides.py)
    main()
