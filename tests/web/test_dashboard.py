"""The dashboard over a real store: one finished Core API experiment (embedded run), served by
a real `det-local dashboard` process and read over HTTP on the loopback. /api/ answers with
what the CLI's --json prints; ids it does not have are 404 with one line; user strings (the
experiment's name, a label, log lines) come back as data, never as markup; the stream
delivers a running trial's new lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import paths

pytest.importorskip("starlette", reason="the dashboard needs the web extra")
pytest.importorskip("uvicorn", reason="the dashboard needs the web extra")

from det_local.store.db import Store
from det_local.store.paths import Paths
from tests.support.dashboard import (
    LABEL,
    NAME,
    TOKEN,
    Server,
    World,
    asgi_get,
    bearer,
    finished_experiment,
    make_world,
    serve,
    token_app,
)
from tests.support.world import wait_for


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("dash"), dict(os.environ))


@pytest.fixture(scope="module")
def exp_id(world: World) -> int:
    return finished_experiment(world)


@pytest.fixture(scope="module")
def server(world: World, exp_id: int) -> Iterator[Server]:
    yield from serve(world)


def trial_id(world: World, exp_id: int) -> int:
    return int(world.json("trial", "list", exp_id)[0]["id"])


# ---------------------------------------------------------------------------- /api/
def test_api_matches_cli_json(world: World, exp_id: int, server: Server) -> None:
    tid = trial_id(world, exp_id)
    assert server.json("/api/experiments") == world.json("experiment", "list", "--all")
    assert server.json(f"/api/experiments/{exp_id}") == world.json("experiment", "describe", exp_id)
    assert server.json(f"/api/trials/{tid}") == world.json("trial", "describe", tid)
    # under ~2,000 reports a group: every one, as `trial metrics --json`
    assert server.json(f"/api/trials/{tid}/metrics?group=validation") == world.json(
        "trial", "metrics", tid, "--group", "validation"
    )
    assert server.json("/api/jobs?all=1") == world.json("job", "list", "--all")
    slots = server.json("/api/slots")
    cli = world.json("slots")
    assert [s["index"] for s in slots] == [s["index"] for s in cli]
    assert all(set(a) == set(b) for a, b in zip(slots, cli, strict=True))
    exp = server.json(f"/api/experiments/{exp_id}")["experiment"]
    assert exp["name"] == NAME and LABEL in exp["labels"]  # as data, unchanged


def test_metrics_downsampled_to_about_2000_points(
    world: World, exp_id: int, server: Server
) -> None:
    tid = trial_id(world, exp_id)
    every = world.json("trial", "metrics", tid, "--group", "training")
    assert len(every) == 3000
    sampled = server.json(f"/api/trials/{tid}/metrics?group=training")
    steps = [r["steps_completed"] for r in sampled]
    assert 1500 <= len(sampled) <= 2001, len(sampled)
    assert steps[0] == 1 and steps[-1] == 3000 and steps == sorted(steps)
    assert set(sampled[0]) == set(every[0])  # the same keys
    by_step = {r["steps_completed"]: r for r in every}
    assert all(r == by_step[r["steps_completed"]] for r in sampled)  # real reports, untouched
    # every group at once; the experiment's curves: one entry per trial
    groups = {r["group"] for r in server.json(f"/api/trials/{tid}/metrics")}
    assert groups == {"training", "validation"}
    curves = server.json(f"/api/experiments/{exp_id}/metrics?group=validation")
    assert [t["trial_id"] for t in curves["trials"]] == [tid]
    assert [r["steps_completed"] for r in curves["trials"][0]["reports"]] == [750, 1500, 2250, 3000]


def test_logs_are_data_and_resume_from_offset(world: World, exp_id: int, server: Server) -> None:
    tid = trial_id(world, exp_id)
    chunk = server.json(f"/api/trials/{tid}/logs")
    assert any('<script>alert("log")</script> starting' in ln for ln in chunk["lines"]), chunk
    assert chunk["state"] == "COMPLETED" and chunk["trial_id"] == tid
    log = Paths(world.home).trial_log(exp_id, tid).read_bytes()
    assert chunk["offset"] == len(log)
    assert server.json(f"/api/trials/{tid}/logs?offset={chunk['offset']}")["lines"] == []
    tail = server.json(f"/api/trials/{tid}/logs?tail=1")["lines"]
    assert len(tail) == 1 and tail[0].endswith("done")


@pytest.mark.parametrize(
    ("path", "status", "fragment"),
    [
        ("/api/experiments/999", 404, "experiment 999 not found"),
        ("/api/experiments/999/metrics", 404, "experiment 999 not found"),
        ("/api/trials/999", 404, "trial 999 not found"),
        ("/api/trials/999/metrics", 404, "trial 999 not found"),
        ("/api/trials/999/logs", 404, "trial 999 not found"),
        ("/api/trials/999/stream", 404, "trial 999 not found"),
        ("/api/experiments/999/stream", 404, "experiment 999 not found"),
        ("/api/trials/abc", 404, "trial 'abc' not found: trial ids are whole numbers"),
        ("/api/nothing", 404, "no such API route: /api/nothing"),
        ("/api/trials/1/logs?offset=x", 400, "?offset='x' is not a whole number"),
        ("/api/trials/1/metrics?group=nope", 404, "has no 'nope' metrics"),
    ],
)
def test_api_errors_are_one_line(server: Server, path: str, status: int, fragment: str) -> None:
    got, body, headers = server.get(path)
    assert got == status, body
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert fragment in error and "\n" not in error, error


def test_api_index_lists_every_route(server: Server) -> None:
    got, body, _ = server.get("/api/")
    assert got == 200
    routes = json.loads(body)["routes"]
    for path in (
        "/api/experiments",
        "/api/experiments/{experiment_id}/hparams",
        "/api/experiments/{experiment_id}/progress",
        "/api/trials/{trial_id}/logs/raw",
        "/api/trials/{trial_id}/stream",
    ):
        assert path in routes, routes
    assert "/api/{rest:path}" not in routes and all(r.startswith("/api/") for r in routes)


def test_read_only(server: Server) -> None:
    for method in ("POST", "PUT", "DELETE"):
        req = urllib.request.Request(
            server.base + "/api/experiments",
            method=method,
            data=b"",
            headers=bearer(server.token),
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 405
        assert "read-only" in json.loads(err.value.read())["error"]


# ---------------------------------------------------------------------------- pages
def test_pages_show_user_strings_as_text(world: World, exp_id: int, server: Server) -> None:
    tid = trial_id(world, exp_id)
    for path in ("/", f"/experiments/{exp_id}", f"/trials/{tid}", "/queue", "/slots"):
        status, body, headers = server.get(path)
        assert status == 200, (path, body)
        page = body.decode()
        assert "<script>alert" not in page and "<img src=x" not in page, path
        assert "script-src 'self'" in headers["content-security-policy"]
    listing = server.get("/")[1].decode()
    assert "&lt;script&gt;alert(&quot;name&quot;)&lt;/script&gt; digits" in listing
    assert "&lt;img src=x onerror=alert(1)&gt;" in listing
    assert f'href="/experiments/{exp_id}"' in listing and "COMPLETED" in listing
    exp_page = server.get(f"/experiments/{exp_id}")[1].decode()
    assert "<th>lr</th>" in exp_page and "<th>batches</th>" in exp_page  # one column each
    assert "det-local checkpoint download " in exp_page
    filtered = server.get("/?state=ERROR")[1].decode()
    assert "0 of 1 experiments" in filtered
    assert "1 of 1 experiments" in server.get("/?label=digits&sort=best")[1].decode()
    status, body, _ = server.get("/experiments/999")
    assert status == 404 and "experiment 999 not found" in body.decode()


def test_experiments_at_both_addresses(exp_id: int, server: Server) -> None:
    """/experiments (where a Determined user looks) is the list, as / is."""
    home = server.get("/")
    listed = server.get("/experiments")
    assert listed[0] == 200 and home[0] == 200
    assert f'href="/experiments/{exp_id}"' in listed[1].decode()
    assert listed[1] == home[1]


# ---------------------------------------------------------------------------- live
def read_events(
    server: Server,
    path: str,
    until: str,
    box: list[tuple[str, Any]],
    connected: threading.Event | None = None,
) -> None:
    req = urllib.request.Request(server.base + path, headers=bearer(server.token))
    with urllib.request.urlopen(req, timeout=60) as r:
        if connected is not None:
            connected.set()  # the stream's headers came: it watches from now on
        name = ""
        for raw in r:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                box.append((name, json.loads(line[6:])))
                if name == until:
                    return


def test_stream_sends_a_running_trials_new_lines(world: World, server: Server) -> None:
    gate = world.tmp / "gate"
    cfg, ctx = world.context("live", {"batches": 8, "lr": 0.1, "wait_for": str(gate)})
    run = world.start_run(cfg, ctx)
    try:
        exp = wait_for(
            lambda: [e for e in server.json("/api/experiments") if e["id"] > 1], what="the run"
        )[-1]

        def waiting() -> Any:
            trials = server.json(f"/api/experiments/{exp['id']}")["trials"]
            if not trials:
                return None
            chunk = server.json(f"/api/trials/{trials[0]['id']}/logs")
            return chunk if any("waiting for" in ln for ln in chunk["lines"]) else None

        chunk = wait_for(waiting, timeout=60, what="the trial to wait")
        events: list[tuple[str, Any]] = []
        reader = threading.Thread(
            target=read_events,
            args=(
                server,
                f"/api/trials/{chunk['trial_id']}/stream?offset={chunk['offset']}",
                "end",
                events,
                trial_connected := threading.Event(),
            ),
        )
        exp_events: list[tuple[str, Any]] = []
        connected = threading.Event()
        exp_reader = threading.Thread(
            target=read_events,
            args=(server, f"/api/experiments/{exp['id']}/stream", "end", exp_events, connected),
        )
        reader.start()
        exp_reader.start()
        assert connected.wait(30) and trial_connected.wait(30), "a stream did not answer"
        gate.write_text("go")
        reader.join(60)
        exp_reader.join(60)
        assert not reader.is_alive() and not exp_reader.is_alive()
        # the experiment's stream: its trial's new reports, then its end
        assert "metrics" in [name for name, _ in exp_events], exp_events
        assert exp_events[-1] == ("end", {"state": "COMPLETED"}), exp_events
        lines = [ln for name, d in events if name == "log" for ln in d["lines"]]
        assert "RELEASED <b>bold</b>" in lines[0], lines  # nothing before the offset again
        assert any(name == "metrics" for name, _ in events)
        assert events[-1] == ("end", {"state": "COMPLETED"})
        assert run.wait(60) == 0
    finally:
        run.kill()
        run.wait()


# ---------------------------------------------------------------------------- access


def test_token_on_every_request_off_loopback(
    exp_id: int, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DET_LOCAL_HOME", str(world.home))
    app = token_app(loopback_only=False, port=8080)
    host = {"host": "10.1.2.3:8080"}
    status, _, body = asgi_get(app, "/api/experiments", host, auth=False)
    assert status == 401 and json.loads(body)["error"] == (
        "this dashboard needs its access token (no access token): open the address "
        "`det-local dashboard` printed at start (it ends ?token=...)"
    )
    assert body.count(b"\n") == 1 and body.endswith(b"\n")
    for wrong in ({"authorization": "Bearer nope"}, {"x-det-local-token": TOKEN[:-1]}):
        status, _, body = asgi_get(app, "/api/experiments", {**host, **wrong}, auth=False)
        assert status == 401 and "(a wrong access token)" in json.loads(body)["error"]
    assert asgi_get(app, "/api/experiments?token=nope", host, auth=False)[0] == 401
    # a cookie is no credential (a browser sends it to every port of the host: issue 34)
    for cookie in (f"det_local_token_8080={TOKEN}", f"det_local_token={TOKEN}"):
        status, _, body = asgi_get(app, "/api/experiments", {**host, "cookie": cookie}, auth=False)
        assert status == 401 and "(no access token)" in json.loads(body)["error"]
    for right in ({"authorization": f"Bearer {TOKEN}"}, {"x-det-local-token": TOKEN}):
        status, _, body = asgi_get(app, "/api/experiments", {**host, **right}, auth=False)
        assert status == 200 and json.loads(body)[0]["id"] == exp_id
    # the login address: a page with no data but the login script; no credential cookie (an
    # older det-local's is expired)
    status, headers, body = asgi_get(app, f"/?label=digits&token={TOKEN}", host, auth=False)
    assert status == 200 and b'src="/static/login.js"' in body and b'data-mode="store"' in body
    assert headers["cache-control"] == "no-store" and TOKEN.encode() not in body
    cookie = headers["set-cookie"]
    assert cookie.startswith("det_local_token") and "=; Max-Age=0;" in cookie, cookie
    # a browser's page without the token: the one line in a page that may retry the login
    html = {**host, "accept": "text/html,application/xhtml+xml"}
    status, headers, body = asgi_get(app, "/experiments/1", html, auth=False)
    assert status == 401 and b"needs its access token (no access token)" in body
    assert b'data-mode="retry"' in body and b"digits" not in body
    # /api/ with ?token= answers at once (a script's one request), and sets no cookie
    status, headers, _ = asgi_get(app, f"/api/jobs?token={TOKEN}", host, auth=False)
    assert status == 200 and "set-cookie" not in headers


def test_loopback_needs_the_token_too(server: Server) -> None:
    status, body, _ = server.get("/api/trials/1/logs", auth=False)
    assert status == 401 and "needs its access token" in json.loads(body)["error"]
    status, body, _ = server.get("/", auth=False)
    assert status == 401 and "needs its access token" in json.loads(body)["error"]
    assert server.get("/api/jobs")[0] == 200
    # what the login page needs is served without the token (code shipped with det-local)
    for public in ("/sw.js", "/static/login.js", "/static/dashboard.css"):
        assert server.get(public, auth=False)[0] == 200, public
    status, _, headers = server.get("/sw.js", auth=False)
    assert headers["content-type"].startswith("text/javascript")
    assert server.get("/static/dashboard.js", auth=False)[0] == 401


def test_loopback_answers_only_loopback_hosts(server: Server) -> None:
    assert server.get("/api/jobs", {"Host": "localhost:1"})[0] == 200
    status, body, _ = server.get("/api/jobs", {"Host": "evil.example:8080"})
    assert status == 403 and "only requests to localhost" in json.loads(body)["error"]


def test_token_printed_for_another_address(world: World) -> None:
    from det_local.web.serve import address

    assert address("10.0.0.5", 8080, "T0K") == "http://10.0.0.5:8080/?token=T0K"
    assert address("127.0.0.1", 8080, None) == "http://127.0.0.1:8080/"


def test_dashboard_errors_are_one_line(world: World, server: Server) -> None:
    port = server.base.rsplit(":", 1)[1]
    r = world.det("dashboard", "--port", port, timeout=30)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr
    code = (
        "import sys; sys.modules['starlette'] = None; sys.argv = ['det-local', 'dashboard'];"
        " from det_local.cli.main import main; main()"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], env=world.env, capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr, p
    assert len(p.stderr.strip().splitlines()) == 1
    assert p.stderr.startswith("error: the dashboard needs starlette"), p.stderr
    # run from this source checkout: the editable install of the extra, in it
    root = paths.REPO
    assert f"cd {root} && pip install -e '.[web]' (a source checkout)" in p.stderr, p.stderr


def test_install_hint_where_det_local_came_from(tmp_path: Path) -> None:
    from det_local.web import install_hint

    checkout = tmp_path / "src" / "det-local"
    (checkout / "det_local").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("[project]\n")
    assert install_hint(str(checkout / "det_local")) == (
        f"cd {checkout} && pip install -e '.[web]' (a source checkout)"
    )
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    (site / "det_local").mkdir(parents=True)
    assert install_hint(str(site / "det_local")) == "pip install 'det-local[web]'"


def test_sample_in_the_store(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    exp = store.create_experiment(name="x", config={})
    tid = store.create_trial(exp, hparams={}, seed=0)
    reports = [("training", s, {"loss": float(s)}, 0.0) for s in range(0, 100_000, 10)]
    store.add_metrics(tid, 1, reports)
    sampled = store.sample_metrics(tid, "training", 500)
    steps = [r.steps_completed for r in sampled]
    assert 400 <= len(sampled) <= 500
    assert steps[0] == 0 and steps[-1] == 99_990 and steps == sorted(steps)
    gaps = {b - a for a, b in zip(steps, steps[1:], strict=False)}
    assert max(gaps) <= 2 * min(gaps) + 10  # evenly spread
    assert store.sample_metrics(tid, "training", 10_000) == store.list_metrics(tid, "training")
    assert len(store.sample_metrics(tid, "training", 9_999)) < 10_000
    assert store.newest_metric_id() == 10_000
    assert store.last_metric_id(tid, 0) == 10_000 and store.last_metric_id(tid, 10_000) == 10_000
    assert store.last_metric_id(tid + 1, 5) == 5
