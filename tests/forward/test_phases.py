"""The body and response phases and verdict headers, through both HTTP engines on real sockets:
a Gateway from a policy file, the engine on port 0, a real upstream (aiohttp, or a raw socket
server for broken heads) and an aiohttp client. A probe filter is put into the chain."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.adapters.engines import start_http
from gateway.app import Gateway
from gateway.context import EventKind, RequestContext, Status, StreamEvent
from gateway.core.body import RequestBody
from gateway.core.outcome import Outcome
from gateway.core.verdict import reject
from gateway.filters.chain import Chain
from gateway.filters.request_id import RequestIdFilter
from gateway.filters.routing import RouteFilter
from gateway.snapshot import Snapshot

USAGE = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}


@dataclass
class Upstream:
    port: int = 0
    bodies: list[bytes] = field(default_factory=list)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        raw = await request.read()
        self.bodies.append(raw)
        if request.path == "/v1/chat/completions":
            doc = json.loads(raw)
            if not doc.get("stream"):
                return web.json_response({"choices": [{"text": "hi"}], "usage": USAGE})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i)
            if (doc.get("stream_options") or {}).get("include_usage"):
                await resp.write(b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode())
                await resp.write(b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        if request.path == "/die":  # an SSE stream whose backend dies mid-way
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.abort()
            return resp
        return web.Response(body=raw, content_type="application/octet-stream")


@contextlib.asynccontextmanager
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    runner = web.ServerRunner(web.Server(up.handle))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    up.port = runner.addresses[0][1]
    try:
        yield up
    finally:
        await runner.cleanup()


class Probe:
    """A test filter with every phase: records what it saw, rewrites or cuts on demand."""

    name = "probe"

    def __init__(self) -> None:
        self.bodies: list[RequestBody] = []
        self.events: list[StreamEvent] = []
        self.ended: list[RequestContext] = []
        self.rewrite: dict[str, Any] = {}
        self.ask_usage = False
        self.cut_after_sse = 0
        self.reject_headers = False

    def on_request(self, ctx: RequestContext) -> Status:
        if self.reject_headers:
            v = reject(401, 16, "unauthorized", "no", headers=(("www-authenticate", "Bearer"),))
            return ctx.stop(v)
        ctx.response_headers.append(("x-probe", "1"))
        return Status.CONTINUE

    def on_body(self, ctx: RequestContext, body: RequestBody) -> Status:
        self.bodies.append(body)
        for k, v in self.rewrite.items():
            body.set(k, v)
        if self.ask_usage and body.stream and not body.wants_usage:
            body.set("stream_options", {"include_usage": True})
            body.usage_added = True
        return Status.CONTINUE

    def on_event(self, ctx: RequestContext, event: StreamEvent) -> Status:
        self.events.append(event)
        sse = [e for e in self.events if e.kind is EventKind.SSE]
        if self.cut_after_sse and len(sse) >= self.cut_after_sse:
            return ctx.stop(reject(429, 8, "token_overrun", "token budget exceeded"))
        return Status.CONTINUE

    def on_response(self, ctx: RequestContext) -> None:
        self.ended.append(ctx)


POLICY = """
version: 1
listeners: {{http: null, grpc: null, admin: null}}
limits: {{max_buffered_body_bytes: 4096, max_body_bytes: 100000}}
access_log: {{enabled: false}}
backends:
  - name: up
    endpoints: [{{address: "127.0.0.1:{port}"}}]
routes:
  - name: all
    backend: up
"""


@contextlib.asynccontextmanager
async def proxied(
    tmp_path: Path, port: int, engine: str
) -> AsyncIterator[tuple[Probe, aiohttp.ClientSession]]:
    p = tmp_path / "policy.yaml"
    p.write_text(POLICY.format(port=port))
    gw = Gateway(p)
    probe = Probe()
    compiled = gw.active.policy
    chain = Chain([RequestIdFilter(), probe, RouteFilter(compiled)])
    gw.holder.active = Snapshot(compiled, chain)
    listener = await start_http(gw, "127.0.0.1", 0, engine=engine)
    session = aiohttp.ClientSession(f"http://127.0.0.1:{listener.port}")
    try:
        yield probe, session
    finally:
        await session.close()
        await listener.close(1.0)
        await gw.aclose()


CHAT = {"model": "m1", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 40}]}


async def test_body_phase_sees_fields_and_rewrite_reaches_backend(
    tmp_path: Path, engine: str
) -> None:
    async with upstream() as up, proxied(tmp_path, up.port, engine) as (probe, c):
        probe.rewrite = {"max_tokens": 7}
        big = 123456789012345678901234567890  # past 64 bits: the rewrite must keep it
        async with c.post("/v1/chat/completions", json={**CHAT, "seed": big}) as r:
            assert r.status == 200
            assert r.headers["x-probe"] == "1"
            await r.read()
        assert json.loads(up.bodies[-1])["seed"] == big
        (b,) = probe.bodies
        assert (b.model, b.max_tokens, b.stream, b.prompt_chars) == ("m1", 5, False, 40)
        assert b.prompt_tokens_estimate == 10
        assert json.loads(up.bodies[-1])["max_tokens"] == 7


@pytest.mark.parametrize(
    "raw",
    [
        b"not json at all",
        b'{"model": "m", "max_tokens": ',  # malformed
        b"x" * 5000,  # above the buffer cap: streamed, never parsed
        bytes(range(256)) * 30,
    ],
)
async def test_body_phase_passes_other_bodies_byte_for_byte(
    tmp_path: Path, engine: str, raw: bytes
) -> None:
    async with upstream() as up, proxied(tmp_path, up.port, engine) as (probe, c):
        probe.rewrite = {"max_tokens": 7}  # must not apply to an opaque body
        async with c.post("/echo", data=raw, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200
            assert await r.read() == raw
        assert up.bodies[-1] == raw
        (b,) = probe.bodies
        assert not b.parsed and b.size == len(raw)


async def test_response_phase_usage_json_and_sse(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, proxied(tmp_path, up.port, engine) as (probe, c):
        async with c.post("/v1/chat/completions", json=CHAT) as r:
            await r.read()
        stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        async with c.post("/v1/chat/completions", json=stream) as r:
            body = await r.read()
        assert b'"usage"' in body  # the client asked for it: it sees it
        u1, u2 = (ctx.usage for ctx in probe.ended)
        assert u1 is not None and u1.total_tokens == 14
        assert u2 is not None and u2.completion_tokens == 3
        kinds = [e.kind for e in probe.events]
        assert kinds.count(EventKind.JSON) == 1 and kinds.count(EventKind.SSE) == 4


async def test_usage_asked_by_sluice_is_hidden_from_the_client(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, proxied(tmp_path, up.port, engine) as (probe, c):
        probe.ask_usage = True
        async with c.post("/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            body = await r.read()
        assert json.loads(up.bodies[-1])["stream_options"] == {"include_usage": True}
        assert b'"usage"' not in body and body.endswith(b"data: [DONE]\n\n")
        assert body.count(b"data: ") == 4  # three deltas and [DONE]
        assert probe.ended[-1].usage is not None


def _events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


async def test_filter_cut_stream_ends_with_error_event(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, proxied(tmp_path, up.port, engine) as (probe, c):
        probe.cut_after_sse = 2
        async with c.post("/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status == 200
            body = await r.read()  # a complete chunked body: no ClientPayloadError
        events = _events(body)
        assert events[-1] == b"data: [DONE]"
        err = json.loads(events[-2].removeprefix(b"data: "))
        assert err["error"]["type"] == "token_overrun"
        assert len(events) == 3  # the first delta, the error, [DONE]
        assert probe.ended[-1].outcome is Outcome.STREAM_CUT


async def test_upstream_killed_mid_stream_ends_with_error_event(
    tmp_path: Path, engine: str
) -> None:
    async with upstream() as up, proxied(tmp_path, up.port, engine) as (probe, c):
        async with c.post("/die", data=b"{}") as r:
            assert r.status == 200
            body = await asyncio.wait_for(r.read(), 5)
        events = _events(body)
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2].removeprefix(b"data: "))["error"]["type"] == (
            "upstream_protocol_error"
        )
        assert probe.ended[-1].outcome is Outcome.UPSTREAM_PROTOCOL


async def test_verdict_headers_on_http(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, proxied(tmp_path, up.port, engine) as (probe, c):
        probe.reject_headers = True
        async with c.get("/x") as r:
            assert r.status == 401
            assert r.headers["www-authenticate"] == "Bearer"
            assert (await r.json())["error"]["type"] == "unauthorized"
        assert probe.ended[-1].outcome is Outcome.REJECTED


@contextlib.asynccontextmanager
async def raw_upstream(answer: bytes) -> AsyncIterator[int]:
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
            await reader.read()  # until the gateway closes its side
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for w in writers:
            w.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 600 Weird\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.1 200 O\x01K\x7f\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nx-bad: a\x01b\r\ncontent-length: 2\r\n\r\nok",
    ],
)
async def test_invalid_upstream_heads_are_502(tmp_path: Path, engine: str, answer: bytes) -> None:
    async with raw_upstream(answer) as port, proxied(tmp_path, port, engine) as (probe, c):
        async with c.get("/x") as r:
            status, reason = r.status, r.reason
            await r.read()
        if b" 600 " in answer or b"x-bad" in answer:
            assert status == 502
            assert probe.ended[-1].outcome is Outcome.UPSTREAM_PROTOCOL
        else:  # a reason phrase is never passed on: the status line is written from the code
            assert status == 200 and reason == "OK"


async def test_upstream_header_bytes_pass_unchanged(tmp_path: Path, engine: str) -> None:
    answer = b"HTTP/1.1 200 OK\r\nx-latin: caf\xe9\r\ncontent-length: 2\r\n\r\nok"
    async with raw_upstream(answer) as port, proxied(tmp_path, port, engine) as (_, c):
        host, gw_port = c._base_url.host, c._base_url.port  # type: ignore[union-attr]
        reader, writer = await asyncio.open_connection(host, gw_port)
        writer.write(b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    assert data.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nx-latin: caf\xe9\r\n" in data
