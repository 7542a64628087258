"""HTTP ingress end to end: a real Gateway from a policy file, `start_http` on port 0, an aiohttp
upstream on port 0, and an aiohttp client. No mocks."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from gateway.adapters.aiohttp import HttpListener
from gateway.adapters.engines import start_http
from gateway.adapters.native import NativeListener
from gateway.app import Gateway
from gateway.telemetry.metrics import REGISTRY
from tests.support import free_port


@dataclass
class Upstream:
    port: int = 0
    seen: list[dict[str, str]] = field(default_factory=list)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled_at: float = 0.0

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.seen.append({k.lower(): v for k, v in request.headers.items()})
        if request.path == "/slow":
            await asyncio.sleep(5)
        if request.path == "/sse":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                await resp.write(b"data: 1\n\n")
                await self.gate.wait()
                await resp.write(b"data: 2\n\n")
                await asyncio.sleep(30)  # only a client disconnect ends this early
            except asyncio.CancelledError:
                self.cancelled_at = time.monotonic()
                self.cancelled.set()
                raise
            return resp
        body = await request.read()
        return web.json_response(
            {"path": request.path_qs, "len": len(body), "method": request.method},
            headers={"X-Up": "1", "Connection": "keep-alive, X-Drop-Me", "X-Drop-Me": "1"},
        )


@contextlib.asynccontextmanager
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    runner = web.ServerRunner(web.Server(up.handle, handler_cancellation=True))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    up.port = runner.addresses[0][1]
    try:
        yield up
    finally:
        await runner.cleanup()


POLICY = """
version: 1
listeners: {{http: null, grpc: null, admin: null}}
limits: {{max_body_bytes: 1000, max_header_bytes: 4096, max_header_count: 30,
          max_line_bytes: 2048}}
timeouts: {{first_byte_s: 5, header_read_s: 0.3}}
backends:
  - name: up
    endpoints: [{{address: "127.0.0.1:{port}"}}]
  - name: dead
    endpoints: [{{address: "127.0.0.1:{dead}"}}]
  - name: drained
    endpoints: [{{address: "127.0.0.1:{dead}", weight: 0}}]
routes:
  - name: total
    match: {{path_prefix: /tot}}
    backend: up
    strip_prefix: /tot
    timeouts: {{total_s: 0.3}}
  - name: drained
    match: {{path_prefix: /drained}}
    backend: drained
  - name: slow
    match: {{path_prefix: /slow}}
    backend: up
    timeouts: {{first_byte_s: 0.3}}
  - name: dead
    match: {{path_prefix: /dead}}
    backend: dead
  - name: api
    match: {{path_prefix: /api}}
    backend: up
    strip_prefix: /api
  - name: sse
    match: {{path_prefix: /sse}}
    backend: up
filters: {filters}
access_log: {{enabled: false}}
"""


@contextlib.asynccontextmanager
async def gateway(
    tmp_path: Path, port: int, filters: str = "[request_id, route]", engine: str = "aiohttp"
) -> AsyncIterator[tuple[Gateway, HttpListener | NativeListener, aiohttp.ClientSession]]:
    p = tmp_path / "policy.yaml"
    p.write_text(POLICY.format(port=port, dead=free_port(), filters=filters))
    gw = Gateway(p)
    listener = await start_http(gw, "127.0.0.1", 0, engine=engine)
    session = aiohttp.ClientSession(f"http://127.0.0.1:{listener.port}")
    try:
        yield gw, listener, session
    finally:
        await session.close()
        await listener.close(1.0)
        await gw.aclose()


async def test_plain_proxy_and_headers(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (gw, _, c):
        headers = {
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "secret",
            "Keep-Alive": "timeout=5",
            "X-Forwarded-For": "10.0.0.1",
            "Authorization": "Bearer t",
        }
        async with c.post("/api/v1/chat?x=1", data=b"{}", headers=headers) as r:
            assert r.status == 200
            assert await r.json() == {"path": "/v1/chat?x=1", "len": 2, "method": "POST"}
            assert r.headers["X-Up"] == "1"
            assert len(r.headers["X-Request-Id"]) == 32  # the upstream did not echo it: we add it
            assert "X-Drop-Me" not in r.headers  # named in the upstream's Connection header
        seen = up.seen[-1]
        assert seen["host"] == f"127.0.0.1:{up.port}"
        assert seen["x-forwarded-for"] == "10.0.0.1, 127.0.0.1"
        assert seen["x-forwarded-proto"] == "http"
        assert len(seen["x-request-id"]) == 32
        assert seen["authorization"] == "Bearer t"
        assert "x-hop" not in seen and "keep-alive" not in seen
        for _ in range(3):  # keep-alive both sides
            async with c.get("/api/x") as r:
                assert r.status == 200
        assert gw.inflight.count == 0


async def test_sse_streams_chunk_by_chunk(tmp_path: Path, engine: str) -> None:
    async with (
        upstream() as up,
        gateway(tmp_path, up.port, engine=engine) as (_, _, c),
        c.get("/sse") as r,
    ):
        assert r.headers["Content-Type"] == "text/event-stream"
        first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 2)
        assert first == b"data: 1\n\n"  # arrived while the upstream still waits on the gate
        up.gate.set()
        assert await asyncio.wait_for(r.content.readuntil(b"\n\n"), 2) == b"data: 2\n\n"


async def test_client_disconnect_cancels_upstream(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (gw, _, c):
        r = await c.get("/sse")
        assert await r.content.readuntil(b"\n\n") == b"data: 1\n\n"
        gone = time.monotonic()
        r.close()  # drop the connection mid-stream
        await asyncio.wait_for(up.cancelled.wait(), 1.0)
        assert up.cancelled_at - gone < 1.0
        for _ in range(50):
            if gw.inflight.count == 0:
                break
            await asyncio.sleep(0.02)
        assert gw.inflight.count == 0


async def test_body_limits(tmp_path: Path, engine: str) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"x" * 300

    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, _, c):
        async with c.post("/api/big", data=b"x" * 2000) as r:
            assert r.status == 413
            assert (await r.json())["error"]["type"] == "body_too_large"
        async with c.post("/api/big", data=chunks()) as r:
            assert r.status == 413
        async with c.post("/api/ok", data=b"x" * 1000) as r:
            assert r.status == 200


async def test_oversized_headers_431(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, _, c):
        many = {f"X-H{i}": "v" for i in range(40)}  # over max_header_count (aiohttp's parser)
        async with c.get("/api/x", headers=many) as r:
            assert r.status == 431
        total = {f"X-H{i}": "v" * 1000 for i in range(5)}  # over max_header_bytes (handler)
        async with c.get("/api/x", headers=total) as r:
            assert r.status == 431
            assert (await r.json())["error"]["type"] == "headers_too_large"
        async with c.get("/api/x", headers={"X-Long": "v" * 3000}) as r:  # over max_line_bytes
            assert r.status == 431


async def test_upstream_errors(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, _, c):
        async with c.get("/dead") as r:
            assert r.status == 502
            assert (await r.json())["error"]["type"] == "upstream_connect_error"
        t0 = time.monotonic()
        async with c.get("/slow") as r:
            assert r.status == 504
            assert (await r.json())["error"]["type"] == "upstream_timeout"
        assert time.monotonic() - t0 < 2


async def test_no_route_404(tmp_path: Path, engine: str) -> None:
    # (A chain without `route` is refused by the policy loader; the adapter would answer 404 too.)
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, _, c):
        r = await c.get("/nowhere")
        assert r.status == 404
        assert (await r.json())["error"]["type"] == "no_route"
        r.release()


async def test_drain_closes_connections(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (gw, listener, c):
        gw.draining = True
        async with c.get("/api/x") as r:
            assert r.status == 200
            assert r.headers.get("Connection", "").lower() == "close"
        async with c.get("/nowhere") as r:
            assert r.headers.get("Connection", "").lower() == "close"
        await listener.stop_accepting()
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as fresh:
                await fresh.get(f"http://127.0.0.1:{listener.port}/api/x")


def _finished_by_code() -> collections.Counter[str]:
    """`sluice_requests_total` summed by status code (what `Lifecycle.finish` books once per
    request; collecting the registry flushes the request path's batched counts first)."""
    out: collections.Counter[str] = collections.Counter()
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name == "sluice_requests_total":
                out[sample.labels["code"]] += int(sample.value)
    return out


async def test_finish_runs_once_per_request(tmp_path: Path, engine: str) -> None:
    before = _finished_by_code()
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, _, c):
        for path in ("/api/x", "/dead", "/nowhere"):
            async with c.get(path) as r:
                await r.read()
        deadline = time.monotonic() + 5
        while (_finished_by_code() - before).total() < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # booked in the loop's next turn
        await asyncio.sleep(0.2)  # and never a second time
        assert _finished_by_code() - before == {"200": 1, "502": 1, "404": 1}


async def test_total_timeout(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, _, c):
        async with c.get("/tot/slow") as r:  # no head within total_s: 504
            assert r.status == 504
        async with c.get("/tot/sse") as r:  # head sent, then total_s expires: ends cleanly
            assert r.status == 200
            body = await asyncio.wait_for(r.read(), 3)  # a complete chunked body, no reset
        events = [e for e in body.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        err = json.loads(events[-2].removeprefix(b"data: "))
        assert err["error"]["type"] == "upstream_timeout"


async def test_verdict_retry_after(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, _, c):
        r = await c.get("/drained")
        assert r.status == 503
        assert r.headers["Retry-After"] == "1"
        assert r.headers["X-Request-Id"]
        assert (await r.json())["error"]["type"] == "no_healthy_upstream"
        r.release()


async def test_header_read_deadline(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, listener, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        writer.write(b"GET /api/x HTTP/1.1\r\nHost: a\r\n")  # and never the blank line
        t0 = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 2) == b""  # closed by the gateway
        assert time.monotonic() - t0 < 1.5
        writer.close()


async def test_header_read_deadline_moves_with_each_head(tmp_path: Path, engine: str) -> None:
    """One keep-alive connection sends a whole request every 0.1 s for longer than
    `header_read_s` (0.3 s) and each is answered (the connection's one deadline moves with
    each head, it does not cut the connection at the first head's), then a head that never
    ends is cut at `header_read_s` from its first byte."""
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, listener, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        t0 = time.monotonic()
        answered = 0
        while time.monotonic() - t0 < 1.2:
            await asyncio.sleep(0.1)
            writer.write(b"GET /api/x HTTP/1.1\r\nHost: a\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await asyncio.wait_for(reader.readexactly(length), 2)
            answered += 1
        assert answered >= 8
        await asyncio.sleep(0.2)  # idle, within keepalive_s
        writer.write(b"GET /api/x HTTP/1.1\r\nHost: a\r\n")  # and never the blank line
        t1 = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 2) == b""  # closed by the gateway
        assert 0.25 <= time.monotonic() - t1 < 1.5
        writer.close()
