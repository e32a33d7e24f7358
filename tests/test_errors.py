"""User errors: one class per cause, each with the CLI's label, and the class survives the rank-0 broadcast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from recsys_runner.distributed.env import decided_on_rank0
from recsys_runner.errors import CheckpointError, ConfigError, DataError, TrackingError, UserError
from tests.conftest import free_port

WORLD = 2
CLASSES = {cls.__name__: cls for cls in (ConfigError, DataError, CheckpointError, TrackingError)}


def test_each_cause_has_its_own_class_and_label() -> None:
    assert {name: cls.label for name, cls in CLASSES.items()} == {
        "ConfigError": "Config error", "DataError": "Data error", "CheckpointError": "Checkpoint error",
        "TrackingError": "Tracking error"}
    for cls in CLASSES.values():
        assert issubclass(cls, UserError) and issubclass(cls, ValueError)
        assert all(not issubclass(cls, other) for other in CLASSES.values() if other is not cls)  # siblings


def _decide(name: str) -> None:
    raise CLASSES[name](f"{name} on rank 0")


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_one_rank_raises_the_error_itself(name: str) -> None:
    with pytest.raises(CLASSES[name], match=f"^{name} on rank 0$"):
        decided_on_rank0(lambda: _decide(name), rank=0, world_size=1)


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        seen = {}
        for name in sorted(CLASSES):
            try:
                decided_on_rank0(lambda name=name: _decide(name), rank, WORLD)
            except UserError as e:
                seen[name] = [type(e).__name__, str(e)]
        seen["result"] = [decided_on_rank0(lambda: "chosen on rank 0" if rank == 0 else "not rank 0", rank, WORLD)]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()




def test_every_rank_raises_rank_0s_error_class_and_message(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    expected = {name: [name, f"{name} on rank 0"] for name in CLASSES} | {"result": ["chosen on rank 0"]}
    for rank in range(WORLD):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected, rank
