"""What TLS costs the HTTP listener: `python -m tests.bench.bench_tls [SECONDS] [CONNECTIONS]`.

Starts the simulated backend and two gateways (native engine, default chain, access log off):
one plaintext, one TLS (a private CA's ECDSA P-256 certificate). wrk drives `GET /v1/models`:
keep-alive on both (CPU µs per request in the gateway process, and their ratio; the target is
TLS ÷ plaintext ≤ 1.25), then `Connection: close` on the TLS one and on an nginx TLS proxy to the
same backend with the same certificate (one full handshake per request: handshakes per second
and CPU µs per handshake, Sluice beside nginx). Gateway CPU comes from /proc (utime+stime).
Unpinned: on a shared machine run it twice and take the lower figures.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from gateway.bench.loads import parse_wrk, run_load
from gateway.bench.procs import Procs, cpu_seconds, free_port, http_ok, models_ok, start_nginx
from gateway.bench.procs import wait_until as wait_ready
from gateway.bench.report import Row
from tests.tls_support import TestCA

POLICY = """version: 1
listeners:
  http: {{host: 127.0.0.1, port: {port}, engine: native{tls}}}
  grpc: null
  admin: {{host: 127.0.0.1, port: {admin}}}
access_log: {{enabled: false}}
mock_backend: {{enabled: false}}
backends:
  - {{name: sim, protocol: http, endpoints: [{{address: "127.0.0.1:{backend}"}}]}}
routes:
  - {{name: openai, match: {{protocol: http, path_prefix: /v1/}}, backend: sim}}
"""


def measure(pid: int, url: str, seconds: int, conns: int, extra: list[str]) -> tuple[Row, float]:
    """(wrk's figures, gateway CPU µs per request) for one wrk run."""
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--latency", *extra, url]
    before = cpu_seconds(pid)
    out = run_load(cmd, seconds)
    used = cpu_seconds(pid) - before
    row = Row("tls")
    parse_wrk(out, row)
    return row, used / max(1, row.requests) * 1e6


def main(argv: list[str]) -> int:
    seconds = int(argv[0]) if argv else 5
    conns = int(argv[1]) if len(argv) > 1 else 16
    with tempfile.TemporaryDirectory(prefix="sluice-bench-tls-") as d:
        tmp = Path(d)
        ca = TestCA(tmp / "ca")
        cert = ca.server()
        procs = Procs(tmp)
        try:
            backend = free_port()
            py = [sys.executable, "-m", "gateway"]
            mock = procs.start("backend", [*py, "mock-backend", "--http", f"127.0.0.1:{backend}",
                                           "--no-grpc", "--no-admin"])  # fmt: skip
            wait_ready(
                "backend", lambda: models_ok(f"http://127.0.0.1:{backend}/v1/models"), [mock]
            )
            gateways = {}
            for name, tls in (
                ("plain", ""),
                ("tls", f", tls: {{cert: {cert.cert}, key: {cert.key}}}"),
            ):
                port, admin = free_port(), free_port()
                policy = tmp / f"{name}.yaml"
                policy.write_text(POLICY.format(port=port, admin=admin, backend=backend, tls=tls))
                p = procs.start(
                    name, [*py, "serve", "--policy", str(policy), "--log-level", "WARNING"]
                )
                wait_ready(name, lambda a=admin: http_ok(f"http://127.0.0.1:{a}/readyz"), [p])
                scheme = "https" if tls else "http"
                gateways[name] = (p.pid, f"{scheme}://127.0.0.1:{port}/v1/models")
            for pid, url in gateways.values():  # warm-up
                measure(pid, url, 1, conns, [])
            results = {}
            for name, (pid, url) in gateways.items():
                row, us = measure(pid, url, seconds, conns, [])
                results[name] = us
                print(f"{name:>6} keep-alive: {row.rps:9.0f} req/s  {us:6.1f} µs CPU/req  "
                      f"p50 {row.p50_ms:.2f} ms  failed {row.failed}")  # fmt: skip
            print(f"TLS ÷ plaintext (keep-alive, gateway CPU per request): "
                  f"{results['tls'] / results['plain']:.2f}")  # fmt: skip
            # Full handshakes (one request per connection), Sluice beside an nginx TLS proxy to
            # the same backend with the same certificate (one worker, stock TLS settings).
            nginx, nport = start_nginx(procs, "nginx-tls", "", backend, (cert.cert, cert.key))
            gateways["nginx"] = (nginx.pid, f"https://127.0.0.1:{nport}/v1/models")
            measure(nginx.pid, gateways["nginx"][1], 1, conns, [])  # warm-up
            for name in ("tls", "nginx"):
                pid, url = gateways[name]
                t0 = time.monotonic()
                row, us = measure(pid, url, seconds, conns, ["-H", "Connection: close"])
                label = "Sluice" if name == "tls" else "nginx"
                print(f"{label:>6} handshakes: {row.rps:9.0f} /s  {us:6.1f} µs CPU/handshake"
                      f"+request ({time.monotonic() - t0:.0f} s, failed {row.failed})")  # fmt: skip
        finally:
            procs.stop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
