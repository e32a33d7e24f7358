"""ESMM (Ma, Zhao, Huang, Wang, Hu, Zhu, Gai, 2018, "Entire Space Multi-Task Model: An Effective Approach for Estimating
Post-Click Conversion Rate", https://arxiv.org/abs/1804.07931) on TorchRec.

A conversion is only observed after a click, so a CVR model fitted on clicked rows learns from a sample the clicks
selected, and is then asked to score every impression (sample selection bias), from far fewer rows than the CTR model
(data sparsity). ESMM never fits CVR on its own: a CTR tower and a CVR tower read the same embeddings, and
``pCTCVR = pCTR × pCVR`` is trained against the click∧conversion label over every impression, beside ``pCTR`` against
the click. The CVR tower gets its gradient only through that product.

Outputs, one logit ``[B]`` per task (:class:`~recsys_runner.tasks.BinaryTask`, BCE-with-logits):

* ``ctr``: the CTR tower, against the click, on every row (weight ``ctr_weight``);
* ``cvr``: the CVR tower, against the conversion on clicked rows only (``only_where_positive`` the click), weight
  ``cvr_weight``, 0 by default: ESMM's CVR is not fitted there, but ``eval/cvr/auc`` is the CVR AUC over clicked rows;
* ``ctcvr``: ``logit(σ(a)·σ(b))`` of the two towers' logits ``a``, ``b`` (:func:`product_logit`, in log space), against
  the conversion label (positive only on clicked rows: click∧conversion), on every row (weight ``ctcvr_weight``);
* ``cvr_all``, when the data has ``conversion_truth``'s column: the CVR tower against whether each impression would
  convert if clicked, weight 0 (eval only): the CVR AUC over all impressions, which ESMM is for.

Shape legend: ``B`` batch, ``F`` sparse features, ``D_f`` feature ``f``'s embedding width, ``N`` dense features, ``I``
the towers' input width ``ΣD_f + N``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError, DataError, require
from recsys_runner.features import DataNeeds, FeatureSpec, check_embedding_dim
from recsys_runner.models.common import ModelConfig, SparseArch, check_layer_sizes
from recsys_runner.models.multitask import Tower
from recsys_runner.task_specs import TaskSpec, resolve_tasks
from recsys_runner.tasks import BinaryTask, Task

__all__ = ["ESMMConfig", "ESMM", "ConversionTask", "product_logit", "WITHOUT_CLICK"]

WITHOUT_CLICK = ("error", "and")
"""``model.conversion_without_click``: what a row with a conversion but no click does (see :class:`ESMMConfig`)."""


@dataclass(kw_only=True)
class ESMMConfig(ModelConfig):
    """Schema of ``conf/model/esmm.yaml``."""

    _target_: str = "recsys_runner.models.esmm.ESMM"
    embedding_dim: int = 16
    """Width ``D`` of every embedding table whose feature sets no ``embedding_dim`` of its own in ``data.sparse`` (the
    towers read the concatenated embeddings, so widths may differ); the paper's 18, rounded to fbgemm's multiple of 4."""
    tower_layer_sizes: list[int] = field(default_factory=lambda: [360, 200, 80])
    """Hidden layers of each tower (CTR and CVR; each then ends in one logit): the paper's 360-200-80."""
    click_label: str = "ctr"
    """The data's click label column (0/1 on every impression)."""
    conversion_label: str = "cvr"
    """The data's conversion label column, positive only on clicked rows: the CTCVR label (``data=synthetic``'s ``cvr``,
    Taobao's buy). On clicked rows it is the CVR label."""
    ctr_weight: float = 1.0
    """Weight of the ``ctr`` loss (click, every row)."""
    ctcvr_weight: float = 1.0
    """Weight of the ``ctcvr`` loss (``pCTR × pCVR`` against click∧conversion, every row): ESMM's CVR signal."""
    cvr_weight: float = 0.0
    """Weight of the ``cvr`` loss (the CVR tower against the conversion on clicked rows only). 0: ESMM; with
    ``ctcvr_weight=0`` and this 1 the same towers are the naive CVR model fitted on clicked rows (the baseline of
    docs/multitask.md's learning test)."""
    conversion_truth: str | None = "cvr_if_clicked"
    """A label column saying, for every impression, whether it would convert if clicked (``data=synthetic_esmm`` writes
    it; logged data has none): when the data has it, the eval-only task ``cvr_all`` (loss weight 0, no train metrics)
    scores the CVR tower against it on every row, ``eval/cvr_all/auc``. Data without it gets no such task; ``null``:
    never."""
    conversion_without_click: str = "error"
    """A row whose conversion label is positive but whose click is 0 (a funnel ESMM's product cannot fit):
    ``error`` stops with a :class:`~recsys_runner.errors.DataError`: files declare the funnel (``data.funnel``, from
    :meth:`data_needs`) and name the file, row and both columns of the first such row as it is read; every batch is also
    checked, train and eval, on the host as it is read, before its copy to the device (no host sync in the step), naming
    how many of its rows; ``and`` trains and evaluates ``ctcvr`` on click∧conversion (such rows count as not converted),
    unchecked."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        check_layer_sizes("tower_layer_sizes", self.tower_layer_sizes)
        require(self.click_label != self.conversion_label,
                f"model.click_label and model.conversion_label are both {self.click_label!r}; ESMM needs two labels, the click "
                f"and the conversion. Fix: e.g. model.click_label=ctr model.conversion_label=cvr")
        require(self.conversion_truth not in (self.click_label, self.conversion_label),
                f"model.conversion_truth={self.conversion_truth!r} is a training label; it names the eval-only column of "
                f"whether each impression would convert if clicked. Fix: model.conversion_truth=cvr_if_clicked, or null")
        weights = {"ctr_weight": self.ctr_weight, "ctcvr_weight": self.ctcvr_weight, "cvr_weight": self.cvr_weight}
        negative = {k: v for k, v in weights.items() if v < 0}
        require(not negative, f"model.{', model.'.join(negative)} must be >= 0, got {', '.join(map(str, negative.values()))}. Fix: e.g. "
                              f"model.{next(iter(negative), '')}=0 (that loss off)")
        require(self.ctcvr_weight > 0 or self.cvr_weight > 0,
                "model.ctcvr_weight=0 and model.cvr_weight=0: the CVR tower would get no gradient. Fix: model.ctcvr_weight=1 "
                "(ESMM), or model.cvr_weight=1 with model.ctcvr_weight=0 (the naive CVR model on clicked rows)")
        require(self.conversion_without_click in WITHOUT_CLICK,
                f"model.conversion_without_click={self.conversion_without_click!r} must be one of {list(WITHOUT_CLICK)}")

    def data_needs(self) -> DataNeeds:
        """Two binary labels: the click, then the conversion (generated data draws a funnel: a conversion only on a
        clicked row); with ``conversion_without_click=error`` the funnel, which files check row by row as they are read
        (``data.funnel``: naming the file, row and columns before the batch reaches the model)."""
        return DataNeeds(labels=(self.click_label, self.conversion_label), label_kinds=("binary", "binary"),
                         label_classes=(0, 0),
                         funnel=(self.click_label, self.conversion_label) if self.conversion_without_click == "error" else ())

    def resolve_tasks(self, features: FeatureSpec) -> tuple[Task, ...]:
        """``ctr``, ``cvr`` (masked by the click), ``ctcvr`` (a :class:`ConversionTask`) and, when the data has
        :attr:`conversion_truth`, ``cvr_all``, bound to the data's columns.

        Raises:
            ConfigError: the data lacks the click or the conversion label, naming both keys and the fix.
        """
        labels = list(features.label_names) if features.multi_label else []
        missing = [f"model.{key}={name!r}" for key, name in (("click_label", self.click_label), ("conversion_label", self.conversion_label))
                   if name not in labels]
        if missing:
            raise ConfigError(
                f"ESMM trains on a click label and a conversion label, but the data has no {' and no '.join(missing)}; its "
                f"label(s): {list(features.label_names)}{'' if features.multi_label else ' (a single [B] label)'}. Fix: name the "
                f"data's click and conversion columns (model.click_label=<click> model.conversion_label=<conversion>), or give "
                f"the data both: data.labels={{{self.click_label}: <click column>, {self.conversion_label}: <conversion column>}} "
                f"for Parquet/CSV, data.tasks=[{self.click_label},{self.conversion_label}] (or null) for synthetic data")
        names = ["ctr", "cvr", "ctcvr"]
        specs = {"ctr": TaskSpec(label=self.click_label, weight=self.ctr_weight),
                 "cvr": TaskSpec(label=self.conversion_label, weight=self.cvr_weight, only_where_positive="ctr"),
                 "ctcvr": TaskSpec(label=self.conversion_label, weight=self.ctcvr_weight)}
        if self.conversion_truth is not None and self.conversion_truth in labels:
            names.append("cvr_all")
            specs["cvr_all"] = TaskSpec(label=self.conversion_truth, weight=0.0, train_metrics=[])
        tasks = resolve_tasks(features, names, None, None, specs)
        click = labels.index(self.click_label)
        return tuple(ConversionTask(t.name, column=t.column, weight=t.weight, label=t.label, click_column=click,
                                    click_label=self.click_label, without_click=self.conversion_without_click) if t.name == "ctcvr" else t for t in tasks)


def checked_funnel(conversion: Tensor, click: Tensor, label: str, click_label: str, batch: str = "batch") -> Tensor:
    """``conversion`` unchanged when it is positive only where ``click`` is. ``batch`` says which (``training batch`` /
    ``eval batch``): the eval data is its own files (``data.eval_path``) or rows held out of the training files.

    Raises:
        DataError: some row converts without a click, naming how many of the batch's rows, which batch, both columns
            and the fix.
    """
    bad = (conversion > 0) & (click <= 0)
    if bool(bad.any()):
        count = int(bad.sum())
        data = {"training batch": " in the training data (data.path)",
                "eval batch": " in the eval data (data.eval_path, else the rows data.eval_fraction holds out of data.path)"}
        raise DataError(f"ESMM: {count} of this {batch}'s {conversion.shape[0]} rows have the conversion label {label!r} positive "
                        f"where the click {click_label!r} is 0; ESMM's pCTCVR = pCTR x pCVR cannot fit a conversion without a "
                        f"click. Fix the labels{data.get(batch, '')} (a conversion is counted only after a click), or set "
                        f"model.conversion_without_click=and to train on click AND conversion (those rows then count as not converted)")
    return conversion


@dataclass(frozen=True, slots=True)
class ConversionTask(BinaryTask):
    """ESMM's ``ctcvr``: a binary task on the conversion label that also reads the click column (``click_column`` of
    ``Batch.labels``), because its target is click∧conversion: with ``without_click="error"`` a conversion without a
    click is a :class:`~recsys_runner.errors.DataError` (:func:`checked_funnel`, on the host: :meth:`check_labels`) and
    the target is the conversion, with ``"and"`` the target is ``conversion · [click > 0]``."""

    click_column: int = 0
    click_label: str = ""
    """The click column's name, for the error message."""
    without_click: str = "error"

    @property
    def checks_labels(self) -> bool:
        return self.without_click == "error" or self.weight_column is not None

    def check_labels(self, labels: Tensor, batch: str = "batch") -> None:
        if self.without_click == "error":
            checked_funnel(labels[:, self.column], labels[:, self.click_column], str(self.label), self.click_label, batch)

    def targets(self, output: Tensor, labels: Tensor) -> Tensor:
        conversion, click = labels[:, self.column], labels[:, self.click_column]
        if self.without_click == "and":
            return conversion * (click > 0).to(conversion.dtype)
        return conversion


def product_logit(a: Tensor, b: Tensor) -> Tensor:
    """``logit(σ(a)·σ(b))`` from the logits ``a``, ``b`` ``[B]``, in log space: ``log p = logσ(a) + logσ(b)`` and
    ``log(1 − p) = log(σ(−a) + σ(a)·σ(−b)) = logaddexp(logσ(−a), logσ(a) + logσ(−b))`` (``1 − σ(a)σ(b)`` split exactly),
    so the logit ``log p − log(1 − p)`` is finite with finite gradients for any finite ``a``, ``b``. Neither ``log`` of a
    product of probabilities (``log 0`` once both underflow) nor ``log(−expm1(log p))`` (which needs a clamp as
    ``log p → 0``, when both towers are sure) would be."""
    log_a, log_b = F.logsigmoid(a), F.logsigmoid(b)
    return log_a + log_b - torch.logaddexp(F.logsigmoid(-a), log_a + F.logsigmoid(-b))


class ESMM(nn.Module):
    """ESMM: a CTR and a CVR tower over shared embeddings, ``pCTCVR = pCTR × pCVR``;
    ``(dense [B, N], sparse KJT) → {ctr, cvr, ctcvr[, cvr_all]: logits [B]}``.

    ``tasks`` (:class:`~recsys_runner.tasks.Task` objects, in output order) tells the TrainWrapper each output's label
    column, loss weight and mask (module docstring); the model itself is the two towers and the product.

    Args:
        config: its hyperparameters (:class:`ESMMConfig`: ``embedding_dim`` ``D``, ``tower_layer_sizes``, the click and
            conversion labels, the loss weights, ``conversion_truth``, ``conversion_without_click``).
        features: the data's feature schema; it must carry the click and the conversion label.
        dense_device: device of the dense parameters (embeddings start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.esmm import ESMM, ESMMConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50, tasks=["ctr", "cvr"]).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> model = materialize(ESMM(ESMMConfig(embedding_dim=8, tower_layer_sizes=[16]), features=data.features))
        >>> {task: logits.shape for task, logits in model(batch.dense_features, batch.sparse_features).items()}
        {'ctr': torch.Size([8]), 'cvr': torch.Size([8]), 'ctcvr': torch.Size([8])}
    """

    same_embedding_width: ClassVar[str | None] = None
    """None: the towers read the concatenated embeddings, so each feature may have its own width."""

    def __init__(self, config: ESMMConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.tasks = config.resolve_tasks(features)
        self.sparse_arch = SparseArch(features, config.embedding_dim, type(self))
        """The embeddings both towers read: the CVR tower learns its features from every impression through them."""
        width = self.sparse_arch.output_dim + features.num_dense
        self.ctr_tower = Tower(width, list(config.tower_layer_sizes), device=dense_device)
        """``[B, I] → [B]``: the click logit ``a``."""
        self.cvr_tower = Tower(width, list(config.tower_layer_sizes), device=dense_device)
        """``[B, I] → [B]``: the conversion-given-click logit ``b``."""
        self.scores_all = any(t.name == "cvr_all" for t in self.tasks)
        """Whether the data has the would-convert column: the CVR logit is then also output as ``cvr_all``."""

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor) -> dict[str, Tensor]:
        x = torch.cat([self.sparse_arch(sparse), dense], dim=1)
        ctr, cvr = self.ctr_tower(x), self.cvr_tower(x)
        out = {"ctr": ctr, "cvr": cvr, "ctcvr": product_logit(ctr, cvr)}
        if self.scores_all:
            out["cvr_all"] = cvr
        return out
