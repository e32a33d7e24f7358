"""Artifacts an earlier recsys_runner wrote, met by this one (docs/lifecycle.md, *Upgrading recsys_runner*):
a checkpoint without a ``format`` is read as format 1, one of a newer format is refused by name, as are a newer
version's encoders; a key added to the config since a checkpoint was written, or renamed since, is no change to warn
about."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recsys_runner.__main__ import run
from recsys_runner.checkpoint import resume_changes
from recsys_runner.checkpoint.resume_changes import ADDED_KEYS, Launched, check_changes
from recsys_runner.checkpoint.storage import FORMAT, FORMAT_KEY, list_checkpoints
from recsys_runner.data.encoding.stored import from_json
from recsys_runner.errors import CheckpointError
from recsys_runner.runtime import composed_settings
from recsys_runner.tracking import lineage

NEWER = rf"was written by a newer recsys_runner \(checkpoint format {FORMAT + 1}; this version reads format {FORMAT} and older\)"


def _edit_meta(checkpoint: Path, **changes: object) -> None:
    meta = json.loads((checkpoint / "meta.json").read_text())
    for key, value in changes.items():
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def test_a_checkpoint_records_its_format_reads_without_one_and_refuses_a_newer_one(make_cfg, tmp_path: Path) -> None:
    """Written by every checkpoint; one written before formats were recorded (no ``format``, as up to 2026-12-01) resumes
    as format 1; one a later version wrote in a newer format is refused by ``load=``, a resume and ``init_from``, naming
    both formats and the fix, and is not set aside as damaged (it is whole)."""
    args = ("checkpoint.every_steps=2", f"checkpoint.dir={tmp_path}/ck", "tracking=none", "train.sanity_eval_batches=0")
    run(make_cfg("train.num_steps=2", *args))
    (first,) = list_checkpoints(tmp_path / "ck")
    assert json.loads((first / "meta.json").read_text())[FORMAT_KEY] == FORMAT
    _edit_meta(first, **{FORMAT_KEY: None})  # as the code before formats wrote it
    assert lineage.resolve_checkpoint(str(tmp_path / "ck")) == first
    run(make_cfg("train.num_steps=4", *args))
    newest = list_checkpoints(tmp_path / "ck")[-1]
    assert newest.name == "step_00000004"
    _edit_meta(newest, **{FORMAT_KEY: FORMAT + 1})
    with pytest.raises(CheckpointError, match=NEWER):
        lineage.resolve_checkpoint(str(tmp_path / "ck"))
    with pytest.raises(CheckpointError, match=NEWER + r".*Fix: run this command with the recsys_runner version that wrote it"):
        run(make_cfg("train.num_steps=6", *args))
    assert list_checkpoints(tmp_path / "ck")[-1] == newest  # refused, never set aside as damaged
    with pytest.raises(CheckpointError, match=NEWER):
        run(make_cfg("train.num_steps=2", "tracking=none", f"checkpoint.dir={tmp_path}/tuned", f"checkpoint.init_from={newest}"))


def test_encoders_of_a_newer_format_are_refused_as_a_newer_versions() -> None:
    """Said as a newer version's, with the fix, and not wrapped as 'not a readable encoders document' (a CheckpointError
    is a ValueError, which that catch-all took)."""
    with pytest.raises(CheckpointError, match=r"^ck/encoders.json: encoders of format 2, written by a newer recsys_runner "
                                              r"\(this version reads format 1\).*Fix: run this command with the recsys_runner "
                                              r"version that trained it or a later one"):
        from_json(json.dumps({"format": 2}).encode(), "ck/encoders.json")
    with pytest.raises(CheckpointError, match=r"^ck/encoders.json: encoders of format None, this version reads format 1"):
        from_json(json.dumps({"label": "click"}).encode(), "ck/encoders.json")


ADDED_SINCE = ("train.sanity_eval_batches", "data.next_item", "precision.embedding_data_type", "data.items.header",
               "data.items.column_names")
"""Keys added after checkpoints began saving their composed config (up to 2026-12-01), named here so that dropping one's
rule from ``resume_changes.ADDED_KEYS`` fails; keys added since are in tests/resume_keys.txt, whose test guards them."""


@pytest.mark.parametrize("key", sorted({*ADDED_SINCE, *ADDED_KEYS}))
def test_resuming_a_checkpoint_saved_before_a_key_was_added_warns_of_no_change(make_cfg, tmp_path: Path, key: str) -> None:
    """A checkpoint whose composed config predates ``train.sanity_eval_batches`` or file data's ``data.next_item``
    (recsys_runner up to 2026-11-30) lacks them: resumed after the upgrade it warned ``train.sanity_eval_batches: (unset)
    -> 2`` / ``data.next_item: (unset) -> false`` and tagged the run resume_changes, though the sanity check leaves
    training unchanged bit for bit and ``next_item`` is false for every model but next-item ones, set by the model.
    So every key of ``ADDED_KEYS`` and :data:`ADDED_SINCE` (file data holds them all): its rule's value is the one a launch
    composes today, so a checkpoint lacking it resumes without a word."""
    now = composed_settings(make_cfg("data=parquet", f"data.path={tmp_path}/train.parquet", tiny=False), {})
    assert key in now
    before = {k: value for k, value in now.items() if k != key}
    assert check_changes(Launched([], before), Launched([], now), tmp_path) == ()


def test_a_renamed_key_is_compared_under_its_new_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A checkpoint saved before a key was renamed (here a dummy rename of ``train.num_steps`` from ``train.steps``, and of
    the section ``train.ema`` from ``train.average``) holds the old name: with ``resume_changes.RENAMED_KEYS`` mapping it, it resumes
    without a word when the value is the same, and warns under the new name when it is not; without the mapping it would
    warn of both names, one unset."""
    now = {"model": "deepfm", "train.num_steps": 5, "train.ema.decay": 0.9, "train.ema.eval_with_ema": False}
    before = {"model": "deepfm", "train.steps": 5, "train.average.decay": 0.9, "train.average.eval_with_ema": False}
    without_ema = {"model": "deepfm", "train.num_steps": 5}, {"model": "deepfm", "train.steps": 5}
    unmapped = check_changes(Launched([], without_ema[1]), Launched([], without_ema[0]), tmp_path)
    assert {c.key for c in unmapped} == {"train.num_steps", "train.steps"}
    with pytest.raises(CheckpointError, match=r"train.ema.decay: \(unset\) -> 0.9"):  # unmapped, the EMA looks newly turned on
        check_changes(Launched([], before), Launched([], now), tmp_path)
    monkeypatch.setattr(resume_changes, "RENAMED_KEYS", {"train.steps": "train.num_steps", "train.average": "train.ema"})
    assert check_changes(Launched([], before), Launched([], now), tmp_path) == ()
    (changed,) = check_changes(Launched([], before | {"train.steps": 3}), Launched([], now), tmp_path)
    assert changed.line() == "train.num_steps: 3 -> 5" and changed.put_back == "train.num_steps=3"
    # a checkpoint that saved only its overrides (before configs were saved) is compared under the new names too
    assert check_changes(Launched(["train.steps=5"]), Launched(["train.num_steps=5"]), tmp_path) == ()
    (changed,) = check_changes(Launched(["train.average.decay=0.5"]), Launched(["train.ema.decay=0.9"]), tmp_path)
    assert changed.line() == "train.ema.decay: 0.5 -> 0.9"
