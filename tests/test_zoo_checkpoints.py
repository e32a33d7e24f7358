"""The checkpoints of issue 32's models (xdeepfm, autoint, masknet, dcn, wukong, hstu_rank): a run stopped and resumed
ends where the uninterrupted one does, and each checkpoint evaluated on 2 gloo ranks gives the 1-process evaluate's
metrics. ESMM and MIND have these tests in their own files.

Each model runs at tiny sizes (a few seconds a run); the uninterrupted runs are trained once for the module
(:func:`zoo`) and their final checkpoints are what both ranks evaluate.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import DictConfig

from recsys_runner import evaluate
from recsys_runner.build import build
from recsys_runner.checkpoint.storage import list_checkpoints
from recsys_runner.config import validate
from recsys_runner.train.loop import train
from recsys_runner.train.signals import Interrupted
from tests.conftest import TINY, torchrun
from tests.test_evaluate import compose_entry
from tests.test_interaction_models import TINY_SIZES, one_thread

ZOO = {**{name: [f"model={name}", *sizes, "data.num_embeddings=1000", "data.num_dense=3", "data.num_sparse=4"]
          for name, sizes in TINY_SIZES.items()},
       "hstu_rank": ["model=hstu_rank", "model.embedding_dim=8", "model.num_layers=1", "model.deep_layer_sizes=[16]",
                     "data=synthetic_sequences", "data.num_items=500", "data.num_users=1000", "data.max_len=16"]}
"""Each model at the sizes of its export test, on 7 columns (the planner's and the checkpoint's work grows with the
tables: on Criteo's 39 a build took 3x longer); hstu_rank on generated histories of up to 16 events."""
RUN = [*(a for a in TINY if not a.startswith("data.num_embeddings=")), "data.num_train_rows=2048", "data.num_eval_rows=1024",
       "train.num_steps=6", "train.log_every_steps=3", "optim/dense=adam", "tracking=none"]
"""Six steps of 256 rows, Adam on the dense parts (state a resume must restore), eval on 1,024 rows: 4 batches on one
rank, 2 on each of two."""
STOP_AT = 3


def trained(cfg: DictConfig) -> dict[str, float]:
    """The run's final metrics (``train``'s return: the last eval's and the last log window's), built and trained here."""
    c = build(validate(cfg))
    try:
        with one_thread():
            return train(c.loop)
    finally:
        c.close()


def evals(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("eval/")}


@dataclass
class Trained:
    """A model's uninterrupted run: its composed config (``checkpoint.dir`` its own), final metrics, last checkpoint."""

    cfg: DictConfig
    final: dict[str, float]
    checkpoint: Path


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Trained]:
    """``zoo(name)`` → the model's uninterrupted run, trained on first use (composed once: Hydra's compose costs more
    than these runs' steps)."""
    root = tmp_path_factory.mktemp("zoo")
    done: dict[str, Trained] = {}

    def get(name: str) -> Trained:
        if name not in done:
            cfg = compose_entry("config", *RUN, *ZOO[name], f"checkpoint.dir={root / name}")
            final = trained(cfg)
            (*_, last) = list_checkpoints(root / name)
            done[name] = Trained(cfg, final, last)
        return done[name]

    return get


def sliced(cfg: DictConfig, checkpoint_dir: Path) -> DictConfig:
    """``cfg`` with its own ``checkpoint.dir`` and ``train.stop_after_steps=3``: the command a time-sliced job repeats."""
    cfg = copy.deepcopy(cfg)
    cfg.checkpoint.dir, cfg.train.stop_after_steps = str(checkpoint_dir), STOP_AT
    return cfg


@pytest.mark.parametrize("name", sorted(ZOO))
def test_resumed_training_matches_uninterrupted(zoo: Callable[[str], Trained], tmp_path: Path, name: str) -> None:
    """Stopped after step 3 (``train.stop_after_steps``) and relaunched, the run ends where the uninterrupted one does:
    every final eval metric to 1e-6 (weights, both optimizers' state and the data's position restored)."""
    straight = zoo(name)
    command = sliced(straight.cfg, tmp_path)
    with pytest.raises(Interrupted, match=f"after step {STOP_AT}"):
        trained(command)
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step_{STOP_AT:08d}"]
    resumed = trained(command)  # the same command again: resumes from step 3
    assert {"eval/auc", "eval/logloss"} <= set(evals(straight.final))
    assert evals(resumed) == pytest.approx(evals(straight.final), abs=1e-6)


@pytest.mark.slow
def test_two_ranks_evaluate_every_model_like_one_process(zoo: Callable[[str], Trained], tmp_path: Path) -> None:
    """One torchrun launch, 2 gloo ranks, every table split column-wise between them: each model's checkpoint (written by
    one process) resharded on load, each rank scoring half the eval rows; the metrics over both ranks equal the
    1-process evaluate's to 1e-5 (tests/zoo_evaluate.py evaluates the six in one process group)."""
    jobs = {name: [*RUN, *ZOO[name], f"load={zoo(name).checkpoint}"] for name in sorted(ZOO)}
    one = {name: evaluate.run(compose_entry("evaluate", *overrides)) for name, overrides in jobs.items()}
    for name, metrics in one.items():
        assert {"eval/auc", "eval/logloss"} <= set(metrics), name
        assert evals(metrics) == pytest.approx(evals(zoo(name).final), abs=1e-6), name  # 1 process: the training's own eval
    (tmp_path / "jobs.json").write_text(json.dumps({name: [*o, "distributed.sharding_types=[column_wise]"] for name, o in jobs.items()}))
    out = torchrun(str(tmp_path / "jobs.json"), str(tmp_path / "two.json"), cwd=tmp_path, module="tests.zoo_evaluate")
    assert out.returncode == 0, out.stderr[-4000:]
    plans = [line for line in out.stderr.splitlines() if line.startswith("sharding plan:")]
    assert len(plans) == len(ZOO) and all(" on 2 ranks: " in p and "column_wise" in p for p in plans), plans
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world_size"] == 2 and sorted(two["metrics"]) == sorted(ZOO)
    for name, metrics in one.items():
        assert two["metrics"][name] == pytest.approx(metrics, abs=1e-5), name
