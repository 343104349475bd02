"""The dashboard started by the daemon (daemon.yaml's `dashboard:`, det_local/web/supervisor.py):
served on its port by its own process, run as an unprivileged user when the daemon is root,
restarted after kill -9, stopped with the daemon, gone when the daemon is killed; bad settings
are one-line errors naming the field."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from det_local.errors import ConfigError
from det_local.web.supervisor import load_dashboard_settings
from tests.support.dashboard import free_port
from tests.support.world import Env, gone, one_line_error, wait_for

pytest.importorskip("uvicorn")


@pytest.fixture
def reachable(dl: Env) -> Iterator[Env]:
    """`dl` with its home where an unprivileged user can read it (the dashboard runs as one
    when the daemon is root; pytest's own directories are root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="det-local-dash-", dir="/tmp"))
    os.chmod(base, 0o755)
    dl.home = base / "home"
    dl.env["DET_LOCAL_HOME"] = str(dl.home)
    dl.setenv(DET_LOCAL_CPU_SLOTS="1", DET_LOCAL_CGROUPS="off", DET_LOCAL_MDNS="0")
    try:
        yield dl
    finally:
        from tests.support.world import kill_home_processes

        kill_home_processes(dl.home)
        shutil.rmtree(base, ignore_errors=True)


def token(dl: Env) -> str:
    """The access token the daemon wrote for its dashboard (made again at each start)."""
    try:
        return (dl.paths.run_dir / "dashboard.token").read_text().strip()
    except FileNotFoundError:
        return ""


def get(dl: Env, port: int, path: str, *, auth: bool = True) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token(dl)}"} if auth else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except (urllib.error.URLError, ConnectionError, OSError):
        return 0, None


def dashboards(daemon_pid: int) -> list[psutil.Process]:
    out = []
    for child in psutil.Process(daemon_pid).children():
        try:
            if "dashboard" in child.cmdline():
                out.append(child)
        except psutil.Error:
            continue
    return out


def serving(dl: Env, port: int) -> bool:
    return get(dl, port, "/api/experiments")[0] == 200


def _dashboard(dl: Env, port: int) -> str | None:
    """ "up" (serving), "taken" (its port was taken: its log says so), or None yet."""
    if serving(dl, port):
        return "up"
    log = dl.paths.dashboard_log
    if log.exists() and f"cannot listen on 127.0.0.1:{port}:" in log.read_text():
        return "taken"
    return None


def daemon_with_dashboard(dl: Env) -> tuple[int, int]:
    """A daemon serving its dashboard on a port free when chosen: (its pid, the port).
    Another process may take that port before the dashboard binds it: the daemon is then
    started again on another."""
    for _attempt in range(5):
        port = free_port()
        pid = dl.daemon_start({"dashboard": {"port": port}})
        state = wait_for(
            lambda port=port: _dashboard(dl, port),
            timeout=30,
            what="the daemon's dashboard to serve",
        )
        if state == "up":
            return pid, port
        assert dl.det("daemon", "stop").rc == 0
    raise AssertionError("no free port in 5 tries")


def test_daemon_runs_restarts_and_stops_its_dashboard(reachable: Env) -> None:
    dl = reachable
    pid, port = daemon_with_dashboard(dl)
    assert get(dl, port, "/api/experiments") == (200, [])
    (child,) = dashboards(pid)
    if os.geteuid() == 0:  # a root daemon's dashboard is never root
        assert child.uids().effective == pwd.getpwnam("nobody").pw_uid
        assert get(dl, port, "/api/slots")[0] == 200  # what it reads through the spool, as nobody
    log = dl.paths.dashboard_log
    assert "dashboard of" in log.read_text() and oct(log.stat().st_mode & 0o777) == "0o600"
    # every request needs the token the daemon wrote: every user may read it under a root
    # daemon (its dashboard shows only what every user may read), else only the daemon's user
    first = token(dl)
    assert len(first) >= 30 and first not in log.read_text()
    tok = dl.paths.run_dir / "dashboard.token"
    assert oct(tok.stat().st_mode & 0o777) == ("0o644" if os.geteuid() == 0 else "0o600")
    status, body = get(dl, port, "/api/experiments", auth=False)
    assert status == 401 and body["error"] == (
        "this dashboard needs its access token (no access token): run `det-local dashboard "
        "--url` on this machine and open the address it prints (it ends ?token=...)"
    )
    r = dl.det("dashboard", "--url")
    assert r.rc == 0 and r.out.strip() == f"http://127.0.0.1:{port}/?token={first}", r

    os.kill(child.pid, signal.SIGKILL)
    wait_for(lambda: gone(child.pid), what="the dashboard to die")
    wait_for(
        lambda: serving(dl, port) and [p.pid for p in dashboards(pid)] not in ([], [child.pid]),
        timeout=30,
        what="the dashboard to be restarted",
    )
    (again,) = dashboards(pid)
    assert token(dl) != first  # a fresh token at each start

    r = dl.det("daemon", "stop")
    assert r.rc == 0, r
    wait_for(lambda: gone(again.pid), what="the dashboard to stop with the daemon")
    assert not serving(dl, port)
    assert not tok.exists()
    r = dl.det("dashboard", "--url")
    assert r.rc == 1 and "is the daemon of" in r.err and "daemon status" in r.err, r


def test_dashboard_ends_when_the_daemon_is_killed(reachable: Env) -> None:
    dl = reachable
    pid, port = daemon_with_dashboard(dl)
    (child,) = dashboards(pid)
    dl.kill_daemon()  # kill -9: no stop() runs; the pipe's end closes with the process
    wait_for(lambda: gone(child.pid), what="the orphaned dashboard to exit")


@pytest.mark.parametrize(
    ("section", "fragments"),
    [
        ({"port": "web"}, ["dashboard.port", "1-65535", "'web'"]),
        ({"port": 0}, ["dashboard.port", "1-65535"]),
        ({"port": 70000}, ["dashboard.port", "1-65535"]),
        ({"prot": 8080}, ["dashboard.prot", "did you mean 'port'"]),
        ({"host": ""}, ["dashboard.host", "an address"]),
        ({"enabled": "yes"}, ["dashboard.enabled", "true or false"]),
        ("on", ["dashboard in", "expected a mapping"]),
        ({"user": "root"}, ["dashboard.user", "must not run as root"]),
        ({"user": "no-such-user-dlx"}, ["dashboard.user", "no user 'no-such-user-dlx'"]),
    ],
)
def test_bad_dashboard_settings(tmp_path: Path, section: Any, fragments: list[str]) -> None:
    if "user" in str(section) and os.geteuid() != 0:
        pytest.skip("the user is checked only where the daemon is root")
    path = tmp_path / "daemon.yaml"
    path.write_text(json.dumps({"dashboard": section}))
    with pytest.raises(ConfigError) as err:
        load_dashboard_settings(path)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg
    for f in fragments:
        assert f in msg, msg


def test_dashboard_settings_defaults(tmp_path: Path) -> None:
    path = tmp_path / "daemon.yaml"
    assert not load_dashboard_settings(path).enabled  # no file: off
    path.write_text("scheduler: {mode: priority}\n")
    assert not load_dashboard_settings(path).enabled  # no section: off
    path.write_text("dashboard: {port: 9000}\n")
    s = load_dashboard_settings(path)
    assert (s.enabled, s.host, s.port, s.user) == (True, "127.0.0.1", 9000, "nobody")
    path.write_text("dashboard: {port: 9000, enabled: false}\n")
    assert not load_dashboard_settings(path).enabled


def test_daemon_refuses_a_bad_dashboard_section(dl: Env) -> None:
    dl.settings({"dashboard": {"port": -1}})
    r = dl.det("daemon")  # in the foreground: the error, and no daemon
    one_line_error(r, "dashboard.port", "1-65535")
    assert dl.daemon_pid() is None


@pytest.mark.skipif(os.geteuid() != 0, reason="real Unix users need root")
def test_every_user_logs_in_and_sees_what_every_user_may_read(
    reachable: Env, accounts: None
) -> None:
    """The design (docs/system-mode.md, "Dashboard"): a root daemon's dashboard runs as nobody;
    its token is in run/dashboard.token, which every user may read; with it, any user sees what
    every user may read, and nobody's private log, not even its owner's."""
    import json as _json

    from tests.support.dashboard import curl
    from tests.support.users import A, B

    dl = reachable
    ids = {}
    for name, line in (("open", "a line every user may read"), ("private", "a private line")):
        cfg, ctx = dl.context(f"print({line!r}, flush=True)", name=name)
        r = dl.det("run", cfg, ctx)  # no daemon yet: embedded, as root
        assert r.rc == 0, r
        exp = int(dl.json("experiment", "list", "--all")[-1]["id"])
        ids[name] = (exp, int(dl.json("trial", "list", exp)[0]["id"]))
    private = dl.paths.trial_log(*ids["private"])
    pw = pwd.getpwnam(A)
    os.chown(private, pw.pw_uid, pw.pw_gid)
    os.chmod(private, 0o600)

    _pid, port = daemon_with_dashboard(dl)
    base = f"http://127.0.0.1:{port}"
    status, body = curl(B, f"{base}/api/experiments")
    assert status == 401 and "det-local dashboard --url" in _json.loads(body)["error"]
    # B reads the token from the file (as `det-local dashboard --url` does) and logs in
    pwb = pwd.getpwnam(B)
    cat = ["setpriv", f"--reuid={pwb.pw_uid}", f"--regid={pwb.pw_gid}", "--clear-groups", "cat"]
    r = subprocess.run([*cat, str(dl.paths.run_dir / "dashboard.token")], capture_output=True)
    assert r.returncode == 0, r
    auth = ("-H", f"Authorization: Bearer {r.stdout.decode().strip()}")
    status, body = curl(B, f"{base}/api/experiments", *auth)
    assert status == 200 and len(_json.loads(body)) == 2
    status, body = curl(B, f"{base}/api/trials/{ids['open'][1]}/logs", *auth)
    assert status == 200 and "a line every user may read" in _json.loads(body)["lines"]
    for user in (B, A):  # nobody's view: A's private log is not shown, not even to A
        status, body = curl(user, f"{base}/api/trials/{ids['private'][1]}/logs", *auth)
        assert status == 403, body
        assert _json.loads(body)["error"].startswith(f"permission denied: cannot read {private}")


SQUAT = (  # listen on argv[1] of 127.0.0.1 until killed
    "import socket, sys, time\n"
    "s = socket.socket()\n"
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1])))\n"
    "s.listen()\n"
    "time.sleep(600)\n"
)


@pytest.mark.skipif(os.geteuid() != 0, reason="real Unix users need root")
def test_a_squatted_port_names_its_holder(reachable: Env, accounts: None) -> None:
    """Another user holds the dashboard's port (as while it restarts, issue 34): the daemon's
    log line names the holder (pid, user, command) and what to do, `dashboard --url` will
    not hand the login address to it, and once it is gone the dashboard serves again."""
    from tests.support.users import B

    dl = reachable
    port = free_port()
    pw = pwd.getpwnam(B)
    argv = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"]
    squat = subprocess.Popen([*argv, "/usr/bin/python3", "-c", SQUAT, str(port)], cwd="/")
    try:
        from det_local.web.portholder import listeners

        wait_for(lambda: listeners(port), what="B to hold the port")
        dl.daemon_start({"dashboard": {"port": port}})
        log = dl.home / "run" / "daemon.log"
        want = f"the dashboard cannot listen on 127.0.0.1:{port}: pid {squat.pid} of user {B} "

        def line() -> str | None:
            found = [x for x in log.read_text().splitlines() if want in x] if log.exists() else []
            return found[0] if found else None

        said = wait_for(line, timeout=30, what="the daemon to name the port's holder")
        assert "(/usr/bin/python3 -c import socket, sys, time?s = socket.socket()" in said
        assert "holds it; stop that process (or set dashboard.port in " in said, said
        assert "and restart the daemon); retrying in " in said, said
        # the dashboard's own one-line error (its log; `det-local dashboard` at a terminal)
        child = dl.paths.dashboard_log.read_text()
        assert f"Address already in use (pid {squat.pid} of user {B} (" in child, child
        r = dl.det("dashboard", "--url")
        assert r.rc == 1 and "?token=" not in r.out + r.err, r
        one_line_error(r, f"port 127.0.0.1:{port} is held by pid {squat.pid} of user {B}")
        assert "login address is not printed" in r.err, r
    finally:
        squat.kill()
        squat.wait()
    wait_for(lambda: serving(dl, port), timeout=60, what="the dashboard to serve once freed")
    r = dl.det("dashboard", "--url")
    assert r.rc == 0 and r.out.strip() == f"http://127.0.0.1:{port}/?token={token(dl)}", r


def test_port_holders_from_proc() -> None:
    """web/portholder.py reads /proc/net/tcp and tcp6 (addresses in the kernel's word order)
    and finds the process by its descriptors; only a socket a browser may reach at host:port
    counts against the daemon's dashboard."""
    import socket

    from det_local.web.portholder import held_by, holders

    v4 = socket.socket()
    v4.bind(("127.0.0.1", 0))
    v4.listen()
    port = v4.getsockname()[1]
    v6 = socket.socket(socket.AF_INET6)
    try:
        v6.bind(("::1", port))
        v6.listen()
        found = holders(port, "::1")
        assert [h.listener.address for h in found] == ["::1", "127.0.0.1"], found
        assert {h.pid for h in found} == {os.getpid()}
        assert all("python" in h.command and "\n" not in h.command for h in found)
        assert [h.collides("127.0.0.1") for h in found] == [False, True]
        assert all(h.collides("0.0.0.0") and h.collides("localhost") for h in found)
        me = pwd.getpwuid(os.getuid()).pw_name
        assert held_by(port, "127.0.0.1").startswith(f"pid {os.getpid()} of user {me} (")
        assert held_by(port, "127.0.0.1").endswith(" and 1 more holds it")
    finally:
        v6.close()
        v4.close()
    assert held_by(port) == ""
