"""The generic gRPC proxy, end to end on real sockets: a grpc.aio upstream in this test, the
gateway's listener on port 0, and generated stubs as the client. No mocks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_reflection.v1alpha import reflection

from gateway.adapters.engines import GrpcListener, start_grpc
from gateway.adapters.grpcio import server_options
from gateway.app import Gateway
from gateway.policy.model import Limits
from gateway.proto import load
from tests.support import free_port, until

pb2, pb2_grpc = load()
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]

SERVICE = "sluice.inference.v1.Inference"
INFER = f"/{SERVICE}/Infer"
GENERATE = f"/{SERVICE}/Generate"


@dataclass
class Seen:
    """What the upstream observed, for the tests to assert on."""

    metadata: dict[str, str | bytes] = field(default_factory=dict)
    time_remaining: float | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)


class Upstream(pb2_grpc.InferenceServicer):  # type: ignore[misc,name-defined]
    """A small test backend; the prompt selects the behaviour."""

    def __init__(self) -> None:
        self.seen = Seen()

    async def _cancellable(self, aw: Awaitable[Any]) -> None:
        try:
            await aw
        except asyncio.CancelledError:
            self.seen.cancelled.set()
            raise

    async def Infer(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        self.seen.metadata = dict(context.invocation_metadata() or ())
        self.seen.time_remaining = context.time_remaining()
        if request.prompt == "fail":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such model", (("x-why", "gone"),))
        if request.prompt == "sleep":
            await self._cancellable(asyncio.sleep(2))
        if request.prompt == "verbose":
            await context.abort(grpc.StatusCode.INTERNAL, "why " * 1500)  # 6000 characters
        await context.send_initial_metadata((("x-initial", "hello"),))
        context.set_trailing_metadata((("x-trailing", "bye"), ("x-usage-bin", b"\x01\x02")))
        return pb2.InferResponse(model=request.model, text=request.prompt.upper())

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        self.seen.metadata = dict(context.invocation_metadata() or ())
        yield pb2.GenerateChunk(text="first", index=0)
        if request.prompt == "verbose":
            await context.abort(grpc.StatusCode.INTERNAL, "why " * 1500)
        if request.prompt == "hang":
            await self._cancellable(asyncio.sleep(30))
        if request.prompt == "gated":
            await self.seen.release.wait()  # the test opens it once the first chunk is in hand
        for i in range(1, request.max_tokens):
            if request.prompt == "slow":
                await asyncio.sleep(0.05)
            yield pb2.GenerateChunk(text=f"t{i}", index=i)

    async def Collect(self, request_iterator: Any, context: Any) -> Any:
        prompts = [r.prompt async for r in request_iterator]
        return pb2.InferResponse(text="+".join(prompts))

    async def Chat(self, request_iterator: Any, context: Any) -> Any:
        async for r in request_iterator:
            yield pb2.GenerateChunk(text=f"echo:{r.prompt}")


def pairs(metadata: Any) -> list[tuple[str, str | bytes]]:
    return [(k, v) for k, v in metadata]


async def read_rest(call: Any) -> list[str]:
    texts = []
    while (msg := await call.read()) is not EOF:
        texts.append(msg.text)
    return texts


@contextlib.asynccontextmanager
async def upstream_server(with_reflection: bool = True) -> AsyncIterator[tuple[Upstream, int]]:
    servicer = Upstream()
    server = grpc.aio.server()
    pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    if with_reflection:
        reflection.enable_server_reflection((SERVICE, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, port
    finally:
        await server.stop(None)


def write_policy(
    tmp_path: Path,
    upstream_port: int,
    *,
    unary: list[str] | None = None,
    discover: bool = False,
    weight: int = 1,
    max_message: int | None = None,
) -> Path:
    limits = f"limits: {{grpc_max_message_bytes: {max_message}}}\n" if max_message else ""
    path = tmp_path / "policy.yaml"
    path.write_text(
        f"""
listeners: {{http: null, grpc: null, admin: null}}
access_log: {{enabled: false}}
{limits}
backends:
  - name: infer
    protocol: grpc
    endpoints: [{{address: "127.0.0.1:{upstream_port}", weight: {weight}}}]
    unary_methods: {unary or []}
    discover_unary: {str(discover).lower()}
routes:
  - name: inference
    match: {{protocol: grpc, path_prefix: /{SERVICE}/}}
    backend: infer
"""
    )
    return path


@contextlib.asynccontextmanager
async def proxied(
    policy: Path, engine: str = "grpcio"
) -> AsyncIterator[tuple[Gateway, GrpcListener, grpc.aio.Channel]]:
    gateway = Gateway(policy)
    listener = await start_grpc(gateway, "127.0.0.1", 0, engine)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{listener.port}")
    try:
        yield gateway, listener, channel
    finally:
        await channel.close(None)
        await listener.stop(0)
        await gateway.aclose()


Setup = Callable[..., contextlib.AbstractAsyncContextManager[tuple[Upstream, Any, GrpcListener]]]


@pytest.fixture(params=["unary-handler", "stream-handler"])
async def proxy(
    request: pytest.FixtureRequest, tmp_path: Path, grpc_engine: str
) -> AsyncIterator[Any]:
    """The gateway in front of the test upstream; Infer served by either handler kind."""
    unary = [INFER] if request.param == "unary-handler" else []
    async with contextlib.AsyncExitStack() as stack:
        servicer, port = await stack.enter_async_context(upstream_server())
        policy = write_policy(tmp_path, port, unary=unary)
        _, listener, ch = await stack.enter_async_context(proxied(policy, grpc_engine))
        assert (INFER in listener.unary_methods) is bool(unary)
        yield servicer, pb2_grpc.InferenceStub(ch), listener


async def test_unary_round_trip_with_metadata(proxy: Any) -> None:
    servicer, stub, _ = proxy
    call = stub.Infer(
        pb2.InferRequest(model="m", prompt="hi"),
        metadata=(("x-tenant", "acme"), ("x-blob-bin", b"\x00\xff"), ("x-request-id", "rid-1")),
    )
    response = await call
    assert response.text == "HI"
    assert await call.code() is grpc.StatusCode.OK
    assert ("x-initial", "hello") in pairs(await call.initial_metadata())
    trailing = pairs(await call.trailing_metadata())
    assert ("x-trailing", "bye") in trailing
    assert ("x-usage-bin", b"\x01\x02") in trailing
    seen = servicer.seen.metadata
    assert seen["x-tenant"] == "acme"
    assert seen["x-blob-bin"] == b"\x00\xff"
    assert seen["x-request-id"] == "rid-1"  # kept: well formed, and forwarded once


async def test_request_id_is_added_when_missing(proxy: Any) -> None:
    servicer, stub, _ = proxy
    await stub.Infer(pb2.InferRequest(prompt="x"))
    assert len(servicer.seen.metadata["x-request-id"]) == 32


async def test_upstream_status_details_and_trailers_pass_through(proxy: Any) -> None:
    _, stub, _ = proxy
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Infer(pb2.InferRequest(prompt="fail"))
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert err.value.details() == "no such model"
    assert ("x-why", "gone") in pairs(err.value.trailing_metadata())


async def test_long_upstream_details_are_truncated(proxy: Any) -> None:
    _, stub, _ = proxy
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Infer(pb2.InferRequest(prompt="verbose"))
    assert err.value.code() is grpc.StatusCode.INTERNAL
    assert err.value.details() == ("why " * 1500)[:4096]
    with pytest.raises(grpc.aio.AioRpcError) as err:  # the streaming handler caps them too
        _ = [c async for c in stub.Generate(pb2.InferRequest(prompt="verbose", max_tokens=2))]
    assert err.value.code() is grpc.StatusCode.INTERNAL
    assert err.value.details() == ("why " * 1500)[:4096]


async def test_deadline_is_forwarded_and_upstream_cancelled(proxy: Any) -> None:
    servicer, stub, _ = proxy
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Infer(pb2.InferRequest(prompt="sleep"), timeout=0.2)
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert servicer.seen.time_remaining is not None
    # Forwarded (not the route's 600 s); grpc-timeout is rounded up on the wire, hence the slack.
    assert 0 < servicer.seen.time_remaining <= 0.21
    await asyncio.wait_for(servicer.seen.cancelled.wait(), 1.0)


async def test_server_streaming_forwards_each_message_as_it_comes(proxy: Any) -> None:
    servicer, stub, _ = proxy
    call = stub.Generate(pb2.InferRequest(prompt="gated", max_tokens=4))
    first = await asyncio.wait_for(call.read(), 2.0)
    assert first.text == "first"  # arrived while the upstream still waits on `release`
    servicer.seen.release.set()
    rest = await read_rest(call)
    assert rest == ["t1", "t2", "t3"]
    assert await call.code() is grpc.StatusCode.OK


async def test_client_streaming(proxy: Any) -> None:
    _, stub, _ = proxy

    async def prompts() -> AsyncIterator[Any]:
        for p in ("a", "b", "c"):
            yield pb2.InferRequest(prompt=p)

    response = await stub.Collect(prompts())
    assert response.text == "a+b+c"


async def test_bidi_ping_pong(proxy: Any) -> None:
    _, stub, _ = proxy
    call = stub.Chat()
    for i in range(5):
        # Each answer must come back before the next request is sent: streaming both ways.
        await call.write(pb2.InferRequest(prompt=f"p{i}"))
        reply = await asyncio.wait_for(call.read(), 2.0)
        assert reply.text == f"echo:p{i}"
    await call.done_writing()
    assert await call.read() is EOF
    assert await call.code() is grpc.StatusCode.OK


async def test_client_cancel_cancels_upstream(proxy: Any) -> None:
    servicer, stub, _ = proxy
    call = stub.Generate(pb2.InferRequest(prompt="hang", max_tokens=2))
    assert (await call.read()).text == "first"
    call.cancel()
    await asyncio.wait_for(servicer.seen.cancelled.wait(), 1.0)


async def test_no_route_is_unimplemented(proxy: Any) -> None:
    _, _, listener = proxy
    async with grpc.aio.insecure_channel(f"127.0.0.1:{listener.port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ch.unary_unary("/other.v1.Other/Do", None, None)(b"")
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED


async def test_backend_down_is_unavailable(tmp_path: Path, grpc_engine: str) -> None:
    async with proxied(write_policy(tmp_path, free_port(), unary=[INFER]), grpc_engine) as (
        _,
        _,
        ch,
    ):
        stub = pb2_grpc.InferenceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Infer(pb2.InferRequest(prompt="x"), timeout=5)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        stream = stub.Generate(pb2.InferRequest(prompt="x"), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.read()
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_no_endpoint_is_unavailable_with_retry_after(
    tmp_path: Path, grpc_engine: str
) -> None:
    async with upstream_server() as (_, port):
        policy = write_policy(tmp_path, port, weight=0)
        async with proxied(policy, grpc_engine) as (_, _, ch):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb2_grpc.InferenceStub(ch).Infer(pb2.InferRequest(prompt="x"))
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert ("retry-after", "1") in pairs(err.value.trailing_metadata())


async def test_message_over_limit_is_resource_exhausted(tmp_path: Path, grpc_engine: str) -> None:
    async with upstream_server() as (_, port):
        policy = write_policy(tmp_path, port, unary=[INFER], max_message=1024)
        async with proxied(policy, grpc_engine) as (_, _, ch):
            stub = pb2_grpc.InferenceStub(ch)
            assert (await stub.Infer(pb2.InferRequest(prompt="a" * 100))).text == "A" * 100
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Infer(pb2.InferRequest(prompt="a" * 2000))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_unary_methods_are_discovered_through_reflection(
    tmp_path: Path, grpc_engine: str
) -> None:
    async with upstream_server() as (_, port):
        policy = write_policy(tmp_path, port, discover=True)
        async with proxied(policy, grpc_engine) as (_, listener, ch):
            methods = await listener.refresh_unary()
            assert INFER in methods
            assert GENERATE not in methods
            assert listener.unary_methods == methods
            response = await pb2_grpc.InferenceStub(ch).Infer(pb2.InferRequest(prompt="u"))
            assert response.text == "U"


async def test_stop_lets_an_inflight_stream_finish(tmp_path: Path, grpc_engine: str) -> None:
    async with upstream_server() as (_, port):
        policy = write_policy(tmp_path, port)
        async with proxied(policy, grpc_engine) as (gateway, listener, ch):
            stub = pb2_grpc.InferenceStub(ch)
            call = stub.Generate(pb2.InferRequest(prompt="slow", max_tokens=8))
            assert (await call.read()).text == "first"
            assert gateway.inflight.count == 1
            stopping = asyncio.create_task(listener.stop(5.0))
            texts = await read_rest(call)
            assert texts == [f"t{i}" for i in range(1, 8)]
            assert await call.code() is grpc.StatusCode.OK
            await stopping
            assert gateway.inflight.count == 0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Infer(pb2.InferRequest(prompt="late"), timeout=2)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_refresh_unary_follows_a_reload(tmp_path: Path, grpc_engine: str) -> None:
    async with upstream_server() as (_, port):
        policy = write_policy(tmp_path, port)
        async with proxied(policy, grpc_engine) as (gateway, listener, ch):
            assert await listener.refresh_unary() == frozenset()
            write_policy(tmp_path, port, unary=[INFER])
            assert gateway.holder.reload().changed
            assert await listener.refresh_unary() == {INFER}
            response = await pb2_grpc.InferenceStub(ch).Infer(pb2.InferRequest(prompt="r"))
            assert response.text == "R"


def test_server_options_follow_limits() -> None:
    limits = Limits(
        grpc_max_message_bytes=2048,
        grpc_max_concurrent_streams=7,
        grpc_max_metadata_bytes=4096,
        grpc_keepalive_min_ping_interval_s=30,
    )
    opts = dict(server_options(limits))
    assert opts["grpc.max_receive_message_length"] == 2048
    assert opts["grpc.max_send_message_length"] == 2048
    assert opts["grpc.max_concurrent_streams"] == 7
    assert opts["grpc.max_metadata_size"] == 4096
    assert opts["grpc.http2.min_ping_interval_without_data_ms"] == 30_000
    assert opts["grpc.so_reuseport"] == 1
    assert "grpc.minimal_stack" not in opts  # it would stop enforcing the message size


async def test_compressed_calls_pass_through(proxy: Any) -> None:
    """A client that compresses its messages (grpc-encoding gzip) is served by both engines."""
    _, stub, _ = proxy
    response = await stub.Infer(
        pb2.InferRequest(prompt="z" * 5000), compression=grpc.Compression.Gzip, timeout=5
    )
    assert response.text == "Z" * 5000

    async def prompts() -> AsyncIterator[Any]:
        for p in ("a" * 3000, "b"):
            yield pb2.InferRequest(prompt=p)

    collected = await stub.Collect(prompts(), compression=grpc.Compression.Deflate, timeout=5)
    assert collected.text == "a" * 3000 + "+b"


def _requests(code: str) -> float:
    from gateway.telemetry.metrics import REQUESTS, flush

    flush()  # the request path adds to tallies; a scrape moves them into the children

    return sum(
        s.value
        for m in REQUESTS.collect()
        for s in m.samples
        if s.name.endswith("_total")
        and s.labels.get("code") == code
        and s.labels.get("protocol") == "grpc"
    )


async def test_calls_refused_before_the_lifecycle_are_counted(
    tmp_path: Path, grpc_engine: str
) -> None:
    """A unary call whose message is over the limit never reaches the chain; the h2 engine still
    records it (sluice_requests_total), as it does a call the client resets before it ran, and
    a streaming call refused for a message is recorded with its code (not as a cancel)."""
    async with upstream_server() as (_, port):
        policy = write_policy(tmp_path, port, unary=[INFER], max_message=1024)
        async with proxied(policy, grpc_engine) as (gateway, _, ch):
            before = _requests("8")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb2_grpc.InferenceStub(ch).Infer(pb2.InferRequest(prompt="a" * 2000))
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED

            async def prompts() -> AsyncIterator[Any]:  # a streaming call: the lifecycle has it
                yield pb2.InferRequest(prompt="small")
                yield pb2.InferRequest(prompt="a" * 2000)

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb2_grpc.InferenceStub(ch).Collect(prompts(), timeout=5)
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            await asyncio.sleep(0.05)
            assert gateway.inflight.count == 0
            if grpc_engine == "h2":  # grpcio: grpc core refuses both before Sluice's handler
                assert _requests("8") == before + 2


async def test_h2_engine_drains_with_two_goaways(tmp_path: Path) -> None:
    """Stopping the h2 engine's listener: GOAWAY(2^31-1) at once, then GOAWAY naming the last
    stream taken (RFC 9113 §6.8); the call in flight is still served to its end."""
    from hpack import Encoder
    from hyperframe.frame import DataFrame, Frame, GoAwayFrame, HeadersFrame, SettingsFrame

    def frame(f: Frame, flags: set[str], **attrs: Any) -> bytes:
        for k, v in attrs.items():
            setattr(f, k, v)
        f.flags = flags  # type: ignore[assignment]
        return f.serialize()

    msg = pb2.InferRequest(prompt="late").SerializeToString()
    block = Encoder().encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":authority", "t"),
            (":path", f"/{SERVICE}/Collect"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]  # fmt: skip
    )
    async with upstream_server() as (_, port):
        gateway = Gateway(write_policy(tmp_path, port))
        listener = await start_grpc(gateway, "127.0.0.1", 0, "h2")
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        writer.write(
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
            + SettingsFrame(0).serialize()
            + frame(HeadersFrame(1), {"END_HEADERS"}, data=block)
            + frame(DataFrame(1), set(), data=b"\x00" + len(msg).to_bytes(4) + msg)
        )
        await until(lambda: gateway.inflight.count, ok=lambda n: n == 1, interval=0.01,
                    what="the call under way")  # fmt: skip
        stopping = asyncio.create_task(listener.stop(5.0))
        goaways: list[int] = []
        ended = False
        buf = b""
        try:
            async with asyncio.timeout(5):
                while True:  # until the listener closes the connection
                    data = await reader.read(65536)
                    if not data:
                        break
                    buf += data
                    while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3]):
                        f, n = Frame.parse_frame_header(memoryview(buf[:9]))
                        f.parse_body(memoryview(buf[9 : 9 + n]))
                        buf = buf[9 + n :]
                        if isinstance(f, GoAwayFrame):
                            goaways.append(f.last_stream_id)
                            if len(goaways) == 1:  # half-close: the call can finish
                                writer.write(frame(DataFrame(1), {"END_STREAM"}, data=b""))
                        elif f.stream_id == 1 and "END_STREAM" in f.flags:
                            ended = True
        finally:
            writer.close()
            await stopping
            await gateway.aclose()
    assert goaways[0] == 2**31 - 1 and goaways[-1] == 1, goaways
    assert ended
