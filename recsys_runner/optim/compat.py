"""Every import whose location differs between the supported TorchRec/fbgemm_gpu releases, in one place.

Supported: torchrec 1.6–1.8 with fbgemm_gpu 1.6–1.8. The rest of the package imports these names
from here, never from their version-specific modules, so a new release that moves one needs a
change here only.

- ``WeightDecayMode`` (the fused optimizers' ``weight_decay_mode``): fbgemm_gpu 1.8 defines it in
  ``fbgemm_gpu.tbe.config.optimizer_config``; 1.6 in ``fbgemm_gpu.split_table_batched_embeddings_ops_training``.

The TorchRec names the package uses (planner types and stats, ``ShardingType``, ``EmbeddingComputeKernel``,
``DistributedModelParallel``, the train pipelines, ``torchrec.optim``) live in the same modules in
torchrec 1.6, 1.7 and 1.8, so they are imported directly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

SUPPORTED_VERSIONS = "torchrec 1.6-1.8 with fbgemm_gpu 1.6-1.8"

WEIGHT_DECAY_MODE_MODULES = (
    "fbgemm_gpu.tbe.config.optimizer_config",  # fbgemm_gpu 1.8
    "fbgemm_gpu.split_table_batched_embeddings_ops_training",  # fbgemm_gpu 1.6
)


def _installed_versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for dist in ("torchrec", "fbgemm_gpu", "fbgemm_gpu-cpu", "fbgemm-gpu-genai"):
        try:
            found.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            continue
    return ", ".join(found) or "neither torchrec nor fbgemm_gpu"


def import_first(name: str, modules: tuple[str, ...]) -> tuple[Any, str]:
    """``name`` from the first of ``modules`` that defines it, and that module's name.

    Raises :class:`ImportError` naming the supported versions and the installed ones when none does.
    """
    errors = []
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name), module
        except (ImportError, AttributeError) as e:
            errors.append(f"{module}: {e}")
    raise ImportError(
        f"cannot import {name} from any of {list(modules)} ({'; '.join(errors)}). recsys_runner supports "
        f"{SUPPORTED_VERSIONS}; installed: {_installed_versions()}. Fix: install a supported pair, e.g. "
        f"pip install 'torchrec>=1.6,<1.9' 'fbgemm_gpu>=1.6,<1.9'"
    )


if TYPE_CHECKING:
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

    WEIGHT_DECAY_MODE_FROM: str
else:
    # WEIGHT_DECAY_MODE_FROM: the module it came from (for tests and bug reports)
    WeightDecayMode, WEIGHT_DECAY_MODE_FROM = import_first("WeightDecayMode", WEIGHT_DECAY_MODE_MODULES)

__all__ = ["SUPPORTED_VERSIONS", "WeightDecayMode", "import_first"]
