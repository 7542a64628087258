"""A soak as an operator runs one (not part of the test run):

    .venv/bin/python -m tests.bench.soak [--duration 600] [--every 30] [--engine native|aiohttp]

Starts the simulated backend (no delays) and one gateway (the HTTP engine named, gRPC on the
h2 engine, access log on, the bench policy), then drives it for `duration` seconds with wrk (16
connections posting small chat completions) and h2load (2 connections × 8 streams calling a
unary gRPC method over the whole run: long-lived HTTP/2 connections with many streams each).
Every `every` seconds it prints the gateway's RSS (from /proc) and, from `/admin/debug/heap`,
Python's allocated blocks and live objects. At the end: requests served (both loads' counts,
none failed), RSS after the first minute and at the end, and the verdict (target: the end within
10 MB of the first minute's reading).

`--tracemalloc` runs the gateway under tracemalloc (slower) and prints the allocation sites
that grew between readings: the way to find what grows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from gateway.bench.gateways import Setup, Variant, start_gateway, start_mock
from gateway.bench.loads import CHAT_PATH, INFER, grpc_body, post_script
from gateway.bench.procs import Procs

TARGET_MB = 10.0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def heap(admin: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{admin}/admin/debug/heap?top=60"
    with urllib.request.urlopen(url, timeout=60) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def sites(prev: dict[str, Any], cur: dict[str, Any]) -> str:
    before = {s["where"]: s["bytes"] for s in prev["tracemalloc"]["top_sites"]}
    grew = [
        (s["bytes"] - before.get(s["where"], 0), s["where"])
        for s in cur["tracemalloc"]["top_sites"]
    ]
    return ", ".join(f"{w} {d / 1e3:+.0f} kB" for d, w in sorted(grew, reverse=True)[:6] if d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=int, default=600)
    ap.add_argument("--every", type=int, default=30)
    ap.add_argument("--engine", choices=["native", "aiohttp"], default="native")
    ap.add_argument("--tracemalloc", action="store_true")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="sluice-soak-"))
    args = argparse.Namespace(
        gateway_cpus="", load_cpus="", connections=16, no_access_log=False,
        policy_extra=None, workers=1, grpc_connections=2, grpc_streams=8,
    )  # fmt: skip
    procs = Procs(tmp)
    s = Setup(args, procs)
    loads: list[subprocess.Popen[bytes]] = []
    try:
        http, grpc_port, _ = start_mock(s)
        if a.tracemalloc:
            os.environ["PYTHONTRACEMALLOC"] = "1"
        gw, ports = start_gateway(s, http, grpc_port, Variant(a.engine, grpc_engine="h2"), "gw")
        os.environ.pop("PYTHONTRACEMALLOC", None)
        body = tmp / "infer.grpc"
        body.write_bytes(grpc_body())
        run_s = str(a.duration + 5)
        url = f"http://127.0.0.1:{ports['http']}{CHAT_PATH}"
        wrk = ["wrk", "-t1", "-c16", "-d", f"{run_s}s", "-s", str(post_script(tmp)), url]
        h2load = ["h2load", "-t1", "-c2", "-m8", "-D", run_s, "-d", str(body)]
        h2load += ["-H", "content-type: application/grpc", "-H", "te: trailers"]
        h2load += [f"http://127.0.0.1:{ports['grpc']}{INFER}"]
        for cmd in (wrk, h2load):
            loads.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        print(f"soak: {a.engine} engine, gRPC on h2, {a.duration} s (gateway pid {gw.pid})")
        print(f"{'t (s)':>6} {'RSS (MB)':>9} {'blocks':>10} {'objects':>8}")
        t0 = time.monotonic()
        readings: list[tuple[float, float]] = []
        prev = None
        while (t := time.monotonic() - t0) < a.duration:
            time.sleep(min(a.every, max(0.0, a.duration - t)))
            t = time.monotonic() - t0
            h = heap(ports["admin"])
            mb = rss_mb(gw.pid)
            readings.append((t, mb))
            line = f"{t:6.0f} {mb:9.1f} {h['allocated_blocks']:10d} {h['gc_objects']:8d}"
            if prev is not None and h["tracemalloc"]:
                line += "  " + sites(prev, h)
            print(line, flush=True)
            prev = h
        outs = [p.communicate(timeout=120)[0].decode() for p in loads]
        print(
            "wrk:",
            " ".join(x for x in outs[0].splitlines() if "requests in" in x or "Non-2xx" in x),
        )
        print("h2load:", " ".join(x for x in outs[1].splitlines() if x.startswith("requests:")))
        first = next((mb for t, mb in readings if t >= 60), readings[0][1])
        end = readings[-1][1]
        verdict = "ok" if end - first <= TARGET_MB else "OVER"
        print(f"RSS after the first minute {first:.1f} MB, at the end {end:.1f} MB: "
              f"{end - first:+.1f} MB (target ≤ {TARGET_MB:.0f}): {verdict}")  # fmt: skip
        return 0 if verdict == "ok" else 1
    finally:
        for p in loads:
            if p.poll() is None:
                p.kill()
        procs.stop_all()


if __name__ == "__main__":
    sys.exit(main())
