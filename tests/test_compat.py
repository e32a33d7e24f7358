"""recsys_runner.optim.compat: version-specific imports of fbgemm_gpu/TorchRec, with a fallback and a clear error."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator

import pytest

import recsys_runner.optim.compat as compat

NEW, OLD = compat.WEIGHT_DECAY_MODE_MODULES  # fbgemm_gpu 1.8's location, then 1.6's


@pytest.fixture
def reload_compat(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """``monkeypatch``; afterwards the patches are undone and compat is reloaded from the real modules."""
    yield monkeypatch
    monkeypatch.undo()
    importlib.reload(compat)


def test_compat_exposes_weight_decay_mode() -> None:
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

    assert compat.WeightDecayMode is WeightDecayMode and compat.WEIGHT_DECAY_MODE_FROM == NEW
    assert {"NONE", "L2", "DECOUPLE"} <= set(compat.WeightDecayMode.__members__)


def test_falls_back_to_the_fbgemm_1_6_location(reload_compat: pytest.MonkeyPatch) -> None:
    importlib.import_module(OLD)
    reload_compat.setitem(sys.modules, NEW, None)  # `import NEW` now raises ImportError, as on fbgemm_gpu 1.6
    importlib.reload(compat)
    assert compat.WEIGHT_DECAY_MODE_FROM == OLD
    assert compat.WeightDecayMode is sys.modules[OLD].WeightDecayMode
    assert compat.WeightDecayMode["DECOUPLE"].name == "DECOUPLE"


def test_neither_location_names_the_supported_versions(reload_compat: pytest.MonkeyPatch) -> None:
    reload_compat.setitem(sys.modules, NEW, None)
    reload_compat.setitem(sys.modules, OLD, None)
    with pytest.raises(ImportError, match=r"cannot import WeightDecayMode .*supports torchrec 1\.6-1\.8 with fbgemm_gpu 1\.6-1\.8"):
        importlib.reload(compat)


def test_the_package_imports_weight_decay_mode_only_through_compat() -> None:
    from pathlib import Path

    package = Path(compat.__file__).parent
    offenders = [str(p.relative_to(package)) for p in package.rglob("*.py")
                 if p.name != "compat.py" and ("from fbgemm_gpu" in p.read_text() or "import fbgemm_gpu" in p.read_text())]
    assert offenders == [], f"import fbgemm_gpu names through recsys_runner.optim.compat: {offenders}"
