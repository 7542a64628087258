"""What an HTTP/2 flood costs the other clients of a live gateway (not part of the test run):

    .venv/bin/python -m tests.bench.bench_h2_floods [--duration 5] [--rounds 3] [--rate 50]
        [--only NAME] [--target http|grpc]

Starts the simulated backend (no delays) and one gateway with the datapath off: the HTTP listener
on the native engine (h2c with prior knowledge) and the gRPC listener on the HTTP/2 engine
(`engine: h2`), access log off. For each flood of the attack table, on each port: a well-behaved
client (httpx with HTTP/2 on the HTTP port, grpcio on the gRPC port) sends one request every
1/rate s, for `duration` s of quiet, then for `duration` s while an attacker process floods the
same port, reconnecting each time the gateway closes it; `rounds` times, the samples of each kind
pooled (one phase's p99 is its third or fifth slowest request: it moved by half from one run to
the next). Printed per flood:
- the client's p99 quiet and under the flood, and their ratio (target ≤ 2);
- the p99 of the gateway's own time in those answers, quiet / flooded (`x-sluice-overhead-ms`:
  from the request's start to its answer's head, the upstream's wait left out);
- the gateway's RSS growth (the largest of the rounds' peak while flooding minus before, from
  /proc/PID/status VmRSS; target ≤ 20 MB);
- how many attacking connections were closed, and the slowest close (target ≤ 2 s);
- the gateway's CPU while flooded (in cores, from /proc), and failed client requests.

The attacker is a child process (`--attack`) so that its send loop does not share a GIL with the
measuring client. Every loop is bounded by `duration` (a connection that is never closed is
given up after 5 s). Loopback only. On a 2-core machine the attacker alone keeps a core busy, and
the client, the backend and the gateway share what is left: the flooded p99 is the machine's as
much as the gateway's (the own time tells them apart). Run it twice.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gateway.bench.procs import Procs, cpu_seconds, free_port, http_ok, wait_until
from gateway.proto import load
from tests.integration.h2_support import CHAT, RawH2
from tests.integration.test_grpc_h2_attacks import COLLECT, GRPC_HEADERS
from tests.integration.test_h2_attacks import ATTACKS, flood
from tests.support import wait_for_port

pb2, pb2_grpc = load()

POLICY = """version: 1
listeners:
  http: {{host: 127.0.0.1, port: {http}, engine: native}}
  grpc: {{host: 127.0.0.1, port: {grpc}, engine: h2}}
  admin: {{host: 127.0.0.1, port: {admin}}}
limits: {{grpc_max_concurrent_streams: 100}}
access_log: {{enabled: false}}
mock_backend: {{enabled: false}}
backends:
  - {{name: sim-http, protocol: http, endpoints: [{{address: "127.0.0.1:{be_http}"}}]}}
  - name: sim-grpc
    protocol: grpc
    endpoints: [{{address: "127.0.0.1:{be_grpc}"}}]
    unary_methods: [/sluice.inference.v1.Inference/Infer]
routes:
  - {{name: grpc, match: {{protocol: grpc}}, backend: sim-grpc}}
  - {{name: openai, match: {{protocol: http, path_prefix: /}}, backend: sim-http}}
"""

# The attack table's floods (tests/integration/test_h2_attacks.py), in the order.
FLOODS = ["continuation", "ping_never_read", "settings", "empty_data", "rapid_reset", "streams"]
TARGETS = ["http", "grpc"]
HEADER = (
    "port flood            p99q(ms)  p99f(ms)  ratio  own q/f(ms)  RSS+(MB)  conns  close(s)   CPU"
    " fail"
)
OWN = "x-sluice-overhead-ms"


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


# ---------------------------------------------------------------------------- attacker


def stream_exhaustion(target: str) -> Callable[[RawH2], Callable[[int], bytes]]:
    """Batches of 50 streams that never send their body (calls that never send a message on
    the gRPC port): 100 are held open, the rest are refused until the gateway sends GOAWAY."""
    path, extra = (COLLECT, GRPC_HEADERS) if target == "grpc" else ("/v1/chat/completions", [])

    def make(conn: RawH2) -> Callable[[int], bytes]:
        return lambda i: b"".join(
            conn.headers(1 + 2 * (50 * i + k), "POST", path, False, extra=extra) for k in range(50)
        )

    return make


def attack(port: int, target: str, name: str, seconds: float) -> dict[str, float]:
    """Flood `port` with `name` until `seconds` pass, reconnecting after each close; the count
    of connections and their slowest and median close, in seconds."""
    if name == "streams":
        make, pause = stream_exhaustion(target), 0.005
    else:
        _, make, pause = ATTACKS[name]
    closes: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            conn = RawH2(port)
        except OSError:  # e.g. no local port free yet: wait, do not spin
            time.sleep(0.01)
            continue
        closes.append(flood(conn, make(conn), pause))  # itself bounded: 5 s
        conn.close()
    closes.sort()
    return {"connections": len(closes), "max_close_s": closes[-1],
            "median_close_s": closes[len(closes) // 2]}  # fmt: skip


# ---------------------------------------------------------------------------- measuring client


class Client:
    """One request every `1 / rate` s on one connection; the latency of each, or a failure."""

    def __init__(self, target: str, port: int, rate: float) -> None:
        self.target, self.port, self.interval = target, port, 1.0 / rate
        self.latencies: list[float] = []
        self.own: list[float] = []  # the gateway's own time per answer (x-sluice-overhead-ms)
        self.failed = 0

    def run(self, seconds: float) -> None:
        """Request for `seconds`; the samples add to those of earlier runs."""
        if self.target == "http":
            import httpx

            with httpx.Client(http1=False, http2=True, timeout=5) as c:
                url = f"http://127.0.0.1:{self.port}/v1/chat/completions"

                def post() -> str | None:
                    r = c.post(url, json=CHAT)
                    return r.headers.get(OWN, "") if r.status_code == 200 else None

                self._loop(seconds, post)
        else:
            import grpc

            with grpc.insecure_channel(f"127.0.0.1:{self.port}") as ch:
                stub, req = pb2_grpc.InferenceStub(ch), pb2.InferRequest(prompt="x", max_tokens=1)

                def infer() -> str | None:
                    answer, call = stub.Infer.with_call(req, timeout=5)
                    own = dict(call.initial_metadata()).get(OWN, "")
                    return str(own) if answer.usage.total_tokens > 0 else None

                self._loop(seconds, infer)

    def _loop(self, seconds: float, call: Callable[[], str | None]) -> None:
        """`call` answers the gateway's own time (or "" when not said), None when it failed."""
        call()  # the connection is open before timing starts
        start = next_at = time.monotonic()
        while next_at < start + seconds:
            time.sleep(max(0.0, next_at - time.monotonic()))
            t = time.monotonic()
            try:
                own = call()
            except Exception:  # noqa: BLE001 - any failure counts as one
                own = None
            if own is None:
                self.failed += 1
            else:
                self.latencies.append(time.monotonic() - t)
                if own:
                    self.own.append(float(own) / 1000)
            next_at += self.interval  # a fixed schedule: a slow answer is not hidden by a pause


@dataclass
class Row:
    target: str
    flood: str
    p99_quiet_ms: float
    p99_flood_ms: float
    own_quiet_ms: float  # the gateway's own time (x-sluice-overhead-ms), p99
    own_flood_ms: float
    rss_growth_mb: float
    connections: int  # attacking connections the gateway closed
    max_close_s: float
    gateway_cpu: float  # the gateway's CPU while flooded, in cores
    failed: int  # the measuring client's failed requests, quiet and flood

    @property
    def ratio(self) -> float:
        return self.p99_flood_ms / self.p99_quiet_ms

    @property
    def within(self) -> bool:
        return self.ratio <= 2 and self.rss_growth_mb <= 20 and self.max_close_s <= 2

    def __str__(self) -> str:
        return (
            f"{self.target:>4} {self.flood:<16} {self.p99_quiet_ms:9.2f} {self.p99_flood_ms:9.2f} "
            f"{self.ratio:6.2f} {self.own_quiet_ms:5.2f}/{self.own_flood_ms:<5.2f} "
            f"{self.rss_growth_mb:8.1f} {self.connections:6d} "
            f"{self.max_close_s:8.2f} {self.gateway_cpu:5.0%} {self.failed:4d}  "
            f"{'ok' if self.within else 'OVER'}"
        )


def measure(
    gw_pid: int, target: str, port: int, name: str, duration: float, rate: float, rounds: int
) -> Row:
    """`rounds` rounds of quiet then flooded, the client's samples of each kind pooled."""
    quiet, busy = Client(target, port, rate), Client(target, port, rate)
    growth, conns, slowest, cpu_s, flooded_s = 0, 0, 0.0, 0.0, 0.0
    for _ in range(rounds):
        quiet.run(duration)
        rss0 = peak = rss_kb(gw_pid)
        cpu0, t0 = cpu_seconds(gw_pid), time.monotonic()
        cmd = [sys.executable, "-m", "tests.bench.bench_h2_floods", "--attack", name,
               "--target", target, "--port", str(port), "--duration", str(duration)]  # fmt: skip
        attacker = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        th = threading.Thread(target=busy.run, args=(duration,))
        th.start()
        while th.is_alive() or attacker.poll() is None:
            peak = max(peak, rss_kb(gw_pid))
            time.sleep(0.1)
        th.join()
        cpu_s += cpu_seconds(gw_pid) - cpu0
        flooded_s += time.monotonic() - t0
        out, _ = attacker.communicate(timeout=30)
        closes = json.loads(out.strip().splitlines()[-1])
        growth = max(growth, peak - rss0)
        conns += closes["connections"]
        slowest = max(slowest, closes["max_close_s"])
    return Row(
        target, name, p99(quiet.latencies) * 1000, p99(busy.latencies) * 1000,
        p99(quiet.own) * 1000, p99(busy.own) * 1000, growth / 1024, conns, slowest,
        cpu_s / flooded_s, quiet.failed + busy.failed,
    )  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=5.0, help="seconds of quiet, then of flood")
    p.add_argument("--rate", type=float, default=50.0, help="measuring client requests per second")
    p.add_argument("--rounds", type=int, default=3, help="rounds of quiet then flood per row")
    p.add_argument("--only", choices=FLOODS, action="append", help="this flood only (repeatable)")
    p.add_argument("--target", choices=TARGETS, action="append", help="this port only")
    p.add_argument("--attack", choices=FLOODS, help=argparse.SUPPRESS)  # the attacker child
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.attack:
        print(json.dumps(attack(a.port, a.target[0], a.attack, a.duration)), flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="sluice-bench-h2-floods-") as d:
        tmp = Path(d)
        procs = Procs(tmp)
        try:
            py = [sys.executable, "-m", "gateway"]
            be_http, be_grpc = free_port(), free_port()
            backend = procs.start("backend", [
                *py, "mock-backend", "--http", f"127.0.0.1:{be_http}", "--grpc",
                f"127.0.0.1:{be_grpc}", "--no-admin", "--ttft-ms", "0", "--token-delay-ms", "0",
            ])  # fmt: skip
            wait_for_port(be_http)
            wait_for_port(be_grpc)
            ports = {"http": free_port(), "grpc": free_port()}
            admin = free_port()
            policy = tmp / "policy.yaml"
            policy.write_text(POLICY.format(admin=admin, be_http=be_http, be_grpc=be_grpc, **ports))
            gw = procs.start("gateway", [*py, "serve", "--policy", str(policy),
                                         "--log-level", "WARNING"])  # fmt: skip
            wait_until(
                "gateway", lambda: http_ok(f"http://127.0.0.1:{admin}/readyz"), [gw, backend]
            )
            print(
                f"{a.rounds} × ({a.duration:g} s quiet + {a.duration:g} s flood) per row, "
                f"client {a.rate:g} req/s, gateway pid {gw.pid}, "
                f"RSS {rss_kb(gw.pid) / 1024:.0f} MB"
            )
            print(HEADER)
            for target in a.target or TARGETS:
                for name in a.only or FLOODS:
                    row = measure(gw.pid, target, ports[target], name, a.duration, a.rate,
                                  a.rounds)  # fmt: skip
                    print(row, flush=True)
            print(f"gateway RSS after the table: {rss_kb(gw.pid) / 1024:.0f} MB")
        finally:
            procs.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
