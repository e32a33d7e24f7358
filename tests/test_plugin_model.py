"""A model from outside the package: one module (this file) and one YAML, nothing in recsys_runner edited.

``TinyModel`` and its ``TinyConfig`` are defined here; a config directory written by the test holds
``model/tiny.yaml`` naming the class in ``_target_``. The CLI composes it, types the ``model`` node by
the config class the constructor declares (so the user's keys are validated like ours), shards and
trains it, and logs it to MLflow — exactly what docs/architecture.md ("Adding a model") shows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_cli
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf, open_dict
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.config import validate
from recsys_runner.errors import ConfigError, require
from recsys_runner.features import FeatureSpec
from recsys_runner.models.common import MLP, ModelConfig, SparseArch

HERE = Path(__file__).resolve().parent


@dataclass(kw_only=True)
class TinyConfig(ModelConfig):
    """A user's model config: its own fields, defaults and validation."""

    _target_: str = f"{__name__}.TinyModel"
    embedding_dim: int = 8
    hidden: list[int] = field(default_factory=lambda: [16])

    def __post_init__(self) -> None:
        require(all(h > 0 for h in self.hidden), f"model.hidden={self.hidden} must be positive sizes")


class TinyModel(nn.Module):
    """Embeddings and dense features concatenated into an MLP: ``(dense [B, N], KJT) → logits [B]``."""

    def __init__(self, config: TinyConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.sparse_arch = SparseArch(features, config.embedding_dim, type(self))
        width = features.num_dense + self.sparse_arch.output_dim
        self.mlp = MLP(width, list(config.hidden), device=dense_device)
        self.out = nn.Linear(config.hidden[-1], 1, device=dense_device)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.out(self.mlp(torch.cat([dense, self.sparse_arch(sparse)], dim=1))).squeeze(1)


def _config_dir(tmp_path: Path) -> Path:
    conf = tmp_path / "my_conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "tiny.yaml").write_text(f"_target_: {__name__}.TinyModel\nhidden: [32, 8]\n")
    return conf


def test_a_model_class_from_outside_the_package_trains_from_yaml(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    out = run_cli("--config-dir", str(_config_dir(tmp_path)), "model=tiny", "+model.embedding_dim=4", *TINY,
                  f"tracking.uri={uri}", "tracking.experiment=plugin", cwd=tmp_path,
                  env={"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("plugin").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["model._target_"] == f"{__name__}.TinyModel"
    assert run.data.params["model.hidden"] == "[32, 8]" and run.data.params["model.embedding_dim"] == "4"
    assert run.data.metrics["eval/auc"] > 0.55  # it learned: the synthetic clicks are predictable


def _with_model(make_cfg, node: dict) -> OmegaConf:
    cfg = make_cfg(tiny=True)
    with open_dict(cfg):
        cfg.model = OmegaConf.create(node)
    return cfg


def test_the_user_config_class_types_and_validates_the_node(make_cfg) -> None:
    run = validate(_with_model(make_cfg, {"_target_": f"{__name__}.TinyModel", "hidden": [4]}))
    assert isinstance(run.model, TinyConfig) and run.model.hidden == [4] and run.model.embedding_dim == 8
    with pytest.raises(ConfigError, match=r"unknown key model\.hiden \(did you mean model\.hidden\?\)"):
        validate(_with_model(make_cfg, {"_target_": f"{__name__}.TinyModel", "hiden": [4]}))
    with pytest.raises(ConfigError, match=r"model\.hidden=\[-1\] must be positive"):
        validate(_with_model(make_cfg, {"_target_": f"{__name__}.TinyModel", "hidden": [-1]}))


def test_a_target_without_a_config_class_is_refused_with_the_fix(make_cfg) -> None:
    with pytest.raises(ConfigError, match=r"model\._target_=torch\.nn\.Linear does not declare its config"):
        validate(_with_model(make_cfg, {"_target_": "torch.nn.Linear", "in_features": 3}))
    with pytest.raises(ConfigError, match=r"_target_: 'no_such_module\.Model' cannot be imported"):
        validate(_with_model(make_cfg, {"_target_": "no_such_module.Model"}))
