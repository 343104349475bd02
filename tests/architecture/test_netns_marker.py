"""Every test that makes Linux network namespaces carries the `netns` marker, so that
`-m "not netns"` leaves out all of them (README.md, "How tests are laid out"). Those in
tests/federation/netns/ get it from their folder (tests/conftest.py); a test elsewhere that
builds namespaced machines (`tests.support.fednet.Net`, `tests.support.slurmnodes.cluster`),
directly, through a fixture of its module or through a helper of its module, is marked by hand:
`@pytest.mark.netns`, or `netns` in its module's `pytestmark`. Helpers that only use fednet's or
gangnet's functions without making namespaces (`reachable`, `cli`) need no marker."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import TESTS

# module -> the names in it that make network namespaces when called
MAKERS = {"tests.support.fednet": {"Net"}, "tests.support.slurmnodes": {"cluster"}}
BY_FOLDER = ("federation", "netns")  # marked by tests/conftest.py FOLDER_MARKERS


def _maker_names(tree: ast.Module) -> tuple[set[str], dict[str, set[str]]]:
    """The local names bound to a maker, and local module names -> their makers' names."""
    direct: set[str] = set()
    modules: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in MAKERS:
            made = MAKERS[node.module]
            direct |= {a.asname or a.name for a in node.names if a.name in made}
        elif isinstance(node, ast.ImportFrom) and node.module == "tests.support":
            for a in node.names:
                if f"tests.support.{a.name}" in MAKERS:
                    modules[a.asname or a.name] = MAKERS[f"tests.support.{a.name}"]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MAKERS:
                    modules[a.asname or a.name] = MAKERS[a.name]
    return direct, modules


def _calls(fn: ast.AST) -> set[str]:
    """What `fn` calls, as written: `f` or `module.f` (dotted)."""
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            out.add(ast.unparse(node.func))
    return out


def _marked(decorators: list[ast.expr]) -> bool:
    return any("mark.netns" in ast.unparse(d) for d in decorators)


def unmarked(path: Path, root: Path) -> list[str]:
    """One line per test in the module at `path` (under the tests/ folder `root`) that makes
    network namespaces without the `netns` marker."""
    rel = path.relative_to(root)
    if rel.parts[: len(BY_FOLDER)] == BY_FOLDER:
        return []
    tree = ast.parse(path.read_text(), str(path))
    direct, modules = _maker_names(tree)
    makes = direct | {f"{m}.{name}" for m, names in modules.items() for name in names}
    if not makes:
        return []
    module_marked = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and "mark.netns" in ast.unparse(node.value)
        for node in tree.body
    )
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        functions += [n for n in cls.body if isinstance(n, ast.FunctionDef)]
    # fixtures and helpers of the module that make namespaces, to a fixed point
    namespaced: set[str] = set()
    changed = True
    while changed:
        changed = False
        for fn in functions:
            if fn.name in namespaced:
                continue
            args = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
            if _calls(fn) & (makes | namespaced) or args & namespaced:
                namespaced.add(fn.name)
                changed = True
    return [
        f"{rel.as_posix()}::{fn.name}: makes network namespaces but is not marked `netns`: add "
        "@pytest.mark.netns (or netns in the module's pytestmark)"
        for fn in functions
        if fn.name.startswith("test")
        and fn.name in namespaced
        and not module_marked
        and not _marked(fn.decorator_list)
    ]


def breaches(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("test_*.py")):
        out += unmarked(path, root)
    return out


def test_every_test_that_makes_namespaces_is_marked_netns() -> None:
    assert breaches(TESTS) == []


def test_the_checker_finds_each_way_of_making_namespaces(tmp_path: Path) -> None:
    root = tmp_path / "tests"
    (root / "web").mkdir(parents=True)
    (root / "federation" / "netns").mkdir(parents=True)
    (root / "web" / "test_direct.py").write_text(
        "import pytest\n"
        "from tests.support.fednet import Net, reachable\n"
        "def test_direct(tmp_path):\n    with Net(tmp_path) as net:\n        pass\n"
        "@pytest.mark.slow\n@pytest.mark.netns\n"
        "def test_marked(tmp_path):\n    Net(tmp_path)\n"
        "def test_only_a_path(tmp_path):\n    reachable(tmp_path)\n"
        "def test_annotation_only(net: Net):\n    pass\n"
        "def two(tmp_path):\n    return Net(tmp_path)\n"
        "def test_through_a_helper(tmp_path):\n    two(tmp_path)\n"
    )
    (root / "web" / "test_fixture.py").write_text(
        "import pytest\n"
        "from tests.support import slurmnodes\n"
        "@pytest.fixture(scope='module')\n"
        "def slurm():\n    with slurmnodes.cluster('/x') as c:\n        yield c\n"
        "@pytest.fixture\ndef started(slurm):\n    return slurm\n"
        "def test_by_fixture(started):\n    pass\n"
        "def test_unit():\n    slurmnodes.CORE\n"
    )
    (root / "web" / "test_module_marked.py").write_text(
        "import pytest\nfrom tests.support.fednet import Net\n"
        "pytestmark = [pytest.mark.slow, pytest.mark.netns]\n"
        "def test_a(tmp_path):\n    Net(tmp_path)\n"
    )
    (root / "federation" / "netns" / "test_folder.py").write_text(
        "from tests.support.fednet import Net\ndef test_b(tmp_path):\n    Net(tmp_path)\n"
    )
    fix = "makes network namespaces but is not marked `netns`: add @pytest.mark.netns (or netns "
    fix += "in the module's pytestmark)"
    assert breaches(root) == [
        f"web/test_direct.py::test_direct: {fix}",
        f"web/test_direct.py::test_through_a_helper: {fix}",
        f"web/test_fixture.py::test_by_fixture: {fix}",
    ]
