"""The gRPC listener on Sluice's HTTP/2 engine (`listeners.grpc.engine: h2`): binds the socket
(plaintext h2c with prior knowledge, or TLS with ALPN h2 through the listener's `TlsOwner`,
rotated like the HTTP listener's), serves every connection with `conn.H2Conn` under
`limits.http2` (stream concurrency from `limits.grpc_max_concurrent_streams`, no cap on calls
per connection) and every stream
with `grpc.H2GrpcHandler`, and drains with the two-step GOAWAY.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from gateway.adapters.h2.grpc import H2GrpcHandler
from gateway.adapters.h2.guard import MAX_STREAM_ID
from gateway.adapters.h2.server import H2Server
from gateway.forward.grpc import GrpcForward

if TYPE_CHECKING:
    from gateway.app import Gateway


class H2GrpcServer:
    """A bound gRPC listener of the HTTP/2 engine; `stop(grace)` as grpc.aio's server."""

    def __init__(self, server: asyncio.Server, h2: H2Server) -> None:
        self._server: asyncio.Server | None = server
        self.h2 = h2

    async def stop(self, grace: float | None) -> None:
        """Refuse new calls (listening socket closed, the first GOAWAY on each connection),
        let calls in flight run up to `grace`, then the last GOAWAY, and cut what is left."""
        if self._server is not None:
            server, self._server = self._server, None
            server.close()
        h2 = self.h2
        h2.draining = True
        for conn in list(h2.conns):
            conn.drain()
        tasks = [s.task for c in h2.conns for s in c.streams.values() if s.task is not None]
        if tasks and grace:
            await asyncio.wait(tasks, timeout=grace)
        for conn in list(h2.conns):
            conn.shutdown()
        await asyncio.sleep(0)  # let connection_lost run


async def start_h2_grpc(
    gateway: Gateway, host: str, port: int
) -> tuple[H2GrpcServer, int, H2GrpcHandler]:
    """Bind the gRPC listener on the HTTP/2 engine: the server, its port and its handler (whose
    unary method set the listener keeps current)."""
    loop = asyncio.get_running_loop()
    policy = gateway.active.policy.policy
    limits = policy.limits
    handler = H2GrpcHandler(
        GrpcForward(gateway, loop),
        limits.grpc_max_message_bytes,
        policy.timeouts.body_read_s,
        limits.grpc_first_data_wait_s,
    )
    handler.set_unary(gateway.active.policy.unary_methods)
    # gRPC channels are long-lived and carry every call of a client: no calls-per-connection
    # cap (grpc core's server has none; a GOAWAY every 1,000 calls costs a reconnect).
    h2_limits = limits.http2.model_copy(
        update={
            "max_concurrent_streams": limits.grpc_max_concurrent_streams,
            "max_requests_per_connection": MAX_STREAM_ID,
        }
    )
    h2 = H2Server(
        loop, handler, h2_limits, policy.timeouts.header_read_s, policy.timeouts.keepalive_s, "grpc"
    )
    cfg = policy.listeners.grpc
    tls = None
    if cfg is not None and cfg.tls is not None:
        from gateway.tls.listener import listener_tls

        tls = listener_tls(gateway.services, "grpc", cfg.tls)
        h2.mtls = tls.verifies_clients
    server = await loop.create_server(
        h2,
        host,
        port,
        reuse_port=True,  # one process per core shares the port (`sluice serve --workers`)
        backlog=1024,
        ssl=tls.context if tls is not None else None,
        ssl_handshake_timeout=policy.timeouts.tls_handshake_s if tls is not None else None,
    )
    bound = int(server.sockets[0].getsockname()[1]) if server.sockets else 0
    return H2GrpcServer(server, h2), bound, handler
