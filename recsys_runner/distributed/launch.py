"""Launcher glue: a submitit job's environment as torch.distributed's, and a submit-and-exit SLURM launcher.

Under ``hydra/launcher=submitit_slurm`` (or ``submitit_local``) with ``tasks_per_node`` × ``nodes``
> 1, every task runs the Hydra job. :func:`map_submitit_env` (called first thing by
``Distributed.setup``) has submitit's own ``TorchDistributedEnvironment`` export what
``init_process_group(init_method="env://")`` and the runner read — ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` — from its ``JobEnvironment``
(SLURM's ``SLURM_PROCID``, node list, …), with the port of :func:`job_port`. A launcher that already set them (torchrun inside an
allocation) wins; a one-task job is left alone, so it gets the private in-process store and cannot
clash with other jobs on the node.

``hydra/launcher=submitit_slurm_detached`` submits the sweep's array and returns without waiting
(its class lives in ``hydra_plugins/recsys_runner_detached``: Hydra loads launchers only from the
``hydra_plugins`` namespace); the jobs log to MLflow as children of the sweep's parent run, and
``python -m recsys_runner.compare collect --parent <id> --wait`` gathers them later.

Under torchrun the process group's store is torchrun's own, under a prefix of the restart (:func:`elastic_store`), so
that the group a ``--max-restarts`` restart forms does not read the addresses of the attempt before.
"""

from __future__ import annotations

import datetime
import logging
import os
import zlib

import torch.distributed as dist

from recsys_runner.errors import LaunchError

log = logging.getLogger(__name__)

_TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

JOB_PORTS = range(20000, 32768)
"""Where a multi-task job's ``MASTER_PORT`` is drawn from (:func:`job_port`): below 32768, where Linux's ephemeral ports
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default) begin. submitit's own draw spans 20000-60000, so
seven ports in ten it picked were ones the kernel hands out to any process's outgoing connection or ``bind(0)`` — a
gloo pair of another run on the node, an HTTP client's socket — and rank 0 failed ``EADDRINUSE`` at the rendezvous."""


def job_port(job_id: str) -> int:
    """The rendezvous port of the job ``job_id`` (SLURM's, ``12345`` or ``12345_7`` for an array's task): the same on
    every task and every node of the job, without a word between them; two jobs on a node share one only by chance
    (1 in 12768), and :data:`JOB_PORTS` lies outside the kernel's ephemeral ports."""
    return JOB_PORTS.start + zlib.crc32(job_id.encode()) % len(JOB_PORTS)


def map_submitit_env() -> dict[str, str]:
    """Inside a multi-task submitit job, export torch.distributed's variables; return what was set.

    Does nothing outside submitit, for a one-task job, or when ``RANK``/``WORLD_SIZE`` are already set.
    ``MASTER_ADDR`` is the job's first node; ``MASTER_PORT`` is :func:`job_port` of the job id (the same on every task,
    different between jobs) unless the environment sets it.
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
    os.environ.setdefault("MASTER_PORT", str(job_port(str(job.job_id))))  # submitit's export takes it from there
    dist_env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    log.info("submitit job %s task %d/%d → torch.distributed via %s:%s", job.job_id, dist_env.rank, dist_env.world_size,
             dist_env.master_addr, dist_env.master_port)
    return {k: os.environ[k] for k in _TORCH_VARS}


def port_taken(error: BaseException, port_from: str) -> LaunchError | None:
    """The one-line error for rank 0 of a group whose rendezvous port another process holds (``EADDRINUSE`` from the
    ``env://`` store torch opens on ``MASTER_ADDR:MASTER_PORT``), else ``None``; ``port_from`` says who chose the port.

    The other ranks never learn of it: they wait for the store until ``distributed.timeout_s`` (connected to the other
    process on the port, longer), unless the launcher ends them (torchrun; srun's ``--kill-on-bad-exit``, which
    ``hydra/launcher=submitit_slurm`` passes; ``submitit_local``'s controller, :mod:`recsys_runner.distributed.local_tasks`)."""
    if "EADDRINUSE" not in str(error) and "address already in use" not in str(error):
        return None
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return LaunchError(f"rank 0 cannot open the process group's rendezvous on {where}: another process on this host "
                       f"listens on that port ({port_from}). Fix: choose a free port for the job: under SLURM "
                       f"hydra.launcher.setup='[\"export MASTER_PORT=<free port>\"]', else MASTER_PORT=<free port> in the "
                       f"command's environment")


def elastic_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, ``env://``'s store under the prefix ``attempt_<TORCHELASTIC_RESTART_COUNT>``; ``None`` elsewhere
    (``init_process_group`` then reads ``env://`` itself).

    torchrun's store lives in its agent and outlives the workers it restarts (``--max-restarts``), and torch 2.13's
    ``env://`` puts no attempt in its keys: the restarted ranks read each other's gloo addresses of the attempt before
    and fail with ``Gloo connectFullMesh failed ... Connection refused`` (3 restarts in 4, measured on 2 CPU ranks; 0 in
    4 with the prefix). The restart count is each node's agent's own: it agrees across nodes when the whole group
    restarts together, the case ``--max-restarts`` handles.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"attempt_{attempt}", store)
