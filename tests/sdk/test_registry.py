"""The model registry (store/tables/registry.py, sched/intake/lifecycle/registry.py): from the CLI
(`det-local model`, Determined's verbs), from the SDK (the flows of Determined's
model-registry-org.rst), from the dashboard (/models); a registered checkpoint is kept by
checkpoint GC, by `checkpoint delete` and by `experiment delete`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from det_local.errors import DetLocalError
from tests.support.trials.core import CORE, core_config
from tests.support.world import Env, one_line_error, wait_for


def _run(dl: Env, **hparams: Any) -> None:
    cfg, ctx = dl.context(CORE, core_config(hyperparameters={"steps": 6, "best_at": 4, **hparams}))
    r = dl.det("run", "-q", cfg, ctx)
    assert r.rc == 0, r


def test_registry_from_the_cli(dl: Env) -> None:
    _run(dl)
    uuids = [c.uuid for c in dl.checkpoints(1)]
    r = dl.det("model", "create", "mnist-cnn", "-d", "a small CNN", "-l", "vision")
    assert r.rc == 0 and r.out == "Created model 'mnist-cnn' (id 1)\n", r
    r = dl.det("model", "register-version", "mnist-cnn", uuids[1])
    assert r.out == f"Registered checkpoint {uuids[1]} as version 1 of 'mnist-cnn'\n", r
    assert dl.det("model", "register-version", "1", uuids[2]).rc == 0  # by id
    listed = dl.json("model", "list", "--json")
    assert [(m["name"], m["num_versions"], m["labels"], m["user"]) for m in listed] == [
        ("mnist-cnn", 2, ["vision"], "root")
    ]
    described = dl.json("model", "describe", "mnist-cnn", "--json")
    assert [v["checkpoint_uuid"] for v in described["versions"]] == uuids[1:3]
    assert dl.det("m", "ls").out == dl.det("model", "list").out  # Determined's short names
    versions = dl.det("model", "list-versions", "mnist-cnn")
    assert versions.rc == 0 and uuids[1] in versions.out and "1/1" in versions.out
    text = dl.det("model", "describe", "mnist-cnn").out
    assert text.startswith("Model mnist-cnn (id 1)\n") and "a small CNN" in text

    # bad input, one line each
    one_line_error(
        dl.det("model", "create", "mnist-cnn"),
        "a model named 'mnist-cnn' already exists; `det-local model describe mnist-cnn`",
    )
    one_line_error(dl.det("model", "create", "123"), "model name '123' is all digits")
    one_line_error(dl.det("model", "describe", "nope"), "model 'nope' not found; `det-local")
    one_line_error(
        dl.det("model", "register-version", "mnist-cnn", "0000"), "checkpoint 0000 not found"
    )
    one_line_error(
        dl.det("checkpoint", "delete", uuids[1], "--yes"),
        "this subset of checkpoints provided are in the model registry and cannot be deleted",
    )
    r = dl.det("model", "delete", "mnist-cnn")  # asks first; "no" on stdin
    assert r.rc == 1 and "aborted; nothing was deleted" in r.out, r
    r = dl.det("model", "delete", "mnist-cnn", "--yes")
    assert r.out == "model 'mnist-cnn' deleted (2 versions)\n", r
    assert dl.json("model", "list", "--json") == []
    # no longer registered: its checkpoint can go
    assert dl.det("checkpoint", "delete", uuids[1], "--yes").out == "deleted 1 checkpoint\n"


def test_registry_from_the_sdk(dl: Env, client: Any) -> None:
    """docs/model-dev-guide/model-management/model-registry-org.rst, flow by flow."""
    from determined.experimental import Determined, ModelSortBy, OrderBy

    _run(dl)
    d = Determined()
    model = d.create_model(
        "model_name",
        description="optional description",
        metadata={"optional": "JSON serializable dictionary"},
    )
    assert model.metadata == {"optional": "JSON serializable dictionary"}
    d.create_model("mnist_cnn")
    d.create_model("other")
    assert [m.name for m in d.get_models()] == ["mnist_cnn", "model_name", "other"]
    assert [m.name for m in d.get_models(sort_by=ModelSortBy.CREATION_TIME)] == [
        "model_name", "mnist_cnn", "other",
    ]  # fmt: skip
    assert [m.name for m in d.get_models(name="mnist")] == ["mnist_cnn"]
    assert [m.name for m in d.get_models(order_by=OrderBy.DESC)][0] == "other"

    model = Determined().get_model("model_name")
    model.add_metadata({"metrics": {"test_set_loss": 0.091}})
    model.add_metadata({"metrics": {"test_set_acc": 0.97}})  # top-level keys are replaced
    assert Determined().get_model("model_name").metadata == {
        "optional": "JSON serializable dictionary",
        "metrics": {"test_set_acc": 0.97},
    }
    model.remove_metadata(["optional"])
    assert client.get_model("model_name").metadata == {"metrics": {"test_set_acc": 0.97}}
    model.set_labels(["a", "b"])
    model.set_description("new")
    again = client.get_model(model.model_id)  # by id too
    assert again.labels == ["a", "b"] and again.description == "new"
    with pytest.raises(ValueError, match="^set_labels\\(\\) requires a list of strings"):
        model.set_labels("a")  # type: ignore[arg-type]

    assert model.get_version() is None  # no versions yet
    checkpoint = d.get_experiment(1).list_checkpoints()[0]
    model_version = model.register_version(checkpoint.uuid)
    assert model_version.model_version == 1 and model_version.checkpoint.uuid == checkpoint.uuid
    second = d.get_experiment(1).list_checkpoints()[1]
    model.register_version(second.uuid)
    latest_version = model.get_version()
    specific_version = model.get_version(1)
    assert latest_version.model_version == 2 and specific_version.model_version == 1
    assert [v.model_version for v in model.list_versions()] == [2, 1]  # newest first
    with pytest.warns(FutureWarning, match=r"Model.get_versions\(\) has been deprecated"):
        assert [v.model_version for v in model.get_versions(OrderBy.ASC)] == [1, 2]
    path = latest_version.checkpoint.download()
    assert (Path(path) / "w").read_text() == str(second.steps_completed)
    with pytest.raises(DetLocalError, match="^model 1 has no version 7"):
        model.get_version(7)

    specific_version.delete()
    assert [v.model_version for v in model.list_versions()] == [2]
    model.archive()
    assert client.get_model("model_name").archived
    with pytest.raises(DetLocalError, match="^model 'model_name' is archived; unarchive it"):
        model.register_version(checkpoint.uuid)
    model.unarchive()
    with pytest.raises(DetLocalError, match="^a model named 'other' already exists"):
        client.create_model("other")
    model.delete()
    with pytest.raises(DetLocalError, match="^model 'model_name' not found"):
        client.get_model("model_name")


def test_registry_on_the_dashboard(dl: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.dashboard import asgi_get, token_app

    _run(dl)
    uuid = dl.checkpoints(1)[1].uuid
    assert dl.det("model", "create", "resnet <b>", "-d", "<script>x</script>").rc == 0
    assert dl.det("model", "register-version", "resnet <b>", uuid).rc == 0
    monkeypatch.setenv("DET_LOCAL_HOME", str(dl.home))
    app = token_app()
    host = {"host": "localhost:8080"}
    status, _, body = asgi_get(app, "/models", host)
    page = body.decode()
    assert status == 200 and 'href="/models/resnet%20%3Cb%3E"' in page
    assert "&lt;b&gt;" in page and "<b>" not in page.split("<main>")[1]
    status, _, body = asgi_get(app, "/models/resnet <b>", host)  # ASGI paths are decoded
    page = body.decode()
    assert status == 200 and uuid in page
    assert 'href="/trials/1"' in page and 'href="/experiments/1"' in page
    assert "&lt;script&gt;" in page and "<script>x" not in page
    status, _, body = asgi_get(app, "/api/models", host)
    assert status == 200 and json.loads(body)[0]["name"] == "resnet <b>"
    status, _, body = asgi_get(app, "/api/models/resnet <b>", host)
    data = json.loads(body)
    assert data["versions"][0]["checkpoint"]["trial_id"] == 1
    status, _, body = asgi_get(app, "/api/models/nope", host)
    assert status == 404 and "model 'nope' not found" in json.loads(body)["error"]
    status, _, body = asgi_get(app, "/models/nope", host)
    assert status == 404


def test_checkpoint_gc_keeps_a_registered_checkpoint(dl: Env, client: Any) -> None:
    """Checkpoints at steps 2, 4, 6, 8; best (val) at 4, latest 8: GC deletes 2 and 6, but 2
    was registered while the experiment ran, so only 6 goes."""
    gate = dl.tmp / "gate"
    _, ctx = dl.context(CORE, core_config())
    hp = {"steps": 8, "best_at": 4, "gate": str(gate), "gate_at": 3}
    exp = client.create_experiment(
        core_config(hyperparameters=hp, checkpoint_storage={}), model_dir=str(ctx)
    )
    first = wait_for(lambda: dl.checkpoints(1), what="the first checkpoint")[0]
    assert first.steps_completed == 2
    client.create_model("keep").register_version(first.uuid)
    gate.touch()
    assert exp.wait(interval=0.1) == client.ExperimentState.COMPLETED
    wait_for(lambda: dl.store().get_checkpoint_gc(1) == "done", what="checkpoint GC")
    states = {c.steps_completed: str(c.state) for c in dl.checkpoints(1)}
    assert states == {2: "COMPLETED", 4: "COMPLETED", 6: "DELETED", 8: "COMPLETED"}
    assert Path(first.path).is_dir()


def test_experiment_delete_keeps_registered_checkpoints(dl: Env, client: Any) -> None:
    _run(dl)
    ckpts = dl.checkpoints(1)
    kept = ckpts[0]
    client.create_model("keep").register_version(kept.uuid)
    log = dl.paths.trial_log(1, 1)
    assert log.exists() and dl.paths.context_dir(1).is_dir()
    r = dl.det("experiment", "delete", "1", "--yes")
    assert r.out == "experiment 1 deleted (1 checkpoint registered in a model kept)\n", r
    assert not log.exists() and not dl.paths.context_dir(1).exists()
    assert all(not Path(c.path).exists() for c in ckpts[1:])
    assert Path(kept.path).is_dir()
    one_line_error(dl.det("experiment", "describe", "1"), "experiment 1 not found")
    version = client.get_model("keep").get_version()
    assert version.checkpoint.uuid == kept.uuid and version.checkpoint.training is None
    assert (Path(version.checkpoint.download()) / "w").read_text() == "2"
    # the record of a registered checkpoint outlives its experiment: listing it by uuid works
    assert dl.json("checkpoint", "describe", kept.uuid, "--json")["uuid"] == kept.uuid
    # the dashboard names the deleted experiment instead of linking to it
    from tests.support.dashboard import asgi_get, token_app

    _, _, body = asgi_get(token_app(), "/models/keep", {"host": "localhost:8080"})
    page = body.decode()
    assert "experiment 1 (deleted) / trial 1" in page and 'href="/trials/1"' not in page
