"""The hidden world of ``data=synthetic``: what each row's labels depend on, drawn once from the seed.

A :class:`World` holds per-id effects for each categorical feature, weights for the dense features and one dense×sparse
interaction; a row's click probability is the sigmoid of its score, and its label a Bernoulli draw, so a model that
learns the world reaches an AUC far above 0.5 and one that learns nothing stays at 0.5. With several tasks,
:class:`TaskLabels` draws each task's label: the click first, then a conversion funnel like Taobao's (each later task
with a world of its own, positive only on a clicked row), a ``regression`` task's amount, a ``multiclass`` task's class
(:func:`class_index`). :mod:`recsys_runner.data.generated.synthetic` draws the rows they score.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class World:
    """The hidden ground truth that labels are drawn from."""

    id_effects: list[torch.Tensor]
    dense_weights: torch.Tensor
    bias: float
    scale: float
    flat_effects: torch.Tensor = field(init=False)
    """``id_effects`` end to end, so that a batch's effects are one gather (a quarter of a batch's cost was 26 of them)."""
    offsets: torch.Tensor = field(init=False)
    """Where each column's effects start in ``flat_effects``, ``[F]``."""

    def __post_init__(self) -> None:
        sizes = torch.tensor([0] + [len(e) for e in self.id_effects[:-1]], dtype=torch.long)
        object.__setattr__(self, "flat_effects", torch.cat(self.id_effects) if self.id_effects else torch.zeros(0))
        object.__setattr__(self, "offsets", sizes.cumsum(0))

    @staticmethod
    def draw(seed: int, num_dense: int, sizes: list[int], scale: float, bias: float = -1.1) -> World:
        g = torch.Generator().manual_seed(seed)
        # Each categorical column carries a little signal; together they carry about as much as
        # the dense columns, so both halves of a model have something to learn.
        per_feature = 1.2 / max(len(sizes), 1) ** 0.5
        effects = [torch.randn(n, generator=g) * per_feature for n in sizes]
        dense_w = torch.randn(num_dense, generator=g) * (1.0 / max(num_dense, 1) ** 0.5)
        return World(effects, dense_w, bias=bias, scale=scale)

    def score(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        sparse = self.flat_effects[ids + self.offsets].sum(1)
        linear = dense @ self.dense_weights if dense.shape[1] else torch.zeros(dense.shape[0])
        # A dense×sparse interaction that a purely additive model cannot capture.
        cross = dense[:, 0] * self.id_effects[0][ids[:, 0]] if dense.shape[1] else 0.0
        return self.scale * (self.bias + linear + sparse + cross)


@dataclass(frozen=True)
class TaskLabels:
    """The labels of a multi-task batch, one per task: the first task's from the click world's score, each later task's
    from its own world, a conversion observed only on clicked rows (the funnel)."""

    worlds: list[World]
    """The later tasks' worlds: their own seeds, a higher base rate (conversion given a click)."""
    kinds: list[str]
    """Per task: ``binary``, ``regression`` or ``multiclass``."""
    classes: list[int]
    """Per task: its number of classes when ``multiclass``, else 0."""
    conflict: float
    """``conversion_conflict``: how strongly each later task's score falls with the click's."""
    amount: float | None
    """``conversion_amount``: a later ``regression`` task's label as a purchase amount on the converting rows."""
    truth: bool = False
    """``conversion_truth``: one more column after the tasks', the first later task's conversion draw on every row (would
    it convert if clicked), the ground truth of CVR over all impressions."""

    def labels(self, click: torch.Tensor, score: torch.Tensor, dense: torch.Tensor, ids: torch.Tensor,
               g: torch.Generator) -> list[torch.Tensor]:
        """Each task's label ``[B]``: the click, then the funnel's conversions; a ``regression`` task's is ``softplus(score_t)``,
        or with ``conversion_amount`` an amount on the converting rows; with :attr:`truth`, then the first conversion's draw
        before the click gates it."""
        first = {"binary": click, "multiclass": class_index(score, self.classes[0] if self.classes else 0, g)}
        columns = [first.get(self.kinds[0], F.softplus(score))]
        draws: list[torch.Tensor] = []
        for world, kind, classes in zip(self.worlds, self.kinds[1:], self.classes[1:], strict=True):
            task_score = world.score(dense, ids) - self.conflict * score if self.conflict else world.score(dense, ids)
            if kind == "multiclass":
                columns.append(class_index(task_score, classes, g))
                continue
            if kind != "binary" and self.amount is None:
                columns.append(F.softplus(task_score))
                continue
            draws.append(torch.bernoulli(torch.sigmoid(task_score), generator=g))
            converted = click * draws[-1]
            columns.append(converted if self.amount is None or kind == "binary" else converted * self.amount * (1 + F.softplus(task_score)))
        return [*columns, draws[0]] if self.truth else columns


def class_index(score: torch.Tensor, classes: int, g: torch.Generator) -> torch.Tensor:
    """A multiclass label ``[B]`` (float class indices ``0..classes-1``): the ``classes`` quantiles of
    ``sigmoid(score + logistic noise)``, so a row's class rises with its score; zeros (no draw) when the task is not multiclass."""
    if classes < 2:
        return score.new_zeros(score.shape)
    u = torch.rand(score.shape, generator=g, dtype=score.dtype).clamp(1e-6, 1 - 1e-6)
    noisy = torch.sigmoid(score + torch.log(u / (1 - u)))
    return (noisy * classes).floor().clamp(max=classes - 1)
