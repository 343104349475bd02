"""Another user's strings never drive a member's terminal (issue 34, item 6).

Bob (a real user, through the spool of a root daemon on a shared home) names, labels and
describes an experiment, its hyperparameters and searcher metric, a model and a command with
escape sequences: OSC 52 (writes the reader's clipboard), a title set, clear-screen, a C1 CSI,
DEL and U+202E (bidi override). Root and alice read them with every table and describe that
shows them, in a pipe and on a terminal (NO_COLOR: det-local's own colours are the only escapes
it may write): no ESC, no C1 control, no bidi control reaches stdout; each is shown visibly
(`\\x1b`, `<U+202E>`). `--json` is unchanged: the strings come back exactly as bob wrote them.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import pytest

# everything alice's child uses is imported before it drops root (it cannot read /root)
import det_local.cli.main
import det_local.cli.results.history
import det_local.cli.results.model
import det_local.sched.warm.starttimes
import det_local.textsafe
import det_local.trial.core
import det_local.views.cluster
import det_local.views.experiments  # noqa: F401
from det_local import api
from det_local.textsafe import BIDI
from det_local.trial.session import Session
from tests.support.tty import cli_on_pty
from tests.support.users import A, B, Shared, _submit_raw, cli_output, start_sleeping_trial
from tests.support.world import wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="multi-user tests create real users: they need root"
)

OSC52 = "\x1b]52;c;cm0gLXJmIH4K\x07"  # the clipboard: "rm -rf ~"
TITLE = "\x1b]0;pwned\x07"
CLEAR = "\x1b[2J\x1b[H"
EVIL = f"x{OSC52}{TITLE}{CLEAR}\x9b31m\x7f\u202egnp.exe"
MODEL_EVIL = "m\u202e\x9b31m\x7fgnp"  # a model name refuses C0 controls (ESC) already


def _dirty(text: str) -> list[str]:
    """What a terminal would act on in `text` (line breaks and tabs are layout)."""
    bad = {chr(c) for c in (*range(0x20), 0x7F, *range(0x80, 0xA0), *BIDI)} - {"\n", "\t"}
    return sorted({repr(ch) for ch in text if ch in bad})


def _in_pty(env: dict[str, str], *args: Any) -> str:
    """The CLI on a pseudo-terminal 200 wide (rich's layout), without colour."""
    env = {**env, "NO_COLOR": "1", "TERM": "xterm-256color"}
    env.pop("COLUMNS", None)
    return cli_on_pty(env, 200, *args, stderr=False)


def report_nan(env: dict[str, str], metric: str) -> Any:
    """As bob's trial: a validation of its searcher metric that is NaN (an event names it)."""
    session = Session(
        env["DET_LOCAL_SOCKET"],
        env["DET_LOCAL_TOKEN"],
        int(env["DET_TRIAL_ID"]),
        int(env["DET_TRIAL_RUN_ID"]),
    )
    session.report("validation", 1, {metric: float("nan")})
    return session.request("best_val", timeout=20)


def add_label(exp: int, label: str) -> str:
    return api.control(exp, "label_add", label=label)


def test_other_users_escapes_reach_no_terminal(shared: Shared) -> None:
    ctx = shared.out / "ctx"
    ctx.mkdir()
    os.chmod(ctx, 0o755)
    config = {
        "name": EVIL,
        "description": f"about {EVIL}",
        "labels": [EVIL],
        "entrypoint": "sh -c true",  # ends without the metric: an event names it
        "searcher": {"name": "single", "metric": f"loss{EVIL}", "max_length": 1},
        "hyperparameters": {f"hp{EVIL}": f"v{EVIL}"},
        "max_restarts": 0,
    }
    exp = int(shared.as_user(B, _submit_raw, config, str(ctx)))
    shared.as_user(B, add_label, exp, f"l2{EVIL}")
    with contextlib.closing(api.open_store(shared.paths)) as store:
        wait_for(lambda: store.get_experiment(exp).state.terminal, what="bob's experiment")
        trial = store.list_trials(exp)[0].id
    shared.as_user(
        B,
        api.control_job,
        "model_create",
        {"name": MODEL_EVIL, "description": f"d{EVIL}", "labels": [EVIL]},
    )
    job = shared.cmd(B, f"echo '{EVIL}'", name=f"n{EVIL}")
    shared.wait_job(job)
    # bob's trial reports his metric as NaN: the warning event names the metric
    sleeper = start_sleeping_trial(shared, B, "sleeper", {"metric": f"loss{EVIL}"})
    shared.as_user(B, report_nan, sleeper["env"], f"loss{EVIL}")
    shared.as_user(B, api.control, sleeper["exp"], "kill")

    dl = shared.dl
    views = [
        ("experiment", "list", "--all"),
        ("experiment", "describe", exp),
        ("experiment", "wait", exp),
        ("experiment", "events", sleeper["exp"]),
        ("trial", "list", exp),
        ("trial", "describe", trial),
        ("cmd", "list", "--all"),
        ("job", "list", "--all"),
        ("model", "list"),
        ("model", "describe", "1"),
    ]
    for args in views:
        r = dl.det(*args)  # root, in a pipe
        assert r.rc == 0, r
        assert not _dirty(r.out), (args, _dirty(r.out), r.out)
        out = _in_pty(dl.env, *args)  # root, on a terminal (rich's layout)
        assert not _dirty(out), (args, _dirty(out), out)
    # shown, visibly: what bob wrote is there to see
    described = dl.det("experiment", "describe", exp).out
    assert "\\x1b]52;c;cm0gLXJmIH4K\\x07" in described and "<U+202E>gnp.exe" in described
    assert "<U+202E>" in dl.det("model", "list").out
    assert "nx\\x1b]52;c;" in dl.det("cmd", "list", "--all").out
    events = dl.det("experiment", "events", sleeper["exp"]).out
    assert "loss" in events and "\\x1b" in events, events
    # alice, another member, sees the same in her own process
    for args in (["experiment", "list", "--all"], ["experiment", "describe", str(exp)]):
        out = shared.as_user(A, cli_output, args)
        assert str(exp) in out and not _dirty(out), (args, _dirty(out), out)

    # --json: unchanged, bob's strings exactly as written
    got = dl.json("experiment", "describe", exp)["experiment"]
    assert (got["name"], got["description"]) == (EVIL, f"about {EVIL}")
    assert set(got["labels"]) == {EVIL, f"l2{EVIL}"}
    listed = dl.json("experiment", "list", "--all")
    assert [e["name"] for e in listed] == [EVIL, "sleeper"]
    assert [m["name"] for m in dl.json("model", "list")] == [MODEL_EVIL]
    commands = dl.json("cmd", "list", "--all")
    assert json.dumps(commands).count("\\u001b]52;c;") >= 1
