"""gRPC ingress: a generic grpc.aio proxy for any `/pkg.Service/Method`, raw bytes both ways.

One `GenericRpcHandler` answers every method: a unary handler for methods known to be unary (the
policy's `unary_methods` plus what the backends' server reflection lists), because a stream-stream
handler costs ~65 % more per call; stream-stream for every other method, which carries
unary-stream, stream-unary and stream-stream alike since messages are forwarded as they come.
Per call the adapter only translates (`gateway.adapters.grpcio.exchange`: the call's context as a
`GrpcExchange`); the call's lifecycle, from the chain to the upstream call and the status, is
`gateway.forward.grpc`.

Sluice registers no grpc.health.v1 service of its own on this port: `/grpc.health.v1.Health/*`
is proxied like any other method, so a client's health check reports the backend behind its
route (what a transparent sidecar should do). Sluice's own liveness is on the admin listener.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from gateway.adapters.grpcio.calls import CallAccounting
from gateway.adapters.grpcio.exchange import stream_call, unary_call
from gateway.forward.grpc import GrpcForward
from gateway.tls.listener import listener_tls

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.policy.model import Limits

log = logging.getLogger("sluice.grpc")


MAX_CACHED_HANDLERS = 4096  # method names come from clients: bound what we remember of them


def server_options(limits: Limits) -> list[tuple[str, Any]]:
    """grpc.aio server options from the policy limits (read at start: a reload cannot change
    them on a bound server)."""
    return [
        ("grpc.so_reuseport", 1),  # one process per core shares the port (`sluice serve --workers`)
        ("grpc.max_concurrent_streams", limits.grpc_max_concurrent_streams),
        ("grpc.max_receive_message_length", limits.grpc_max_message_bytes),
        ("grpc.max_send_message_length", limits.grpc_max_message_bytes),
        ("grpc.max_metadata_size", limits.grpc_max_metadata_bytes),
        # Ping-flood defence: pings closer than the interval are strikes; 2 strikes → GOAWAY.
        # Idle keepalive pings at or above the interval are fine (long-lived client channels).
        (
            "grpc.http2.min_ping_interval_without_data_ms",
            int(limits.grpc_keepalive_min_ping_interval_s * 1000),
        ),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.enable_channelz", 0),
        # Not grpc.minimal_stack: on the server it drops the message-size filter, and the
        # max_receive_message_length limit above silently stops being enforced (checked).
    ]


class _Proxy(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """The generic handler: picks the unary or the stream-stream behaviour per method name."""

    def __init__(self, gateway: Gateway, loop: asyncio.AbstractEventLoop) -> None:
        self._forward = GrpcForward(gateway, loop)
        self._calls = CallAccounting()  # calls that end between handler lookup and start
        self.client_certs = False  # the listener verifies client certificates (mTLS)
        self.unary: frozenset[str] = frozenset()
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}  # type: ignore[type-arg]

    def set_unary(self, methods: frozenset[str]) -> None:
        if methods != self.unary:
            self.unary = methods
            self._handlers = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:  # type: ignore[type-arg]
        self._calls.looked_up()  # in the call's task: one that ends before the handler counts
        method: str = handler_call_details.method
        handler = self._handlers.get(method)
        if handler is None:
            fwd, calls, certs = self._forward, self._calls, self.client_certs
            if method in self.unary:
                handler = grpc.unary_unary_rpc_method_handler(
                    functools.partial(unary_call, fwd, calls, certs, method)
                )
            else:
                handler = grpc.stream_stream_rpc_method_handler(
                    functools.partial(stream_call, fwd, calls, certs, method)
                )
            if len(self._handlers) < MAX_CACHED_HANDLERS:
                self._handlers[method] = handler
        return handler


async def start_grpcio(
    gateway: Gateway, host: str, port: int
) -> tuple[grpc.aio.Server, int, _Proxy]:
    """Bind and start grpc.aio's server with the generic handler: the server, the bound port and
    the handler (which methods it serves as unary)."""
    policy = gateway.active.policy.policy
    proxy = _Proxy(gateway, asyncio.get_running_loop())
    proxy.set_unary(gateway.active.policy.unary_methods)
    options = server_options(policy.limits)
    tls_cfg = policy.listeners.grpc.tls if policy.listeners.grpc is not None else None
    if tls_cfg is not None:
        ms = int(policy.timeouts.tls_handshake_s * 1000)
        options.append(("grpc.server_handshake_timeout_ms", ms))
    server = grpc.aio.server(migration_thread_pool=None, handlers=[proxy], options=options)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if tls_cfg is None:
        bound = server.add_insecure_port(address)
    else:
        tls = listener_tls(gateway.services, "grpc", tls_cfg)
        bound = server.add_secure_port(address, tls.grpc_credentials())
        proxy.client_certs = tls.verifies_clients
    await server.start()
    return server, bound, proxy
