"""The hyperparameter view over a real store: a grid search run to its end (embedded engine,
8 trials: lr (log) x opt (categorical, one value markup) x layers (int), a nested group with
constants), served by a real `det-local dashboard` and read over HTTP. The trials whose lr is
0.001 never validate: they are in the API without a metric. /api/experiments/{id}/hparams
flattens nested names, types each hyperparameter from the config (log stays log), says which
vary; the page links both ways and shows markup in a value or the name as text."""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

pytest.importorskip("starlette", reason="the dashboard needs the web extra")
pytest.importorskip("uvicorn", reason="the dashboard needs the web extra")

from det_local.store.db import Store
from det_local.store.paths import Paths
from tests.support.dashboard import NAME, Server, World, make_world, serve

HOSTILE = "<script>alert('opt')</script>"

# validation only when lr > 0.001; val_loss a function of the hyperparameters
SCRIPT = r"""
import math
import determined as det

hp = det.get_cluster_info().trial.hparams
with det.core.init() as core:
    for step in (1, 2):
        core.train.report_training_metrics(step, {"loss": 1.0 / step})
        if hp["lr"] > 0.002:
            loss = abs(math.log10(hp["lr"]) + 2) + hp["layers"] / 10 + (hp["opt"] == "sgd")
            loss += 1 / step
            core.train.report_validation_metrics(step, {"val_loss": loss})
"""

CONFIG = {
    "name": NAME,
    "entrypoint": "python3 train.py",
    "hyperparameters": {
        "lr": {"type": "log", "minval": -3, "maxval": -1, "base": 10, "count": 2},
        "opt": {"type": "categorical", "vals": ["sgd", HOSTILE]},
        "layers": {"type": "int", "minval": 1, "maxval": 2, "count": 2},
        "model": {"width": 32, "act": {"type": "categorical", "vals": ["relu"]}},
    },
    "searcher": {"name": "grid", "metric": "val_loss", "max_length": 2},
    "max_restarts": 0,
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("hparams"), dict(os.environ))


@pytest.fixture(scope="module")
def exp_id(world: World) -> int:
    ctx = world.tmp / "grid"
    ctx.mkdir()
    (ctx / "train.py").write_text(SCRIPT)
    (ctx / "config.yaml").write_text(yaml.safe_dump(CONFIG, sort_keys=False))
    r = world.det("run", ctx / "config.yaml", ctx)
    assert r.returncode == 0, r
    return int(world.json("experiment", "list", "--all")[-1]["id"])


@pytest.fixture(scope="module")
def server(world: World, exp_id: int) -> Iterator[Server]:
    yield from serve(world)


def test_api_types_flattening_and_trials_without_metric(
    world: World, exp_id: int, server: Server
) -> None:
    d = server.json(f"/api/experiments/{exp_id}/hparams")
    assert set(d) == {
        "experiment_id",
        "name",
        "state",
        "metric",
        "smaller_is_better",
        "hyperparameters",
        "trials",
    }
    assert (d["experiment_id"], d["name"], d["state"]) == (exp_id, NAME, "COMPLETED")
    assert (d["metric"], d["smaller_is_better"]) == ("val_loss", True)
    hps = {h["name"]: h for h in d["hyperparameters"]}
    assert list(hps) == ["lr", "opt", "layers", "model.width", "model.act"]  # config order
    assert hps["lr"] == {
        "name": "lr",
        "type": "log",
        "minval": -3.0,
        "maxval": -1.0,
        "base": 10.0,
        "count": 2,
        "varies": True,
    }
    assert hps["opt"] == {
        "name": "opt",
        "type": "categorical",
        "vals": ["sgd", HOSTILE],
        "varies": True,
    }
    assert hps["layers"]["type"] == "int" and hps["layers"]["varies"] is True
    width = {"name": "model.width", "type": "const", "val": 32, "varies": False}
    assert hps["model.width"] == width
    assert hps["model.act"]["type"] == "categorical" and hps["model.act"]["varies"] is False

    trials = d["trials"]
    described = {t["id"]: t for t in world.json("experiment", "describe", exp_id)["trials"]}
    assert [t["trial_id"] for t in trials] == list(described)  # best first, as describe
    assert len(trials) == 8
    for t in trials:
        assert set(t) == {"trial_id", "state", "hparams", "metric", "rung"}
        assert set(t["hparams"]) == set(hps)  # flat, dotted
        assert t["hparams"]["model.width"] == 32 and t["hparams"]["model.act"] == "relu"
        assert t["metric"] == described[t["trial_id"]]["best_validation"]
        assert t["rung"] is None and t["state"] == "COMPLETED"  # grid: no rungs
        assert (t["metric"] is None) == (t["hparams"]["lr"] < 0.002), t
    scored = [t["metric"] for t in trials if t["metric"] is not None]
    assert len(scored) == 4 and scored == sorted(scored)
    assert trials[0]["hparams"]["opt"] == HOSTILE  # data, unchanged


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("/api/experiments/999/hparams", "experiment 999 not found"),
        ("/api/experiments/abc/hparams", "experiment 'abc' not found: experiment ids are whole"),
    ],
)
def test_api_unknown_experiment_is_one_line(server: Server, path: str, fragment: str) -> None:
    status, body, headers = server.get(path)
    assert status == 404, body
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert fragment in error and "\n" not in error, error


def test_page_links_and_markup_as_text(exp_id: int, server: Server) -> None:
    status, body, headers = server.get(f"/experiments/{exp_id}/hparams")
    assert status == 200, body
    page = body.decode()
    assert "script-src 'self'" in headers["content-security-policy"]
    # only the page's own scripts: ECharts (this page only) and hparams.js; the data block
    scripts = re.findall(r"<script[^>]*>", page)
    assert scripts == [
        '<script src="/static/vendor/echarts/echarts.min.js" defer>',
        '<script src="/static/hparams.js" defer>',
        '<script type="application/json" id="page-data">',
    ], scripts
    assert "<script>alert" not in page
    assert "&lt;script&gt;alert(&#x27;opt&#x27;)&lt;/script&gt;" in page  # the categorical value
    assert "&lt;script&gt;alert(&quot;name&quot;)&lt;/script&gt; digits" in page  # the name
    assert f'href="/experiments/{exp_id}"' in page  # back to the experiment
    assert "val_loss (smaller is better)" in page
    assert "10^-3 … 10^-1 (2 grid points)" in page  # the log range, as the config has it
    # the experiment page links here, and loads no ECharts of its own
    experiment = server.get(f"/experiments/{exp_id}")[1].decode()
    assert f'href="/experiments/{exp_id}/hparams"' in experiment
    assert "echarts" not in experiment
    # the script and the library are served
    for path in ("/static/hparams.js", "/static/vendor/echarts/echarts.min.js"):
        status, body, headers = server.get(path)
        assert status == 200 and len(body) > 1000, path
        assert "javascript" in headers["content-type"], headers["content-type"]


def test_page_of_an_unknown_experiment_says_so(server: Server) -> None:
    status, body, _ = server.get("/experiments/999/hparams")
    assert status == 404
    main = re.search(r"<main>(.*)</main>", body.decode())
    assert main and "<p>experiment 999 not found" in main.group(1), body


def test_experiment_without_trials_and_an_unreadable_config(
    world: World, exp_id: int, server: Server
) -> None:
    """An experiment whose trials have not started: no trials, every hyperparameter defined and
    none varying. A config this version cannot read (one an older version wrote): the types
    come from the values."""
    store = Store(Paths(world.home).db)
    empty = store.create_experiment(name="waiting", config=copy.deepcopy(CONFIG))
    old = store.create_experiment(
        name="old", config={"hyperparameters": {"lr": {"type": "loguniform?"}}}
    )
    for hp in ({"lr": 0.1, "opt": {"name": "adam", "beta": 0.9}}, {"lr": 3, "opt": "sgd"}):
        store.create_trial(old, hparams=hp, seed=0)
    store.close()

    d = server.json(f"/api/experiments/{empty}/hparams")
    assert d["trials"] == [] and d["state"] == "ACTIVE"
    assert [h["name"] for h in d["hyperparameters"]] == [
        "lr",
        "opt",
        "layers",
        "model.width",
        "model.act",
    ]
    assert not any(h["varies"] for h in d["hyperparameters"])
    assert server.get(f"/experiments/{empty}/hparams")[0] == 200

    d = server.json(f"/api/experiments/{old}/hparams")
    types: dict[str, Any] = {h["name"]: (h["type"], h["varies"]) for h in d["hyperparameters"]}
    assert types == {
        "lr": ("double", True),
        "opt.name": ("categorical", False),
        "opt.beta": ("double", False),
        "opt": ("categorical", False),
    }, types
    assert d["metric"] is None and all(t["metric"] is None for t in d["trials"])
    status, body, _ = server.get(f"/experiments/{old}/hparams")
    assert status == 200 and "the searcher names no metric" in body.decode()
