"""fp16 loss scaling in the step policy: the GradScaler's scale wherever it must reach, and what it did.

``precision.grad_scaler`` (:mod:`recsys_runner.train.precision`) builds a ``torch.amp.GradScaler``; the step policy
(:class:`~recsys_runner.train.stepping.StepPolicy`) hands it to :class:`LossScaling`, which carries it through each
optimizer step:

* **The loss** is multiplied by the current scale before backward (:meth:`LossScaling.scale`).
* **The embedding tables**: the fused embedding optimizer updates rows *inside* backward, so the scaled gradient
  flowing back into them is divided by the current scale on the way, and zeroed if it overflowed, so the fused
  optimizer sees true gradients. The lookups are found by TorchRec's type, not by a model's class: the output of every
  top-level :class:`~torchrec.distributed.types.ShardedModule` (a sharded EmbeddingBagCollection, whichever model part
  holds it) gets the unscaling, added through the output awaitable's public ``callbacks``
  (:meth:`LossScaling.hook_embeddings`). Each module's gradient is zeroed on its own overflow, so a table whose
  gradient stayed finite still takes its update on a step whose dense gradients overflowed.
* **``data_parallel`` tables** differ: the dense optimizer trains them and the GradScaler unscales their gradient, so
  theirs is scaled back first (:meth:`LossScaling.rescale_replicated_tables`: divided once, not twice).
* **The dense step**: the gradients are unscaled before clipping (:meth:`LossScaling.unscale_`), the dense optimizers
  are stepped through the scaler, which skips the step when a dense gradient overflowed, and the scale adapts
  (:meth:`LossScaling.step`, which says whether the step was taken: a skipped step left the dense weights as they were,
  so the policy does not move the EMA either).
* **What it did**: the current scale and the count of skipped dense steps, logged with the train metrics
  (:meth:`LossScaling.logged`: ``train/loss_scale``, ``train/skipped_steps``).
* **Checkpoints**: the scale, its count of overflow-free steps and the count of skipped steps; a resume continues them
  under the launch's ``precision.grad_scaler`` settings (:meth:`LossScaling.load_state_dict`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec.distributed.types import Awaitable, ShardedModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

LOSS_SCALE_KEY = "train/loss_scale"
"""The logged loss scale: the scale the next step's loss will be multiplied by."""

SKIPPED_STEPS_KEY = "train/skipped_steps"
"""The logged count of dense optimizer steps the GradScaler skipped (a gradient overflowed) since the run started."""


class _UnscaleGrad(torch.autograd.Function):
    """Identity forward; backward divides by the loss scale and zeroes a non-finite gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        unscaled = grad / ctx.scale.to(grad.device)
        finite = torch.isfinite(unscaled).all()
        return torch.where(finite, unscaled, torch.zeros_like(unscaled)), None


class LossScaling:
    """The fp16 loss scaler of a step policy, wherever its scale must reach; see the module docstring.

    Args:
        scaler: the ``GradScaler`` (:meth:`~recsys_runner.train.precision.Precision.grad_scaler`), as built: its scale
            now is ``precision.grad_scaler.init_scale``, saved with its state (:meth:`load_state_dict` compares it).
        dense: the dense optimizers the scaler steps; a step hook on them tells a taken step from a skipped one.
    """

    def __init__(self, scaler: torch.amp.GradScaler, dense: torch.optim.Optimizer) -> None:
        self.scaler = scaler
        self.init_scale = scaler.get_scale()
        """``precision.grad_scaler.init_scale`` (the scale before the first step), saved with the scaler's state."""
        self.skipped_steps = 0
        """Dense steps the scaler skipped in this run (all its launches: saved and restored with the checkpoint)."""
        self._replicated: list[torch.Tensor] = []
        """Dense-optimizer parameters inside a hooked sharded module (``data_parallel`` tables): see
        :meth:`rescale_replicated_tables`."""
        self._taken = False
        # Why a hook: GradScaler.step decides on the host whether to step (it reads the overflow flag, its one sync) but
        # says so to nobody; its public step post hook tells it here without a second sync (the scale's, after update).
        dense.register_step_post_hook(self._step_taken)

    def _step_taken(self, _optimizer: torch.optim.Optimizer, _args: tuple[Any, ...], _kwargs: dict[str, Any]) -> None:
        self._taken = True

    # -- the loss and the embedding lookups ----------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale, for backward."""
        scaled: torch.Tensor = self.scaler.scale(loss)
        return scaled

    def hook_embeddings(self, model: nn.Module, dense: torch.optim.Optimizer) -> None:
        """Unscale the gradient reaching each top-level sharded module (embedding lookups) of ``model``; remember the
        parameters of ``dense`` among theirs (``data_parallel`` tables)."""
        hooked: list[str] = []
        dense_ids = {id(p) for group in dense.param_groups for p in group["params"]}
        for name, module in model.named_modules():
            if isinstance(module, ShardedModule) and not any(name.startswith(f"{h}.") for h in hooked):
                module.register_forward_hook(self._unscale_on_backward)
                hooked.append(name)
                self._replicated += [p for p in module.parameters() if id(p) in dense_ids]

    def _unscale_on_backward(self, _module: nn.Module, _inputs: Any, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return None  # evaluation: no backward to unscale
        return self._unscaled(output)

    def _unscaled(self, result: Any) -> Any:
        """``result`` with :class:`_UnscaleGrad` on its values, at the scale the loss is multiplied by.

        An EmbeddingBagCollection gives a ``KeyedTensor``; an EmbeddingCollection (the sequence models: SASRec, HSTU,
        DIN, MIND …) a ``{feature: JaggedTensor}`` of per-id rows, each unscaled on its own (each zeroed on its own
        overflow, as each module's output is); a managed-collision collection (``data.managed_collision``) a tuple of
        one of those and its remapped ids (a ``KeyedJaggedTensor`` or ``None``: no gradient, passed as they are). A sharded
        module's output may be an awaitable (or hold one): its result is unscaled once it is waited for."""
        if isinstance(result, Awaitable):  # a sharded module's output: unscale once it is waited for
            result.callbacks.append(self._unscaled)
            return result
        if result is None or isinstance(result, KeyedJaggedTensor):
            return result
        if isinstance(result, tuple):
            return tuple(self._unscaled(part) for part in result)
        if isinstance(result, KeyedTensor):
            return KeyedTensor(keys=result.keys(), length_per_key=result.length_per_key(),
                               values=self._unscale(result.values()), key_dim=result.key_dim())
        if isinstance(result, JaggedTensor):
            return JaggedTensor(values=self._unscale(result.values()), weights=result.weights_or_none(),
                                lengths=result.lengths_or_none(), offsets=result.offsets_or_none())
        if isinstance(result, torch.Tensor):
            return self._unscale(result)
        if isinstance(result, dict):
            return {key: self._unscaled(value) for key, value in result.items()}
        raise TypeError(f"fp16 loss scaling unscales embedding outputs of type KeyedTensor, JaggedTensor, Tensor or a dict or "
                        f"tuple of them, got {type(result).__name__}; use precision.grad_scaler.enabled=false or precision=bf16")

    def _unscale(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` with :class:`_UnscaleGrad` at the current loss scale."""
        result: torch.Tensor = _UnscaleGrad.apply(values, self._current(values.device))
        return result

    def _current(self, device: torch.device) -> torch.Tensor:
        """The current scale as a tensor on ``device``, learned with the public ``scale`` of a one: no host sync."""
        current: torch.Tensor = self.scaler.scale(torch.ones((), dtype=torch.float32, device=device))
        return current

    # -- the dense step --------------------------------------------------------------------------------
    def rescale_replicated_tables(self) -> None:
        """Scale the gradient of the ``data_parallel`` tables back up, before the dense step.

        They are trained by the dense optimizer, but their gradient came through the embedding unscaling already: scaled
        back, the GradScaler's unscale is its one division (was: 1/scale-sized updates of every ``data_parallel`` table
        under fp16) and its overflow check sees it as the others."""
        grads = [p.grad for p in self._replicated if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, self._current(grads[0].device))

    def unscale_(self, dense: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``dense`` by the scale now (before clipping); the step then does not again."""
        self.scaler.unscale_(dense)

    def step(self, dense: torch.optim.Optimizer) -> bool:
        """Step ``dense`` through the scaler and adapt the scale; whether the step was taken (``False``: a gradient
        overflowed, the scaler skipped it and the weights are unchanged, counted in :attr:`skipped_steps`)."""
        self._taken = False
        self.scaler.step(dense)
        self.scaler.update()
        if not self._taken:
            self.skipped_steps += 1
        return self._taken

    # -- what it did, and its state ---------------------------------------------------------------------
    def logged(self) -> dict[str, float]:
        """``train/loss_scale`` (the scale now, which the next step uses) and ``train/skipped_steps`` (dense steps
        skipped for overflow so far in the run). Reading the scale syncs with the device: called at log steps only."""
        return {LOSS_SCALE_KEY: float(self.scaler.get_scale()), SKIPPED_STEPS_KEY: float(self.skipped_steps)}

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, the ``init_scale`` it started from and the count of skipped steps."""
        return {"scaler": self.scaler.state_dict(), "init_scale": self.init_scale, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the checkpoint's loss scale, its count of overflow-free steps and of skipped steps, under this
        launch's ``precision.grad_scaler`` settings.

        Why not torch's ``GradScaler.load_state_dict`` as is: it also puts back the saved ``growth_factor``,
        ``backoff_factor`` and ``growth_interval``, so a resume that changed one of them kept the old one while the resume
        warning said it takes effect; and a count of good steps at or past a lowered interval would never grow the scale
        (torch grows it when the count *equals* the interval), so the count is capped just below it. A changed
        ``init_scale`` takes effect as the others do: the scale starts over there (the count of skipped steps, the run's
        history, goes on). A checkpoint without a scaler (an fp32 or bf16 run) leaves this launch's fresh one."""
        saved = state.get("scaler")
        if not saved:
            return
        self.skipped_steps = int(state.get("skipped_steps", 0))  # checkpoints before it was saved: none counted
        interval = self.scaler.get_growth_interval()
        scale, good_steps = saved["scale"], min(int(saved["_growth_tracker"]), interval - 1)
        if state.get("init_scale", self.init_scale) != self.init_scale:  # checkpoints before it was saved: as unchanged
            scale, good_steps = self.init_scale, 0
        self.scaler.load_state_dict({"scale": scale, "_growth_tracker": good_steps, "growth_interval": interval,
                                     "growth_factor": self.scaler.get_growth_factor(),
                                     "backoff_factor": self.scaler.get_backoff_factor()})
