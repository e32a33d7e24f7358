"""Parts shared by every model, in TorchRec's style: small modules with a shape legend.

Shape legend: ``B`` batch size, ``F`` number of sparse features, ``D`` embedding dim,
``N`` number of dense features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError, require
from recsys_runner.features import FeatureSpec

__all__ = ["MLP", "SparseArch", "DenseArch", "Task", "TrainWrapper", "check_layer_sizes", "resolve_tasks", "SINGLE_TASK"]

TaskKind = Literal["binary", "regression", "retrieval"]
TASK_KINDS: tuple[str, ...] = ("binary", "regression")
"""Kinds a multi-task model's task may have: ``binary`` (BCE on 0/1 labels) or ``regression`` (MSE)."""


@dataclass(frozen=True, slots=True)
class Task:
    """What one model output is trained and evaluated as.

    A model with several outputs has a ``tasks`` attribute (a tuple of these, in output order) and
    returns ``{task.name: logits [B]}``; a model without one is a single ``binary`` task, unnamed.

    Attributes:
        name: metric-key prefix (``eval/<name>/auc``); ``None`` keeps the plain keys (``eval/auc``).
        kind: ``binary`` (BCE, metrics see ``sigmoid(logits)``), ``regression`` (MSE, metrics see the
            raw output) or ``retrieval`` (in-batch softmax over query×candidate scores ``[B, C]``;
            metrics see the scores and each query's positive index).
        column: the task's column in ``Batch.labels [B, T]``; ``None`` when labels are ``[B]``.
        weight: the task's weight in the summed loss.
        eval_metrics: the task's own eval metric names; ``None`` takes ``metrics.eval``.
        train_metrics: the task's own train metric names; ``None`` takes ``metrics.train``.
    """

    name: str | None
    kind: TaskKind = "binary"
    column: int | None = None
    weight: float = 1.0
    eval_metrics: tuple[str, ...] | None = None
    train_metrics: tuple[str, ...] | None = None


SINGLE_TASK = (Task(None),)
"""The task of every model without a ``tasks`` attribute: one unnamed binary output ``[B]``."""


def resolve_tasks(features: FeatureSpec, names: list[str], loss_weights: list[float] | None, kinds: list[str] | None) -> tuple[Task, ...]:
    """Tasks ``names`` bound to their label columns in the data.

    Args:
        features: the data's schema; its ``label_names`` are the tasks it has labels for.
        names: the model's task names (``model.tasks``).
        loss_weights: one weight per task, or ``None`` for all 1.
        kinds: one kind per task (``binary`` / ``regression``), or ``None`` for all binary.

    Raises:
        ConfigError: a task has no label column in the data, or a list's length differs from ``names``.
    """
    weights = [1.0] * len(names) if loss_weights is None else list(loss_weights)
    task_kinds = ["binary"] * len(names) if kinds is None else list(kinds)
    require(len(weights) == len(names), f"model.loss_weights has {len(weights)} entries but model.tasks={list(names)} has "
            f"{len(names)}. Fix: give one weight per task, e.g. model.loss_weights=[{','.join(['1.0'] * len(names))}]")
    require(len(task_kinds) == len(names), f"model.task_kinds has {len(task_kinds)} entries but model.tasks={list(names)} "
            f"has {len(names)}. Fix: give one kind ({'/'.join(TASK_KINDS)}) per task, or model.task_kinds=null")
    labels = features.label_names
    missing = [n for n in names if n not in labels]
    if missing or not features.multi_label:
        raise ConfigError(
            f"model.tasks={list(names)}: task(s) {missing or list(names)} have no label column; the data's label(s): "
            f"{list(labels)}{'' if features.multi_label else ' (a single [B] label)'}. Fix: name tasks after the data's "
            f"labels, or give the data one label per task (data.tasks=[...] for synthetic data, data.labels={{task: column}} "
            f"for Parquet/CSV)"
        )
    return tuple(
        Task(n, kind=k, column=labels.index(n), weight=float(w),  # type: ignore[arg-type]
             eval_metrics=("mse", "mae") if k == "regression" else None, train_metrics=("mse",) if k == "regression" else None)
        for n, k, w in zip(names, task_kinds, weights, strict=True)
    )



def check_layer_sizes(name: str, sizes: list[int]) -> None:
    """Validate an MLP's layer sizes from config (non-empty, all positive)."""
    require(len(sizes) > 0, f"model.{name} must list at least one layer size, e.g. model.{name}=[64,16]")
    require(all(s > 0 for s in sizes), f"model.{name}={sizes} has a non-positive layer size")


class SparseArch(nn.Module):
    """Embeds every sparse feature: ``KeyedJaggedTensor → [B, F, D]``.

    The EmbeddingBagCollection is created on ``meta``: no memory is spent until
    DistributedModelParallel materializes each shard on the rank that owns it.

    Args:
        features: the data's feature schema; one table ``t_<feature>`` per sparse feature.
        embedding_dim: ``D``, shared by all tables so the interaction arches can combine them.
    """

    def __init__(self, features: FeatureSpec, embedding_dim: int) -> None:
        super().__init__()
        features.require_uniform_dim(embedding_dim, "DeepFM/DLRM (their interaction arches)")
        self.ebc = EmbeddingBagCollection(
            tables=features.embedding_tables(embedding_dim), device=torch.device("meta")
        )
        self.feature_names = features.sparse_names

    def forward(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(sparse).to_dict()
        return torch.stack([pooled[name] for name in self.feature_names], dim=1)


class DenseArch(nn.Module):
    """MLP over the dense features: ``[B, N] → [B, layer_sizes[-1]]``."""

    def __init__(self, in_features: int, layer_sizes: list[int], device: torch.device | None = None) -> None:
        super().__init__()
        self.mlp = MLP(in_features, layer_sizes, bias=True, activation="relu", device=device)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(dense)


class TrainWrapper(nn.Module):
    """Adapts a ``(dense, sparse) → output`` model to TorchRec's train pipelines.

    A TrainPipeline calls ``model(batch)`` and expects ``(loss, output)``; this wrapper computes the
    loss of the model's tasks (:class:`Task`) and returns detached ``(loss, logits, labels)`` for
    metrics:

    * a single-task model (no ``tasks`` attribute): BCE; ``logits [B]``, ``labels [B]``;
    * a multi-task model (``tasks``, returning ``{task: logits [B]}``): the ``weight``-ed sum of each
      task's BCE or MSE; ``logits [B, T]`` in task order, ``labels [B, T]`` in the same order;
    * a retrieval model (one ``retrieval`` task, returning scores ``[B, C]`` whose positive for
      query ``b`` is candidate ``b``): softmax cross-entropy; ``logits [B, C]``, ``labels`` the
      positive indices ``[B]``.

    The dense forward runs under the precision policy's autocast; the loss is always computed in float32.

    Raises:
        ConfigError: a single-task model is given data with several labels.
    """

    _columns: torch.Tensor
    _weights: torch.Tensor
    _binary: torch.Tensor

    def __init__(self, model: nn.Module, autocast: torch.autocast | None = None, features: FeatureSpec | None = None) -> None:
        super().__init__()
        self.model = model
        self._autocast_args = None if autocast is None else (autocast.device, autocast.fast_dtype)
        self.tasks: tuple[Task, ...] = tuple(getattr(model, "tasks", SINGLE_TASK))
        self._multi = self.tasks[0].name is not None and self.tasks[0].kind != "retrieval"
        self._retrieval = self.tasks[0].kind == "retrieval"
        if features is not None and features.multi_label and not (self._multi or self._retrieval):
            raise ConfigError(
                f"{type(model).__name__} has one output but the data has labels {list(features.label_names)}. Fix: a "
                f"multi-task model (model=mmoe), or single-label data (data.tasks=null / data.label=<column>)"
            )
        self.loss_fn = nn.BCEWithLogitsLoss()
        if self._multi:
            self.register_buffer("_columns", torch.tensor([t.column for t in self.tasks]), persistent=False)
            self.register_buffer("_weights", torch.tensor([t.weight for t in self.tasks]), persistent=False)
            self.register_buffer("_binary", torch.tensor([t.kind == "binary" for t in self.tasks]), persistent=False)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if self._autocast_args is None:
            out = self.model(batch.dense_features, batch.sparse_features)
        else:
            device, dtype = self._autocast_args
            with torch.autocast(device_type=device, dtype=dtype):
                out = self.model(batch.dense_features, batch.sparse_features)
        if self._multi:
            return self._multi_task(out, batch.labels)
        logits = out.float()
        if self._retrieval:
            labels = torch.arange(logits.shape[0], device=logits.device)
            loss = nn.functional.cross_entropy(logits, labels)
            return loss, (loss.detach(), logits.detach(), labels)
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())

    def _multi_task(self, out: dict[str, torch.Tensor], labels: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Weighted per-task losses: ``{task: [B]}`` and labels ``[B, T_data]`` → loss, ``[B, T]``, ``[B, T]``."""
        logits = torch.stack([out[t.name] for t in self.tasks], dim=1).float()  # type: ignore[index]
        targets = labels.float().index_select(1, self._columns)
        bce = nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none").mean(0)
        mse = (logits - targets).pow(2).mean(0)
        loss = (torch.where(self._binary, bce, mse) * self._weights).sum()
        return loss, (loss.detach(), logits.detach(), targets.detach())
