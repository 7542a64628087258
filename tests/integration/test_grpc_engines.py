"""The gRPC listener on both engines (`listeners.grpc.engine`: grpcio, h2), each in a gateway
process in front of the simulated backend, with grpcio clients: the four call kinds, metadata
and trailers (binary ones too), statuses passed through, deadlines, a client cancel reaching the
backend, messages near and over the size limit, a rate-limit refusal and an auth refusal."""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
import h2.config
import h2.connection
import h2.errors
import pytest

from gateway.proto import load
from tests.integration.conftest import Backend, wait_ready
from tests.integration.h2_support import exchange
from tests.support import Proc, free_port, until

pytestmark = pytest.mark.integration

pb2, pb2_grpc = load()
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]
SECRET_ENV = "SLUICE_TEST_GRPC_SECRET"
LIMIT = 65536  # limits.grpc_max_message_bytes


def policy_text(
    backend: Backend, engine: str, grpc_port: int, admin: int, limits: str = "", tls: str = ""
) -> str:
    return f"""\
version: 1
listeners:
  http: null
  grpc: {{host: 127.0.0.1, port: {grpc_port}, engine: {engine}{tls}}}
  admin: {{host: 127.0.0.1, port: {admin}}}
limits: {{grpc_max_message_bytes: {LIMIT}{limits}}}
timeouts: {{first_byte_s: 5, drain_s: 10}}
auth:
  providers:
    - name: internal
      issuer: internal
      audiences: [sluice]
      algorithms: [HS256]
      secret: {{env: {SECRET_ENV}}}
rate_limits:
  rules:
    - name: per-tenant
      key: ["header:x-rl-tenant"]
      qps: 50
backends:
  - name: sim-grpc
    protocol: grpc
    endpoints: [{{address: "127.0.0.1:{backend.grpc_port}"}}]
    unary_methods: [/sluice.inference.v1.Inference/Infer]
routes:
  - name: secure
    match: {{protocol: grpc, path_prefix: /secure.v1.Secure/}}
    backend: sim-grpc
    auth: required
  - name: grpc
    match: {{protocol: grpc}}
    backend: sim-grpc
"""


@dataclass
class GrpcGateway:
    proc: Proc
    engine: str
    port: int
    admin: int

    def calls_recorded(self) -> float:
        """sluice_requests_total summed over the gRPC protocol."""
        return self.metric_sum("sluice_requests_total{")

    def metric_sum(self, prefix: str) -> float:
        """The samples of gRPC calls whose line starts with `prefix`, summed."""
        url = f"http://127.0.0.1:{self.admin}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(prefix) and 'protocol="grpc"' in line
        )


@pytest.fixture(scope="module", params=["grpcio", "h2"])
def gw(
    request: pytest.FixtureRequest, backend: Backend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GrpcGateway]:
    engine = str(request.param)
    tmp = tmp_path_factory.mktemp(f"grpc-{engine}")
    port, admin = free_port(), free_port()
    path = tmp / "policy.yaml"
    path.write_text(policy_text(backend, engine, port, admin))
    proc = Proc(["serve", "--policy", str(path)], tmp / "gateway.log", env={SECRET_ENV: "s" * 32})
    wait_ready(admin, proc)
    try:
        yield GrpcGateway(proc, engine, port, admin)
    finally:
        assert proc.stop() == 0, proc.output()


@pytest.fixture
async def stub(gw: GrpcGateway) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
        yield pb2_grpc.InferenceStub(ch)


async def test_four_call_kinds(stub: Any) -> None:
    reply = await stub.Infer(pb2.InferRequest(model="m", prompt="hi", max_tokens=3), timeout=5)
    assert reply.usage.completion_tokens == 3
    chunks = [c async for c in stub.Generate(pb2.InferRequest(prompt="x", max_tokens=4), timeout=5)]
    assert len(chunks) == 4 and chunks[-1].usage.total_tokens > 0

    async def prompts() -> AsyncIterator[Any]:
        for p in ("a", "b", "c"):
            yield pb2.InferRequest(prompt=p)

    assert "abc" in (await stub.Collect(prompts(), timeout=5)).text
    call = stub.Chat(timeout=5)
    for p in ("ping1", "ping2"):
        await call.write(pb2.InferRequest(prompt=p))
        assert p in (await asyncio.wait_for(call.read(), 5)).text  # one reply per request
    await call.done_writing()
    assert await call.read() is EOF
    assert await call.code() is grpc.StatusCode.OK


async def test_metadata_and_trailers_round_trip(stub: Any) -> None:
    md = (("x-echo-tenant", "t7"), ("x-echo-blob-bin", b"\x00\xff\x01"))
    call = stub.Infer(pb2.InferRequest(prompt="hi"), metadata=md, timeout=5)
    await call
    initial = dict(await call.initial_metadata())
    trailing = dict(await call.trailing_metadata())
    assert initial["x-echo-tenant"] == "t7" and initial["x-echo-blob-bin"] == b"\x00\xff\x01"
    assert trailing["x-echo-blob-bin"] == b"\x00\xff\x01"
    assert int(trailing["x-mock-usage-tokens"]) > 0
    stream = stub.Generate(pb2.InferRequest(prompt="x", max_tokens=2), metadata=md, timeout=5)
    assert len([c async for c in stream]) == 2
    assert dict(await stream.trailing_metadata())["x-echo-blob-bin"] == b"\x00\xff\x01"


def overhead_ms(md: Any) -> float:
    return float(dict(md or ())["x-sluice-overhead-ms"])


async def test_every_answer_carries_the_overhead_figure(stub: Any, gw: GrpcGateway) -> None:
    """x-sluice-overhead-ms in the initial metadata of the four call kinds (the upstream's time
    excluded), in the trailing metadata of trailers-only answers (an upstream failure, a
    refusal); sluice_overhead_seconds counts them all."""
    count = 'sluice_overhead_seconds_count{protocol="grpc",route="grpc"}'
    before = gw.metric_sum(count)
    slow = (("x-mock-sleep-ms", "400"),)
    t0 = time.monotonic()
    call = stub.Infer(pb2.InferRequest(prompt="hi"), metadata=slow, timeout=5)
    await call
    took = time.monotonic() - t0
    ms = overhead_ms(await call.initial_metadata())
    assert took >= 0.4 and 0.0 <= ms < 200.0, (took, ms)  # the backend's 400 ms are not Sluice's
    gen = stub.Generate(pb2.InferRequest(prompt="x", max_tokens=2), metadata=slow, timeout=5)
    assert len([c async for c in gen]) == 2
    assert 0.0 <= overhead_ms(await gen.initial_metadata()) < 200.0

    async def prompts() -> AsyncIterator[Any]:
        for p in ("a", "b"):
            yield pb2.InferRequest(prompt=p)

    collect = stub.Collect(prompts(), timeout=5)
    assert "ab" in (await collect).text
    overhead_ms(await collect.initial_metadata())
    chat = stub.Chat(timeout=5)
    await chat.write(pb2.InferRequest(prompt="ping"))
    assert "ping" in (await asyncio.wait_for(chat.read(), 5)).text
    await chat.done_writing()
    assert await chat.read() is EOF
    overhead_ms(await chat.initial_metadata())
    failing = stub.Infer(pb2.InferRequest(prompt="x"), metadata=(("x-mock-status", "9"),))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await failing
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    overhead_ms(e.value.trailing_metadata())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ch.unary_unary("/secure.v1.Secure/Do")(b"", timeout=5)
    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
    overhead_ms(e.value.trailing_metadata())
    assert gw.metric_sum(count) == before + 5  # the refusal is route "secure"'s


async def test_upstream_status_passes_through(stub: Any) -> None:
    for method in ("Infer", "Generate"):
        call = getattr(stub, method)(
            pb2.InferRequest(prompt="x"),
            metadata=(("x-mock-status", "9"), ("x-echo-why", "because")),
            timeout=5,
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            if method == "Infer":
                await call
            else:
                _ = [c async for c in call]
        assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details() == "mock failure"
        assert dict(e.value.trailing_metadata() or ())["x-echo-why"] == "because"


async def test_deadline_exceeded(stub: Any) -> None:
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Infer(
            pb2.InferRequest(prompt="x"), metadata=(("x-mock-sleep-ms", "3000"),), timeout=0.3
        )
    assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 1.5


async def test_client_cancel_reaches_the_backend(stub: Any, backend: Backend) -> None:
    await until(lambda: backend.stats()["in_flight"], 5, ok=lambda n: n == 0)
    before = int(backend.stats()["cancelled"])
    call = stub.Generate(pb2.InferRequest(prompt="x", max_tokens=200), timeout=30)
    await asyncio.wait_for(call.read(), 5)
    call.cancel()
    await until(lambda: int(backend.stats()["cancelled"]), 3, ok=lambda n: n > before)
    assert int(backend.stats()["cancelled"]) == before + 1


async def test_messages_near_and_over_the_limit(stub: Any) -> None:
    near = LIMIT - 64  # the prompt's protobuf framing takes a few bytes
    reply = await stub.Infer(pb2.InferRequest(prompt="a" * near, max_tokens=1), timeout=5)
    assert reply.usage.completion_tokens == 1
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Infer(pb2.InferRequest(prompt="a" * (LIMIT + 10)), timeout=5)
    assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED

    async def big() -> AsyncIterator[Any]:
        yield pb2.InferRequest(prompt="small")
        yield pb2.InferRequest(prompt="a" * (4 * LIMIT))

    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Collect(big(), timeout=5)
    assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    # The connection serves on.
    assert (await stub.Infer(pb2.InferRequest(prompt="ok"), timeout=5)).usage.total_tokens > 0


async def test_rate_limit_refusal_is_resource_exhausted_with_retry_after(stub: Any) -> None:
    md = (("x-rl-tenant", f"burst-{time.monotonic_ns()}"),)
    calls = [stub.Infer(pb2.InferRequest(prompt="x"), metadata=md, timeout=10) for _ in range(80)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert refused and len(refused) < 80
    for e in refused:
        assert e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, e
        assert "retry-after" in dict(e.trailing_metadata() or ())


async def test_auth_required_is_unauthenticated(gw: GrpcGateway) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
        call = ch.unary_unary("/secure.v1.Secure/Do")(b"", timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED


async def open_and_drop(port: int, cancel: bool) -> None:
    """One connection, one unary call's HEADERS (no request message), then RST_STREAM or a
    closed socket."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    path = "/sluice.inference.v1.Inference/Infer"
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", "t"), (":path", path),
               ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip
    conn.send_headers(1, headers)
    writer.write(conn.data_to_send())
    await asyncio.wait_for(writer.drain(), 5)
    await asyncio.sleep(0.05)
    if cancel:
        conn.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
        writer.write(conn.data_to_send())
        await asyncio.wait_for(writer.drain(), 5)
        await asyncio.sleep(0.02)
    writer.close()
    await asyncio.wait_for(writer.wait_closed(), 5)


@pytest.mark.parametrize("gw", ["h2"], indirect=True)
async def test_a_connection_storm_is_accounted_call_by_call(gw: GrpcGateway) -> None:
    """Calls a client resets or abandons before their request message came: grpc.aio ends
    them before Sluice's handler (counted apart, grpcio's own test in test_hardening.py); on
    the h2 engine every one of them is a recorded call."""
    assert gw.engine == "h2"
    before = gw.calls_recorded()
    n = 200
    storm = [open_and_drop(gw.port, cancel=i % 2 == 0) for i in range(n)]
    for i in range(0, n, 50):
        await asyncio.gather(*storm[i : i + 50])
    await until(lambda: gw.calls_recorded() - before, ok=lambda k: k >= n, interval=0.2)
    assert gw.calls_recorded() - before == n


@pytest.mark.parametrize("gw", ["h2"], indirect=True)
def test_the_overhead_figure_stays_out_of_the_hpack_table(gw: GrpcGateway) -> None:
    """Calls on one HTTP/2 connection: each answer's overhead figure is new, so the h2 engine
    sends it as a literal never indexed; in the dynamic table it would push out the fields that
    repeat (and hpack's encoder searches that table for every field it sends)."""
    assert gw.engine == "h2"
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=5)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    message = pb2.InferRequest(model="m", prompt="hi", max_tokens=1).SerializeToString()
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", "t"),
               (":path", "/sluice.inference.v1.Inference/Infer"),
               ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    figures: list[bytes] = []
    for sid in range(1, 30, 2):
        initial, trailing = exchange(sock, conn, sid, headers, body)
        assert trailing[b"grpc-status"] == b"0"
        figures.append(initial[b"x-sluice-overhead-ms"])
    sock.close()
    assert len(figures) == 15 and all(float(f) >= 0 for f in figures)
    table = {n for n, _ in conn.decoder.header_table.dynamic_entries}
    assert b"content-type" in table  # the table is in use
    assert b"x-sluice-overhead-ms" not in table
