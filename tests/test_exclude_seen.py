"""metrics.exclude_seen: a row's earlier items score -inf except its true item, for next-item models (the row's history)
and two-tower full-corpus metrics (seen catalogue rows); the metrics equal a brute-force numpy ranking of the model's
own scores with that mask, on 1 rank and on 2 ranks with the item table sharded column-wise. A two-tower model (dssm)
trained a few steps on generated files with a history feature and a ``data.items.seen`` column: its full-corpus eval
with exclude_seen equals numpy's ranking of its towers' vectors with those items masked, on 1 and on 2 gloo ranks."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from recsys_runner import evaluate
from recsys_runner.__main__ import run as train
from recsys_runner.config import register_configs
from recsys_runner.configurable import make
from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
from recsys_runner.errors import ConfigError
from recsys_runner.metrics.corpus import corpus_ranks
from recsys_runner.metrics.registry import MetricsConfig, build_eval_metrics
from recsys_runner.models.sasrec import SASRec, SASRecConfig
from recsys_runner.models.train_wrapper import TrainWrapper
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.train.corpus import two_tower_of, use_ranking_protocol
from tests.conftest import torchrun
from tests.test_evaluate import compose_entry
from tests.test_next_item import SMALL

NAMES = ["hr@1", "hr@10", "ndcg@10", "mrr"]


def brute_force(scores: np.ndarray, targets: np.ndarray, seen: list[np.ndarray], ks: tuple[int, ...] = (1, 10)) -> dict[str, float]:
    """``NAMES`` in numpy (``hr@k`` for each of ``ks``, ndcg@10, mrr): each row's seen items (not its target) dropped,
    then the target ranked among the rest (items strictly higher, plus half the other ties)."""
    ranks = []
    for row, t, s in zip(scores, targets, seen, strict=True):
        keep = np.ones(row.shape[0], bool)
        keep[s] = False
        keep[t] = True
        rest = row[keep]
        ranks.append(float((rest > row[t]).sum() + 0.5 * ((rest == row[t]).sum() - 1)))
    r = np.array(ranks)
    return {**{f"hr@{k}": float((r < k).mean()) for k in ks},
            "ndcg@10": float(np.where(r < 10, 1 / np.log2(r + 2), 0).mean()), "mrr": float((1 / (r + 1)).mean())}


def _model_and_data() -> tuple[TrainWrapper, SASRec, object]:
    data = make(SyntheticSequencesConfig, batch_size=32, num_items=80, num_categories=4, num_users=40, max_len=12,
                num_train_rows=64, num_eval_rows=96).for_model(SASRecConfig().data_needs()).build()
    torch.manual_seed(0)
    model = SASRec(make(SASRecConfig, embedding_dim=8), features=data.features)
    model.arch.to_empty(device=torch.device("cpu"))
    for p in model.arch.parameters():
        torch.nn.init.normal_(p, std=0.3)
    wrapper = TrainWrapper(model, features=data.features)
    wrapper.eval()
    return wrapper, model, data


def test_next_item_exclude_seen_equals_a_brute_force_ranking_on_one_rank() -> None:
    wrapper, model, data = _model_and_data()
    spec = MetricsConfig(eval=NAMES, train=[], exclude_seen=True)
    masked = build_eval_metrics(spec, torch.device("cpu"))
    full = build_eval_metrics(spec, torch.device("cpu"))
    all_scores, all_targets, all_seen = [], [], []
    repeats = 0
    with torch.no_grad():
        for batch in data.eval_batches(0, 1):  # type: ignore[attr-defined]
            use_ranking_protocol(wrapper, data, MetricsConfig(exclude_seen=False), two_tower=False)
            _, (_, scores, targets) = wrapper(batch)
            full.update(scores, targets)
            use_ranking_protocol(wrapper, data, spec, two_tower=False)
            _, (_, masked_scores, masked_targets) = wrapper(batch)
            assert torch.equal(masked_targets, targets)
            masked.update(masked_scores, targets)
            history = batch.sparse_features["hist_item_id"]
            for row, ids in enumerate(torch.split(history.values(), history.lengths().tolist())):
                unseen = torch.ones(scores.shape[1], dtype=torch.bool)
                unseen[ids] = False
                unseen[targets[row]] = True
                assert torch.equal(masked_scores[row][unseen], scores[row][unseen])
                assert bool(torch.isneginf(masked_scores[row][~unseen]).all())
                repeats += int((ids == targets[row]).any())
                all_seen.append(ids.numpy())
            all_scores.append(scores.numpy())
            all_targets.append(targets.numpy())
    assert model.exclude_seen
    expected = brute_force(np.concatenate(all_scores), np.concatenate(all_targets), all_seen)
    got = {k: float(v) for k, v in masked.compute().items()}
    assert got == pytest.approx(expected, rel=1e-12)
    unmasked = {k: float(v) for k, v in full.compute().items()}
    assert got["mrr"] > unmasked["mrr"], "excluding seen items can only raise the true item"
    print(f"rows with a repeated target: {repeats}")


def test_exclude_seen_without_histories_names_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"metrics.exclude_seen=true .*Fix: metrics.exclude_seen=false, or one of those"):
        use_ranking_protocol(torch.nn.Linear(2, 2), _model_and_data()[2], MetricsConfig(exclude_seen=True), two_tower=False)


@pytest.mark.parametrize("chunk_rows", [1, 7, 1000])
def test_corpus_ranks_exclude_seen_rows_like_numpy(chunk_rows: int) -> None:
    g = torch.Generator().manual_seed(5)
    queries, index = torch.randint(-2, 3, (30, 4), generator=g).float(), torch.randint(-2, 3, (57, 4), generator=g).float()
    targets = torch.randint(0, 57, (30,), generator=g)
    seen = torch.randint(-1, 57, (30, 9), generator=g)  # -1: padding; some rows hold their own target (a repeat)
    seen[0, 0] = targets[0]
    ranks, top = corpus_ranks(queries, index, targets, 5, chunk_rows, seen=seen)
    full = (queries @ index.t()).numpy()
    expected = brute_force(full, targets.numpy(), [s[s >= 0].numpy() for s in seen])
    r = ranks.numpy()
    got = {"hr@1": float((r < 1).mean()), "hr@10": float((r < 10).mean()),
           "ndcg@10": float(np.where(r < 10, 1 / np.log2(r + 2), 0).mean()), "mrr": float((1 / (r + 1)).mean())}
    assert got == pytest.approx(expected, rel=1e-12)
    for q in range(30):  # the top rows are never a seen item other than the target
        excluded = set(seen[q][seen[q] >= 0].tolist()) - {int(targets[q])}
        assert not excluded & set(top[q].tolist())


def _eval_rows(tmp_path: Path, overrides: list[str], checkpoint: Path) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """The checkpoint's unmasked full-table scores of every eval row on one process, its targets and histories."""
    from recsys_runner.config import validate
    from recsys_runner.inference_build import build_inference
    from tests.test_evaluate import compose_entry

    spec = validate(compose_entry("evaluate", *overrides, "tracking=none", f"load={checkpoint}"))
    built = build_inference(spec, weights=checkpoint)
    scores, targets, seen = [], [], []
    try:
        built.model.eval()
        with torch.no_grad():
            for batch in built.data.eval_batches(0, 1):
                _, (_, s, t) = built.model(batch)
                history = batch.sparse_features["hist_item_id"]
                seen += [ids.numpy() for ids in torch.split(history.values(), history.lengths().tolist())]
                scores.append(s.numpy())
                targets.append(t.numpy())
    finally:
        built.close()
    return np.concatenate(scores), np.concatenate(targets), seen


@pytest.mark.slow
def test_two_ranks_with_the_item_table_sharded_column_wise_exclude_seen(tmp_path: Path) -> None:
    """torchrun, 2 ranks, gloo: every table split column-wise (row-wise has no CPU kernel), so each rank holds a part of
    every item vector and eval reads the whole table through the sharded EmbeddingCollection on both ranks; exclude_seen
    on. One launch checks both: its final eval metrics (each rank half of the eval rows, sasrec's default hr@10, ndcg@10,
    hr@50, mrr) equal ``evaluate`` of the same checkpoint on one process, and numpy's ranking of that checkpoint's
    unmasked scores (one process) with the mask. (tests/test_next_item.py's 2-rank run, merged here: one launch fewer.)"""
    from recsys_runner.checkpoint.storage import list_checkpoints

    uri = f"sqlite:///{tmp_path}/seen.db"
    overrides = [*(o for o in SMALL if o != "checkpoint=none"), "train.num_steps=30", "distributed.sharding_types=[column_wise]",
                 "model.embedding_dim=256"]  # two 128-wide column shards (TorchRec's smallest) of the item table, one per rank
    out = torchrun(*overrides, "metrics.exclude_seen=true", f"checkpoint.dir={tmp_path}/ck", f"tracking.uri={uri}", "tracking.experiment=seen2",
                   f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    client = MlflowClient(tracking_uri=uri)
    (logged,) = client.search_runs([client.get_experiment_by_name("seen2").experiment_id])
    assert logged.data.tags["world_size"] == "2"
    plan = Path(client.download_artifacts(logged.info.run_id, "sharding_plan.txt", str(tmp_path))).read_text()
    item_shards = [line for line in plan.splitlines() if line.startswith("item ")]
    assert any("column_wise" in line for line in item_shards), plan
    assert any("rank:0" in line for line in item_shards) and any("rank:1" in line for line in item_shards), plan
    two = {k: v for k, v in logged.data.metrics.items() if k.startswith("eval/")}
    assert set(two) == {"eval/hr_at_10", "eval/ndcg_at_10", "eval/hr_at_50", "eval/mrr"} and two["eval/hr_at_10"] > 0.3, two
    alone = evaluate.run(compose_entry("evaluate", *overrides, "metrics.exclude_seen=true", f"load={tmp_path}/ck", "tracking=none"))
    assert alone == pytest.approx(two, abs=1e-6), "one process over all eval rows, the table on one rank"
    (checkpoint,) = list_checkpoints(tmp_path / "ck")
    scores, targets, seen = _eval_rows(tmp_path, overrides, checkpoint)  # without the mask
    expected = brute_force(scores, targets, seen, ks=(10, 50))
    assert two == pytest.approx({f"eval/{k.replace('@', '_at_')}": v for k, v in expected.items()}, abs=1e-6)
    full = brute_force(scores, targets, [np.zeros(0, np.int64)] * len(seen), ks=(10, 50))
    print(f"2 ranks, exclude_seen: {two}; one process without the mask: {full}")
    assert not math.isclose(full["mrr"], expected["mrr"]), "the mask changed the ranking"


def test_two_tower_exclude_seen_without_a_history_or_seen_column_names_the_fix(make_cfg) -> None:
    from recsys_runner.build import build
    from recsys_runner.config import validate
    from tests.test_corpus_eval import CORPUS

    cfg = make_cfg(*CORPUS, "metrics.exclude_seen=true", "tracking=none", "checkpoint=none")
    with pytest.raises(ConfigError, match=r"model reads no history of items .*Fix: data.items.seen=<a list column"):
        build(validate(cfg)).close()


# --- two-tower: dssm trained on generated files with a history feature and data.items.seen ---

TOWER_NAMES = ["recall@1", "recall@10", "ndcg@10", "mrr"]
"""The two-tower eval metrics; ``brute_force`` names them ``hr@…`` (``recall@k`` is ``hr@k`` with one relevant item)."""
NUM_ITEMS = 60


def two_tower_files(root: Path) -> list[str]:
    """Generated two-tower rows in ``root`` (384 of: a user, the item it took, its last two items ``hist`` — a user-tower
    feature reading the item table — and ``seen``, 0-6 earlier items, holding the row's own item in every 9th row: a
    repeat) and their catalogue of ``NUM_ITEMS`` items; the overrides that train dssm a few steps on them (1 rank, no
    tracking, checkpoints in ``root/ck``; the eval reads the same rows)."""
    rng = np.random.default_rng(0)
    n, users = 384, 24
    user = rng.integers(0, users, n)
    item = (user * 5 + rng.integers(0, 8, n)) % NUM_ITEMS  # each user's items are near one another
    hist = [rng.choice(NUM_ITEMS, 2, replace=False).tolist() for _ in range(n)]
    seen = [rng.choice(NUM_ITEMS, int(rng.integers(0, 7)), replace=False).tolist() for _ in range(n)]
    for r in range(0, n, 9):
        seen[r] = [*seen[r], int(item[r])]
    ids = pa.list_(pa.int64())
    pq.write_table(pa.table({"label": np.ones(n, np.int64), "user_id": user, "item_id": item, "cate": item % 5,
                             "hist": pa.array(hist, ids), "seen": pa.array(seen, ids)}), root / "rows.parquet", row_group_size=96)
    pq.write_table(pa.table({"item_id": np.arange(NUM_ITEMS), "cate": np.arange(NUM_ITEMS) % 5}), root / "items.parquet")
    item_table = "num_embeddings: 64, encoding: mod, table: item"
    sparse = (f"[{{name: user_id, num_embeddings: {users}, encoding: mod}}, {{name: item_id, {item_table}}}, "
              f"{{name: cate, num_embeddings: 5, encoding: mod}}, {{name: hist, {item_table}}}, {{name: seen, {item_table}}}]")
    return ["model=dssm", "model.user_features=[user_id,hist]", "model.item_features=[item_id,cate]", "model.tower_layer_sizes=[8]",
            f"model.eval_metrics=[{','.join(TOWER_NAMES)}]", "model.corpus_chunk_rows=16", "data=parquet",
            f"data.path={root}/rows.parquet", f"data.eval_path={root}/rows.parquet", "data.label=label", f"data.sparse={sparse}",
            f"data.items.path={root}/items.parquet", "data.items.id=item_id", "data.items.features=[cate]", "data.items.seen=seen",
            "data.batch_size=32", "train.num_steps=6", "train.eval_every_steps=null", "distributed.device=cpu", "tracking=none",
            f"checkpoint.dir={root}/ck"]


def train_two_tower(root: Path) -> tuple[list[str], Path]:
    """dssm trained on :func:`two_tower_files` in this process: its overrides and final checkpoint."""
    overrides = two_tower_files(root)
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        train(compose(config_name="config", overrides=overrides))
    return overrides, sorted((root / "ck").glob("step_*"))[-1]


def tower_rows(overrides: list[str], checkpoint: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """The checkpoint's towers on one process, in numpy: every eval query's vector ``[Q, O]``, every catalogue item's
    ``[N, O]``, each query's item as a catalogue row ``[Q]`` and its seen rows (``hist`` and ``seen`` together)."""
    from recsys_runner.config import validate
    from recsys_runner.inference_build import build_inference

    built = build_inference(validate(compose_entry("evaluate", *overrides, f"load={checkpoint}")), weights=checkpoint)
    try:
        towers, table = two_tower_of(built.model), built.data.item_table()
        assert towers is not None and table is not None and len(table) == NUM_ITEMS
        built.model.eval()
        queries, targets, seen = [], [], []
        with torch.no_grad():
            dense, sparse = table.rows(np.arange(len(table)), built.data.features.kjt_keys, built.data.features.dense_names)
            items = towers.tower("item", dense, sparse).numpy()
            for batch in built.data.eval_batches(0, 1):
                queries.append(towers.tower("user", batch.dense_features, batch.sparse_features).numpy())
                targets.append(batch.sparse_features["item_id"].values().numpy())
                per_feature = [torch.split(batch.sparse_features[f].values(), batch.sparse_features[f].lengths().tolist())
                               for f in ("hist", "seen")]
                seen += [np.concatenate([ids.numpy() for ids in row]) for row in zip(*per_feature, strict=True)]
    finally:
        built.close()
    rows, found = table.index_of(np.concatenate(targets))
    assert found.all()
    return np.concatenate(queries), items, rows, [table.index_of(s)[0] for s in seen]


def as_tower_keys(metrics: dict[str, float]) -> dict[str, float]:
    """``brute_force``'s values under the logged keys of ``TOWER_NAMES``."""
    return {f"eval/{k.replace('hr@', 'recall@').replace('@', '_at_')}": v for k, v in metrics.items()}


@pytest.fixture(scope="module")
def two_tower(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path, dict[str, float], dict[str, float]]:
    """dssm trained on the generated files; its overrides, checkpoint, and numpy's values of ``TOWER_NAMES`` over all eval
    queries with the seen items masked (the target kept) and without a mask."""
    overrides, checkpoint = train_two_tower(tmp_path_factory.mktemp("two_tower_seen"))
    queries, items, targets, seen = tower_rows(overrides, checkpoint)
    scores = queries @ items.T
    assert sum(int(t in s) for t, s in zip(targets, seen, strict=True)) >= 384 // 9, "repeats: the target is kept"
    masked = as_tower_keys(brute_force(scores, targets, seen))
    full = as_tower_keys(brute_force(scores, targets, [np.zeros(0, np.int64)] * len(seen)))
    return overrides, checkpoint, masked, full


def test_two_tower_exclude_seen_equals_a_brute_force_ranking_on_one_rank(two_tower) -> None:
    overrides, checkpoint, masked, full = two_tower
    got = evaluate.run(compose_entry("evaluate", *overrides, f"load={checkpoint}", "metrics.exclude_seen=true"))
    assert got == pytest.approx(masked, rel=1e-12)
    assert got["eval/mrr"] > full["eval/mrr"], "excluding seen items can only raise the true item"


@pytest.mark.slow
def test_two_tower_two_ranks_exclude_seen_equals_a_brute_force_ranking(two_tower, mlflow_uri: str, tmp_path: Path) -> None:
    """torchrun, 2 gloo ranks, tables split column-wise: ``python -m recsys_runner.evaluate`` of the trained checkpoint
    with exclude_seen (each rank builds half the item index, gathers it and ranks half the queries); the logged
    full-corpus metrics equal numpy's masked ranking on one process."""
    overrides, checkpoint, masked, _ = two_tower
    overrides = [o for o in overrides if not o.startswith("tracking")]
    out = torchrun(*overrides, f"load={checkpoint}", "metrics.exclude_seen=true", "distributed.sharding_types=[column_wise]",
                   f"tracking.uri={mlflow_uri}", "tracking.experiment=two_tower_seen_2_ranks", f"hydra.run.dir={tmp_path}/run",
                   cwd=tmp_path, module="recsys_runner.evaluate")
    assert out.returncode == 0, out.stderr[-4000:]
    client = MlflowClient(tracking_uri=mlflow_uri)
    (logged,) = client.search_runs([client.get_experiment_by_name("two_tower_seen_2_ranks").experiment_id])
    assert logged.data.tags["world_size"] == "2"
    assert {k: v for k, v in logged.data.metrics.items() if k.startswith("eval/")} == pytest.approx(masked, rel=1e-12)
