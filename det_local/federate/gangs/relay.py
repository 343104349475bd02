"""What travels between a gang's ranks and its owner once it runs: a member rank's trial
frames relayed to the owner (held in order while the owner's daemon restarts), the owner's
frames down to every member (preempt), and the members' log lines shipped to the owner's
trial log (capped by federation.max_log_mb)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from det_local.errors import DetLocalError
from det_local.federate.gangs.state import BACKLOG_MAX, LOG_CHUNK, LOG_EVERY_S, GangBook, MemberGang

if TYPE_CHECKING:
    from det_local.sched.life.experiments import TrialRun


class Relay:
    """Frames and logs between a gang's members and its owner."""

    def __init__(self, book: GangBook) -> None:
        self.book = book
        self.view = book.view

    # ---------------------------------------------------------------- at the owner
    def on_relay(self, node: str, msg: dict[str, Any]) -> dict[str, Any] | None:
        og = self.book.owned.get(msg["gang"])
        reply: dict[str, Any] | None = {"t": "reply", "id": msg["id"]} if "id" in msg else None
        try:
            if og is None or og.run != msg["run"] or node not in og.shares:
                raise DetLocalError(f"gang {msg['gang']} run {msg['run']} is not running here")
            value = self.view.gangs.apply_relayed(og.trial_id, og.run, msg["frame"])
            if reply is not None:
                reply["value"] = value
        except DetLocalError as err:
            if reply is not None:
                reply["error"] = str(err)[:1000]
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            if reply is not None:
                reply["error"] = f"malformed frame ({type(err).__name__}: {err})"[:1000]
        return reply

    def on_log(self, node: str, msg: dict[str, Any]) -> None:
        og = self.book.owned.get(msg["gang"])
        if og is None or og.run != msg["run"] or node not in og.shares:
            return
        data: bytes = msg["data"]
        cap = self.max_log_bytes()
        if og.log_bytes >= cap:
            return  # cut already (the line below says where)
        if og.log_bytes + len(data) > cap:
            data = data[: cap - og.log_bytes]
            data += (
                f"\n[det-local: the log relayed from {node} was cut here, after "
                f"{cap // (1024 * 1024)} MiB (federation.max_log_mb on {self.book.node}); the "
                "rest of its output is not kept]\n"
            ).encode()
            self.view.log(
                f"federation: job {og.job_id}: the log relayed from {node} was cut at "
                f"{cap // (1024 * 1024)} MiB (federation.max_log_mb)"
            )
        og.log_bytes += len(msg["data"])
        if og.command:
            self.view.append_command_log(og.job_id, data)
        else:
            self.view.append_trial_log(og.experiment_id, og.trial_id, data)

    def max_log_bytes(self) -> int:
        s = self.book.fed.settings
        return (s.max_log_mb if s is not None else 64) * 1024 * 1024

    def down(self, run: TrialRun, frame: dict[str, Any]) -> None:
        og = self.book.owned_by_trial(run.trial_id, run.run_id)
        if og is None:
            return
        for s in og.shares.values():
            self.book.send(s.node, {"t": "down", "gang": og.gang, "run": og.run, "frame": frame})

    # ---------------------------------------------------------------- at a member
    def on_down(self, node: str, msg: dict[str, Any]) -> None:
        mg = self.book.members.get(msg["gang"])
        if mg is None or mg.owner != node or mg.run != msg["run"]:
            return
        self.view.gangs.relay_down(mg.job_id, msg["frame"])

    def relay(self, run: TrialRun, msg: dict[str, Any]) -> asyncio.Future[Any] | None:
        job = self.view.job(run.job_id)
        gang = str((job.gang or {}).get("gang")) if job is not None else ""
        mg = self.book.members.get(gang)
        if mg is None:
            raise DetLocalError("this rank's gang is no longer placed here")
        out: dict[str, Any] = {"t": "relay", "gang": mg.gang, "run": mg.run, "frame": msg}
        if mg.backlog or not self.book.linked(mg.owner):  # held until the owner is back
            if len(mg.backlog) >= BACKLOG_MAX:
                raise DetLocalError(f"the trial's owner {mg.owner} is unreachable")
            held = asyncio.get_running_loop().create_future() if "id" in msg else None
            mg.backlog.append((out, held))
            return held
        if "id" not in msg:
            if not self.book.send(mg.owner, out):
                raise DetLocalError(f"the trial's owner {mg.owner} is unreachable")
            return None
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.book.fed.spawn(self._ask_owner(mg, out, fut))
        return fut

    async def _ask_owner(
        self, mg: MemberGang, out: dict[str, Any], fut: asyncio.Future[Any]
    ) -> None:
        """A rank's request, relayed: the owner's answer (or its error line) in `fut`."""
        try:
            value = await self.book.request(mg.owner, out)
        except Exception as err:  # the rank gets the error line
            if not fut.done():
                fut.set_exception(DetLocalError(str(err) or type(err).__name__))
            return
        if not fut.done():
            fut.set_result(value)

    def flush(self, mg: MemberGang) -> None:
        """The owner's link is up again: the frames held for it go, in order."""
        held, mg.backlog = mg.backlog, []
        for out, fut in held:
            if fut is None:
                self.book.send(mg.owner, out)
            else:
                self.book.fed.spawn(self._ask_owner(mg, out, fut))

    def fail_backlog(self, mg: MemberGang, why: str) -> None:
        held, mg.backlog = mg.backlog, []
        for _out, fut in held:
            if fut is not None and not fut.done():
                fut.set_exception(DetLocalError(f"not sent to the trial's owner: {why}"))

    def ship_logs(self, mg: MemberGang) -> None:
        """Send the share's new log lines to its owner every LOG_EVERY_S while it runs."""
        mg.log_task = asyncio.get_running_loop().create_task(self._ship_logs(mg))

    async def _ship_logs(self, mg: MemberGang) -> None:
        while True:
            await asyncio.sleep(LOG_EVERY_S)
            self.send_log(mg)

    def send_log(self, mg: MemberGang, final: bool = False) -> None:
        path = self.view.gangs.member_log(mg.job_id)
        try:
            with open(path, "rb") as f:
                f.seek(mg.log_offset)
                data = f.read(LOG_CHUNK)
        except OSError:
            return
        if not final:
            cut = data.rfind(b"\n")
            data = data[: cut + 1] if cut >= 0 else b""
        if not data:
            return
        msg = {"t": "log", "gang": mg.gang, "run": mg.run, "data": data}
        if self.book.send(mg.owner, msg):
            mg.log_offset += len(data)
            with contextlib.suppress(OSError):  # where a restarted daemon goes on from
                path.with_name("log.offset").write_text(str(mg.log_offset))
