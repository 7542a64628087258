"""HTTP/2 floods against a live gateway's gRPC port, with and without the eBPF datapath (not part
of the test run; needs root and bcc).

    .venv/bin/python tests/bench/bench_floods.py [--flood cont|ping] [--connections 4]
        [--duration 15] [--datapath on|off|both]

`sluice serve` runs in a server network namespace (built-in simulated backend, gRPC listener on
the veth); N flood connections come from a client namespace for `duration` seconds each:
`cont` is HEADERS without END_HEADERS then 16 kB CONTINUATION frames for ever, `ping` is PING
frames 500 per write; neither client reads. Printed per run: bytes the clients got accepted,
the gateway's CPU seconds and RSS (before, peak, 5 s after), how each flood connection ended
and after how long, and whether a well-behaved client was served during the flood.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from tests.bench.bench_datapath import Topo, proc_cpu_ns  # noqa: E402

PEER = ROOT / "tests" / "datapath" / "_peer.py"
POLICY = """\
version: 1
listeners:
  http: {host: 127.0.0.1, port: 8090}
  grpc: {host: 0.0.0.0, port: 8091}
  admin: {host: 127.0.0.1, port: 9901}
mock_backend: {enabled: true, ttft_ms: 0, token_delay_ms: 0}
backends:
  - {name: sim, protocol: grpc, endpoints: [{address: "127.0.0.1:18001"}]}
routes:
  - {name: grpc, match: {protocol: grpc}, backend: sim}
datapath: {enabled: DATAPATH, required: true, interface: IFACE, h2c_ports: [8091]}
"""


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def ready(t: Topo) -> bool:
    code = "import urllib.request as u; u.urlopen('http://127.0.0.1:9901/readyz', timeout=1)"
    return subprocess.run(["ip", "netns", "exec", t.s, sys.executable, "-c", code],
                          capture_output=True).returncode == 0  # fmt: skip


def peer(t: Topo, *args: str, timeout: float = 120) -> dict[str, Any]:
    out = subprocess.run(["ip", "netns", "exec", t.c, sys.executable, str(PEER), *args],
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}


def run(t: Topo, datapath: bool, flood: str, conns: int, duration: float) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-floods-"))
    policy = tmp / "policy.yaml"
    policy.write_text(POLICY.replace("DATAPATH", str(datapath).lower()).replace("IFACE", t.sif))
    log = open(tmp / "gateway.log", "wb")  # noqa: SIM115
    gw = subprocess.Popen(["ip", "netns", "exec", t.s, sys.executable, "-m", "gateway", "serve",
                           "--policy", str(policy)], stdout=log, stderr=subprocess.STDOUT,
                          cwd=ROOT)  # fmt: skip
    target = f"{t.srv}:8091"
    try:
        deadline = time.monotonic() + 60
        while not ready(t):
            if gw.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((tmp / "gateway.log").read_text()[-3000:])
            time.sleep(0.3)
        peer(t, "grpc", "--target", target, "-n", "20", "--size", "0")  # warm up
        time.sleep(1)
        rss0, cpu0 = rss_mb(gw.pid), proc_cpu_ns(gw.pid)
        args = {"cont": ["cont", "--size", "16000"], "ping": ["ping", "-n", "500"]}[flood]
        results: list[dict[str, Any]] = []
        threads = [
            threading.Thread(target=lambda: results.append(peer(
                t, *args, "--target", target, "--source", t.other, "--timeout", str(duration))))
            for _ in range(conns)
        ]  # fmt: skip
        for th in threads:
            th.start()
        served: dict[str, Any] = {}

        def good_client() -> None:  # 0.3 s into the floods, 20 unary calls
            time.sleep(0.3)
            g0 = time.monotonic()
            served["ok"] = peer(t, "grpc", "--target", target, "-n", "20", "--size", "0").get("ok")
            served["seconds"] = round(time.monotonic() - g0, 2)

        threads.append(threading.Thread(target=good_client))
        threads[-1].start()
        peak = rss0
        while any(th.is_alive() for th in threads):
            peak = max(peak, rss_mb(gw.pid))
            time.sleep(0.2)
        for th in threads:
            th.join()
        cpu1 = proc_cpu_ns(gw.pid)
        time.sleep(5)
        cpu2, rss2 = proc_cpu_ns(gw.pid), rss_mb(gw.pid)
        return {
            "datapath": datapath,
            "flood": flood,
            "connections": conns,
            "accepted_mb": round(sum(r.get("sent", 0) for r in results) / 2**20, 1),
            "ends": sorted(f"{r.get('outcome')} after {r.get('elapsed')} s" for r in results),
            "gateway_cpu_s": round((cpu1 - cpu0) / 1e9, 2),
            "gateway_cpu_s_5s_after": round((cpu2 - cpu1) / 1e9, 2),
            "rss_mb": {"before": round(rss0), "peak": round(peak), "5s_after": round(rss2)},
            "good_client_during_flood": served,
        }
    finally:
        gw.terminate()
        gw.wait(30)
        log.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--flood", choices=["cont", "ping"], default="cont")
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--datapath", choices=["on", "off", "both"], default="both")
    a = p.parse_args()
    t = Topo()
    try:
        t.up()
        modes = {"on": [True], "off": [False], "both": [False, True]}[a.datapath]
        for dp in modes:
            print(json.dumps(run(t, dp, a.flood, a.connections, a.duration)), flush=True)
    finally:
        from gateway.datapath.loader import detach

        try:
            detach(t.sif, t.s)
        except Exception:  # noqa: BLE001 - the namespace may be gone
            pass
        t.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
