"""The top-k MLflow model ``export`` writes for a next-item model (issue 31, point 4): a user's history of raw item ids in,
``predict``'s top-k out.

A generated log → ``data sequences`` rows (with their id mapping) → HSTU (whose time bias reads the history's times)
trained a few steps → ``export``. ``predict`` on the same rows is the reference: the served model, given each row's
history as the log's raw ids, answers the same items (raw ids, best first) with the same scores, with and without the
seen items; an unknown raw id reads the OOV row a ``--vocab`` encoding gives it (and is counted); a bad ``k`` or request
is a clear error; and the model loads and answers where recsys_runner, TorchRec and fbgemm_gpu cannot be imported.
"""

from __future__ import annotations

import importlib.abc
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_runner import export, predict
from recsys_runner.__main__ import run as train
from recsys_runner.data.encoding import served as served_module
from recsys_runner.data.encoding.keys import value_keys
from recsys_runner.data.sequences.mapping import load_mapping
from recsys_runner.errors import ConfigError
from recsys_runner.scoring_topk import TOP_ITEMS, TOP_SCORES
from recsys_runner.serving import mlflow_model, served_topk
from recsys_runner.serving.served_topk import TopKModel
from tests.test_evaluate import compose_entry
from tests.test_sequence_rows import distinct_times_log, run_sequences

K = 5
UNKNOWN = 10**9 + 7
"""A raw item id the log never holds."""


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """HSTU trained on ``data sequences`` rows of a generated log, exported (logged to MLflow as the export run's model)."""
    root = tmp_path_factory.mktemp("served_topk")
    rows = run_sequences(root, distinct_times_log(num_users=40, seed=3), "rows", "--max-len", "8")
    data = ["model=sasrec", "model.block=hstu", "model.num_blocks=1", "model.embedding_dim=8", "data=parquet",
            f"data.path={rows}/train.parquet", f"data.eval_path={rows}/eval.parquet", "data.batch_size=16", "distributed.device=cpu",
            "tracking=none"]
    train(compose_entry("config", *data, "train.num_steps=6", "train.eval_every_steps=null", f"checkpoint.dir={root}/ck"))
    checkpoint = root / "ck" / "step_00000006"
    uri = f"sqlite:///{root}/mlflow.db"
    out = export.run(compose_entry("export", *data, f"load={checkpoint}", f"export.dir={root}/export", f"export.top_k={K}",
                                   "tracking=mlflow", f"tracking.uri={uri}"))
    return {"root": root, "rows": rows, "data": data, "checkpoint": checkpoint, "model": out / mlflow_model.MODEL_DIR, "uri": uri,
            "mapping": load_mapping(str(rows))}


@pytest.fixture(scope="module")
def loaded(exported: dict[str, Any]) -> tuple[Any, TopKModel]:
    """The exported model loaded once for the module (a load reads the program: seconds): through MLflow, and as the
    loader's own class (which takes requests past MLflow's signature check)."""
    import mlflow.pyfunc

    return mlflow.pyfunc.load_model(str(exported["model"])), TopKModel(str(exported["model"] / "data" / "data"))


def _predicted(exported: dict[str, Any], rows: Path, out: Path, exclude_seen: bool) -> pa.Table:
    result = predict.run(compose_entry("predict", *exported["data"], f"load={exported['checkpoint']}", f"predict.input={rows}",
                                       f"predict.output={out}", f"predict.top_k={K}", f"predict.exclude_seen={exclude_seen}"))
    return pq.read_table(result.parts)


def _request(table: pa.Table, mapping: dict[str, np.ndarray]) -> pd.DataFrame:
    """Rows of ``data sequences`` output as a request: each history as the log's raw item ids, with its times."""
    return pd.DataFrame({"hist_item_id": [mapping["item"][np.asarray(h, np.int64)].tolist() for h in table["hist_item_id"].to_pylist()],
                         "hist_ts": table["hist_ts"].to_pylist()})


def _with_unknown_ids(exported: dict[str, Any]) -> tuple[Path, list[int]]:
    """``eval.parquet`` with the newest event of every third row replaced by the item table's OOV row — what
    ``data sequences --vocab`` writes for a raw id its mapping lacks (``size + key mod oov_buckets``) — beside the mapping
    its metadata names; and the rows changed."""
    rows = exported["rows"]
    table = pq.read_table(rows / "eval.parquet")
    vocab = json.loads((rows / "vocab.json").read_text())
    size, buckets = vocab["tables"]["item"]["size"], vocab["oov_buckets"]
    keys, _ = value_keys(pa.array([UNKNOWN], pa.int64()), False)
    oov = size + int(keys[0] % np.uint64(buckets))
    histories = table["hist_item_id"].to_pylist()
    changed = [r for r in range(0, len(histories), 3) if histories[r]]
    for r in changed:
        histories[r] = [*histories[r][:-1], oov]
    column = pa.array(histories, table.schema.field("hist_item_id").type)
    pq.write_table(table.set_column(table.schema.get_field_index("hist_item_id"), "hist_item_id", column), rows / "eval_unknown.parquet")
    return rows / "eval_unknown.parquet", changed


def test_served_top_k_equals_predicts_in_raw_ids_and_reads_an_unknown_id_as_the_oov_row(exported: dict[str, Any], loaded: tuple[Any, TopKModel],
                                                                                       tmp_path: Path) -> None:
    model, unit = loaded
    rows, mapping = exported["rows"], exported["mapping"]
    request = _request(pq.read_table(rows / "eval.parquet"), mapping)
    raw_items = set(distinct_times_log(num_users=40, seed=3)["item"].to_pylist())
    assert set(request["hist_item_id"].explode().dropna()) <= raw_items  # the request holds the log's own ids
    # the rows with an unknown raw id: predict reads them from rows holding the OOV row data sequences --vocab gives that id
    with_unknown, changed = _with_unknown_ids(exported)
    unknown = request.assign(hist_item_id=[[*h[:-1], UNKNOWN] if r in changed else h for r, h in enumerate(request["hist_item_id"])])
    for exclude_seen, asked, path in ((True, unknown, with_unknown), (False, request, rows / "eval.parquet")):
        reference = _predicted(exported, path, tmp_path / f"predicted_{exclude_seen}", exclude_seen)
        served = model.predict(asked, params={"exclude_seen": exclude_seen})
        assert list(served.columns) == [TOP_ITEMS, TOP_SCORES, served_topk.UNKNOWN_IDS]
        assert served[TOP_ITEMS].tolist() == reference[TOP_ITEMS].to_pylist()
        np.testing.assert_allclose(np.array(served[TOP_SCORES].tolist()), np.array(reference[TOP_SCORES].to_pylist()), rtol=1e-5, atol=1e-5)
        assert all(item in raw_items for items in served[TOP_ITEMS] for item in items)
        assert served[served_topk.UNKNOWN_IDS].tolist() == [int(exclude_seen and r in changed) for r in range(len(request))]
        seen_in_top = [set(items) & set(history) for items, history in zip(served[TOP_ITEMS], asked["hist_item_id"], strict=True)]
        assert not any(seen_in_top) if exclude_seen else any(seen_in_top)  # the mask had something to exclude
    # a reversed frame (its index not 0..n-1): the answers come back on the request's index, so assigning them lines up
    backwards = request.iloc[::-1]
    assert backwards.assign(top=model.predict(backwards)[TOP_ITEMS]).sort_index()["top"].tolist() == model.predict(request)[TOP_ITEMS].tolist()
    # k from the request; without params the export's export.top_k; a history longer than max_len is cut as training cut it
    assert [len(items) for items in model.predict(request.head(3), params={"k": 2})[TOP_ITEMS]] == [2, 2, 2]
    assert [len(items) for items in model.predict(request.head(3))[TOP_ITEMS]] == [K, K, K]
    head = request.head(10)
    longer = head.assign(hist_item_id=[[3, 10, *h] for h in head["hist_item_id"]], hist_ts=[[0, 1, *t] for t in head["hist_ts"]])
    full = [len(h) >= 8 for h in head["hist_item_id"]]  # max_len 8: the two events put before these are cut off again
    assert any(full)
    same = model.predict(longer)[TOP_ITEMS].tolist()
    assert [a for a, f in zip(same, full, strict=True) if f] == [b for b, f in zip(model.predict(head)[TOP_ITEMS], full, strict=True) if f]
    # through MLflow's signature (``any``: its array check would refuse them naming no column), ids sent as text or as whole
    # floats for this integer table are read as the integers training keyed
    as_text = head.assign(hist_item_id=[[str(i) for i in h] for h in head["hist_item_id"]])
    as_floats = head.assign(hist_item_id=[[float(i) for i in h] for h in head["hist_item_id"]])
    assert model.predict(as_text)[TOP_ITEMS].tolist() == model.predict(as_floats)[TOP_ITEMS].tolist() == model.predict(head)[TOP_ITEMS].tolist()


def test_top_k_leaves_out_every_seen_row_beside_padding_and_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(served_topk, "CHUNK_ROWS", 3)
    index = torch.eye(7)
    queries = torch.tensor([[7.0, 6, 5, 4, 3, 2, 1], [7.0, 6, 5, 4, 3, 2, 1]])
    seen = torch.tensor([[0, 4, -1, -1], [3, 0, 1, 2]])  # item 0, the best, seen by a row with padding; row 1 saw 4 of 7
    rows, scores, keep = served_topk.top_k(queries, index, 4, seen)
    assert rows[0][keep[0]].tolist() == [1, 2, 3, 5] and scores[0][keep[0]].tolist() == [6, 5, 4, 2]
    assert rows[1][keep[1]].tolist() == [4, 5, 6]  # fewer than k unseen: a shorter list


def test_bad_requests_and_a_bad_k_are_named(exported: dict[str, Any], loaded: tuple[Any, TopKModel]) -> None:
    model, unit = loaded
    size = len(exported["mapping"]["item"])
    request = _request(pq.read_table(exported["rows"] / "eval.parquet").slice(0, 3), exported["mapping"])
    for k in (0, -1, size + 1):
        with pytest.raises(Exception, match=rf"k={k}: the number of items to return must be a whole number from 1 to {size}"):
            model.predict(request, params={"k": k})
    with pytest.raises(Exception, match=r"k='many': .* from 1 to"):
        unit.predict(request, params={"k": "many"})
    assert len(model.predict(request, params={"k": size, "exclude_seen": False})[TOP_ITEMS][0]) == size
    with pytest.raises(Exception, match=r"unknown parameter\(s\) \['top'\]"):
        unit.predict(request, params={"top": 3})
    for served in (model, unit):  # HSTU reads times (the signature's arrays are optional: MLflow leaves the check to the model)
        with pytest.raises(Exception, match=r"the request has no column 'hist_ts'.*Fix: send every one of them"):
            served.predict(request.drop(columns=["hist_ts"]))
    with pytest.raises(Exception, match=r"request row 1: column 'hist_ts' holds \d+ values for \d+ events"):
        unit.predict(request.assign(hist_ts=[request["hist_ts"][0], [*request["hist_ts"][1], 5], request["hist_ts"][2]]))
    # each through MLflow's signature too, which leaves the cells to the model: it names the row and the column
    with pytest.raises(Exception, match=r"request row 0, column 'hist_item_id': 42 is not a list"):
        model.predict(request.assign(hist_item_id=[42, [], []]))
    with pytest.raises(Exception, match=r"column 'hist_item_id' cannot be read as int64 .*the model's ids in it are integers"):
        model.predict(request.assign(hist_item_id=[["abc"], [], []]))
    with pytest.raises(Exception, match=r"request row 1, column 'hist_item_id' holds booleans.*True would silently be the id 1"):
        model.predict(request.head(2).assign(hist_item_id=[[], [True]], hist_ts=[[], [1]]))
    with pytest.raises(Exception, match=r"request row 1, column 'hist_item_id': a missing id in the list. Fix: leave it out"):
        model.predict(request.head(2).assign(hist_item_id=[[3], [3, None]], hist_ts=[[1], [1, 2]]))
    with pytest.raises(Exception, match=r"column 'hist_ts' cannot be read as int64 .*the model's times in it are integers"):
        model.predict(request.head(1).assign(hist_item_id=[[3]], hist_ts=[[1.5]]))
    # an empty history (a new user) and a missing cell are answered too, alike, through MLflow's signature check (a missing
    # cell of a required array column is refused there); and a request of no rows gets no rows
    answered = model.predict(request.assign(hist_item_id=[[], None, []], hist_ts=[[], None, []]))
    assert [len(items) for items in answered[TOP_ITEMS]] == [K] * 3 and answered[TOP_ITEMS][0] == answered[TOP_ITEMS][1]
    empty = model.predict(request.head(0))
    assert list(empty.columns) == [TOP_ITEMS, TOP_SCORES, served_topk.UNKNOWN_IDS] and len(empty) == 0
    with pytest.raises(Exception, match=r"the request has no column 'hist_ts'"):
        unit.predict(request.head(0).drop(columns=["hist_ts"]))
    # export.top_k above the items that may be recommended: refused before anything is written
    with pytest.raises(ConfigError, match=rf"export.top_k={size + 1}, but the item table \(item\) holds {size} items.*export.top_k<={size}"):
        export.run(compose_entry("export", *exported["data"], f"load={exported['checkpoint']}", f"export.dir={exported['root']}/too_many",
                                 f"export.top_k={size + 1}"))
    assert not (exported["root"] / "too_many").exists()


def test_the_export_run_logs_the_top_k_model_as_its_model(exported: dict[str, Any], loaded: tuple[Any, TopKModel]) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=exported["uri"])
    (logged,) = client.search_logged_models(experiment_ids=[e.experiment_id for e in client.search_experiments()])
    assert logged.name == "model" and client.get_run(logged.source_run_id).data.tags.get("entry") == "export"
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(exported["uri"])
    try:
        model = mlflow.pyfunc.load_model(f"models:/{logged.model_id}")
    finally:
        mlflow.set_tracking_uri(before)
    request = _request(pq.read_table(exported["rows"] / "eval.parquet").slice(0, 4), exported["mapping"])
    assert model.predict(request)[TOP_ITEMS].tolist() == loaded[0].predict(request)[TOP_ITEMS].tolist()


BLOCKED = ("recsys_runner", "torchrec", "fbgemm_gpu")


class _Refuse(importlib.abc.MetaPathFinder):
    """An import system that refuses :data:`BLOCKED`."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: the served model must not need it")
        return None


def test_the_served_model_loads_and_answers_where_recsys_runner_torchrec_and_fbgemm_cannot_be_imported(exported: dict[str, Any],
                                                                                                       loaded: tuple[Any, TopKModel]) -> None:
    """In this process, for the load and a request: recsys_runner, TorchRec and fbgemm_gpu taken out of ``sys.modules`` and
    refused by the import system (a subprocess would cost a Python start; test_mlflow_model.py runs one for the pointwise
    model), the model's code/ modules imported afresh from its directory. Their names end in the hash of the files the
    model carries (so a model of other code, another version's or the pointwise model's, never shares one:
    test_mlflow_model.py loads two side by side), the loader's too."""
    import mlflow.pyfunc
    from mlflow.models import Model

    request = _request(pq.read_table(exported["rows"] / "eval.parquet").slice(0, 6), exported["mapping"])
    want = loaded[0].predict(request, params={"k": 3})
    loader = Model.load(str(exported["model"])).flavors["python_function"]["loader_module"]
    suffix = loader.removeprefix(served_topk.LOADER_MODULE)
    stems = [*served_module.SHIPPED.values(), served_topk.LOADER_MODULE, served_topk.TOP_K_MODULE]
    files = {p.stem: p.read_bytes() for p in (exported["model"] / "code").glob("*.py")}
    assert sorted(files) == sorted(f"{stem}{suffix}" for stem in stems)
    assert suffix == f"_{mlflow_model.code_hash({name.removesuffix(suffix): text for name, text in files.items()})}"
    hidden = {n: m for n, m in sys.modules.items() if n.split(".")[0] in BLOCKED or n in files}
    refuse = _Refuse()
    for name in hidden:
        del sys.modules[name]
    sys.meta_path.insert(0, refuse)
    try:
        got = mlflow.pyfunc.load_model(str(exported["model"])).predict(request, params={"k": 3})
        imported = [n for n in sys.modules if n.split(".")[0] in BLOCKED]
        loaded_from = {Path(sys.modules[name].__file__ or "").parent for name in files if name in sys.modules}
        assert loader in sys.modules
    finally:
        sys.meta_path.remove(refuse)
        for name in [n for n in sys.modules if n.split(".")[0] in BLOCKED or n in files]:
            del sys.modules[name]
        sys.modules.update(hidden)
    assert not imported and loaded_from == {exported["model"] / "code"}
    assert got[TOP_ITEMS].tolist() == want[TOP_ITEMS].tolist()
    np.testing.assert_allclose(np.array(got[TOP_SCORES].tolist()), np.array(want[TOP_SCORES].tolist()), rtol=1e-6, atol=1e-6)
