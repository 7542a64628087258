"""Hardening, against a live gateway: a huge upstream gRPC status message, slowloris on a reused
keep-alive connection."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import grpc
import pytest

from gateway.proto import load
from tests.integration.conftest import Backend, Gateway, start_gateway

pytestmark = pytest.mark.integration

pb2, pb2_grpc = load()

HEADER_READ_S = 1.5
TIMEOUTS = f"header_read_s: {HEADER_READ_S}\n  keepalive_s: 75\n  first_byte_s: 5\n  drain_s: 10"
INFER = "/sluice.inference.v1.Inference/Infer"


@pytest.fixture(scope="module")
def gateways(
    backend: Backend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Gateway]]:
    started: dict[str, Gateway] = {}
    try:
        for engine in ("aiohttp", "native"):
            tmp = tmp_path_factory.mktemp(f"hardening-{engine}")
            started[engine] = start_gateway(backend, tmp, engine=engine, timeouts=TIMEOUTS)
        yield started
    finally:
        for gw in started.values():
            assert gw.proc.stop() == 0, gw.proc.output()


# -- item 10: a 100 KB grpc-message from the backend ------------------------------------------


@pytest.mark.parametrize("method", ["Infer", "Generate"])
async def test_huge_upstream_status_message_reaches_the_client_trimmed(
    gateways: dict[str, Gateway], method: str
) -> None:
    md = (("x-mock-status", "13"), ("x-mock-details-bytes", "100000"))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateways['aiohttp'].grpc_port}") as ch:
        stub = pb2_grpc.InferenceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            if method == "Infer":
                await stub.Infer(pb2.InferRequest(prompt="x"), metadata=md, timeout=10)
            else:
                async for _ in stub.Generate(pb2.InferRequest(prompt="x"), metadata=md, timeout=10):
                    pass
    assert e.value.code() == grpc.StatusCode.INTERNAL, e.value  # the backend's code
    details = e.value.details() or ""
    assert len(details) == 4096 and details.startswith("mock failure x")


# -- item 8: slowloris on a reused keep-alive connection --------------------------------------


def _slowloris_after_one_request(port: int) -> float:
    """One complete request on a keep-alive connection, then the next head one byte every
    0.5 s; returns how long the connection stayed open after the second head began."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
        got = b""
        while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200"), got
        head = b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 100
        t0 = time.monotonic()
        s.settimeout(0.5)
        for byte in head:
            try:
                s.sendall(bytes([byte]))
                if s.recv(1) == b"":
                    return time.monotonic() - t0  # closed by the gateway
            except TimeoutError:
                continue
            except OSError:
                return time.monotonic() - t0
        return time.monotonic() - t0


@pytest.mark.parametrize("engine", ["aiohttp", "native"])
async def test_slowloris_on_a_reused_connection_is_cut_at_header_read_s(
    gateways: dict[str, Gateway], engine: str
) -> None:
    held = await asyncio.to_thread(_slowloris_after_one_request, gateways[engine].http_port)
    # header_read_s (1.5 s) plus the drip interval and scheduling slack; keepalive_s is 75 s
    assert held < HEADER_READ_S + 3, held
