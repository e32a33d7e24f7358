"""PLE (Tang, Liu, Zhao, Gong, 2020, "Progressive Layered Extraction (PLE): A Novel Multi-Task Learning (MTL) Model for
Personalized Recommendations", https://dl.acm.org/doi/10.1145/3383313.3412236) on TorchRec.

The embedded sparse features and the dense features are concatenated into one input ``x``. ``L`` extraction levels
follow (each the paper's customized gate control, CGC): a level has ``S`` shared experts and ``E`` experts per task.
Task ``t``'s gate mixes its own experts and the shared ones; its mixture is task ``t``'s input to the next level. A
shared gate mixes every expert of the level (all tasks' and the shared ones) into the next level's shared input; the
last level has no shared gate, since nothing reads its output. Each task's last mixture feeds its own tower, which
ends in one logit. Experts that serve one task are kept apart from those that serve all, so a task's private signal
need not pass through the experts the others also pull on (MMoE's "seesaw").

With one level and ``E = 0`` this is MMoE: the task gates mix the shared experts alone (``tests/test_multitask_models.py``
checks the equality).

Shape legend: ``B`` batch, ``F`` sparse features, ``D`` embedding dim, ``N`` dense features, ``I`` a level's input
width (``ΣD_f + N`` at the first level, ``H`` after), ``S`` shared experts, ``E`` experts per task, ``H`` expert output
width, ``T`` tasks, ``L`` levels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import require
from recsys_runner.features import FeatureSpec, check_embedding_dim
from recsys_runner.models.common import SparseArch, check_layer_sizes
from recsys_runner.models.multitask import Experts, Gate, MultiTaskConfig, Tower

__all__ = ["PLEConfig", "PLE", "ExtractionLevel"]


@dataclass(kw_only=True)
class PLEConfig(MultiTaskConfig):
    """Schema of ``conf/model/ple.yaml``."""

    _target_: str = "recsys_runner.models.ple.PLE"
    embedding_dim: int = 16
    """Width ``D`` of every embedding table whose feature sets no ``embedding_dim`` of its own in ``data.sparse``
    (this model accepts mixed per-feature widths)."""
    num_levels: int = 2
    """``L``: extraction levels stacked (1: a single CGC layer)."""
    num_shared_experts: int = 2
    """``S``: experts per level shared by every task."""
    num_task_experts: int = 1
    """``E``: experts per level and task, read by that task's gate alone (0: each level mixes the shared experts
    only, and one level is MMoE)."""
    expert_layer_sizes: list[int] = field(default_factory=lambda: [128, 64])
    """Layers of every expert, at every level; the last is the width ``H`` the gates mix."""
    tower_layer_sizes: list[int] = field(default_factory=lambda: [32])
    """Hidden layers of each task's tower (a final 1-unit layer is added)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        require(self.num_levels >= 1, f"model.num_levels must be at least 1, got {self.num_levels}. Fix: e.g. model.num_levels=2")
        require(self.num_shared_experts >= 1,
                f"model.num_shared_experts={self.num_shared_experts}: every PLE level needs at least one shared expert (each task's "
                f"gate mixes them, and they carry what the tasks share to the next level). Fix: model.num_shared_experts=1 or "
                f"more; for tasks that share nothing, train one model per task")
        require(self.num_task_experts >= 0,
                f"model.num_task_experts must be 0 or more, got {self.num_task_experts}. Fix: e.g. model.num_task_experts=1")
        check_layer_sizes("expert_layer_sizes", self.expert_layer_sizes)
        check_layer_sizes("tower_layer_sizes", self.tower_layer_sizes)


class ExtractionLevel(nn.Module):
    """One PLE level: shared experts, experts per task, a gate per task and (except at the last level) a shared gate.

    ``forward(task_inputs: T × [B, I], shared_input [B, I]) → (T × [B, H], shared [B, H] or shared experts [B, S, H])``:
    each task's gate mixture, then the shared gate's mixture — or, at the last level (``final``, no shared gate), the
    shared experts' outputs themselves.

    Args:
        config: the model's hyperparameters (``num_shared_experts`` ``S``, ``num_task_experts`` ``E``,
            ``expert_layer_sizes``).
        in_features: ``I``, the width of every input of this level.
        num_tasks: ``T``.
        final: the last level: no shared gate.
        device: device of the parameters.

    Example::

        >>> import torch
        >>> from recsys_runner.models.ple import ExtractionLevel, PLEConfig
        >>> level = ExtractionLevel(PLEConfig(num_shared_experts=2, num_task_experts=1, expert_layer_sizes=[8]), 5, 2, final=False)
        >>> tasks, shared = level([torch.randn(4, 5)] * 2, torch.randn(4, 5))   # 2 tasks' inputs [B, 5], the shared one
        >>> [t.shape for t in tasks], shared.shape
        ([torch.Size([4, 8]), torch.Size([4, 8])], torch.Size([4, 8]))
    """

    def __init__(self, config: PLEConfig, in_features: int, num_tasks: int, *, final: bool,
                 device: torch.device | None = None) -> None:
        super().__init__()
        sizes, num_shared, num_own = list(config.expert_layer_sizes), config.num_shared_experts, config.num_task_experts
        self.final = final
        self.shared_experts = Experts(in_features, num_shared, sizes, device=device)
        """``S`` experts every task's gate reads: ``[B, I] → [B, S, H]``."""
        self.task_experts = nn.ModuleList(Experts(in_features, num_own, sizes, device=device) for _ in range(num_tasks if num_own else 0))
        """Each task's ``E`` experts, ``[B, I] → [B, E, H]``; empty when ``E = 0``."""
        self.task_gates = nn.ModuleList(Gate(in_features, num_own + num_shared, device=device) for _ in range(num_tasks))
        """Each task's softmax over its own and the shared experts, read from the task's input."""
        self.shared_gate = None if final else Gate(in_features, num_tasks * num_own + num_shared, device=device)
        """Softmax over every expert of the level, read from the shared input; ``None`` at the last level."""

    def forward(self, task_inputs: list[torch.Tensor], shared_input: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        shared = self.shared_experts(shared_input)
        own = [experts(x) for experts, x in zip(self.task_experts, task_inputs, strict=False)]  # [] when E = 0
        pools = [torch.cat([e, shared], dim=1) for e in own] if own else [shared] * len(task_inputs)
        mixed = [gate(x, pool) for gate, x, pool in zip(self.task_gates, task_inputs, pools, strict=True)]
        if self.shared_gate is None:
            return mixed, shared
        return mixed, self.shared_gate(shared_input, torch.cat([*own, shared], dim=1))


class PLE(nn.Module):
    """PLE: ``L`` levels of shared and per-task experts with a gate per task and level, a tower per task;
    ``(dense [B, N], sparse KJT) → {task: logits [B]}``.

    ``tasks`` (:class:`~recsys_runner.tasks.Task` objects, in output order: :class:`~recsys_runner.tasks.BinaryTask` or
    :class:`~recsys_runner.tasks.RegressionTask`) tells the TrainWrapper each task's label column, loss and weight. The
    shared part is the last level's shared experts (:attr:`shared_module` names them).

    Args:
        config: its hyperparameters (:class:`PLEConfig`: ``embedding_dim`` ``D``, the task names with their
            ``loss_weights`` / ``task_kinds``, ``num_levels`` ``L``, ``num_shared_experts`` ``S``, ``num_task_experts``
            ``E``, ``expert_layer_sizes``, ``tower_layer_sizes``).
        features: the data's feature schema; it must carry a label per task.
        dense_device: device of the dense parameters (embeddings start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.ple import PLE, PLEConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50, tasks=["ctr", "cvr"]).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> model = materialize(PLE(PLEConfig(embedding_dim=8, tasks=["ctr", "cvr"], num_levels=2, num_shared_experts=2,
        ...                                   num_task_experts=1, expert_layer_sizes=[16], tower_layer_sizes=[8]),
        ...                         features=data.features))
        >>> {task: logits.shape for task, logits in model(batch.dense_features, batch.sparse_features).items()}
        {'ctr': torch.Size([8]), 'cvr': torch.Size([8])}
    """

    shared_module: ClassVar[str] = "last_level.shared_experts"
    """The representation every task reads: the last level's shared experts (their outputs ``[B, S, H]``, mixed by
    every task's last gate). Pareto weighting takes each task's gradient with respect to it (``train.loss_weighting``)."""
    same_embedding_width: ClassVar[str | None] = None
    """None: the first level reads the concatenated embeddings, so each feature may have its own width."""

    def __init__(self, config: PLEConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        names = list(config.tasks)  # the tasks' names, in output order
        self.tasks = config.resolve_tasks(features)
        self.sparse_arch = SparseArch(features, config.embedding_dim, type(self))
        width = config.expert_layer_sizes[-1]
        inputs = [self.sparse_arch.output_dim + features.num_dense] + [width] * (config.num_levels - 1)
        self.levels = nn.ModuleList(ExtractionLevel(config, i, len(names), final=False, device=dense_device) for i in inputs[:-1])
        """Every level but the last (none with ``num_levels=1``)."""
        self.last_level = ExtractionLevel(config, inputs[-1], len(names), final=True, device=dense_device)
        """The last level: no shared gate; its shared experts are :attr:`shared_module`."""
        widths = {t.name: t.output_width for t in self.tasks}
        self.towers = nn.ModuleDict({name: Tower(width, list(config.tower_layer_sizes), device=dense_device,
                                                      out_width=widths[name]) for name in names})

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        x = torch.cat([self.sparse_arch(sparse), dense], dim=1)
        task_inputs, shared = [x] * len(self.towers), x
        for level in [*self.levels, self.last_level]:
            outputs = level(task_inputs, shared)  # indexed, not unpacked: under TorchRec's pipeline trace it is one value
            task_inputs, shared = [outputs[0][t] for t in range(len(self.towers))], outputs[1]
        return {name: self.towers[name](task_inputs[t]) for t, name in enumerate(self.towers)}
