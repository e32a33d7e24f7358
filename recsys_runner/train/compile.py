"""``train.compile``: ``torch.compile`` of the model's dense modules, optionally replayed as CUDA graphs.

Why only the dense modules: the embedding lookups are TorchRec's sharded modules (fbgemm's fused kernels, input
distribution, the pipeline's rewritten forwards), which neither dynamo nor a CUDA graph may own. What is left of a
step on a GPU is many small kernels of the over-arch, interaction and towers, each paying a launch from Python: the
host-bound part of the step (docs/performance.md). Compiling fuses them; a CUDA graph replays the fused forward and
backward with one launch each.

Which modules: walking down from the model, the first module on each path that holds no embedding table (no
EmbeddingBagCollection / EmbeddingCollection / managed-collision module) is compiled whole — DeepFM's ``dense_arch``,
``fm`` and ``deep``, DLRM's dense and over arches, a multi-task model's experts and towers. The module's ``forward`` is
replaced on the instance (``torch.compile`` of the bound method), so parameter names, the state dict, checkpoints and
TorchRec's pipeline tracing (which treats embedding-free modules as leaves) are unchanged.

CUDA graphs (``train.compile.cuda_graphs``) are inductor's ``reduce-overhead`` mode. A graph replays fixed shapes, so
it is refused where shapes change from batch to batch: data with histories (padded to each batch's longest row),
token-budget batches, and file data that keeps a last partial batch (``data.drop_remainder=false``). A graph's outputs
live in memory the next replay overwrites; the train metrics keep a step's logits until the next log step, so a graph
module's outputs are cloned (a few ``[B, D]`` copies a step), and each training forward starts a new graph step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.distributed.types import ShardedModule
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_modules import ManagedCollisionCollection

from recsys_runner.errors import ConfigError, require
from recsys_runner.features import FeatureSpec

log = logging.getLogger(__name__)

_BACKENDS = ("inductor", "aot_eager", "eager")
_MODES = ("default", "max-autotune-no-cudagraphs")
_EMBEDDINGS = (EmbeddingBagCollection, EmbeddingCollection, ManagedCollisionCollection, ShardedModule)


@dataclass(kw_only=True)
class CompileConfig:
    """``train.compile``: compile the model's dense modules (``train.compile.enabled=true``)."""

    enabled: bool = False
    """``torch.compile`` every embedding-free module of the model (over-arch, interaction, towers); the embedding
    lookups stay TorchRec's. Costs compile time at the first steps (and at the first eval) for faster steps after."""
    backend: str = "inductor"
    """dynamo backend: ``inductor`` (fused kernels: the point of it), ``aot_eager`` / ``eager`` (no code generation:
    checks that the model traces, e.g. in a test, without the compiler's cost)."""
    mode: str = "default"
    """inductor's mode: ``default`` or ``max-autotune-no-cudagraphs`` (autotuned matmuls; long compile). CUDA graphs
    are ``train.compile.cuda_graphs``, not a mode here."""
    cuda_graphs: bool = False
    """Replay the compiled dense forward and backward as CUDA graphs (inductor's ``reduce-overhead``): one launch
    instead of one per kernel. CUDA only, and only for fixed shapes (see the module docstring); implies ``enabled``."""
    dynamic: bool | None = None
    """dynamo's ``dynamic``: ``null`` compiles for the first shape and recompiles once as dynamic if the shape changes
    (a last partial batch, a history's padded length); ``true``/``false`` force it."""

    def __post_init__(self) -> None:
        require(self.backend in _BACKENDS, f"train.compile.backend={self.backend!r} must be one of {_BACKENDS}")
        require(self.mode in _MODES, f"train.compile.mode={self.mode!r} must be one of {_MODES} "
                                     f"(for CUDA graphs: train.compile.cuda_graphs=true)")
        require(not (self.cuda_graphs and self.backend != "inductor"),
                f"train.compile.cuda_graphs=true is inductor's reduce-overhead mode; train.compile.backend={self.backend} has "
                f"no CUDA graphs. Fix: train.compile.backend=inductor")
        require(not (self.cuda_graphs and self.dynamic),
                "train.compile.cuda_graphs=true replays fixed shapes; train.compile.dynamic=true asks for changing ones. "
                "Fix: drop train.compile.dynamic")

    @property
    def active(self) -> bool:
        """Whether anything is compiled."""
        return self.enabled or self.cuda_graphs


def check_compile(config: CompileConfig, device_type: str, data: Any) -> None:
    """Refuse CUDA graphs where they cannot run, before anything is built.

    Args:
        config: ``train.compile``.
        device_type: the run's resolved device, ``cuda`` or ``cpu``.
        data: the data config (``data.*``): ``batch_tokens`` and ``drop_remainder`` decide whether every training batch
            has one shape (histories are checked once the data's columns are known: :func:`check_static_shapes`).

    Raises:
        ConfigError: naming why the shapes change, or the device, and the fix.
    """
    if not config.cuda_graphs:
        return
    fix = "Fix: train.compile.cuda_graphs=false (train.compile.enabled=true alone compiles without graphs)"
    require(device_type == "cuda", f"train.compile.cuda_graphs=true needs CUDA; this run is on {device_type}. {fix}")
    if getattr(data, "batch_tokens", None) is not None:
        raise ConfigError(f"train.compile.cuda_graphs=true replays fixed shapes, and data.batch_tokens={data.batch_tokens} makes "
                          f"batches of varying rows. {fix}")
    if getattr(data, "drop_remainder", True) is False:
        raise ConfigError("train.compile.cuda_graphs=true replays fixed shapes, and data.drop_remainder=false keeps a last "
                          f"partial batch. Fix: data.drop_remainder=true, or {fix.removeprefix('Fix: ')}")


def check_static_shapes(config: CompileConfig, features: FeatureSpec) -> None:
    """Refuse CUDA graphs for data with histories (known once the data's columns are: a Parquet schema may hold them).

    Raises:
        ConfigError: the data has histories, padded to each batch's longest row.
    """
    if config.cuda_graphs and features.sequences:
        raise ConfigError(f"train.compile.cuda_graphs=true replays fixed shapes, and this data has histories "
                          f"({', '.join(g.name for g in features.sequences)}), padded to each batch's longest row. Fix: "
                          f"train.compile.cuda_graphs=false (train.compile.enabled=true alone compiles, recompiling once as "
                          f"dynamic when the padded length changes)")


def dense_modules(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """The topmost embedding-free submodules of ``model`` that have work to compile, by dotted name."""
    for name, child in model.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, _EMBEDDINGS):
            continue
        if any(isinstance(m, _EMBEDDINGS) for m in child.modules()):
            yield from dense_modules(child, f"{path}.")
        elif _has_work(child):
            yield path, child


def _has_work(module: nn.Module) -> bool:
    """A module with parameters or its own ``forward`` (a parameter-free interaction such as the FM term)."""
    return any(True for _ in module.parameters()) or type(module).forward is not nn.Module.forward


class _Compiled:
    """A module's compiled ``forward``, set on the instance; with CUDA graphs its tensor outputs are cloned out of the
    graph's memory (which the next replay overwrites)."""

    def __init__(self, compiled: Callable[..., Any], clone: bool) -> None:
        self.compiled, self.clone = compiled, clone

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.compiled(*args, **kwargs)
        return _cloned(out) if self.clone else out


def _cloned(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple | list):
        return type(out)(_cloned(o) for o in out)
    if isinstance(out, dict):
        return {k: _cloned(v) for k, v in out.items()}
    return out


def _new_graph_step(_module: nn.Module, _args: Any) -> None:
    """Before each training forward: a new step of inductor's CUDA graph trees (the last step's outputs are done)."""
    if torch.is_grad_enabled():
        torch.compiler.cudagraph_mark_step_begin()


def compile_dense(model: nn.Module, config: CompileConfig, wrapper: nn.Module | None = None) -> list[str]:
    """Compile ``model``'s dense modules in place as ``config`` says; returns their names (logged once).

    Args:
        model: the user's model (inside the TrainWrapper and DistributedModelParallel; the same module objects).
        config: ``train.compile``.
        wrapper: the module whose forward starts a training step (the TrainWrapper), hooked for CUDA graphs.
    """
    if not config.active:
        return []
    options: dict[str, Any] = {"backend": config.backend, "dynamic": config.dynamic}
    if config.backend == "inductor":
        options["mode"] = "reduce-overhead" if config.cuda_graphs else config.mode
    names = []
    for name, module in dense_modules(model):
        # on the instance, not a wrapper module: parameter names and the pipeline's leaf tracing stay as they are
        object.__setattr__(module, "forward", _Compiled(torch.compile(module.forward, **options), clone=config.cuda_graphs))
        names.append(name)
    if config.cuda_graphs and wrapper is not None:
        wrapper.register_forward_pre_hook(_new_graph_step)
    log.info("train.compile: %s compiled (%s%s): %s", type(model).__name__, config.backend,
             ", CUDA graphs" if config.cuda_graphs else "", ", ".join(names) or "no dense module")
    return names
