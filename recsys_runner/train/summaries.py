"""``train.summary_every_steps``: training summaries every N steps — gradient norms, embedding row norms, lrs, histograms.

On a summary step (``step % train.summary_every_steps == 0``) rank 0 logs, through the tracker (MLflow, and TensorBoard
event files with ``tracking.tensorboard=true``):

* ``grad_norm/dense``: the global L2 norm of every dense parameter's gradient after the step's backward(s) — after
  fp16 unscaling and after ``train.clip_grad`` clipping, i.e. what the dense optimizer applied. Dense gradients are
  all-reduced by DDP, so every rank holds the same ones.
* ``grad_norm/sparse``: the embedding tables have no ``.grad`` (fbgemm's fused optimizer updates rows inside
  backward), so this is the L2 norm of the gradient of the loss with respect to the **looked-up embeddings**: the
  outputs of every sharded embedding module (one vector per sample and feature, pooled for an
  EmbeddingBagCollection, per id for an EmbeddingCollection) over all ranks' batches and the step's micro-batches.
  That gradient is what the fused kernel receives: with sum pooling each row of a bag gets its bag's gradient, and a row
  looked up several times gets the sum of them, so this is the norm before the per-row sum, not of the per-row update.
  It is captured by a tensor hook on those outputs, armed only for summary steps.
* ``embedding/<table>/row_norm_mean|max|min``: L2 norms of each table's rows, over the whole table, combined across
  ranks (a row split by column-wise sharding is put back together before its norm is taken).
* ``lr/<group>``: the learning rate of every optimizer's parameter groups (``lr/<group>/<i>`` when an optimizer's
  groups differ), as the loop logs them every ``train.log_every_steps`` (:meth:`~recsys_runner.train.stepping.Stepper.learning_rates`: the lrs the step trained with);
  added on the summary steps that are not log steps.
* with ``train.summary_histograms=true``: histograms of every dense parameter and its gradient (``hist/param/<name>``,
  ``hist/grad/<name>``), logged to MLflow as one JSON artifact per summary step (``summaries/histograms_step_<N>.json``)
  and to TensorBoard as histograms.

Between summary steps nothing runs but one flag test per sharded module's forward (the hook is registered only when
summaries are on).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.utils.hooks import RemovableHandle
from torchrec.distributed.types import Awaitable, ShardedModule
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

from recsys_runner.distributed.env import DistEnv
from recsys_runner.tracking.tracker import Histogram, Tracker

HISTOGRAM_BINS = 30
"""Buckets of each histogram (equal widths between the tensor's min and max)."""

_TABLE_PARENTS = ("embedding_bags", "embeddings")  # TorchRec's state-dict key of a table: <...>.<parent>.<table>.weight


def top_sharded_modules(model: nn.Module) -> list[nn.Module]:
    """The outermost :class:`ShardedModule` s of ``model`` (the embedding lookups, whichever model part holds them)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, ShardedModule) and not any(name.startswith(f"{f}.") for f, _ in found):
            found.append((name, module))
    return [m for _, m in found]


class Summaries:
    """Computes and logs the summaries of the module docstring every ``every`` steps; see :meth:`after_step`.

    Args:
        every: summary cadence in steps (``train.summary_every_steps``); ``None`` turns everything off.
        histograms: also log parameter and gradient histograms (``train.summary_histograms``).
        model: the sharded model (DistributedModelParallel); its top-level sharded modules get the gradient hook.
        learning_rates: the lrs of every optimizer of the run during the step just taken (:meth:`Stepper.learning_rates
            <recsys_runner.train.stepping.Stepper.learning_rates>`).
        dense: the dense optimizers (their parameters' gradients and histograms; names prefixed by the optimizer's key).
        env: rank, world size, device (the reductions across ranks).
        tracker: where rank 0 logs (a :class:`~recsys_runner.tracking.tracker.NullTracker` elsewhere).
        log_every_steps: the loop's log cadence, and ``total_steps`` the run's length: the loop logs the lrs on those steps.
        next_step: the step the next call of the pipeline trains (a resumed run's step + 1).
    """

    def __init__(self, every: int | None, *, histograms: bool, model: nn.Module, learning_rates: Callable[[], dict[str, float]],
                 dense: KeyedOptimizer, env: DistEnv, tracker: Tracker, log_every_steps: int, total_steps: int,
                 next_step: int = 1) -> None:
        self.every, self.histograms, self.model, self.learning_rates = every, histograms, model, learning_rates
        self.log_every_steps, self.total_steps = log_every_steps, total_steps
        self.dense, self.env, self.tracker = dense, env, tracker
        self._sparse_sq: torch.Tensor | None = None  # sum of squared embedding-output gradients, while armed
        self._armed = False
        self._hooks: list[RemovableHandle] = []
        if every:
            for module in top_sharded_modules(model):  # prepended, before fp16 unscaling's hook: it sees true gradients
                self._hooks.append(module.register_forward_hook(self._hook_output, prepend=True))
            self._arm(next_step)

    def close(self) -> None:
        """Remove the hooks from the model (the benchmark swaps summaries in and out of one built run)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def after_step(self, step: int) -> None:
        """After optimizer step ``step``: log its summaries if it is a summary step, and arm the hook for the next one."""
        if not self.every:
            return
        if step % self.every == 0:
            self._log(step)
        self._arm(step + 1)

    def _arm(self, step: int) -> None:
        self._armed = step % self.every == 0 if self.every else False
        self._sparse_sq = torch.zeros((), dtype=torch.float64, device=self.env.device) if self._armed else None

    # -- the sparse gradient: a hook on the looked-up embeddings -------------------------------------
    def _hook_output(self, _module: nn.Module, _inputs: Any, output: Any) -> None:
        if not self._armed or not torch.is_grad_enabled():
            return
        if isinstance(output, Awaitable):  # a sharded module's output: hook it once it is waited for
            output.callbacks.append(self._hooked)
        else:
            self._hooked(output)

    def _hooked(self, result: Any) -> Any:
        for tensor in _tensors(result):
            if tensor.requires_grad:
                tensor.register_hook(self._add_grad)
        return result

    def _add_grad(self, grad: torch.Tensor) -> None:
        if self._sparse_sq is not None:
            self._sparse_sq += grad.detach().double().pow(2).sum()

    # -- one summary step ---------------------------------------------------------------------------
    def _log(self, step: int) -> None:
        sparse_sq = self._sparse_sq if self._sparse_sq is not None else torch.zeros((), dtype=torch.float64, device=self.env.device)
        metrics = {"grad_norm/dense": dense_grad_norm(self._dense_params())}
        tables = self._table_weights()
        sums, extremes = _row_norm_parts(tables, self.env)
        sums = torch.cat([sums, sparse_sq.reshape(1).to(sums)])  # one reduction for the sparse norm and the row sums
        if self.env.world_size > 1:
            dist.all_reduce(sums)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        totals, bounds = sums.tolist(), extremes.tolist()  # one device-to-host copy each
        metrics["grad_norm/sparse"] = totals[-1] ** 0.5
        for i, name in enumerate(tables):
            metrics |= {f"embedding/{name}/row_norm_mean": totals[2 * i] / max(totals[2 * i + 1], 1.0),
                        f"embedding/{name}/row_norm_max": bounds[2 * i], f"embedding/{name}/row_norm_min": -bounds[2 * i + 1]}
        if step % self.log_every_steps and step != self.total_steps:  # else the loop's log line has them at this step
            metrics |= self.learning_rates()
        self.tracker.log_metrics(metrics, step)
        if self.histograms and self.env.is_main:
            self.tracker.log_histograms(self._histograms(), step)

    def _dense_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.dense.params.items()

    def _table_weights(self) -> dict[str, torch.Tensor | ShardedTensor]:
        """Every embedding table's weight (a ShardedTensor, or a replicated tensor for ``data_parallel``), by table name."""
        tables: dict[str, torch.Tensor | ShardedTensor] = {}
        for module in top_sharded_modules(self.model):
            for key, value in module.state_dict().items():
                parts = key.split(".")
                if len(parts) >= 3 and parts[-1] == "weight" and parts[-3] in _TABLE_PARENTS:
                    tables[parts[-2]] = value
        return dict(sorted(tables.items()))  # the same order on every rank: the reductions line up

    def _histograms(self) -> dict[str, Histogram]:
        hists: dict[str, Histogram] = {}
        for name, param in self._dense_params():
            hists[f"hist/param/{name}"] = histogram(param.detach())
            if param.grad is not None:
                hists[f"hist/grad/{name}"] = histogram(param.grad.detach())
        return hists


def dense_grad_norm(params: Iterable[tuple[str, torch.Tensor]]) -> float:
    """The global L2 norm of the parameters' gradients (those that have one), as ``clip_grad_norm_`` computes it."""
    norms = [torch.linalg.vector_norm(p.grad.detach().double()) for _, p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def _tensors(result: Any) -> Iterator[torch.Tensor]:
    """The tensors carrying a sharded module's output: a KeyedTensor's or JaggedTensor's values, tensors, nested containers."""
    if isinstance(result, (KeyedTensor, JaggedTensor)):
        yield result.values()
    elif isinstance(result, torch.Tensor):
        yield result
    elif isinstance(result, dict):
        for value in result.values():
            yield from _tensors(value)
    elif isinstance(result, (list, tuple)):
        for value in result:
            yield from _tensors(value)


def _row_norm_parts(tables: dict[str, torch.Tensor | ShardedTensor], env: DistEnv) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of each table's row-norm statistics: ``[sum, count]`` per table (summed over ranks) and
    ``[max, -min]`` per table (maxed over ranks). A replicated table counts on rank 0 only."""
    sums = torch.zeros(2 * len(tables), dtype=torch.float64, device=env.device)
    extremes = torch.full((2 * len(tables),), float("-inf"), dtype=torch.float64, device=env.device)
    for i, weight in enumerate(tables.values()):
        norms = _local_row_norms(weight, env)
        if norms.numel():
            sums[2 * i], sums[2 * i + 1] = norms.sum(), norms.numel()
            extremes[2 * i], extremes[2 * i + 1] = norms.max(), -norms.min()
    return sums, extremes


def _local_row_norms(weight: torch.Tensor | ShardedTensor, env: DistEnv) -> torch.Tensor:
    """L2 norms of the rows this rank accounts for; a table whose rows are split by columns is reassembled first (the
    squared norms of its column shards all-reduced over its rows, then counted on rank 0)."""
    if not isinstance(weight, ShardedTensor):
        return weight.detach().double().norm(dim=1) if env.is_main else weight.new_zeros(0, dtype=torch.float64)
    meta = weight.metadata()
    rows, dim = meta.size[0], meta.size[1]
    shards = weight.local_shards()
    if all(s.shard_sizes[1] == dim for s in meta.shards_metadata):
        norms = [s.tensor.detach().double().norm(dim=1) for s in shards]
        return torch.cat(norms).to(env.device) if norms else torch.zeros(0, dtype=torch.float64, device=env.device)
    squares = torch.zeros(rows, dtype=torch.float64, device=env.device)
    for s in shards:
        start, length = s.metadata.shard_offsets[0], s.metadata.shard_sizes[0]
        squares[start:start + length] += s.tensor.detach().double().pow(2).sum(dim=1).to(env.device)
    if env.world_size > 1:
        dist.all_reduce(squares)
    return squares.sqrt() if env.is_main else squares.new_zeros(0)


def histogram(tensor: torch.Tensor, bins: int = HISTOGRAM_BINS) -> Histogram:
    """A histogram of ``tensor``'s values in TensorBoard's raw form (``bucket_limits`` are right edges)."""
    values = tensor.double().flatten()
    if values.numel() == 0:
        return Histogram(min=0.0, max=0.0, num=0, sum=0.0, sum_squares=0.0, bucket_limits=[0.0], bucket_counts=[0])
    low, high = float(values.min()), float(values.max())
    if high > low:
        counts = torch.histc(values, bins=bins, min=low, max=high)
        limits = torch.linspace(low, high, bins + 1)[1:].tolist()
    else:  # one value: one bucket
        counts, limits = torch.tensor([float(values.numel())]), [high]
    return Histogram(min=low, max=high, num=int(values.numel()), sum=float(values.sum()), sum_squares=float(values.pow(2).sum()),
                     bucket_limits=limits, bucket_counts=[int(c) for c in counts.tolist()])
