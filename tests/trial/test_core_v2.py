"""`determined.experimental.core_v2`: a plain `python train.py` (no `det-local run`) records an
experiment and its trial in the local store, through the daemon when one runs, else through an
engine in the script's own process; `experiment list` and `trial describe` show them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import det_local.trial.session  # noqa: F401
import det_local.wire.rpc  # noqa: F401  (imported before the system-mode children drop root)
from det_local.sched.enginelock import lock_free
from det_local.store.states import State
from tests.support.paths import COMPAT, REPO
from tests.support.users import A, B, Shared
from tests.support.world import Env, gone, wait_for

# Written the way Determined's unmanaged examples are: a Config, the singletons, close().
SCRIPT = """\
import os
import pathlib
import sys

from determined.experimental import core_v2


def main():
    core_v2.init(
        config=core_v2.Config(
            name="unmanaged-mnist",
            hparams={"lr": 0.01, "layers": {"hidden": 64}},
            labels=["notebook"],
            description="logged from a plain python process",
            searcher={"name": "single", "metric": "loss", "smaller_is_better": True},
        )
    )
    print("token", core_v2.train._session.token, flush=True)
    print("ids", core_v2.info.trial.experiment_id, core_v2.info.trial.trial_id, flush=True)
    tb = pathlib.Path(core_v2.train.get_tensorboard_path())
    tb.mkdir(parents=True, exist_ok=True)
    (tb / "events.out").write_text("tb")
    loss = 1.0
    for step in range(1, 6):
        loss *= 0.5
        core_v2.train.report_training_metrics(steps_completed=step, metrics={"loss": loss})
        if step == 3:
            core_v2.train.report_validation_metrics(steps_completed=step, metrics={"loss": loss})
            with core_v2.checkpoint.store_path({"steps_completed": step}) as (path, uuid):
                (path / "weights").write_text(str(loss))
    gate = os.environ.get("GATE")
    if gate:  # wait, live, until the test has looked
        pathlib.Path(gate + ".ready").touch()
        while not pathlib.Path(gate).exists():
            pass
    how = os.environ.get("END", "close")
    if how == "raise":
        raise RuntimeError("diverged at step 5")
    if how == "exit3":
        sys.exit(3)
    if how == "close":
        core_v2.close()
        print("closed", flush=True)
    # "none": the process just exits; Determined ends the trial at exit (COMPLETED)


if __name__ == "__main__":
    main()
"""


def _python(dl: Env, script: Path, **env: str) -> subprocess.Popen[str]:
    full = dict(dl.env, PYTHONPATH=os.pathsep.join([str(COMPAT), str(REPO)]), **env)
    return subprocess.Popen(
        [sys.executable, str(script)],
        cwd=script.parent,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run(dl: Env, script: Path, **env: str) -> tuple[int, str, str]:
    proc = _python(dl, script, **env)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def _script(dl: Env, text: str = SCRIPT, name: str = "train.py") -> Path:
    ctx = dl.tmp / "notebook"
    ctx.mkdir(exist_ok=True)
    path = ctx / name
    path.write_text(text)
    return path


def _token(out: str) -> str:
    return next(line.split()[1] for line in out.splitlines() if line.startswith("token "))


def _assert_recorded(dl: Env, exp_id: int, state: str) -> dict[str, Any]:
    listed = {e["id"]: e for e in dl.json("experiment", "list", "--all")}
    exp = listed[exp_id]
    assert exp["name"] == "unmanaged-mnist" and exp["labels"] == ["notebook"]
    assert exp["state"] == state, exp
    trial = dl.trial(exp_id)
    described = dl.json("trial", "describe", trial.id)
    assert described["trial"]["hparams"] == {"lr": 0.01, "layers": {"hidden": 64}}
    assert described["trial"]["state"] == state
    assert [m.steps_completed for m in dl.metrics(trial.id, "training")] == [1, 2, 3, 4, 5]
    assert described["metrics"]["validation"]["metrics"] == {"loss": 0.125}
    assert trial.best_validation == 0.125  # the searcher metric of its Config
    (ckpt,) = described["checkpoints"]
    assert ckpt["steps_completed"] == 3 and Path(ckpt["path"], "weights").read_text() == "0.125"
    info = dl.paths.trial_info_dir(exp_id, trial.id, 1)
    assert (info / "tensorboard" / "events.out").read_text() == "tb"
    assert not dl.paths.unmanaged_token(trial.id, 1).exists()  # removed once it connected
    return described


def _assert_token_kept_secret(dl: Env, token: str) -> None:
    """The session token is in no file every user can read: not in the store (request results
    are kept there), not in the spool's answers, not in the run's info files."""
    assert len(token) == 64
    for path in [dl.paths.db, *dl.home.rglob("*")]:
        if path.is_file() and not path.name.endswith(".token"):
            assert token.encode() not in path.read_bytes(), path


def test_plain_python_without_a_daemon_records_an_experiment(dl: Env) -> None:
    rc, out, err = _run(dl, _script(dl))
    assert rc == 0, out + err
    assert "closed" in out and "Traceback" not in err
    exp_id = int(out.split("ids ")[1].split()[0])
    _assert_recorded(dl, exp_id, "COMPLETED")
    exp = dl.experiment(exp_id)
    assert exp.config["entrypoint"].endswith("train.py")
    assert exp.description == "logged from a plain python process"
    _assert_token_kept_secret(dl, _token(out))
    assert lock_free(dl.paths)  # its engine stopped with it
    assert dl.jobs() == []  # nothing was scheduled for it
    assert "unmanaged trial 1" in " ".join(dl.events(exp_id))


def test_plain_python_with_a_daemon_reports_through_it(dl: Env) -> None:
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="0")
    gate = dl.tmp / "gate"
    proc = _python(dl, _script(dl), GATE=str(gate))
    wait_for(lambda: Path(str(gate) + ".ready").exists() or proc.poll() is not None)
    assert proc.poll() is None, proc.communicate()
    # live: the daemon shows it ACTIVE, with what was reported so far (sent in the background)
    assert dl.json("experiment", "list")[0]["state"] == "ACTIVE"
    wait_for(lambda: dl.trial(1).steps_completed == 5, what="the reports to arrive")
    assert dl.trial(1).state == State.ACTIVE
    # det-local did not start it, so it cannot pause or kill it: it says which process to stop
    for action in ("pause", "kill"):
        r = dl.det("experiment", action, 1)
        assert r.rc == 1 and "Traceback" not in r.err, r
        assert r.err.strip() == (
            f"error: experiment 1 is unmanaged: its trial is reported by a process det-local "
            f"did not start (pid {proc.pid}), so it cannot {action} it; stop that process "
            "instead (its trial then ends)"
        )
    assert dl.trial(1).state == State.ACTIVE
    gate.touch()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    _assert_recorded(dl, 1, "COMPLETED")
    _assert_token_kept_secret(dl, _token(out))
    assert "unmanaged trial 1" in dl.paths.run_dir.joinpath("daemon.log").read_text()
    assert "det-local:" not in err  # the daemon recorded it; no engine ran in the script


def test_an_exception_or_exit_code_ends_it_error(dl: Env) -> None:
    script = _script(dl)
    rc, out, err = _run(dl, script, END="raise")
    assert rc == 1 and "RuntimeError: diverged at step 5" in err
    t1 = dl.trial(1)
    assert t1.state == State.ERROR
    line = SCRIPT.splitlines().index('        raise RuntimeError("diverged at step 5")') + 1
    assert t1.message == f"the script raised RuntimeError at train.py:{line}: diverged at step 5"
    assert dl.experiment(1).state == State.ERROR
    rc, out, err = _run(dl, script, END="exit3")
    assert rc == 3
    assert (dl.trial(2).state, dl.trial(2).message) == (
        State.ERROR,
        "the script exited with code 3",
    )
    # no close(): a normal exit ends it COMPLETED (Determined's atexit rule)
    rc, out, err = _run(dl, script, END="none")
    assert rc == 0, err
    _assert_recorded(dl, 3, "COMPLETED")


def test_a_killed_process_ends_it_error(dl: Env) -> None:
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="0")
    gate = dl.tmp / "gate"
    proc = _python(dl, _script(dl), GATE=str(gate))
    wait_for(lambda: Path(str(gate) + ".ready").exists() or proc.poll() is not None)
    wait_for(lambda: dl.trial(1).steps_completed == 5, what="the reports to arrive")
    proc.kill()
    proc.communicate()
    wait_for(lambda: dl.trial(1).state == State.ERROR, what="the trial to end ERROR")
    assert "went away without ending it (killed?)" in (dl.trial(1).message or "")
    assert dl.experiment(1).state == State.ERROR
    assert len(dl.metrics(dl.trial(1).id, "training")) == 5  # what it reported is kept


def test_an_engine_that_died_with_its_script_settles_it_at_the_next_start(dl: Env) -> None:
    """No daemon: the engine lives in the script. kill -9 takes both; the next engine marks
    the experiment ERROR and starts nothing for it (there is nothing of det-local's to run)."""
    gate = dl.tmp / "gate"
    proc = _python(dl, _script(dl), GATE=str(gate))
    wait_for(lambda: Path(str(gate) + ".ready").exists() or proc.poll() is not None)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    wait_for(lambda: gone(proc.pid))
    assert dl.trial(1).state == State.ACTIVE
    rc, out, err = _run(dl, _script(dl))  # the next run starts an engine: it settles the first
    assert rc == 0, out + err
    t1 = dl.trial(1)
    assert t1.state == State.ERROR and t1.run_id == 1
    assert "the det-local engine stopped while unmanaged trial 1 was reporting" in (
        t1.message or ""
    )
    assert dl.experiment(1).state == State.ERROR
    assert dl.jobs() == []
    assert dl.experiment(2).state == State.COMPLETED


OLD_SPELLING = """\
import warnings
from determined.experimental import core_v2

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ctx = core_v2.init_context(
        defaults=core_v2.DefaultConfig(name="old-spelling", hparams={"x": 1}),
        unmanaged=core_v2.UnmanagedConfig(external_experiment_id=None),
    )
print("warned", sorted({w.category.__name__ for w in caught}))
with ctx as core_context:
    for op in core_context.searcher.operations():
        core_context.train.report_training_metrics(steps_completed=1, metrics={"x": 1.0})
        op.report_completed(1.0)
        break
print("length", op.length)
"""


def test_the_older_spellings_and_the_context_manager(dl: Env) -> None:
    rc, out, err = _run(dl, _script(dl, OLD_SPELLING, "old.py"))
    assert rc == 0, out + err
    assert "warned ['FutureWarning']" in out
    assert "length 100000000" in out  # Determined's default searcher for unmanaged runs
    exp = dl.json("experiment", "list", "--all")[0]
    assert (exp["name"], exp["state"]) == ("old-spelling", "COMPLETED")
    assert dl.trial(1).hparams == {"x": 1}


MANAGED = """\
from determined.experimental import core_v2

core_v2.init(config=core_v2.Config(name="ignored when managed"))
core_v2.train.report_training_metrics(steps_completed=1, metrics={"loss": 0.5})
core_v2.train.report_validation_metrics(steps_completed=1, metrics={"loss": 0.25})
core_v2.close()
"""


def test_under_det_local_run_it_is_the_managed_trial(dl: Env) -> None:
    cfg, ctx = dl.context(MANAGED, {"name": "managed"})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    assert [e["name"] for e in dl.json("experiment", "list", "--all")] == ["managed"]
    assert dl.trial(1).best_validation == 0.25


def test_a_search_in_the_config_records_only_this_trial(dl: Env) -> None:
    """Determined runs no search for unmanaged runs: a searcher other than single is recorded
    as single (its metric kept), and det-local never starts a trial of its own for it."""
    search = SCRIPT.replace(
        '{"name": "single", "metric": "loss", "smaller_is_better": True}',
        '{"name": "random", "metric": "loss", "max_trials": 3, "max_length": 5}',
    )
    rc, out, err = _run(dl, _script(dl, search))
    assert rc == 0, out + err
    assert dl.experiment(1).config["searcher"]["name"] == "single"
    assert len(dl.trials(1)) == 1 and dl.trial(1).best_validation == 0.125
    assert dl.jobs() == [] and dl.experiment(1).state == State.COMPLETED


def test_a_config_det_local_cannot_record_is_one_line(dl: Env) -> None:
    bad = SCRIPT.replace(
        'labels=["notebook"],', 'labels=["notebook"], checkpoint_storage="s3://b/p",'
    )
    rc, out, err = _run(dl, _script(dl, bad))
    assert rc == 1
    assert "checkpoint_storage 's3://b/p': det-local stores checkpoints on local or shared " in err
    bad = SCRIPT.replace(
        'labels=["notebook"],',
        'labels=["notebook"], checkpoint_storage={"type": "shared_fs", "host_pth": "/x"},',
    )
    rc, out, err = _run(dl, _script(dl, bad, "bad2.py"))
    assert rc == 1
    assert "host_pth" in err and "core_v2.Config" in err
    assert json.loads(dl.det("experiment", "list", "--all", "--json").out) == []


# ---------------------------------------------------------------------------- system mode
def _ask(payload: dict[str, Any]) -> Any:
    from det_local import api
    from det_local.client.requester import remote_request

    return remote_request(api.paths(), "unmanaged", payload)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except PermissionError as err:
        return f"denied: {err.strerror}"


def _hello(answer: dict[str, Any], token: str) -> str:
    import socket

    from det_local.wire import rpc

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(answer["socket"])
        rpc.send(
            sock,
            {"t": "hello", "unmanaged": True, "token": token, "trial_id": answer["trial_id"]},
        )
        reply = rpc.recv(sock) or {}
    return str(reply.get("error") or "accepted")


def _report_and_end(answer: dict[str, Any], token: str) -> str:
    from det_local.trial.session import Session

    session = Session(
        answer["socket"], token, answer["trial_id"], answer["run_id"], hello={"unmanaged": True}
    )
    session.report("training", 1, {"loss": 0.5})
    session.request("unmanaged_end", state="COMPLETED", message=None)
    session.close()
    return "ended"


def test_system_mode_the_token_is_the_requesters_alone(shared: Shared) -> None:  # noqa: F811
    """A root daemon: user A's unmanaged run gets its token in a 0600 file of A's, never in
    the (world-readable) answer; B cannot read the file, and a connection from B is refused
    even with A's token (SO_PEERCRED); A's own process reports and ends the trial."""
    import pwd

    payload = {
        "config": {"name": "a-notebook", "searcher": {"name": "single", "metric": "loss"}},
        "argv": ["python3", "nb.py"],
        "cwd": str(shared.out),
    }
    answer = shared.as_user(A, _ask, payload)
    token_file = Path(answer["token_file"])
    st = token_file.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (pwd.getpwnam(A).pw_uid, 0o600)
    token = token_file.read_text()
    assert len(token) == 64 and token not in json.dumps(answer)
    assert shared.as_user(B, _read, str(token_file)) == "denied: Permission denied"
    # a stolen token is not enough: the peer must be A
    assert shared.as_user(B, _hello, answer, token) == "this trial belongs to another user"
    assert shared.as_user(A, _hello, answer, "0" * 64) == "unknown trial or wrong token"
    log = shared.paths.run_dir.joinpath("daemon.log").read_text()
    assert (
        f"refused a connection for unmanaged trial {answer['trial_id']} from uid "
        f"{pwd.getpwnam(B).pw_uid}" in log
    )
    dl = shared.dl
    assert dl.trial(answer["experiment_id"]).state == State.ACTIVE  # B changed nothing
    assert shared.as_user(A, _report_and_end, answer, token) == "ended"
    wait_for(lambda: dl.trial(answer["experiment_id"]).state == State.COMPLETED)
    exp = dl.experiment(answer["experiment_id"])
    assert (exp.user, exp.state) == (A, State.COMPLETED)
    assert [m.steps_completed for m in dl.metrics(answer["trial_id"])] == [1]
    assert not token_file.exists()
    _assert_token_kept_secret(dl, token)
