"""Sequence models through the rest of the runner: resume, resharding on another world size, evaluate, export, plan, sweeps.

DIN on generated histories (``data=synthetic`` turned into ``data=synthetic_sequences`` by the model's needs) stands in
for every sequence model: the parts exercised here (the EmbeddingCollection of history tables, jagged batches,
per-batch padding) are shared by all of them (``recsys_runner/models/sequence.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from recsys_runner import evaluate, plan
from recsys_runner.__main__ import run
from recsys_runner.checkpoint.storage import list_checkpoints
from recsys_runner.config import validate
from recsys_runner.distributed.plan_report import GB, mb
from recsys_runner.errors import ConfigError
from recsys_runner.train.signals import Interrupted
from tests.conftest import TINY, run_in_process, torchrun
from tests.test_checkpoint import history
from tests.test_evaluate import compose_entry
from tests.test_export import check_export, export_cfg  # noqa: F401 - a fixture

SEQ = ["model=din", "data.batch_size=128", "data.num_train_rows=8192", "data.num_eval_rows=1024"]
"""DIN on small generated histories (its data needs switch the default data to histories)."""
SEQ_DATA = ["data=synthetic_sequences", "data.num_items=2000", "data.num_users=5000", "data.max_len=30"]


def test_sequence_model_resumes_to_the_same_losses_and_eval(make_cfg, mlflow_uri: str, tmp_path: Path) -> None:
    args = [*SEQ, "train.num_steps=10", "train.log_every_steps=1", "optim/dense=adam"]
    run(make_cfg(*args, f"checkpoint.dir={tmp_path}/a", "tracking.experiment=seq_straight"))
    sliced = make_cfg(*args, f"checkpoint.dir={tmp_path}/b", "tracking.experiment=seq_sliced", "train.stop_after_steps=4")
    with pytest.raises(Interrupted, match="after step 4"):
        run(sliced)
    run(make_cfg(*args, f"checkpoint.dir={tmp_path}/b", "tracking.experiment=seq_sliced"))
    expected, resumed = history(mlflow_uri, "seq_straight"), history(mlflow_uri, "seq_sliced")
    assert sorted(resumed) == list(range(1, 11))
    for step in range(1, 11):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
    auc = history(mlflow_uri, "seq_straight", "eval/auc")
    assert history(mlflow_uri, "seq_sliced", "eval/auc") == pytest.approx(auc, rel=1e-6)


def test_evaluate_a_sequence_checkpoint_gives_the_training_eval(make_cfg, tmp_path: Path) -> None:
    trained = run(make_cfg(*SEQ, "train.num_steps=6", f"checkpoint.dir={tmp_path}/ck", "tracking=none"))
    (checkpoint,) = list_checkpoints(tmp_path / "ck")
    metrics = evaluate.run(compose_entry("evaluate", *TINY, *SEQ, f"load={checkpoint}", "tracking=none"))
    assert metrics["eval/auc"] == pytest.approx(trained, abs=1e-6)


@pytest.mark.parametrize("model", ["din", "bst", "sasrec"])
def test_exported_sequence_model_takes_the_jagged_history(make_cfg, export_cfg, tmp_path: Path, model: str) -> None:  # noqa: F811
    # check_export scores the second eval batch, whose histories differ from the traced first one: padding is per call,
    # and loads the program in a process that imports torch alone (no fbgemm op in the graph)
    spec, batch, expected = check_export(make_cfg, export_cfg, tmp_path, *SEQ, f"model={model}")
    kind = "next_item" if model == "sasrec" else "binary"
    assert [o["kind"] for o in spec["outputs"]] == [kind]
    if model == "sasrec":  # every item of the table scored for each row
        assert expected.shape == (batch.labels.shape[0], spec["sparse_features"][1]["num_embeddings"])
    (group,) = spec["sequences"]
    assert group["group"] == "hist" and group["features"] == ["hist_item_id", "hist_category"] and group["timestamps"] == "hist_ts"
    entries = {f["name"]: f for f in spec["sparse_features"]}
    assert entries["hist_item_id"]["history"] == "hist" and entries["hist_ts"]["timestamps_of"] == "hist"
    lengths = batch.sparse_features["hist_item_id"].lengths()
    assert int(lengths.max()) > int(lengths.min()), "the scored batch has histories of several lengths"


def test_plan_counts_the_history_tables(make_cfg) -> None:
    """The history tables (``item``, ``category``: each read by the candidate and the history, unpooled) are planned
    once each at their full size beside the pooled ``t_user_id``, and the rank's memory counts all three: weights and
    Adagrad's state (``optim=adagrad``: one value per weight), 2 · rows · dim · 4 bytes, plus the planner's buffers for a
    batch (measured 27 kB of 9.0 MB)."""
    cfg = make_cfg(*SEQ, "tracking=none")
    report = plan.dry_run(cfg)
    spec = validate(cfg)
    data, dim = spec.served_data, spec.model.embedding_dim
    rows = {"t_user_id": data.num_users, "item": data.num_items, "category": data.num_categories}
    planned = {table: [shard.shard_sizes for shard in option.sharding_spec.shards]
               for module in report.plan.plan.values() for table, option in module.items()} if report.plan else {}
    assert planned == {table: [[n, dim]] for table, n in rows.items()}, planned
    weights = sum(rows.values()) * dim * 4
    (rank,) = report.ranks
    assert report.fits and rank.hbm == 0 and 2 * weights <= rank.ddr <= 1.01 * 2 * weights, (rank, weights)
    assert f"DDR {mb(rank.ddr)}" in report.summary and f"{rank.ddr / GB:8.3f} /" in str(report), str(report)


@pytest.mark.slow
def test_two_ranks_shard_history_tables_and_one_rank_evaluates_the_same(tmp_path: Path) -> None:
    """torchrun, 2 ranks, every table column-wise across both: jagged histories through sharded EmbeddingCollections;
    the 2-rank checkpoint then evaluated on 1 rank (resharded by DCP) gives the 2-rank run's eval."""
    uri = f"sqlite:///{tmp_path}/seq.db"
    args = [*(a for a in TINY if not a.startswith("data.")), *SEQ, *SEQ_DATA, "train.num_steps=16", "distributed.sharding_types=[column_wise]", f"tracking.uri={uri}",
            "tracking.experiment=seq2", f"checkpoint.dir={tmp_path}/ck"]
    out = torchrun(*args, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    client = MlflowClient(tracking_uri=uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("seq2").experiment_id])
    assert mlrun.data.tags["world_size"] == "2" and mlrun.data.metrics["eval/auc"] > 0.55
    sharding = Path(client.download_artifacts(mlrun.info.run_id, "sharding_plan.txt", str(tmp_path))).read_text()
    assert "column_wise" in sharding and "rank:1" in sharding and "item" in sharding
    (checkpoint,) = list_checkpoints(tmp_path / "ck")
    one = evaluate.run(compose_entry("evaluate", *[a for a in args if not a.startswith(("tracking.", "distributed.sharding"))],
                                     "tracking=none", f"load={checkpoint}"))
    auc = one["eval/auc"]
    assert auc == pytest.approx(mlrun.data.metrics["eval/auc"], abs=1e-5)


@pytest.mark.slow
def test_a_sweep_over_a_sequence_model(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/sweep.db"
    out = run_in_process([sys.executable, "-m", "recsys_runner", "-m", *TINY, *SEQ, "train.num_steps=4",  # as python -m runs it
                          "model.attention_layer_sizes=[16],[32]", f"tracking.uri={uri}", "tracking.experiment=seq_sweep",
                          "checkpoint=none", f"hydra.sweep.dir={tmp_path}/multi"], tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("seq_sweep").experiment_id])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 2 and all(r.info.status == "FINISHED" and "eval/auc" in r.data.metrics for r in children)
    assert sorted(json.loads(r.data.params["model.attention_layer_sizes"].replace("'", '"')) for r in children) == [[16], [32]]


def test_history_batches_are_padded_per_batch_not_to_max_len() -> None:
    from recsys_runner.configurable import make
    from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig
    from recsys_runner.models.din import DIN, DINConfig

    data = make(SyntheticSequencesConfig, batch_size=16, max_len=200, length_skew=3.0, num_items=500, num_users=100,
                num_categories=10).build(device="cpu")
    batch = data.batch(0, 0)
    model = DIN(DINConfig(embedding_dim=8, attention_layer_sizes=[8], deep_layer_sizes=[8], attention="padded"), features=data.features)
    for module in (model.arch.ec, model.arch.ebc):
        assert module is not None
        module.to_empty(device="cpu")
    embedded = model.arch(batch.sparse_features)
    history_block = embedded.histories["hist"]
    longest = int(batch.sparse_features["hist_item_id"].lengths().max())
    assert history_block.values.shape[:2] == (16, max(longest, 1)) and longest < 200
    assert torch.equal(history_block.mask.sum(1), batch.sparse_features["hist_item_id"].lengths().long())


def test_history_tables_are_never_data_parallel(make_cfg) -> None:
    """A small history table (20 categories) would be replicated on one rank by the planner's default types; an
    EmbeddingCollection cannot be sharded data_parallel here, so the runner never offers it, and refuses it by name."""
    small = ["data=synthetic_sequences", "data.num_items=500", "data.num_categories=20", "data.batch_size=64",
             "data.num_train_rows=2048", "data.num_eval_rows=512", "train.num_steps=4", "distributed.device=cpu", "tracking=none",
             "checkpoint=none"]
    assert run(make_cfg("model=din", *small, tiny=False)) > 0
    with pytest.raises(ConfigError, match=r"'category' is read unpooled.*cannot be sharded data_parallel.*Fix: "):
        run(make_cfg("model=din", *small, "+distributed.tables={category: {sharding_types: [data_parallel]}}", tiny=False))


def test_the_worked_example_from_a_log_to_din_sasrec_and_predict(make_cfg, tmp_path: Path) -> None:
    """docs/sequences.md's worked example, small: a ratings log → rows with histories → DIN and SASRec train on the
    files with nothing else set → predict scores every eval row of the files, the history read from its list columns."""
    import pyarrow.parquet as pq

    from recsys_runner import predict
    from recsys_runner.data.__main__ import main as data_main
    from recsys_runner.data.generated.generate import write_movielens_ratings

    write_movielens_ratings(str(tmp_path / "ratings.csv"), 20_000, layout="ratings.csv")
    assert data_main(["sequences", str(tmp_path / "ratings.csv"), str(tmp_path / "rows"), "--user", "userId", "--item", "movieId",
                      "--time", "timestamp", "--label", "rating", "--label-threshold", "4", "--max-len", "20"]) == 0
    files = ["data=parquet", f"data.path={tmp_path}/rows/train.parquet", f"data.eval_path={tmp_path}/rows/eval.parquet",
             "data.batch_size=256", "train.num_steps=30", "distributed.device=cpu", "tracking=none"]
    auc = run(make_cfg("model=din", *files, f"checkpoint.dir={tmp_path}/din", tiny=False))
    assert auc > 0.6  # the label (rating >= 4) follows user and item biases the history carries
    assert run(make_cfg("model=sasrec", *files, "checkpoint=none", tiny=False)) > 0  # HR@10 of the held-out next movie
    (checkpoint,) = list_checkpoints(tmp_path / "din")
    result = predict.run(compose_entry("predict", "model=din", *files, f"load={checkpoint}",
                                       f"predict.input={tmp_path}/rows/eval.parquet", f"predict.output={tmp_path}/scores"))
    scores = pq.read_table(result.parts).column("score").to_numpy()
    assert len(scores) == pq.read_metadata(tmp_path / "rows" / "eval.parquet").num_rows
    assert ((scores > 0) & (scores < 1)).all() and scores.std() > 0.01
