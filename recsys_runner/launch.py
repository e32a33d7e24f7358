"""Launcher glue: a submitit job's environment as torch.distributed's, and a submit-and-exit SLURM launcher.

Under ``hydra/launcher=submitit_slurm`` (or ``submitit_local``) with ``tasks_per_node`` × ``nodes``
> 1, every task runs the Hydra job. :func:`map_submitit_env` (called first thing by
``Distributed.setup``) exports what ``init_process_group(init_method="env://")`` and the runner
read — ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` — from submitit's ``JobEnvironment`` (SLURM's ``SLURM_PROCID``, node list, …).
A launcher that already set them (torchrun inside an allocation) wins; a one-task job is left
alone, so it gets the private in-process store and cannot clash with other jobs on the node.

``hydra/launcher=submitit_slurm_detached`` submits the sweep's array and returns without waiting
(its class lives in ``hydra_plugins/recsys_runner_detached``: Hydra loads launchers only from the
``hydra_plugins`` namespace); the jobs log to MLflow as children of the sweep's parent run, and
``python -m recsys_runner.compare collect --parent <id> --wait`` gathers them later.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

_TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_PORT_RANGE = (20000, 60000)


def torch_env_from_submitit(
    *, job_id: str, global_rank: int, local_rank: int, num_tasks: int, num_nodes: int, hostnames: Sequence[str],
    environ: Mapping[str, str],
) -> dict[str, str]:
    """The torch.distributed variables for one task of a submitit job (pure; see :func:`map_submitit_env`).

    ``MASTER_PORT`` is derived from the job id (the same on every task, different between jobs)
    unless the environment sets it.
    """
    base_job = job_id.split("_")[0]  # array task "123_4" and its requeues share nothing with job "124"
    port = environ.get("MASTER_PORT") or str(random.Random(job_id if "_" in job_id else base_job).randint(*_PORT_RANGE))
    return {
        "RANK": str(global_rank),
        "WORLD_SIZE": str(num_tasks),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(num_tasks // max(num_nodes, 1)),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or hostnames[0],
        "MASTER_PORT": port,
    }


def map_submitit_env(environ: dict[str, str] | os._Environ[str] | None = None) -> dict[str, str]:
    """Inside a multi-task submitit job, export torch.distributed's variables; return what was set.

    Does nothing outside submitit, for a one-task job, or when ``RANK``/``WORLD_SIZE`` are already set.
    """
    env = os.environ if environ is None else environ
    if "SUBMITIT_EXECUTOR" not in env or ("RANK" in env and "WORLD_SIZE" in env):
        return {}
    import submitit

    job = submitit.JobEnvironment()
    if job.num_tasks <= 1:
        return {}
    values = torch_env_from_submitit(job_id=str(job.job_id), global_rank=job.global_rank, local_rank=job.local_rank,
                                     num_tasks=job.num_tasks, num_nodes=job.num_nodes, hostnames=list(job.hostnames), environ=env)
    env.update(values)
    log.info("submitit job %s task %d/%d → torch.distributed via %s:%s", job.job_id, job.global_rank, job.num_tasks,
             values["MASTER_ADDR"], values["MASTER_PORT"])
    return values
