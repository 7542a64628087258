"""gRPC relay under a client that does not read: the gateway must not buffer whole responses
(the upstream is held back by flow control) and a stream without downstream progress for
`idle_s` is cancelled both ways. The client is a raw HTTP/2 connection (the `h2` package) that
grants no stream window; the backend is a real grpc.aio server in this test."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import h2.config
import h2.connection
import h2.events
import h2.settings

from gateway.adapters.engines import start_grpc
from gateway.app import Gateway
from gateway.context import EventKind, RequestContext, Status, StreamEvent
from gateway.core.outcome import Outcome
from gateway.core.verdict import reject
from gateway.filters.chain import Chain
from gateway.filters.routing import RouteFilter
from gateway.snapshot import Snapshot

METHOD = "/t.Flow/Big"
MSG = 64 * 1024
COUNT = 30  # 30 × 64 KiB ≈ 1.9 MB per call


@dataclass
class Backend:
    written: dict[int, int] = field(default_factory=dict)  # call -> messages written so far
    cancelled: int = 0
    calls: int = 0


def _handler(backend: Backend) -> grpc.GenericRpcHandler:  # type: ignore[type-arg]
    async def big(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> Any:
        n = backend.calls
        backend.calls += 1
        backend.written[n] = 0
        try:
            for _ in range(COUNT):
                await context.write(b"x" * MSG)
                backend.written[n] += 1
        except BaseException:  # cancelled, or the write failed because the call was cancelled
            backend.cancelled += 1
            if context.cancelled():
                return
            raise

    async def hang(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        await asyncio.sleep(30)
        return b""

    async def echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        context.set_trailing_metadata((("x-usage-tokens", "5"),))
        return request

    class H(grpc.GenericRpcHandler):  # type: ignore[type-arg]
        def service(self, details: grpc.HandlerCallDetails) -> Any:
            if details.method == METHOD:
                return grpc.unary_stream_rpc_method_handler(big)
            if details.method == "/t.Flow/Hang":
                return grpc.unary_unary_rpc_method_handler(hang)
            if details.method == "/t.Flow/HangStream":
                return grpc.unary_stream_rpc_method_handler(hang)
            if details.method == "/t.Flow/Echo":
                return grpc.unary_unary_rpc_method_handler(echo)
            return None

    return H()


@contextlib.asynccontextmanager
async def backend_server() -> AsyncIterator[tuple[Backend, int]]:
    backend = Backend()
    server = grpc.aio.server(handlers=[_handler(backend)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield backend, port
    finally:
        await server.stop(0)


def _policy(tmp: Path, port: int, idle_s: float, first_byte_s: float = 30) -> Path:
    p = tmp / "policy.yaml"
    p.write_text(
        f"""
version: 1
listeners: {{http: null, grpc: null, admin: null}}
access_log: {{enabled: false}}
timeouts: {{idle_s: {idle_s}, first_byte_s: {first_byte_s}}}
backends:
  - name: b
    protocol: grpc
    discover_unary: false
    unary_methods: [/t.Flow/Hang, /t.Flow/Echo]
    endpoints: [{{address: "127.0.0.1:{port}"}}]
routes:
  - name: all
    match: {{protocol: grpc}}
    backend: b
"""
    )
    return p


class NonReadingClient:
    """An HTTP/2 client that opens gRPC calls and grants no stream flow-control window."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setblocking(False)
        cfg = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self.conn = h2.connection.H2Connection(cfg)
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        self.granting = False
        self.ended: set[int] = set()
        self.status: dict[int, str] = {}
        self.received = 0

    def start_reading(self, streams: set[int]) -> None:
        """From now on, grant window as data arrives (a client that reads again)."""
        self.granting = True
        for sid in streams:
            self.conn.increment_flow_control_window(1 << 20, stream_id=sid)

    def open_call(self) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(
            sid,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", METHOD),
                (":authority", "sluice"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ],
        )
        self.conn.send_data(sid, b"\x00\x00\x00\x00\x00", end_stream=True)  # one empty message
        return sid

    async def pump(self, seconds: float) -> None:
        """Send what h2 wants to send, read frames (never acknowledging stream data)."""
        loop = asyncio.get_running_loop()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            out = self.conn.data_to_send()
            if out:
                await loop.sock_sendall(self.sock, out)
            try:
                data = await asyncio.wait_for(loop.sock_recv(self.sock, 65536), 0.05)
            except TimeoutError:
                continue
            if not data:
                return
            for ev in self.conn.receive_data(data):
                if isinstance(ev, h2.events.DataReceived):
                    self.received += len(ev.data)
                    if self.granting:
                        self.conn.acknowledge_received_data(len(ev.data), ev.stream_id)
                elif isinstance(ev, h2.events.TrailersReceived):
                    self.status[ev.stream_id] = dict(ev.headers).get("grpc-status", "")
                elif isinstance(ev, h2.events.StreamEnded | h2.events.StreamReset):
                    self.ended.add(ev.stream_id)

    def close(self) -> None:
        self.sock.close()


async def test_non_reading_client_holds_the_upstream_back(tmp_path: Path, grpc_engine: str) -> None:
    async with backend_server() as (backend, port):
        gw = Gateway(_policy(tmp_path, port, idle_s=30))
        listener = await start_grpc(gw, "127.0.0.1", 0, grpc_engine)
        client = NonReadingClient(listener.port)
        try:
            streams = [client.open_call() for _ in range(20)]
            await client.pump(2.0)
            assert backend.calls == 20
            total = sum(backend.written.values())
            # Without backpressure every call finishes (20 × 30 messages). With it, each call is
            # held to what the HTTP/2 windows on both legs let through.
            assert total < 20 * COUNT / 3, backend.written
            assert not client.ended & set(streams)
            assert client.received == 0
        finally:
            client.close()
            await listener.stop(0)
            await gw.aclose()


async def test_stalled_stream_is_cancelled_both_ways_after_idle(
    tmp_path: Path, grpc_engine: str
) -> None:
    async with backend_server() as (backend, port):
        gw = Gateway(_policy(tmp_path, port, idle_s=0.5))
        listener = await start_grpc(gw, "127.0.0.1", 0, grpc_engine)
        client = NonReadingClient(listener.port)
        try:
            streams = {client.open_call() for _ in range(3)}
            t0 = time.monotonic()
            while backend.cancelled < 3 and time.monotonic() - t0 < 8:
                await client.pump(0.2)
            took = time.monotonic() - t0
            assert backend.cancelled == 3, backend.written  # the upstream calls: cancelled
            assert took < 5.0
            # HTTP/2 sends trailers after the DATA already queued: a client that reads again
            # gets at most that one message, then DEADLINE_EXCEEDED.
            client.start_reading(streams)
            await client.pump(1.0)
            assert streams <= client.ended
            assert {client.status.get(s) for s in streams} == {"4"}
            assert client.received <= 3 * 2 * (MSG + 5)
            await asyncio.sleep(0.1)
            assert gw.inflight.count == 0  # and the gateway is done with them
        finally:
            client.close()
            await listener.stop(0)
            await gw.aclose()


async def test_first_byte_timeout_applies_to_grpc(tmp_path: Path, grpc_engine: str) -> None:
    """A hanging backend and a client with no deadline: first_byte_s ends the call."""
    async with backend_server() as (_, port):
        gw = Gateway(_policy(tmp_path, port, idle_s=30, first_byte_s=0.3))
        listener = await start_grpc(gw, "127.0.0.1", 0, grpc_engine)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{listener.port}") as ch:
                for method, kind in (
                    ("/t.Flow/Hang", ch.unary_unary),
                    ("/t.Flow/HangStream", ch.unary_stream),
                ):
                    t0 = time.monotonic()
                    call = kind(method)(b"x")
                    try:
                        if method.endswith("Stream"):
                            async for _ in call:  # type: ignore[attr-defined]
                                pass
                        else:
                            await call
                        raise AssertionError("the call should have failed")
                    except grpc.aio.AioRpcError as e:
                        assert e.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                        assert "upstream first byte timeout" in (e.details() or "")
                    assert time.monotonic() - t0 < 3.0
        finally:
            await listener.stop(0)
            await gw.aclose()


class TrailerProbe:
    name = "probe"

    def __init__(self) -> None:
        self.trailers: list[tuple[tuple[str, str], ...]] = []
        self.outcomes: list[Outcome] = []

    def on_request(self, ctx: RequestContext) -> Status:
        if "x-reject" in ctx.info.headers:
            v = reject(401, 16, "unauthorized", "no", headers=(("www-authenticate", "Bearer"),))
            return ctx.stop(v)
        ctx.response_headers.append(("x-probe", "1"))
        return Status.CONTINUE

    def on_event(self, ctx: RequestContext, event: StreamEvent) -> Status:
        if event.kind is EventKind.TRAILERS:
            self.trailers.append(event.metadata)
            if "x-cut" in ctx.info.headers:
                return ctx.stop(reject(429, 8, "token_overrun", "token budget exceeded", 2.0))
        return Status.CONTINUE

    def on_response(self, ctx: RequestContext) -> None:
        self.outcomes.append(ctx.outcome)


async def test_grpc_verdict_headers_trailers_event_and_cut(
    tmp_path: Path, grpc_engine: str
) -> None:
    async with backend_server() as (_, port):
        gw = Gateway(_policy(tmp_path, port, idle_s=30))
        probe = TrailerProbe()
        compiled = gw.active.policy
        gw.holder.active = Snapshot(compiled, Chain([probe, RouteFilter(compiled)]))
        listener = await start_grpc(gw, "127.0.0.1", 0, grpc_engine)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{listener.port}") as ch:
                echo = ch.unary_unary("/t.Flow/Echo")
                call = echo(b"hi")
                assert await call == b"hi"
                trailing = dict(await call.trailing_metadata())
                assert trailing["x-usage-tokens"] == "5" and trailing["x-probe"] == "1"
                assert probe.trailers[-1] == (("x-usage-tokens", "5"),)

                call = echo(b"hi", metadata=(("x-reject", "1"),))
                try:
                    await call
                    raise AssertionError("rejected call answered")
                except grpc.aio.AioRpcError as e:
                    assert e.code() is grpc.StatusCode.UNAUTHENTICATED
                    assert ("www-authenticate", "Bearer") in tuple(e.trailing_metadata() or ())

                call = echo(b"hi", metadata=(("x-cut", "1"),))
                try:
                    await call
                    raise AssertionError("cut call answered")
                except grpc.aio.AioRpcError as e:
                    assert e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert ("retry-after", "2") in tuple(e.trailing_metadata() or ())
            assert probe.outcomes == [Outcome.OK, Outcome.REJECTED, Outcome.STREAM_CUT]
        finally:
            await listener.stop(0)
            await gw.aclose()
