"""What a resume may change of the settings the checkpoint's launch trained with, and what it says of each change.

A resumed run continues the experiment its checkpoint belongs to, into the same MLflow run, whose params stay the first
launch's. What the launch composed is compared with what the checkpoint's launch composed, saved in its ``meta.json``
(:func:`check_changes`: values, wherever they were set: an override, a YAML file, a default; a checkpoint that saved only
its overrides is compared by those), each changed key treated as :data:`RESUME_CHANGES` says: refused (the run would no longer be the experiment it continues), warned and
tagged on the MLflow run (it takes effect from the resumed step), or allowed silently (it changes how the run is
watched or placed, not what it learns).

A change no setting names is said as well: a resume in the middle of an epoch that cuts it into other shards
(:func:`epoch_cut_change`), and one on another number of ranks, which trains other rows per step
(:func:`rows_per_step_change`). Choosing and loading the checkpoint: :mod:`~recsys_runner.checkpoint.resume`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hydra.core.override_parser.overrides_parser import OverridesParser

from recsys_runner import uris
from recsys_runner.checkpoint.config import TrainState
from recsys_runner.checkpoint.weights import TABLE_CONVERSION
from recsys_runner.errors import CheckpointError

log = logging.getLogger(__name__)

Treatment = Literal["refuse", "warn", "silent"]

_EPOCH_POSITION = ("the position in the epoch it restores counts batches of the data as it was: the resumed run would see "
                   "other batches than the run it continues")
_CONVERTED = (f"the checkpoint's embedding tables are converted as they load: {TABLE_CONVERSION}; their optimizer state is "
              "float32 either way and loads as it was")
RESUME_CHANGES: tuple[tuple[str, Treatment, str], ...] = (
    ("checkpoint", "silent", "where and when checkpoints are written"),
    ("tracking", "silent", "where the run is recorded"),
    ("storage", "silent", "how object stores are reached"),
    ("distributed", "silent", "ranks and sharding plan: a checkpoint reshards on load"),
    ("train.stop_after_steps", "silent", "a time slice"),
    ("train.stop_check_every_steps", "silent", "how often ranks agree to stop"),
    ("train.log_every_steps", "silent", "log cadence"),
    ("train.progress", "silent", "the progress display"),
    ("train.profile", "silent", "the profiler"),
    ("train.summary_every_steps", "silent", "summary cadence"),
    ("train.summary_histograms", "silent", "summaries"),
    ("train.sanity_eval_batches", "silent", "a check before the first step, which leaves training unchanged bit for bit "
                                            "(a checkpoint written before it existed lacks it)"),
    ("data.num_workers", "silent", "loader processes"),
    ("data.pin_memory", "silent", "host memory"),
    ("data.worker_start", "silent", "how loader processes start: the same batches"),
    ("seed", "refuse", "the resumed run restores the RNG states the checkpoint saved: a new seed would be logged nowhere "
                       "and change nothing"),
    ("data", "refuse", "another data option: " + _EPOCH_POSITION),
    ("data.path", "refuse", "other training files: " + _EPOCH_POSITION),
    ("data.batch_size", "refuse", _EPOCH_POSITION),
    ("data.batch_tokens", "refuse", _EPOCH_POSITION),
    ("data.seed", "refuse", "another shuffle order: " + _EPOCH_POSITION),
    ("data.shuffle", "refuse", _EPOCH_POSITION),
    ("data.drop_remainder", "refuse", _EPOCH_POSITION),
    ("data.group_by_length", "refuse", _EPOCH_POSITION),
    ("data.negative_rate", "refuse", "other rows of each epoch are trained (the negatives kept), and the checkpoint's outputs "
                                     "are corrected by the rate it trained with: " + _EPOCH_POSITION),
    ("train.grad_accum_steps", "refuse", "a step trains that many batches, and the position in the epoch it restores counts "
                                         "steps: the resumed run would skip another number of batches than the run it "
                                         "continues trained (rows left out or trained twice), and train more or fewer rows "
                                         "per step"),
    ("experiment", "refuse", "another preset: its model, data and optimizer settings are another experiment's"),
    ("model", "refuse", "another model: its weights are not the checkpoint's"),
    ("optim", "refuse", "another optimizer: the optimizer state saved is another's"),
    ("optim/sparse", "refuse", "another sparse optimizer: the optimizer state saved is another's"),
    ("optim/dense", "refuse", "another dense optimizer: the optimizer state saved is another's"),
    ("precision.embedding_data_type", "warn", _CONVERTED),
    ("precision.embedding_data_type_by_feature", "warn", _CONVERTED),
)
"""How a resume treats a setting whose value differs from the launch that wrote the checkpoint: the first entry whose
key is the setting's key (a group's for its option: ``model``, ``optim/sparse``), or a section above it (``data`` for ``data=parquet`` only; ``checkpoint`` for
``checkpoint.every_steps``), decides; a key no entry names (``optim.lr``, ``train.num_steps``, ``scheduler``,
``model.dropout`` …) is warned about (:data:`WARNED_BY_DEFAULT`); a ``warn`` entry's own reason is added to the warning. Shapes that cannot load (``model.embedding_dim``) are
refused by the loader, naming the tensors."""
TURNED_ON: dict[str, str] = {
    "train.ema.decay": "the checkpoint's run trained without a moving average of the dense weights, so it holds none to "
                       "continue; a new run from these weights starts the average at the weights loaded",
}
"""Keys a resume refuses to turn on (from ``null`` or unset to a value), though it lets their value change otherwise: the
checkpoint was written without the state they keep, so the loader would only find its tensors missing (``ema/…``), which
names no setting; refused here instead, naming the key and the way on, as a :data:`RESUME_CHANGES` refusal is."""
ADDED_KEYS: dict[str, Any] = {"precision.embedding_data_type": "fp32", "data.items.header": None, "data.items.column_names": None,
                              "data.next_item": False, "data.funnel": None, "data.negative_rate": None}
"""Keys added after checkpoints began saving their composed config, each with the value every run before it trained with:
such a checkpoint's missing key is compared as that value, so resuming it after an upgrade warns about no change."""
RENAMED_KEYS: dict[str, str] = {}
"""Keys renamed after checkpoints began saving their composed config: old dotted key -> new dotted key (a section's name
renames every key under it: ``"train.ema": "train.average"`` takes ``train.ema.decay`` to ``train.average.decay``). A
checkpoint that saved the old name (in its config or its overrides) is compared under the new one
(:func:`under_new_names`), so resuming it after the rename warns of no change, and of a real change of the value as of
any other key's. tests/test_resume_keys.py checks that a key gone from the config beside a new one is mapped here."""
SECTIONS = ("checkpoint", "tracking", "storage", "distributed", "train.profile", "precision.embedding_data_type_by_feature")
"""The entries of :data:`RESUME_CHANGES` that cover every key under them; the others name one key (or a group's choice)."""
WARNED_BY_DEFAULT = ("takes effect from the resumed step; the MLflow run's params keep the first launch's value (the run is "
                     "tagged resume_changes)")


@dataclass(frozen=True)
class Launched:
    """What one launch trained with, as a resume compares it: the launch that wrote a checkpoint (:meth:`saved`, its
    ``meta.json``) or this one (the checkpointer's)."""

    overrides: Sequence[str] | None = None
    """Its command-line overrides; ``None`` outside the CLI."""
    config: Mapping[str, Any] | None = None
    """What Hydra composed, flattened (:func:`recsys_runner.runtime.composed_settings`): every key's value and group's
    choice; ``None`` outside the CLI and in a checkpoint written before it was saved."""
    cwd: str | None = None
    """The directory it was launched in: relative paths among its values are read from there."""

    @classmethod
    def saved(cls, meta: Mapping[str, Any]) -> Launched:
        """The launch that wrote the checkpoint whose ``meta.json`` is ``meta``."""
        return cls(meta.get("overrides"), meta.get("config"), meta.get("cwd"))


@dataclass(frozen=True)
class Change:
    """One setting whose value differs between the checkpoint's launch and this one."""

    key: str
    saved: str
    """Its value at the launch that wrote the checkpoint, as an override would write it (``(default)`` when that
    launch's overrides left it at its default, ``(unset)`` when its config had no such key)."""
    now: str
    treatment: Treatment
    why: str
    put_back: str
    """The override that restores the saved value (``data.seed=1``, ``~key`` for a key the checkpoint's launch lacked)."""

    def line(self) -> str:
        """``key: saved -> now``, with the reason when :data:`RESUME_CHANGES` gives this key one of its own."""
        line = f"{self.key}: {self.saved} -> {self.now}"
        return line if self.why == WARNED_BY_DEFAULT else f"{line} ({self.why})"


_ABSENT = object()
"""A key the launch did not have (no override for it; no such key in its config)."""


def _text(value: Any) -> str:
    """``value`` as an override writes it: ``null``, ``true``, ``0.05``, ``[256,128,64]``, ``{a:1}`` quoted as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))


def _by_key(overrides: Sequence[str]) -> dict[str, Any]:
    """``key -> value`` of Hydra overrides, the values parsed as Hydra parses them (``0.1`` and ``1e-1`` the same float,
    ``{a:1,b:2}`` the same mapping in any order, ``+``/``++`` dropped); a ``~key`` deletion is left out (the default)."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 - Hydra accepted these at launch; one that no longer parses compares as text
        return {k.lstrip("+"): v for k, _, v in (o.partition("=") for o in overrides) if not k.startswith("~")}
    return {o.key_or_group + (f"@{o.package}" if o.package else ""): o.get_value_element_as_str() if o.is_sweep_override() else o.value()
            for o in parsed if not o.is_delete()}


def _same(before: Any, after: Any, cwd_before: str | None, cwd_after: str | None) -> bool:
    """Whether two values are the same setting: equal values, or two spellings of one local path (``./d`` and
    ``$PWD/d``), each read from the directory its launch started in."""
    if before == after:
        return True
    if not (isinstance(before, str) and isinstance(after, str)) or uris.is_uri(before) or uris.is_uri(after):
        return False
    here = os.getcwd()

    def where(text: str, cwd: str | None) -> str:
        return os.path.normpath(os.path.join(cwd or cwd_after or here, os.path.expanduser(text)))

    return where(before, cwd_before) == where(after, cwd_after)


def renamed(key: str) -> str:
    """``key`` under its name today: :data:`RENAMED_KEYS`' new name for it (or for the section it is under), else itself."""
    for old, new in RENAMED_KEYS.items():
        if key == old or key.startswith(f"{old}."):
            return new + key[len(old):]
    return key


def under_new_names(values: Mapping[str, Any]) -> dict[str, Any]:
    """A launch's ``key -> value`` with each renamed key (:data:`RENAMED_KEYS`) under its new name; where a launch has
    both names, the new name's value stands."""
    return {renamed(key): value for key, value in values.items() if renamed(key) == key or renamed(key) not in values}


def renamed_override(text: str) -> str:
    """A saved override (``+train.steps=5``) with its key under its name today (``+train.num_steps=5``): what a checkpoint's
    launch wrote, for a command that carries it (``load=``, :func:`recsys_runner.inference.training_overrides`)."""
    body = text.lstrip("+~")
    key, equals, value = body.partition("=")
    return f"{text[:len(text) - len(body)]}{renamed(key)}{equals}{value}"


def treatment(key: str, before: Any = None, after: Any = None) -> tuple[Treatment, str]:
    """How :data:`RESUME_CHANGES` treats a change of ``key`` from ``before`` to ``after`` (refused when it turns on a
    :data:`TURNED_ON` key: ``None`` or absent before, a value now)."""
    if key in TURNED_ON and before in (None, _ABSENT) and after not in (None, _ABSENT):
        return "refuse", TURNED_ON[key]
    for entry, how, why in RESUME_CHANGES:
        if key == entry or (entry in SECTIONS and key.startswith((f"{entry}.", f"{entry}/"))):
            return how, why
    return "warn", WARNED_BY_DEFAULT


def check_changes(saved: Launched, now: Launched, path: Path) -> tuple[Change, ...]:
    """The changes to warn about (:func:`note_changes`) of resuming ``path``, whose launch was ``saved``, with the launch
    ``now``; ``()`` when nothing warned about changed, or when the two cannot be compared (a run outside the CLI).

    The composed configs are compared where both launches saved one, so a setting changed in a YAML file (or a
    default changed in the code) counts as one changed on the command line (a key added since, :data:`ADDED_KEYS`, as the
    value earlier runs had; a key renamed since, :data:`RENAMED_KEYS`, under its new name); keys under a group whose option changed
    come with the option and are not listed apart. A checkpoint written before configs were saved is compared by its
    overrides. Either way values are compared, not spellings.

    Raises:
        CheckpointError: a change :data:`RESUME_CHANGES` refuses, each named with why and the two ways on.
    """
    if saved.config is not None and now.config is not None:
        before, after = ADDED_KEYS | under_new_names(saved.config), ADDED_KEYS | under_new_names(now.config)
        absent = "(unset)"
    elif saved.overrides is not None and now.overrides is not None:
        before, after, absent = under_new_names(_by_key(saved.overrides)), under_new_names(_by_key(now.overrides)), "(default)"
    else:
        return ()
    differ = [key for key in sorted(before.keys() | after.keys())
              if not _same(before.get(key, _ABSENT), after.get(key, _ABSENT), saved.cwd, now.cwd)]
    rechosen = tuple(f"{key.replace('/', '.')}." for key in differ if saved.config is not None and "." not in key)

    def shown(values: Mapping[str, Any], key: str) -> str:
        return _text(values[key]) if key in values else absent

    changes = [Change(key, shown(before, key), shown(after, key), *treatment(key, before.get(key, _ABSENT), after.get(key, _ABSENT)),
                      put_back=f"{key}={_text(before[key])}" if key in before else f"~{key}")
               for key in differ if not key.startswith(rechosen)]
    refused = [c for c in changes if c.treatment == "refuse"]
    if refused:
        named = "; ".join(c.line() for c in refused)
        if saved.config is not None:
            own = (f"put back {' '.join(c.put_back for c in refused)} on the command line, or undo the edit of the config file "
                   f"that changed it; the first launch's overrides and composed config are in {path}/meta.json")
        else:
            own = f"its overrides are in {path}/meta.json"
        raise CheckpointError(f"resuming {path} with changed settings that would make it another experiment: {named}. Fix: "
                              f"resume with the run's own settings ({own}), or start a new run from these weights in its own "
                              f"checkpoint.dir (drop the override for a new one) with checkpoint.init_from={path}")
    return tuple(c for c in changes if c.treatment == "warn")


def note_changes(path: Path, changes: Sequence[str]) -> None:
    """The one warning naming the settings :func:`check_changes` let through, once the checkpoint loaded (a change the
    loader refuses, a table's width, is not warned about first)."""
    if changes:
        log.warning("resuming %s with changed settings: %s. Each %s", path, "; ".join(changes), WARNED_BY_DEFAULT)


DATA_SHARDS_KEY = "data_shards_per_rank"
"""``meta.json``'s record of the data's shards per rank (:meth:`~recsys_runner.data.base.DataModule.shards_per_rank`),
beside ``world_size``: together they say how the rows of an epoch were cut when the checkpoint was written."""


def epoch_cut_change(meta: Mapping[str, Any], state: TrainState, world_size: int, shards: int | None) -> tuple[str, str] | None:
    """``(change line, warning)`` when a resume in the middle of an epoch (``state.epoch_step > 0``) reads that epoch cut
    into other shards (``world_size`` × ``shards`` per rank) than the run that wrote ``meta`` did; ``None`` when they
    agree, at an epoch's end, or when this run does not say (a checkpoint written before the shards were saved is
    compared by its ranks alone).

    Why: the position it restores is a count of the epoch's batches, and which rows those are follows the shards (file
    data: each rank and each of its DataLoader workers reads its own share; ``data.num_workers=auto`` decides by the
    device, so a resume on another machine may change it without an override). Skipping that many batches of an epoch
    ordered otherwise trains some of its rows twice and others never; a supported move (to fewer ranks, off a GPU) is
    warned about, not refused."""
    if not state.epoch_step or shards is None:
        return None
    # a checkpoint written before the shards were saved: its ranks are all that can be compared
    saved_ranks, saved_shards = int(meta.get("world_size", 1)), int(meta.get(DATA_SHARDS_KEY, shards))
    if (saved_ranks, saved_shards) == (world_size, shards):
        return None
    line = f"data shards: {saved_ranks} rank(s) x {saved_shards} -> {world_size} rank(s) x {shards} (mid-epoch)"
    fixes = []
    if saved_shards != shards:
        fixes.append(f"data.num_workers={saved_shards if saved_shards > 1 else 0}")
    if saved_ranks != world_size:
        fixes.append(f"{saved_ranks} rank(s)")
    warning = (f"in the middle of epoch {state.epoch} (step {state.epoch_step} of it), whose rows it now cuts into other shards than the "
               f"run it continues: {saved_ranks} rank(s) x {saved_shards} shard(s) per rank then, {world_size} rank(s) x {shards} now "
               f"(file data: each rank and each of its data.num_workers DataLoader workers reads its own share; data.num_workers=auto "
               f"decides by the device). The order of the epoch's batches follows the shards, so the batches skipped to reach the "
               f"step are not the ones the checkpoint trained: rows of this epoch are trained twice or never (the epochs after it "
               f"are whole). Fix: resume with {' on '.join(fixes)}, as the run was written")
    return line, warning


def rows_per_step_change(meta: Mapping[str, Any], path: Path, world_size: int) -> tuple[str, str] | None:
    """``(change line, warning)`` when a resume runs on another number of ranks than the run that wrote ``meta`` (its
    checkpoint ``path``); ``None`` on as many.

    Why: ``data.batch_size`` (and ``data.batch_tokens``) is per rank, so a step trains ``ranks × data.batch_size ×
    train.grad_accum_steps`` rows, and resharding onto another number of ranks changes that for every step after the
    checkpoint, while ``train.num_steps``, the lr schedule and the eval and checkpoint cadence still count steps: the
    same change of the global batch as another ``data.batch_size``, which a resume refuses, but allowed (a checkpoint
    reshards) and, at an epoch's end, said by nothing else. The fix that keeps the rows per step on other ranks is a new
    run from these weights with the per-rank batch scaled, which a resume cannot take."""
    saved = int(meta.get("world_size", 1))
    if saved == world_size:
        return None
    config = meta.get("config") or {}
    batch, accumulation = config.get("data.batch_size"), config.get("train.grad_accum_steps", 1)
    line = f"ranks: {saved} -> {world_size} (rows per step x{world_size / saved:g})"
    if isinstance(batch, int) and isinstance(accumulation, int) and config.get("data.batch_tokens") is None:
        rows = (f"{world_size} x data.batch_size={batch} x train.grad_accum_steps={accumulation} = "
                f"{world_size * batch * accumulation} rows, {saved * batch * accumulation} before")
        scaled = saved * batch / world_size
        keep = f" data.batch_size={int(scaled)}" if scaled == int(scaled) else ""
    else:
        rows, keep = f"{world_size}/{saved} as many rows as before", ""
    warning = (f"on {world_size} rank(s), written by {saved}: data.batch_size is per rank, so each step from here on trains "
               f"{rows}, while train.num_steps, the lr schedule and the eval and checkpoint cadence still count steps. Fix: "
               f"resume on {saved} rank(s) to keep the rows per step, or start a new run from these weights in its own "
               f"checkpoint.dir with checkpoint.init_from={path}{keep}")
    return line, warning
