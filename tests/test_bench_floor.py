"""The bench's floor proxies forward requests with their bodies intact, so their CPU per request
is that of a working proxy: the HTTP/1.1 floor (`gateway.bench.floor`), both variants (a task per
request, and the callbacks-only reference), keep-alive POSTs and GETs; the HTTP/2 floor
(`gateway.bench.h2floor`), h2c streams in parallel on one connection, bodies larger than the
flow-control windows both ways; the TLS floor of the handshake storm (`tests.bench.tls_floor`)."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from gateway.bench.procs import MODELS_JSON
from tests.support import ROOT, free_port, wait_for_port
from tests.tls_support import TestCA


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n) if n else b""
        out = b"%s %s %d %s" % (self.command.encode(), self.path.encode(), len(body), body[:16])
        if self.path.startswith("/big"):  # past the client's stream window (64 KiB)
            out += b"x" * 200_000
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
        pass


@pytest.fixture
def upstream() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("extra", [[], ["--callbacks"]], ids=["task-per-request", "callbacks"])
def test_the_floor_proxy_forwards_keep_alive_requests(upstream: int, extra: list[str]) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.bench.floor", "--listen", f"127.0.0.1:{port}"]
    proc = subprocess.Popen([*cmd, "--upstream", f"127.0.0.1:{upstream}", *extra], cwd=ROOT)
    try:
        wait_for_port(port)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            for i in range(20):
                body = b'{"model":"m","n":%d}' % i
                r = client.post("/v1/chat/completions", content=body)
                assert r.status_code == 200
                assert r.content == b"POST /v1/chat/completions %d %s" % (len(body), body[:16])
            r = client.get("/v1/models?x=1")
            assert r.content == b"GET /v1/models?x=1 0 "
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_h2_floor_proxy_forwards_h2c_streams(upstream: int) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.bench.h2floor", "--listen", f"127.0.0.1:{port}"]
    proc = subprocess.Popen([*cmd, "--upstream", f"127.0.0.1:{upstream}"], cwd=ROOT)

    async def run() -> None:
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, http1=False, http2=True, timeout=5) as client:
            bodies = [b'{"model":"m","n":%d}' % i for i in range(20)]
            answers = await asyncio.gather(
                *(client.post("/v1/chat/completions", content=b) for b in bodies)
            )
            for body, r in zip(bodies, answers, strict=True):
                assert r.http_version == "HTTP/2"
                assert r.status_code == 200
                assert r.content == b"POST /v1/chat/completions %d %s" % (len(body), body[:16])
            r = await client.get("/v1/models?x=1")
            assert r.content == b"GET /v1/models?x=1 0 "
            big = b"y" * 150_000  # past the proxy's stream window
            r = await client.post("/big", content=big)
            assert r.content == b"POST /big 150000 " + big[:16] + b"x" * 200_000

    try:
        wait_for_port(port)
        asyncio.run(run())
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_tls_floor_answers_over_sluices_tls_context(tmp_path: Path) -> None:
    """`tests.bench.tls_floor` (the handshake storm's third server) answers a request head over
    TLS 1.3 with the context Sluice's listener builds, then closes the connection."""
    ca = TestCA(tmp_path / "ca")
    cert = ca.server()
    port = free_port()
    cmd = [sys.executable, "-m", "tests.bench.tls_floor", "--listen", f"127.0.0.1:{port}",
           "--cert", str(cert.cert), "--key", str(cert.key)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        wait_for_port(port)
        ctx = ssl.create_default_context(cafile=str(ca.path))
        ctx.set_alpn_protocols(["http/1.1"])
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            ctx.wrap_socket(raw, server_hostname="localhost") as tls,
        ):
            assert tls.version() == "TLSv1.3"
            assert tls.selected_alpn_protocol() == "http/1.1"  # Sluice's ALPN list
            tls.sendall(b"GET /v1/models HTTP/1.0\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := tls.recv(4096):  # ends when the server closes
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert json.loads(body) == json.loads(MODELS_JSON)
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(10)
