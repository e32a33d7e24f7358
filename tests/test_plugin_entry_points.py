"""A model and a data option from another installed package, found by its entry points (recsys_runner/plugins.py).

The package is written into ``tmp_path`` with a ``theirpkg-0.1.dist-info/`` beside it (METADATA and entry_points.txt),
which is all ``importlib.metadata`` needs to find an installed distribution on the path: nothing is pip-installed. Its
model is a small real one built from recsys_runner's public parts (``models.common``' ``SparseArch`` and ``MLP``); its
entry points also hold the three broken kinds (an import that fails, a built-in's name, a class that is no config).
Its broken module leaves a file beside itself when imported (``broken.imported``): a run that does not choose it must
not import it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, run_cli, run_in_process
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from recsys_runner import config, overrides, plugins
from recsys_runner.errors import ConfigError

MODEL = '''
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import require
from recsys_runner.features import FeatureSpec
from recsys_runner.models.common import MLP, ModelConfig, SparseArch


@dataclass(kw_only=True)
class TinyConfig(ModelConfig):
    _target_: str = "theirpkg.tiny.Tiny"
    embedding_dim: int = 4
    hidden: list[int] = field(default_factory=lambda: [8])

    def __post_init__(self) -> None:
        require(all(h > 0 for h in self.hidden), f"model.hidden={self.hidden} must be positive sizes")


class Tiny(nn.Module):
    same_embedding_width = None

    def __init__(self, config: TinyConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.sparse_arch = SparseArch(features, config.embedding_dim, type(self))
        self.mlp = MLP(features.num_dense + self.sparse_arch.output_dim, list(config.hidden), device=dense_device)
        self.out = nn.Linear(config.hidden[-1], 1, device=dense_device)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.out(self.mlp(torch.cat([dense, self.sparse_arch(sparse)], dim=1))).squeeze(1)
'''
DATA = '''
from dataclasses import dataclass

from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig


@dataclass(kw_only=True)
class SmallDataConfig(SyntheticDataConfig):
    batch_size: int = 64
    num_sparse: int = 4
    num_train_rows: int = 1024
    num_eval_rows: int = 256
'''
ENTRY_POINTS = """[recsys_runner.models]
tiny = theirpkg.tiny:TinyConfig
deepfm = theirpkg.tiny:TinyConfig
broken = theirpkg.broken:Config
notaconfig = theirpkg.tiny:Tiny

[recsys_runner.data]
small = theirpkg.small:SmallDataConfig
"""
PRESET = "defaults:\n  - /schema/model/tiny@_here_\n  - _self_\nhidden: [16, 8]\n"
"""Their own YAML option ``model=tiny_wide``, in ``theirpkg/conf/model/``, extending their schema as ours do."""
RUN = ["train.num_steps=3", "tracking=none", "distributed.device=cpu", "train.sanity_eval_batches=0"]


def write_package(root: Path) -> None:
    """``theirpkg`` and its dist-info under ``root``, as ``pip install`` would leave them in site-packages."""
    pkg = root / "theirpkg"
    (pkg / "conf" / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tiny.py").write_text(MODEL)
    (pkg / "small.py").write_text(DATA)
    (pkg / "broken.py").write_text("from pathlib import Path\nPath(__file__).with_suffix('.imported').touch()\n"
                                   "import no_such_dependency_xyz\n")
    (pkg / "conf" / "__init__.py").write_text("")
    (pkg / "conf" / "model" / "tiny_wide.yaml").write_text(PRESET)
    dist = root / "theirpkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: theirpkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``theirpkg`` on this process's path, its entry points read afresh; afterwards gone again (path, modules, cache)."""
    root = tmp_path / "site"
    write_package(root)
    monkeypatch.syspath_prepend(str(root))
    config.plugins.cache_clear()
    config._plugin_schema.cache_clear()
    yield root
    config.plugins.cache_clear()
    config._plugin_schema.cache_clear()
    for name in [m for m in sys.modules if m == "theirpkg" or m.startswith("theirpkg.")]:
        del sys.modules[name]
    repo = ConfigStore.instance().repo
    for folder in [repo.get("model", {}), repo.get("data", {}), *repo.get("schema", {}).values()]:
        for name in [n for n, node in folder.items() if isinstance(node, plugins._LazyNode)]:
            del folder[name]


def composed(run_dir: Path) -> dict:
    """The config a run composed (Hydra's ``.hydra/config.yaml`` in its run folder)."""
    loaded = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"))
    assert isinstance(loaded, dict)
    return loaded


def test_an_installed_package_model_and_data_train_by_name(tmp_path: Path) -> None:
    """A fresh process, as a user runs it: discovery from PYTHONPATH, training works, and the broken entries it does not
    choose are neither imported nor said."""
    site = tmp_path / "site"
    write_package(site)
    out = run_cli("model=tiny", "model.hidden=[8,4]", "data=small", *RUN, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                  env={"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 3/3" in out.stdout + out.stderr
    cfg = composed(tmp_path / "run")
    assert cfg["model"] == {"_target_": "theirpkg.tiny.Tiny", "embedding_dim": 4, "hidden": [8, 4]}
    assert cfg["data"]["num_train_rows"] == 1024 and cfg["data"]["num_sparse"] == 4
    assert "entry point" not in out.stderr, out.stderr[-3000:]
    assert not (site / "theirpkg" / "broken.imported").exists()


def test_listing_imports_nothing_and_only_a_name_clash_is_refused(installed: Path) -> None:
    config.register_configs()
    assert "theirpkg.tiny" not in sys.modules and not (installed / "theirpkg" / "broken.imported").exists()
    assert set(config.plugins().entries["model"]) == {"tiny", "broken", "notaconfig"}
    assert set(config.plugins().entries["data"]) == {"small"}
    assert set(config.plugins().refused) == {("model", "deepfm")}
    assert ("'deepfm = theirpkg.tiny:TinyConfig' (group recsys_runner.models) of distribution theirpkg is refused: model=deepfm "
            "is already the built-in recsys_runner.models.deepfm.DeepFMConfig") in config.plugins().refused["model", "deepfm"]
    assert config.plugin_schema("model", "tiny").__name__ == "TinyConfig"  # imported when asked for, not before
    assert not (installed / "theirpkg" / "broken.imported").exists()


def test_a_broken_entry_is_one_line_naming_its_entry_point_distribution_and_cause(installed: Path) -> None:
    with pytest.raises(ConfigError) as broken:
        config.plugin_schema("model", "broken")
    assert str(broken.value).startswith("model=broken: entry point 'broken = theirpkg.broken:Config' (group "
                                        "recsys_runner.models) of distribution theirpkg failed to import: ModuleNotFoundError: "
                                        "No module named 'no_such_dependency_xyz'")
    with pytest.raises(ConfigError, match="not a subclass of recsys_runner.models.common.ModelConfig") as other:
        config.plugin_schema("model", "notaconfig")
    assert "\n" not in str(broken.value) + str(other.value)
    assert config.group_options("model")["deepfm"] is config.GROUPS["model"]["deepfm"]  # the built-in keeps its name
    assert {"tiny"} <= set(config.group_options("model")) and "broken" not in config.group_options("model")


def test_choosing_a_refused_entry_says_why_in_one_line(installed: Path, tmp_path: Path) -> None:
    out = run_in_process([sys.executable, "-m", "recsys_runner", "model=broken", *RUN], tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "model=broken: entry point 'broken = theirpkg.broken:Config' (group recsys_runner.models) of distribution theirpkg " \
           "failed to import" in out.stderr


def test_choosing_a_name_an_entry_point_lost_warns_once(installed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``model=deepfm`` trains the built-in; the entry point of that name is said once, and only to a run choosing it."""
    out = run_in_process([sys.executable, "-m", "recsys_runner", "model=deepfm", "data=small", *RUN], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    said = [r.getMessage() for r in caplog.records if "entry point" in r.getMessage()]
    assert len(said) == 1 and "'deepfm = theirpkg.tiny:TinyConfig'" in said[0] and "is refused" in said[0], said


@pytest.mark.parametrize(("rank", "lines"), [("0", 1), ("1", 0)])
def test_the_warning_is_said_by_rank_0_only(installed: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
                                            rank: str, lines: int) -> None:
    """Under torchrun every rank checks the same command line: one line for the job, not one per rank."""
    monkeypatch.setenv("RANK", rank)
    overrides.explain("config", ["model=deepfm", "data=small"])
    assert len([r for r in caplog.records if "'deepfm = theirpkg.tiny:TinyConfig'" in r.getMessage()]) == lines


def test_help_lists_the_installed_options(installed: Path, tmp_path: Path) -> None:
    out = run_in_process([sys.executable, "-m", "recsys_runner", "--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    models = next(line for line in out.stdout.splitlines() if line.startswith("model: "))
    assert {"tiny", "broken"} <= set(models.removeprefix("model: ").split(", "))  # by name: nothing imported to list them
    assert "entry point" not in out.stderr and not (installed / "theirpkg" / "broken.imported").exists()
    assert "small" in next(line for line in out.stdout.splitlines() if line.startswith("data: ")).split(", ")


@pytest.mark.parametrize("scheme", ["pkg", "file"])
def test_their_own_yaml_option_on_the_search_path(installed: Path, tmp_path: Path, scheme: str) -> None:
    """``hydra.searchpath`` adds their ``conf/`` folder: its ``model/tiny_wide.yaml`` extends ``schema/model/tiny``."""
    where = "pkg://theirpkg.conf" if scheme == "pkg" else f"file://{installed / 'theirpkg' / 'conf'}"
    out = run_in_process([sys.executable, "-m", "recsys_runner", "model=tiny_wide", "data=small", f"hydra.searchpath=[{where}]",
                          *RUN, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert composed(tmp_path / "run")["model"]["hidden"] == [16, 8]
