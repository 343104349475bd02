"""The suite keeps its layout (issue 26, item 4; README.md, "How tests are laid out"): test files
live in a folder named after what they test, not at tests/'s top; every folder of tests is a
package of at most MAX_MODULES test modules; helpers are imported from tests/support/, never from
a conftest.py (pytest loads those itself), and no test module imports another test module (what
two test modules share lives in tests/support/)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.paths import TESTS

MAX_MODULES = 20
DATA = {"fixtures", "golden", "artifacts", "__pycache__"}  # data, not code


def layout_breaches(root: Path) -> list[str]:
    """One line per breach of the layout under `root` (a tests/ folder)."""
    out = [
        f"{p.relative_to(root.parent)}: a test at the top of tests/; move it into the folder of "
        "what it tests (README.md, How tests are laid out)"
        for p in sorted(root.glob("test_*.py"))
    ]
    folders = [p for p in sorted(root.rglob("*")) if p.is_dir() and not DATA & set(p.parts)]
    for folder in folders:
        name = folder.relative_to(root.parent)
        if not (folder / "__init__.py").exists():
            out.append(f"{name}/: no __init__.py (every folder of tests is a package)")
        count = len(list(folder.glob("test_*.py")))
        if count > MAX_MODULES:
            out.append(f"{name}/: {count} test modules, over {MAX_MODULES}: split it by concern")
    for p in sorted(root.rglob("*.py")):
        if DATA & set(p.relative_to(root).parts):
            continue
        if re.search(r"^\s*(from conftest import|import conftest\b)", p.read_text(), re.M):
            out.append(f"{p.relative_to(root.parent)}: imports conftest; import tests.support.*")
        out += [
            f"{p.relative_to(root.parent)}:{line}: imports the test module {name}; move what is "
            "shared into tests/support/ and import it from there"
            for line, name in imports_of_test_modules(p)
        ]
    return out


def imports_of_test_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for each import of a test module (test_*.py) in the file at `path`,
    wherever it stands (top level or inside a function)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            join = "" if base.endswith(".") else "."
            names = [base] + [f"{base}{join}{alias.name}" for alias in node.names]
        else:
            continue
        hits = [n for n in names if any(part.startswith("test_") for part in n.split("."))]
        if hits:
            found.append((node.lineno, hits[0]))
    return found


def test_the_suite_keeps_its_layout() -> None:
    assert layout_breaches(TESTS) == []


def test_the_checker_names_each_breach(tmp_path: Path) -> None:
    root = tmp_path / "tests"
    (root / "big").mkdir(parents=True)
    (root / "loose").mkdir()
    for folder in (root, root / "big"):
        (folder / "__init__.py").write_text("")
    (root / "test_flat.py").write_text("from conftest import Env\n")
    for i in range(MAX_MODULES + 1):
        (root / "big" / f"test_{i}.py").write_text("")
    (root / "big" / "test_0.py").write_text("from tests.big.test_1 import SCRIPT\n")
    (root / "loose" / "test_x.py").write_text("def f():\n    from . import test_y\n")
    (root / "fixtures").mkdir()
    (root / "fixtures" / "test_data.py").write_text("from conftest import x\n")  # data: ignored
    assert layout_breaches(root) == [
        "tests/test_flat.py: a test at the top of tests/; move it into the folder of what it "
        "tests (README.md, How tests are laid out)",
        f"tests/big/: {MAX_MODULES + 1} test modules, over {MAX_MODULES}: split it by concern",
        "tests/loose/: no __init__.py (every folder of tests is a package)",
        "tests/big/test_0.py:1: imports the test module tests.big.test_1; move what is shared "
        "into tests/support/ and import it from there",
        "tests/loose/test_x.py:2: imports the test module .test_y; move what is shared into "
        "tests/support/ and import it from there",
        "tests/test_flat.py: imports conftest; import tests.support.*",
    ]
