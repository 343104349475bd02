"""What a new user met (issue 34, "tried as a new user would"), each reproduced: `experiment
events` whole in a pipe, other users' experiments hinted, archived ones marked, and `experiment
fork` (Determined's `det e fork`: a new experiment from another's config, edited)."""

from __future__ import annotations

import contextlib
import os
import pwd
from typing import Any

import pytest

from det_local import api
from det_local.errors import DetLocalError
from tests.support.trials.core import CORE, core_config
from tests.support.users import A, B, Shared, _submit_raw, cli_output
from tests.support.world import Env, one_line_error, wait_for

CPU1 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "1"}

NAN = """\
import determined as det
with det.core.init() as core:
    core.train.report_validation_metrics(steps_completed=1, metrics={"val": float("nan")})
"""


def test_experiment_events_are_whole_in_a_pipe(dl: Env) -> None:
    """`experiment events | grep` got `... it ranks worst (never the...`: in a pipe the message
    is whole, however wide (a terminal folds it)."""
    dl.setenv(**CPU1)
    cfg, ctx = dl.context(NAN, core_config(hyperparameters={}))
    assert dl.det("run", "-q", cfg, ctx).rc == 0
    (message,) = [m for m in dl.events(1) if "is nan" in m]
    assert len(message) > 100  # wider than a pipe's 100 columns
    r = dl.det("experiment", "events", "1")
    assert r.rc == 0 and message in r.out, r
    line = next(ln for ln in r.out.splitlines() if "is nan" in ln)
    assert line.endswith(message) and "..." not in line, line


def _submit(sh: Shared, user: str, name: str) -> int:
    ctx = sh.out / f"ctx-{name}"
    ctx.mkdir()
    ctx.chmod(0o755)
    config = {
        "name": name,
        "entrypoint": "sh -c true",
        "searcher": {"name": "single", "metric": "loss", "max_length": 1},
    }
    return int(sh.as_user(user, _submit_raw, config, str(ctx)))


def _ended(sh: Shared, exp: int) -> None:
    with contextlib.closing(api.open_store(sh.paths)) as store:
        wait_for(lambda: store.get_experiment(exp).state.terminal, what=f"experiment {exp}")


def _archive(exp: int) -> Any:
    return api.control_job("experiment_archive", {"experiment_id": exp})


def test_experiment_list_hints_at_others_and_marks_archived(shared: Shared) -> None:
    dl = shared.dl
    mine = _submit(shared, A, "alices")
    theirs = [_submit(shared, B, f"bobs{i}") for i in range(3)]
    for exp in (mine, *theirs):
        _ended(shared, exp)
    shared.as_user(B, _archive, theirs[0])
    # root has none of its own: an empty table used to say nothing of the others
    r = dl.det("experiment", "list")
    assert r.rc == 0 and r.out.count("\n") == 2, r  # the header and its rule
    assert r.err == "(3 experiments of other users not shown: --all lists them)\n", r
    r = dl.det("experiment", "list", "--archived")  # the archived one counted too
    assert r.err == "(4 experiments of other users not shown: --all lists them)\n", r
    assert dl.det("experiment", "list", "--all").err == ""
    assert dl.det("experiment", "list", "--json").err == ""  # JSON: nothing added

    # --all (and --archived) mark the archived ones in the State column
    r = dl.det("experiment", "list", "--all")
    states = {
        int(cells[0]): cells[2]
        for ln in r.out.splitlines()[2:]
        if (cells := [c.strip() for c in ln.split("|")])
    }
    assert states[theirs[0]] == "COMPLETED (archived)", r.out
    assert states[theirs[1]] == states[mine] == "COMPLETED", r.out
    mark = next(e for e in dl.json("experiment", "list", "--all") if e["id"] == theirs[0])
    assert mark["state"] == "COMPLETED" and mark["archived"] is True  # JSON unchanged

    # bob sees his own archived one marked with --archived, and alice's hinted
    out = shared.as_user(B, cli_output, ["experiment", "list", "--archived"])
    assert "COMPLETED (archived)" in out and "alices" not in out, out


# ---------------------------------------------------------------------------- fork
def test_experiment_fork_runs_the_edited_config(dl: Env) -> None:
    dl.setenv(**CPU1)
    cfg, ctx = dl.context(CORE, core_config(hyperparameters={"steps": 6, "best_at": 4}))
    assert dl.det("run", "-q", cfg, ctx).rc == 0
    r = dl.det(
        "experiment",
        "fork",
        "1",
        "--config",
        "hyperparameters.steps=8",
        "--config",
        "searcher.max_length=8",
        "-f",
    )
    assert r.rc == 0 and r.out.startswith("Created experiment 2\n"), r
    with contextlib.closing(dl.store()) as store:
        assert str(store.get_experiment(2).state) == "COMPLETED"
        (trial,) = store.list_trials(2)
        assert trial.hparams == {"steps": 8, "best_at": 4} and trial.steps_completed == 8
        assert store.get_experiment(2).config["name"] == "sdk"
    assert "trained 8 steps" in dl.paths.trial_log(2, trial.id).read_text()
    # the original's code, from its snapshot: the context given at first may be gone
    (ctx / "train.py").unlink()
    r = dl.det("experiment", "fork", "1", "-f")
    assert r.rc == 0 and "Created experiment 3" in r.out, r
    with contextlib.closing(dl.store()) as store:
        assert store.list_trials(3)[0].hparams == {"steps": 6, "best_at": 4}


def test_experiment_fork_refuses_bad_edits_in_one_line(dl: Env) -> None:
    dl.setenv(**CPU1)
    cfg, ctx = dl.context(CORE, core_config())
    assert dl.det("run", "-q", cfg, ctx).rc == 0
    fork = ("experiment", "fork", "1")
    one_line_error(
        dl.det(*fork, "--config", "hyperparameters.stepz=3"),
        "--config hyperparameters.stepz: experiment 1 has no hyperparameters.stepz; "
        "did you mean 'hyperparameters.steps'?",
    )
    one_line_error(
        dl.det(*fork, "--config", "hyperparamters.steps=3"),
        "hyperparamters",
        "did you mean 'hyperparameters'?",
    )
    one_line_error(dl.det(*fork, "--config", "searcher.max_lenght=3"), "max_lenght", "did you mean")
    one_line_error(dl.det(*fork, "--config", "searcher.max_length=-3"), "searcher.max_length", "-3")
    one_line_error(
        dl.det(*fork, "--config", "steps"), "--config 'steps': expected KEY=VALUE with a dotted key"
    )
    one_line_error(dl.det("experiment", "fork", "9"), "experiment 9 not found")
    with contextlib.closing(dl.store()) as store:
        assert [e.id for e in store.list_experiments()] == [1]  # nothing was submitted


def _fork(exp: int) -> int:
    return api.fork_experiment(exp, {}, follow=False)


def test_a_private_experiment_is_its_owners_to_fork(shared: Shared) -> None:
    """The config is in the database every user reads; the code only as its snapshot's modes
    say: alice's umask 077 keeps bob from forking it (the daemon snapshots it as bob too)."""
    ctx = shared.out / "ctx-private"
    ctx.mkdir()
    (ctx / "train.py").write_text("print('mine')\n")
    uid = pwd.getpwnam(A).pw_uid
    for path, mode in ((ctx, 0o700), (ctx / "train.py", 0o600)):
        os.chown(path, uid, -1)
        path.chmod(mode)
    config = {
        "name": "private",
        "entrypoint": "sh -c true",
        "searcher": {"name": "single", "metric": "loss", "max_length": 1},
    }

    exp = int(shared.as_user(A, _submit_raw, config, str(ctx)))
    _ended(shared, exp)
    snapshot = shared.paths.context_dir(exp)
    with pytest.raises(DetLocalError) as err:
        shared.as_user(B, _fork, exp)
    assert str(err.value) == (
        f"cannot read experiment {exp}'s context snapshot ({snapshot / 'train.py'}): it is "
        f"private to {A} (only its owner and the admin group may fork it)"
    ), err
    # past the CLI's check, the daemon takes the snapshot as bob: refused there too
    with pytest.raises(DetLocalError) as err:
        shared.as_user(B, _submit_raw, config, str(snapshot))
    assert "train.py" in str(err.value) and "\n" not in str(err.value), err
    assert shared.as_user(A, _fork, exp) == 0  # alice may
