"""Federation figures, measured between real daemons in Linux network namespaces (root).

    sudo python3 bench/federation.py [--runs N]

- discovery_s_p50/p99: 3 daemons started together (mDNS on), from the moment all three
  serve until each lists the other two as alive. Anchor in the same run: raw python-zeroconf,
  register in one namespace and browse-and-resolve in another (zeroconf_resolve_s_p50).
- dead_detect_s: kill -9 of a node until the others mark it dead (target <= 5 s).
- handshake_ms_p50, rtt_ms_p50: TCP connect + mutual HMAC handshake, and a query/reply on an
  authenticated link, from a client in one namespace to a daemon in another.
- idle_peer_cpu_pct, idle_rss_mb: a federated daemon with two peers, idle for 10 s.

Targets: discovery <= 2 s p99, dead <= 5 s, handshake <= 10 ms, rtt <= 1 ms, idle CPU <= 1 %,
RSS <= 80 MB. The machine may be loaded: read the times as upper bounds. The last line printed
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
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from fednet import Net, sweep  # noqa: E402

from det_local.federate import keys  # noqa: E402
from det_local.federate.client import request  # noqa: E402
from det_local.store.paths import Paths  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/federation.py creates network namespaces: run it as root")
    sweep()
    disc, dead, anchor = [], [], []
    extra: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            anchor.append(zeroconf_anchor(Path(tmp) / f"zc{i}"))
            d, k, e = discovery_run(Path(tmp) / f"run{i}")
            disc.append(d)
            dead.append(k)
            extra = extra or e
            print(f"run {i}: discovery {d:.2f}s, dead {k:.2f}s, zeroconf {anchor[-1]:.2f}s")
    result = {
        "discovery_s_p50": round(statistics.median(disc), 2),
        "discovery_s_p99": round(pct(disc, 0.99), 2),
        "zeroconf_resolve_s_p50": round(statistics.median(anchor), 2),
        "dead_detect_s": round(max(dead), 2),
        **extra,
        "runs": args.runs,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
