"""The native HTTP engine's listener: binds the socket, owns the open connections, and drains
them on close. Connections are `conn.H1Conn`; requests `exchange.H1Handler`; a connection that
opens with the HTTP/2 preface (or negotiates `h2` by ALPN) becomes a connection of the
listener's `H2Server` (the `gateway.adapters.h2` engine)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from gateway.adapters.h2 import H2HttpHandler, H2Server
from gateway.adapters.native.conn import H1Conn
from gateway.adapters.native.exchange import H1Handler
from gateway.adapters.native.messages import OutBatch
from gateway.forward.http import HttpForward
from gateway.tls.listener import server_tls

if TYPE_CHECKING:
    from gateway.app import Gateway


class H1Server:
    """Settings read at start, the request handler and the open connections of one listener."""

    def __init__(self, gateway: Gateway, loop: asyncio.AbstractEventLoop) -> None:
        policy = gateway.active.policy.policy
        self.loop = loop
        self.limits = policy.limits
        self.header_read_s = policy.timeouts.header_read_s
        self.keepalive_s = policy.timeouts.keepalive_s
        self.handler = H1Handler(HttpForward(gateway, loop))
        self.conns: set[H1Conn] = set()
        self.out = OutBatch(loop)  # small complete answers of one loop turn, written together
        self.mtls = False  # client certificates are verified: connections read their identity
        # HTTP/2 on the same listener: h2c with prior knowledge, h2 when ALPN selects it.
        self.h2 = H2Server(
            loop,
            H2HttpHandler(self.handler.forward),
            policy.limits.http2,
            self.header_read_s,
            self.keepalive_s,
        )

    def __call__(self) -> H1Conn:
        return H1Conn(self)


class NativeListener:
    """A bound native HTTP listener: the same interface as `HttpListener`."""

    def __init__(self, server: asyncio.Server, h1: H1Server) -> None:
        self._server: asyncio.Server | None = server
        self._h1 = h1
        self.port: int = int(server.sockets[0].getsockname()[1]) if server.sockets else 0

    async def stop_accepting(self) -> None:
        """Close the listening socket; open connections keep being served (HTTP/2 ones get the
        first GOAWAY of the graceful two)."""
        if self._server is not None:
            server, self._server = self._server, None
            server.close()
        h2 = self._h1.h2
        h2.draining = True
        for conn in list(h2.conns):
            conn.drain()

    async def close(self, timeout: float) -> None:
        """Stop accepting, close idle connections, give requests `timeout` s, then cut the rest."""
        await self.stop_accepting()
        conns = self._h1.conns
        for conn in list(conns):
            conn.shutdown()
        tasks = [c.task for c in conns if c.task is not None]
        h2conns = self._h1.h2.conns
        tasks += [s.task for c in h2conns for s in c.streams.values() if s.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        for conn in list(conns):
            if conn.transport is not None:
                conn.transport.abort()
        for h2conn in list(h2conns):
            h2conn.shutdown()
        await asyncio.sleep(0)  # let connection_lost run


async def start_native(
    gateway: Gateway, host: str, port: int, *, reuse_port: bool = False
) -> NativeListener:
    """Bind the native HTTP ingress. Limits and timeouts come from the policy at start."""
    loop = asyncio.get_running_loop()
    h1 = H1Server(gateway, loop)
    policy = gateway.active.policy.policy
    tls = server_tls(gateway.services, policy.listeners.http)
    if tls is not None:
        h1.mtls = tls.verifies_clients
    server = await loop.create_server(
        h1,
        host,
        port,
        reuse_port=reuse_port or None,
        backlog=1024,
        ssl=tls.context if tls is not None else None,
        ssl_handshake_timeout=policy.timeouts.tls_handshake_s if tls is not None else None,
    )
    return NativeListener(server, h1)
