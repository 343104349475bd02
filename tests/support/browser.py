"""What the dashboard's browser tests share: Debian's chromium (headless, driven by Playwright;
Playwright's own browser download is not used), its flags, where screenshots go (tests/artifacts/,
git-ignored; CI keeps them), and polling a page. A test module calls :func:`require` at import:
it skips the module when the web extra, Playwright or chromium is missing."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.support import paths
from tests.support.world import wait_for

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = paths.ARTIFACTS


def require() -> Any:
    """playwright.sync_api, or skip the calling module (no web extra, Playwright or chromium)."""
    pytest.importorskip("starlette", reason="the dashboard needs the web extra")
    pytest.importorskip("uvicorn", reason="the dashboard needs the web extra")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not (os.access(CHROMIUM, os.X_OK) or shutil.which("chromium")):
        why = f"no chromium at {CHROMIUM} (apt-get install chromium)"
        pytest.skip(why, allow_module_level=True)
    ARTIFACTS.mkdir(exist_ok=True)
    return sync_api


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless chromium, closed at the end."""
    sync_api = require()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def until(page: Any, expression: str, timeout: float = 30.0) -> Any:
    """Poll a JavaScript expression in the page until it is truthy. page.evaluate, not
    wait_for_function: the dashboard's Content-Security-Policy forbids the eval that
    wait_for_function's string predicates use (and the tests keep that policy on). An
    expression that throws (a chart being rebuilt) counts as not yet; the last error is in the
    failure."""
    errors: list[str] = []

    def value() -> Any:
        try:
            return page.evaluate(expression)
        except Exception as err:  # noqa: BLE001 - e.g. a chart being rebuilt: poll again
            errors[:] = [str(err).splitlines()[0]]
            return None

    try:
        return wait_for(value, timeout=timeout, what=expression)
    except AssertionError as err:
        raise AssertionError(f"{err}; last error in the page: {errors}") from None


def console_errors(page: Any) -> list[str]:
    """The page's console errors and uncaught exceptions, collected from now on."""
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda err: problems.append(str(err)))
    return problems


@contextmanager
def checked_page(browser: Any, width: int = 1280, height: int = 900) -> Iterator[Any]:
    """A new page (30 s timeouts); when the block ends without an error, the console must
    have stayed clean (a CSP violation is a console error too)."""
    page = browser.new_page(viewport={"width": width, "height": height})
    problems = console_errors(page)
    page.set_default_timeout(30_000)
    yield page
    assert problems == [], problems
    page.close()
