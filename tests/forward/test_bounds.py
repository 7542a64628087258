"""Request-lifecycle bounds through both HTTP engines on real sockets: slow uploads cannot hold
upstream connections (buffered bodies have a deadline, streamed uploads a per-backend cap), and
a client that stops reading a stream is cut both ways after idle_s."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from gateway.adapters.engines import start_http
from gateway.app import Gateway
from tests.support import until


@dataclass
class Upstream:
    port: int = 0
    requests: int = 0
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.requests += 1
        if request.path == "/flood":  # an endless fast SSE stream
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            event = b"data: " + b"x" * 65536 + b"\n\n"
            try:
                while True:
                    await resp.write(event)
            except (asyncio.CancelledError, ConnectionError):
                self.cancelled.set()
                raise
        body = await request.read()
        return web.Response(body=b"%d" % len(body))


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
access_log: {{enabled: false}}
limits: {{max_buffered_body_bytes: 1000, max_connections_per_backend: 4,
          max_streamed_uploads_per_backend: 2}}
timeouts: {{body_read_s: 0.5, idle_s: 0.5, connect_s: 1}}
backends:
  - name: up
    endpoints: [{{address: "127.0.0.1:{port}"}}]
routes:
  - name: all
    backend: up
"""


@contextlib.asynccontextmanager
async def proxied(tmp_path: Path, port: int, engine: str) -> AsyncIterator[int]:
    p = tmp_path / "policy.yaml"
    p.write_text(POLICY.format(port=port))
    gw = Gateway(p)
    listener = await start_http(gw, "127.0.0.1", 0, engine=engine)
    try:
        yield listener.port
    finally:
        await listener.close(1.0)
        await gw.aclose()


async def _response(reader: asyncio.StreamReader) -> bytes:
    """One response: the head, then a Content-Length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


async def _slow_upload(port: int, head: bytes, pieces: list[bytes], pause: float) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = asyncio.create_task(_response(reader))
    try:
        writer.write(head)
        for piece in pieces:
            if answer.done():
                break
            with contextlib.suppress(ConnectionError):
                writer.write(piece)
                await writer.drain()
            await asyncio.sleep(pause)
        return await asyncio.wait_for(answer, 5)
    finally:
        answer.cancel()
        writer.close()


async def test_slow_buffered_body_gets_408_without_an_upstream_connection(
    tmp_path: Path, engine: str
) -> None:
    async with upstream() as up, proxied(tmp_path, up.port, engine) as port:
        head = b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n"
        t0 = time.monotonic()
        answer = await _slow_upload(port, head, [b"x"] * 20, 0.2)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert b"body_timeout" in answer
        assert time.monotonic() - t0 < 2.5
        assert up.requests == 0  # the upstream never saw it


async def test_slow_uploads_do_not_starve_other_requests(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, proxied(tmp_path, up.port, engine) as port:
        head = b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        slow = [
            asyncio.create_task(_slow_upload(port, head, [b"1\r\nx\r\n"] * 4, 0.1))
            for _ in range(12)  # three times the connection limit
        ]
        await asyncio.sleep(0.15)
        async with aiohttp.ClientSession() as c:
            for _ in range(5):
                async with c.post(f"http://127.0.0.1:{port}/x", data=b"abc") as r:
                    assert r.status == 200
                    assert await r.read() == b"3"
        answers = await asyncio.gather(*slow)
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers)


async def test_streamed_uploads_are_capped_per_backend(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, proxied(tmp_path, up.port, engine) as port:
        big = b"x" * 2000  # above max_buffered_body_bytes: streamed
        head = b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 4000\r\n\r\n"
        held = [asyncio.create_task(_slow_upload(port, head, [big, big], 0.35)) for _ in range(2)]
        await until(lambda: up.requests, ok=lambda n: n == 2, interval=0.01, what="both streaming")
        answer = await _slow_upload(port, head, [big, big], 0.0)
        assert answer.startswith(b"HTTP/1.1 503 ")
        assert b"uploads_busy" in answer
        async with (  # small requests still go through
            aiohttp.ClientSession() as c,
            c.post(f"http://127.0.0.1:{port}/x", data=b"abcd") as r,
        ):
            assert r.status == 200
        for a in await asyncio.gather(*held):
            assert a.startswith(b"HTTP/1.1 200 ")
            assert a.endswith(b"4000")


async def test_client_that_stops_reading_a_stream_is_cut_both_ways(
    tmp_path: Path, engine: str
) -> None:
    async with upstream() as up, proxied(tmp_path, up.port, engine) as port:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, b"GET /flood HTTP/1.1\r\nHost: a\r\n\r\n")
        await loop.sock_recv(sock, 100)  # the head arrived; from now on the client reads nothing
        t0 = time.monotonic()
        await asyncio.wait_for(up.cancelled.wait(), 10)
        took = time.monotonic() - t0
        assert took < 5.0  # idle_s 0.5 plus the time to fill the socket buffers
        with contextlib.suppress(BlockingIOError, ConnectionError):
            while sock.recv(1 << 20):  # what was in flight, then the close
                pass
        sock.close()
