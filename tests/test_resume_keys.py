"""The guard against a resume's false warning about a new config key: the keys every option composes today against the
snapshot ``tests/resume_keys.txt`` (:mod:`tests.resume_keys`). A key added since must come with a rule that makes a
checkpoint written before it resume without a word (``resume.ADDED_KEYS``, or a ``silent`` entry of
``resume.RESUME_CHANGES``), then the snapshot is rewritten (docs/architecture.md, "Adding a config key")."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recsys_runner.checkpoint.resume import Launched, check_changes
from recsys_runner.errors import CheckpointError
from tests.resume_keys import compose_options, read_snapshot

REWRITE = "python -m tests.resume_keys --write"


def resumes_silently(key: str, settings: Mapping[str, Any], path: Path) -> bool:
    """Whether a checkpoint saved with ``settings`` less ``key`` (written before the key existed) resumes with
    ``settings`` without a warning or a refusal."""
    before = {k: value for k, value in settings.items() if k != key}
    try:
        return check_changes(Launched([], before), Launched([], dict(settings)), path) == ()
    except CheckpointError:
        return False


def problems(options: Mapping[str, Mapping[str, Any]], snapshot: Mapping[str, set[str]], path: Path) -> list[str]:
    """What differs between the keys ``options`` compose and ``snapshot``, each with its fix; ``[]`` when nothing."""
    new: dict[str, list[str]] = {}
    gone: dict[str, list[str]] = {}
    out = [f"{option}: a new option, which no checkpoint written before used. Fix: {REWRITE}"
           for option in sorted(options.keys() - snapshot.keys())]
    out += [f"{option}: the option is gone. Fix: {REWRITE}" for option in sorted(snapshot.keys() - options.keys())]
    for option in sorted(options.keys() & snapshot.keys()):
        for key in sorted(options[option].keys() - snapshot[option]):
            new.setdefault(key, []).append(option)
        for key in sorted(snapshot[option] - options[option].keys()):
            gone.setdefault(key, []).append(option)
    for key, under in new.items():
        where = f"{key} (new under {under[0]}{f' and {len(under) - 1} more options' if len(under) > 1 else ''})"
        if resumes_silently(key, options[under[0]], path):
            out.append(f"{where}: resume has a rule for it. Fix: {REWRITE}")
        else:
            out.append(f"{where}: a checkpoint written before lacks it, so resuming one after the upgrade would warn "
                       f"'{key}: (unset) -> ...' (or refuse it) though nothing changed. Fix: add it to ADDED_KEYS in "
                       f"recsys_runner/checkpoint/resume.py with the value every earlier run trained with (or give it a "
                       f"'silent' entry in RESUME_CHANGES if it changes nothing learned), then {REWRITE}")
    for key, under in gone.items():
        out.append(f"{key} (gone from {under[0]}{f' and {len(under) - 1} more options' if len(under) > 1 else ''}): removed or "
                   f"renamed. A checkpoint that saved it resumes with a warning '{key}: <its value> -> (unset)' (refused "
                   f"where RESUME_CHANGES refuses the key). Fix: {REWRITE}; and consider old checkpoints' value of it: if "
                   f"it no longer changes what is trained give it a 'silent' entry in RESUME_CHANGES; if it was renamed, "
                   f"the new name needs ADDED_KEYS with the value earlier runs trained with")
    return out


def test_every_config_key_is_in_the_snapshot_or_resume_has_a_rule_for_it(tmp_path: Path) -> None:
    """Every option of every group composed in-process (~50 composes, a few seconds) against tests/resume_keys.txt."""
    found = problems(compose_options(), read_snapshot(), tmp_path)
    assert not found, "config keys differ from tests/resume_keys.txt:\n" + "\n".join(found)


def test_the_guard_names_each_kind_of_difference_with_its_fix(tmp_path: Path) -> None:
    """A new key without a rule, one with a rule (``ADDED_KEYS``, a ``silent`` entry), a new option and a gone key each
    get their own fix, against a snapshot of two options (no composing: the keys are given)."""
    now = {"model": "deepfm", "optim.lr": 0.1, "train.num_steps": 5, "data.next_item": False, "train.progress": "auto"}
    snapshot = {"model=deepfm": {"model", "optim.lr", "train.num_steps", "model.dropout"}, "model=dlrm": {"model"}}
    found = problems({"model=deepfm": now, "model=dlrm": {"model": "dlrm"}, "model=new": {"model": "new"}}, snapshot, tmp_path)
    assert found[0] == f"model=new: a new option, which no checkpoint written before used. Fix: {REWRITE}"
    assert found[1] == f"data.next_item (new under model=deepfm): resume has a rule for it. Fix: {REWRITE}"  # ADDED_KEYS
    assert found[2] == f"train.progress (new under model=deepfm): resume has a rule for it. Fix: {REWRITE}"  # silent
    assert found[3].startswith("model.dropout (gone from model=deepfm): removed or renamed. A checkpoint that saved it resumes "
                               "with a warning 'model.dropout: <its value> -> (unset)'")
    assert len(found) == 4
    found = problems({"model=deepfm": {**now, "train.new_key": 3}}, {"model=deepfm": set(now)}, tmp_path)
    assert found == [f"train.new_key (new under model=deepfm): a checkpoint written before lacks it, so resuming one after the "
                     f"upgrade would warn 'train.new_key: (unset) -> ...' (or refuse it) though nothing changed. Fix: add it to "
                     f"ADDED_KEYS in recsys_runner/checkpoint/resume.py with the value every earlier run trained with (or give "
                     f"it a 'silent' entry in RESUME_CHANGES if it changes nothing learned), then {REWRITE}"]
