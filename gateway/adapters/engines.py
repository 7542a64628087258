"""Choosing an ingress engine: the one module that knows them all, through their faces.

`start_http` binds the HTTP listener on the engine the policy names (`listeners.http.engine`:
`native`, the default, or `aiohttp`); `start_grpc` the gRPC listener (`listeners.grpc.engine`:
`h2`, the default, or `grpcio`). Either gRPC engine is wrapped in the same `GrpcListener`, which
keeps the set of methods served as unary current (the policy's `unary_methods` and what the
backends' server reflection lists).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from gateway.adapters.aiohttp import HttpListener, start_aiohttp
from gateway.adapters.grpcio import start_grpcio
from gateway.adapters.h2 import start_h2_grpc
from gateway.adapters.native import NativeListener, start_native

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.policy.compiled import CompiledPolicy, Endpoint

DISCOVERY_TIMEOUT_S = 2.0


async def start_http(
    gateway: Gateway,
    host: str,
    port: int,
    *,
    reuse_port: bool = False,
    engine: str | None = None,
) -> HttpListener | NativeListener:
    """Bind the HTTP ingress. Parser limits and keep-alive come from the policy at start.

    `engine` overrides the policy's `listeners.http.engine` ("native", the default, or
    "aiohttp": same interface and behaviour, dearer)."""
    policy = gateway.active.policy.policy
    if engine is None:
        engine = policy.listeners.http.engine if policy.listeners.http else "native"
    if engine == "native":
        return await start_native(gateway, host, port, reuse_port=reuse_port)
    return await start_aiohttp(gateway, host, port, reuse_port=reuse_port)


async def start_grpc(
    gateway: Gateway, host: str, port: int, engine: str | None = None
) -> GrpcListener:
    """Bind and start the gRPC listener on `engine` (default: the policy's
    `listeners.grpc.engine`); unary discovery runs in the background."""
    policy = gateway.active.policy.policy
    if engine is None:
        engine = policy.listeners.grpc.engine if policy.listeners.grpc is not None else "h2"
    server: Server
    kinds: MethodKinds
    if engine == "h2":
        server, bound, kinds = await start_h2_grpc(gateway, host, port)
    else:
        server, bound, kinds = await start_grpcio(gateway, host, port)
    listener = GrpcListener(gateway, server, bound, kinds)
    listener.start_discovery()
    return listener


class MethodKinds(Protocol):
    """Which methods an engine serves as unary (the grpcio engine's generic handler, or the h2
    engine's `H2GrpcHandler`)."""

    unary: frozenset[str]

    def set_unary(self, methods: frozenset[str]) -> None: ...


class Server(Protocol):
    """A bound engine: grpc.aio's server, or the h2 engine's `H2GrpcServer`."""

    async def stop(self, grace: float | None) -> None: ...


class GrpcListener:
    """The bound gRPC server. `stop(grace)` drains; `refresh_unary()` after policy reloads."""

    def __init__(self, gateway: Gateway, server: Server, port: int, proxy: MethodKinds) -> None:
        self.port = port
        self._gw = gateway
        self._server = server
        self._proxy = proxy
        self._discovery: asyncio.Task[frozenset[str]] | None = None

    @property
    def unary_methods(self) -> frozenset[str]:
        return self._proxy.unary

    async def refresh_unary(self, timeout: float = DISCOVERY_TIMEOUT_S) -> frozenset[str]:
        """Recompute the unary set: the policy's `unary_methods` at once, then ∪ what server
        reflection of each `discover_unary` backend lists (bounded by `timeout`, never raises)."""
        compiled = self._gw.active.policy
        self._proxy.set_unary(self._proxy.unary | compiled.unary_methods)
        found = await asyncio.gather(
            *(self._gw.channels.discover_unary(e, timeout) for e in _discoverable(compiled))
        )
        # The policy may have been swapped while we waited: recompute from the current one.
        methods = self._gw.active.policy.unary_methods.union(*found)
        self._proxy.set_unary(methods)
        return methods

    def start_discovery(self) -> None:
        """Refresh the unary set in the background (serving goes on with stream-stream)."""
        if self._discovery is not None and not self._discovery.done():
            self._discovery.cancel()
        self._discovery = asyncio.get_running_loop().create_task(self.refresh_unary())

    async def stop(self, grace: float) -> None:
        """Refuse new RPCs now, let in-flight ones (streams too) run up to `grace`, then cancel."""
        if self._discovery is not None and not self._discovery.done():
            self._discovery.cancel()
            await asyncio.gather(self._discovery, return_exceptions=True)
        await self._server.stop(grace)


def _discoverable(compiled: CompiledPolicy) -> list[Endpoint]:
    seen: dict[str, Endpoint] = {}
    for route in compiled.routes:
        for e in route.endpoints:
            b = compiled.backends.get(e.backend)
            if b is not None and b.protocol == "grpc" and b.discover_unary:
                seen.setdefault(e.address, e)
    return list(seen.values())
