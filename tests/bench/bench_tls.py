"""What TLS costs the HTTP listener: `python -m tests.bench.bench_tls [SECONDS] [CONNECTIONS]
[CLIENTS]`.

Starts the simulated backend and two gateways (native engine, default chain, access log off):
one plaintext, one TLS (a private CA's ECDSA P-256 certificate). wrk drives `GET /v1/models`
with keep-alive on both (CPU µs per request in the gateway process, and their ratio; the target
is TLS ÷ plaintext ≤ 1.25), then h2load (4 connections × 8 streams) the same way: h2 by ALPN on
the TLS gateway against h2c on the plaintext one (target ≤ 1.25).

Then the handshake storm, Sluice beside an nginx TLS proxy to the same backend, like with like:
the same certificate and key, TLS 1.2 and 1.3 offered by both (nginx 1.22 offers no TLS 1.3
unless told; `procs.nginx_conf`), one session ticket per full handshake, no session cache; the
negotiated version and cipher of each are printed and must match. CLIENTS (8) `openssl s_time`
processes each open one connection after another (`GET` over HTTP/1.0, answered and closed), in
two rows:
- full: `-new`, every connection a full handshake (certificate signature, key exchange), as
  after a deploy, when no client holds a ticket the new process can open;
- resumed: `-reuse`, every connection resumes the previous one's session (a TLS 1.3 ticket:
  the key exchange still runs, no signature and no certificate).
s_time marks each connection new or reused; the row prints both counts, so a resumption that
does not happen shows. wrk cannot make either row: it keeps the session of its last connection
(SSL_clear) and resumes whenever the server issued a ticket.

A third server takes the same storms: the TLS floor (`tests.bench.tls_floor`), uvloop's TLS
transport with the context Sluice's listener builds, answering each request from memory and
closing. It is what the TLS stack Sluice stands on (OpenSSL through Python's `ssl` over memory
BIOs) costs a connection before any HTTP work: `floor ÷ nginx` is the most any server on that
stack can reach against nginx here, and `Sluice ÷ floor` what Sluice's own work leaves of it.

Per row: connections per second, server CPU µs per connection (handshake + request + close,
from /proc utime+stime), and what one core of the server would do at that cost (1e6 ÷ µs). On
a 2-core machine the clients (OpenSSL client handshakes cost more than server ones) cannot keep
a server's core busy, so the rate they reach says little; compare the per-core figures, Sluice
÷ nginx, printed at the end of each row. Unpinned and shared: run it twice, report ranges.
"""

from __future__ import annotations

import re
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway.bench.loads import parse_h2load, parse_wrk, run_load
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
limits: {{http2: {{max_requests_per_connection: 1073741824}}}}  # h2load does not reconnect
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


def measure_h2(pid: int, url: str, seconds: int, tmp: Path) -> tuple[Row, float]:
    """(h2load's figures, gateway CPU µs per request) for one h2load run, 4 connections × 8
    streams: h2c with prior knowledge on an http URL, h2 by ALPN on an https one."""
    log = tmp / f"h2-{time.monotonic_ns()}.tsv"
    cmd = ["h2load", "-t1", "-c4", "-m8", "-D", str(seconds), "--log-file", str(log), url]
    before = cpu_seconds(pid)
    out = run_load(cmd, seconds)
    used = cpu_seconds(pid) - before
    row = Row("h2")
    parse_h2load(out, log, row)
    return row, used / max(1, row.requests) * 1e6


class Storm:
    """One handshake row: connections made (new and reused), their rate, server CPU per one."""

    def __init__(self, new: int, reused: int, seconds: float, cpu_s: float) -> None:
        self.new, self.reused = new, reused
        total = max(1, new + reused)
        self.rate = total / seconds
        self.us = cpu_s / total * 1e6


def storm(pid: int, port: int, mode: str, seconds: int, clients: int) -> Storm:
    """`clients` parallel `openssl s_time -new|-reuse` for `seconds` against 127.0.0.1:`port`;
    each prints `*` for a connection with a full handshake and `r` for a resumed one."""
    cmd = ["openssl", "s_time", "-connect", f"127.0.0.1:{port}", f"-{mode}",
           "-time", str(seconds), "-www", "/v1/models"]  # fmt: skip
    before, t0 = cpu_seconds(pid), time.monotonic()
    runs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(clients)]  # fmt: skip
    outs = [p.communicate(timeout=seconds + 60)[0] for p in runs]
    used, wall = cpu_seconds(pid) - before, time.monotonic() - t0
    marks = "".join(m for out in outs for m in re.findall(r"^[*r]+$", out, re.MULTILINE))
    return Storm(marks.count("*"), marks.count("r"), wall, used)


def negotiated(port: int, ca: Path) -> str:
    """The TLS version and cipher a default client gets from 127.0.0.1:`port`."""
    import socket

    ctx = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        cipher = tls.cipher()
        return f"{tls.version()} {cipher[0] if cipher else '?'}"


def answers(port: int, ca: Path) -> bool:
    """127.0.0.1:`port` completes a TLS handshake (a server starting up)."""
    try:
        negotiated(port, ca)
    except OSError:  # ssl.SSLError is one
        return False
    return True


def main(argv: list[str]) -> int:
    seconds = int(argv[0]) if argv else 5
    conns = int(argv[1]) if len(argv) > 1 else 16
    clients = int(argv[2]) if len(argv) > 2 else 8
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
            gateways, tls_port = {}, 0
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
                tls_port = port if tls else tls_port
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
            if shutil.which("h2load"):  # HTTP/2: h2 over TLS (ALPN) against h2c
                h2 = {}
                for name, (pid, url) in gateways.items():
                    measure_h2(pid, url, 1, tmp)  # warm-up
                    row, us = measure_h2(pid, url, seconds, tmp)
                    h2[name] = us
                    label = "h2" if name == "tls" else "h2c"
                    print(f"{label:>6} keep-alive: {row.rps:9.0f} req/s  {us:6.1f} µs CPU/req  "
                          f"p50 {row.p50_ms or 0:.2f} ms  failed {row.failed}")  # fmt: skip
                print(f"h2 over TLS ÷ h2c (gateway CPU per request; target ≤ 1.25): "
                      f"{h2['tls'] / h2['plain']:.2f}")  # fmt: skip
            # Handshakes (one request per connection), Sluice beside an nginx TLS proxy to the
            # same backend with the same certificate, TLS settings like Sluice's.
            if not shutil.which("openssl"):
                print("openssl not found: no handshake rows")
                return 0
            nginx, nport = start_nginx(procs, "nginx-tls", "", backend, (cert.cert, cert.key))
            fport = free_port()
            floor = procs.start("tls-floor", [sys.executable, "-m", "tests.bench.tls_floor",
                                              "--listen", f"127.0.0.1:{fport}", "--cert",
                                              str(cert.cert), "--key", str(cert.key)])  # fmt: skip
            wait_ready("tls floor", lambda: answers(fport, ca.path), [floor])
            servers = {
                "Sluice": (gateways["tls"][0], tls_port),
                "nginx": (nginx.pid, nport),
                "floor": (floor.pid, fport),
            }
            seen = {name: negotiated(port, ca.path) for name, (_, port) in servers.items()}
            for name, what in seen.items():
                print(f"{name:>6} negotiates {what} (ECDSA P-256 certificate)")
            if len(set(seen.values())) != 1:
                print("warning: the two servers negotiate differently; not like with like")
            for mode, label in (("new", "full"), ("reuse", "resumed")):
                per_core = {}
                for name, (pid, port) in servers.items():
                    storm(pid, port, mode, 1, clients)  # warm-up
                    r = storm(pid, port, mode, seconds, clients)
                    per_core[name] = 1e6 / r.us
                    ratio = ""
                    if name == "nginx":
                        ratio = f"  Sluice ÷ nginx {per_core['Sluice'] / per_core['nginx']:.2f}"
                    elif name == "floor":
                        floor_ = per_core["floor"]
                        ratio = (
                            f"  floor ÷ nginx {floor_ / per_core['nginx']:.2f}, "
                            f"Sluice ÷ floor {per_core['Sluice'] / floor_:.2f}"
                        )
                    print(f"{name:>6} {label:>7}: {r.rate:6.0f} conn/s  {r.us:6.0f} µs CPU/conn  "
                          f"→ {per_core[name]:5.0f}/s on one core  (full {r.new}, resumed "
                          f"{r.reused}){ratio}")  # fmt: skip
        finally:
            procs.stop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
