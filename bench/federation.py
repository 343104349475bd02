"""Federation figures, measured between real daemons in Linux network namespaces (root).

    sudo python3 bench/federation.py [--runs N]

- discovery_s_p50/p99: 3 daemons started together (mDNS on), from the moment all three
  serve until each lists the other two as alive. Anchor in the same run: raw python-zeroconf,
  register in one namespace and browse-and-resolve in another (zeroconf_resolve_s_p50).
- dead_detect_s: kill -9 of a node until the others mark it dead (target <= 5 s).
- handshake_ms_p50, rtt_ms_p50: TCP connect + mutual HMAC handshake, and a query/reply on an
  authenticated link, from a client in one namespace to a daemon in another.
- idle_peer_cpu_pct, idle_rss_mb: a federated daemon with two peers, idle for 10 s.
- flood_*: a keyless flood at node 1 from a third namespace (16 idle connections held and
  1,000 connects a second, one source address): a keyed client's handshake from a known peer's
  address and from an address node 1 never saw (max of 20 each), and a peer's reattach (its
  daemon killed -9 and started again: from the moment its status says federation on, and from
  its pid file, until both list each other alive; polled every 20 ms); the same without the
  flood as the anchor; flood_log_lines: node 1's log lines about the flood's source during it.
- contexts_peak_mb: fed/contexts on disk at most while 100 different 1 MiB contexts are
  shipped through `federate/shipments.py` into a real `ContextCache` with a 16 MiB cap (in
  this process: the cap is the receiving side's).

Targets: discovery <= 2 s p99, dead <= 5 s, handshake <= 10 ms, rtt <= 1 ms, idle CPU <= 1 %,
RSS <= 80 MB, join/reattach under the flood <= 2 s, contexts under their cap. The machine may
be loaded: read the times as upper bounds. The last line printed
is one JSON object. Namespaces are prefixed dlf<pid> and removed at the end, even on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from det_local.federate import keys  # noqa: E402
from det_local.federate.client import request  # noqa: E402
from det_local.store.paths import Paths  # noqa: E402
from tests.support.fednet import Net, sweep  # noqa: E402

MDNS = {"DET_LOCAL_FED_INTERFACES": "eth0"}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def states(home: Path) -> dict[str, str]:
    try:
        view = request(Paths(home), {"t": "peers"}, timeout=5)
    except Exception:
        return {}
    return {r["id"]: r["state"] for r in view.get("peers", [])}


def wait(pred, timeout: float, tick: float = 0.02) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise SystemExit("timed out")
        time.sleep(tick)
    return time.monotonic() - t0


def discovery_run(root: Path) -> tuple[float, float, dict[str, float]]:
    key = keys.new_key()
    with Net(root) as net:
        nodes = [net.node(i, key) for i in (1, 2, 3)]
        for n in nodes:
            n.proc = None
        import threading

        threads = [threading.Thread(target=n.start, kwargs=MDNS) for n in nodes]
        for t in threads:
            t.start()

        def federating(n) -> bool:  # type: ignore[no-untyped-def]
            try:
                return request(Paths(n.home), {"t": "status"}, timeout=2)["federation"] == "on"
            except Exception:
                return False

        wait(lambda: all(federating(n) for n in nodes), 60)
        t0 = time.monotonic()  # all three listen: from here, mDNS and the handshakes

        def all_alive() -> bool:
            for n in nodes:
                st = states(n.home)
                if sum(v == "alive" for v in st.values()) != 2:
                    return False
            return True

        wait(all_alive, 30)
        discovery = time.monotonic() - t0
        for t in threads:
            t.join()
        extra: dict[str, float] = {}
        if not extra:
            extra.update(link_figures(nodes[0], nodes[1], key))
            extra.update(idle_figures(nodes[0]))
        nodes[2].kill()
        t1 = time.monotonic()
        wait(lambda: states(nodes[0].home).get("n3") == "dead", 20)
        dead = time.monotonic() - t1
        return discovery, dead, extra


ZC_REGISTER = textwrap.dedent(
    """
    import socket, sys, time, asyncio
    from zeroconf import IPVersion
    from zeroconf.asyncio import AsyncZeroconf, AsyncServiceInfo
    async def main():
        zc = AsyncZeroconf(interfaces=[sys.argv[1]], ip_version=IPVersion.V4Only)
        info = AsyncServiceInfo("_dlbench._tcp.local.", "a._dlbench._tcp.local.",
            addresses=[socket.inet_aton(sys.argv[1])], port=1, properties={"x": "1"})
        print(time.time(), flush=True)
        await (await zc.async_register_service(info))
        await asyncio.sleep(float(sys.argv[2]))
        await zc.async_close()
    asyncio.run(main())
    """
)
ZC_BROWSE = textwrap.dedent(
    """
    import sys, time, asyncio
    from zeroconf import IPVersion, ServiceStateChange
    from zeroconf.asyncio import AsyncZeroconf, AsyncServiceBrowser, AsyncServiceInfo
    async def main():
        zc = AsyncZeroconf(interfaces=[sys.argv[1]], ip_version=IPVersion.V4Only)
        done = asyncio.Event()
        async def resolve(name):
            info = AsyncServiceInfo("_dlbench._tcp.local.", name)
            if await info.async_request(zc.zeroconf, 3000):
                print(time.time(), flush=True); done.set()
        def on(zeroconf, service_type, name, state_change):
            if state_change is ServiceStateChange.Added:
                asyncio.ensure_future(resolve(name))
        b = AsyncServiceBrowser(zc.zeroconf, ["_dlbench._tcp.local."], handlers=[on])
        print("ready", flush=True)
        await asyncio.wait_for(done.wait(), 20)
        await b.async_cancel(); await zc.async_close()
    asyncio.run(main())
    """
)


def zeroconf_anchor(root: Path) -> float:
    with Net(root) as net:
        a, b = net.node(1), net.node(2)
        browse = subprocess.Popen(
            ["ip", "netns", "exec", b.ns, sys.executable, "-c", ZC_BROWSE, b.addr],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert browse.stdout is not None
        assert browse.stdout.readline().strip() == "ready"
        reg = subprocess.Popen(
            ["ip", "netns", "exec", a.ns, sys.executable, "-c", ZC_REGISTER, a.addr, "3"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert reg.stdout is not None
        started = float(reg.stdout.readline())
        seen = float(browse.stdout.readline())
        browse.wait(30)
        reg.wait(30)
        return seen - started


LINK_CLIENT = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    from det_local.federate import transport
    from det_local.federate.transport import Me
    key = bytes.fromhex(sys.argv[1]); host = sys.argv[2]
    async def main():
        hs, rtt = [], []
        for i in range(20):
            t0 = time.perf_counter()
            r, w = await asyncio.open_connection(host, 47800)
            me = Me(f"bench{i}", key, os.urandom(8).hex(), 47800)
            s, _ = await transport.client_handshake(r, w, me, host)
            hs.append((time.perf_counter() - t0) * 1000)
            if i == 19:
                for q in range(200):
                    t1 = time.perf_counter()
                    await s.send({"t": "query", "id": q, "what": "slots"})
                    while (await s.recv())["t"] != "reply":
                        pass
                    rtt.append((time.perf_counter() - t1) * 1000)
            s.close()
        print(json.dumps({"hs": hs, "rtt": rtt}))
    asyncio.run(main())
    """
)


def link_figures(client_node, server_node, key: bytes) -> dict[str, float]:  # type: ignore[no-untyped-def]
    res = client_node.in_ns(
        "env",
        f"PYTHONPATH={REPO}",
        sys.executable,
        "-c",
        LINK_CLIENT,
        key.hex(),
        server_node.addr,
        timeout=120,
    )
    if res.returncode != 0:
        raise SystemExit(res.stderr[-2000:])
    data = json.loads(res.stdout.strip().splitlines()[-1])
    return {
        "handshake_ms_p50": round(statistics.median(data["hs"]), 2),
        "rtt_ms_p50": round(statistics.median(data["rtt"]), 3),
    }


def idle_figures(node) -> dict[str, float]:  # type: ignore[no-untyped-def]
    import psutil

    proc = psutil.Process(node.proc.pid)
    time.sleep(2)  # the bench client's links are gone
    c0, t0 = proc.cpu_times(), time.monotonic()
    time.sleep(10)
    c1, t1 = proc.cpu_times(), time.monotonic()
    cpu = (c1.user + c1.system - c0.user - c0.system) / (t1 - t0) * 100
    return {
        "idle_peer_cpu_pct": round(cpu, 2),
        "idle_rss_mb": round(proc.memory_info().rss / 2**20, 1),
    }


FLOOD = textwrap.dedent(
    """
    import collections, socket, sys, time
    host, secs = sys.argv[1], float(sys.argv[2])
    idle = []
    for _ in range(16):
        s = socket.create_connection((host, 47800), timeout=5); idle.append(s)
    print("ready", flush=True)
    n, t0, open_ = 0, time.monotonic(), collections.deque()
    while time.monotonic() - t0 < secs:
        now = time.monotonic()
        due = int((now - t0) * 1000)
        while n < due:  # non-blocking: a connect does not wait for the one before
            s = socket.socket(); s.setblocking(False)
            s.connect_ex((host, 47800)); open_.append((now, s)); n += 1
        while open_ and now - open_[0][0] > 0.02:  # closed once its handshake is through
            open_.popleft()[1].close()
        time.sleep(0.001)
    print(n / (time.monotonic() - t0), flush=True)
    """
)
JOIN_CLIENT = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    from det_local.federate import transport
    from det_local.federate.transport import Me
    key = bytes.fromhex(sys.argv[1]); host = sys.argv[2]
    async def main():
        hs = []
        for i in range(20):
            t0 = time.perf_counter()
            r, w = await asyncio.open_connection(host, 47800)
            me = Me(f"joiner{i}", key, os.urandom(8).hex(), 47800)
            s, _ = await transport.client_handshake(r, w, me, host)
            hs.append(time.perf_counter() - t0)
            s.close()
        print(json.dumps(hs))
    asyncio.run(main())
    """
)


def joins(node, server, key: bytes) -> list[float]:  # type: ignore[no-untyped-def]
    res = node.in_ns(
        "env",
        f"PYTHONPATH={REPO}",
        sys.executable,
        "-c",
        JOIN_CLIENT,
        key.hex(),
        server.addr,
        timeout=120,
    )
    if res.returncode != 0:
        raise SystemExit(res.stderr[-2000:])
    return list(json.loads(res.stdout.strip().splitlines()[-1]))


def reattach(n1, n2) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(from its federation on, from its pid file) until both list each other alive."""
    n2.kill()
    n2.start(DET_LOCAL_MDNS="0", DET_LOCAL_PEERS=f"{n1.addr}:47800")
    t0 = time.monotonic()  # its daemon is up (pid file written)

    def federating() -> bool:
        try:
            return request(Paths(n2.home), {"t": "status"}, timeout=2)["federation"] == "on"
        except Exception:
            return False

    wait(federating, 60)
    t1 = time.monotonic()
    wait(lambda: states(n1.home).get("n2") == "alive" and states(n2.home).get("n1") == "alive", 30)
    return time.monotonic() - t1, time.monotonic() - t0


def flood_figures(root: Path) -> dict[str, float]:
    key = keys.new_key()
    with Net(root) as net:
        n1 = net.node(1, key).start(DET_LOCAL_MDNS="0")
        n2 = net.node(2, key).start(DET_LOCAL_MDNS="0", DET_LOCAL_PEERS=f"{n1.addr}:47800")
        attacker, newcomer = net.node(3), net.node(4)
        wait(lambda: states(n1.home).get("n2") == "alive", 30)
        calm_known, calm_new = joins(n2, n1, key), joins(newcomer, n1, key)
        calm_reattach = reattach(n1, n2)
        before = n1.log_text().count(attacker.addr)
        flood = subprocess.Popen(
            ["ip", "netns", "exec", attacker.ns, sys.executable, "-c", FLOOD, n1.addr, "25"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert flood.stdout is not None
        assert flood.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # the flood under way
        known, new = joins(n2, n1, key), joins(newcomer, n1, key)
        flooded_reattach = reattach(n1, n2)
        rate = float(flood.stdout.readline())
        flood.wait(30)
        lines = n1.log_text().count(attacker.addr) - before
    return {
        "flood_connects_per_s": round(rate),
        "flood_join_known_s_max": round(max(known), 3),
        "flood_join_new_s_max": round(max(new), 3),
        "flood_reattach_s": round(flooded_reattach[0], 2),
        "flood_restart_to_alive_s": round(flooded_reattach[1], 2),
        "calm_join_known_s_max": round(max(calm_known), 3),
        "calm_join_new_s_max": round(max(calm_new), 3),
        "calm_reattach_s": round(calm_reattach[0], 2),
        "calm_restart_to_alive_s": round(calm_reattach[1], 2),
        "flood_log_lines": lines,
    }


def contexts_figure(root: Path) -> dict[str, float]:
    from det_local.federate.blobs import MAX_CHUNK, ContextCache, pack_context
    from det_local.federate.shipments import Shipments

    cap = 16 * 2**20
    cache = ContextCache(root / "contexts")
    ship = Shipments(cache, cap, cap, set, lambda _line: None)
    peak = 0
    for i in range(100):
        src = root / f"src{i}"
        src.mkdir()
        (src / "data.bin").write_bytes(os.urandom(2**20))
        packed = pack_context(src, root / "out")
        ship.expect("n2", packed.digest)
        data = packed.path.read_bytes()
        for off in range(0, len(data), MAX_CHUNK):
            chunk = data[off : off + MAX_CHUNK]
            ship.receive("n2", packed.digest, off, len(data), chunk, off + len(chunk) == len(data))
        used = sum(p.stat().st_size for p in cache.root.rglob("*") if p.is_file())
        peak = max(peak, used)
        packed.path.unlink()
    return {"contexts_peak_mb": round(peak / 2**20, 2), "contexts_cap_mb": cap / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", default="discovery,flood,contexts")
    args = parser.parse_args()
    only = set(args.only.split(","))
    if os.geteuid() != 0:
        raise SystemExit("bench/federation.py creates network namespaces: run it as root")
    sweep()
    disc, dead, anchor = [], [], []
    extra: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "flood" in only:
            extra.update(flood_figures(Path(tmp) / "flood"))
            print(f"flood: {extra}", file=sys.stderr)
        if "contexts" in only:
            (Path(tmp) / "ctx").mkdir()
            extra.update(contexts_figure(Path(tmp) / "ctx"))
        for i in range(args.runs if "discovery" in only else 0):
            anchor.append(zeroconf_anchor(Path(tmp) / f"zc{i}"))
            d, k, e = discovery_run(Path(tmp) / f"run{i}")
            disc.append(d)
            dead.append(k)
            if i == 0:
                extra.update(e)
            print(f"run {i}: discovery {d:.2f}s, dead {k:.2f}s, zeroconf {anchor[-1]:.2f}s")
    result: dict[str, float] = {}
    if disc:
        result = {
            "discovery_s_p50": round(statistics.median(disc), 2),
            "discovery_s_p99": round(pct(disc, 0.99), 2),
            "zeroconf_resolve_s_p50": round(statistics.median(anchor), 2),
            "dead_detect_s": round(max(dead), 2),
        }
    result = {**result, **extra, "runs": args.runs}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
