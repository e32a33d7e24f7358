"""The model as a server calls it: plain tensors in (no TorchRec), traced by ``torch.export`` into a program that loads
with torch alone. :class:`ServingModule` wraps a whole model, :class:`TowerServing` one tower of a two-tower model,
:class:`HistoryServing` a next-item model's query (the state after a history); :func:`export_program` traces any of them
(``python -m recsys_runner.export`` writes them; docs/export.md)."""

from __future__ import annotations

import logging
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError
from recsys_runner.scoring_topk import NextItemModel
from recsys_runner.serving.fused import for_serving
from recsys_runner.tasks import SINGLE_TASK, Task, calibrated
from recsys_runner.train.signals import Interrupted

log = logging.getLogger(__name__)

EXACT_ATOL = 1e-6
"""Largest absolute difference allowed between the exported program and the eager model on the example batch, plus
:data:`EXACT_RTOL` of the output's size."""
EXACT_RTOL = 1e-6
"""The relative part of the allowed difference: a transformer's eager kernels (PyTorch's fused encoder fast path) and
the traced ATen ops sum in another order, differing by float32 rounding of logits of a few units."""


class ServingModule(nn.Module):
    """What is exported: ``(dense [B, N], values [V], lengths [F, B]) → the model's output``.

    Builds the KeyedJaggedTensor inside, so the caller passes plain tensors (module docstring). A model with weighted
    features (``weighted``) also takes ``weights [V]`` float32: each id's weight (1.0 for the ids of features without
    weights, which pool exactly as without). ``logit_shift``: added to a binary logit (``log(data.negative_rate)`` of a model
    trained on downsampled negatives, :func:`~recsys_runner.tasks.logit_shift`), so that a server gets the probability on
    all rows, as evaluate and predict score it.
    """

    def __init__(self, model: nn.Module, keys: list[str], weighted: bool = False, logit_shift: float = 0.0) -> None:
        super().__init__()
        self.model = model
        self.logit_shift = logit_shift
        self.keys = keys
        self.weighted = weighted
        tasks = tuple(getattr(model, "tasks", SINGLE_TASK))
        self.task: Task | None = tasks[0] if len(tasks) == 1 else None
        """The model's one task, which says what a server gets of its output (:meth:`Task.served`); ``None``: all of it."""

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None) -> Any:
        sparse = KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths.reshape(-1), weights=weights)
        out = calibrated(self.model(dense, sparse), self.logit_shift)
        return out if self.task is None else self.task.served(out)

    def inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """``batch`` as this module's inputs (:func:`serving_inputs`; with ``weights`` when the model is weighted)."""
        if not self.weighted:
            return serving_inputs(batch)
        weights = batch.sparse_features.weights_or_none()
        if weights is None:
            raise ConfigError("a model with weighted features is exported with a batch that carries no weights")
        return (*serving_inputs(batch), weights.float())


class TwoTowerModel(Protocol):
    """What :class:`TowerServing` needs of a two-tower model (:class:`~recsys_runner.models.dssm.DSSM` has it)."""

    tower_features: dict[str, list[str]]
    temperature: float

    def tower(self, name: str, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor: ...


class TowerServing(nn.Module):
    """One tower of a two-tower model: ``(dense [B, n], values [V], lengths [f, B])`` of the tower's own features
    (``feature_spec.json``'s ``towers.<name>``) → its vectors ``[B, O]``.

    The model's forward needs every feature; a tower reads only its own, so the other tower's features are filled
    in as empty bags and zero columns inside, and a server passes a user's features alone (or an item's).
    """

    sparse_index: torch.Tensor
    dense_index: torch.Tensor

    def __init__(self, model: nn.Module, name: str, keys: list[str], dense_names: list[str]) -> None:
        super().__init__()
        mine = set(cast(TwoTowerModel, model).tower_features[name])
        self.model, self.name, self.keys, self.num_dense = model, name, keys, len(dense_names)
        self.sparse_keys = [k for k in keys if k in mine]
        self.dense_columns = [c for c in dense_names if c in mine]
        self.register_buffer("sparse_index", torch.tensor([keys.index(k) for k in self.sparse_keys], dtype=torch.long), persistent=False)
        self.register_buffer("dense_index", torch.tensor([dense_names.index(c) for c in self.dense_columns], dtype=torch.long),
                             persistent=False)

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        rows = dense.shape[0]
        all_lengths = lengths.new_zeros(len(self.keys), rows).index_copy(0, self.sparse_index, lengths)
        all_dense = dense.new_zeros(rows, self.num_dense).index_copy(1, self.dense_index, dense)
        sparse = KeyedJaggedTensor(keys=self.keys, values=values, lengths=all_lengths.reshape(-1))
        return cast(TwoTowerModel, self.model).tower(self.name, all_dense, sparse)

    def inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``batch`` as this tower's inputs: its dense columns, and its sparse features' ids and lengths (in key order)."""
        dense, values, lengths = serving_inputs(batch)
        per_feature = torch.split(values, lengths.sum(dim=1).tolist())
        index = self.sparse_index.tolist()
        mine = torch.cat([per_feature[i] for i in index]) if index else values[:0]
        return dense[:, self.dense_index], mine, lengths[self.sparse_index]


class HistoryServing(nn.Module):
    """A next-item model's query: ``(values [G, V] int64, lengths [B] int64, times [V] int64) → queries [B, O]``.

    ``values[g]`` holds every event's id of the history group's feature ``g`` (``group_features`` order), row after row,
    oldest event first; ``lengths[b]`` is row ``b``'s number of events (every feature of the group has one id per event);
    ``times`` their event times (only when the group has them: :attr:`timed`). The query is the model's state after the
    whole history, L2-normalized when the model scores cosines, divided by its temperature: ``queries @ items.T`` are the
    model's scores of every item (what ``predict``'s top-k ranks: :mod:`recsys_runner.scoring_topk`). The model's forward
    reads a batch of every feature; the others are filled in as empty bags inside, as :class:`TowerServing` does.
    """

    group_index: torch.Tensor
    times_index: torch.Tensor

    def __init__(self, model: nn.Module, keys: list[str]) -> None:
        super().__init__()
        group = cast(NextItemModel, model).group
        self.model, self.keys = model, keys
        self.group_features = [k for k in keys if k in group.features]
        times = [keys.index(group.timestamps)] if group.timestamps is not None and group.timestamps in keys else []
        self.timed = bool(times)
        if times and times[0] < max(keys.index(k) for k in self.group_features):
            raise ConfigError(f"the history group {group.name!r}'s times {group.timestamps!r} come before its features in the batch's "
                              f"keys {keys}: this is a bug; please report it")
        self.register_buffer("group_index", torch.tensor([keys.index(k) for k in self.group_features], dtype=torch.long), persistent=False)
        self.register_buffer("times_index", torch.tensor(times, dtype=torch.long), persistent=False)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, times: torch.Tensor | None = None) -> torch.Tensor:
        model = cast(NextItemModel, self.model)
        rows = lengths.shape[0]
        features = self.group_index.shape[0]
        all_lengths = lengths.new_zeros(len(self.keys), rows).index_copy(0, self.group_index, lengths.expand(features, rows))
        flat = values.reshape(-1)
        if self.timed:
            assert times is not None, "a history with event times is served with them"
            all_lengths = all_lengths.index_copy(0, self.times_index, lengths.view(1, rows))
            flat = torch.cat([flat, times])
        sparse = KeyedJaggedTensor(keys=self.keys, values=flat, lengths=all_lengths.reshape(-1))
        history = model.arch(sparse).histories[model.group.name]
        user = model.encode(history)[torch.arange(rows, device=lengths.device), history.lengths].float()
        return (F.normalize(user, dim=1) if model.normalize else user) / model.temperature

    def inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """``batch`` as this module's inputs: its history group's ids, lengths (and times)."""
        sparse = batch.sparse_features
        jagged = sparse.to_dict()
        lengths = jagged[self.group_features[0]].lengths().to(torch.int64)
        values = torch.stack([jagged[k].values().to(torch.int64) for k in self.group_features])
        if not self.timed:
            return values, lengths
        group = cast(NextItemModel, self.model).group
        return values, lengths, jagged[group.timestamps].values().to(torch.int64)


def serving_inputs(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch as :class:`ServingModule`'s inputs: ``(dense float32, values int64, lengths [F, B] int64)``."""
    kjt = batch.sparse_features
    lengths = kjt.lengths().to(torch.int64).reshape(len(kjt.keys()), -1)
    return batch.dense_features.float(), kjt.values().to(torch.int64), lengths


def export_program(serving: ServingModule | TowerServing | HistoryServing, batch: Batch) -> torch.export.ExportedProgram:
    """``serving`` (its model unsharded, on CPU, in eval mode) as a torch.export program with a dynamic batch size and
    id count, traced on ``batch`` as its inputs; a :class:`ServingModule`'s or :class:`TowerServing`'s embedding-bag
    collections fused (:func:`~recsys_runner.serving.fused.for_serving`: the same scores, a few lookups).

    Raises:
        ConfigError: torch.export cannot trace the model, naming the model and the first line of why.
    """
    model = serving.model
    serving.eval()
    inputs = serving.inputs(batch)
    batch_dim, ids = torch.export.Dim("batch"), torch.export.Dim("ids")
    shapes: dict[str, Any] = {"dense": {0: batch_dim}, "values": {0: ids}, "lengths": {1: batch_dim}}
    if isinstance(serving, HistoryServing):
        shapes = {"values": {1: ids}, "lengths": {0: batch_dim}} | ({"times": {0: ids}} if serving.timed else {})
    if isinstance(serving, ServingModule) and serving.weighted:
        shapes["weights"] = {0: ids}
    root = logging.getLogger()
    root.addFilter(_quiet_kjt_warning)
    # a row-scoring module is traced with its embedding bags fused (one lookup per group of tables, serving/fused.py); the
    # callers compare the program with ``serving`` itself, unfused
    traced = serving if isinstance(serving, HistoryServing) else for_serving(serving, serving.keys)
    try:
        with torch.no_grad():
            program = torch.export.export(traced, inputs, dynamic_shapes=shapes, strict=False)
    except Exception as e:  # noqa: BLE001 - torch.export raises many kinds; all mean "cannot be exported"
        if _stopped(e):  # a signal while tracing (the lifecycle raises it here): a stop, not a model that cannot be exported
            raise
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"model {type(model).__name__} cannot be exported with torch.export ({type(e).__name__}: {why}). Its forward "
            f"must be traceable for any batch size and id count: no Python branches on tensor values, no .item()/.tolist() "
            f"feeding shapes. Serve it from a checkpoint instead, or make its forward traceable (docs/export.md)"
        ) from e
    finally:
        root.removeFilter(_quiet_kjt_warning)
    return program


def check_same(eager: Any, exported: Any, model: str) -> None:
    """Refuse to write a program whose output differs from the eager model's on the example batch."""
    pairs = [(eager[k], exported[k]) for k in eager] if isinstance(eager, dict) else [(eager, exported)]
    worst = max(float(((a - b).abs() - EXACT_RTOL * a.abs()).max()) for a, b in pairs)
    if worst > EXACT_ATOL:
        diff = max(float((a - b).abs().max()) for a, b in pairs)
        raise ConfigError(f"model {model}: the exported program's output differs from the model's by {diff:.3g} on the "
                          f"example batch (allowed {EXACT_ATOL} + {EXACT_RTOL} x |output|); it cannot be exported faithfully")


def compile_program(program: torch.export.ExportedProgram, path: str) -> bool:
    """Compile ``program`` ahead of time with AOTInductor into the package ``path``, which
    :func:`~recsys_runner.data.encoding.served_program.load_program` loads with torch alone: C++ kernels instead of ~1,000 ATen
    calls run by Python (DeepFM at one row: 0.8 instead of ~5 ms; docs/performance.md, 'Serving'). It needs a C++
    compiler and takes minutes of CPU; whether it is worth it is the caller's choice. Whether it was written (``False``:
    it could not be compiled, with a warning naming why; the program alone is served then).
    """
    try:
        from torch._inductor import aoti_compile_and_package

        aoti_compile_and_package(program, package_path=path)
    except Exception as e:  # noqa: BLE001 - a missing compiler or an op Inductor cannot lower: serve the program instead
        if _stopped(e):
            raise
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        log.warning("the program could not be compiled with AOTInductor (%s: %s); it is served as torch.export's program",
                    type(e).__name__, why)
        return False
    return True


def _stopped(e: BaseException | None) -> bool:
    """Whether ``e`` is, or was raised while handling or because of, the lifecycle's :class:`Interrupted` (a signal)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, Interrupted):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _quiet_kjt_warning(record: logging.LogRecord) -> bool:
    """Drop TorchRec's "non-strict torch.export KJT to_dict … extremely slow" warning: it is about tracing time
    (seconds, once), not about the exported program, which runs plain ATen ops."""
    return "non-strict torch.export KJT" not in record.getMessage()
