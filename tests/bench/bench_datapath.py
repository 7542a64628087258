"""Benchmark of the eBPF datapath (not part of the test run; needs root, bcc, nginx, wrk, h2load).

    .venv/bin/python tests/bench/bench_datapath.py [--duration 5] [--rounds 2]

1. Throughput through a veth pair (server netns S <-> client netns C) with and without the
   classifier: wrk (HTTP/1.1 keep-alive) and h2load (h2c, so the HTTP/2 frame parser runs on every
   payload) against nginx in S; req/s and packets/s (client -> server), rounds alternate
   off/on to spread out the noise of a shared machine. The classifier's own cost per packet is
   read from the kernel's BPF run-time statistics (kernel.bpf_stats_enabled, restored after).
2. CPU cost of refusing: a SYN dropped by the classifier (source over its SYN budget) vs a 429
   answered in user space. The 429 side is a minimal aiohttp low-level server (uvloop) returning
   Sluice's 429 JSON body with Retry-After on keep-alive connections: the cheapest a Python
   gateway can refuse; the real gateway does more work per request (routing, limits, logging).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from gateway.datapath.loader import BpfProgram, detach, prog_run_stats  # noqa: E402
from gateway.datapath.maps import Maps  # noqa: E402
from gateway.policy.model import Datapath  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")

SYN_FLOOD = textwrap.dedent(
    """
    import socket, sys, time, json
    host, port, src, dur = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    n, end = 0, time.monotonic() + dur
    while time.monotonic() < end:
        for _ in range(200):
            s = socket.socket()
            s.setblocking(False)
            s.bind((src, 0))
            s.connect_ex((host, port))  # one SYN; close() before any answer: no retransmit
            s.close()
            n += 1
    print(json.dumps({"syns": n}))
    """
)

SERVER_429 = textwrap.dedent(
    """
    import asyncio, sys, uvloop
    from aiohttp import web
    BODY = b'{"error": {"type": "rate_limited", "message": "too many requests"}}'
    async def handler(request):
        return web.Response(status=429, body=BODY, content_type="application/json",
                            headers={"Retry-After": "1"})
    async def main():
        server = web.Server(handler, access_log=None)
        runner = web.ServerRunner(server)
        await runner.setup()
        await web.TCPSite(runner, sys.argv[1], int(sys.argv[2])).start()
        print("ready", flush=True)
        await asyncio.Event().wait()
    uvloop.run(main())
    """
)


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


class Topo:
    def __init__(self) -> None:
        rid = f"{random.randrange(16**6):06x}"
        a, b = random.randrange(100, 250), random.randrange(0, 255)
        self.s, self.c, self.sif, self.cif = (
            f"sluice-b-{rid}-s",
            f"sluice-b-{rid}-c",
            f"s{rid}",
            f"c{rid}",
        )
        self.srv, self.good, self.other = f"10.{a}.{b}.1", f"10.{a}.{b}.2", f"10.{a}.{b}.3"

    def up(self) -> None:
        sh("ip", "netns", "add", self.s)
        sh("ip", "netns", "add", self.c)
        sh("ip", "-n", self.s, "link", "add", self.sif, "type", "veth", "peer", "name", self.cif,
           "netns", self.c)  # fmt: skip
        sh("ip", "-n", self.s, "addr", "add", f"{self.srv}/24", "dev", self.sif)
        sh("ip", "-n", self.c, "addr", "add", f"{self.good}/24", "dev", self.cif)
        sh("ip", "-n", self.c, "addr", "add", f"{self.other}/24", "dev", self.cif)
        for ns, dev in ((self.s, self.sif), (self.c, self.cif)):
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def down(self) -> None:
        sh("ip", "netns", "del", self.s, check=False)
        sh("ip", "netns", "del", self.c, check=False)

    def in_c(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        return sh("ip", "netns", "exec", self.c, *cmd)

    def rx_packets(self) -> int:
        out = sh("ip", "-n", self.s, "-s", "-j", "link", "show", "dev", self.sif).stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["packets"])


@contextmanager
def nginx(t: Topo, tmp: Path) -> Iterator[None]:
    conf = tmp / "nginx.conf"
    conf.write_text(textwrap.dedent(f"""
        worker_processes 1;
        daemon off;
        pid {tmp}/nginx.pid;
        error_log {tmp}/error.log;
        events {{ worker_connections 4096; }}
        http {{
            access_log off;
            keepalive_requests 1000000;
            server {{ listen {t.srv}:8080; location / {{ return 200 "ok"; }} }}
            server {{ listen {t.srv}:8082 http2; location / {{ return 200 "ok"; }} }}
        }}
    """))  # fmt: skip
    p = subprocess.Popen(["ip", "netns", "exec", t.s, "nginx", "-c", str(conf), "-p", str(tmp)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    time.sleep(0.5)
    try:
        yield
    finally:
        p.terminate()
        p.wait(10)


def cpu_busy_ns() -> int:
    """Non-idle CPU time of the whole machine (all CPUs), from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = f[3] + f[4]
    return (sum(f[:8]) - idle) * 1_000_000_000 // HZ


def softirq_ns() -> int:
    """Softirq time of the whole machine: where the veth receive path (and TC) runs."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return f[6] * 1_000_000_000 // HZ


def proc_cpu_ns(pid: int) -> int:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) * 1_000_000_000 // HZ  # utime + stime


def wrk(t: Topo, url: str, d: float) -> float:
    out = t.in_c("wrk", "-t1", "-c32", f"-d{int(d)}s", url).stdout
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]


def h2load(t: Topo, url: str, d: float) -> float:
    out = t.in_c("h2load", "-c16", "-m8", "-t1", f"-D{int(d)}", url).stdout
    return float(re.search(r"finished in .*?, ([\d.]+) req/s", out).group(1))  # type: ignore[union-attr]


def attach(t: Topo, **policy: Any) -> BpfProgram:
    prog = BpfProgram(t.sif, netns=t.s)
    prog.load()
    Maps(prog).apply_policy(Datapath(**policy))
    prog.attach()
    return prog


def throughput(t: Topo, d: float, rounds: int) -> dict[str, Any]:
    """Alternate off/on per tool and round (the program stays loaded; only the filter comes
    and goes), so a shared machine's background load hits both sides alike."""
    res: dict[str, Any] = {"wrk": {"off": [], "on": []}, "h2load": {"off": [], "on": []}}
    bpf_ns: list[float] = []
    wrk(t, f"http://{t.srv}:8080/", 2)  # warm-up: first runs on a fresh nginx are slow
    h2load(t, f"http://{t.srv}:8082/", 2)
    prog = attach(t, h2c_ports=[8080, 8082])
    try:
        for r in range(rounds):
            for tool, fn, url in (("wrk", wrk, f"http://{t.srv}:8080/"),
                                  ("h2load", h2load, f"http://{t.srv}:8082/")):  # fmt: skip
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                for mode in order:
                    if mode == "on":
                        prog.attach()
                    else:
                        detach(t.sif, t.s, unpin=False)
                    rx0, st0 = t.rx_packets(), prog_run_stats(prog.program_fd())
                    t0 = time.monotonic()
                    rps = fn(t, url, d)
                    pps = (t.rx_packets() - rx0) / (time.monotonic() - t0)
                    res[tool][mode].append((rps, pps))
                    st1 = prog_run_stats(prog.program_fd())
                    if mode == "on" and st1[1] > st0[1]:
                        bpf_ns.append((st1[0] - st0[0]) / (st1[1] - st0[1]))
        flows = Maps(prog).flows()
        res["h2_headers_counted"] = sum(f.headers for f in flows if f.dport == 8082)
    finally:
        prog.close()
        detach(t.sif, t.s)
    res["bpf_ns_per_packet"] = bpf_ns
    return res


def refusal(t: Topo, d: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Kernel: every SYN from `other` is over budget (rate 1/s, burst 1).
    prog = attach(t, h2c_ports=[8090])
    try:
        Maps(prog).set_budget((1, 1), (0, 0), source=t.other)
        st0, busy0, sirq0 = prog_run_stats(prog.program_fd()), cpu_busy_ns(), softirq_ns()
        gen = subprocess.Popen(["ip", "netns", "exec", t.c, sys.executable, "-c", SYN_FLOOD,
                                t.srv, "8090", t.other, str(d)],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
        cpu_gen = 0
        while gen.poll() is None:
            cpu_gen = max(cpu_gen, proc_cpu_ns(gen.pid))
            time.sleep(0.1)
        syns = json.loads(gen.stdout.read())["syns"]  # type: ignore[union-attr]
        busy, sirq = cpu_busy_ns() - busy0, softirq_ns() - sirq0
        st1 = prog_run_stats(prog.program_fd())
        drops = Maps(prog).stats()["syn_drop"]
        out["kernel"] = {
            "syns_sent": syns,
            "syn_drops": drops,
            "bpf_ns_per_syn": (st1[0] - st0[0]) / max(1, st1[1] - st0[1]),
            "softirq_ns_per_syn": sirq / max(1, syns),
            "machine_busy_ns_per_syn_incl_generator": busy / max(1, syns),
            "generator_cpu_ns_per_syn": cpu_gen / max(1, syns),
        }
    finally:
        prog.close()
        detach(t.sif, t.s)
    # User space: 429 from a minimal aiohttp server, keep-alive, wrk driving.
    srv = subprocess.Popen(["ip", "netns", "exec", t.s, sys.executable, "-c", SERVER_429,
                            t.srv, "8090"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
        wrk(t, f"http://{t.srv}:8090/", 1)  # warm-up
        c0, busy0, t0 = proc_cpu_ns(srv.pid), cpu_busy_ns(), time.monotonic()
        sirq0 = softirq_ns()
        rps = wrk(t, f"http://{t.srv}:8090/", d)
        el = time.monotonic() - t0
        c1, busy = proc_cpu_ns(srv.pid), cpu_busy_ns() - busy0
        sirq = softirq_ns() - sirq0
        n = rps * d
        out["gateway_429"] = {
            "req_per_s": rps,
            "server_cpu_ns_per_429": (c1 - c0) / n,
            "softirq_ns_per_429": sirq / n,
            "machine_busy_ns_per_429_incl_wrk": busy / (rps * el),
        }
    finally:
        srv.terminate()
        srv.wait(10)
    k, g = out["kernel"], out["gateway_429"]
    out["ratio_server_cpu_429_vs_bpf_syn_drop"] = g["server_cpu_ns_per_429"] / k["bpf_ns_per_syn"]
    out["ratio_429_server_cpu_plus_softirq_vs_syn_drop_softirq"] = (
        g["server_cpu_ns_per_429"] + g["softirq_ns_per_429"]
    ) / max(1.0, k["softirq_ns_per_syn"])
    out["ratio_machine_busy_429_vs_syn_drop"] = (
        g["machine_busy_ns_per_429_incl_wrk"] / k["machine_busy_ns_per_syn_incl_generator"]
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root", file=sys.stderr)
        return 2
    stats_path = Path("/proc/sys/kernel/bpf_stats_enabled")
    stats_before = stats_path.read_text().strip()
    t = Topo()
    try:
        stats_path.write_text("1")
        t.up()
        with tempfile.TemporaryDirectory() as tmp, nginx(t, Path(tmp)):
            thr = throughput(t, a.duration, a.rounds)
        ref = refusal(t, a.duration)
    finally:
        stats_path.write_text(stats_before)
        t.down()

    def avg(xs: list[tuple[float, float]], i: int) -> float:
        return sum(x[i] for x in xs) / len(xs)

    print(f"== throughput through the veth ({a.rounds} rounds x {a.duration:.0f}s, alternating)")
    for tool in ("wrk", "h2load"):
        off, on = thr[tool]["off"], thr[tool]["on"]
        ratios = sorted(x[0] / y[0] for x, y in zip(on, off, strict=True))
        print(f"{tool:7} off: {avg(off, 0):9.0f} req/s {avg(off, 1):9.0f} pkt/s | "
              f"on: {avg(on, 0):9.0f} req/s {avg(on, 1):9.0f} pkt/s | "
              f"req/s on/off per round: {' '.join(f'{x:.3f}' for x in ratios)} "
              f"(median {ratios[len(ratios) // 2]:.3f})")  # fmt: skip
    print(f"load average at the end: {Path('/proc/loadavg').read_text().split()[:3]}")
    ns = thr["bpf_ns_per_packet"]
    print(f"classifier run time per ingress packet: {sum(ns) / len(ns):.0f} ns "
          f"(min {min(ns):.0f}, max {max(ns):.0f}); h2c HEADERS counted in the last "
          f"h2load run: {thr.get('h2_headers_counted')}")  # fmt: skip
    print("== refusing: kernel SYN drop vs user-space 429")
    print(json.dumps(ref, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
