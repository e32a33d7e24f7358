"""The package's import structure: each room imports only what docs/architecture.md allows (import-linter's contracts
in pyproject.toml, as `make lint` runs them) and no modules import each other in a cycle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_hold() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "broken" not in proc.stdout.lower().replace("0 broken", "")


def test_no_import_cycles() -> None:
    graph = grimp.build_graph("recsys_runner", exclude_type_checking_imports=True)
    cycles = sorted(
        (importer, imported)
        for importer in graph.modules
        for imported in graph.find_modules_directly_imported_by(importer)
        if imported != importer and graph.chain_exists(importer=imported, imported=importer)
    )
    assert not cycles, "modules importing each other in a cycle: " + "; ".join(f"{a} <-> {b}" for a, b in cycles)


def test_every_module_is_listed_in_docs_architecture() -> None:
    listed = (ROOT / "docs" / "architecture.md").read_text()
    modules = sorted(str(p.relative_to(ROOT / "recsys_runner")) for p in (ROOT / "recsys_runner").rglob("*.py")
                     if p.name != "__init__.py" or p.parent.name != "recsys_runner")
    missing = [m for m in modules if f"`{m}`" not in listed]
    assert not missing, f"docs/architecture.md does not list {missing}"
