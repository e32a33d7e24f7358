"""The hidden world of ``data=synthetic``: what each row's labels depend on, drawn once from the seed.

A :class:`World` holds per-id effects for each categorical feature, weights for the dense features and one dense×sparse
interaction; a row's click probability is the sigmoid of its score, and its label a Bernoulli draw, so a model that
learns the world reaches an AUC far above 0.5 and one that learns nothing stays at 0.5. With several tasks, each later
task has a world of its own, whose scores :class:`~recsys_runner.data.generated.synthetic_labels.TaskLabels` turns into
the funnel's labels. :mod:`recsys_runner.data.generated.synthetic` draws the rows they score.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
