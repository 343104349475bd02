"""A dashboard that switches user (`det-local dashboard --user`, a root daemon's dashboard) has
imported, before it switched, every module its pages import when first asked
(`web/serve.preload`): its Python may sit where that user cannot read (a venv under a 0700
home), and a module imported later, as that user, fails the page ("No module named ...").

Checked statically: every det_local module imported inside a function of det_local/web/ or
det_local/views/ (the pages and their read models; serve.py, which runs before the switch, left
out) is in sys.modules after preload() in a fresh interpreter."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

PACKAGE = REPO / "det_local"


def lazy_imports(path: Path) -> set[str]:
    """det_local modules imported inside functions of the module at `path`."""
    found: set[str] = set()
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.startswith("det_local"):
                    found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("det_local"))
    return found


def module_file(name: str) -> Path | None:
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def test_preload_imports_what_the_pages_import_later() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys; from det_local.web.serve import preload; preload();"
            " print(json.dumps(sorted(m for m in sys.modules if m.startswith('det_local'))))",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=120,
    )
    loaded = set(json.loads(out.stdout))
    sources = [*PACKAGE.joinpath("web").glob("*.py"), *PACKAGE.joinpath("views").glob("*.py")]
    sources.remove(PACKAGE / "web" / "serve.py")
    missing = {
        f"{m} (imported inside a function of {src.relative_to(REPO)})"
        for src in sources
        for m in lazy_imports(src)
        if m not in loaded and module_file(m) is not None
    }
    assert not missing, "add to det_local/web/serve.preload: " + "; ".join(sorted(missing))


def test_static_files_are_served_from_what_was_read_at_start(tmp_path: Path) -> None:
    """A dashboard that drops to a user after building its app serves det-local's scripts
    (the login's service worker and script among them) though that user cannot read them
    (det-local under root's 0700 home: the login page's scripts were refused and nobody
    could log in): the files are read when the app is built, not at each request."""
    import shutil

    from starlette.exceptions import HTTPException
    from starlette.requests import Request

    from det_local.web.app import STATIC_DIR
    from det_local.web.staticmem import StaticFiles

    copy = tmp_path / "static"
    shutil.copytree(STATIC_DIR, copy)
    static = StaticFiles(copy)
    copy.chmod(0)  # nobody, root included through os.walk's listing, reads it from now on
    try:
        request = Request({"type": "http", "method": "GET", "path": "/", "headers": []})
        for rel, kind in (("sw.js", "text/javascript"), ("login.js", "text/javascript")):
            answer = static.response(rel, request)
            assert answer.status_code == 200, rel
            assert answer.body == (STATIC_DIR / rel).read_bytes()
            assert answer.headers["content-type"].startswith(kind)
        css = static.response("vendor/uplot/uPlot.min.css", request)
        assert css.headers["content-type"].startswith("text/css")
        etag = css.headers["etag"]
        hit = [(b"if-none-match", etag.encode())]
        again = Request({"type": "http", "method": "GET", "path": "/", "headers": hit})
        assert static.response("vendor/uplot/uPlot.min.css", again).status_code == 304
        for missing in ("nope.js", "../app.py", "vendor"):
            with pytest.raises(HTTPException):
                static.response(missing, request)
    finally:
        copy.chmod(0o755)
