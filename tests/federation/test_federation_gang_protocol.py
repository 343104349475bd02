"""The gang placement protocol under bad input: a real member daemon (one CPU slot, a cluster
key, listening on 127.0.0.1 only, mDNS off) and this test as a hand-made owner ("n9") speaking
the authenticated peer protocol: it ships a context, then sends crafted reserve, commit, abort
and blob messages. Each is refused with one line (a `reply{id, error}`, or an `error` for a
message that breaks the schema), and the member's queue (its jobs table, read read-only) shows
exactly what the protocol says it must.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.fednet import reachable
from tests.support.peerlink import (
    NODE,
    Member,
    Owner,
    abort,
    command_reserve,
    commit,
    config,
    no_new_member_jobs,
    reserve,
    talk,
    until,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs a root daemon")

# ----------------------------------------------------------------------------- the cases


def test_a_share_larger_than_the_machine(member: Member) -> None:
    async def scenario(o: Owner) -> None:
        before = member.jobs()
        line = await o.error(reserve(member, 1, slots=2))
        assert "a share of 2 slots is more than this machine's 1" in line, line
        no_new_member_jobs(member, before)

    talk(member, scenario)


def test_a_commit_after_the_hold_expired(member: Member) -> None:
    async def scenario(o: Owner) -> None:
        assert (await o.ask(reserve(member, 2, hold_s=0.5)))["value"] == "queued"
        seen: set[str] = set()

        def went_back() -> bool:
            job = member.job(f"{NODE}:2")
            if job is not None:
                seen.add(job["state"])
            return "RESERVED" in seen and bool(o.wounded)

        await until(went_back, what="the share RESERVED, then released with `wounded`")
        assert o.wounded[0]["gang"] == f"{NODE}:2" and o.wounded[0]["run"] == 1
        assert "no commit within the hold time" in o.wounded[0]["why"]
        line = await o.error(commit(2))
        assert "not reserved here" in line and "hold expired" in line, line
        assert (await o.ask(abort(2)))["value"] is None
        await until(lambda: member.job(f"{NODE}:2")["state"] == "DONE", what="share done")

    talk(member, scenario)


def test_a_duplicate_commit_spawns_once_and_abort_stops_it(member: Member) -> None:
    async def scenario(o: Owner) -> None:
        gang = f"{NODE}:3"
        assert (await o.ask(reserve(member, 3)))["value"] == "queued"
        await until(lambda: any(m["gang"] == gang for m in o.ready), what="`ready`")
        first = await o.ask(commit(3))
        second = await o.ask(commit(3))
        assert not first.get("error") and not second.get("error"), (first, second)
        pid = first["value"]["pid"]
        assert second["value"]["pid"] == pid
        assert member.job(gang)["state"] == "SCHEDULED"
        assert psutil.pid_exists(pid)
        assert (await o.ask(abort(3)))["value"] is None
        await until(lambda: member.job(gang)["state"] == "DONE", what="the share DONE")
        await until(lambda: not psutil.pid_exists(pid), what=f"pid {pid} gone")

    talk(member, scenario)


def test_an_abort_of_an_unknown_gang(member: Member) -> None:
    async def scenario(o: Owner) -> None:
        line = await o.error(abort(404))
        assert line == f"unknown gang {NODE}:404", line

    talk(member, scenario)


def test_a_user_missing_here(member: Member) -> None:
    async def scenario(o: Owner) -> None:
        before = member.jobs()
        line = await o.error(reserve(member, 5, user="no-such-user-dl"))
        assert "user 'no-such-user-dl' does not exist on victim" in line, line
        assert "create the account" in line, line
        no_new_member_jobs(member, before)

    talk(member, scenario)


def test_shared_fs_missing_here(member: Member) -> None:
    async def scenario(o: Owner) -> None:
        before = member.jobs()
        gone = member.shared.parent / "not-mounted"
        bad = config(member, checkpoint_storage={"type": "shared_fs", "host_path": str(gone)})
        line = await o.error(reserve(member, 6, spec={"config": bad}))
        assert f"checkpoint_storage.host_path {gone} is not a directory" in line, line
        no_new_member_jobs(member, before)

    talk(member, scenario)


def test_a_context_that_does_not_match_its_digest(member: Member) -> None:
    async def scenario(o: Owner) -> None:
        before = member.jobs()
        data = member.packed.path.read_bytes()
        forged = hashlib.sha256(b"something else").hexdigest()
        assert (await o.ask(reserve(member, 7, spec={"digest": forged})))["value"] == "context"
        half = len(data) // 2
        await o.session.send(
            {"t": "blob", "digest": forged, "off": 0, "total": len(data), "data": data[:half]}
            | {"last": False}
        )
        tail = {"t": "blob", "digest": forged, "off": half, "total": len(data)}
        line = await o.error(tail | {"data": data[half:], "last": True})
        assert forged[:12] in line, line
        assert not (await o.ask({"t": "has", "digest": forged}))["value"]
        no_new_member_jobs(member, before)

    talk(member, scenario)


def test_a_stale_run(member: Member) -> None:
    async def scenario(o: Owner) -> None:
        gang = f"{NODE}:8"
        assert (await o.ask(reserve(member, 8, run=2)))["value"] == "queued"
        for msg in (commit(8, run=1), abort(8, run=1)):
            line = await o.error(msg)
            assert f"gang {gang}: run 1 is stale (run 2 is the current one)" == line, line
        line = await o.error(reserve(member, 8, run=1))
        assert "run 1 is older than run 2" in line, line
        assert member.job(gang)["state"] in ("QUEUED", "RESERVED")
        assert (await o.ask(abort(8, run=2)))["value"] is None
        await until(lambda: member.job(gang)["state"] == "DONE", what="the share DONE")

    talk(member, scenario)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"slots": -1}, "'reserve' message with an invalid 'slots' ('-1')"),
        ({"slots": "8"}, "'reserve' message with an invalid 'slots' ('8')"),
        ({"slots": True}, "'reserve' message with an invalid 'slots' ('True')"),
        ({"gang": "n9-9"}, "'reserve' message with an invalid 'gang' ('n9-9')"),
        ({"spec": None}, "'reserve' message without 'spec'"),
    ],
)
def test_a_reserve_that_breaks_the_schema(
    member: Member, change: dict[str, Any], needle: str
) -> None:
    async def scenario(o: Owner) -> None:
        before = member.jobs()
        msg = reserve(member, 9) | change
        if change.get("spec", 0) is None:
            del msg["spec"]
        answer = await o.ask(msg)
        assert answer["t"] == "error" and answer["error"] == needle, answer
        no_new_member_jobs(member, before)

    talk(member, scenario)


def test_a_commit_whose_rank_is_not_in_its_addresses(member: Member) -> None:
    async def scenario(o: Owner) -> None:
        gang = f"{NODE}:10"
        assert (await o.ask(reserve(member, 10, hold_s=3.0)))["value"] == "queued"
        await until(lambda: any(m["gang"] == gang for m in o.ready), what="`ready`")
        line = await o.error(commit(10) | {"node_rank": 5})
        assert "node_rank 5" in line and "node_rank must be in 0..1" in line, line
        line = await o.error(commit(10) | {"slot_counts": [1]})
        assert "1 slot counts for 2 nodes" in line, line
        # nothing spawned, the link is up (this reply came on it), and the hold still runs
        assert member.job(gang)["state"] == "RESERVED"
        await until(lambda: o.wounded, what="the hold to expire after the refused commits")
        assert o.wounded[0]["gang"] == gang
        assert (await o.ask(abort(10)))["value"] is None
        await until(lambda: member.job(gang)["state"] == "DONE", what="the share DONE")

    talk(member, scenario)


def test_a_commit_whose_ranks_cannot_start_frees_the_share(member: Member) -> None:
    async def scenario(o: Owner) -> None:
        gang = f"{NODE}:11"
        assert (await o.ask(reserve(member, 11)))["value"] == "queued"
        await until(lambda: any(m["gang"] == gang for m in o.ready), what="`ready`")
        line = await o.error(commit(11) | {"ports": {}})
        assert line.startswith("its ranks could not start: ") and "C10D_PORT" in line, line
        job = member.job(gang)
        assert job["state"] == "DONE" and job["pid"] is None, job
        assert job["message"] == line
        line = await o.error(commit(11))  # not a duplicate commit of a share with no process
        assert line == f"unknown gang {gang}", line
        # its slot is free: the next share is reserved at once
        assert (await o.ask(reserve(member, 12)))["value"] == "queued"
        await until(lambda: any(m["gang"] == f"{NODE}:12" for m in o.ready), what="`ready`")
        assert (await o.ask(abort(12)))["value"] is None
        await until(lambda: member.job(f"{NODE}:12")["state"] == "DONE", what="share 12 DONE")

    talk(member, scenario)


def test_a_command_whose_directory_is_not_here(member: Member, tmp_path: Path) -> None:
    async def scenario(o: Owner) -> None:
        before = member.jobs()
        gone = tmp_path / "not-on-this-machine"
        line = await o.error(command_reserve(20, {"argv": ["true"], "cwd": str(gone)}))
        assert line == (
            f"the command's working directory {gone} is not on this machine: run it from a "
            "directory every machine has (a shared file system) [permanent]"
        ), line
        line = await o.error(
            command_reserve(21, {"argv": ["true"], "cwd": str(tmp_path)}, user="no-such-user-dl")
        )
        assert "user 'no-such-user-dl' does not exist on victim" in line, line
        no_new_member_jobs(member, before)

    talk(member, scenario)


@pytest.mark.parametrize(
    "command",
    [
        {"argv": [], "cwd": "/"},
        {"argv": "rm -rf /", "cwd": "/"},
        {"argv": ["true", 3], "cwd": "/"},
        {"argv": ["true"], "cwd": "/", "env": {"LD_PRELOAD": "/tmp/x.so"}},
        {"argv": ["true"]},
    ],
)
def test_a_command_that_breaks_the_schema(member: Member, command: dict[str, Any]) -> None:
    async def scenario(o: Owner) -> None:
        before = member.jobs()
        answer = await o.ask(command_reserve(22, command))
        assert answer["t"] == "error" and "reserve" in answer["error"], answer
        no_new_member_jobs(member, before)

    talk(member, scenario)


def test_a_command_sent_whole_runs_here_and_reports_its_exit(
    member: Member, tmp_path: Path
) -> None:
    reachable(tmp_path)

    async def scenario(o: Owner) -> None:
        gang = f"{NODE}:23"
        argv = ["sh", "-c", "pwd; echo from-the-owner; exit 4"]
        answer = await o.ask(command_reserve(23, {"argv": argv, "cwd": str(tmp_path)}))
        assert answer["value"] == "queued", answer
        await until(lambda: any(m["gang"] == gang for m in o.ready), what="`ready`")
        one = {"addrs": ["127.0.0.1"], "node_rank": 0, "slot_counts": [1], "ports": {}}
        first = await o.ask(commit(23) | one)
        assert not first.get("error"), first
        await until(lambda: member.job(gang)["state"] == "DONE", what="the command DONE")
        job = member.job(gang)
        assert job["message"] == "its command exited with 4", job
        with member.db() as conn:
            code = conn.execute("SELECT exit_code FROM jobs WHERE id=?", (job["id"],)).fetchone()
        assert code == (4,)

    talk(member, scenario)
