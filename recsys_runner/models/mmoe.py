"""MMoE (Ma et al., 2018, "Modeling Task Relationships in Multi-task Learning with Multi-gate
Mixture-of-Experts", https://dl.acm.org/doi/10.1145/3219819.3220007) on TorchRec.

The embedded sparse features and the dense features are concatenated into one input ``x``. ``E``
expert MLPs all read ``x``; each task ``t`` has a softmax gate over the experts, mixes their
outputs with it, and feeds the mixture to its own tower, which ends in one logit. Tasks therefore
share what helps them all and keep apart what does not.

Shape legend: ``B`` batch, ``F`` sparse features, ``D`` embedding dim, ``N`` dense features,
``E`` experts, ``H`` expert output width, ``T`` tasks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.features import FeatureSpec, check_embedding_dim
from recsys_runner.models.common import SparseArch, check_layer_sizes, require_count
from recsys_runner.models.multitask import Experts, Gate, MultiTaskConfig, Tower


@dataclass(kw_only=True)
class MMoEConfig(MultiTaskConfig):
    """Schema of ``conf/model/mmoe.yaml``."""

    _target_: str = "recsys_runner.models.mmoe.MMoE"
    embedding_dim: int = 16
    """Width ``D`` of every embedding table whose feature sets no ``embedding_dim`` of its own in ``data.sparse``
    (this model accepts mixed per-feature widths)."""
    num_experts: int = 4
    """``E``: expert MLPs shared by all tasks."""
    expert_layer_sizes: list[int] = field(default_factory=lambda: [128, 64])
    """Layers of each expert; the last is the width ``H`` the gates mix."""
    tower_layer_sizes: list[int] = field(default_factory=lambda: [32])
    """Hidden layers of each task's tower (a final layer is added: 1 unit, or ``C`` for a multiclass task)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        require_count(self, "num_experts", 1)
        check_layer_sizes("expert_layer_sizes", self.expert_layer_sizes)
        check_layer_sizes("tower_layer_sizes", self.tower_layer_sizes)


class MMoE(nn.Module):
    """MMoE: shared experts, a gate and a tower per task; ``(dense [B, N], sparse KJT) → {task: logits [B]}``.

    ``tasks`` (:class:`~recsys_runner.tasks.Task` objects, in output order: :class:`~recsys_runner.tasks.BinaryTask` or
    :class:`~recsys_runner.tasks.RegressionTask`) tells the TrainWrapper each task's label column, loss and weight.

    Args:
        config: its hyperparameters (:class:`MMoEConfig`: ``embedding_dim`` ``D``, the task names with their
            ``loss_weights`` / ``task_kinds`` (``None``: 1 / binary), ``num_experts``, ``expert_layer_sizes``,
            ``tower_layer_sizes``).
        features: the data's feature schema; it must carry a label per task.
        dense_device: device of the dense parameters (embeddings start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.mmoe import MMoE, MMoEConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50, tasks=["ctr", "cvr"]).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> model = materialize(MMoE(MMoEConfig(embedding_dim=8, tasks=["ctr", "cvr"], num_experts=2, expert_layer_sizes=[16],
        ...                                     tower_layer_sizes=[8]), features=data.features))
        >>> {task: logits.shape for task, logits in model(batch.dense_features, batch.sparse_features).items()}
        {'ctr': torch.Size([8]), 'cvr': torch.Size([8])}
    """

    shared_module: ClassVar[str] = "experts"
    """The representation every task reads (``[B, E, H]``, the experts' outputs): Pareto weighting takes each task's
    gradient with respect to it (``train.loss_weighting``)."""
    same_embedding_width: ClassVar[str | None] = None
    """None: the experts and gates read the concatenated embeddings, so each feature may have its own width."""

    def __init__(self, config: MMoEConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        num_experts, expert_layer_sizes = config.num_experts, config.expert_layer_sizes
        names = list(config.tasks)  # the tasks' names, in output order
        self.tasks = config.resolve_tasks(features)
        self.sparse_arch = SparseArch(features, config.embedding_dim, type(self))
        in_features = self.sparse_arch.output_dim + features.num_dense
        self.experts = Experts(in_features, num_experts, list(expert_layer_sizes), device=dense_device)
        self.gates = nn.ModuleDict({name: Gate(in_features, num_experts, device=dense_device) for name in names})
        widths = {t.name: t.output_width for t in self.tasks}
        self.towers = nn.ModuleDict({name: Tower(expert_layer_sizes[-1], list(config.tower_layer_sizes), device=dense_device,
                                                      out_width=widths[name]) for name in names})

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        x = torch.cat([self.sparse_arch(sparse), dense], dim=1)
        experts = self.experts(x)
        return {name: self.towers[name](gate(x, experts)) for name, gate in self.gates.items()}
