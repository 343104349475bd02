"""The dashboard's learning-curve, log and compare endpoints over a real store: two finished
Core API experiments (embedded runs; the second with global_batch_size and records_per_epoch),
served by a real `det-local dashboard` process and read over HTTP on the loopback. The curves'
API carries what the x units need; the progress route is what a live page polls; the raw log
is the log file, as an attachment; /compare parses its ids and says what is wrong with them in
one line (400 for a bad id or too many, 404 for an unknown one); user strings stay text."""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Iterator

import pytest

pytest.importorskip("starlette", reason="the dashboard needs the web extra")
pytest.importorskip("uvicorn", reason="the dashboard needs the web extra")

from det_local.store.paths import Paths
from tests.support.dashboard import NAME, Server, World, make_world, serve


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("curves"), dict(os.environ))


@pytest.fixture(scope="module")
def exps(world: World) -> tuple[int, int]:
    """Two finished experiments: (plain, with global_batch_size 16 and records_per_epoch 64)."""
    cfg, ctx = world.context("plain", {"batches": 8, "lr": 0.1})
    assert world.det("run", cfg, ctx).returncode == 0
    hparams = {"batches": 8, "lr": 0.2, "global_batch_size": 16, "extra": {"depth": 3}}
    cfg, ctx = world.context("units", hparams, records_per_epoch=64)
    assert world.det("run", cfg, ctx).returncode == 0
    ids = [int(e["id"]) for e in world.json("experiment", "list", "--all")]
    assert len(ids) == 2
    return ids[0], ids[1]


@pytest.fixture(scope="module")
def server(world: World, exps: tuple[int, int]) -> Iterator[Server]:
    yield from serve(world)


def trial_of(world: World, exp_id: int) -> dict[str, object]:
    return dict(world.json("trial", "list", exp_id)[0])


def one_line_error(server: Server, path: str, status: int) -> str:
    got, body, headers = server.get(path)
    assert got == status, (path, got, body)
    if headers["content-type"].startswith("application/json"):
        error = str(json.loads(body)["error"])
    else:  # a page: the message is its one paragraph
        found = re.findall(r"<main><h1>[^<]*</h1><p>([^<]*)</p></main>", body.decode())
        assert len(found) == 1, body
        error = html.unescape(found[0])
    assert "\n" not in error and "Traceback" not in error, error
    return error


# ---------------------------------------------------------------------------- curves
def test_curves_carry_what_the_x_units_need(
    world: World, exps: tuple[int, int], server: Server
) -> None:
    plain, units = exps
    body = server.json(f"/api/experiments/{plain}/metrics")
    assert body["group"] == "validation" and body["state"] == "COMPLETED"
    assert body["metric"] == "val_loss" and body["smaller_is_better"] is True
    assert body["records_per_epoch"] is None  # the config has none: no epochs
    (t,) = body["trials"]
    trial = trial_of(world, plain)
    assert t["trial_id"] == trial["id"] and t["state"] == "COMPLETED"
    assert t["global_batch_size"] is None and t["started_at"] == trial["created_at"]
    assert t["best_validation"] == trial["best_validation"]
    assert [r["steps_completed"] for r in t["reports"]] == [2, 4, 6, 8]
    assert all(r["time"] >= t["started_at"] for r in t["reports"])  # what time is counted from

    body = server.json(f"/api/experiments/{units}/metrics?group=training")
    assert body["records_per_epoch"] == 64
    (t,) = body["trials"]
    assert t["global_batch_size"] == 16
    assert [r["steps_completed"] for r in t["reports"]] == list(range(1, 9))


def test_progress_is_what_a_live_page_polls(exps: tuple[int, int], server: Server) -> None:
    plain, units = exps
    first = server.json(f"/api/experiments/{plain}/progress")
    assert first["state"] == "COMPLETED" and first["ended"] is True
    newest = first["last"]
    # after 0: the experiment's own newest report, which is older than the second's
    own = server.json(f"/api/experiments/{plain}/progress?after=0")["last"]
    assert 0 < own < newest
    assert server.json(f"/api/experiments/{plain}/progress?after={own}")["last"] == own
    assert server.json(f"/api/experiments/{units}/progress?after=0")["last"] == newest
    assert "not found" in one_line_error(server, "/api/experiments/999/progress", 404)
    msg = one_line_error(server, f"/api/experiments/{plain}/progress?after=x", 400)
    assert msg == "?after='x' is not a whole number"


# ---------------------------------------------------------------------------- raw log
def test_raw_log_is_the_whole_file_as_an_attachment(
    world: World, exps: tuple[int, int], server: Server
) -> None:
    plain, _ = exps
    tid = int(str(trial_of(world, plain)["id"]))
    status, body, headers = server.get(f"/api/trials/{tid}/logs/raw")
    assert status == 200
    assert headers["content-type"] == "text/plain; charset=utf-8"
    name = f"experiment-{plain}-trial-{tid}.log"
    assert headers["content-disposition"] == f'attachment; filename="{name}"'
    assert body == Paths(world.home).trial_log(plain, tid).read_bytes()
    assert b'<script>alert("log")</script> starting' in body  # as written: plain text
    assert "nosniff" in headers["x-content-type-options"]  # never sniffed as HTML
    # the trial page links it
    page = server.get(f"/trials/{tid}")[1].decode()
    assert f'href="/api/trials/{tid}/logs/raw" download' in page
    assert 'id="log-rank"' in page


def test_raw_log_errors_are_one_line(server: Server) -> None:
    assert one_line_error(server, "/api/trials/999/logs/raw", 404).startswith("trial 999 not found")
    msg = one_line_error(server, "/api/trials/x1/logs/raw", 404)
    assert msg == "trial 'x1' not found: trial ids are whole numbers"


# ---------------------------------------------------------------------------- compare
def test_compare_shows_the_experiments_side_by_side(exps: tuple[int, int], server: Server) -> None:
    plain, units = exps
    for query in (f"ids={plain},{units}", f"ids={plain}&ids={units}", f"ids={plain},{units},1"):
        status, body, headers = server.get(f"/compare?{query}")
        assert status == 200, body
        page = body.decode()
        assert "script-src 'self'" in headers["content-security-policy"]
        assert "<script>alert" not in page  # the hostile name is text
        assert page.count("&lt;script&gt;alert(&quot;name&quot;)&lt;/script&gt; digits") == 2
        data = re.search(r'<script type="application/json" id="page-data">(.*?)</script>', page)
        assert data is not None
        shown = json.loads(data.group(1))["experiments"]
        assert [e["id"] for e in shown] == [plain, units]  # repeats dropped, order kept
    # where the hyperparameter spaces differ: lr, global_batch_size, extra.depth (missing in
    # the first); batches is the same in both
    diff = page[page.index('id="hp-diff"') :]
    diff = diff[: diff.index("</table>")]
    rows = re.findall(r"<tr><td><code>([^<]*)</code></td><td>([^<]*)</td><td>([^<]*)</td>", diff)
    assert sorted(rows) == [
        ("extra.depth", "—", "3"),
        ("global_batch_size", "—", "16"),
        ("lr", "0.1", "0.2"),
    ], rows
    assert "the same in every one: batches" in page
    assert "val_loss (smaller is better)" in page


def test_experiments_page_selects_for_compare(exps: tuple[int, int], server: Server) -> None:
    page = server.get("/")[1].decode()
    assert '<form id="compare-form" method="get" action="/compare"' in page
    for exp_id in exps:
        assert f'<input type="checkbox" name="ids" value="{exp_id}" form="compare-form"' in page


@pytest.mark.parametrize(
    ("query", "status", "message"),
    [
        ("ids=1,x", 400, "?ids='1,x': 'x' is not an experiment id"),
        ("ids=-1", 400, "'-1' is not an experiment id"),
        ("ids=1,999", 404, "experiment 999 not found"),
        ("ids=" + ",".join(map(str, range(1, 12))), 400, "11 experiments: at most 10"),
        ("", 400, "nothing to compare: give experiment ids, e.g. /compare?ids=1,2"),
        ("ids=,", 400, "nothing to compare"),
    ],
)
def test_compare_errors_are_one_line(
    exps: tuple[int, int], server: Server, query: str, status: int, message: str
) -> None:
    assert message in one_line_error(server, f"/compare?{query}", status)


def test_compare_hostile_ids_stay_text(exps: tuple[int, int], server: Server) -> None:
    status, body, _ = server.get("/compare?ids=%3Cscript%3Ealert(1)%3C/script%3E")
    assert status == 400
    page = body.decode()
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)" in page
    assert NAME not in page
