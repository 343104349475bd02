"""CheckpointContext (shard=True, both DownloadModes) and PreemptContext across real rank
processes. The daemon's session is a stand-in that records what each rank asks of it."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tests.support.ranks import run_ranks

COMMON = """
from pathlib import Path
from det_local.errors import CheckpointError
from det_local.trial.core import CheckpointContext, DownloadMode, PreemptContext, PreemptMode

class Session:
    def __init__(self, preempted):
        self.preempted = preempted
        self.log = Path(os.environ["OUT"]) / f"requests-{rank}.json"
        self.log.write_text("[]")
    def request(self, kind, **fields):
        seen = json.loads(self.log.read_text())
        seen.append([kind, fields])
        self.log.write_text(json.dumps(seen, default=str))

out = Path(os.environ["OUT"])
store = out / "store"
"""


def _requests(out: Path, rank: int) -> list[list]:
    path = out / f"requests-{rank}.json"
    return json.loads(path.read_text()) if path.exists() else []


def test_sharded_store_path_and_upload(tmp_path: Path) -> None:
    body = """
    d = make()
    session = Session(False)
    ckpt = CheckpointContext(d, store, session)
    result = {}
    # store_path(shard=True): every rank writes into the same directory; metadata merged
    meta = {"steps_completed": 7, "per_rank": {str(rank): rank}}
    if rank == 1:
        meta["extra"] = "from rank 1"
    with ckpt.store_path(meta, shard=True) as (path, sid):
        (path / f"shard-{rank}.bin").write_bytes(bytes([rank]) * 10)
    result["store_sid"] = sid
    result["store_files"] = sorted(p.name for p in (store / sid).iterdir())
    result["store_meta"] = json.loads((store / sid / "metadata.json").read_text())

    # upload(shard=True): ranks 0 and 1 share one dir (uploaded once), rank 2 its own with a
    # file that rank 0's dir also has with the same content; rank 3 has nothing
    shared = out / "shared"
    own = out / f"own-{rank}"
    if rank == 0:
        shared.mkdir()
        (shared / "common.txt").write_text("same")
        (shared / "sub").mkdir()
        (shared / "sub" / "a.txt").write_text("a")
    if rank == 2:
        own.mkdir()
        (own / "common.txt").write_text("same")
        (own / "two.txt").write_text("2")
    d.allgather(None)  # the directories exist before anyone uploads
    src = {0: shared, 1: shared, 2: own, 3: None}[rank]
    sid2 = ckpt.upload(src, {"steps_completed": 8} if rank == 0 else None, shard=True)
    result["upload_files"] = sorted(
        str(p.relative_to(store / sid2)) for p in (store / sid2).rglob("*") if p.is_file()
    )

    # conflicts: the same file with different contents on two ranks
    bad = out / f"bad-{rank}"
    bad.mkdir()
    (bad / "weights.pt").write_text(f"rank {rank}")
    try:
        ckpt.upload(bad, {"steps_completed": 9}, shard=True)
        result["file_conflict"] = None
    except CheckpointError as err:
        result["file_conflict"] = str(err)
    try:
        with ckpt.store_path({"steps_completed": 9, "lr": rank}, shard=True) as (path, sid3):
            pass
        result["meta_conflict"] = None
    except CheckpointError as err:
        result["meta_conflict"] = str(err)
    try:
        ckpt.upload(None, {"steps_completed": 1}, shard=True)
    except CheckpointError as err:
        result["nothing"] = str(err)
    result["dirs"] = sorted(p.name for p in store.iterdir())
    emit(result)
    """
    results = run_ranks(
        tmp_path, COMMON + textwrap.dedent(body), size=4, env={"OUT": str(tmp_path)}
    )
    for code, res, err in results:
        assert code == 0, err
        assert res["store_files"] == [
            "metadata.json",
            "shard-0.bin",
            "shard-1.bin",
            "shard-2.bin",
            "shard-3.bin",
        ]
        assert res["store_meta"] == {
            "steps_completed": 7,
            "per_rank": {"0": 0, "1": 1, "2": 2, "3": 3},
            "extra": "from rank 1",
        }
        assert res["upload_files"] == ["common.txt", "metadata.json", "sub/a.txt", "two.txt"]
        assert "conflicting files: weights.pt from ranks [0, 1, 2, 3]" in res["file_conflict"]
        assert "conflicting metadata: /lr from ranks [0, 1, 2, 3]" in res["meta_conflict"]
        assert "at least one rank must pass a directory" in res["nothing"]
        # the refused checkpoints left nothing behind
        assert len(res["dirs"]) == 2
    # only the chief reported, with the merged metadata and every rank's files
    assert all(_requests(tmp_path, r) == [] for r in (1, 2, 3))
    reports = [f for kind, f in _requests(tmp_path, 0) if kind == "checkpoint"]
    assert [r["uuid"] for r in reports] == [results[0][1]["store_sid"], reports[1]["uuid"]]
    assert reports[0]["metadata"]["per_rank"] == {"0": 0, "1": 1, "2": 2, "3": 3}
    assert "shard-3.bin" in reports[0]["resources"]
    assert reports[1]["steps_completed"] == 8


def test_restore_and_download_modes(tmp_path: Path) -> None:
    body = """
    d = make()
    ckpt = CheckpointContext(d, store, None)
    sid = None
    if rank == 0:
        with ckpt.store_path({"steps_completed": 1}) as (path, sid):
            (path / "model.pt").write_text("weights")
            (path / "opt.pt").write_text("optimizer")
    sid = d.broadcast(sid)
    result = {}
    with ckpt.restore_path(sid) as path:
        result["shared"] = (path / "model.pt").read_text()
    with ckpt.restore_path(sid, DownloadMode.NoSharedDownload) as path:
        result["own"] = (path / "opt.pt").read_text()
    # shared download: the local chief copies every file some rank's selector keeps
    dest = out / "dl-shared"
    selector = (lambda p: p == "model.pt") if rank == 1 else (lambda p: p == "metadata.json")
    ckpt.download(sid, dest, selector=selector)
    result["shared_dl"] = sorted(p.name for p in dest.iterdir())
    mine = out / f"dl-{rank}"
    ckpt.download(sid, mine, DownloadMode.NoSharedDownload, selector=lambda p: p == "opt.pt")
    result["own_dl"] = sorted(p.name for p in mine.iterdir())
    try:
        with ckpt.restore_path("no-such-checkpoint"):
            pass
    except CheckpointError as err:
        result["missing"] = str(err)
    emit(result)
    """
    results = run_ranks(
        tmp_path, COMMON + textwrap.dedent(body), size=2, env={"OUT": str(tmp_path)}
    )
    for code, res, err in results:
        assert code == 0, err
        assert res["shared"] == "weights"
        assert res["own"] == "optimizer"
        assert res["shared_dl"] == ["metadata.json", "model.pt"]
        assert res["own_dl"] == ["opt.pt"]
        assert "no-such-checkpoint" in res["missing"] and "is gone" in res["missing"]


def test_preemption_across_ranks(tmp_path: Path) -> None:
    """WorkersAskChief: the chief's flag decides for everyone and only the chief acks;
    WorkersAskMaster: each rank its own flag; ChiefOnly: a worker may not ask."""
    body = """
    d = make()
    # only the chief's session has seen the preempt message
    session = Session(rank == 0)
    result = {}
    ctx = PreemptContext(session, d, PreemptMode.WorkersAskChief)
    result["ask_chief"] = [ctx.should_preempt(), ctx.should_preempt()]
    result["ask_master"] = PreemptContext(
        Session(rank == 1), d, PreemptMode.WorkersAskMaster
    ).should_preempt(auto_ack=False)
    only = PreemptContext(Session(rank == 0), d, PreemptMode.ChiefOnly)
    try:
        result["chief_only"] = only.should_preempt(auto_ack=False)
    except RuntimeError as err:
        result["chief_only"] = str(err)
    emit(result)
    """
    results = run_ranks(
        tmp_path, COMMON + textwrap.dedent(body), size=3, env={"OUT": str(tmp_path)}
    )
    for rank, (code, res, err) in enumerate(results):
        assert code == 0, err
        assert res["ask_chief"] == [True, True]
        assert res["ask_master"] is (rank == 1)
        if rank == 0:
            assert res["chief_only"] is True
        else:
            assert "ChiefOnly" in res["chief_only"] and f"rank={rank}" in res["chief_only"]
