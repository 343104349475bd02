"""Config bombs: a YAML billion laughs, a 5,000-deep structure, a 55 MB file; each refused at
once with one line, by the loader, by `det-local config check`, and by a real daemon when the
config comes as msgpack in a request."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from det_local.config import load_config, load_yaml, parse_config
from det_local.config.limits import MAX_CONFIG_BYTES, MAX_DEPTH
from det_local.errors import ConfigError, DetLocalError
from det_local.sched.intake import spool
from tests.support.world import Env, gone
from tests.support.world import write_raw_request as _submit_raw

BASE = (
    "entrypoint: python3 train.py\n"
    "searcher:\n  name: single\n  metric: loss\n  max_length: {batches: 5}\n"
)
LAUGHS = (
    BASE
    + 'lol0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    + "".join(f"lol{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]\n" for i in range(1, 10))
)
CPU1 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "1"}
DEEP_PATH = "hyperparameters.a.a.a.(58 more).a.a"  # the 65th level, under hyperparameters


def deep_yaml(depth: int) -> str:
    return BASE + "hyperparameters: " + "{a: " * depth + "1" + "}" * depth + "\n"


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text and "report it" not in text, text
    return lines[0]


# ---------------------------------------------------------------------- the loader
def test_billion_laughs_is_refused_at_once_by_the_loader(tmp_path: Path) -> None:
    path = tmp_path / "laughs.yaml"
    path.write_text(LAUGHS)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    took = time.monotonic() - t0
    msg = one_line(str(exc.value))
    assert msg.startswith(f"{path}: its anchors and aliases expand past the limit of"), msg
    assert took < 1.0, took


def test_a_recursive_alias_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="alias \\*h refers to the mapping or list that"):
        load_yaml(BASE + "hyperparameters: &h\n  a: *h\n", "rec.yaml")


def test_aliases_within_the_limit_still_work() -> None:
    raw = load_yaml(
        BASE + "defaults: &d {lr: 0.1, layers: [1, 2]}\nhyperparameters:\n  <<: *d\n  x: *d\n",
        "ok.yaml",
    )
    assert raw["hyperparameters"] == {"lr": 0.1, "layers": [1, 2], "x": raw["defaults"]}


def test_five_thousand_deep_hyperparameters_name_the_path(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(deep_yaml(5000))
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = one_line(str(exc.value))
    assert msg.startswith(f"{DEEP_PATH} in {path}: nested deeper than {MAX_DEPTH} levels"), msg
    # the same bound on a config given as data (the Python API, a request)
    with pytest.raises(ConfigError) as exc:
        parse_config({**load_yaml(BASE, "x"), "hyperparameters": nested(5000)}, "api")
    assert one_line(str(exc.value)).startswith(f"{DEEP_PATH} in api: nested deeper than"), exc
    # and the deepest allowed still loads
    ok = tmp_path / "ok.yaml"
    ok.write_text(deep_yaml(MAX_DEPTH - 2))
    assert load_config(ok).hyperparameters


def test_a_55_mb_config_names_the_size_limit(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(BASE + 'data:\n  blob: "' + "x" * (55 * 1024 * 1024) + '"\n')
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = one_line(str(exc.value))
    size = path.stat().st_size
    assert msg.startswith(f"config {path} is {size} bytes, over the 1 MiB ({MAX_CONFIG_BYTES}"), msg
    assert time.monotonic() - t0 < 1.0


# ---------------------------------------------------------------------- the CLI
def test_config_check_refuses_the_bombs_with_one_line(dl: Env) -> None:
    laughs = dl.tmp / "laughs.yaml"
    laughs.write_text(LAUGHS)
    deep = dl.tmp / "deep.yaml"
    deep.write_text(deep_yaml(5000))
    big = dl.tmp / "big.yaml"
    big.write_text(BASE + 'data:\n  blob: "' + "x" * (55 * 1024 * 1024) + '"\n')
    expected = {
        laughs: f"{laughs}: its anchors and aliases expand past the limit of",
        deep: f"{DEEP_PATH} in {deep}: nested deeper than {MAX_DEPTH} levels",
        big: f"config {big} is {big.stat().st_size} bytes, over the 1 MiB",
    }
    for path, start in expected.items():
        t0 = time.monotonic()
        r = dl.det("config", "check", path, timeout=20)
        took = time.monotonic() - t0
        assert r.rc == 1 and r.out == "", r
        assert one_line(r.err).startswith(f"error: {start}"), r.err
        # the CLI's own start-up (~0.2 s, more on a loaded machine) is most of it
        assert took < 3.0, (path, took)


# ---------------------------------------------------------------------- through the daemon
def test_a_daemon_refuses_config_bombs_in_requests(dl: Env) -> None:
    pid = dl.daemon_start(**CPU1)
    _, ctx = dl.context("print('never runs')\n")
    base = load_yaml(BASE, "base")

    def submit(config: Any) -> str:
        payload = {"config": config, "context": str(ctx), "source": "bomb.yaml"}
        with pytest.raises(DetLocalError) as exc:
            spool.request(dl.paths, "submit", payload, timeout=30)
        return one_line(str(exc.value))

    # nested past the config's limit: named by its path, as `config check` names it
    msg = submit({**base, "hyperparameters": nested(80)})
    assert msg.startswith("hyperparameters.a.a.a.(58 more).a.a in bomb.yaml: nested deeper"), msg
    # nested deeper still (msgpack packs up to ~1,000 levels): bounded when read
    msg = submit({**base, "hyperparameters": nested(900)})
    assert re.search(
        r"\.req refused: message nests deeper than 100 levels \(at byte \d+\); submit it with "
        r"the det-local CLI$",
        msg,
    ), msg
    # 5,000 levels (crafted by hand: msgpack will not pack them)
    me = spool.user_name(os.geteuid())
    head = msgpack.packb({"op": "submit", "user": me}, use_bin_type=True)
    body = (
        bytes([head[0] + 1])  # the same map with one entry more: the payload
        + head[1:]
        + msgpack.packb("payload")
        + b"\x81\xa1a" * 5000
        + b"\x01"
    )
    req_id = _submit_raw(dl, body)
    with pytest.raises(DetLocalError) as exc:
        spool.wait_response(dl.paths, req_id, timeout=30)
    msg = one_line(str(exc.value))
    assert re.fullmatch(
        rf"request {req_id}\.req refused: message nests deeper than 100 levels \(at byte \d+\); "
        "submit it with the det-local CLI",
        msg,
    ), msg
    # over the size limit (under the request's): measured as sent
    msg = submit({**base, "data": {"blob": "x" * (2 * MAX_CONFIG_BYTES)}})
    assert msg.startswith("config bomb.yaml is ") and "bytes as sent, over the 1 MiB" in msg, msg
    # 55 MB: over the request's own limit, named
    req_id = _submit_raw(
        dl,
        msgpack.packb(
            {
                "op": "submit",
                "user": me,
                "payload": {"config": {**base, "data": "x" * (55 * 1024 * 1024)}},
            },
            use_bin_type=True,
        ),
    )
    with pytest.raises(DetLocalError) as exc:
        spool.wait_response(dl.paths, req_id, timeout=30)
    msg = one_line(str(exc.value))
    assert msg.startswith(f"request {req_id}.req is ") and "over the 4194304-byte limit" in msg
    # nothing was submitted, the daemon goes on
    store = dl.store()
    try:
        assert store.list_experiments() == []
    finally:
        store.close()
    assert not gone(pid)
    assert dl.wait_job(dl.cmd("true")).exit_code == 0
