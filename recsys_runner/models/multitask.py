"""What every multi-task model shares: its task list in config (:class:`MultiTaskConfig`) and the named parts
mixture-of-experts models are built from (:class:`Experts`, :class:`Gate`, :class:`Tower`).

MMoE, PLE and DBMTL subclass :class:`MultiTaskConfig`, so the task fields are declared, documented and
checked once; how the task losses are weighted is not the model's concern (``train/weighting.py``).

Shape legend: ``B`` batch, ``I`` input width, ``E`` experts, ``H`` expert output width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from recsys_runner.errors import require
from recsys_runner.features import DataNeeds, FeatureSpec
from recsys_runner.models.common import MLP, ModelConfig
from recsys_runner.task_specs import TaskSpec, check_task_specs, resolve_tasks, task_labels
from recsys_runner.tasks import LABEL_TASK_KINDS, TASK_KINDS, BinaryTask, Task

__all__ = ["MultiTaskConfig", "Experts", "Gate", "Tower"]


@dataclass(kw_only=True)
class MultiTaskConfig(ModelConfig):
    """The task fields of a multi-task model's config; a model's own config adds its hyperparameters."""

    tasks: list[str] = field(default_factory=lambda: ["ctr", "cvr"])
    """Task names, each with a label of the same name in the data (``data.tasks`` / ``data.labels``)."""
    loss_weights: list[float] | None = None
    """Weight of each task's loss in the sum (one per task); ``null``: all 1."""
    task_kinds: list[str] | None = None
    """``binary`` (BCE, metrics ``metrics.eval``), ``regression`` (MSE, metrics mse/mae), ``huber`` or ``multiclass`` (its
    ``num_classes`` in ``task_specs``) per task; ``null``: all binary."""
    task_specs: dict[str, Any] = field(default_factory=dict)
    """Per task, what the lists above do not say (docs/multitask.md): its data ``label`` column, ``kind``, ``weight``,
    ``huber_delta``, ``num_classes`` (a ``multiclass`` task's), ``eval_metrics``/``train_metrics``, a ``sample_weight`` column
    and ``only_where_positive`` (a mask: the loss and metrics only on rows where another task is positive), e.g.
    ``+model.task_specs.cvr.only_where_positive=ctr``, ``'+model.task_specs.category={kind: multiclass, num_classes: 5}'``."""

    def __post_init__(self) -> None:
        require(len(self.tasks) > 0 and len(set(self.tasks)) == len(self.tasks),
                f"model.tasks={self.tasks} must list distinct task names, e.g. model.tasks=[ctr,cvr]")
        if self.loss_weights is not None:
            require(len(self.loss_weights) == len(self.tasks),
                    f"model.loss_weights={self.loss_weights} has {len(self.loss_weights)} entries but model.tasks={self.tasks} "
                    f"has {len(self.tasks)}. Fix: one weight per task, or model.loss_weights=null")
            require(all(w >= 0 for w in self.loss_weights) and sum(self.loss_weights) > 0,
                    f"model.loss_weights={self.loss_weights} must be >= 0 and not all 0. Fix: e.g. model.loss_weights=null (all 1)")
        if self.task_kinds is not None:
            require(len(self.task_kinds) == len(self.tasks),
                    f"model.task_kinds={self.task_kinds} has {len(self.task_kinds)} entries but model.tasks={self.tasks} has "
                    f"{len(self.tasks)}. Fix: one kind per task, or model.task_kinds=null")
            wrong = [k for k in self.task_kinds if k not in LABEL_TASK_KINDS]
            require(not wrong, f"model.task_kinds has {wrong}; each must be one of {list(LABEL_TASK_KINDS)}")
        self.task_specs = {name: _task_spec(name, spec) for name, spec in self.task_specs.items()}
        check_task_specs(self.tasks, self.task_specs, self.task_kinds, self.loss_weights)

    def resolve_tasks(self, features: FeatureSpec) -> tuple[Task, ...]:
        """The model's tasks bound to the data's columns (:func:`recsys_runner.task_specs.resolve_tasks` of these fields):
        what a multi-task model sets as its ``tasks`` attribute, ``self.tasks = config.resolve_tasks(features)``."""
        return resolve_tasks(features, list(self.tasks), self.loss_weights, self.task_kinds, self.task_specs)

    def data_needs(self) -> DataNeeds:
        """A label per task (its ``label`` column), of the task's label kind (with a multi-class task's number of
        classes), and each sample-weight column (a positive amount): generated data (``data=synthetic``) draws them."""
        kinds = [TASK_KINDS[k].label_kind for k in (self.task_kinds or [BinaryTask.kind] * len(self.tasks))]
        by_column, classes, renamed = {}, {}, []
        for name, kind in zip(self.tasks, kinds, strict=True):
            spec = _task_spec(name, self.task_specs[name]) if name in self.task_specs else None
            column = (spec.label if spec else None) or name
            if column != name:
                renamed.append((name, column))
            by_column[column] = TASK_KINDS[spec.kind].label_kind if spec and spec.kind else kind
            classes[column] = spec.num_classes if spec and spec.num_classes else 0
        labels = task_labels(self.tasks, self.task_specs)
        return DataNeeds(labels=tuple(labels), label_kinds=tuple(by_column.get(c, "regression") for c in labels),
                         label_classes=tuple(classes.get(c, 0) for c in labels), task_label_columns=tuple(renamed))


def _task_spec(name: str, spec: Any) -> TaskSpec:
    """``model.task_specs.<name>`` as a :class:`TaskSpec` (a mapping from YAML or an override); a typo names the key."""
    if isinstance(spec, TaskSpec):
        return spec
    known = [f.name for f in fields(TaskSpec)]
    require(isinstance(spec, Mapping), f"model.task_specs.{name} must be a mapping of {known}, got {spec!r}")
    unknown = sorted(set(spec) - set(known))
    require(not unknown, f"model.task_specs.{name} has unknown key(s) {unknown}; valid: {known}")
    values: dict[str, Any] = {str(k): list(v) if isinstance(v, Sequence) and not isinstance(v, str) else v for k, v in spec.items()}
    return TaskSpec(**values)


class Experts(nn.Module):
    """``E`` independent MLPs over the same input: ``[B, I] → [B, E, H]``.

    Example::

        >>> import torch
        >>> from recsys_runner.models.multitask import Experts
        >>> Experts(in_features=5, num_experts=3, layer_sizes=[16, 8])(torch.randn(4, 5)).shape
        torch.Size([4, 3, 8])
    """

    def __init__(self, in_features: int, num_experts: int, layer_sizes: list[int], device: torch.device | None = None) -> None:
        super().__init__()
        self.experts = nn.ModuleList(MLP(in_features, layer_sizes, device=device) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([expert(x) for expert in self.experts], dim=1)


class Gate(nn.Module):
    """One task's mixture of the experts: softmax weights from the input, ``([B, I], [B, E, H]) → [B, H]``.

    Example::

        >>> import torch
        >>> from recsys_runner.models.multitask import Gate
        >>> gate = Gate(in_features=5, num_experts=3)
        >>> gate(torch.randn(4, 5), torch.randn(4, 3, 8)).shape   # the input, 3 experts' outputs → their mixture
        torch.Size([4, 8])
    """

    def __init__(self, in_features: int, num_experts: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.logits = nn.Linear(in_features, num_experts, device=device)

    def forward(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.logits(x), dim=1)
        return torch.bmm(weights.unsqueeze(1), experts).squeeze(1)


class Tower(nn.Module):
    """One task's head: an MLP ending in one logit, ``[B, H] → [B]``, or in ``out_width > 1`` (a multi-class task's
    ``Task.output_width``) logits, ``[B, H] → [B, out_width]``.

    Example::

        >>> import torch
        >>> from recsys_runner.models.multitask import Tower
        >>> Tower(in_features=8, layer_sizes=[16])(torch.randn(4, 8)).shape
        torch.Size([4])
        >>> Tower(in_features=8, layer_sizes=[16], out_width=5)(torch.randn(4, 8)).shape   # a 5-class task
        torch.Size([4, 5])
    """

    def __init__(self, in_features: int, layer_sizes: list[int], device: torch.device | None = None, out_width: int = 1) -> None:
        super().__init__()
        self.mlp = MLP(in_features, layer_sizes, device=device)
        self.out = nn.Linear(layer_sizes[-1], out_width, device=device)
        self.out_width = out_width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.out(self.mlp(x))
        return out.squeeze(1) if self.out_width == 1 else out  # the width is known here; a traced out.shape is not
