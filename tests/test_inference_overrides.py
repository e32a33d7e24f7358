"""What evaluate, predict and export take from the command line and from the checkpoint (issue 30): a group the command
chooses drops the training's overrides under it, and ``load=`` is checked before anything about the data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recsys_runner import evaluate, export, predict
from recsys_runner.checkpoint import resume_changes
from recsys_runner.errors import CheckpointError, ConfigError
from recsys_runner.inference import carry_into_argv
from tests.test_evaluate import compose_entry


def fake_checkpoint(root: Path, overrides: list[str]) -> Path:
    """A checkpoints root whose one step checkpoint looks complete and names the training launch's ``overrides`` (its
    weights are never loaded here)."""
    step = root / "step_00000010"
    step.mkdir(parents=True)
    (step / ".metadata").touch()
    (step / "meta.json").write_text(json.dumps({"step": 10, "overrides": overrides}))
    return root


def test_a_group_chosen_here_drops_the_trainings_overrides_under_it(tmp_path: Path) -> None:
    """``predict … tracking=none`` on a run trained with ``tracking.uri=…``: the training's ``tracking.*`` belong to its
    ``mlflow`` option, which ``none`` lacks (Hydra: "Could not override 'tracking.uri'"); they are left out, the rest is
    carried, and the command's config composes."""
    root = fake_checkpoint(tmp_path / "ck", ["model=dlrm", "model.embedding_dim=8", f"tracking.uri=sqlite:///{tmp_path}/m.db",
                                             "tracking.experiment=trained", "checkpoint.resume=auto"])
    argv = ["predict", f"load={root}", "tracking=none", f"predict.output={tmp_path}/out"]
    carried = carry_into_argv(argv)
    assert carried is not None
    assert carried.overrides == ("model=dlrm", "model.embedding_dim=8")
    assert carried.dropped == (f"tracking.uri=sqlite:///{tmp_path}/m.db", "tracking.experiment=trained")
    cfg = compose_entry("predict", *argv[1:])
    assert cfg.model._target_.endswith("DLRM") and cfg.model.embedding_dim == 8
    assert "uri" not in cfg.tracking and cfg.tracking._target_.endswith("NullTracker")


def test_the_same_option_chosen_again_keeps_the_trainings_settings_of_it(tmp_path: Path) -> None:
    """``evaluate load=… data=parquet data.eval_path=…`` where the training chose ``data=parquet data.path=…``: its
    ``data.path`` still holds; another option (``data=csv``) drops it."""
    root = fake_checkpoint(tmp_path / "ck", ["data=parquet", f"data.path={tmp_path}/train.parquet", "model=fm"])
    argv = ["evaluate", f"load={root}", "data=parquet", f"data.eval_path={tmp_path}/day2.parquet"]
    carried = carry_into_argv(argv)
    assert carried is not None and carried.overrides == (f"data.path={tmp_path}/train.parquet", "model=fm") and not carried.dropped
    cfg = compose_entry("evaluate", *argv[1:])
    assert cfg.data.path == f"{tmp_path}/train.parquet" and cfg.data.eval_path == f"{tmp_path}/day2.parquet"
    other = carry_into_argv(["evaluate", f"load={root}", "data=csv"])
    assert other is not None and other.overrides == ("model=fm",) and other.dropped == (f"data.path={tmp_path}/train.parquet",)


def test_a_key_renamed_since_the_training_is_carried_under_its_new_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint whose launch set a key since renamed (a dummy rename: ``model.width`` to ``model.embedding_dim``,
    in ``resume_changes.RENAMED_KEYS``): ``load=`` carries its override under the new name, which composes; the old name would be
    an unknown key."""
    monkeypatch.setattr(resume_changes, "RENAMED_KEYS", {"model.width": "model.embedding_dim"})
    root = fake_checkpoint(tmp_path / "ck", ["model=dlrm", "model.width=8"])
    argv = ["evaluate", f"load={root}"]
    carried = carry_into_argv(argv)
    assert carried is not None and carried.overrides == ("model=dlrm", "model.embedding_dim=8")
    assert compose_entry("evaluate", *argv[1:]).model.embedding_dim == 8


@pytest.mark.parametrize("entry", ["evaluate", "predict", "export"])
def test_load_is_checked_before_the_data(entry: str, tmp_path: Path) -> None:
    """A ``load=`` that names no checkpoint is the first error, before the data's (here: file data without a path, which
    validation refuses, and for predict scoring generated data)."""
    module = {"evaluate": evaluate, "predict": predict, "export": export}[entry]
    export.register()
    for data in (["data=parquet"], []):
        cfg = compose_entry(entry, *data, f"load={tmp_path}/nothing", f"predict.output={tmp_path}/out" if entry == "predict" else
                            f"export.dir={tmp_path}/exported" if entry == "export" else "tracking=none")
        with pytest.raises(CheckpointError, match=r"checkpoint '.*nothing' is neither a directory nor a known MLflow run id"):
            module.run(cfg)


def test_without_load_a_misspelt_load_is_named_first(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key lod \(did you mean load\?\)"):
        predict.run(compose_entry("predict", "+lod=x", f"predict.output={tmp_path}/out"))
    with pytest.raises(ConfigError, match="load is required"):
        predict.run(compose_entry("predict", f"predict.output={tmp_path}/out"))
