"""Checkpoint → module state: :class:`TrainingParts` (what of a run a checkpoint holds, under which keys) and
:func:`load_into`, the one loader every reader of a checkpoint's tensors goes through.

One loader, three rules (:data:`Rule`), each refusing by name what it cannot load:

* ``exact`` — evaluate, predict, export: the checkpoint holds every tensor asked for with the same shape and no
  ``model/`` tensor beyond them, so weights of another model config are refused by name, not half-loaded;
* ``resume`` — every tensor asked for (model, optimizer, EMA) is in the checkpoint;
* ``fine_tune`` — ``init_from``: names are renamed (``name_map``) and the ones the checkpoint lacks, or holds with
  another shape (a resized table, a changed width), keep their fresh values (a warning names them); refused only when
  nothing of the model is shared. With vocabularies fitted anew or grown (``data.vocabulary=refit|extend``) each
  such table's rows are carried over by id instead (:mod:`~recsys_runner.checkpoint.carried_rows`): every rank reads
  the whole trained table and copies the row of each id into the id's new row of its own shards, and the rows of its
  optimizer state alike.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

from recsys_runner.checkpoint.carried_rows import CarriedRows, load_carried, split_carried
from recsys_runner.checkpoint.storage import CheckpointStorage, TensorIndex
from recsys_runner.checkpoint.tensor_keys import param_of, shape_of
from recsys_runner.errors import CheckpointError, ConfigError
from recsys_runner.models.collision import restore_collision_state

log = logging.getLogger(__name__)

EMA_PREFIX = "ema/"
"""The checkpoint keys of the dense EMA weights (the tensor holder ``ema``, :class:`~recsys_runner.train.ema.DenseEMA`),
which a fine-tune that lacks them starts at the loaded weights rather than keeping fresh."""

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

    def init_optimizer_state(self, saved: Collection[str] | None = None) -> None:
        """Create the optimizers' lazy state (e.g. Adam moments), so a checkpoint's can be loaded into it.

        ``saved``: the checkpoint's tensor keys; an optimizer that has none there had no state when it was written — it
        never stepped, as when fp16's loss scaler skipped every step so far (their gradients overflowed) — and is left
        lazy, as it was, instead of being asked for state the checkpoint cannot give."""
        for name, opt in self.optimizer.optimizers:
            if isinstance(opt, KeyedOptimizerWrapper) and not opt.state:
                if saved is not None and not any(key.startswith(f"optim/{name}.") for key in saved):
                    continue
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
    sources: Callable[[TensorIndex], Mapping[str, str]] | None = None, world_size: int = 1, carry: CarriedRows | None = None,
    announce_conversion: bool = True,
) -> dict[str, Any]:
    """Load checkpoint ``path``'s tensors into ``ours`` (checkpoint key → this process's tensor; loaded in place,
    each rank its shards) under ``rule`` (the module docstring).

    ``sources``, given the checkpoint's tensor index, says which checkpoint key each of ``ours`` is read from
    (default: its own): ``init_from``'s renames, export's EMA weights. Several of ours may read one source on one
    rank. ``carry`` (``fine_tune`` only): the tables whose rows are carried over by id
    (:class:`~recsys_runner.checkpoint.carried_rows.CarriedRows`). Returns ours' keys (those loaded) → the loaded values,
    for the optimizer and tensor holders (:meth:`TrainingParts.take`).

    A ``model/`` tensor stored in another dtype than ours (embedding tables of another ``precision.embedding_data_type``
    or ``embedding_data_type_by_feature``) is converted as it loads, with a warning naming the tables and the types
    (:func:`note_conversions`), unless ``announce_conversion`` is off: for export, whose float32 tables are its design,
    and a resume, whose changed settings are warned about by name already (:func:`~recsys_runner.checkpoint.resume_changes.check_changes`).

    Raises:
        CheckpointError: the checkpoint does not hold what ``rule`` needs, naming the differences.
        ConfigError: several of ours read one source on more than one rank.
    """
    index = storage.tensor_index(path)
    if rule == "exact":
        _refuse_mismatch(path, index, ours)
    elif rule == "resume":
        missing = [k for k in ours if k not in index]
        if missing and all(k.startswith(EMA_PREFIX) for k in missing):  # a launch outside the CLI, which compares no config
            raise CheckpointError(f"checkpoint {path} holds no moving average of the dense weights ({len(missing)} ema/ tensors, "
                                  f"e.g. {missing[0]}): its run trained without train.ema.decay, which this one sets. Fix: "
                                  f"resume without train.ema.decay, or start a new run from these weights in its own "
                                  f"checkpoint.dir with checkpoint.init_from={path} (the average starts at the weights loaded)")
        if missing:
            raise CheckpointError(f"checkpoint {path} does not match this model/optimizer: it lacks {missing[:5]} "
                                  f"({len(missing)} in all); resume needs the same config (fine-tune with checkpoint.init_from)")
        resized = [f"{k} is {index[k]} there, {shape_of(v)} here" for k, v in ours.items()
                   if k.startswith("model/") and index.get(k) is not None and index[k] != shape_of(v)]
        if resized:  # by name, before DCP's own size check fails inside its load plan
            raise CheckpointError(f"checkpoint {path} does not match this model: {'; '.join(resized[:3])} ({len(resized)} in all): "
                                  f"a table's num_embeddings (a managed-collision table's slots) or a width changed. Fix: resume "
                                  f"with the training run's data and model settings (fine-tune with checkpoint.init_from)")
    wanted = dict(sources(index)) if sources is not None else {k: k for k in ours}
    carried: dict[str, tuple[str, np.ndarray]] = {}
    if rule == "fine_tune":
        if carry is not None:
            wanted, carried = split_carried(path, index, ours, wanted, carry)
        wanted = _shared(path, index, ours, wanted, carried)
    if announce_conversion and rule != "resume":
        note_conversions(path, storage.tensor_dtypes(path), ours,
                         {**wanted, **{k: src for k, (src, _) in carried.items()}}, "init_from" if rule == "fine_tune" else "loading")
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
    loaded = {k: to_load[src] for k, src in wanted.items()}
    if carried:
        load_carried(storage, path, index, ours, carried)
        loaded |= {k: ours[k] for k in carried}
    return loaded


TABLE_CONVERSION = "to fp16 every weight is rounded to 11 significant bits, to fp32 they widen exactly"
"""What converting a stored table's weights does, said by every warning of one (a resume's, :func:`note_conversions`)."""


def note_conversions(path: Path, saved: Mapping[str, torch.dtype], ours: Mapping[str, Any], wanted: Mapping[str, str],
                     doing: str) -> None:
    """Warn (on rank 0) naming each ``model/`` tensor of ``ours`` that loads from a checkpoint key of ``wanted`` saved in
    another dtype (``saved``): its weights are converted as they load, so this run does not score with the stored run's
    weights exactly. Why loudly: evaluate or predict with another ``precision.embedding_data_type`` would otherwise
    report metrics of rounded tables as the stored run's, and ``init_from`` start from other weights than it names."""
    changed: dict[tuple[str, str], list[str]] = {}
    for k, src in wanted.items():
        before, after = saved.get(src), _dtype(ours[k])
        if k.startswith("model/") and before is not None and after is not None and before != after:
            changed.setdefault((_type_name(before), _type_name(after)), []).append(_table_name(k))
    if not changed or (dist.is_initialized() and dist.get_rank() != 0):
        return
    lines = "; ".join(f"{a} -> {b}: {', '.join(names[:6])}{', …' if len(names) > 6 else ''} ({len(names)} tables)"
                      for (a, b), names in sorted(changed.items()))
    log.warning("%s %s: its embedding tables are stored in other types than this run's precision.embedding_data_type / "
                "embedding_data_type_by_feature, and are converted as they load: %s (%s), so scores may differ slightly "
                "from the stored run's. Fix: to load them as stored, give the types the run that wrote it trained with",
                doing, path, lines, TABLE_CONVERSION)


_TYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _type_name(dtype: torch.dtype) -> str:
    """``dtype`` as ``precision.embedding_data_type`` names it (``fp16``), or torch's name for another."""
    return _TYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _table_name(key: str) -> str:
    """The table a ``model/…<table>.weight`` key holds (``t_cat_0``), or the key for another tensor."""
    param = key.split("/", 1)[-1]
    if param.endswith(".weight") and (".embedding_bags." in param or ".embeddings." in param):
        return param.removesuffix(".weight").rsplit(".", 1)[-1]
    return param


def _dtype(t: Any) -> torch.dtype | None:
    """The dtype of a tensor or ShardedTensor (whose properties warn that ShardedTensor is deprecated); ``None`` for
    another value."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dtype = getattr(t, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


TRAINING_ONLY = "model/weighting."
"""The TrainWrapper's multi-task loss weighting state (learned log-variances, Pareto weights): trained and resumed, but no
part of the model a reader of weights (export) builds, so the ``exact`` rule does not count it as another model's."""


def _refuse_mismatch(path: Path, index: TensorIndex, wanted: Mapping[str, Any]) -> None:
    """The ``exact`` rule: every tensor of ``wanted`` with the same shape, and no ``model/`` tensor beyond them."""
    missing = [k for k in wanted if k not in index]
    extra = [k for k in index if k.startswith("model/") and not k.startswith(TRAINING_ONLY) and k not in wanted]
    shapes = [f"has {k} of shape {index[k]} where this model's is {shape_of(wanted[k])}" for k in wanted
              if index.get(k) is not None and index[k] != shape_of(wanted[k])]
    if missing or extra or shapes:
        parts = ([f"lacks {missing[:3]} ({len(missing)} in all)"] if missing else []) + \
                ([f"has {extra[:3]} this model does not ({len(extra)} in all)"] if extra else []) + shapes[:3]
        raise CheckpointError(f"checkpoint {path} does not match this model config: it {'; '.join(parts)}. Fix: give the "
                              f"same model=/model.*/data overrides as the training run (its resolved config is config.yaml "
                              f"in its MLflow run, its overrides the run's hydra.overrides tag, and .hydra/ beside its checkpoints)")


def _shared(path: Path, index: TensorIndex, ours: Mapping[str, Any], wanted: Mapping[str, str],
            carried: Mapping[str, Any]) -> dict[str, str]:
    """The ``fine_tune`` rule: the renamed tensors the checkpoint has with the same shape; the others keep their fresh
    values (a warning each kind). An optimizer state of a parameter whose state is resized anywhere stays fresh as a whole
    (Adam's step count without its moments would be off). ``carried``: ours' keys whose rows are carried by id (shared)."""
    skipped = [k for k, src in wanted.items() if src not in index]
    resized = {k: f"{k} ({shape_of(ours[k])} here, {index[src]} there)" for k, src in wanted.items()
               if src in index and index[src] is not None and hasattr(ours[k], "size") and index[src] != shape_of(ours[k])}
    stale = {k.rsplit("/", 1)[0] for k in resized if k.startswith("optim/")}
    resized |= {k: k for k in wanted if k.startswith("optim/") and k.rsplit("/", 1)[0] in stale and k not in resized}
    kept = [k for k in wanted if k not in resized and k not in skipped]
    if not any(k.startswith("model/") for k in [*kept, *carried]):
        raise CheckpointError(f"checkpoint.init_from={path} shares no parameter name with this model; map names with "
                              f"checkpoint.name_map (e.g. this model has {sorted(ours)[:3]}, it has {sorted(index)[:3]})")
    averages = [k for k in skipped if k.startswith(EMA_PREFIX)]
    if averages:  # DenseEMA.load_state_dict starts them at the loaded weights
        log.info("init_from %s: it holds no EMA weights for %d dense tensors (written without train.ema.decay, or by "
                 "another model): their moving average starts at the weights loaded", path, len(averages))
    skipped = [k for k in skipped if not k.startswith(EMA_PREFIX)]
    if moved := _other_optimizer(index, [wanted[k] for k in skipped]):
        log.warning("init_from %s: the optimizer state of %d embedding tables starts fresh: the checkpoint holds it in its %s "
                    "optimizer, while this run trains them with its %s one, because the sharding plan placed them otherwise "
                    "(a data_parallel table is trained by the dense optimizer, a table_wise, row_wise or column_wise one by "
                    "the fused sparse one; the planner chooses by data.batch_size, the table sizes and the ranks), e.g. %s. "
                    "Fix: give the tables the checkpoint's sharding type (distributed.sharding_types=[...], or per table "
                    "+distributed.tables={<table>: {sharding_types: [...]}}; its run's sharding_plan.txt lists them), or "
                    "checkpoint.load_optimizer=false to start every optimizer state fresh alike", path, len(moved),
                    *moved[sorted(moved)[0]], ", ".join(sorted(moved)[:3]))
        skipped = [k for k in skipped if param_of(wanted[k]) not in moved]
    if skipped:
        log.warning("init_from %s: %d tensors not in the checkpoint keep their fresh values, e.g. %s", path, len(skipped), skipped[:5])
    if resized:
        log.warning("init_from %s: %d tensors of another shape there keep their fresh values (a table resized, e.g. one sized "
                    "from the files with data.vocabulary=refit, or a width changed): %s", path, len(resized), "; ".join(list(resized.values())[:5]))
    return {k: wanted[k] for k in kept}


def _other_optimizer(index: TensorIndex, missing: list[str]) -> dict[str, tuple[str, str]]:
    """Of the optimizer state keys ``missing`` from the checkpoint, the parameters whose state it holds under the other
    optimizer half (``optim/dense.<param>/…`` for our ``optim/sparse.<param>/…``, or the reverse): parameter → (its
    half there, ours)."""
    halves = {"sparse": "dense", "dense": "sparse"}
    moved: dict[str, tuple[str, str]] = {}
    for key in missing:
        half = key.split("/")[1].split(".", 1)[0] if key.startswith("optim/") and key.count("/") >= 2 else ""
        param = param_of(key)
        if half in halves and any(k.startswith(f"optim/{halves[half]}.{param}/") for k in index):
            moved[param] = (halves[half], half)
    return moved


def _local(t: Any) -> torch.Tensor:
    """The local shard of a ShardedTensor (this rank's rows), or the tensor itself."""
    return t.local_tensor() if hasattr(t, "local_tensor") else t
