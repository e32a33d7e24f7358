"""The one-line summary a test session ends with when the SLURM tests skipped (tests/conftest.py's hook)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, SLURM_SKIP_MARK, slurm_skip_summary
from tests.slurm_cluster import unavailable_reason

SESSION_CONFTEST = "from tests.conftest import pytest_terminal_summary  # noqa: F401 - the hook under test\n"


def _session(tmp_path: Path, test_body: str) -> subprocess.CompletedProcess[str]:
    """A real pytest session in ``tmp_path`` with this repo's summary hook and one test file."""
    (tmp_path / "conftest.py").write_text(SESSION_CONFTEST)
    (tmp_path / "test_one.py").write_text(test_body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


def test_skipped_slurm_tests_are_summarized_in_one_line_with_how_to_run_them(tmp_path: Path) -> None:
    out = _session(tmp_path, f"""
import pytest

@pytest.fixture(scope="module")
def cluster():
    pytest.skip("{SLURM_SKIP_MARK} — this machine cannot run the test cluster: not root here")

def test_a(cluster): pass
def test_b(cluster): pass
def test_other(): pytest.skip("unrelated")
""")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("SLURM tests skipped")]
    assert lines == [f"SLURM tests skipped (2): not root here; to run them: {lines[0].split('to run them: ')[1]}"], out.stdout
    assert "make test" in lines[0] and "slurmctld slurmd slurm-client munge" in lines[0]


def test_no_summary_line_when_no_slurm_test_skipped(tmp_path: Path) -> None:
    out = _session(tmp_path, "import pytest\ndef test_a(): pass\ndef test_b(): pytest.skip('unrelated')\n")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SLURM tests skipped" not in out.stdout


def test_summary_carries_the_fixtures_own_reason() -> None:
    """The reason comes from tests/slurm_cluster.py as the fixture words it (here: whatever this machine lacks)."""
    reason = unavailable_reason() or "SLURM/munge binaries missing: ['slurmd']; install with `apt-get install -y slurmd`"
    report = type("Report", (), {"longrepr": ("tests/test_slurm.py", 33, f"Skipped: {SLURM_SKIP_MARK} — this machine cannot "
                                                                      f"run the test cluster: {reason}")})()
    line = slurm_skip_summary([report])
    assert line is not None and line.startswith(f"SLURM tests skipped (1): {reason}; to run them: ")
