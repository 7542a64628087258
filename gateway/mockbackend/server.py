"""Starts and stops the simulated backend in-process: one aiohttp listener (OpenAI API, health,
metrics), one grpc.aio listener and an optional loopback admin listener (knobs, stats, reset),
sharing one `MockState`. The handle owns all three. With `ServerTls` the HTTP and gRPC
listeners speak TLS (and require a client certificate signed by `client_ca` if given); the admin
listener stays plaintext on loopback."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

from gateway.mockbackend.admin import add_health_routes, build_admin_app
from gateway.mockbackend.families import add_family_routes
from gateway.mockbackend.http import MAX_BODY, STATE, chat_completions, completions, models
from gateway.mockbackend.http import echo_request_id as _echo_request_id
from gateway.mockbackend.knobs import Knobs, MockState, Stats
from gateway.mockbackend.tls import ServerTls
from gateway.policy.model import is_loopback

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 0.5  # streams in flight get this long at close, then are cancelled


def build_app(state: MockState) -> web.Application:
    """The whole HTTP listener: OpenAI and Anthropic routes, health and metrics (the admin API
    is apart)."""
    app = web.Application(client_max_size=MAX_BODY)
    app[STATE] = state
    app.on_response_prepare.append(_echo_request_id)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    add_family_routes(app)
    add_health_routes(app)
    return app


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' → (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


@dataclass(eq=False)
class MockBackendHandle:
    """A running simulated backend. Change `knobs` in place, or with `update_knobs` (validated,
    and it keeps grpc.health in step with the `healthy` knob). Close it exactly once."""

    state: MockState
    http_port: int | None
    grpc_port: int | None
    _runners: list[web.AppRunner]
    _grpc: object | None  # gateway.mockbackend.grpc.GrpcBackend, imported only when used
    admin_port: int | None = None

    @property
    def knobs(self) -> Knobs:
        return self.state.knobs

    @property
    def stats(self) -> Stats:
        return self.state.stats

    async def update_knobs(self, patch: Mapping[str, object]) -> Knobs:
        return await self.state.update(patch)

    async def close(self) -> None:
        """Stop both listeners at once; calls still running after the grace are cancelled."""
        from gateway.mockbackend.grpc import GrpcBackend

        grpc_backend, self._grpc = self._grpc, None
        runners, self._runners = self._runners, []
        stops = [runner.cleanup() for runner in runners]
        if isinstance(grpc_backend, GrpcBackend):
            stops.append(grpc_backend.stop(SHUTDOWN_GRACE_S))
        await asyncio.gather(*stops)


async def _listen(
    handle: MockBackendHandle,
    app: web.Application,
    address: str,
    tls: ssl.SSLContext | None = None,
) -> int:
    host, port = split_host_port(address)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client that leaves cancels its handler
        shutdown_timeout=SHUTDOWN_GRACE_S,
        access_log=None,
    )
    handle._runners.append(runner)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=tls).start()
    return int(runner.addresses[0][1])


async def start_mock_backend(
    http: str | None,
    grpc: str | None,
    knobs: Knobs | None = None,
    admin: str | None = None,
    tls: ServerTls | None = None,
) -> MockBackendHandle:
    """Listen on `http` and/or `grpc` (over TLS with `tls`), and on `admin` if given
    ('host:port', port 0 picks one; the admin host must be loopback, ValueError otherwise), and
    return the handle."""
    if http is None and grpc is None:
        raise ValueError("the mock backend needs an HTTP or a gRPC address")
    if admin is not None and not is_loopback(split_host_port(admin)[0]):
        raise ValueError(f"the mock backend's admin listener must be on loopback, not {admin!r}")
    state = MockState(knobs if knobs is not None else Knobs())
    handle = MockBackendHandle(state, None, None, [], None)
    try:
        if http is not None:
            ctx = tls.context() if tls is not None else None
            handle.http_port = await _listen(handle, build_app(state), http, ctx)
        if admin is not None:
            handle.admin_port = await _listen(handle, build_admin_app(state), admin)
        if grpc is not None:
            from gateway.mockbackend.grpc import GrpcBackend

            backend = GrpcBackend(state)
            handle._grpc = backend
            handle.grpc_port = await backend.start(grpc, tls)
    except BaseException:
        await handle.close()
        raise
    log.debug(
        "mock backend on http=%s grpc=%s admin=%s",
        handle.http_port,
        handle.grpc_port,
        handle.admin_port,
    )
    return handle
