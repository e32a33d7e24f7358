"""A two-tower model's full-corpus eval and ``predict``'s top-k rank the same catalogue items: those that may be
recommended (``train.candidates.catalogue_candidates``), never the item table's OOV rows past the ``data sequences`` id
mapping, which an items file listing every table row holds. On the same rows, the eval's recall@k equals the recall
computed from predict's top-k output by brute force; export's item index holds the same items."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir

from recsys_runner import evaluate, export, predict
from recsys_runner.__main__ import run as train
from recsys_runner.config import register_configs
from recsys_runner.data.sequences.mapping import load_mapping
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.scoring_topk import TOP_ITEMS
from recsys_runner.train import candidates
from tests.test_evaluate import compose_entry
from tests.test_sequence_rows import distinct_times_log, run_sequences

OOV_ROWS, K = 16, 60


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], int]:
    """``data sequences`` rows whose item table has 16 OOV rows after the mapping's items, a catalogue of every table row
    (the OOV rows included: a catalogue dumped from the embedding table), dssm trained a few steps; the folder, the
    overrides and the mapping's item count."""
    root = tmp_path_factory.mktemp("catalogue_candidates")
    log = distinct_times_log(num_users=40, seed=7)
    log = log.append_column("cate", pa.array(np.asarray(log["item"]) % 5))
    rows = run_sequences(root, log, "rows", "--max-len", "6", "--oov-buckets", str(OOV_ROWS), "--side", "cate")
    items = len(load_mapping(str(rows))["item"])
    pq.write_table(pa.table({"item_id": np.arange(items + OOV_ROWS, dtype=np.int64)}), root / "items.parquet")
    # the user tower reads the history group (hist_item_id, hist_cate) but not its times (hist_ts), as a two-tower model on
    # `data sequences` rows does
    overrides = ["model=dssm", "model.user_features=[user_id,hist_item_id,hist_cate]", "model.item_features=[item_id]",
                 "model.tower_layer_sizes=[8]",
                 f"model.eval_metrics=[recall@{K}]", "model.corpus_chunk_rows=16", "data=parquet", f"data.path={rows}/train.parquet",
                 f"data.eval_path={rows}/eval.parquet", f"data.items.path={root}/items.parquet", "data.items.id=item_id",
                 "data.batch_size=16", "train.num_steps=6", "train.eval_every_steps=null", "distributed.device=cpu", "tracking=none",
                 f"checkpoint.dir={root}/ck"]
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        train(compose(config_name="config", overrides=overrides))
    return root, overrides, items


def test_eval_recall_equals_a_brute_force_recall_of_predicts_top_k_on_the_same_rows(
        trained: tuple[Path, list[str], int], tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    root, overrides, items = trained
    monkeypatch.setattr(candidates, "_SAID", set())  # the training said it already: the line comes once per process
    (step,) = sorted((root / "ck").glob("step_*"))[-1:]
    with caplog.at_level(logging.INFO):
        metrics = evaluate.run(compose_entry("evaluate", *overrides, f"load={step}"))
    result = predict.run(compose_entry("predict", *overrides, f"load={step}", f"predict.input={root}/rows/eval.parquet",
                                       f"predict.output={tmp_path}/out", f"predict.top_k={K}", "predict.exclude_seen=false",
                                       "predict.columns=[item_id]"))
    written = pq.read_table(result.parts)
    assert result.rows == pq.read_metadata(root / "rows" / "eval.parquet").num_rows
    raw_items = set(load_mapping(str(root / "rows"))["item"].tolist())
    assert all(set(top) <= raw_items for top in written[TOP_ITEMS].to_pylist()), "no OOV row recommended"
    hits = [item in top for item, top in zip(written["item_id"].to_pylist(), written[TOP_ITEMS].to_pylist(), strict=True)]
    assert 0 < np.mean(hits) < 1
    assert metrics[f"eval/recall_at_{K}"] == pytest.approx(np.mean(hits), rel=1e-12)
    said = [r.getMessage() for r in caplog.records if "not rankable" in r.getMessage()]  # evaluate's, predict's: one line
    assert len(said) == 1 and f"{OOV_ROWS} of {items + OOV_ROWS} catalogue items" in said[0], said
    assert f"past the {items} item ids of the id mapping in {root / 'rows'}" in said[0]


@pytest.fixture(scope="module")
def exported(trained: tuple[Path, list[str], int], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The export of the trained model (its folder)."""
    root, overrides, _ = trained
    return export.run(compose_entry("export", *overrides, f"load={root}/ck", f"export.dir={tmp_path_factory.mktemp('export')}/export"))


def test_export_serves_the_same_items_as_eval_and_predict(trained: tuple[Path, list[str], int], exported: Path) -> None:
    """``items.pt``, the index a server loads, holds the ranked items only: no OOV row past the mapping."""
    _, _, items = trained
    out = exported
    saved = torch.load(out / "items.pt")
    assert saved["ids"].tolist() == list(range(items)) and saved["vectors"].shape[0] == items


def test_the_served_user_tower_reads_the_history_without_its_times_and_cuts_it_as_training(
        trained: tuple[Path, list[str], int], exported: Path) -> None:
    """The user tower reads the history group but not its times: its MLflow model is written (the export crashed checking
    it: ``serving.json and encoders.json describe other features``), asks for no ``hist_ts``, and cuts a history to the
    group's ``max_len`` (6) as training did."""
    import mlflow.pyfunc
    import pandas as pd

    mapping = load_mapping(str(trained[0] / "rows"))
    model = mlflow.pyfunc.load_model(str(exported / "mlflow_user_tower"))
    assert [c.name for c in model.metadata.get_input_schema().inputs] == ["user_id", "hist_item_id", "hist_cate"]
    events = mapping["item"][:10].tolist()  # the log's raw ids (the towers read them through the id mapping)
    cates = mapping["cate"][np.arange(10) % 5].tolist()
    user = str(mapping["user_id"][0])
    request = pd.DataFrame({"user_id": [user, user], "hist_item_id": [events, events[-6:]], "hist_cate": [cates, cates[-6:]]})
    vectors = np.stack(model.predict(request)["vector"].to_numpy())
    np.testing.assert_array_equal(vectors[0], vectors[1])


def test_a_towers_part_of_a_history_group_is_cut_to_the_groups_max_len() -> None:
    """A tower reading one feature of a history group (``hist_item_id`` of ``[hist_item_id, hist_cate]``) keeps the group for
    it, so a served history is cut to ``max_len`` as training cut it (the group was dropped whole: histories went uncut)."""
    from recsys_runner.data.encoding.served import _Schema

    sparse = [{"name": n, "num_embeddings": 10} for n in ("user_id", "hist_item_id", "hist_cate")]
    document = {"dense": [], "sparse": sparse, "vocabularies": {},
                "sequences": {"hist": {"features": ["hist_item_id", "hist_cate"], "max_len": 6, "timestamps": "hist_ts"}}}
    (group,) = _Schema(document, {"user_id", "hist_item_id"}).sequences
    assert (group.features, group.max_len, group.timestamps) == (("hist_item_id",), 6, None)
    (whole,) = _Schema(document).sequences
    assert (whole.features, whole.timestamps) == (("hist_item_id", "hist_cate"), "hist_ts")


def test_an_items_file_of_the_logs_raw_ids_is_refused_naming_the_mapping(tmp_path: Path) -> None:
    """``data sequences`` rows hold the mapping's table ids; an items file of the log's raw ids was refused with the
    encoder's fix (raise num_embeddings, or hash the ids), which would have encoded each raw id to another item's row."""
    from recsys_runner.configurable import make
    from recsys_runner.data.files.tabular import ParquetData
    from recsys_runner.data.files.tabular_config import ParquetDataConfig
    from recsys_runner.errors import DataError

    rows = run_sequences(tmp_path, distinct_times_log(num_users=20, seed=3), "rows", "--max-len", "4")
    raw = load_mapping(str(rows))["item"]  # items 7i + 3: most beyond the table's rows
    pq.write_table(pa.table({"item_id": raw[::-1].copy()}), tmp_path / "raw_items.parquet")
    with pytest.raises(DataError, match=r"bad item in .*raw_items.parquet.*column 'item_id': id \d+ is outside \[0, \d+\) \(encoding=id\): "
                                        r"the model's table .*written by python -m recsys_runner.data sequences, whose id mapping "
                                        r"\(in .*rows\).*Fix: write the items file with the mapping's table ids"):
        ParquetData(make(ParquetDataConfig, path=f"{rows}/train.parquet", num_workers=0,
                         items={"path": str(tmp_path / "raw_items.parquet"), "id": "item_id"}))


def test_the_served_towers_take_the_logs_raw_ids_through_the_id_mapping(trained: tuple[Path, list[str], int], exported: Path) -> None:
    """Trained on ``data sequences`` rows, each tower's MLflow model takes the log's raw ids (user, item, side and history
    cells) and reads them through the rows' id mapping: its vectors are the table-id program's (``<tower>_tower.pt2``) for
    the mapped ids, an unseen raw id reads the OOV row ``data sequences --vocab`` gives it (counted in ``unknown_ids``),
    and ``items.pt`` names each vector's raw item id. (They took table ids: a raw user id read another user's row, or
    was refused.)"""
    import json

    import mlflow.pyfunc
    import pandas as pd

    from recsys_runner.data.sequences.mapping import EarlierVocab

    root, _, items = trained
    folder = str(root / "rows")
    mapping, vocab = load_mapping(folder), EarlierVocab.load(folder)
    users, item_ids, cates = mapping["user_id"], mapping["item"], mapping["cate"]
    unseen_user, unseen_item, unseen_cate = "nobody", int(item_ids.max()) + 10_000, int(cates.max()) + 7

    def oov(table: str, value: object) -> int:
        (row,), unseen = vocab.encode(table, pa.array([value]), "test")
        assert unseen == 1 and row >= len(mapping[table])
        return int(row)

    spec = json.loads((exported / "feature_spec.json").read_text())["towers"]

    def program_vectors(tower: str, ids: dict[str, list[list[int]]]) -> np.ndarray:
        """The table-id program's vectors of rows given as table ids per feature (a list per row)."""
        keys = [f["name"] for f in spec[tower]["sparse_features"]]
        n = len(ids[keys[0]])
        values = torch.tensor([i for k in keys for cell in ids[k] for i in cell], dtype=torch.int64)
        lengths = torch.tensor([[len(cell) for cell in ids[k]] for k in keys], dtype=torch.int64)
        with torch.no_grad():
            return torch.export.load(str(exported / spec[tower]["file"])).module()(torch.zeros(n, 0), values, lengths).numpy()

    user_model = mlflow.pyfunc.load_model(str(exported / "mlflow_user_tower"))
    request = pd.DataFrame({"user_id": [str(users[3]), unseen_user],
                            "hist_item_id": [item_ids[[5, 9, 2]].tolist(), [int(item_ids[7]), unseen_item]],
                            "hist_cate": [cates[[1, 4, 0]].tolist(), [int(cates[2]), unseen_cate]]})
    served = user_model.predict(request)
    want = program_vectors("user", {"user_id": [[3], [oov("user_id", unseen_user)]],
                                    "hist_item_id": [[5, 9, 2], [7, oov("item", unseen_item)]],
                                    "hist_cate": [[1, 4, 0], [2, oov("cate", unseen_cate)]]})
    np.testing.assert_allclose(np.stack(served["vector"].to_numpy()), want, rtol=1e-5, atol=1e-6)
    assert served["unknown_ids"].tolist() == [0, 3]
    as_text = request.head(1).assign(hist_item_id=[[str(i) for i in request["hist_item_id"][0]]])  # integer ids sent as text
    np.testing.assert_allclose(np.stack(user_model.predict(as_text)["vector"].to_numpy())[0], np.stack(served["vector"].to_numpy())[0],
                               rtol=1e-6, atol=1e-7)

    item_model = mlflow.pyfunc.load_model(str(exported / "mlflow_item_tower"))
    served = item_model.predict(pd.DataFrame({"item_id": [str(item_ids[5]), str(unseen_item), str(item_ids[0])]}))
    want = program_vectors("item", {"item_id": [[5], [oov("item", unseen_item)], [0]]})
    np.testing.assert_allclose(np.stack(served["vector"].to_numpy()), want, rtol=1e-5, atol=1e-6)
    assert served["unknown_ids"].tolist() == [0, 1, 0]

    saved = torch.load(exported / "items.pt")
    assert saved["raw_ids"] == item_ids[saved["ids"].numpy()].tolist() and len(saved["raw_ids"]) == items
