"""What the dashboard tests share: a finished experiment in a home of its own (one per test
module), a `det-local dashboard` process serving it, and HTTP helpers (urllib: real sockets on
the loopback). Every request to the dashboard needs its access token: `Server` reads the one the
dashboard printed and sends it (Authorization: Bearer), `Server.open` logs a browser page in
with the login address (?token=: the login page keeps it for the dashboard's origin and its
service worker sends it as a header, web/guard.py); in-process requests (`asgi_get`) go to
an application made with `TOKEN`."""

from __future__ import annotations

import asyncio
import json
import pwd
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.world import kill_home_processes, wait_for

# A Core API trial: training metrics at every step, validations, a checkpoint, and output lines
# that are markup (they must come back as text). With hparams.wait_for, it holds after its
# second report until that file exists, then prints RELEASED and goes on.
SCRIPT = r"""
import os, pathlib, sys, time
import determined as det

def main(core):
    hp = det.get_cluster_info().trial.hparams
    n = int(hp["batches"])
    print('<script>alert("log")</script> starting', flush=True)
    for step in range(1, n + 1):
        core.train.report_training_metrics(step, {"loss": 1.0 / step, "acc": step / n})
        if step == 2 and hp.get("wait_for"):
            print("waiting for", hp["wait_for"], flush=True)
            deadline = time.monotonic() + 60
            while not os.path.exists(hp["wait_for"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            print("RELEASED <b>bold</b>", flush=True)
            core.train.report_training_metrics(step, {"loss": 0.5, "acc": 0.0})
        if step % (n // 4) == 0:
            core.train.report_validation_metrics(step, {"val_loss": hp["lr"] * 10 / step})
    with core.checkpoint.store_path({"steps_completed": n}) as (path, _):
        (path / "w").write_text("1")
    print("done", flush=True)

with det.core.init() as core:
    main(core)
"""

NAME = '<script>alert("name")</script> digits'
LABEL = "<img src=x onerror=alert(1)>"


@dataclass
class World:
    home: Path
    tmp: Path
    env: dict[str, str]

    def det(self, *args: Any, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "det_local.cli.main", *map(str, args)],
            env=self.env,
            cwd=self.tmp,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start_run(self, cfg: Path, ctx: Path, **env: str) -> subprocess.Popen[bytes]:
        """`det-local run CONFIG CONTEXT` left running (the caller waits for it or kills it)."""
        return subprocess.Popen(
            [sys.executable, "-m", "det_local.cli.main", "run", str(cfg), str(ctx)],
            env={**self.env, **env},
            cwd=self.tmp,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def json(self, *args: Any) -> Any:
        r = self.det(*args, "--json")
        assert r.returncode == 0, r
        return json.loads(r.stdout)

    def context(self, name: str, hparams: dict[str, Any], **config: Any) -> tuple[Path, Path]:
        ctx = self.tmp / name
        ctx.mkdir()
        (ctx / "train.py").write_text(SCRIPT)
        cfg = {
            "name": NAME,
            "labels": [LABEL, "digits"],
            "entrypoint": "python3 train.py",
            "hyperparameters": hparams,
            "searcher": {"name": "single", "metric": "val_loss", "max_length": 4},
            "max_restarts": 0,
            **config,
        }
        (ctx / "config.yaml").write_text(yaml.safe_dump(cfg))
        return ctx / "config.yaml", ctx


def make_world(tmp: Path, env: dict[str, str]) -> World:
    home = tmp / "home"
    env = {**env, "DET_LOCAL_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    for var in ("DET_LOCAL_SOCKET", "DET_LOCAL_TOKEN", "DET_LOCAL_INFO_DIR", "DET_LOCAL_DEBUG"):
        env.pop(var, None)
    return World(home, tmp, env)


def finished_experiment(world: World, batches: int = 3000) -> int:
    """Run one experiment to its end (embedded engine); returns its id."""
    cfg, ctx = world.context("exp", {"batches": batches, "lr": 0.1})
    r = world.det("run", cfg, ctx)
    assert r.returncode == 0, r
    return int(world.json("experiment", "list", "--all")[-1]["id"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TOKEN = "test-token-0123456789abcdef"  # what asgi_get sends and token_app() expects
TOKEN_RE = re.compile(r"\?token=([A-Za-z0-9_-]+)")


def token_app(**kw: Any) -> Any:
    """The dashboard's application, expecting TOKEN."""
    from det_local.web.app import create_app

    return create_app(token=TOKEN, **kw)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    base: str
    out: Path
    token: str = ""

    def get(
        self, path: str, headers: dict[str, str] | None = None, *, auth: bool = True
    ) -> tuple[int, bytes, Any]:
        """GET path; auth: with the token (Authorization: Bearer)."""
        sent = {**(bearer(self.token) if auth else {}), **(headers or {})}
        req = urllib.request.Request(self.base + path, headers=sent)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read(), r.headers
        except urllib.error.HTTPError as err:
            return err.code, err.read(), err.headers

    def json(self, path: str) -> Any:
        status, body, _ = self.get(path)
        assert status == 200, (path, status, body)
        return json.loads(body)

    def login_url(self, path: str = "/") -> str:
        return f"{self.base}{path}{'&' if '?' in path else '?'}token={self.token}"

    def open(self, page: Any, path: str = "/") -> None:
        """A browser page goes to `path` through the login address: the login page keeps the
        token (this origin's storage, its service worker) and opens the address without it."""
        page.goto(self.login_url(path))
        page.wait_for_url(lambda url: "token=" not in url, wait_until="load")
        assert page.url.startswith(self.base), page.url


def printed_token(out: Path) -> str:
    """The token in the address `det-local dashboard` printed first."""
    found = TOKEN_RE.search(out.read_text()) if out.exists() else None
    return found.group(1) if found else ""


def _start(world: World, args: tuple[str, ...]) -> Server | None:
    """`det-local dashboard ARGS` on a port free when chosen; None when another process took
    that port before the dashboard bound it (it exits with one line saying so)."""
    port = free_port()
    out = world.tmp / f"dashboard-{port}.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "det_local.cli.main", "dashboard", "--port", str(port), *args],
            env=world.env,
            cwd=world.tmp,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    # its address is printed once the port is bound and listening
    wait_for(
        lambda: printed_token(out) or proc.poll() is not None,
        timeout=30,
        what="the dashboard to listen",
    )
    if proc.poll() is None:
        return Server(proc, f"http://127.0.0.1:{port}", out, printed_token(out))
    assert "cannot listen on" in out.read_text(), out.read_text()
    return None


def serve(world: World, *args: str) -> Iterator[Server]:
    server = None
    for _attempt in range(5):
        server = _start(world, args)
        if server is not None:
            break
    assert server is not None, "no free port in 5 tries"
    try:
        yield server
    finally:
        server.proc.terminate()
        try:
            server.proc.wait(10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
        kill_home_processes(world.home)


def asgi_get(
    app: Any, path: str, headers: dict[str, str], *, auth: bool = True
) -> tuple[int, dict[str, str], bytes]:
    """One GET through the ASGI application in this process (no socket); auth: with TOKEN."""
    headers = {**({"authorization": f"Bearer {TOKEN}"} if auth else {}), **headers}
    path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "GET",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "scheme": "http",
        "server": ("10.1.2.3", 8080),
        "client": ("10.1.2.4", 5000),
        "root_path": "",
    }
    out: dict[str, Any] = {"body": b""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}
        else:
            out["body"] += message.get("body", b"")

    asyncio.run(app(scope, receive, send))
    return out["status"], out["headers"], out["body"]


def curl(user: str, url: str, *args: str) -> tuple[int, str]:
    """curl as `user` (its uid and group only): (HTTP status, body)."""
    pw = pwd.getpwnam(user)
    argv = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"]
    argv += ["curl", "-s", "-o", "-", "-w", "\n%{http_code}", *args, url]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/")
    body, _, status = r.stdout.rpartition("\n")
    assert status.isdigit(), r
    return int(status), body
