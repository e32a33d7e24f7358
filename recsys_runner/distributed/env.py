"""Where this process sits (rank, world, device) and how many CPU threads it gets; decisions made once on rank 0."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from recsys_runner.errors import UserError


def auto_num_threads(local_world_size: int = 1, sample_s: float = 0.1) -> tuple[int, str]:
    """``distributed.num_threads: auto`` for one of ``local_world_size`` ranks on this node, with why.

    An explicit ``OMP_NUM_THREADS`` wins (the user or launcher chose). Else each rank gets its share of the
    physical cores this process may use (its CPU affinity and cgroup quota, hyperthreads not counted), capped
    by its share of the CPUs idle right now (sampled over ``sample_s``): on a machine other jobs keep busy,
    torch's threads spin-wait for cores they do not get, and a CPU step measured 10x slower with 2 threads
    than with 1 on 2 busy cores. At least 1.
    """
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), f"OMP_NUM_THREADS={omp}"
    cores, ranks = usable_cores(), max(local_world_size, 1)
    idle = idle_cpus(sample_s)
    threads = max(1, min(cores // ranks, int(idle + 0.5) // ranks if idle is not None else cores))
    busy = f", {idle:.1f} CPUs idle" if idle is not None else ""
    return threads, f"auto: {cores} usable physical cores{busy}, {ranks} rank(s) on this node; set distributed.num_threads to change"


def idle_cpus(sample_s: float = 0.1) -> float | None:
    """How many of this process's CPUs were idle over the next ``sample_s`` seconds (``/proc/stat``); ``None``
    where that cannot be read."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

    def snapshot() -> dict[str, tuple[int, int]]:
        times = {}
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu" and (allowed is None or int(name[3:]) in allowed):
                values = [int(v) for v in fields[:8]]
                times[name] = (values[3] + values[4], sum(values))  # idle + iowait, all
        return times

    try:
        before = snapshot()
        time.sleep(sample_s)
        after = snapshot()
    except (OSError, ValueError):
        return None
    shares = [(after[c][0] - before[c][0]) / (after[c][1] - before[c][1]) for c in after
              if c in before and after[c][1] > before[c][1]]
    return sum(shares) if shares else None


def usable_cores() -> int:
    """Physical cores this process may run on: the CPUs of its affinity mask, capped by a cgroup CPU quota
    (a container's ``cpu.max``), and by the physical core count when CPUs are hyperthreads."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    with contextlib.suppress(OSError):
        cores: set[tuple[str, str]] = set()
        physical = "0"
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "physical id":
                physical = value.strip()
            elif key.strip() == "core id":
                cores.add((physical, value.strip()))
        if cores:
            cpus = min(cpus, len(cores))
    return max(1, cpus)

T = TypeVar("T")


def decided_on_rank0(decide: Callable[[], T], rank: int, world_size: int) -> T:
    """``decide()`` on rank 0 only; every rank gets its result, or raises the same :class:`~recsys_runner.errors.UserError`
    (its class too: a :class:`~recsys_runner.errors.TrackingError` stays one on every rank).

    For start-of-run checks and choices about shared state (the tracking store, the checkpoint
    directory's lock, which checkpoint to resume): one view of the world, and no rank left waiting in
    a collective for a rank that raised.
    """
    result: Any = None
    error: UserError | None = None
    if rank == 0:
        try:
            result = decide()
        except UserError as e:
            error = e
    if world_size > 1:
        # the error is sent pickled as class and message (an exception's traceback and cause are not pickled)
        box: list[Any] = [(result, error)]
        dist.broadcast_object_list(box, src=0)
        result, error = box[0]
    if error is not None:
        raise error
    return result


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: its rank, the world, its device and the process group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0
