"""What users do after (or during) a run: `trial kill` (one trial of a search; the searcher
goes on as Determined's does after a trial exited early), `experiment archive|unarchive|
delete`, `checkpoint delete` (sched/intake/lifecycle/runs.py); and the owner rules for all of them
and the registry, from the SDK as from the CLI."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from det_local.errors import DetLocalError
from det_local.store.states import State
from tests.support.trials.core import CORE, core_config
from tests.support.users import ADMIN, ADMIN_GROUP, A, B, Shared
from tests.support.world import Env, one_line_error, wait_for


def test_trial_kill_stops_one_trial_and_the_search_goes_on(dl: Env) -> None:
    """A grid of three trials on one slot (one runs at a time): trial 1 is killed while it
    runs, trial 2 while it waits in the queue; the searcher hears both as exited early and
    trial 3 still runs."""
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="1")
    gate = dl.tmp / "gate"
    cfg, ctx = dl.context(
        CORE,
        core_config(
            hyperparameters={
                "steps": 4, "best_at": 2, "gate": str(gate),
                "offset": {"type": "categorical", "vals": [0, 1, 2]},
            },
            searcher={"name": "grid", "metric": "val", "max_length": 4,
                      "max_concurrent_trials": 3},
        ),
    )  # fmt: skip
    assert dl.det("experiment", "create", cfg, ctx).rc == 0
    wait_for(lambda: len(dl.trials(1)) == 3 and dl.metrics(1), what="trial 1 running")
    r = dl.det("trial", "kill", "2")
    assert r.rc == 0 and r.out == "trial 2 killed\n", r
    assert dl.det("trial", "kill", "1").out == "trial 1 killed\n"
    wait_for(lambda: dl.trials(1)[0].state == State.CANCELED, what="trial 1 to stop")
    gate.touch()  # trial 3 runs through
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=60, what="the end")
    states = [t.state for t in dl.trials(1)]
    assert states == [State.CANCELED, State.CANCELED, State.COMPLETED], states
    assert "trial 1 killed by root" in dl.events(1)
    # the searcher heard both as exited early, USER_CANCELED (Determined's trialExitedEarly)
    snapshot = dl.store().get_searcher_state(1)
    assert snapshot is not None
    request_of = {trial: rid for rid, trial in snapshot["trial_of"].items()}
    canceled = snapshot["searcher"]["state"]["canceled"]
    assert sorted(canceled) == sorted([request_of[1], request_of[2]])
    one_line_error(dl.det("trial", "kill", "9"), "trial 9 not found")
    r = dl.det("trial", "kill", "3")
    assert r.rc == 0 and r.out == "trial 3 is already COMPLETED\n", r


@pytest.fixture
def gated(dl: Env) -> Any:
    gate = dl.tmp / "gate"
    gate.touch()
    cfg, ctx = dl.context(CORE, core_config(hyperparameters={"steps": 2, "best_at": 2}))
    assert dl.det("run", "-q", cfg, ctx).rc == 0
    return cfg, ctx


def test_archive_hides_an_experiment_from_the_list(dl: Env, gated: Any) -> None:
    r = dl.det("experiment", "archive", "1")
    assert r.out == "experiment 1 archived\n", r
    assert dl.json("experiment", "list", "--json") == []
    listed = dl.json("experiment", "list", "--archived", "--json")
    assert [(e["id"], e["archived"]) for e in listed] == [(1, True)]
    assert [e["id"] for e in dl.json("experiment", "list", "--all", "--json")] == [1]
    # the dashboard's list leaves it out too, and says so, with a link that shows it
    pytest.importorskip("starlette", reason="the dashboard needs the web extra")
    from tests.support.dashboard import asgi_get, token_app

    app, host = token_app(), {"host": "127.0.0.1:8080"}
    status, _, body = asgi_get(app, "/", host)
    assert status == 200 and b'href="/experiments/1"' not in body, body
    assert b"0 of 0 experiments; 1 archived not shown (" in body
    assert b'<a href="/?archived=1">show them</a>' in body
    status, _, body = asgi_get(app, "/?archived=1", host)
    assert status == 200 and b'href="/experiments/1"' in body
    assert dl.det("experiment", "unarchive", "1").out == "experiment 1 unarchived\n"
    assert [(e["id"], e["archived"]) for e in dl.json("experiment", "list", "--json")] == [
        (1, False)
    ]


def test_delete_asks_first_and_checkpoint_delete(dl: Env, gated: Any) -> None:
    ckpt = dl.checkpoints(1)[0]
    r = dl.det("experiment", "delete", "1")  # nobody answers: nothing is deleted
    assert r.rc == 1 and "aborted; nothing was deleted" in r.out, r
    assert dl.experiment(1).state == State.COMPLETED
    one_line_error(dl.det("experiment", "delete", "7", "--yes"), "experiment 7 not found")
    one_line_error(dl.det("checkpoint", "delete", "nope", "--yes"), "checkpoint nope not found")
    r = dl.det("checkpoint", "delete", ckpt.uuid, "--yes")
    assert r.out == "deleted 1 checkpoint\n", r
    assert str(dl.checkpoints(1)[0].state) == "DELETED" and not os.path.exists(ckpt.path)
    r = dl.det("experiment", "delete", "1", "--yes")
    assert r.out == "experiment 1 deleted\n", r
    assert dl.json("experiment", "list", "--all", "--json") == []
    assert not dl.paths.experiment_dir(1).exists()


def test_running_experiments_refuse_deletion_and_archiving(dl: Env) -> None:
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="1")
    gate = dl.tmp / "gate"
    cfg, ctx = dl.context(
        CORE,
        core_config(hyperparameters={"steps": 4, "best_at": 2, "gate": str(gate), "gate_at": 2}),
    )
    assert dl.det("experiment", "create", cfg, ctx).rc == 0
    first = wait_for(lambda: dl.checkpoints(1), what="a checkpoint")[0]
    one_line_error(
        dl.det("experiment", "delete", "1", "--yes"),
        "experiment 1 is ACTIVE; it cannot be deleted while it runs or is paused "
        "(`det-local experiment kill 1` first)",
    )
    one_line_error(
        dl.det("experiment", "archive", "1"),
        "experiment 1 is ACTIVE; only ended experiments can be archived",
    )
    one_line_error(
        dl.det("checkpoint", "delete", first.uuid, "--yes"),
        f"checkpoint {first.uuid}: its experiment 1 is ACTIVE; checkpoints of running or "
        "paused experiments cannot be deleted",
    )
    gate.touch()


# ---------------------------------------------------------------------------- owner rules
pytestmark_mu = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="multi-user tests create real users: they need root and useradd",
)


def _denied(exc: pytest.ExceptionInfo[DetLocalError], what: str, owner: str) -> None:
    msg = str(exc.value)
    assert msg.startswith(f"permission denied: {what} belongs to {owner}"), msg
    assert f"member of the {ADMIN_GROUP} group" in msg, msg


@pytestmark_mu
def test_sdk_keeps_the_owner_rules(shared: Shared) -> None:
    """Another Unix user cannot kill, pause, archive or delete someone else's experiment, kill
    its trial, nor change their model, through the SDK: the engine refuses, naming the owner."""
    import datetime  # noqa: F401  (what the SDK imports lazily: the users cannot read /root)

    import det_local.sched.run.launchplan
    import det_local.sched.run.userfiles
    import det_local.sdk.submit  # noqa: F401
    from det_local.sdk import client

    mine = client.Determined(home=shared.home)  # this process's view (root)
    ctx = shared.out / "ctx"
    ctx.mkdir()
    os.chmod(ctx, 0o755)
    config = {
        "name": "a-exp",
        "entrypoint": "sleep 1000",
        "max_restarts": 0,
        "searcher": {"name": "single", "metric": "loss", "max_length": 1},
    }

    def create() -> int:
        return int(client.create_experiment(config, model_dir=str(ctx)).id)

    assert shared.as_user(A, create) == 1
    wait_for(lambda: shared.job(1).state == "SCHEDULED", what="A's trial to start")

    def act(what: str) -> str:
        exp = client.get_experiment(1)
        {
            "kill": exp.kill,
            "pause": exp.pause,
            "archive": exp.archive,
            "delete": exp.delete,
            "trial": client.get_trial(1).kill,
        }[what]()
        return "done"

    for what in ("kill", "pause", "archive", "delete"):
        with pytest.raises(DetLocalError) as exc:
            shared.as_user(B, act, what)
        _denied(exc, "experiment 1", A)
    with pytest.raises(DetLocalError) as exc:
        shared.as_user(B, act, "trial")
    _denied(exc, "trial 1 (experiment 1)", A)
    assert shared.job(1).state == "SCHEDULED"

    # models: anyone creates one; only its owner (or an admin) changes it
    def make_model() -> str:
        return str(client.create_model("a-model", description="A's").username)

    assert shared.as_user(A, make_model) == A

    def touch_model(what: str) -> str:
        model = client.get_model("a-model")
        if what == "describe":
            model.set_description("B was here")
        else:
            model.delete()
        return "done"

    for what in ("describe", "delete"):
        with pytest.raises(DetLocalError) as exc:
            shared.as_user(B, touch_model, what)
        _denied(exc, "model 'a-model'", A)
    assert shared.as_user(ADMIN, touch_model, "describe") == "done"

    # the owner kills it; B still cannot delete it; the owner archives and deletes it
    assert shared.as_user(A, act, "kill") == "done"
    canceled = client.ExperimentState.CANCELED
    wait_for(lambda: mine.get_experiment(1).state == canceled, what="the kill")
    with pytest.raises(DetLocalError) as exc:
        shared.as_user(B, act, "delete")
    _denied(exc, "experiment 1", A)
    assert shared.as_user(A, act, "archive") == "done"
    assert shared.as_user(A, act, "delete") == "done"
    with pytest.raises(DetLocalError, match="^experiment 1 not found"):
        mine.get_experiment(1)
