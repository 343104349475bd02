"""docs/architecture.md names only what exists (issue 26): every path it cites in backquotes
(`sched/run/launcher.py`, `client/`, `det_local/web/`), every dotted module (`det_local.views`),
and every bare module name (`pages.py`) is a file or folder of this checkout."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support import paths

ROOT = paths.REPO
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "det_local"

# a backquoted path: words and slashes, ending in .py or / (an optional .name after a .py is a
# definition in it: `sched/run/trialplan.build_trial_plan` is checked as sched/run/trialplan.py)
PATH = re.compile(
    r"`((?:[\w.]+/)*[\w]+(?:\.py|/))`"
    r"|`((?:[\w]+/)+[\w]+)\.(?!(?:js|css|html|token|json|yaml|log)`)[A-Za-z_]\w*`"
)
DOTTED = re.compile(r"`(det_local(?:\.\w+)+)`")


def _exists(cited: str) -> bool:
    """A path from the repository, from det_local/ or the dashboard's folder, or (a bare module
    name) anywhere in det_local/."""
    if any((base / cited).exists() for base in (ROOT, PACKAGE, PACKAGE / "web")):
        return True
    return "/" not in cited.rstrip("/") and any(PACKAGE.rglob(cited.rstrip("/")))


def cited_paths(text: str) -> set[str]:
    out = set()
    for whole, module in PATH.findall(text):
        if whole:
            out.add(whole)
        elif (PACKAGE / f"{module}.py").exists() or (ROOT / f"{module}.py").exists():
            out.add(f"{module}.py")
        elif (PACKAGE / module).is_dir():
            out.add(f"{module}/")
        else:
            out.add(f"{module}.py")  # reported as missing below
    return {p for p in out if p not in {"/", "/api/"}}


def test_every_path_the_page_cites_exists() -> None:
    text = DOC.read_text()
    missing = sorted(p for p in cited_paths(text) if not _exists(p))
    assert missing == [], f"docs/architecture.md cites what does not exist: {missing}"


def test_every_dotted_module_the_page_cites_exists() -> None:
    text = DOC.read_text()
    missing = []
    for dotted in set(DOTTED.findall(text)):
        parts = dotted.split(".")
        # the longest prefix that is a module or package; the rest may be a name in it
        found = any(
            (ROOT / Path(*parts[:n])).with_suffix(".py").exists()
            or (ROOT / Path(*parts[:n])).is_dir()
            for n in range(len(parts), 1, -1)
        )
        if not found:
            missing.append(dotted)
    assert missing == []


def test_the_checker_catches_a_stale_name() -> None:
    assert not _exists("sched/trialstarts.py")
    assert "sched/expcontrol.py" in cited_paths("see `sched/expcontrol.py` and `rpc.py`")
    assert not _exists("sched/expcontrol.py")
    assert _exists("sched/life/changes.py") and _exists("client/")
