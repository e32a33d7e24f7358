"""Task kinds beyond binary and regression: a multi-class task (its loss, metrics, generated labels, training, export,
errors), and a masked task's metrics (``only_where_positive``: computed over the mask task's positive rows only)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torchrec.datasets.utils import Batch

from recsys_runner import export, predict
from recsys_runner.__main__ import run as run_training
from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.metrics.registry import MetricsConfig
from recsys_runner.metrics.tasks import TaskEvalMetrics, TaskTrainMetrics, check_task_metrics
from recsys_runner.models.multitask import MultiTaskConfig
from recsys_runner.models.train_wrapper import TrainWrapper
from recsys_runner.tasks import BinaryTask, MulticlassTask, Task, check_batch_labels, output_columns
from recsys_runner.train.loop import train
from tests.conftest import FixedHeads, free_port
from tests.test_evaluate import compose_entry
from tests.test_export import SMALL, check_export, export_cfg  # noqa: F401 - a fixture

MULTICLASS = ["model=mmoe", "model.tasks=[ctr,category]", "+model.task_specs.category={kind: multiclass, num_classes: 5}",
              "model.num_experts=2", "model.expert_layer_sizes=[32]", "model.tower_layer_sizes=[16]", "model.embedding_dim=8"]




def _forward(tasks: tuple[Task, ...], out: dict[str, torch.Tensor], labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    wrapper = TrainWrapper(FixedHeads(tasks, out))
    loss, (_, logits, targets) = wrapper(Batch(dense_features=torch.zeros(len(labels), 1), sparse_features=None, labels=labels))  # type: ignore[arg-type]
    return loss, logits, targets


def _auc(preds: np.ndarray, labels: np.ndarray) -> float:
    """AUC by counting every (positive, negative) pair, ties ½: the definition, not the metric's rank formula."""
    pos, neg = preds[labels > 0.5], preds[labels <= 0.5]
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg)))


# -- multi-class: loss, layout, metrics -------------------------------------------------------------------------------------
def test_multiclass_loss_is_cross_entropy_and_its_metrics_read_the_class_probabilities() -> None:
    g = torch.Generator().manual_seed(0)
    n, c = 64, 4
    ctr, category = torch.randn(n, generator=g), torch.randn(n, c, generator=g)
    labels = torch.stack([torch.randint(0, 2, (n,), generator=g).float(), torch.randint(0, c, (n,), generator=g).float()], dim=1)
    tasks = (BinaryTask("ctr", column=0), MulticlassTask("category", column=1, num_classes=c, weight=0.5))
    loss, logits, targets = _forward(tasks, {"ctr": ctr, "category": category}, labels)
    expected = F.binary_cross_entropy_with_logits(ctr, labels[:, 0]) + 0.5 * F.cross_entropy(category, labels[:, 1].long())
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    assert logits.shape == (n, 1 + c) and targets.shape == (n, 2)  # outputs side by side, one target per task
    assert output_columns(tasks) == [slice(0, 1), slice(1, 1 + c)]
    torch.testing.assert_close(logits[:, 1:], category)

    metrics = TaskEvalMetrics(MetricsConfig(), tasks, torch.device("cpu"))
    metrics.update(logits[:32], targets[:32])
    metrics.update(logits[32:], targets[32:])
    got = metrics.compute()
    probs, y = torch.softmax(category.double(), 1), labels[:, 1].long()
    assert list(got) == ["eval/ctr/auc", "eval/ctr/logloss", "eval/category/accuracy", "eval/category/logloss", "eval/category/auc"]
    assert got["eval/category/accuracy"] == pytest.approx(float((category.argmax(1) == y).double().mean()))
    assert got["eval/category/logloss"] == pytest.approx(float(F.cross_entropy(category.double(), y)), rel=1e-6)
    macro = np.mean([_auc(probs[:, k].numpy(), (y == k).numpy()) for k in range(c)])
    assert got["eval/category/auc"] == pytest.approx(macro, rel=1e-9)
    train_metrics = TaskTrainMetrics(MetricsConfig(), tasks, torch.device("cpu"), flush_every=10)
    train_metrics.update(logits, targets)
    assert set(train_metrics.compute()) == {"train/ctr/auc", "train/category/accuracy"}


def test_a_label_outside_the_classes_is_a_data_error_naming_the_column_and_value() -> None:
    """Checked on the host as the batch is read (tests/test_host_syncs.py: no sync in the step), not in the forward."""
    tasks = (BinaryTask("ctr", column=0), MulticlassTask("category", column=1, num_classes=3, label="genre"))
    with pytest.raises(DataError, match=r"task 'category': its label 'genre' holds 7, but .* num_classes=3 needs class indices 0..2"):
        check_batch_labels(tasks, torch.tensor([[0.0, 1.0], [1.0, 7.0], [0.0, 2.0]]), "training batch")
    with pytest.raises(DataError, match=r"holds 1.5"):
        check_batch_labels(tasks, torch.tensor([[0.0, 1.5], [1.0, 0.0], [0.0, 2.0]]), "training batch")
    check_batch_labels(tasks, torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 2.0]]), "training batch")  # every class in 0..2


@pytest.mark.parametrize(
    ("specs", "kinds", "message"),
    [
        ({"category": {"kind": "multiclass", "num_classes": 1}}, None, r"model.task_specs.category.num_classes must be an integer >= 2, got 1"),
        ({"category": {"kind": "multiclass"}}, None, r"task 'category' is multiclass but has no number of classes"),
        ({}, ["binary", "multiclass"], r"task 'category' is multiclass but has no number of classes"),
        ({"category": {"num_classes": 5}}, None, r"model.task_specs.category.num_classes=5 is only for a multiclass task, but 'category' is binary"),
        ({"category": {"kind": "huber", "num_classes": 5}}, None, r"is only for a multiclass task, but 'category' is huber"),
        ({"category": {"kind": "multiclass", "num_classes": 5, "train_metrics": ["auc"]}}, None,
         r"model.task_specs.category.train_metrics lists \['auc'\]; a multiclass task's train metrics are \['accuracy', 'logloss'\]"),
    ],
)
def test_bad_multiclass_specs_are_refused_naming_the_key(specs: dict, kinds: list[str] | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MultiTaskConfig(tasks=["ctr", "category"], task_kinds=kinds, task_specs=specs)


def test_a_multiclass_task_takes_only_metrics_that_read_class_probabilities() -> None:
    task = MulticlassTask("category", column=1, num_classes=3, eval_metrics=("accuracy", "mse"))
    with pytest.raises(ConfigError, match=r"lists 'mse'; the model's eval is multiclass, so only accuracy, auc, logloss apply"):
        check_task_metrics(MetricsConfig(), (task,))


# -- masked task metrics -------------------------------------------------------------------------------------------------
def test_a_masked_tasks_metrics_see_only_the_rows_where_the_mask_task_is_positive() -> None:
    g = torch.Generator().manual_seed(1)
    n = 400
    click = torch.randint(0, 2, (n,), generator=g).float()
    buy = click * torch.randint(0, 2, (n,), generator=g).float()
    logits = torch.randn(n, 2, generator=g)
    logits[:, 1] += 2 * (1 - click)  # unclicked rows score high: counting them would change the AUC a lot
    labels = torch.stack([click, buy], dim=1)
    tasks = (BinaryTask("ctr", column=0), BinaryTask("cvr", column=1, mask_column=0))
    metrics = TaskEvalMetrics(MetricsConfig(eval=["auc", "logloss", "accuracy"]), tasks, torch.device("cpu"))
    for part in torch.arange(n).chunk(3):
        metrics.update(logits[part], labels[part])
    got = metrics.compute()
    clicked = click > 0
    p = torch.sigmoid(logits[:, 1])
    assert got["eval/cvr/auc"] == pytest.approx(_auc(p[clicked].numpy(), buy[clicked].numpy()), rel=1e-9)
    assert got["eval/cvr/auc"] != pytest.approx(_auc(p.numpy(), buy.numpy()), abs=0.01)
    assert got["eval/cvr/logloss"] == pytest.approx(float(F.binary_cross_entropy(p[clicked].double(), buy[clicked].double())), rel=1e-6)
    assert got["eval/ctr/auc"] == pytest.approx(_auc(torch.sigmoid(logits[:, 0]).numpy(), click.numpy()), rel=1e-9)  # unmasked: all rows
    train_metrics = TaskTrainMetrics(MetricsConfig(train=["accuracy"]), tasks, torch.device("cpu"), flush_every=1)
    train_metrics.update(logits, labels)
    assert train_metrics.compute()["train/cvr/accuracy"] == pytest.approx(float(((p[clicked] >= 0.5) == (buy[clicked] > 0)).double().mean()))


# -- end to end: generated data, training, export ---------------------------------------------------------------------------
def test_mmoe_learns_a_multiclass_task_from_generated_data_and_exports_it(make_cfg, export_cfg, tmp_path: Path) -> None:  # noqa: F811
    c = build(validate(make_cfg(*MULTICLASS, "train.num_steps=150", "data.num_train_rows=65536", "tracking=none", "checkpoint=none")))
    try:
        classes = torch.cat([b.labels[:, 1] for b in c.loop.data.eval_batches(0, 1)]).long()
        final = train(c.loop)
    finally:
        c.close()
    majority = float(torch.bincount(classes, minlength=5).max()) / len(classes)
    print(f"multiclass accuracy {final['eval/category/accuracy']:.4f} (majority class {majority:.4f}, chance 0.2), "
          f"logloss {final['eval/category/logloss']:.4f}, macro AUC {final['eval/category/auc']:.4f}")
    assert bool((classes >= 0).all() and (classes < 5).all()) and len(set(classes.tolist())) == 5
    assert final["eval/category/accuracy"] > majority + 0.05, final
    assert final["eval/category/auc"] > 0.6 and final["eval/ctr/auc"] > 0.6, final

    spec, _, expected = check_export(make_cfg, export_cfg, tmp_path, *MULTICLASS)
    assert [(o["name"], o["kind"], o["shape"]) for o in spec["outputs"]] == [("ctr", "binary", []), ("category", "multiclass", [5])]
    assert expected.shape[1] == 6 and "softmax" in spec["outputs"][1]["meaning"]
    assert json.loads((tmp_path / "export" / export.FEATURE_SPEC_FILE).read_text())["output_type"] == "dict[task name, Tensor]"


@pytest.mark.parametrize("model", ["ple", "dbmtl"])
def test_ple_and_dbmtl_heads_output_the_classes(make_cfg, model: str) -> None:
    overrides = [f"model={model}", "model.tasks=[ctr,category]", "+model.task_specs.category={kind: multiclass, num_classes: 3}"]
    c = build(validate(make_cfg(*overrides, *SMALL, "tracking=none", "checkpoint=none")))
    try:
        final = train(c.loop)
        batch = next(iter(c.loop.data.eval_batches(0, 1)))  # the one eval batch (train.eval_max_batches=1)
        model = c.loop.evaluator.model.eval()
        with torch.no_grad():
            _, (_, logits, labels) = model(batch)
    finally:
        c.close()
    assert {"eval/category/accuracy", "eval/category/logloss", "eval/category/auc"} <= set(final)
    assert logits.shape == (64, 1 + 3) and torch.isfinite(logits).all()  # the ctr logit, then the 3 classes' logits
    classes = labels[:, 1].long()
    assert final["eval/category/accuracy"] == pytest.approx(float((logits[:, 1:].argmax(1) == classes).double().mean()))
    assert final["eval/category/logloss"] == pytest.approx(float(F.cross_entropy(logits[:, 1:].double(), classes)), rel=1e-5)


# -- files: an int label column through data.labels, predict, bad values -----------------------------------------------------
def _genre_parquet(directory: Path, genre: list[int] | None = None, rows: int = 2048) -> Path:
    """A click and a 3-class genre (the item id mod 3, so it is learnable), a price and an item id."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    item = rng.integers(0, 30, rows)
    table = pa.table({"click": pa.array(rng.integers(0, 2, rows), pa.int8()),
                      "genre": pa.array(genre if genre is not None else item % 3, pa.int64()),
                      "price": pa.array(rng.random(len(item))), "item": pa.array(item, pa.int64()),
                      "request_id": pa.array(np.arange(len(item)))})
    pq.write_table(table, directory / "a.parquet", row_group_size=512)
    return directory


def _file_overrides(path: Path, tmp_path: Path, classes: int = 3) -> list[str]:
    return ["model=mmoe", "model.tasks=[ctr,category]", f"+model.task_specs.category={{kind: multiclass, num_classes: {classes}}}",
            "data=parquet", f"data.path={path}", "data.labels={ctr: click, category: genre}", "data.label_kinds={category: multiclass}",
            "data.dense=[{name: price}]", "data.sparse=[{name: item, num_embeddings: 30}]", "data.batch_size=128",
            "train.num_steps=40", "train.log_every_steps=20", "train.eval_every_steps=null", "distributed.device=cpu",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.experiment=multiclass_file", f"checkpoint.dir={tmp_path}/ck"]


def test_a_multiclass_label_from_a_file_trains_and_predict_writes_the_class_and_its_probability(tmp_path: Path) -> None:
    overrides = _file_overrides(_genre_parquet(tmp_path / "train"), tmp_path)
    objective = run_training(compose_entry("config", *overrides))
    assert objective > 0.0
    result = predict.run(compose_entry("predict", *overrides, f"load={tmp_path}/ck", f"predict.output={tmp_path}/out",
                                       "predict.columns=[request_id]"))
    written = pq.read_table(result.parts[0])
    assert written.column_names == ["request_id", "score_ctr", "class_category", "score_category"]
    classes, probs = written["class_category"].to_numpy(), written["score_category"].to_numpy()
    assert written.schema.field("class_category").type == pa.int64() and set(classes) <= {0, 1, 2}
    assert bool(((probs >= 1 / 3 - 1e-6) & (probs <= 1)).all())  # the most probable of 3 classes
    source = pq.read_table(tmp_path / "train" / "a.parquet")
    assert float((classes == source["genre"].to_numpy()).mean()) > 0.5  # genre = item mod 3: learned from the item id


@pytest.mark.parametrize(("genre", "classes", "message"), [
    ([0, 1, -1, 2], 3, r"column 'genre': the label \(task 'category'\) is -1, but a multiclass label is a class index"),
    ([0, 1, 5, 2], 3, r"task 'category': its label 'category' holds 5, but a multiclass task with num_classes=3"),
])
def test_a_bad_class_in_a_file_is_a_data_error_naming_the_column(tmp_path: Path, genre: list[int], classes: int, message: str) -> None:
    path = _genre_parquet(tmp_path / "train", genre=genre * 64, rows=256)
    with pytest.raises(DataError, match=message):
        run_training(compose_entry("config", *_file_overrides(path, tmp_path, classes), "train.num_steps=2"))


# -- two ranks: masked rows and class probabilities, uneven per rank ----------------------------------------------------------
TWO_RANK_TASKS = (BinaryTask("ctr", column=0), BinaryTask("cvr", column=1, mask_column=0),
                  MulticlassTask("category", column=2, num_classes=3))


def _rank_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s eval ``(logits [B, 1+1+3], labels [B, 3])``: uneven sizes and clicked rows (a batch without any)."""
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for n in ([40, 7] if rank == 0 else [65, 30, 12]):
        click = (torch.rand(n, generator=g) < (0.0 if n == 7 else 0.4)).float()
        labels = torch.stack([click, click * (torch.rand(n, generator=g) < 0.5).float(), torch.randint(0, 3, (n,), generator=g).float()], 1)
        out.append((torch.randn(n, 5, generator=g), labels))
    return out


def _two_rank_values(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    metrics = TaskEvalMetrics(MetricsConfig(), TWO_RANK_TASKS, torch.device("cpu"))
    for logits, labels in batches:
        metrics.update(logits, labels)
    return metrics.compute()


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(_two_rank_values(_rank_batches(rank))))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_masked_and_multiclass_metrics_on_two_ranks_equal_one_process_over_the_union(tmp_path: Path) -> None:
    mp.spawn(_two_rank_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    union = _two_rank_values([*_rank_batches(0), *_rank_batches(1)])
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == pytest.approx(union, rel=1e-9), rank
    alone = [_two_rank_values(_rank_batches(r)) for r in range(2)]
    assert (alone[0]["eval/cvr/auc"] + alone[1]["eval/cvr/auc"]) / 2 != pytest.approx(union["eval/cvr/auc"], rel=1e-6)
