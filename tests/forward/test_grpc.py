"""The gRPC call lifecycle through its engine seam alone: an in-memory `GrpcExchange` (no ingress
server) in front of a real grpc.aio upstream, as any gRPC engine would drive it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from gateway.app import Gateway
from gateway.core.request import RequestInfo
from gateway.forward.grpc import GrpcForward
from gateway.forward.grpc_exchange import Metadata, request_info
from tests.adapters.test_grpc import INFER, SERVICE, pb2, upstream_server, write_policy

CHAT = f"/{SERVICE}/Chat"


@dataclass
class FakeExchange:
    """What an engine would hand the lifecycle; records what the lifecycle sends back."""

    info: RequestInfo
    metadata: Metadata
    requests: list[bytes] = field(default_factory=list)
    deadline: float | None = None
    initial: Metadata = ()
    written: list[bytes] = field(default_factory=list)
    ends: list[tuple[int, str, tuple[tuple[str, str | bytes], ...]]] = field(default_factory=list)

    def time_remaining(self) -> float | None:
        return self.deadline

    async def read(self) -> bytes | None:
        return self.requests.pop(0) if self.requests else None

    async def send_initial_metadata(self, md: Metadata) -> None:
        self.initial = md

    async def write(self, message: bytes) -> None:
        self.written.append(message)

    def end(self, code: int, details: str, trailing: Metadata) -> None:
        self.ends.append((code, details, tuple(trailing)))


async def booked() -> None:
    """One turn of the loop: a finished call is booked (and leaves the in-flight count) in the
    turn after it ends (`gateway.forward.lifecycle`)."""
    await asyncio.sleep(0)


def exchange(method: str, md: Metadata = (), requests: list[bytes] | None = None) -> FakeExchange:
    return FakeExchange(request_info(method, md, "ipv4:127.0.0.1:1"), md, requests or [])


@contextlib.asynccontextmanager
async def forwarder(tmp_path: Path, port: int) -> AsyncIterator[tuple[Gateway, GrpcForward]]:
    gw = Gateway(write_policy(tmp_path, port))
    try:
        yield gw, GrpcForward(gw, asyncio.get_running_loop())
    finally:
        await gw.aclose()


async def test_unary_call_through_the_seam(tmp_path: Path) -> None:
    async with upstream_server() as (servicer, port), forwarder(tmp_path, port) as (gw, fw):
        ex = exchange(INFER, (("x-tenant", "acme"), ("x-blob-bin", b"\x00")))
        request = pb2.InferRequest(model="m", prompt="hi").SerializeToString()
        await fw.serve(ex, request)
        assert [pb2.InferResponse.FromString(m).text for m in ex.written] == ["HI"]
        assert ("x-initial", "hello") in ex.initial
        [(code, details, trailing)] = ex.ends
        assert (code, details) == (0, "")
        assert ("x-trailing", "bye") in trailing and ("x-usage-bin", b"\x01\x02") in trailing
        assert servicer.seen.metadata["x-tenant"] == "acme"
        assert servicer.seen.metadata["x-blob-bin"] == b"\x00"
        await booked()
        assert gw.inflight.count == 0


async def test_streaming_call_through_the_seam(tmp_path: Path) -> None:
    async with upstream_server() as (_, port), forwarder(tmp_path, port) as (gw, fw):
        prompts = [pb2.InferRequest(prompt=p).SerializeToString() for p in ("a", "b")]
        ex = exchange(CHAT, requests=prompts)
        await fw.serve(ex, None)
        texts = [pb2.GenerateChunk.FromString(m).text for m in ex.written]
        assert texts == ["echo:a", "echo:b"]
        assert [e[0] for e in ex.ends] == [0]
        await booked()
        assert gw.inflight.count == 0


async def test_upstream_status_and_refusal_end_the_call_once(tmp_path: Path) -> None:
    async with upstream_server() as (_, port), forwarder(tmp_path, port) as (gw, fw):
        failing = exchange(INFER)
        await fw.serve(failing, pb2.InferRequest(prompt="fail").SerializeToString())
        assert failing.written == []
        [(code, details, trailing)] = failing.ends  # NOT_FOUND, the figure in its trailers
        assert (code, details, trailing[0]) == (5, "no such model", ("x-why", "gone"))
        assert trailing[1][0] == "x-sluice-overhead-ms" and float(trailing[1][1]) >= 0.0
        unrouted = exchange("/other.Service/Method")
        await fw.serve(unrouted, None)
        assert unrouted.written == [] and len(unrouted.ends) == 1
        assert unrouted.ends[0][0] == 12  # UNIMPLEMENTED: no route
        await booked()
        assert gw.inflight.count == 0
