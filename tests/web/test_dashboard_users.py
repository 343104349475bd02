"""The dashboard's access token against real Unix users (run as root: the `accounts` fixture).

User A's dashboard listens on the loopback; user B, on the same machine, `curl`s it: without the
token (or with a wrong one) B gets 401 and one line; with it (or with the cookie the login
address sets) B sees A's view, A's private log included (the dashboard runs as A and reads
what A may read). A dashboard run as B, with its own token, still cannot show A's private log
(403, one line): a dashboard shows only what the user running it may read. One started as root
(no --user) serves root's view to whoever holds its token and to nobody else.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

pytest.importorskip("uvicorn", reason="the dashboard needs the web extra")
if os.geteuid() != 0:
    pytest.skip("real Unix users need root", allow_module_level=True)

from det_local.store.paths import Paths  # noqa: E402
from tests.support.dashboard import Server, World, curl, finished_experiment, make_world, serve
from tests.support.users import A, B  # noqa: E402
from tests.support.world import kill_home_processes  # noqa: E402

serving = contextlib.contextmanager(serve)


@pytest.fixture(scope="module")
def world(accounts: None) -> Iterator[World]:
    """A home every user may read (pytest's directories are root's), with one finished
    experiment whose log belongs to A, mode 0600 (A keeps it private)."""
    base = Path(tempfile.mkdtemp(prefix="det-local-dusers-", dir="/tmp"))
    os.chmod(base, 0o755)
    w = make_world(base, dict(os.environ))
    try:
        yield w
    finally:
        kill_home_processes(w.home)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def private(world: World) -> tuple[int, Path]:
    """(the trial, its log): A's, 0600."""
    exp = finished_experiment(world, batches=40)
    trial = int(world.json("trial", "list", exp)[0]["id"])
    log = Paths(world.home).trial_log(exp, trial)
    pw = pwd.getpwnam(A)
    os.chown(log, pw.pw_uid, pw.pw_gid)
    os.chmod(log, 0o600)
    return trial, log


@pytest.fixture(scope="module")
def a_dashboard(world: World, private: tuple[int, Path]) -> Iterator[Server]:
    """A's dashboard (started as root with --user A: A cannot start this Python, which lives
    where only root reads; it binds, then runs as A)."""
    yield from serve(world, "--user", A)


def uid_of(server: Server) -> int:
    return int(psutil.Process(server.proc.pid).uids().effective)


def test_another_user_needs_the_token(a_dashboard: Server, private: tuple[int, Path]) -> None:
    trial, log = private
    assert uid_of(a_dashboard) == pwd.getpwnam(A).pw_uid
    url = f"{a_dashboard.base}/api/trials/{trial}/logs"
    status, body = curl(B, url)
    assert status == 401, body
    assert body.count("\n") == 1 and json.loads(body)["error"] == (
        "this dashboard needs its access token (no access token): open the address "
        "`det-local dashboard` printed at start (it ends ?token=...)"
    )
    status, body = curl(B, url, "-H", "Authorization: Bearer not-the-token")
    assert status == 401 and "(a wrong access token)" in json.loads(body)["error"]
    status, body = curl(B, f"{a_dashboard.base}/", "-H", "Cookie: det_local_token=x")
    assert status == 401  # pages too
    # with A's token: A's view, A's private log included
    status, body = curl(B, url, "-H", f"Authorization: Bearer {a_dashboard.token}")
    assert status == 200, body
    assert "done" in json.loads(body)["lines"]
    assert oct(log.stat().st_mode & 0o777) == "0o600" and log.stat().st_uid != 0


def test_login_address_sets_no_credential_cookie(
    a_dashboard: Server, private: tuple[int, Path]
) -> None:
    """The login address answers a page with no data (its script keeps the token in the
    origin's own storage, web/guard.py); whatever cookie it sets carries no token."""
    trial, _ = private
    jar = Path(tempfile.mkdtemp(prefix="det-local-jar-", dir="/tmp")) / "jar"
    try:
        os.chown(jar.parent, pwd.getpwnam(B).pw_uid, -1)
        status, body = curl(B, a_dashboard.login_url(f"/trials/{trial}"), "-c", str(jar), "-D", "-")
        assert status == 200 and "login.js" in body and "done" not in body, body
        assert a_dashboard.token not in jar.read_text()
        status, body = curl(B, f"{a_dashboard.base}/api/trials/{trial}/logs", "-b", str(jar))
        assert status == 401 and "needs its access token" in json.loads(body)["error"]
    finally:
        shutil.rmtree(jar.parent, ignore_errors=True)


# ---------------------------------------------------------------------------- the lure (issue 34)
# B's server on another 127.0.0.1 port (as a TensorBoard of B's would be: whatever B's PATH
# names): it writes down every request's headers, replays them at A's dashboard for A's private
# log, and keeps what came back. Only the standard library: B runs the system's python3.
LURE = r"""
import http.server, json, sys, urllib.error, urllib.request
port, target, record = int(sys.argv[1]), sys.argv[2], sys.argv[3]
SKIP = {"host", "connection", "accept-encoding", "if-none-match", "if-modified-since"}

class Lure(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        got = dict(self.headers.items())
        replay = {k: v for k, v in got.items() if k.lower() not in SKIP}
        try:
            with urllib.request.urlopen(urllib.request.Request(target, headers=replay)) as r:
                answer = [r.status, r.read(65536).decode("utf-8", "replace")]
        except urllib.error.HTTPError as err:
            answer = [err.code, err.read(65536).decode("utf-8", "replace")]
        with open(record, "a") as f:
            f.write(json.dumps({"path": self.path, "headers": got, "replay": answer}) + "\n")
        page = b"<!doctype html><title>lure</title><p id=lure>thanks</p>"
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Lure).serve_forever()
"""


@contextlib.contextmanager
def lure(target: str) -> Iterator[tuple[str, Path]]:
    """B's lure on a free 127.0.0.1 port: (its address, the file of what it received)."""
    from tests.support.dashboard import free_port
    from tests.support.world import wait_for

    base = Path(tempfile.mkdtemp(prefix="det-local-lure-", dir="/tmp"))
    pw = pwd.getpwnam(B)
    os.chown(base, pw.pw_uid, pw.pw_gid)
    (base / "lure.py").write_text(LURE)
    record = base / "record.jsonl"
    port = free_port()
    argv = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"]
    argv += ["/usr/bin/python3", str(base / "lure.py"), str(port), target, str(record)]
    proc = subprocess.Popen(argv, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def listening() -> bool:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return True
        return False

    try:
        wait_for(listening, timeout=30, what="B's lure to listen")
        yield f"http://127.0.0.1:{port}/", record
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(base, ignore_errors=True)


def test_a_lure_on_another_port_gets_no_login(  # before the tests that end a_dashboard
    a_dashboard: Server, private: tuple[int, Path]
) -> None:
    """A logs in to her dashboard in a browser (and sees her private log there), then visits
    B's server on another port of 127.0.0.1: it receives nothing of her login, and replaying
    whatever it received at her dashboard gets 401, not her log (issue 34: the cookie of the
    login went to every port of the host)."""
    from tests.support import browser
    from tests.support.world import wait_for

    trial, _ = private
    target = f"{a_dashboard.base}/api/trials/{trial}/logs/raw"
    with (
        lure(target) as (address, record),
        browser.chromium() as chromium,
        browser.checked_page(chromium) as page,
    ):
        a_dashboard.open(page, f"/trials/{trial}")
        browser.until(page, "document.getElementById('log').textContent.includes('done')")
        page.goto(address)
        assert page.text_content("#lure") == "thanks"
        visits = wait_for(
            lambda: (
                [json.loads(x) for x in record.read_text().splitlines()]
                if record.exists()
                else None
            ),
            what="the lure to write down A's visit",
        )
    assert visits[0]["path"] == "/", visits  # then perhaps /favicon.ico: each is checked
    for visit in visits:
        assert a_dashboard.token not in json.dumps(visit["headers"])
        assert not any(k.lower() in ("cookie", "authorization") for k in visit["headers"])
        status, body = visit["replay"]
        assert status == 401 and "needs its access token (no access token)" in body, visit
        assert "done" not in body


def test_a_dashboard_shows_only_what_its_user_may_read(
    world: World, private: tuple[int, Path]
) -> None:
    trial, log = private
    with serving(world, "--user", B) as b_dashboard:
        assert uid_of(b_dashboard) == pwd.getpwnam(B).pw_uid
        url = f"{b_dashboard.base}/api/trials/{trial}/logs"
        status, body = curl(B, url, "-H", f"Authorization: Bearer {b_dashboard.token}")
        assert status == 403, body
        error = json.loads(body)["error"]
        assert error.startswith(f"permission denied: cannot read {log}: experiment "), error
        assert "keeps them private" in error
        # the rest of the store is what every user may read
        status, body = curl(B, f"{b_dashboard.base}/api/experiments", "-H", bearer(b_dashboard))
        assert status == 200 and len(json.loads(body)) == 1


def bearer(server: Server) -> str:
    return f"Authorization: Bearer {server.token}"


def test_root_dashboard_serves_root_only_to_its_token(
    world: World, private: tuple[int, Path]
) -> None:
    trial, _ = private
    with serving(world) as root_dashboard:
        assert uid_of(root_dashboard) == 0
        url = f"{root_dashboard.base}/api/trials/{trial}/logs"
        status, body = curl(B, url)
        assert status == 401 and "needs its access token" in body
        status, body = curl(B, url, "-H", bearer(root_dashboard))
        assert status == 200 and "done" in json.loads(body)["lines"]
        # the token went to the terminal that started it (here: a file of root's), nowhere else
        assert root_dashboard.token in root_dashboard.out.read_text()
