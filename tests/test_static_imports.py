"""Static tools resolve every `ringtrain` import from a clone installed as the README says: an
editor's go-to-definition and a type checker find ringtrain's modules, not only Python's
import system. mypy resolves, module by module, every ringtrain module the package imports
(resolving, not type-checking: `--follow-imports=skip` finds each module's file without
analysing it, in seconds)."""
from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("mypy", reason="mypy comes with the test extra")


def _imported_ringtrain_modules() -> set[str]:
    """Every ringtrain module any file of the package imports (the module, not the names)."""
    found = set()
    for folder in ("trainer", "data", "models", "conf"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ringtrain"):
                    found.add(node.module)
                elif isinstance(node, ast.Import):
                    found.update(alias.name for alias in node.names if alias.name.startswith("ringtrain"))
    return found


def test_mypy_resolves_every_ringtrain_import(tmp_path):
    modules = sorted(_imported_ringtrain_modules())
    assert len(modules) > 50  # the scan sees the package's imports
    probe = tmp_path / "imports.py"
    probe.write_text("".join(f"import {module}\n" for module in modules))
    done = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=skip", "--no-incremental",
                           "--cache-dir", str(tmp_path / "cache"), str(probe)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    unresolved = [line for line in done.stdout.splitlines() if "ringtrain" in line and "import" in line]
    assert unresolved == [], (
        "mypy cannot resolve these (install the clone with `pip install -e . --config-settings "
        "editable_mode=strict`, as the README says):\n" + "\n".join(unresolved))
