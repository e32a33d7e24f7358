"""Checkpoint → module state: :class:`TrainingParts` (what of a run a checkpoint holds, under which keys) and
:func:`load_into`, the one loader every reader of a checkpoint's tensors goes through.

One loader, three rules (:data:`Rule`), each refusing by name what it cannot load:

* ``exact`` — evaluate, predict, export: the checkpoint holds every tensor asked for with the same shape and no
  ``model/`` tensor beyond them, so weights of another model config are refused by name, not half-loaded;
* ``resume`` — every tensor asked for (model, optimizer, EMA) is in the checkpoint;
* ``fine_tune`` — ``init_from``: names are renamed (``name_map``) and the ones the checkpoint lacks keep their
  fresh values; refused only when nothing of the model is shared.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

from recsys_runner.checkpoint.storage import CheckpointStorage, TensorIndex
from recsys_runner.errors import CheckpointError, ConfigError
from recsys_runner.models.collision import restore_collision_state

log = logging.getLogger(__name__)

Rule = Literal["exact", "resume", "fine_tune"]
"""What :func:`load_into` refuses (the module docstring)."""


@dataclass
class TrainingParts:
    """The stateful parts of a run as a checkpoint holds them: the model (``model/<fqn>``), the keyed optimizers
    (``optim/<key>/<state>``), tensor holders such as the EMA (``<name>/<key>``: objects with ``state_dict`` /
    ``load_state_dict`` of tensors) and small picklable-state objects (schedules, scaler, early stopping: per rank)."""

    model: torch.nn.Module
    optimizer: CombinedOptimizer
    tensors: dict[str, Any] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)

    def tensor_state(self, with_optimizer: bool = True) -> dict[str, Any]:
        """Every tensor, by its checkpoint key (the optimizer's only ``with_optimizer``)."""
        flat: dict[str, Any] = {f"model/{k}": v for k, v in self.model.state_dict().items()}
        if with_optimizer:
            for key, states in self.optimizer.state_dict()["state"].items():
                for name, value in states.items():
                    flat[f"optim/{key}/{name}"] = value
        for holder_name, holder in self.tensors.items():
            for k, v in holder.state_dict().items():
                flat[f"{holder_name}/{k}"] = v
        return flat

    def init_optimizer_state(self) -> None:
        """Create the optimizers' lazy state (e.g. Adam moments), so a checkpoint's can be loaded into it."""
        for _, opt in self.optimizer.optimizers:
            if isinstance(opt, KeyedOptimizerWrapper) and not opt.state:
                opt.init_state()

    def take(self, loaded: Mapping[str, Any], with_optimizer: bool) -> None:
        """Hand what :func:`load_into` returned to the optimizer (``with_optimizer``) and the tensor holders; the
        model's tensors were loaded in place, so its managed-collision mappings are checked and re-sorted here."""
        restore_collision_state(self.model)
        if with_optimizer:
            nested: dict[str, dict[str, Any]] = {}
            for key, states in self.optimizer.state_dict()["state"].items():
                nested[key] = {name: loaded.get(f"optim/{key}/{name}", value) for name, value in states.items()}
            self.optimizer.load_state_dict({"state": nested})
        for holder_name, holder in self.tensors.items():
            prefix = f"{holder_name}/"
            holder.load_state_dict({k[len(prefix):]: v for k, v in loaded.items() if k.startswith(prefix)})

    def object_states(self) -> dict[str, Any]:
        """The small objects' states, saved per rank."""
        return {k: o.state_dict() for k, o in self.objects.items()}

    def load_objects(self, states: Mapping[str, Any]) -> None:
        """Restore the small objects a checkpoint has a state for."""
        for k, o in self.objects.items():
            if k in states:
                o.load_state_dict(states[k])


def load_into(
    storage: CheckpointStorage, path: Path, ours: Mapping[str, Any], *, rule: Rule,
    sources: Callable[[TensorIndex], Mapping[str, str]] | None = None, world_size: int = 1,
) -> dict[str, Any]:
    """Load checkpoint ``path``'s tensors into ``ours`` (checkpoint key → this process's tensor; loaded in place,
    each rank its shards) under ``rule`` (the module docstring).

    ``sources``, given the checkpoint's tensor index, says which checkpoint key each of ``ours`` is read from
    (default: its own): ``init_from``'s renames, export's EMA weights. Several of ours may read one source on one
    rank. Returns ours' keys (those loaded) → the loaded values, for the optimizer and tensor holders
    (:meth:`TrainingParts.take`).

    Raises:
        CheckpointError: the checkpoint does not hold what ``rule`` needs, naming the differences.
        ConfigError: several of ours read one source on more than one rank.
    """
    index = storage.tensor_index(path)
    if rule == "exact":
        _refuse_mismatch(path, index, ours)
    elif rule == "resume":
        missing = [k for k in ours if k not in index]
        if missing:
            raise CheckpointError(f"checkpoint {path} does not match this model/optimizer: it lacks {missing[:5]} "
                                  f"({len(missing)} in all); resume needs the same config (fine-tune with checkpoint.init_from)")
        resized = [f"{k} is {index[k]} there, {_shape(v)} here" for k, v in ours.items()
                   if k.startswith("model/") and index.get(k) is not None and index[k] != _shape(v)]
        if resized:  # by name, before DCP's own size check fails inside its load plan
            raise CheckpointError(f"checkpoint {path} does not match this model: {'; '.join(resized[:3])} ({len(resized)} in all): "
                                  f"a table's num_embeddings (a managed-collision table's slots) or a width changed. Fix: resume "
                                  f"with the training run's data and model settings (fine-tune with checkpoint.init_from)")
    wanted = dict(sources(index)) if sources is not None else {k: k for k in ours}
    if rule == "fine_tune":
        wanted = _shared(path, index, ours, wanted)
    to_load: dict[str, Any] = {}
    copies: list[tuple[str, str]] = []  # (ours, source) for a source mapped to several of ours
    for k, src in wanted.items():
        if src in to_load:
            if world_size > 1:
                raise ConfigError(f"checkpoint.name_map maps {src} to several parameters; that works on one rank only")
            copies.append((k, src))
        else:
            to_load[src] = ours[k]
    storage.load_tensors(path, to_load)
    for k, src in copies:
        _local(ours[k]).copy_(_local(to_load[src]))
    return {k: to_load[src] for k, src in wanted.items()}


TRAINING_ONLY = "model/weighting."
"""The TrainWrapper's multi-task loss weighting state (learned log-variances, Pareto weights): trained and resumed, but no
part of the model a reader of weights (export) builds, so the ``exact`` rule does not count it as another model's."""


def _refuse_mismatch(path: Path, index: TensorIndex, wanted: Mapping[str, Any]) -> None:
    """The ``exact`` rule: every tensor of ``wanted`` with the same shape, and no ``model/`` tensor beyond them."""
    missing = [k for k in wanted if k not in index]
    extra = [k for k in index if k.startswith("model/") and not k.startswith(TRAINING_ONLY) and k not in wanted]
    shapes = [f"has {k} of shape {index[k]} where this model's is {_shape(wanted[k])}" for k in wanted
              if index.get(k) is not None and index[k] != _shape(wanted[k])]
    if missing or extra or shapes:
        parts = ([f"lacks {missing[:3]} ({len(missing)} in all)"] if missing else []) + \
                ([f"has {extra[:3]} this model does not ({len(extra)} in all)"] if extra else []) + shapes[:3]
        raise CheckpointError(f"checkpoint {path} does not match this model config: it {'; '.join(parts)}. Fix: give the "
                              f"same model=/model.*/data overrides as the training run (its resolved config is config.yaml "
                              f"in its MLflow run, its overrides the run's hydra.overrides tag, and .hydra/ beside its checkpoints)")


def _shared(path: Path, index: TensorIndex, ours: Mapping[str, Any], wanted: Mapping[str, str]) -> dict[str, str]:
    """The ``fine_tune`` rule: the renamed tensors the checkpoint has; the others keep their fresh values (a warning)."""
    skipped = [k for k, src in wanted.items() if src not in index]
    if len(skipped) == len(wanted) or not any(k.startswith("model/") and k not in skipped for k in wanted):
        raise CheckpointError(f"checkpoint.init_from={path} shares no parameter name with this model; map names with "
                              f"checkpoint.name_map (e.g. this model has {sorted(ours)[:3]}, it has {sorted(index)[:3]})")
    if skipped:
        log.warning("init_from %s: %d tensors not in the checkpoint keep their fresh values, e.g. %s", path, len(skipped), skipped[:5])
    return {k: src for k, src in wanted.items() if src in index}


def _shape(t: Any) -> list[int]:
    """The global shape of a tensor or ShardedTensor (whose ``size()`` warns that ShardedTensor is deprecated)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return list(t.size())


def _local(t: Any) -> torch.Tensor:
    """The local shard of a ShardedTensor (this rank's rows), or the tensor itself."""
    return t.local_tensor() if hasattr(t, "local_tensor") else t
