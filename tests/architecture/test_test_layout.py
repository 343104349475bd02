"""The suite keeps its layout (issue 26, item 4; README.md, "How tests are laid out"): test files
live in a folder named after what they test, not at tests/'s top; every folder of tests is a
package of at most MAX_MODULES test modules; helpers are imported from tests/support/, never from
a conftest.py (pytest loads those itself)."""

from __future__ import annotations

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
    return out


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
    (root / "fixtures").mkdir()
    (root / "fixtures" / "test_data.py").write_text("from conftest import x\n")  # data: ignored
    assert layout_breaches(root) == [
        "tests/test_flat.py: a test at the top of tests/; move it into the folder of what it "
        "tests (README.md, How tests are laid out)",
        f"tests/big/: {MAX_MODULES + 1} test modules, over {MAX_MODULES}: split it by concern",
        "tests/loose/: no __init__.py (every folder of tests is a package)",
        "tests/test_flat.py: imports conftest; import tests.support.*",
    ]
