"""Nobody pins another user's checkpoint through the model registry (issue 34, item 5).

Real users on a root daemon's shared home (the `shared` fixture): alice's trial (`sleep 600`,
spoken for by a child as alice, as in test_security_socket) records a checkpoint; she registers
it in her model and deletes her experiment (the registered checkpoint stays). Bob then tries
to register it in his own model, which used to work (the owner fell back to the model's user)
and left it pinned for good: refused, one line. Once alice's last version of it goes, it is
still hers to delete, and its files go.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

# everything the children use is imported before they drop root (they cannot read /root)
import det_local.trial.core._distributed
from det_local import api
from det_local.errors import DetLocalError
from det_local.trial.core._checkpoint import CheckpointContext
from det_local.trial.session import Session
from tests.support.users import ADMIN, ADMIN_GROUP, A, B, Shared, start_sleeping_trial
from tests.support.world import wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="multi-user tests create real users: they need root"
)


def store_checkpoint(env: dict[str, str], steps: int) -> str:
    """As alice's trial: core_context.checkpoint.store_path(), as a Core API script does."""
    session = Session(
        env["DET_LOCAL_SOCKET"],
        env["DET_LOCAL_TOKEN"],
        int(env["DET_TRIAL_ID"]),
        int(env["DET_TRIAL_RUN_ID"]),
    )
    dist = det_local.trial.core._distributed.DummyDistributedContext()
    ckpts = CheckpointContext(dist, Path(env["DET_LOCAL_CHECKPOINT_DIR"]), session)
    with ckpts.store_path({"steps_completed": steps}) as (path, sid):
        (path / "weights").write_text(f"weights at {steps}\n")
    return sid


def _as(sh: Shared, user: str, op: str, **payload: Any) -> Any:
    return sh.as_user(user, api.control_job, op, payload)


def _refused(sh: Shared, user: str, op: str, **payload: Any) -> str:
    with pytest.raises(DetLocalError) as err:
        _as(sh, user, op, **payload)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_nobody_pins_another_users_checkpoint(shared: Shared) -> None:
    alice = start_sleeping_trial(shared, A, "alice", {"metric": "loss"})
    exp = alice["exp"]
    mine = shared.as_user(A, store_checkpoint, alice["env"], 1)
    with contextlib.closing(api.open_store(shared.paths)) as store:
        files = Path(store.get_checkpoint(mine).path)
    assert (files / "weights").is_file()
    shared.as_user(A, api.control, exp, "kill")
    with contextlib.closing(api.open_store(shared.paths)) as store:
        wait_for(lambda: store.get_experiment(exp).state.terminal, what="alice's kill")

    # while the experiment exists, bob may not register alice's checkpoint (as before)
    _as(shared, B, "model_create", name="bobs")
    owner = f"belongs to {A}; only its owner or a member of the"
    refusal = _refused(shared, B, "model_register_version", model="bobs", checkpoint_uuid=mine)
    assert owner in refusal, refusal

    _as(shared, A, "model_create", name="alices")
    _as(shared, A, "model_register_version", model="alices", checkpoint_uuid=mine)
    said = _as(shared, A, "experiment_delete", experiment_id=exp)
    assert said == f"experiment {exp} deleted (1 checkpoint registered in a model kept)"

    # the pinning sequence: alice's experiment is gone; bob registers her checkpoint in his
    # model (it used to fall back to the model's owner: bob) -- refused, one line
    refusal = _refused(shared, B, "model_register_version", model="bobs", checkpoint_uuid=mine)
    assert refusal == (
        f"permission denied: checkpoint {mine} (experiment {exp}) belongs to {A}; only its "
        f"owner or a member of the {ADMIN_GROUP} group may change it"
    ), refusal
    with contextlib.closing(api.open_store(shared.paths)) as store:
        assert [v.model_name for v in store.models.versions_of_checkpoint(mine)] == ["alices"]
    # nor may bob delete it or change its metadata: it is still alice's
    assert owner in _refused(shared, B, "checkpoint_metadata", uuid=mine, metadata={"x": 1})
    # alice (its creator) may register it again, her experiment gone
    _as(shared, A, "model_register_version", model="alices", checkpoint_uuid=mine)

    # her model goes: the answer says what is left and how to remove it
    said = _as(shared, A, "model_delete", model="alices")
    assert said == (
        "model 'alices' deleted (2 versions); 1 checkpoint of a deleted experiment no longer "
        f"registered (its creator removes the files: `det-local checkpoint delete {mine}`)"
    ), said
    # bob may not delete it; alice may, and its files go (with her rights)
    assert owner in _refused(shared, B, "checkpoint_delete", uuids=[mine])
    assert _as(shared, A, "checkpoint_delete", uuids=[mine]) == "deleted 1 checkpoint"
    wait_for(lambda: not files.exists(), what="the deleted checkpoint's files to go")
    with contextlib.closing(api.open_store(shared.paths)) as store:
        assert str(store.get_checkpoint(mine).state) == "DELETED"


def test_an_admin_may_register_and_delete_an_orphaned_checkpoint(shared: Shared) -> None:
    """The admin group changes anyone's checkpoints, its experiment deleted or not."""
    alice = start_sleeping_trial(shared, A, "alice", {"metric": "loss"})
    exp = alice["exp"]
    mine = shared.as_user(A, store_checkpoint, alice["env"], 1)
    shared.as_user(A, api.control, exp, "kill")
    with contextlib.closing(api.open_store(shared.paths)) as store:
        wait_for(lambda: store.get_experiment(exp).state.terminal, what="alice's kill")
        files = Path(store.get_checkpoint(mine).path)
    _as(shared, A, "model_create", name="alices")
    _as(shared, A, "model_register_version", model="alices", checkpoint_uuid=mine)
    _as(shared, A, "experiment_delete", experiment_id=exp)
    _as(shared, ADMIN, "model_create", name="admins")
    _as(shared, ADMIN, "model_register_version", model="admins", checkpoint_uuid=mine)
    _as(shared, A, "model_delete", model="alices")
    _as(shared, ADMIN, "model_delete", model="admins")
    assert _as(shared, ADMIN, "checkpoint_delete", uuids=[mine]) == "deleted 1 checkpoint"
    wait_for(lambda: not files.exists(), what="the deleted checkpoint's files to go")
