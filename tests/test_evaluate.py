"""``python -m recsys_runner.evaluate``: a checkpoint's eval metrics, exactly the training's, as a linked MLflow run."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from recsys_runner import compare_table, evaluate
from recsys_runner.__main__ import run as train
from recsys_runner.config import register_configs
from recsys_runner.errors import CheckpointError, ConfigError
from recsys_runner.paths import CONFIG_PATH

MANIFEST_TAGS = ("manifest.command", "manifest.git_commit", "manifest.git_dirty", "manifest.device", "manifest.world_size",
                 "manifest.version.torch", "manifest.version.torchrec")


def compose_entry(name: str, *overrides: str) -> DictConfig:
    """Compose ``conf/<name>.yaml`` as its entry point does (importing the entry's module stored its ``<name>_schema``)."""
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def _training_overrides(make_cfg: Callable[..., DictConfig], *extra: str) -> list[str]:
    """The overrides ``make_cfg`` composes with (TINY, this test's store and experiment) plus ``extra``."""
    from tests.conftest import TINY

    cfg = make_cfg(*extra)
    return [*TINY, f"tracking.uri={cfg.tracking.uri}", f"tracking.experiment={cfg.tracking.experiment}", *extra]


def test_evaluate_reproduces_final_eval_exactly(make_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    # EMA weights for eval and a batch cap: both must be honoured for the numbers to agree.
    extra = ("train.ema.decay=0.9", "train.ema.eval_with_ema=true", "train.eval_max_batches=5", f"checkpoint.dir={tmp_path}/ck")
    overrides = _training_overrides(make_cfg, *extra)
    train(make_cfg(*extra))
    uri = make_cfg().tracking.uri
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(make_cfg().tracking.experiment)
    (trained,) = client.search_runs([experiment.experiment_id])
    final = {k: v for k, v in trained.data.metrics.items() if k.startswith("eval/")}
    assert set(final) == {"eval/auc", "eval/logloss"}

    # By MLflow run id: the run's checkpoint_dir tag leads to the checkpoint.
    metrics = evaluate.run(compose_entry("evaluate", *overrides, f"load={trained.info.run_id}"))
    assert metrics == final  # exactly, not approximately

    runs = client.search_runs([experiment.experiment_id], "tags.entry = 'evaluate'")
    (logged,) = runs
    tags = logged.data.tags
    assert tags["mlflow.parentRunId"] == trained.info.run_id == tags["source_run_id"]
    assert tags["checkpoint"] == str(tmp_path / "ck" / "step_00000030") and tags["checkpoint_step"] == "30"
    assert all(tag in tags for tag in MANIFEST_TAGS), sorted(tags)
    assert {k: logged.data.metrics[k] for k in final} == final
    assert logged.data.params["load"] == trained.info.run_id
    assert "manifest.json" in {a.path for a in client.list_artifacts(logged.info.run_id)}

    # compare shows the manifest columns of both runs.
    shown = compare_table.table(client.search_runs([experiment.experiment_id]), ["eval/auc"], manifest=True)
    header, _, *rows = shown.splitlines()
    assert all(column in header for column in compare_table.MANIFEST_COLUMNS)
    commit = tags["manifest.git_commit"][:8]
    assert len(rows) == 2 and all(commit in row for row in rows)
    assert any(" evaluate " in row for row in rows) and any(" train " in row for row in rows)


def test_evaluate_refuses_another_model_config(make_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    extra = ("train.num_steps=5", "train.eval_max_batches=1", f"checkpoint.dir={tmp_path}/ck")  # only the checkpoint matters
    overrides = _training_overrides(make_cfg, *extra)
    train(make_cfg(*extra))
    checkpoint = f"load={tmp_path}/ck"
    with pytest.raises(CheckpointError, match=r"does not match this model config: it lacks .*Fix: give the same model="):
        evaluate.run(compose_entry("evaluate", *overrides, "model=dlrm", checkpoint))
    # Same names, other shapes: tables of 2000 rows here, 1000 in the checkpoint.
    with pytest.raises(CheckpointError, match=r"of shape \[1000, (16|4)\] where this model's is \[2000, \1\]"):
        evaluate.run(compose_entry("evaluate", *overrides, "data.num_embeddings=2000", checkpoint))


def test_evaluate_config_mistakes(make_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    overrides = _training_overrides(make_cfg)
    with pytest.raises(ConfigError, match="load is required"):
        evaluate.run(compose_entry("evaluate", *overrides))
    with pytest.raises(ConfigError, match=r"unknown key lod \(did you mean load\?\)"):
        evaluate.run(compose_entry("evaluate", *overrides, "+lod=x"))
    with pytest.raises(CheckpointError, match="neither a directory nor a known MLflow run id|no such run"):
        evaluate.run(compose_entry("evaluate", *overrides, f"load={tmp_path}/nothing"))
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        evaluate.run(compose_entry("evaluate", *overrides, f"load={tmp_path}"))


CLI_TRAINED = ["data=parquet", "data.path=train.parquet", "data.batch_size=256", "model=dlrm", "model.embedding_dim=8",
               "train.num_steps=10", "train.log_every_steps=10", "train.eval_every_steps=null", "distributed.device=cpu",
               "tracking=none", "hydra.run.dir=train"]
"""One CLI training on a Parquet file, with a model option and a model key, shared by the CLI evaluate tests."""


@pytest.fixture(scope="module")
def cli_trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``python -m recsys_runner`` run once on ``train.parquet`` (``day2.parquet`` beside it) in a directory of its own:
    that directory and the final eval/auc the training printed."""
    from recsys_runner.data.generated.generate import write_criteo_parquet
    from tests.conftest import run_in_process

    root = tmp_path_factory.mktemp("cli_trained")
    write_criteo_parquet(str(root / "train.parquet"), 4096, seed=1, num_embeddings=1000, row_group_rows=1024)
    write_criteo_parquet(str(root / "day2.parquet"), 2048, seed=7, num_embeddings=1000, row_group_rows=1024)
    done = run_in_process([sys.executable, "-m", "recsys_runner", *CLI_TRAINED], root)  # as python -m runs it, imports aside
    assert done.returncode == 0, done.stderr[-3000:]
    return root, re.findall(r"step \d+/\d+ eval/auc=([0-9.]+)", done.stdout + done.stderr)[-1]


def _evaluate_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m recsys_runner.evaluate load=train/checkpoints *args`` in ``cwd``, in this process as ``python -m`` runs
    it (:func:`tests.conftest.run_in_process`: the module as ``__main__``, so the training's overrides are carried as on
    the command line), without ~10 s of imports. The entry's real launch, a process of its own, is
    :func:`test_two_ranks_evaluate_every_eval_row_once`'s torchrun, which also checks that it carries them."""
    from tests.conftest import run_in_process

    return run_in_process([sys.executable, "-m", "recsys_runner.evaluate", "load=train/checkpoints", *args], cwd)


def test_cli_evaluate_takes_the_training_overrides_from_the_checkpoint(cli_trained: tuple[Path, str]) -> None:
    """A checkpoint written by the CLI carries its launch's overrides; ``python -m recsys_runner.evaluate load=<dir>``
    rebuilds that model from them without their being repeated (exactly the training's final eval), and an override
    given to evaluate wins over the training's of the same key (here refused: another width than the checkpoint's)."""
    root, final = cli_trained
    meta = json.loads(next((root / "train" / "checkpoints").glob("step_*/meta.json")).read_text())
    assert "model=dlrm" in meta["overrides"] and "model.embedding_dim=8" in meta["overrides"]

    out = _evaluate_cli(root, "tracking=none", "hydra.run.dir=eval")  # (a real launch: the 2-rank test's torchrun)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "using the overrides of the training launch" in out.stdout + out.stderr
    auc = re.search(r"evaluate .*: eval/auc=([0-9.]+)", out.stdout + out.stderr)
    assert auc is not None and float(auc.group(1)) == pytest.approx(float(final), abs=1e-4)
    wider = _evaluate_cli(root, "tracking=none", "hydra.run.dir=eval2", "model.embedding_dim=16")
    assert wider.returncode != 0 and "does not match this model config" in wider.stderr and "Traceback" not in wider.stderr


def test_cli_evaluate_sets_keys_of_the_trainings_data_option(cli_trained: tuple[Path, str]) -> None:
    """Trained on a Parquet file, ``evaluate load=<checkpoints> data.eval_path=<another file>`` composes the training's
    ``data=parquet data.path=…`` first (from the checkpoint's saved overrides), so ``data.eval_path`` (a key only file
    data has) is set on it and that file is evaluated; ``+data.eval_path`` works as well."""
    root, _ = cli_trained
    out = _evaluate_cli(root, "data.eval_path=day2.parquet", "tracking=none", "hydra.run.dir=eval_day2")
    assert out.returncode == 0, out.stderr[-3000:]
    logged = out.stdout + out.stderr
    assert "using the overrides of the training launch" in logged and "data=parquet data.path=train.parquet" in logged
    auc = re.search(r"evaluate .*step_00000010 \(step 10\): eval/auc=([0-9.]+)", logged)
    assert auc is not None, logged[-3000:]
    # The same checkpoint on day2.parquet, all overrides spelled out: the same number, so that file was evaluated.
    ckpt = next((root / "train" / "checkpoints").glob("step_*"))
    spelled = [o.replace("=train.parquet", f"={root}/train.parquet") for o in CLI_TRAINED if not o.startswith("hydra.")]
    metrics = evaluate.run(compose_entry("evaluate", *spelled, f"data.eval_path={root}/day2.parquet", f"load={ckpt}"))
    assert metrics["eval/auc"] == pytest.approx(float(auc.group(1)), abs=1e-5)
    # +data.eval_path (what Hydra suggests when data.eval_path is not in the default data) composes the same.
    shown = _evaluate_cli(root, "+data.eval_path=day2.parquet", "--cfg", "job")
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "eval_path: day2.parquet" in shown.stdout and "path: train.parquet" in shown.stdout


def test_evaluate_skips_a_checkpoint_rotated_away_after_it_was_chosen(make_cfg: Callable[..., DictConfig], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """``load=<checkpoints root>`` while a run writes there: keep-last removes the checkpoint evaluate picked (here, made
    deterministic, right after it was picked, once a newer one exists); evaluate loads the newest complete one instead,
    with a warning naming both, and its run names the one loaded and reports that one's eval: the training's at step 20
    (not step 10's)."""
    import shutil

    from recsys_runner.tracking import lineage

    extra = ("train.num_steps=20", "train.eval_every_steps=10", "checkpoint.every_steps=10", "checkpoint.keep_last=null",
             f"checkpoint.dir={tmp_path}/ck")
    overrides = _training_overrides(make_cfg, *extra)
    train(make_cfg(*extra))
    client = MlflowClient(tracking_uri=make_cfg().tracking.uri)
    experiment = client.get_experiment_by_name(make_cfg().tracking.experiment)
    (trained,) = client.search_runs([experiment.experiment_id])
    logged_eval = {step: {k: next(m.value for m in client.get_metric_history(trained.info.run_id, k) if m.step == step)
                          for k in ("eval/auc", "eval/logloss")} for step in (10, 20)}
    root = tmp_path / "ck"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000010", "step_00000020"]
    newest = root / "step_00000020"
    shutil.move(str(newest), str(tmp_path / "later"))  # for now, the newest is step 10
    resolve = lineage.resolve_checkpoint

    def pick_then_rotate(spec: str, **kwargs: object) -> Path:
        picked = resolve(spec, **kwargs)
        assert picked == root / "step_00000010"
        shutil.move(str(tmp_path / "later"), str(newest))  # the run saves step 20 ...
        shutil.rmtree(picked)  # ... and keep_last=1 removes step 10
        return picked

    monkeypatch.setattr(lineage, "resolve_checkpoint", pick_then_rotate)
    metrics = evaluate.run(compose_entry("evaluate", *overrides, f"load={root}"))
    assert metrics == pytest.approx(logged_eval[20], abs=1e-6), logged_eval
    assert metrics["eval/logloss"] != pytest.approx(logged_eval[10]["eval/logloss"], abs=1e-4)  # the two steps differ
    assert f"checkpoint {root / 'step_00000010'} is gone" in caplog.text and f"loading {newest}" in caplog.text
    (logged,) = client.search_runs([experiment.experiment_id], "tags.entry = 'evaluate'")
    assert logged.data.tags["checkpoint"] == str(newest) and logged.data.tags["checkpoint_step"] == "20"

    # Damaged with nothing newer to take its place: refused as before.
    (newest / "rank0.pt").unlink()
    monkeypatch.setattr(lineage, "resolve_checkpoint", resolve)
    with pytest.raises(CheckpointError, match=r"step_00000020 is damaged \(rank0.pt is missing\). Fix: point load= at another checkpoint, or copy this one again whole"):
        evaluate.run(compose_entry("evaluate", *overrides, f"load={newest}"))


@pytest.mark.slow
def test_two_ranks_evaluate_every_eval_row_once(cli_trained: tuple[Path, str]) -> None:
    """``torchrun --nproc_per_node=2 -m recsys_runner.evaluate`` gives one process's metrics on the same eval file. 513
    rows over 2 ranks of batch 256 are shares of 256 and 257 rows: one batch on rank 0, two on rank 1, whose second
    holds one row. Rank 0 steps with a stand-in batch, counted nowhere, while rank 1 scores it: no row is dropped to
    keep the ranks in step (a sharded forward is a collective), none is counted twice."""
    from recsys_runner.data.generated.generate import write_criteo_parquet
    from tests.conftest import torchrun

    root, _ = cli_trained
    write_criteo_parquet(str(root / "odd.parquet"), 2 * 256 + 1, seed=11, num_embeddings=1000)
    one = _evaluate_cli(root, "data.eval_path=odd.parquet", "tracking=none", "hydra.run.dir=eval_odd1")
    assert one.returncode == 0, one.stderr[-3000:]
    # with a feature's importance too: each rank shuffles its own rows, the stand-in batch's none (one more pass)
    two = torchrun("load=train/checkpoints", "data.eval_path=odd.parquet", "tracking=none", "hydra.run.dir=eval_odd2",
                   "distributed.sharding_types=[table_wise]", "distributed.timeout_s=120", "evaluate.importance=permutation",
                   "evaluate.importance_features=[cat_3]", cwd=root, module="recsys_runner.evaluate")
    assert two.returncode == 0, two.stderr[-4000:]
    # the entry's real launch (processes of their own, not run_in_process) carries the training's overrides too
    assert "using the overrides of the training launch" in two.stdout + two.stderr
    (row,) = json.loads((root / "eval_odd2" / "importance.json").read_text())["features"]
    assert row["feature"] == "cat_3" and set(row["changes"]) == {"auc_drop", "logloss_rise"}
    assert all(math.isfinite(v) for v in row["changes"].values()), row

    def shown(logged: str) -> dict[str, float]:
        line = re.search(r"evaluate .*\(step 10\): (.*)", logged)
        assert line is not None, logged[-3000:]
        return {k: float(v) for k, v in re.findall(r"(eval/\w+)=([0-9.e+-]+)", line.group(1))}

    single, double = shown(one.stdout + one.stderr), shown(two.stdout + two.stderr)
    assert set(single) == {"eval/auc", "eval/logloss"}
    assert double == pytest.approx(single, rel=1e-5)
