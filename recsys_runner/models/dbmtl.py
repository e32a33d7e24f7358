"""DBMTL (Wang, Zhao, Xie, Li, Chen, 2019, "Deep Bayesian Multi-Target Learning for Recommender Systems",
https://arxiv.org/abs/1902.09154) on TorchRec, as TorchEasyRec builds it.

The embedded sparse features and the dense features are concatenated into one input ``x``; an optional shared bottom
MLP maps it to ``h``, which every task reads (or, with ``num_experts > 0``, an MMoE layer mixes experts over ``h`` per
task). Each task's tower MLP gives its hidden vector. The tasks' dependencies make the Bayesian network of the paper:
a task that depends on others (``relations: {cvr: [ctr]}`` — conversion given click) concatenates its hidden vector
with theirs and passes it through its relation MLP, so ``p(cvr | x)`` is modelled from what the click tower learnt.
Towers are computed in a dependency (topological) order; each task's final vector ends in one logit.

Shape legend: ``B`` batch, ``F`` sparse features, ``D`` embedding dim, ``N`` dense features, ``I`` the input width
``ΣD_f + N``, ``G`` the shared bottom's width (``I`` without one), ``H_t`` task ``t``'s hidden width, ``T`` tasks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError, require
from recsys_runner.features import FeatureSpec, check_embedding_dim
from recsys_runner.models.common import MLP, SparseArch, check_layer_sizes
from recsys_runner.models.multitask import Experts, Gate, MultiTaskConfig

__all__ = ["DBMTLConfig", "DBMTL", "task_dependencies", "dependency_order"]

RELATIONS_FIX = "e.g. model.relations={cvr: [ctr]} (conversion given click), model.relations={} for none, or null (each task on the one before it)"


@dataclass(kw_only=True)
class DBMTLConfig(MultiTaskConfig):
    """Schema of ``conf/model/dbmtl.yaml``."""

    _target_: str = "recsys_runner.models.dbmtl.DBMTL"
    embedding_dim: int = 16
    """Width ``D`` of every embedding table whose feature sets no ``embedding_dim`` of its own in ``data.sparse``
    (this model accepts mixed per-feature widths)."""
    bottom_layer_sizes: list[int] = field(default_factory=lambda: [128])
    """Layers of the shared bottom MLP every task reads; ``[]``: none (the towers read ``x``)."""
    num_experts: int = 0
    """Experts of an MMoE layer over the bottom's output, mixed by a gate per task; 0: no such layer."""
    expert_layer_sizes: list[int] = field(default_factory=lambda: [64])
    """Layers of each expert (with ``num_experts > 0``)."""
    tower_layer_sizes: list[int] = field(default_factory=lambda: [64, 32])
    """Layers of each task's tower MLP; the last is the task's hidden width ``H_t`` (without relations)."""
    relations: Any = None
    """Task → the tasks it depends on, e.g. ``{cvr: [ctr]}``: the dependent task's relation MLP reads its own hidden
    vector and theirs. ``null``: each task depends on the one before it in ``model.tasks`` (a funnel, ``cvr`` on
    ``ctr``); ``{}``: none. No cycles. A mapping, typed ``Any`` so that ``model.relations={cvr: [ctr]}`` works as a
    plain override."""
    relation_layer_sizes: list[int] = field(default_factory=lambda: [32])
    """Layers of the relation MLP of every task with dependencies; the last is its hidden width ``H_t``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        require(all(s > 0 for s in self.bottom_layer_sizes),
                f"model.bottom_layer_sizes={self.bottom_layer_sizes} has a non-positive layer size (use [] for no bottom MLP)")
        require(self.num_experts >= 0, f"model.num_experts must be 0 (no expert layer) or more, got {self.num_experts}. "
                                       f"Fix: e.g. model.num_experts=0, or 3")
        check_layer_sizes("expert_layer_sizes", self.expert_layer_sizes)
        check_layer_sizes("tower_layer_sizes", self.tower_layer_sizes)
        check_layer_sizes("relation_layer_sizes", self.relation_layer_sizes)
        dependency_order(self.tasks, task_dependencies(self.tasks, self.relations))


def task_dependencies(tasks: list[str], relations: Any) -> dict[str, list[str]]:
    """Each task's dependencies from ``model.relations`` (``None``: each task on the one before it), every task a key.

    Raises:
        ConfigError: ``relations`` is not a mapping of task names to task names, names a task not in ``tasks``, or
            makes a task depend on itself; each message names ``model.relations`` and the fix.
    """
    if relations is None:
        return {t: ([tasks[i - 1]] if i else []) for i, t in enumerate(tasks)}
    require(isinstance(relations, Mapping) and all(_names(v) for v in relations.values()),
            f"model.relations={relations!r} must map a task to the tasks it depends on, {RELATIONS_FIX}")
    given = {str(k): [v] if isinstance(v, str) else [str(n) for n in v] for k, v in relations.items()}
    unknown = sorted({n for k, deps in given.items() for n in [k, *deps]} - set(tasks))
    require(not unknown, f"model.relations={given} names task(s) {unknown} that are not in model.tasks={list(tasks)}. "
                         f"Fix: relate tasks of model.tasks, {RELATIONS_FIX}")
    for task, deps in given.items():
        require(task not in deps, f"model.relations: task {task!r} depends on itself. Fix: remove {task!r} from "
                                  f"model.relations.{task}; a task's tower already reads its own hidden vector")
        require(len(set(deps)) == len(deps), f"model.relations.{task}={deps} names a task twice. Fix: name each once")
    return {t: given.get(t, []) for t in tasks}


def _names(value: object) -> bool:
    """A task name or a list of them (a YAML list arrives as a ListConfig, a Sequence)."""
    return isinstance(value, str) or (isinstance(value, Sequence) and all(isinstance(n, str) for n in value))


def dependency_order(tasks: list[str], dependencies: dict[str, list[str]]) -> list[str]:
    """``tasks`` ordered so that each comes after every task it depends on (ties keep ``model.tasks`` order).

    Raises:
        ConfigError: the dependencies have a cycle, naming it.
    """
    order: list[str] = []
    while len(order) < len(tasks):
        ready = [t for t in tasks if t not in order and all(d in order for d in dependencies[t])]
        if not ready:
            cycle = _a_cycle([t for t in tasks if t not in order], dependencies)
            raise ConfigError(f"model.relations has a cycle: {' -> '.join(cycle)} (each depends on the next), so no task of it "
                              f"can be computed first. Fix: drop one of these dependencies, {RELATIONS_FIX}")
        order.append(ready[0])
    return order


def _a_cycle(left: list[str], dependencies: dict[str, list[str]]) -> list[str]:
    """A dependency cycle among ``left`` (every task of which depends, directly or not, on one of a cycle)."""
    path = [left[0]]
    while True:
        step = next(d for d in dependencies[path[-1]] if d in left)
        if step in path:
            return [*path[path.index(step):], step]
        path.append(step)


class DBMTL(nn.Module):
    """DBMTL: a shared bottom, a tower per task, relation MLPs over the towers a task depends on;
    ``(dense [B, N], sparse KJT) → {task: logits [B]}``.

    ``tasks`` (:class:`~recsys_runner.tasks.Task` objects, in output order) tells the TrainWrapper each task's label
    column, loss and weight; ``order`` is the order the towers run in (each after those it depends on). The shared part
    is the bottom MLP (:attr:`bottom`, ``nn.Identity`` without one; :attr:`shared_module` names it).

    Args:
        config: its hyperparameters (:class:`DBMTLConfig`: ``embedding_dim`` ``D``, the task names with their
            ``loss_weights`` / ``task_kinds``, ``bottom_layer_sizes``, ``num_experts``, ``expert_layer_sizes``,
            ``tower_layer_sizes``, ``relations``, ``relation_layer_sizes``).
        features: the data's feature schema; it must carry a label per task.
        dense_device: device of the dense parameters (embeddings start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.dbmtl import DBMTL, DBMTLConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50, tasks=["ctr", "cvr"]).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> model = materialize(DBMTL(DBMTLConfig(embedding_dim=8, tasks=["ctr", "cvr"], bottom_layer_sizes=[16], tower_layer_sizes=[8],
        ...                                       relations={"cvr": ["ctr"]}, relation_layer_sizes=[8]), features=data.features))
        >>> {task: logits.shape for task, logits in model(batch.dense_features, batch.sparse_features).items()}   # cvr's tower reads ctr's too
        {'ctr': torch.Size([8]), 'cvr': torch.Size([8])}
    """

    shared_module: ClassVar[str] = "bottom"
    """The representation every task reads: the shared bottom's output ``[B, G]`` (``x`` itself without a bottom MLP).
    Pareto weighting takes each task's gradient with respect to it (``train.loss_weighting``)."""
    same_embedding_width: ClassVar[str | None] = None
    """None: the bottom reads the concatenated embeddings, so each feature may have its own width."""

    def __init__(self, config: DBMTLConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        names = list(config.tasks)  # the tasks' names, in output order
        self.tasks = config.resolve_tasks(features)
        self.dependencies = task_dependencies(names, config.relations)
        """Each task's tasks it depends on (``model.relations``, resolved)."""
        self.order = dependency_order(names, self.dependencies)
        """The task names in the order their towers run."""
        self.sparse_arch = SparseArch(features, config.embedding_dim, type(self))
        width = self.sparse_arch.output_dim + features.num_dense
        bottom = list(config.bottom_layer_sizes)
        self.bottom: nn.Module = MLP(width, bottom, device=dense_device) if bottom else nn.Identity()
        """The shared bottom ``[B, I] → [B, G]``: what every task reads."""
        width = bottom[-1] if bottom else width
        self.experts = Experts(width, config.num_experts, list(config.expert_layer_sizes), device=dense_device) if config.num_experts else None
        """The optional MMoE layer's experts over the bottom's output ``[B, G] → [B, E, H]``."""
        self.gates = nn.ModuleDict({n: Gate(width, config.num_experts, device=dense_device) for n in names} if config.num_experts else {})
        width = config.expert_layer_sizes[-1] if config.num_experts else width
        self.towers = nn.ModuleDict({n: MLP(width, list(config.tower_layer_sizes), device=dense_device) for n in names})
        """Each task's tower MLP ``[B, G] → [B, H_t]``."""
        self.relation_mlps, self.heads = self._relations_and_heads(config, dense_device)
        self.output_widths = {t.name: t.output_width for t in self.tasks}
        """Each task's output width: 1 (a logit, squeezed to ``[B]``) or a multi-class task's ``C``."""

    def _relations_and_heads(self, config: DBMTLConfig, device: torch.device | None) -> tuple[nn.ModuleDict, nn.ModuleDict]:
        """A relation MLP per task with dependencies (reading its tower's output and its dependencies' hidden vectors),
        and each task's final layer over its hidden vector: one logit, or a multi-class task's ``C`` (``Task.output_width``)."""
        tower, relation = config.tower_layer_sizes[-1], config.relation_layer_sizes[-1]
        hidden = {n: relation if self.dependencies[n] else tower for n in self.order}
        relation_mlps = nn.ModuleDict({n: MLP(tower + sum(hidden[d] for d in deps), list(config.relation_layer_sizes), device=device)
                                       for n, deps in self.dependencies.items() if deps})
        widths = {t.name: t.output_width for t in self.tasks}
        heads = nn.ModuleDict({n: nn.Linear(hidden[n], widths[n], device=device) for n in config.tasks})
        return relation_mlps, heads

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        shared = self.bottom(torch.cat([self.sparse_arch(sparse), dense], dim=1))
        experts = self.experts(shared) if self.experts is not None else None
        hidden: dict[str, torch.Tensor] = {}
        for name in self.order:
            h = self.towers[name](shared if experts is None else self.gates[name](shared, experts))
            if name in self.relation_mlps:
                h = self.relation_mlps[name](torch.cat([h, *(hidden[d] for d in self.dependencies[name])], dim=1))
            hidden[name] = h
        return {name: _squeezed(head(hidden[name]), self.output_widths[name]) for name, head in self.heads.items()}


def _squeezed(logits: torch.Tensor, width: int) -> torch.Tensor:
    """A head's ``[B, 1]`` as ``[B]``; a multi-class head's ``[B, C]`` as is. The head's ``width`` decides, not
    ``logits.shape``: TorchRec's pipeline traces this forward, where a shape is symbolic (``tests/test_pipelines.py``)."""
    return logits.squeeze(1) if width == 1 else logits
