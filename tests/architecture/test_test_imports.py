"""Every name a test imports from the suite's own modules exists there, also where the import sits
inside a test function (run only when that test runs: a helper moved or renamed would otherwise
show up as one failing test in a 40-minute run, as `steps` did after the move to
tests/support/)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from tests.support.paths import TESTS


def unresolved(root: Path) -> list[str]:
    """`file:line: module.name` for each `from tests... import name` that does not resolve."""
    missing: list[str] = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests")):
                continue
            module = importlib.import_module(str(node.module))
            for alias in node.names:
                if hasattr(module, alias.name):
                    continue
                try:  # a submodule of a package
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    where = path.relative_to(root.parent)
                    missing.append(f"{where}:{node.lineno}: {node.module}.{alias.name}")
    return missing


def test_every_name_imported_from_the_suite_exists() -> None:
    assert unresolved(TESTS) == []


def test_the_check_finds_a_name_that_is_gone(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text(
        "def test_x():\n    from tests.support.world import Env, no_such_helper\n"
    )
    assert unresolved(tests) == ["tests/test_x.py:2: tests.support.world.no_such_helper"]
