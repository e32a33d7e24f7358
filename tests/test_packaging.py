"""conf/ is found both from the checkout and from an installed wheel (pkg://recsys_runner.conf)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from recsys_runner.paths import CONFIG_PATH
from tests.conftest import REPO


def test_checkout_uses_top_level_conf() -> None:
    assert Path(CONFIG_PATH) == REPO / "conf"


def test_installed_wheel_finds_packaged_conf(tmp_path: Path) -> None:
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheel_dir), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = wheel_dir.glob("recsys_runner-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = subprocess.run([sys.executable, "-c", "import recsys_runner.paths as p; print(p.CONFIG_PATH, p.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.startswith("pkg://recsys_runner.conf ") and str(target) in probe.stdout
    out = subprocess.run([sys.executable, "-m", "recsys_runner", "model=dlrm", "optim=sgd", "--cfg", "job"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "recsys_runner.models.dlrm.DLRM" in out.stdout and "torchrec.optim.SGD" in out.stdout


def test_make_install_is_quiet_and_prints_its_log_only_on_failure(tmp_path: Path) -> None:
    """The install step of ``make run``/``make test`` prints one line; pip's output goes to a log file, shown when a step
    fails (a pin no index has: it fails while resolving, before downloading anything)."""
    venv = tmp_path / "venv"
    # Under `make test` (CI) this make is nested: --no-print-directory keeps make's "Entering directory" lines out.
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "MAKELEVEL": "1"}
    out = subprocess.run(["make", "--no-print-directory", "install", f"VENV={venv}", f"PYTHON={sys.executable}", "TORCH=torch==0.0.0"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    # What the Makefile controls, never pip's wording (which differs between pip versions): the status, its lines,
    # and the whole log (its commands traced by set -x, then pip's output) on stderr.
    assert out.returncode != 0
    assert out.stdout.splitlines() == [f"Installing the pinned stack into {venv} (a few minutes the first time; log: {venv}/install.log)"]
    log = (venv / "install.log").read_text()
    assert "torch==0.0.0" in log, log  # the failing pip command, as set -x traced it
    assert log in out.stderr, out.stderr
    assert f"Installing into {venv} failed (output above, also in {venv}/install.log)" in out.stderr.splitlines(), out.stderr
    assert not (venv / ".installed").exists()


def test_make_help_lists_every_target_the_docs_name_in_plain_words() -> None:
    """``make help`` prints each target's ``##`` text as written in the Makefile, so a make variable in it is shown
    unexpanded (``http://127.0.0.1:$(PORT)`` it was); and every ``make <target>`` README.md and docs/ tell a user to
    run is one of the listed targets."""
    out = subprocess.run(["make", "--no-print-directory", "help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "$(" not in out.stdout, out.stdout
    targets = {m.group(1) for m in re.finditer(r"^  make (\S+)", out.stdout, re.MULTILINE)}
    assert {"help", "install", "run", "test", "test-fast", "bench", "lint", "ui", "clean"} <= targets, targets
    documented = {m.group(1) for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]
                  for m in re.finditer(r"`make ([a-z][a-z-]*)\b", doc.read_text())}
    assert documented and documented <= targets, documented - targets
