"""``predict`` for ranking models: a next-item model's top-k per row equals a brute-force numpy top-k of the checkpoint's
own scores (with and without the row's history excluded), named by the raw ids of the ``data sequences`` mapping; two
ranks write disjoint parts covering the input; a top_k above the catalogue is refused before a row is scored; a two-tower
model's top-k over its catalogue equals a brute force without each row's seen items, exact and through FAISS."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir

from recsys_runner import evaluate, predict
from recsys_runner.__main__ import run as train
from recsys_runner.build import build
from recsys_runner.config import register_configs, validate
from recsys_runner.data.sequences.mapping import load_mapping
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.scoring_topk import TOP_ITEMS, TOP_SCORES
from tests.conftest import LogWarnings, torchrun
from tests.test_evaluate import compose_entry
from tests.test_exclude_seen import NUM_ITEMS, train_two_tower
from tests.test_sequence_rows import distinct_times_log, run_sequences

K = 5


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A generated log → ``data sequences`` rows (with their id mapping) → SASRec trained a few steps; returns the
    folder and the training's overrides."""
    root = tmp_path_factory.mktemp("predict_topk")
    rows = run_sequences(root, distinct_times_log(num_users=40, seed=3), "rows", "--max-len", "8")
    overrides = ["model=sasrec", "model.embedding_dim=8", "data=parquet", f"data.path={rows}/train.parquet",
                 f"data.eval_path={rows}/eval.parquet", "data.batch_size=16", "train.num_steps=6", "train.eval_every_steps=null",
                 "distributed.device=cpu", f"tracking.uri=sqlite:///{root}/mlflow.db", "tracking.experiment=predict_topk",
                 f"checkpoint.dir={root}/ck"]
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        train(compose(config_name="config", overrides=overrides))
    return root, overrides


def _checkpoint_scores(root: Path, overrides: list[str], path: Path) -> np.ndarray:
    """The checkpoint's full-table scores ``[rows, N]`` of the rows of ``path``, from the training's own graph."""
    spec = validate(compose_entry("predict", *overrides, f"load={root}/ck", f"data.eval_path={path}"))
    (step,) = sorted((root / "ck").glob("step_*"))[-1:]
    c = build(spec, weights=step)
    try:
        model = c.loop.evaluator.model
        model.eval()
        with torch.no_grad():
            return torch.cat([model(b)[1][1] for b in c.loop.data.eval_batches(0, 1)]).float().numpy()
    finally:
        c.close()


def _brute_force(scores: np.ndarray, histories: list[list[int]], known: int, exclude_seen: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each row's top ``K`` ids and scores by numpy: ids past the mapping (OOV rows) never, history ids not when
    ``exclude_seen``."""
    masked = scores.copy()
    masked[:, known:] = -np.inf
    if exclude_seen:
        for row, history in enumerate(histories):
            masked[row, history] = -np.inf
    top = np.argsort(-masked, axis=1, kind="stable")[:, :K]
    return top, np.take_along_axis(masked, top, axis=1)


@pytest.mark.parametrize("exclude_seen", [True, False])
def test_top_k_equals_a_brute_force_top_k_of_the_checkpoints_scores_in_raw_ids(trained: tuple[Path, list[str]], tmp_path: Path,
                                                                                 exclude_seen: bool) -> None:
    root, overrides = trained
    rows = root / "rows" / "eval.parquet"
    result = predict.run(compose_entry("predict", *overrides, f"load={root}/ck", f"predict.input={rows}",
                                       f"predict.output={tmp_path}/out", f"predict.top_k={K}", f"predict.exclude_seen={exclude_seen}",
                                       "predict.columns=[user_id,item_id,hist_item_id]"))
    written = pq.read_table(result.parts)
    assert written.column_names == ["user_id", "item_id", "hist_item_id", TOP_ITEMS, TOP_SCORES]
    table = pq.read_table(rows)
    mapping = load_mapping(str(root / "rows"))
    # the pass-through id columns as the log's raw values too (text users "user-007", items 7i + 3), row for row
    assert result.rows == table.num_rows
    assert written["user_id"].to_pylist() == mapping["user_id"][table["user_id"].to_numpy()].tolist()
    assert written["item_id"].to_pylist() == mapping["item"][table["item_id"].to_numpy()].tolist()
    assert all(u.startswith("user-") for u in written["user_id"].to_pylist())
    assert written["hist_item_id"].to_pylist() == [mapping["item"][h].tolist() for h in table["hist_item_id"].to_pylist()]

    histories = table["hist_item_id"].to_pylist()
    top, top_scores = _brute_force(_checkpoint_scores(root, overrides, rows), histories, len(mapping["item"]), exclude_seen)
    got_items = written[TOP_ITEMS].to_pylist()
    got_scores = np.array(written[TOP_SCORES].to_pylist())
    np.testing.assert_allclose(got_scores, top_scores, rtol=1e-4, atol=1e-4)
    # the raw ids of the log (items 7i + 3), through the mapping: the brute force's ids named the same way
    assert got_items == [mapping["item"][row].tolist() for row in top]
    raw_items = set(distinct_times_log(num_users=40, seed=3)["item"].to_pylist())
    assert all(item in raw_items for items in got_items for item in items)
    if exclude_seen:
        raw_histories = [set(mapping["item"][h].tolist()) for h in histories]
        assert not any(set(items) & seen for items, seen in zip(got_items, raw_histories, strict=True))
        assert any(histories)  # the mask had something to exclude


def test_rows_whose_seen_items_leave_fewer_than_k_are_counted_and_said(trained: tuple[Path, list[str]], tmp_path: Path) -> None:
    """``top_k`` the whole catalogue with ``exclude_seen``: every row with a history gets a shorter list, as documented;
    the run says how many (a line and ``predict/short_lists``) rather than leaving the lengths to be found."""
    root, overrides = trained
    rows = root / "rows" / "eval.parquet"
    k = len(load_mapping(str(root / "rows"))["item"])
    with LogWarnings() as warned:
        result = predict.run(compose_entry("predict", *overrides, f"load={root}/ck", f"predict.input={rows}",
                                           f"predict.output={tmp_path}/out", f"predict.top_k={k}"))
    lengths = [len(items) for items in pq.read_table(result.parts)[TOP_ITEMS].to_pylist()]
    short = sum(n < k for n in lengths)
    assert short > 0 and result.short_lists == short
    assert any(f"predict: {short} of {result.rows} rows have fewer than predict.top_k={k} items" in w for w in warned.messages), \
        warned.messages


def test_two_ranks_write_disjoint_top_k_parts_covering_the_input(trained: tuple[Path, list[str]], tmp_path: Path) -> None:
    root, overrides = trained
    table = pq.read_table(root / "rows" / "train.parquet")
    rows = root / "rows" / "train_in_row_groups.parquet"  # beside the mapping its metadata names (".")
    pq.write_table(table, rows, row_group_size=40)  # units for two ranks
    out = torchrun(*overrides, f"load={root}/ck", f"predict.input={rows}", f"predict.output={tmp_path}/out", f"predict.top_k={K}",
                   "predict.columns=[user_id,ts]", "distributed.sharding_types=[column_wise]", cwd=tmp_path, module="recsys_runner.predict")
    assert out.returncode == 0, out.stderr[-4000:]
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert {p.name[:10] for p in parts} == {"part-00000", "part-00001"}
    written = pq.read_table(parts)
    # the parts in name order are the input rows in input order, each once (user_id as the log's raw user, ts as it is)
    users = load_mapping(str(root / "rows"))["user_id"][table["user_id"].to_numpy()].tolist()
    assert list(zip(written["user_id"].to_pylist(), written["ts"].to_pylist(), strict=True)) == \
        list(zip(users, table["ts"].to_pylist(), strict=True))
    assert all(len(items) == K for items in written[TOP_ITEMS].to_pylist())
    assert "top_items are the raw item ids of the mapping" in out.stderr + out.stdout


def test_a_top_k_above_the_catalogue_is_refused_before_a_row_is_scored(trained: tuple[Path, list[str]], tmp_path: Path) -> None:
    root, overrides = trained
    size = len(load_mapping(str(root / "rows"))["item"])
    with pytest.raises(ConfigError, match=rf"predict.top_k={size + 1}, but the item table \(item\) holds {size} items.*Fix: predict.top_k<={size}"):
        predict.run(compose_entry("predict", *overrides, f"load={root}/ck", f"predict.input={root}/rows/eval.parquet",
                                  f"predict.output={tmp_path}/out", f"predict.top_k={size + 1}"))
    assert not list((tmp_path / "out").glob("*part-*"))


def _retrieval_files(root: Path) -> list[str]:
    """Two-tower rows (a user, the item it took, the items it had before: ``seen``) and their catalogue; the training
    overrides that read them."""
    rng = np.random.default_rng(0)
    n, items = 400, 30
    item = rng.integers(0, items, n)
    table = pa.table({"label": np.ones(n, np.int64), "user_id": rng.integers(0, 20, n), "item_id": [f"i{i}" for i in item],
                      "cate": item % 4, "seen": [[f"i{j}" for j in rng.choice(items, 3, replace=False)] for _ in range(n)]})
    pq.write_table(table, root / "rows.parquet", row_group_size=100)
    pq.write_table(pa.table({"item_id": [f"i{i}" for i in range(items)], "cate": [i % 4 for i in range(items)],
                             "seen": [[] for _ in range(items)]}, schema=pa.schema([("item_id", pa.string()), ("cate", pa.int64()),
                                                                                    ("seen", pa.list_(pa.string()))])),
                   root / "items.parquet")
    sparse = ("[{name: user_id, num_embeddings: 20, encoding: mod}, {name: item_id, num_embeddings: 97, encoding: hash, table: item}, "
              "{name: cate, num_embeddings: 4}, {name: seen, num_embeddings: 97, encoding: hash, table: item}]")
    return ["model=dssm", "model.user_features=[user_id]", "model.item_features=[item_id,cate]", "model.tower_layer_sizes=[8]",
            "model.corpus_chunk_rows=7", "data=parquet", f"data.path={root}/rows.parquet", f"data.eval_path={root}/rows.parquet", "data.label=label", f"data.sparse={sparse}",
            f"data.items.path={root}/items.parquet", "data.items.id=item_id", "data.items.features=[cate]", "data.items.seen=seen",
            "data.batch_size=32", "model.eval_metrics=[inbatch_recall@10]", "train.num_steps=4", "train.eval_every_steps=null",
            "distributed.device=cpu", "tracking=none", f"checkpoint.dir={root}/ck"]


def test_two_tower_top_k_equals_a_brute_force_over_the_catalogue_without_the_seen_items(tmp_path: Path) -> None:
    from recsys_runner.inference_build import build_inference
    from recsys_runner.train.corpus import two_tower_of

    overrides = _retrieval_files(tmp_path)
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        train(compose(config_name="config", overrides=overrides))
    (step,) = sorted((tmp_path / "ck").glob("step_*"))[-1:]
    result = predict.run(compose_entry("predict", *overrides, f"load={step}", f"predict.output={tmp_path}/out",
                                       f"predict.top_k={K}", "predict.columns=[user_id]"))
    written = pq.read_table(result.parts)
    assert result.rows == 400 and written.column_names == ["user_id", TOP_ITEMS, TOP_SCORES]

    built = build_inference(validate(compose_entry("predict", *overrides, f"load={step}")), weights=step)
    try:
        towers, table = two_tower_of(built.model), built.data.item_table()
        assert towers is not None and table is not None
        built.model.eval()
        with torch.no_grad():
            dense, sparse = table.rows(np.arange(len(table)), built.data.features.kjt_keys, built.data.features.dense_names)
            items = towers.tower("item", dense, sparse).numpy()
            queries, seen = [], []
            for batch in built.data.eval_batches(0, 1):
                queries.append(towers.tower("user", batch.dense_features, batch.sparse_features).numpy())
                jagged = batch.sparse_features["seen"]
                seen += [ids.numpy() for ids in torch.split(jagged.values(), jagged.lengths().tolist())]
    finally:
        built.close()
    scores = np.concatenate(queries) @ items.T / 0.05
    unmasked = np.argsort(-scores, axis=1, kind="stable")[:, :K]
    rows, found = table.index_of(np.concatenate(seen))
    assert found.all()
    starts = np.cumsum([0, *[len(s) for s in seen]])
    for r in range(scores.shape[0]):
        scores[r, rows[starts[r]:starts[r + 1]]] = -np.inf
    top = np.argsort(-scores, axis=1, kind="stable")[:, :K]
    assert written[TOP_ITEMS].to_pylist() == [table.ids[t].tolist() for t in top]
    np.testing.assert_allclose(np.array(written[TOP_SCORES].to_pylist()), np.take_along_axis(scores, top, axis=1), rtol=1e-4, atol=1e-4)
    assert (unmasked != top).any(), "the seen items changed some row's top-k"

    # model.index=faiss: the HNSW graph over 30 items finds the same lists
    searched = predict.run(compose_entry("predict", *overrides, f"load={step}", f"predict.output={tmp_path}/faiss",
                                         f"predict.top_k={K}", "model.index=faiss"))
    assert pq.read_table(searched.parts)[TOP_ITEMS].to_pylist() == written[TOP_ITEMS].to_pylist()


def test_predict_ranks_a_smaller_catalogue_whatever_the_eval_rows_hold(tmp_path: Path) -> None:
    """Predict scores ``predict.input`` and never evaluates: a catalogue lacking items of the eval rows (which full-corpus
    evaluation refuses, naming the row) ranks its own items for every input row; it was refused by the eval check."""
    overrides, step = train_two_tower(tmp_path)
    half = NUM_ITEMS // 2
    pq.write_table(pq.read_table(tmp_path / "items.parquet").slice(0, half), tmp_path / "half.parquet")
    smaller = f"data.items.path={tmp_path}/half.parquet"
    with pytest.raises(DataError, match=r"is not in the item table .*half\.parquet .*so full-corpus evaluation cannot rank it"):
        evaluate.run(compose_entry("evaluate", *overrides, f"load={step}", smaller))
    result = predict.run(compose_entry("predict", *overrides, f"load={step}", smaller, f"predict.output={tmp_path}/out",
                                       f"predict.top_k={K}", "predict.exclude_seen=false"))
    top = pq.read_table(result.parts)[TOP_ITEMS].to_pylist()
    assert result.rows == 384 and all(len(row) == K and set(row) <= set(range(half)) for row in top)


def test_pass_through_ids_past_the_mapping_or_null_are_written_as_null() -> None:
    from recsys_runner.data.sequences.mapping import _raw_column

    values = np.array(["a", "b", "c"], object)
    ids = pa.chunked_array([pa.array([2, 0, 3, None], pa.int64())])
    assert _raw_column(ids, values).to_pylist() == ["c", "a", None, None]
    lists = pa.chunked_array([pa.array([[1, 5], None, []], pa.list_(pa.int64()))])
    assert _raw_column(lists, values).to_pylist() == [["b", None], None, []]
