"""Every option of every group composes, validates and instantiates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchrec.datasets.criteo import BinaryCriteoUtils

from recsys_runner.config import GROUPS, RunConfig, validate
from recsys_runner.data.base import DataConfig
from recsys_runner.data.generated.generate import write_criteo_csv, write_criteo_parquet, write_criteo_tsv
from recsys_runner.data.generated.synthetic import SyntheticData
from recsys_runner.data.generated.synthetic_sequences import SyntheticSequences
from recsys_runner.distributed.sharding import Distributed
from recsys_runner.errors import ConfigError
from recsys_runner.models.common import ModelConfig
from recsys_runner.optim.config import OptimConfig
from recsys_runner.optim.optimizers import DenseOptimizerConfig
from recsys_runner.optim.schedulers import Schedule, SchedulerConfig
from recsys_runner.optim.sparse import SparseOptimizerConfig
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.tracking.tracker import MlflowTracker, NullTracker

CONF = Path(CONFIG_PATH)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


OPTION_MATRIX = [(g, o) for g in ["model", "data", "optim", "optim/sparse", "optim/dense", "scheduler", "distributed", "precision", "tracking", "checkpoint"] for o in options(g)]


def test_every_group_has_options() -> None:
    for group in ["model", "optim", "scheduler", "data", "distributed", "precision", "tracking"]:
        assert options(group), f"conf/{group}/ has no options"
    assert {"deepfm", "dlrm"} <= set(options("model"))
    assert {"adagrad", "rowwise_adagrad", "sgd", "adam"} <= set(options("optim"))
    assert {"fp32", "bf16"} <= set(options("precision"))


def test_every_yaml_option_has_a_registered_schema() -> None:
    for group, option in OPTION_MATRIX:
        text = (CONF / group / f"{option}.yaml").read_text()
        assert f"/schema/{group}/" in text, f"conf/{group}/{option}.yaml does not extend a schema"
        schema_name = text.split(f"/schema/{group}/")[1].split("@")[0]
        assert schema_name in GROUPS[group], f"{group}/{option} extends unregistered schema {schema_name}"


def file_backed_data(option: str, tmp_path: Path) -> list[str]:
    """Overrides giving a file-backed data option (parquet, csv, criteo, criteo_npy) a small generated file."""
    if option == "parquet":
        write_criteo_parquet(str(tmp_path / "d.parquet"), 300)
        return [f"data.path={tmp_path}/d.parquet"]
    if option == "criteo_npy":  # TorchRec's layout, written by TorchRec's own converter
        write_criteo_tsv(str(tmp_path / "d.tsv"), 300)
        (tmp_path / "npy").mkdir()
        BinaryCriteoUtils.tsv_to_npys(str(tmp_path / "d.tsv"), *(str(tmp_path / "npy" / f"day_0_{k}.npy") for k in ("dense", "sparse", "labels")))
        return [f"data.path={tmp_path}/npy", "data.num_embeddings=100"]
    if option == "csv":
        write_criteo_csv(str(tmp_path / "d.csv"), 300)
        return [f"data.path={tmp_path}/d.csv", "data.sparse=[{name: cat_0, num_embeddings: 100, encoding: hash}]", "data.dense=[{name: int_0}]"]
    write_criteo_tsv(str(tmp_path / "d.tsv"), 300)
    return [f"data.path={tmp_path}/d.tsv", "data.num_embeddings=100"]


MODEL_DATA = {"mmoe": ["data=synthetic_multitask"], "dssm": ["data=synthetic_retrieval"]}
"""Models that need data of another shape than the default's single click label."""


@pytest.mark.parametrize(("group", "option"), OPTION_MATRIX, ids=[f"{g}={o}" for g, o in OPTION_MATRIX])
def test_option_composes_validates_and_instantiates(make_cfg, tmp_path: Path, group: str, option: str) -> None:
    if group == "data" and not option.startswith("synthetic"):
        cfg = make_cfg(f"data={option}", *file_backed_data(option, tmp_path), "data.batch_size=64", "distributed.device=cpu", tiny=False)
    elif option == "synthetic_sequences":  # TINY's data keys are data=synthetic's
        cfg = make_cfg(f"data={option}", "data.batch_size=64", "data.num_train_rows=4096", "data.num_eval_rows=1024",
                       "distributed.device=cpu", tiny=False)
    else:
        cfg = make_cfg(f"{group}={option}", *(MODEL_DATA.get(option, []) if group == "model" else []))
    run: RunConfig | None = None
    try:
        run = validate(cfg)
        assert isinstance(run, RunConfig)
    except ConfigError as e:
        # fbgemm's CPU build has no kernel for some fused optimizers: that, and only that, may
        # fail validation here, and it must say so (the option still builds below).
        assert "fbgemm implements only on GPU" in str(e), e
        run = None  # the device check refused it; each group below is checked on the composed node
    data_config = run.data if run is not None else OmegaConf.to_object(cfg.data)
    assert isinstance(data_config, DataConfig)
    needs = run.model.data_needs() if run is not None else None
    data = (data_config if needs is None else data_config.for_model(needs)).build()  # as build() does: sequence models get histories
    assert isinstance(data, SyntheticData | SyntheticSequences) or group == "data"
    assert next(iter(data.train_batches(0, 0, 1))).labels.shape[0] == data.batch_size

    if group == "data":
        return  # built above from its validated config, as the runner builds it
    if group in SERVICES:  # config-first components: the validated config builds them
        assert run is not None
        check_service(group, run)
        return
    if group in ("optim", "optim/sparse", "optim/dense"):
        optim = run.optim if run is not None else OmegaConf.to_object(cfg.optim)
        assert isinstance(optim, OptimConfig)
        assert isinstance(optim.sparse, SparseOptimizerConfig) and isinstance(optim.dense, DenseOptimizerConfig)
        assert issubclass(optim.sparse.optimizer_class(), torch.optim.Optimizer)
        assert optim.sparse.kwargs()["lr"] == cfg.optim.sparse.lr
        opt = optim.dense.build({"w": torch.nn.Parameter(torch.zeros(3))})
        assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups[0]["lr"] == cfg.optim.dense.lr
        return
    if group == "scheduler":
        assert run is not None and isinstance(run.scheduler, SchedulerConfig)
        schedule = run.scheduler.build(total_steps=1000)
        assert isinstance(schedule, Schedule) and 0.0 <= schedule(0) <= 1.0 and schedule(999) > 0.0
        return

    assert group == "model", group
    assert run is not None and isinstance(run.model, ModelConfig)  # a model is built by its validated config
    model = run.model.build(features=data.features, dense_device=torch.device("cpu"))
    assert sum(p.numel() for p in model.parameters()) > 0

SERVICES = ("distributed", "precision", "tracking", "checkpoint")
"""Groups whose component takes its config object (``run.<group>.build(...)``), not Hydra's keyword arguments."""


def check_service(group: str, run: RunConfig) -> None:
    if group == "checkpoint":
        checkpointer = run.checkpoint.build(rank=0, world_size=1, device=torch.device("cpu"), nan_guard=True)
        assert checkpointer.config is run.checkpoint
        assert checkpointer.dir is None and not checkpointer.due(10)  # compose mode: no Hydra run dir, nothing saved
    elif group == "precision":
        built = run.precision.build()
        assert built.autocast(torch.device("cpu")) is None or built.config.dtype in ("bf16", "fp16")
        assert (built.grad_scaler(torch.device("cpu")) is not None) == (built.config.dtype == "fp16")
    elif group == "distributed":
        assert isinstance(run.distributed.build(), Distributed)
    elif group == "tracking":
        assert isinstance(run.tracking.build(), MlflowTracker | NullTracker)


def test_shared_lr_flows_to_both_optimizers_and_each_can_be_set(make_cfg) -> None:
    cfg = make_cfg("optim.lr=0.2")
    assert cfg.optim.sparse.lr == 0.2 and cfg.optim.dense.lr == 0.2
    cfg = make_cfg("optim.lr=0.2", "optim.dense.lr=0.003")
    assert cfg.optim.sparse.lr == 0.2 and cfg.optim.dense.lr == 0.003


def test_optimizer_halves_can_be_mixed(make_cfg) -> None:
    cfg = make_cfg("optim=rowwise_adagrad", "optim/dense=adam")
    assert cfg.optim.sparse._target_ == "torchrec.optim.RowWiseAdagrad"
    assert cfg.optim.dense._target_ == "torch.optim.Adam"
    validate(cfg)
