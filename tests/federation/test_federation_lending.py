"""Who may run on a lending machine (issue 25, item 1): a keyed peer asking for uid 0, for
root by name, for a system account, for a user not on the allow-list, from a machine not on
the allow-list, or for a crafted user name, is refused with one line naming the user, the
machine and the setting; the lender logs the refusal once a minute however often it is asked.
A real member daemon (root, listening on 127.0.0.1) and this test as a hand-made owner."""

from __future__ import annotations

import pwd
from collections.abc import Iterator
from pathlib import Path

import pytest

from det_local.federate import keys
from det_local.federate.lending import LendPolicy, LendRefused, uid_range, valid_user_name
from det_local.federate.settings import load
from tests.support.peerlink import (
    NODE,
    TRAIN,
    Member,
    Owner,
    Victim,
    command_reserve,
    no_new_member_jobs,
    reserve,
    talk,
)
from tests.support.users import A, B

pytestmark = pytest.mark.skipif(
    __import__("os").geteuid() != 0, reason="runs a root daemon, creates users"
)


def test_uid_0_root_and_system_accounts_are_refused(member: Member) -> None:
    lo, hi = uid_range()
    daemon_uid = pwd.getpwnam("daemon").pw_uid

    async def scenario(o: Owner) -> None:
        before = member.jobs()
        line = await o.error(reserve(member, 40, uid=0))
        assert line == (
            f"victim does not run work of uid 0 (root, as '{A}') from {NODE}: root never runs "
            "work from other machines; submit as an ordinary user [permanent]"
        ), line
        line = await o.error(reserve(member, 41, user="root", uid=1000))
        assert line == (
            f"victim does not run work of 'root' (uid 0 on victim) from {NODE}: root never "
            "runs work from other machines; submit as an ordinary user [permanent]"
        ), line
        line = await o.error(reserve(member, 42, user="daemon", uid=1000))
        assert line == (
            f"victim does not run work of 'daemon' from {NODE}: uid {daemon_uid} is a system "
            f"account on victim (not within UID_MIN-UID_MAX {lo}-{hi} of /etc/login.defs); "
            "only ordinary accounts run work from other machines [permanent]"
        ), line
        line = await o.error(command_reserve(43, {"argv": ["id"], "cwd": "/"}, uid=0))
        assert "does not run work of uid 0" in line, line
        no_new_member_jobs(member, before)

    talk(member, scenario)
    # the lender's line, once however often it was asked
    text = member.daemon.text()
    assert text.count(f"federation: refused reserve from {NODE}: victim does not run work") == 3


@pytest.mark.parametrize(
    "name",
    ["../root", "root\n", "-rf", "a b", "a/b", "x" * 33, "ro\x00ot", "..", "émile", "$"],
)
def test_a_crafted_user_name_is_refused(member: Member, name: str) -> None:
    async def scenario(o: Owner) -> None:
        before = member.jobs()
        answer = await o.ask(reserve(member, 44, user=name))
        line = str(answer.get("error"))
        if len(name) > 64:  # over the schema's bound: refused before the policy sees it
            assert answer["t"] == "error" and "invalid 'user'" in line, answer
        else:
            assert line == (
                f"victim refused a user name {name[:40]!r} from {NODE}: not a valid user name "
                "(letters, digits, '.', '_', '-'; at most 32) [permanent]"
            ), line
        no_new_member_jobs(member, before)

    talk(member, scenario)


def test_refusals_are_logged_once_a_minute(member: Member) -> None:
    needle = f"federation: refused reserve from {NODE}: victim does not run work of uid 0"

    async def scenario(o: Owner) -> None:
        for i in range(20):
            await o.error(reserve(member, 50 + i, uid=0))

    before = member.daemon.text().count(needle)
    talk(member, scenario)
    assert member.daemon.text().count(needle) - before <= 1


@pytest.fixture
def strict(tmp_path: Path, accounts: None) -> Iterator[Member]:
    """A member that lends only to user A and only to machine n9."""
    from det_local.federate.blobs import pack_context
    from tests.support.fednet import reachable

    reachable(tmp_path)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text(TRAIN)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    home = tmp_path / "strict"
    home.mkdir()
    (home / "daemon.yaml").write_text(
        f"federation:\n  lend_users: [{A}]\n  lend_peers: [{NODE}, other]\n"
    )
    v = Victim(home, keys.new_key(), DET_LOCAL_CPU_SLOTS="1")
    try:
        v.logged("listening on 127.0.0.1", timeout=30)
        yield Member(v, pack_context(ctx, tmp_path / "out"), shared)
    finally:
        v.stop()


def test_allow_lists_of_users_and_machines(strict: Member) -> None:
    b_uid = pwd.getpwnam(B).pw_uid

    async def scenario(o: Owner) -> None:
        before = strict.jobs()
        line = await o.error(reserve(strict, 60, user=B, uid=b_uid))
        assert line == (
            f"victim does not run work of '{B}' from {NODE}: not in federation.lend_users of "
            "victim's daemon.yaml (add the user there to lend to it) [permanent]"
        ), line
        no_new_member_jobs(strict, before)
        assert (await o.ask(reserve(strict, 61)))["value"] == "queued"  # A may

    talk(strict, scenario)


def test_a_machine_not_on_lend_peers(tmp_path: Path) -> None:
    policy = LendPolicy("gpu1", peers=frozenset({"gpu2"}))
    with pytest.raises(LendRefused) as err:
        policy.check("gpu3", A, 1000)
    assert str(err.value) == (
        "gpu1 does not run work from machine gpu3: it is not in federation.lend_peers of "
        "gpu1's daemon.yaml (add it there to lend to it) [permanent]"
    )
    off = LendPolicy("gpu1", lend=False)
    with pytest.raises(LendRefused, match=r"federation.lend: false in gpu1's daemon.yaml"):
        off.check("gpu2", A, 1000)


def test_settings_and_login_defs(tmp_path: Path) -> None:
    defs = tmp_path / "login.defs"
    defs.write_text("# c\nUID_MIN\t\t\t 2000\nUID_MAX 3000\n")
    assert uid_range(defs) == (2000, 3000)
    assert uid_range(tmp_path / "missing") == (1000, 60000)
    assert not valid_user_name("../x") and valid_user_name("alice_1.b-c")
    yaml = tmp_path / "daemon.yaml"
    yaml.write_text("federation:\n  lend_users: [alice, '../root']\n")
    with pytest.raises(Exception, match=r"federation.lend_users in .*'../root' is not a valid"):
        load(yaml, env={})
    yaml.write_text("federation:\n  lend_peers: ['no/pe']\n  contexts_max_mb: 10\n")
    with pytest.raises(Exception, match=r"federation.lend_peers in .*'no/pe' is not a node id"):
        load(yaml, env={})
    yaml.write_text("federation:\n  lend_users: [alice]\n  contexts_max_mb: 10\n")
    s = load(yaml, env={})
    assert s.lend_users == frozenset({"alice"}) and s.lend_peers is None
    assert s.contexts_max_mb == 10 and s.contexts_peer_mb == 10
