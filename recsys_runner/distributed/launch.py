"""Launcher glue: a submitit job's environment as torch.distributed's, and a submit-and-exit SLURM launcher.

Under ``hydra/launcher=submitit_slurm`` (or ``submitit_local``) with ``tasks_per_node`` × ``nodes``
> 1, every task runs the Hydra job. :func:`map_submitit_env` (called first thing by
``Distributed.setup``) has submitit's own ``TorchDistributedEnvironment`` export what
``init_process_group(init_method="env://")`` and the runner read — ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` — from its ``JobEnvironment``
(SLURM's ``SLURM_PROCID``, node list, …). A launcher that already set them (torchrun inside an
allocation) wins; a one-task job is left alone, so it gets the private in-process store and cannot
clash with other jobs on the node.

``hydra/launcher=submitit_slurm_detached`` submits the sweep's array and returns without waiting
(its class lives in ``hydra_plugins/recsys_runner_detached``: Hydra loads launchers only from the
``hydra_plugins`` namespace); the jobs log to MLflow as children of the sweep's parent run, and
``python -m recsys_runner.compare collect --parent <id> --wait`` gathers them later.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

_TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def map_submitit_env() -> dict[str, str]:
    """Inside a multi-task submitit job, export torch.distributed's variables; return what was set.

    Does nothing outside submitit, for a one-task job, or when ``RANK``/``WORLD_SIZE`` are already set.
    ``MASTER_ADDR`` is the job's first node; ``MASTER_PORT`` is derived from the job id (the same on
    every task, different between jobs) unless the environment sets it.
    """
    if "SUBMITIT_EXECUTOR" not in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return {}
    import submitit

    job = submitit.JobEnvironment()
    if job.num_tasks <= 1:
        return {}
    # overwrite=True: a MASTER_PORT chosen in hydra.launcher.setup (docs/launch.md) is already in the
    # environment; submitit takes the port from it but refuses to export over any set variable otherwise.
    # set_cuda_visible_devices=False: submitit would narrow CUDA_VISIBLE_DEVICES to the task's own GPU,
    # while Distributed.setup addresses cuda:<LOCAL_RANK> among all of the node's GPUs.
    dist_env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    log.info("submitit job %s task %d/%d → torch.distributed via %s:%s", job.job_id, dist_env.rank, dist_env.world_size,
             dist_env.master_addr, dist_env.master_port)
    return {k: os.environ[k] for k in _TORCH_VARS}
