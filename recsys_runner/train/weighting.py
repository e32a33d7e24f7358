"""How a multi-task model's task losses are weighted: ``train.loss_weighting`` (fixed, uncertainty, Pareto).

The :class:`~recsys_runner.models.train_wrapper.TrainWrapper` owns the weighting (a
:class:`~recsys_runner.models.train_wrapper.TaskWeighting`), so learned log-variances are dense parameters that the dense
optimizer trains and the Pareto weights are buffers saved with the model; the step counter is saved per rank
(:class:`WeightingPosition`).

* ``fixed``: ``Σ_t w_t·L_t`` with the configured task weights (the default).
* ``uncertainty`` (Kendall, Gal & Cipolla, 2018): a learned log-variance ``s_t`` per task, ``Σ_t w_t·(exp(-s_t)·L_t + s_t)``:
  a task whose loss is large or noisy gets a small weight, and the ``+ s_t`` term keeps the weights from vanishing.
* ``pareto`` (MGDA-UB, Sener & Koltun, 2018; PE-LTR, Lin et al., 2019): every ``every_n_steps`` optimizer steps, the
  gradient of each task's loss with respect to the representation the tasks share (the model's ``shared_module``
  output) is taken with ``torch.autograd.grad`` (no parameter gradient, no embedding update), and the weights
  ``α`` with ``α_t >= min_weight_t``, ``Σ α_t = 1`` that minimise ``‖Σ_t α_t ∇L_t‖²`` are solved for (Frank–Wolfe on the
  ``T×T`` Gram matrix, on the device, no host sync); the loss is ``T·Σ_t α_t·L_t`` (equal weights are then 1 each, as
  fixed's default). With ``normalization: l2`` (or ``loss``) the problem is solved on the normalized gradients and the
  losses are weighted ``∝ α_t / n_t``, so the tasks reach the shared layers with gradients of comparable size. One combined backward follows, so the fused embedding tables take one update per micro-batch,
  along the weighted combination, exactly as with fixed weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from recsys_runner.errors import ConfigError, require
from recsys_runner.models.train_wrapper import TaskWeighting
from recsys_runner.tasks import Task

__all__ = ["KINDS", "LossWeightingConfig", "ParetoWeighting", "UncertaintyWeighting", "WeightingPosition", "min_norm_weights"]

KINDS = ("fixed", "uncertainty", "pareto")
NORMALIZATIONS = ("none", "l2", "loss")


@dataclass(kw_only=True)
class LossWeightingConfig:
    """``train.loss_weighting``: how the task losses of a multi-task model are combined (docs/multitask.md)."""

    kind: str = "fixed"
    """``fixed`` (the task weights), ``uncertainty`` (learned log-variance per task) or ``pareto`` (min-norm combination of
    the task gradients on the shared representation, MGDA-UB / PE-LTR)."""
    every_n_steps: int = 1
    """``pareto``: solve for the weights every this many optimizer steps (at a step's first micro-batch) and keep them
    in between."""
    min_weight: float = 0.0
    """``pareto``: the least weight of every task, as a share of the sum (at most ``1/num_tasks``)."""
    min_weights: dict[str, float] = field(default_factory=dict)
    """``pareto``: per-task least weights that override ``min_weight``, e.g. ``{cvr: 0.2}``."""
    normalization: str = "none"
    """``pareto``: how each task's gradient ``g_t`` is normalized before solving: ``none`` (MGDA-UB as published: the task with
    the smaller gradient gets the larger weight), ``l2`` (unit norm: the tasks then reach the shared layers with gradients
    of comparable size) or ``loss`` (divided by the task's loss); the loss weights are then ``α_t / n_t``, rescaled to sum
    to ``T``."""
    init_log_variance: float | None = None
    """``uncertainty``: the log-variances' start value (0: every weight starts at its task weight); ``null``: each task's
    ``log`` of its first training loss, so every weighted loss starts at 1 and no task's early gradients dominate the
    optimizer's state (Adagrad's accumulators keep them)."""

    def __post_init__(self) -> None:
        require(self.kind in KINDS, f"train.loss_weighting.kind={self.kind!r} must be one of {list(KINDS)}")
        require(self.every_n_steps > 0, f"train.loss_weighting.every_n_steps must be positive, got {self.every_n_steps}")
        require(self.normalization in NORMALIZATIONS,
                f"train.loss_weighting.normalization={self.normalization!r} must be one of {list(NORMALIZATIONS)}")
        floors = {"min_weight": self.min_weight, **{f"min_weights.{k}": v for k, v in self.min_weights.items()}}
        bad = [f"{k}={v}" for k, v in floors.items() if not 0 <= v <= 1]
        require(not bad, f"train.loss_weighting.{', '.join(bad)}: a minimum weight is a share of the sum, in [0, 1/num_tasks]")

    def build(self, tasks: tuple[Task, ...], accumulation_steps: int = 1) -> TaskWeighting | None:
        """The weighting of ``tasks`` (``None`` for ``fixed``: the TrainWrapper's own).

        Raises:
            ConfigError: a ``min_weights`` key names no task, a minimum weight is above ``1/num_tasks``, or ``pareto`` is
                given configured task weights (it chooses them itself).
        """
        if self.kind == "fixed":
            return None
        names = [str(t.name) for t in tasks]
        weights = [t.weight for t in tasks]
        if len(tasks) == 1 and tasks[0].name is not None:  # one unnamed output: the TrainWrapper names the model
            does = ("would solve for the weight of one task, always 1, at the cost of its gradient every "
                    f"{self.every_n_steps} step(s)" if self.kind == "pareto"
                    else "would learn one log-variance, which only rescales the task's loss as a learning rate would")
            raise ConfigError(f"train.loss_weighting.kind={self.kind} weights the losses of several tasks, but model.tasks={names} "
                              f"has one: it {does}. Fix: train.loss_weighting.kind=fixed, or more tasks (model.tasks=[{names[0]},cvr])")
        if self.kind == "uncertainty":
            return UncertaintyWeighting(names, weights, self.init_log_variance)
        unknown = sorted(set(self.min_weights) - set(names))
        require(not unknown, f"train.loss_weighting.min_weights names {unknown}, which are not tasks of the model ({names})")
        floors = [self.min_weights.get(n, self.min_weight) for n in names]
        high = [f"{n}={f}" for n, f in zip(names, floors, strict=True) if f > 1 / len(names) + 1e-9]
        require(not high, f"train.loss_weighting.min_weight(s) {', '.join(high)} above 1/num_tasks={1 / len(names):.4g}: the "
                f"minimum weights could not sum to at most 1. Fix: at most {1 / len(names):.4g} each")
        if any(w != weights[0] for w in weights):
            raise ConfigError(f"train.loss_weighting.kind=pareto chooses the task weights itself, but the tasks have weights "
                              f"{dict(zip(names, weights, strict=True))} (model.loss_weights / model.task_specs.<task>.weight). Fix: "
                              f"leave them equal, and bound a task's share with train.loss_weighting.min_weights.<task>")
        return ParetoWeighting(names, floors, every_n_steps=self.every_n_steps * accumulation_steps, normalization=self.normalization)


class UncertaintyWeighting(TaskWeighting):
    """``Σ_t w_t·(exp(-s_t)·L_t + s_t)`` with a learned log-variance ``s_t`` per task (a dense parameter, ``log_variance``)."""

    kind: ClassVar[str] = "uncertainty"

    _initialized: torch.Tensor

    def __init__(self, names: list[str], weights: list[float], init: float | None = None) -> None:
        super().__init__(names, weights)
        self.log_variance = nn.Parameter(torch.full((len(names),), 0.0 if init is None else float(init)))
        self.register_buffer("_initialized", torch.tensor(init is not None))
        self._from_first_loss = init is None

    def weights(self) -> torch.Tensor:
        return (self._base * torch.exp(-self.log_variance)).detach()

    def combine(self, losses: torch.Tensor, per_task: list[torch.Tensor], shared: list[torch.Tensor] | None) -> torch.Tensor:
        if self._from_first_loss and self.training and torch.is_grad_enabled():
            self._from_first_loss = False  # one host read, at the first step (or the first after a resume)
            if not bool(self._initialized):
                with torch.no_grad():
                    first = losses.detach().float().clone()
                    if torch.distributed.is_available() and torch.distributed.is_initialized():
                        torch.distributed.all_reduce(first)  # every rank starts from the same values: the mean of theirs
                        first /= torch.distributed.get_world_size()
                    self.log_variance.copy_(first.clamp_min(1e-6).log())
                    self._initialized.fill_(True)
        s = self.log_variance.to(losses.dtype)
        return (self._base * (torch.exp(-s) * losses + s)).sum()


class ParetoWeighting(TaskWeighting):
    """Min-norm (Pareto-stationary) task weights from the task gradients on the shared representation; see the module
    docstring. ``alpha`` (the min-norm shares, summing to 1) and ``task_weights`` (what the losses are multiplied by,
    summing to ``T``) are buffers saved with the model. With a ``normalization`` the problem is solved on the normalized
    gradients ``ĝ_t = g_t / n_t`` and the losses get ``α_t / n_t`` (rescaled to sum to ``T``), so that the combined
    gradient on the shared representation is that min-norm combination of the normalized gradients.

    Args:
        names: the tasks.
        floors: each task's least share (sum at most 1).
        every_n_steps: forwards (micro-batches) between two solves; a solve happens at the first of them.
        normalization: ``none``, ``l2`` or ``loss`` (:class:`LossWeightingConfig`).
    """

    kind: ClassVar[str] = "pareto"
    wants_shared_module = True
    alpha: torch.Tensor
    task_weights: torch.Tensor
    _floors: torch.Tensor

    def __init__(self, names: list[str], floors: list[float], every_n_steps: int = 1, normalization: str = "none") -> None:
        super().__init__(names, [1.0] * len(names))
        self.register_buffer("alpha", torch.full((len(names),), 1.0 / len(names)))
        self.register_buffer("task_weights", torch.ones(len(names)))
        self.register_buffer("_floors", torch.tensor(floors, dtype=torch.float32), persistent=False)
        self.every_n_steps, self.normalization = every_n_steps, normalization
        self.count = 0
        """Training forwards so far (saved by :class:`WeightingPosition`)."""

    def wants_shared(self) -> bool:
        return self.count % self.every_n_steps == 0

    def weights(self) -> torch.Tensor:
        return self.task_weights

    def combine(self, losses: torch.Tensor, per_task: list[torch.Tensor], shared: list[torch.Tensor] | None) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            if shared is not None:
                self._solve(losses, per_task, shared)
            self.count += 1
        return (self.task_weights.to(losses.dtype) * losses).sum()

    def _solve(self, losses: torch.Tensor, per_task: list[torch.Tensor], shared: list[torch.Tensor]) -> None:
        flats = []
        for loss in per_task:  # each task's own scalar: its backward runs through its own tower and gate only
            grads = torch.autograd.grad(loss, shared, retain_graph=True, allow_unused=True)
            parts = [g.reshape(-1).float() if g is not None else torch.zeros(s.numel(), device=s.device) for g, s in zip(grads, shared, strict=True)]
            flats.append(parts[0] if len(parts) == 1 else torch.cat(parts))  # one shared tensor: a view, no copy
        # The Gram matrix from dot products: no [T, N] copy of the gradients.
        gram = torch.stack([torch.stack([torch.dot(a, b) for b in flats]) for a in flats])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(gram)  # every rank solves the same problem: the global batch's gradients
        norms = torch.ones_like(self.alpha)
        if self.normalization == "l2":
            norms = gram.diagonal().clamp_min(1e-24).sqrt()
        elif self.normalization == "loss":
            norms = losses.detach().float().clamp_min(1e-12)
        solved = min_norm_weights(gram / torch.outer(norms, norms), self._floors.to(gram.device))
        weights = solved / norms  # the min-norm combination of the normalized gradients, as weights of the raw losses
        weights = len(self.names) * weights / weights.sum()
        ok = torch.isfinite(weights).all()
        self.alpha.copy_(torch.where(ok, solved, self.alpha))
        self.task_weights.copy_(torch.where(ok, weights, self.task_weights))


def min_norm_weights(gram: torch.Tensor, floors: torch.Tensor, iterations: int = 25) -> torch.Tensor:
    """``argmin_α αᵀ·gram·α`` over ``{α : α_t >= floors_t, Σ α_t = 1}``: Frank–Wolfe with exact line search over the shares
    above the floors (``α = floors + r·u``, ``u`` on the simplex, ``r = 1 - Σ floors``), in tensor ops only (no host sync).

    Two tasks reach the optimum in one iteration (the simplex is a segment); more take a few.
    """
    num_tasks = gram.shape[0]
    r = 1.0 - floors.sum()
    u = torch.full((num_tasks,), 1.0 / num_tasks, device=gram.device, dtype=gram.dtype)
    for _ in range(iterations):
        alpha = floors + r * u
        vertex = torch.nn.functional.one_hot(torch.argmin(gram @ alpha), num_tasks).to(gram.dtype)
        d = vertex - u
        gd = gram @ d
        step = (-(alpha @ gd) / (r * (d @ gd)).clamp_min(1e-20)).clamp(0.0, 1.0)
        u = u + step * d
    return floors + r * u


class WeightingPosition:
    """The part of a weighting's state that is not a tensor of the model (the Pareto solve counter), for the
    checkpoint's per-rank objects; nothing for the other kinds."""

    def __init__(self, weighting: TaskWeighting | None) -> None:
        self.weighting = weighting

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.weighting.count} if isinstance(self.weighting, ParetoWeighting) else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self.weighting, ParetoWeighting) and "count" in state:
            self.weighting.count = int(state["count"])
