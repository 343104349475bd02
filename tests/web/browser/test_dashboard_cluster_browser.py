"""The cluster, commands and slots pages in a real browser (Debian's chromium, headless, by
Playwright): each renders with a clean console under the dashboard's CSP, the navigation links
to them. Screenshots: tests/artifacts/."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.browser import ARTIFACTS, chromium, console_errors, require

require()
from tests.support.dashboard import Server, World, make_world, serve  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("cluster-browser"), dict(os.environ))


@pytest.fixture(scope="module")
def server(world: World) -> Iterator[Server]:
    yield from serve(world)  # no daemon: the cluster page says how to start one


def test_cluster_and_commands_pages_in_chromium(world: World, server: Server) -> None:
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 700})
        problems = console_errors(page)
        page.set_default_timeout(30_000)

        server.open(page, "/")
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
