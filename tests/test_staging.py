"""An output folder replaced as a whole (recsys_runner/staging.py), on the local disk and in a real S3-compatible store
(moto on loopback): the new output whole or the earlier one, never both mixed; nothing left behind by an error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from recsys_runner import store_settings, stores, uris
from recsys_runner.errors import ConfigError
from recsys_runner.staging import StagedFolder, held_names, is_local_file
from tests.object_store import MotoServer, moto_with_buckets


def _write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def test_local_output_is_replaced_whole_and_an_error_leaves_the_earlier_one(tmp_path: Path) -> None:
    out = tmp_path / "export"
    _write(out, {"old.txt": "old", "keep/nested.txt": "old"})
    assert held_names(out, "export.dir") == ["keep", "old.txt"]
    assert is_local_file(out, "old.txt") and not is_local_file(out, "keep")

    with pytest.raises(RuntimeError, match="^stopped before the commit$"), StagedFolder(out) as staged:
        _write(staged.path, {"new.txt": "new"})
        raise RuntimeError("stopped before the commit")
    assert held_names(out, "export.dir") == ["keep", "old.txt"]  # as it was
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no staging folder left

    with StagedFolder(out) as staged:
        _write(staged.path, {"new.txt": "new", "model/MLmodel": "x"})
        assert staged.local == staged.path
        staged.commit()
        assert staged.local == out.absolute()
    assert held_names(out, "export.dir") == ["model", "new.txt"]  # nothing of the earlier output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_local_file_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"export.dir=.*notes.txt is a file, not a folder"):
        held_names(tmp_path / "notes.txt", f"export.dir={tmp_path / 'notes.txt'}")
    assert held_names(tmp_path / "missing", "export.dir") == []


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    with moto_with_buckets(tmp_path_factory.mktemp("s3"), "out") as server:
        yield server


@pytest.fixture
def store(server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoServer]:
    with server.as_client(monkeypatch, store_settings.StorageConfig(max_attempts=2, connect_timeout_s=2, request_timeout_s=5)):
        yield server


def test_store_output_is_uploaded_whole_and_the_earlier_objects_are_gone(store: MotoServer, tmp_path: Path) -> None:
    out = uris.as_path("s3://out/export")
    assert uris.is_remote(out) and held_names(out, "export.dir") == []
    earlier = tmp_path / "earlier"
    _write(earlier, {"old.txt": "old", "model.pt2": "old"})
    store.put(earlier, str(out))
    assert held_names(out, "export.dir") == ["model.pt2", "old.txt"]
    assert is_local_file(out, "anything")  # every object of a store is a file

    with pytest.raises(RuntimeError, match="^stopped before the commit$"), StagedFolder(out) as staged:
        _write(staged.path, {"model.pt2": "new"})
        local = staged.path
        raise RuntimeError("stopped before the commit")
    assert store.fs().cat_file("out/export/model.pt2") == b"old"
    assert not local.exists() and not local.parent.exists()  # the local staging folder is gone

    with StagedFolder(out) as staged:
        _write(staged.path, {"model.pt2": "new", "mlflow_model/MLmodel": "flavors"})
        staged.commit()
        assert (staged.local / "model.pt2").read_text() == "new"  # the uploaded copy, still on the local disk
    assert held_names(out, "export.dir") == ["mlflow_model", "model.pt2"]
    assert store.fs().cat_file("out/export/mlflow_model/MLmodel") == b"flavors"
    assert not store.fs().exists("out/export/old.txt")
    assert sorted(stores.find("s3://out/export")) == ["s3://out/export/mlflow_model/MLmodel", "s3://out/export/model.pt2"]
