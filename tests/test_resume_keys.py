"""The guard against a resume's false warning about a new config key: the keys every option composes today against the
snapshot ``tests/resume_keys.txt`` (:mod:`tests.resume_keys`). A key added since must come with a rule that makes a
checkpoint written before it resume without a word (``resume_changes.ADDED_KEYS``, or a ``silent`` entry of
``resume_changes.RESUME_CHANGES``); a key renamed, an entry of ``resume_changes.RENAMED_KEYS``; then the snapshot is rewritten
(docs/architecture.md, "Adding a config key", "Renaming a config key")."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from recsys_runner.checkpoint import resume_changes
from recsys_runner.checkpoint.resume_changes import Launched, check_changes, renamed
from recsys_runner.errors import CheckpointError
from tests.resume_keys import _owned, _rounds, compose_options, read_snapshot

REWRITE = "python -m tests.resume_keys --write"


def resumes_silently(key: str, settings: Mapping[str, Any], path: Path, saved_as: str | None = None) -> bool:
    """Whether a checkpoint saved with ``settings`` less ``key`` (written before the key existed), or with ``key`` under
    the name ``saved_as`` (written before it was renamed), resumes with ``settings`` without a warning or a refusal."""
    before = {k: value for k, value in settings.items() if k != key}
    if saved_as is not None:
        before[saved_as] = settings[key]
    try:
        return check_changes(Launched([], before), Launched([], dict(settings)), path) == ()
    except CheckpointError:
        return False


def _where(key: str, under: list[str], how: str) -> str:
    return f"{key} ({how} {under[0]}{f' and {len(under) - 1} more options' if len(under) > 1 else ''})"


def problems(options: Mapping[str, Mapping[str, Any]], snapshot: Mapping[str, set[str]], path: Path) -> list[str]:
    """What differs between the keys ``options`` compose and ``snapshot``, each with its fix; ``[]`` when nothing. A key
    gone where a new one appears is a rename when ``resume_changes.RENAMED_KEYS`` maps the one to the other (and a checkpoint that
    saved the old name then resumes without a word); else both fixes are named: the rename's, or the new key's and the
    removal's."""
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
    renames = {old: renamed(old) for old in gone if renamed(old) in new}
    for old, key in renames.items():
        if resumes_silently(key, options[new[key][0]], path, saved_as=old):
            out.append(f"{_where(key, new[key], 'new under')}: {old} renamed, as resume_changes.RENAMED_KEYS says. Fix: {REWRITE}")
        else:
            out.append(f"{_where(key, new[key], 'new under')}: {old} renamed (resume_changes.RENAMED_KEYS), yet a checkpoint that saved "
                       f"{old} does not resume without a word. Fix: map the old name to the new one in RENAMED_KEYS, or, if "
                       f"the value's meaning changed, give {key} its own rule, then {REWRITE}")
    for key, under in new.items():
        if key in renames.values():
            continue
        where = _where(key, under, "new under")
        candidates = sorted(old for old, was in gone.items() if old not in renames and set(was) & set(under))
        if resumes_silently(key, options[under[0]], path):
            out.append(f"{where}: resume has a rule for it. Fix: {REWRITE}")
        elif candidates:
            out.append(f"{where}: new where {', '.join(candidates)} is gone. A checkpoint written before would resume with a "
                       f"warning of both though nothing changed. Fix: if {key} is {candidates[0]} renamed, add "
                       f"'{candidates[0]}': '{key}' to RENAMED_KEYS in recsys_runner/checkpoint/resume_changes.py; if it is a new key, "
                       f"add it to ADDED_KEYS there with the value every earlier run trained with (or give it a 'silent' "
                       f"entry in RESUME_CHANGES if it changes nothing learned), and see to the removal (below); then {REWRITE}")
        else:
            out.append(f"{where}: a checkpoint written before lacks it, so resuming one after the upgrade would warn "
                       f"'{key}: (unset) -> ...' (or refuse it) though nothing changed. Fix: add it to ADDED_KEYS in "
                       f"recsys_runner/checkpoint/resume_changes.py with the value every earlier run trained with (or give it a "
                       f"'silent' entry in RESUME_CHANGES if it changes nothing learned); if it is a key renamed, map the old "
                       f"name to it in RENAMED_KEYS instead; then {REWRITE}")
    for key, under in gone.items():
        if key in renames:
            continue
        out.append(f"{_where(key, under, 'gone from')}: removed or renamed. A checkpoint that saved it resumes with a warning "
                   f"'{key}: <its value> -> (unset)' (refused where RESUME_CHANGES refuses the key). Fix: if it was renamed, "
                   f"add '{key}': '<its new name>' to RENAMED_KEYS in recsys_runner/checkpoint/resume_changes.py, so an old "
                   f"checkpoint's value is compared under the new name; if it was removed, give it a 'silent' entry in "
                   f"RESUME_CHANGES if it no longer changes what is trained; then {REWRITE}")
    return out


def test_every_config_key_is_in_the_snapshot_or_resume_has_a_rule_for_it(tmp_path: Path) -> None:
    """Every option of every group composed in-process (~20 composes in rounds, tests.resume_keys.compose_options)
    against tests/resume_keys.txt."""
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
                     f"ADDED_KEYS in recsys_runner/checkpoint/resume_changes.py with the value every earlier run trained with (or give "
                     f"it a 'silent' entry in RESUME_CHANGES if it changes nothing learned); if it is a key renamed, map the "
                     f"old name to it in RENAMED_KEYS instead; then {REWRITE}"]


def test_a_key_gone_beside_a_new_one_is_a_rename_when_renamed_keys_maps_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dummy rename (``train.steps`` to ``train.num_steps``): unmapped, the new key's line names both fixes (a
    ``RENAMED_KEYS`` entry, or ``ADDED_KEYS`` and the removal's) and the gone key's says how a rename is mapped; mapped in
    ``resume_changes.RENAMED_KEYS``, it is accepted (the snapshot is to be rewritten, nothing else)."""
    now = {"model=deepfm": {"model": "deepfm", "train.num_steps": 5}, "model=dlrm": {"model": "dlrm", "train.num_steps": 5}}
    snapshot = {"model=deepfm": {"model", "train.steps"}, "model=dlrm": {"model", "train.steps"}}
    new, gone = problems(now, snapshot, tmp_path)
    assert new.startswith("train.num_steps (new under model=deepfm and 1 more options): new where train.steps is gone.")
    assert "Fix: if train.num_steps is train.steps renamed, add 'train.steps': 'train.num_steps' to RENAMED_KEYS" in new
    assert "if it is a new key, add it to ADDED_KEYS there with the value every earlier run trained with" in new
    assert gone.startswith("train.steps (gone from model=deepfm and 1 more options): removed or renamed.")
    assert "Fix: if it was renamed, add 'train.steps': '<its new name>' to RENAMED_KEYS" in gone
    monkeypatch.setattr(resume_changes, "RENAMED_KEYS", {"train.steps": "train.num_steps"})
    assert problems(now, snapshot, tmp_path) == [f"train.num_steps (new under model=deepfm and 1 more options): train.steps "
                                                 f"renamed, as resume_changes.RENAMED_KEYS says. Fix: {REWRITE}"]


def test_a_round_chooses_one_option_per_group_and_never_a_group_with_its_subgroup() -> None:
    """The rounds ``compose_options`` composes in (each option's settings are the round's under its group): two options of
    one group, or ``optim=sgd`` (which chooses ``optim/sparse`` itself) beside ``optim/sparse=adam``, would mix."""
    varied = [("model", "dlrm"), ("model", "dcn"), ("data", "csv"), ("optim", "sgd"), ("optim", "adam"),
              ("optim/sparse", "adam"), ("optim/sparse", "sgd"), ("optim/dense", "adam")]
    rounds = _rounds(varied)
    assert sorted(v for chosen in rounds for v in chosen) == sorted(varied)
    for chosen in rounds:
        groups = [group for group, _ in chosen]
        assert len(groups) == len(set(groups)) and not ("optim" in groups and any(g.startswith("optim/") for g in groups))
    assert len(rounds) == 4  # optim's 2 options, then optim/sparse's 2 beside optim/dense's 1
    assert _owned("optim", "optim.sparse.lr") and _owned("optim", "optim/sparse") and not _owned("optim/sparse", "optim.lr")
    assert _owned("data", "experiment/data@data") and not _owned("model", "data.path")
