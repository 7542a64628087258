"""A connection that ends is freed at once, by its objects' reference counts, not left in a
reference cycle for the collector: HTTP/1.1 and HTTP/2 (h2c, and h2 over TLS by ALPN) on the
native engine, HTTP/1.1 on the aiohttp engine, plaintext and TLS, and the upstream connections
a backend closes after each answer. Left to the collector, each closed connection's objects made
it run every few hundred connections (a gateway serving clients that do not keep their
connections).

Counted with the collector off: `gc.get_objects()` lists the instances still alive, which must
fall to none within 3 s of the last connection's end. Each test first checks that the count sees
a connection while it is open, under uvloop (what `sluice serve` runs) and asyncio's own loop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ssl
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvloop

from gateway.adapters.aiohttp.server import _Handler as AiohttpConn
from gateway.adapters.engines import start_http
from gateway.adapters.h2.guard import ServerH2
from gateway.adapters.native.conn import H1Conn
from gateway.app import Gateway
from gateway.upstream.conn import UpstreamConn
from tests.support import until
from tests.tls_support import TestCA

POLICY = """
version: 1
listeners:
  http: {{host: 127.0.0.1, port: 8080{tls}}}
  grpc: null
  admin: null
access_log: {{enabled: false}}
backends: [{{name: up, endpoints: [{{address: "127.0.0.1:{port}"}}]}}]
routes: [{{name: all, backend: up}}]
"""

KINDS = (H1Conn, AiohttpConn, ServerH2, UpstreamConn)
CONNECTIONS = 12
ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n"
    b"Connection: close\r\n\r\nok"
)


def alive() -> dict[str, int]:
    """Instances of the per-connection kinds alive now, by class name."""
    counts = {k.__name__: 0 for k in KINDS}
    for o in gc.get_objects():
        if type(o) in KINDS:
            counts[type(o).__name__] += 1
    return counts


async def answer_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The upstream: one answer per connection, then it closes (`Connection: close`)."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        for line in head.lower().split(b"\r\n"):
            if line.startswith(b"content-length:"):
                await asyncio.wait_for(reader.readexactly(int(line[15:])), 5)
        writer.write(ANSWER)
        await writer.drain()
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path, tls: bool, engine: str
) -> AsyncIterator[tuple[int, ssl.SSLContext | None]]:
    """An upstream that closes after each answer and a gateway of `engine` in front of it:
    (the gateway's port, a client TLS context that trusts it, or None for plaintext)."""
    up = await asyncio.start_server(answer_and_close, "127.0.0.1", 0)
    up_port = up.sockets[0].getsockname()[1]
    client_ctx, tls_cfg = None, ""
    if tls:
        ca = TestCA(tmp_path / "ca")
        cert = ca.server()
        tls_cfg = f", tls: {{cert: {cert.cert}, key: {cert.key}}}"
        client_ctx = ca.client_context()
    p = tmp_path / "policy.yaml"
    p.write_text(POLICY.format(port=up_port, tls=tls_cfg))
    gw = Gateway(p)
    listener = await start_http(gw, "127.0.0.1", 0, engine=engine)
    try:
        yield listener.port, client_ctx
    finally:
        await listener.close(1.0)
        await gw.aclose()
        up.close()
        await up.wait_closed()


async def h1_request(port: int, ctx: ssl.SSLContext | None) -> tuple[int, bytes]:
    """One request with a body on a connection of its own (`Connection: close`): (status,
    body)."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname="localhost" if ctx else None
    )
    try:
        writer.write(
            b"POST /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
        )
        raw = await asyncio.wait_for(reader.read(), 5)
        head, _, body = raw.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


async def h2_request(port: int, ctx: ssl.SSLContext | None) -> tuple[int, bytes]:
    """One request on an HTTP/2 connection of its own (h2c with prior knowledge, or h2 by
    ALPN over TLS): (status, body)."""
    scheme = "https" if ctx else "http"
    verify: ssl.SSLContext | bool = ctx if ctx is not None else False
    async with httpx.AsyncClient(http1=False, http2=True, verify=verify, timeout=5) as c:
        r = await c.post(f"{scheme}://localhost:{port}/x", content=b"{}")
        assert r.http_version == "HTTP/2"
        return r.status_code, r.content


async def check(tmp_path: Path, engine: str, tls: bool, http2: bool) -> None:
    request = h2_request if http2 else h1_request
    first = "H1Conn" if engine == "native" else AiohttpConn.__name__  # accepts the connection
    async with serving(tmp_path, tls, engine) as (port, ctx):
        # The count sees a connection while it is open (one that has sent nothing yet).
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=ctx, server_hostname="localhost" if ctx else None
        )
        await until(alive, 3.0, ok=lambda c: c[first] >= 1)
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()
        await until(alive, 3.0, ok=lambda c: c[first] == 0)
        for _ in range(CONNECTIONS):
            assert await request(port, ctx) == (200, b"ok")
        await until(alive, 3.0, ok=lambda c: not any(c.values()))


LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop,
    "asyncio": asyncio.new_event_loop,
}


def run(loop: str, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    gc.collect()
    gc.disable()
    try:
        with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
            runner.run(main())
    finally:
        gc.enable()


@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
@pytest.mark.parametrize(
    ("engine", "http2"),
    [("native", False), ("native", True), ("aiohttp", False)],
    ids=["native-http1", "native-http2", "aiohttp-http1"],
)
def test_a_closed_connection_is_freed_at_once(
    tmp_path: Path, loop: str, tls: bool, engine: str, http2: bool
) -> None:
    run(loop, lambda: check(tmp_path, engine, tls, http2))
