"""The cluster, commands and slots pages in a real browser (Debian's chromium, headless, by
Playwright): each renders with a clean console under the dashboard's CSP, the navigation links
to them,. Screenshots: tests/artifacts/."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the dashboard needs the web extra")
pytest.importorskip("uvicorn", reason="the dashboard needs the web extra")
from _dashboard import Server, World, make_world, serve

playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"

if not (os.access(CHROMIUM, os.X_OK) or shutil.which("chromium")):
    pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("cluster-browser"), dict(os.environ))


@pytest.fixture(scope="module")
def server(world: World) -> Iterator[Server]:
    yield from serve(world)  # no daemon: the cluster page says how to start one


def test_cluster_and_commands_pages_in_chromium(world: World, server: Server) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 700})
            problems: list[str] = []
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda err: problems.append(str(err)))
            page.set_default_timeout(30_000)

            page.goto(server.base + "/")
            page.click("nav >> text=Cluster")
            page.wait_for_url("**/cluster")
            off = page.text_content("#cluster-off") or ""
            assert "no det-local daemon is running" in off and "det-local cluster init" in off
            page.screenshot(path=str(ARTIFACTS / "cluster.png"), full_page=True)

            page.click("nav >> text=Commands")
            page.wait_for_url("**/commands")
            assert page.locator("#commands").count() == 1
            page.screenshot(path=str(ARTIFACTS / "commands.png"), full_page=True)

            page.click("nav >> text=Slots")
            page.wait_for_url("**/slots")
            assert page.locator("#slots tbody tr").count() >= 1
            page.screenshot(path=str(ARTIFACTS / "slots.png"), full_page=True)
            assert problems == [], problems
        finally:
            browser.close()
