"""What the loader (:mod:`~recsys_runner.checkpoint.weights`) and the row carry (:mod:`~recsys_runner.checkpoint.carried_rows`)
both read of a checkpoint key and of one of ours: the parameter an optimizer state key belongs to, a tensor's global shape."""

from __future__ import annotations

import warnings
from typing import Any


def param_of(key: str) -> str:
    """The parameter an optimizer state key belongs to: ``optim/sparse.<param>/<state>`` → ``<param>``."""
    return key.split("/")[1].split(".", 1)[-1] if key.startswith("optim/") and key.count("/") >= 2 else ""


def shape_of(t: Any) -> list[int]:
    """The global shape of a tensor or ShardedTensor (whose ``size()`` warns that ShardedTensor is deprecated)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return list(t.size())
