"""Many jobs in one process leave nothing behind: a Hydra sweep's basic launcher, a notebook and these tests run jobs one
after another in one process, so a job's process group (its gloo threads, sockets and pipes), MLflow run, logging
handlers and environment must be gone when it ends, whether it finished, failed or stopped (STYLE.md rule 7)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Callable
from pathlib import Path

import mlflow
import pytest
import torch.distributed as dist
from omegaconf import DictConfig

from recsys_runner import evaluate
from recsys_runner.__main__ import run as train
from recsys_runner.errors import ConfigError
from recsys_runner.train.signals import Interrupted
from tests.test_evaluate import _training_overrides, compose_entry

JOB = ("data.num_train_rows=1024", "data.num_eval_rows=512", "data.batch_size=128", "train.num_steps=4", "distributed.num_threads=1")


def _held() -> dict[str, object]:
    """What a job could leave in this process: gloo's threads (native, so counted in /proc), the sockets, pipes and event
    polls its group opens, an initialized group, an active MLflow run, handlers on our loggers, environment variables."""
    threads = [(Path("/proc/self/task") / t / "comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the directory's own descriptor, closed by now
            pass
    return {"gloo threads": sum("gloo" in name for name in threads),
            "sockets, pipes, polls": sum(link.startswith(("socket:", "pipe:", "anon_inode:")) for link in links),
            "group": dist.is_initialized(), "active run": mlflow.active_run() is not None,
            "handlers": [len(logging.getLogger(name).handlers) for name in ("", "recsys_runner")], "environment": sorted(os.environ)}


def test_jobs_in_one_process_leave_nothing_behind_finished_failed_or_stopped(
        make_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    # The collector is off, so that nothing but the jobs' own release frees what they held: automatic collection runs
    # when it likes, and a pass that happened to run between two jobs would hide a job's group left in a cycle.
    gc.collect()  # what earlier tests of this process left in cycles (their groups, built without a job) is theirs, not ours:
    before = _held()  # left, the first job's freeze would keep it until a later job's full pass, and first != last
    gc.disable()
    try:
        train(make_cfg(*JOB, f"checkpoint.dir={tmp_path}/ck"))
        first = _held()
        evaluate.run(compose_entry("evaluate", *_training_overrides(make_cfg, *JOB, f"checkpoint.dir={tmp_path}/ck"),
                                   f"load={tmp_path}/ck"))
        after_evaluate = _held()
        with pytest.raises(Interrupted, match="stop_after_steps"):
            train(make_cfg(*JOB, "train.stop_after_steps=1", f"checkpoint.dir={tmp_path}/ck_stopped"))
        with pytest.raises(ConfigError, match="train.objective"):  # found after the training, with the final eval's keys
            train(make_cfg(*JOB, "train.objective=eval/nope", f"checkpoint.dir={tmp_path}/ck_failed"))
        train(make_cfg(*JOB, "model=dlrm", f"checkpoint.dir={tmp_path}/ck_dlrm"))  # also frees the failed jobs' leftovers
        last = _held()
    finally:
        gc.enable()
    assert after_evaluate == first
    assert last == first
    # Nor does a process keep its first job's group: torch.distributed.optim, imported inside it, would bind that group.
    assert last["gloo threads"] <= before["gloo threads"]  # fewer: an earlier test's group in a cycle, freed by now


@pytest.mark.parametrize("world_size, collected", [("2", False), ("1", True), ("", True)])
def test_a_rank_of_a_multi_rank_launch_leaves_its_group_to_the_process_end(
        world_size: str, collected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a rank of several (``WORLD_SIZE`` > 1) the job's end collects nothing: such a process ends without freeing its
    group (``end_rank_process``), and a collection there ran the gloo group's destructor while a work thread still
    finished a collective, deadlocking the rank (seen in the suite)."""
    from recsys_runner import lifecycle

    entered: list[bool] = []

    def spy() -> contextlib.AbstractContextManager[None]:
        entered.append(True)
        return contextlib.nullcontext()

    monkeypatch.setattr(lifecycle, "job_collected", spy)
    monkeypatch.setenv("WORLD_SIZE", world_size)
    assert lifecycle.one_job(lambda x: x + 1)(1) == 2
    assert entered == ([True] if collected else [])
