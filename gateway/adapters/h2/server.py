"""The HTTP/2 engine's listener side: the per-listener `H2Server` (limits, timeouts, the stream
handler, the open connections) and `serve_h2`, which hands an accepted connection to the engine
(`gateway.adapters.h2.conn.H2Conn`).

For the TLS listener: when the handshake selected ALPN `h2`, call `serve_h2(server, transport)`
from the protocol's `connection_made` (the native engine's `H1Conn.connection_made` does so
already: offering `h2` in the listener's ALPN list is all that is left).
"""

from __future__ import annotations

import asyncio
import typing

from gateway.adapters.h2.conn import H2Conn
from gateway.adapters.h2.stream import H2Stream

if typing.TYPE_CHECKING:
    from gateway.policy.base import Http2Limits

__all__ = ["H2Server", "StreamHandler", "serve_h2"]


class StreamHandler(typing.Protocol):
    """Serves the streams of one listener: HTTP routes (`exchange.H2HttpHandler`) or gRPC
    calls (`grpc.H2GrpcHandler`)."""

    def start(self, conn: H2Conn, stream: H2Stream) -> asyncio.Task[None]:
        """Run the stream in a task of its own; the task calls `conn.stream_done` as it ends."""
        ...


class H2Server:
    """Per listener: the limits and timeouts read at start, the handler, the open connections."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        handler: StreamHandler,
        limits: Http2Limits,
        header_read_s: float,
        keepalive_s: float,
        protocol: str = "http",
    ) -> None:
        self.loop = loop
        self.handler = handler
        self.limits = limits
        self.header_read_s = header_read_s
        self.keepalive_s = keepalive_s
        self.conns: set[H2Conn] = set()
        self.draining = False
        self.mtls = False  # set by a TLS listener that verifies client certificates
        self.protocol = protocol

    def __call__(self) -> H2Conn:
        return H2Conn(self)

    def start(self, conn: H2Conn, stream: H2Stream) -> asyncio.Task[None]:
        return self.handler.start(conn, stream)


def serve_h2(
    server: H2Server, transport: asyncio.BaseTransport, data: bytes = b"", client_cert: str = ""
) -> H2Conn:
    """Hand an accepted connection to the HTTP/2 engine: the native HTTP/1.1 engine calls it on
    an h2c preface (with the bytes read so far), a TLS listener when ALPN selected `h2` (from
    its protocol's `connection_made`, before any byte was read). `client_cert`: the verified
    client certificate's identity, read once by the handing engine."""
    conn = H2Conn(server)
    conn.client_cert = client_cert
    transport.set_protocol(conn)
    conn.connection_made(transport)
    if data:
        conn.data_received(data)
    return conn
